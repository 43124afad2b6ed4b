"""benchmarks/gpu.py: every section runs (in its own process) at the smoke size and lands in
the tables; a section past its time budget is killed and recorded while the others run."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = os.path.join(_ROOT, "benchmarks", "gpu.py")
_spec = importlib.util.spec_from_file_location("benchmark_gpu", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
SECTIONS = [
  "peak",
  "flops",
  "step:1+1",
  "hf:1+1",
  "attention",
  "matcher",
  "retrieval:N=200",
  "compile:1+1",
]


def _run(tmp_path, *extra):
  argv = [sys.executable, _PATH, "--smoke", f"--out={tmp_path}", *extra]
  subprocess.run(argv, check=True, cwd=tmp_path, capture_output=True, timeout=1200)
  return json.loads((tmp_path / "gpu_smoke.json").read_text())


@pytest.mark.slow
def test_smoke_runs_every_section(tmp_path):
  # A budget no loaded CI machine reaches: every section must finish on its own.
  report = _run(tmp_path, "--budget=1100", "--repeats=1", f"--cache-dir={tmp_path / 'xla'}")
  sections = report["sections"]
  assert list(sections) == SECTIONS
  for name, result in sections.items():
    assert "error" not in result, (name, result)
  assert sections["peak"]["peak_bf16_flops"] > 0
  assert sections["flops"]["model_flops_per_image"] > 0
  assert len(sections["step:1+1"]["step_s_all"]) == 1
  if HAS_HF:
    assert sections["hf:1+1"]["dtype"] == "float32" and sections["hf:1+1"]["attention"]
  else:
    assert "skipped" in sections["hf:1+1"]
  # No cuDNN on a CPU: recorded, and the XLA side still measured at 4 * 4 + 1 = 17 tokens.
  attention = sections["attention"]
  assert attention["tokens"] == 17 and attention["xla"]["fwd_bwd_s"] > 0
  assert "error" in attention["cudnn"] and attention["cudnn_padded"]
  assert sections["matcher"]["shape"] == [2, 16, 3]
  run = sections["retrieval:N=200"]
  assert list(run["algorithms"]) == list(bench.retrieval_bench.ALGORITHM_NAMES)
  compile_ = sections["compile:1+1"]
  assert compile_["cold"]["compile_s"] > 0 and compile_["warm"]["compile_s"] > 0
  assert compile_["cache_files"] > 0  # the cold process filled the persistent cache
  (row,) = report["summary"]["steps"]
  assert row["images"] == "1+1" and row["images_per_s"] == pytest.approx(2 / row["step_s"])
  assert row["mfu"] > 0
  percent = report["summary"]["retrieval_percent_of_step"][str(run["num_images"])]
  assert percent["grasp"] == pytest.approx(
    100 * run["algorithms"]["grasp"]["jax_s"] / row["step_s"]
  )
  md = (tmp_path / "gpu_smoke.md").read_text()
  for title in ("## Train step", "## Attention at 17 tokens", "## Hungarian matcher"):
    assert title in md
  assert md.count("| 200 | `") == len(run["algorithms"])  # one retrieval row per algorithm


@pytest.mark.slow
def test_sections_past_the_budget_are_recorded_and_the_rest_still_runs(tmp_path):
  # 2 s in all: every section is killed at its share (>= 1 s) and recorded; the files are
  # still written.
  report = _run(tmp_path, "--budget=2")
  assert list(report["sections"]) == SECTIONS
  for result in report["sections"].values():
    assert result["error"].startswith("over its time budget")
  (row,) = report["summary"]["steps"]
  assert row["step_error"].startswith("over its time budget")
  assert "over its time budget" in (tmp_path / "gpu_smoke.md").read_text()


def test_budget_shares_add_up_to_the_budget():
  plan = bench.plan(_args())
  assert sum(b for _, _, b in plan) == pytest.approx(540.0)
  assert [n for name, n, _ in plan if name == "retrieval"] == [54_226, 1_000_000]
  # Each step beside its HF counterpart, in the order of the batches.
  assert [(n, b) for n, b, _ in plan if n in ("step", "hf")] == [
    ("step", 8),
    ("hf", 8),
    ("step", 16),
    ("hf", 16),
    ("step", 32),
    ("hf", 32),
  ]


def _args(**kw):
  defaults = dict(
    smoke=False,
    budget=540.0,
    sections=bench.ORDER,
    batches=bench.STEP_BATCHES,
    retrieval_sizes=bench.RETRIEVAL_SIZES,
  )
  return type("Args", (), dict(defaults, **kw))()


def test_sections_and_batches_choose_what_runs_in_the_fixed_order():
  plan = bench.plan(_args(sections=("compile", "step", "peak"), batches=(8, 32)))
  assert [(n, b) for n, b, _ in plan] == [("peak", None), ("step", 8), ("step", 32), ("compile", 8)]
  # Unscaled, the shares are BUDGETS' seconds.
  plan = bench.plan(_args(sections=("hf", "retrieval"), batches=(8,)), scale=False)
  assert plan == [
    ("hf", 8, bench.BUDGETS["hf"]),
    ("retrieval", 54_226, bench.BUDGETS["retrieval"]),
    ("retrieval", 1_000_000, bench.BUDGETS["retrieval"] + 30),
  ]


@pytest.mark.slow
def test_grad_agreement_scales_the_key_bias_by_the_key_kernel():
  # bf16 against float32 XLA attention at 17 tokens: every array within the bf16 tolerance
  # once the key bias (zero in exact arithmetic: softmax cancels q . b_k) is divided by the
  # key kernel's magnitude; divided by its own (~1e-6) it would read as ~1e4.
  jnp = bench.jnp
  rng = bench.np.random.default_rng(0)
  x = rng.normal(size=(2, 17, 128)).astype("float32")
  dy = rng.normal(size=(2, 17, 128)).astype("float32")
  results = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    module = bench.clip_lib.SelfAttention(num_heads=4, dtype=dtype, attention="xla")
    params, fwd_bwd = bench._attention_grads(module, jnp.asarray(x, dtype), jnp.asarray(dy, dtype))
    results[dtype] = fwd_bwd(params, jnp.asarray(x, dtype))
  diffs = bench.grad_agreement(results[jnp.float32], results[jnp.bfloat16])
  (key_bias,) = [p for p in diffs if p.endswith("['key']['bias']")]
  assert len(diffs) == 1 + 8 + 1  # output, 4 x (kernel, bias), input gradient
  assert max(diffs.values()) < bench.BF16_TOLERANCE
  # Rounding noise: below one bf16 rounding (2^-8) of the key kernel's gradient (~8).
  assert diffs[key_bias] < 2**-8
  # A 5% error in one array is caught.
  y, (grads, dx) = results[jnp.bfloat16]
  wrong = (y, (bench.jax.tree.map(lambda g: g, grads), dx * 1.05))
  assert max(bench.grad_agreement(results[jnp.float32], wrong).values()) > bench.BF16_TOLERANCE

"""benchmarks/step.py: its smoke run (every path, each side in a fresh process) writes the
fields docs/benchmarks.md reads; the HF side computes our detection loss; the pooled timings."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PATH = os.path.join(_ROOT, "benchmarks", "step.py")
_spec = importlib.util.spec_from_file_location("benchmark_step", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


@pytest.mark.slow
def test_smoke_run_times_every_side_in_fresh_processes(tmp_path):
  # The whole script as a user runs it: arithmetic (2 remats), then our model, our step and
  # (with the hf extra) HF's model and step, each in its own process; 2 threads per side.
  argv = [sys.executable, _PATH, "--smoke", "--remats=none,block", "--threads=2"]
  argv += [f"--out={tmp_path}"] + ([] if HAS_HF else ["--skip-hf"])
  subprocess.run(argv, check=True, cwd=tmp_path, capture_output=True, timeout=900)
  results = json.loads((tmp_path / "step_smoke.json").read_text())
  assert results["mode"] == "smoke"
  a = results["arithmetic"]
  assert a["fixed_bytes_total"] == 16 * a["num_parameters"]  # params, grads, 2 Adam moments
  assert a["model_flops_per_image_train"] > a["model_flops_per_image_eval"] > 0
  rows = {r["remat"]: r for r in a["configs"]}
  for r in rows.values():
    total = r["total_bytes_by_batch"]
    assert float(total["2"]) - float(total["1"]) == r["activation_bytes_per_image"] > 0
  # Remat keeps only the block inputs: fewer saved bytes, more FLOPs (the recomputation).
  assert rows["block"]["activation_bytes_per_image"] < rows["none"]["activation_bytes_per_image"]
  assert rows["block"]["step_flops_per_image"] > rows["none"]["step_flops_per_image"]

  t = results["timing"]
  sides = ["ours_model", "ours_step:jax"] + (["hf_model", "hf_step"] if HAS_HF else [])
  assert [r["side"] for r in t["rows"]] == sides and t["threads"] == 2
  for r in t["rows"]:
    assert "error" not in r, r
    assert r["batch"] == 2 and len(r["step_s_all"]) == 1 and r["processes"] == 1
    assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
    assert r["images_per_s"] == pytest.approx(2 / r["step_s"])
  by_side = {r["side"]: r for r in t["rows"]}
  # The timed step reused the first call's executable (no retrace on the second call).
  assert by_side["ours_step:jax"]["compilations"] == 1
  (ratio,) = t["ratios"]
  if HAS_HF:
    assert by_side["hf_model"]["torch_threads"] == 2
    # The like-for-like model alone: no remat on either side (HF's checkpointing off).
    assert by_side["hf_model"]["remat"] == by_side["ours_model"]["remat"] == "none"
    assert ratio["model_only"] == pytest.approx(
      by_side["hf_model"]["step_s"] / by_side["ours_model"]["step_s"]
    )
    assert ratio["full_step"] == pytest.approx(
      by_side["hf_step"]["step_s"] / by_side["ours_step:jax"]["step_s"]
    )
  md = (tmp_path / "step_smoke.md").read_text()
  assert md.startswith("# Train-step benchmark (smoke)")
  assert md.count("| ours_") == 2 and md.count("| hf_") == (2 if HAS_HF else 0)
  _check_lora_rows(results["lora"], md)


def _check_lora_rows(lora, md):
  """The LoRA rows of the smoke run (tiny model, rank 2): adapter count by hand, state bytes,
  and saved activations at least full fine-tuning's (LoRA keeps x for dA as full fine-tuning
  keeps it for dW, plus x A)."""
  from owl_cl import model as model_lib  # noqa: PLC0415

  c = model_lib.get_variant_config("tiny")
  (r,) = lora["ranks"]
  rank = r["rank"]
  assert rank == 2
  # Per block: q, k, v, out (D x r + r x D each), c_fc (D x r + r x mlp), c_proj (mlp x r +
  # r x D).
  per_block = lambda d, mlp: rank * (4 * 2 * d + 2 * (d + mlp))  # noqa: E731
  expected = c.vision_layers * per_block(c.vision_width, c.vision_mlp_dim) + c.text_layers * (
    per_block(c.text_width, c.text_mlp_dim)
  )
  assert r["adapter_parameters"] == expected and r["adapter_bytes"] == 4 * expected
  assert r["state_bytes"] == 4 * lora["num_parameters"] + 16 * expected
  assert lora["full_state_bytes"] == 16 * lora["num_parameters"]
  for row in lora["configs"]:
    (x,) = row["lora"]
    assert x["activation_bytes_per_image"] >= row["full_activation_bytes_per_image"] > 0
  assert "## LoRA vs full fine-tuning" in md and "| LoRA rank 2 |" in md


@pytest.mark.slow
def test_hf_detection_loss_is_ours():
  # The HF side's full step computes our detection loss (SciPy matching, focal + L1 + GIoU
  # per image): the same value as owl_cl.train.losses.detection_loss on the same inputs.
  torch = pytest.importorskip("torch")
  from owl_cl.train import losses  # noqa: PLC0415

  rng = np.random.default_rng(0)
  batch = bench.numpy_batch(rng, 2, 8, 5, 4, 4)
  logits = rng.normal(size=(2, 7, 5)).astype(np.float32)
  boxes = np.concatenate(
    [rng.uniform(0.3, 0.7, (2, 7, 2)), rng.uniform(0.1, 0.4, (2, 7, 2))], -1
  ).astype(np.float32)
  # Jitted: one program instead of an eager dispatch (and compilation) per operation.
  loss_fn = jax.jit(functools.partial(losses.detection_loss, **bench.LOSS_CONFIG, matcher="scipy"))
  ours = loss_fn(logits, boxes, batch["labels"], batch["boxes"])["loss"]
  hf = bench.hf_detection_loss(
    torch,
    torch.as_tensor(logits),
    torch.as_tensor(boxes),
    torch.as_tensor(batch["labels"]),
    torch.as_tensor(batch["boxes"]),
  )
  # float32 sums of a few dozen terms of order 1: agreement to 1e-5 relative.
  np.testing.assert_allclose(float(hf), float(ours), rtol=1e-5)


def test_pooled_timings_and_thread_settings():
  # Two processes' steps pooled: median of [3, 1, 2, 5] = 2.5, min 1, max 5; 4 images.
  records = [
    {"side": "hf_model", "batch": 4, "step_s_all": [3.0, 1.0]},
    {"side": "hf_model", "batch": 4, "step_s_all": [2.0, 5.0]},
  ]
  s = bench.summarize(records)
  assert (s["step_s"], s["step_s_min"], s["step_s_max"], s["processes"]) == (2.5, 1.0, 5.0, 2)
  assert s["images_per_s"] == 4 / 2.5
  env = bench.thread_settings(1)
  assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
  assert env["XLA_FLAGS"].endswith("intra_op_parallelism_threads=1")
  if hasattr(os, "sched_getaffinity"):
    assert env[bench.CPUS_VARIABLE] == str(min(os.sched_getaffinity(0)))


@pytest.mark.slow
def test_owlv2_arithmetic_counts_the_objectness_head(tmp_path):
  """OWLv2's rows: more parameters (the objectness head: 2 D x D layers + D x 1) and more saved
  activations than v1's at the same size (the head's own, trained by the objectness term)."""
  common = [
    "--quick",
    "--image-size=32",
    "--num-queries=4",
    "--max-instances=2",
    "--batches=1",
    "--dtypes=float32",
    "--remats=none",
    "--attentions=xla",
    "--skip-timing",
    "--skip-lora",  # the LoRA rows are the smoke run's (test_smoke_run_times_every_side...)
  ]
  rows = {}
  for variant in ("tiny", "owlv2_tiny"):
    out = tmp_path / variant
    bench.main(common + [f"--variant={variant}", f"--out={out}"])
    with open(out / "step_quick.json") as f:
      rows[variant] = json.load(f)["arithmetic"]
  d = 128  # the tiny vision width
  extra = rows["owlv2_tiny"]["num_parameters"] - rows["tiny"]["num_parameters"]
  assert extra == 2 * (d * d + d) + (d + 1)
  v1, v2 = (rows[v]["configs"][0]["activation_bytes_per_image"] for v in ("tiny", "owlv2_tiny"))
  assert v2 > v1


def test_hfu_flops_and_hf_remat_record():
  # HFU's FLOPs: the arithmetic row of the timed dtype and remat, the XLA-attention one first
  # (cuDNN's are modelled off a GPU); none without a matching row or without arithmetic.
  rows = [
    {"dtype": "bfloat16", "remat": "block", "attention": "cudnn", "step_flops_per_image": 2.0},
    {"dtype": "bfloat16", "remat": "block", "attention": "xla", "step_flops_per_image": 3.0},
    {"dtype": "float32", "remat": "block", "attention": "xla", "step_flops_per_image": 5.0},
  ]
  args = types.SimpleNamespace(step_flops=rows)
  assert bench.step_flops_of(args, {"dtype": "bfloat16", "remat": "block"}) == 3.0
  assert bench.step_flops_of(args, {"dtype": "float32", "remat": "block"}) == 5.0
  assert bench.step_flops_of(args, {"dtype": "bfloat16", "remat": "none"}) is None
  assert bench.step_flops_of(types.SimpleNamespace(), {"dtype": "float32"}) is None
  # HF's remat as recorded: transformers 5's property, else the older name.
  model = types.SimpleNamespace
  assert bench._hf_checkpointing(model(is_activation_checkpointing=False)) is False
  assert bench._hf_checkpointing(model(is_gradient_checkpointing=True)) is True

"""benchmarks/step.py: its smallest path runs and writes the fields the README reads."""

import importlib.util
import json
import os
import sys
import types

_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "step.py"
)
_spec = importlib.util.spec_from_file_location("benchmark_step", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)


def test_smallest_arithmetic_path_writes_json(tmp_path):
  argv = [
    "--quick",
    "--variant=tiny",
    "--image-size=32",
    "--num-queries=4",
    "--max-instances=2",
    "--batches=1,2",
    "--dtypes=float32",
    "--remats=none,block",
    "--attentions=xla",
    "--skip-timing",
    f"--out={tmp_path}",
  ]
  bench.main(argv)
  with open(tmp_path / "step_quick.json") as f:
    results = json.load(f)
  a = results["arithmetic"]
  assert a["num_parameters"] > 0
  assert a["fixed_bytes_total"] == 16 * a["num_parameters"]  # params, grads, 2 Adam moments
  assert a["model_flops_per_image_train"] > a["model_flops_per_image_eval"] > 0
  rows = {r["remat"]: r for r in a["configs"]}
  assert set(rows) == {"none", "block"}
  for r in rows.values():
    assert r["activation_bytes_per_image"] > 0
    total = r["total_bytes_by_batch"]
    assert float(total["2"]) - float(total["1"]) == r["activation_bytes_per_image"]
  # Remat keeps only the block inputs: fewer saved bytes, more FLOPs (the recomputation).
  assert rows["block"]["activation_bytes_per_image"] < rows["none"]["activation_bytes_per_image"]
  assert rows["block"]["step_flops_per_image"] > rows["none"]["step_flops_per_image"]
  assert (tmp_path / "step_quick.md").read_text().startswith("# Train-step benchmark")


def test_timed_step_reuses_the_first_compilation():
  """The two warm-up calls of the timed step share one executable (no retrace on call 2)."""
  args = types.SimpleNamespace(variant="tiny", image_size=32, num_queries=4, max_instances=2)
  _, record = bench.prepare_ours(args, 2, "jax", "float32", "none", "xla")
  assert record["compilations"] == 1
  assert record["first_step_s"] > 0 and record["second_step_s"] > 0


def test_compile_cache_writes_the_step_and_keeps_full_results(tmp_path):
  """--compile-cache compiles in two fresh processes sharing a new cache folder, writes its
  own files and leaves an existing step_quick.json alone."""
  (tmp_path / "step_quick.json").write_text("{}")
  results = bench.main(
    [
      "--quick",
      "--compile-cache",
      "--skip-arithmetic",
      "--skip-timing",
      "--variant=tiny",
      "--image-size=32",
      "--num-queries=4",
      "--max-instances=2",
      "--time-batches=2",
      "--attention=xla",
      f"--cache-dir={tmp_path / 'xla'}",
      f"--out={tmp_path}",
    ]
  )
  c = results["compile_cache"]
  assert c["batch"] == 2 and c["dtype"] == "float32"
  for run in ("cold", "warm"):
    assert c[run]["lower_s"] > 0 and c[run]["compile_s"] > 0
  # The cold process wrote the step's executable into the (new, first empty) cache folder.
  (folder,) = os.listdir(tmp_path / "xla")
  assert any(f.startswith("jit_step-") for f in os.listdir(tmp_path / "xla" / folder))
  assert c["cache_files"] == len(os.listdir(tmp_path / "xla" / folder))
  assert (tmp_path / "step_quick.json").read_text() == "{}"
  assert "persistent cache" in (tmp_path / "step_quick_compile.md").read_text()


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

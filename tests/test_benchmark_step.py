"""benchmarks/step.py: its smallest path runs and writes the fields the README reads."""

import importlib.util
import json
import os
import sys

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


def test_timed_step_reuses_the_first_compilation(tmp_path):
  """The two warm-up calls of the timed step share one executable (no retrace on call 2)."""
  record = bench.main(
    [
      "--compile-only",
      "--variant=tiny",
      "--image-size=32",
      "--num-queries=4",
      "--max-instances=2",
      "--time-batches=2",
      "--dtype=float32",
      "--remat=none",
      "--attention=xla",
      f"--out={tmp_path}",
    ]
  )
  assert record["compilations"] == 1
  assert record["first_step_s"] > 0 and record["second_step_s"] > 0

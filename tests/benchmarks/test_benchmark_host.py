"""benchmarks/host.py: its smoke run times the main job in a subprocess and writes its rows."""

import json
import math
import os
import subprocess
import sys

import pytest

_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "benchmarks",
  "host.py",
)


@pytest.mark.slow  # a whole tiny run in a subprocess: ~100 s of CPU (compiles, pre-training)
def test_smoke_times_the_main_job_and_appends_a_row(tmp_path):
  argv = [sys.executable, _PATH, "--smoke", "--label=first", f"--out={tmp_path}"]
  subprocess.run(argv, check=True, cwd=tmp_path, capture_output=True, timeout=1200)
  (row,) = json.loads((tmp_path / "host_smoke.json").read_text())["rows"]
  assert row["label"] == "first" and row["cache"] == "empty"
  # The child ran a whole pipeline: CPU seconds, faults and memory of its own, not zeros.
  assert row["user_s"] > 1 and row["sys_s"] > 0 and row["wall_s"] > 1
  assert row["minor_faults"] > 1000 and row["max_rss_mib"] > 50
  assert len(row["metrics_digest"]) == 16
  markdown = (tmp_path / "host_smoke.md").read_text()
  assert "| first |" in markdown and row["metrics_digest"] in markdown


def _load_bench():
  import importlib.util  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location("benchmark_host", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_metrics_digest_ignores_timings_and_paths_only(tmp_path):
  bench = _load_bench()
  results = {"stages": [{"AP": 0.25, "seconds": 3.0}], "run_id": "1", "config": {"cache_dir": "/a"}}
  results.update(timings={"wall_seconds": 5.0}, created_at="t0", updated_at="t1")
  path = tmp_path / "results.json"
  path.write_text(json.dumps(results))
  digest = bench.metrics_digest(str(path))
  # Another run's id, folders and wall times: the same digest.
  results.update(run_id="2", config={"cache_dir": "/b"}, timings={"wall_seconds": 7.0})
  results.update(created_at="t2", updated_at="t3")
  results["stages"][0]["seconds"] = 9.0
  path.write_text(json.dumps(results))
  assert bench.metrics_digest(str(path)) == digest
  # One metric's last bit changed: another digest.
  results["stages"][0]["AP"] = math.nextafter(0.25, 1.0)
  path.write_text(json.dumps(results))
  assert bench.metrics_digest(str(path)) != digest

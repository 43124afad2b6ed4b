"""The projection of benchmarks/asv_left.py (ASER-PC's left term from N = 5k to the paper's
buffer and 8 devices), on hand-worked figures."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "benchmarks",
  "asv_left.py",
)
_spec = importlib.util.spec_from_file_location("benchmark_asv_left", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)


def test_projection_is_quadratic_in_the_images_and_divided_by_the_devices():
  # 5,000 images in 79 chunks of 64, a median chunk of 2 s (wall) and 3 s (CPU); one chunk of
  # 8 images against the paper's 54,226 takes 10 s (wall) and 12 s (CPU).
  whole = dict(images=5000, tokens=40_000, steady_total_s=158.0, steady_total_cpu_s=237.0)
  full = dict(images=54_226, chunk=8, chunk_s=10.0, chunk_cpu_s=12.0)
  p = bench.projections(whole, full, 8)
  assert p["from_small_quadratic_s"] == pytest.approx(158.0 * (54_226 / 5000) ** 2)
  assert p["log_factor"] == pytest.approx(math.log(433_808) / math.log(40_000))
  assert p["from_small_quadratic_log_s"] == pytest.approx(
    p["from_small_quadratic_s"] * p["log_factor"]
  )
  assert p["from_full_chunk_s"] == pytest.approx(10.0 * 6779)  # ceil(54,226 / 8) chunks
  assert p["from_full_chunk_8_devices_s"] == pytest.approx(10.0 * 6779 / 8)
  cpu = bench.projections(whole, full, 8, "cpu")
  assert cpu["from_small_quadratic_8_devices_s"] == pytest.approx(237.0 * (54_226 / 5000) ** 2 / 8)
  # A full-size chunk of another N is scaled linearly to the paper's N.
  half = dict(full, images=27_113)
  assert bench.projections(whole, half, 8)["from_full_chunk_s"] == pytest.approx(2 * 10.0 * 6779)


@pytest.mark.slow
def test_smoke_runs_end_to_end(tmp_path):
  # The whole script as a user runs it (both measurements, projections, report files) on 40
  # images of 2 tokens in chunks of 8, and one chunk of 4 images against 60.
  argv = [sys.executable, _PATH, "--smoke", f"--out={tmp_path}"]
  subprocess.run(argv, check=True, cwd=tmp_path, capture_output=True, timeout=600)
  report = json.loads((tmp_path / "asv_left_smoke.json").read_text())
  assert report["whole"]["chunks"] == 5 and report["whole"]["tokens"] == 80
  assert report["full_chunk"]["tokens"] == 120
  assert report["full_chunk"]["sort"] == "host NumPy"  # the CPU path of knn_shapley
  assert report["projection"]["from_full_chunk_s"] > 0
  assert "host NumPy sort" in (tmp_path / "asv_left_smoke.md").read_text()

"""benchmarks/buffer.py: its smoke run builds a store in a fresh process and reports it."""

import json
import os
import subprocess
import sys

import pytest

_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "benchmarks",
  "buffer.py",
)


@pytest.mark.slow
def test_smoke_builds_a_store_and_writes_the_tables(tmp_path):
  # 64 images in batches of 8, chunks of 32 (two commits of pass 1, so its rate is timed).
  argv = [sys.executable, _PATH, "--smoke", f"--out={tmp_path}"]
  subprocess.run(argv, check=True, cwd=tmp_path, capture_output=True, timeout=600)
  report = json.loads((tmp_path / "buffer_smoke.json").read_text())
  (run,) = report["runs"]
  assert run["images"] == 64 and run["batch_size"] == 8
  assert 0 < run["images_kept"] <= 64
  assert run["pass1_images_per_s"] > 0 and run["peak_rss_bytes"] > 0
  per_array = run["store_bytes_per_image_by_array"].values()
  assert run["store_bytes"] == pytest.approx(sum(v * run["images_kept"] for v in per_array))
  assert report["peak_rss_bytes_64"] == run["peak_rss_bytes"]
  assert (tmp_path / "buffer_smoke.md").read_text().strip()

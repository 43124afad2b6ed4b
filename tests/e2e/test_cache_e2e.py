"""Three runs started together on one fresh cache_dir end as a solo run (issue 33 item 2).

Each cache entry (built-in benchmark, data scan, pre-trained model, replay store, image cache)
is built by one of the three while the others wait for its lock and reuse it.
"""

import json
import os
import subprocess
import sys

import pytest

from owl_cl.testing.results import comparable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = """
from owl_cl.testing.configs import tiny_config


def get_config():
  c = tiny_config("swil", {cache_dir!r})
  # One downstream dataset, few evaluated images: every entry is still built and used.
  c.data.builtin.downstream = ("thermal",)
  c.max_eval_images = 8
  c.eval.pretraining_sets_after_each_dataset = False
  c.replay.image_cache = "replay_images"
  return c
"""


def _start(config, workdir):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  log = open(f"{workdir}.log", "w")  # noqa: SIM115 (closed by the caller)
  command = [sys.executable, "-m", "owl_cl.main", f"--config={config}", f"--workdir={workdir}"]
  return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log


@pytest.mark.slow
def test_three_runs_on_one_fresh_cache_equal_a_solo_run(tmp_path):
  shared, solo = tmp_path / "shared.py", tmp_path / "solo.py"
  shared.write_text(_CONFIG.format(cache_dir=str(tmp_path / "cache_shared")))
  solo.write_text(_CONFIG.format(cache_dir=str(tmp_path / "cache_solo")))
  jobs = [(shared, str(tmp_path / f"run{i}")) for i in range(3)] + [(solo, str(tmp_path / "solo"))]
  started = [_start(config, workdir) for config, workdir in jobs]
  try:
    codes = [p.wait(timeout=1500) for p, _ in started]
  finally:
    for p, log in started:
      if p.poll() is None:
        p.kill()
      log.close()
  outputs = [open(f"{workdir}.log").read() for _, workdir in jobs]
  for code, out in zip(codes, outputs):
    assert code == 0, out[-4000:]
  results = []
  for _, workdir in jobs:
    with open(os.path.join(workdir, "results.json")) as f:
      results.append(json.load(f))
  *together, alone = results
  for r in together:
    assert r["status"] == "complete"
    assert comparable(r["stages"]) == comparable(alone["stages"])
    assert comparable(r["buffer"]) == comparable(alone["buffer"])
  # One of the three pre-trained and built the buffer; the others reused them.
  shared_logs = outputs[:3]
  assert sum("no cached pre-trained model: pre-training" in o for o in shared_logs) == 1
  assert sum("re-using the cached pre-trained model" in o for o in shared_logs) == 2
  assert sum("re-using the cached replay buffer" in o for o in shared_logs) == 2
  assert not any(".corrupt-" in name for name in os.listdir(tmp_path / "cache_shared"))

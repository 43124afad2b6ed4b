"""A sweep killed mid-way and run again finishes with the results of an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from owl_cl.testing.files import snapshot
from owl_cl.testing.results import comparable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = """
from owl_cl.testing.configs import tiny_config


def get_config(arg=""):
  c = tiny_config("uniform", {cache!r})
  c.max_eval_images = 8
  c.eval.downstream_after_each_dataset = "seen"
  c.eval.pretraining_sets_after_each_dataset = False
  return c
"""


def sweep_command(configs, root, seeds="0,1"):
  return [
    sys.executable,
    os.path.join(REPO, "launch", "sweep.py"),
    "--algorithms=uniform",
    f"--seeds={seeds}",
    "--orders=reversed",
    f"--configs-dir={configs}",
    f"--root={root}",
    f"--python={sys.executable}",
    "--run",
  ]


def load(root, seed):
  with open(os.path.join(root, f"uniform_reversed_seed{seed}", "results.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_killed_sweep_finishes_like_an_uninterrupted_one(pretrained_cache_dir, tmp_path):
  configs = tmp_path / "configs"
  configs.mkdir()
  # The runs compile into (and read from) the session's compilation cache: tiny_config
  # leaves `compilation_cache_dir` empty, and JAX takes the folder from the environment
  # (tests/conftest.py).
  (configs / "uniform.py").write_text(CONFIG.format(cache=pretrained_cache_dir))
  whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
  # The uninterrupted reference of the run the kill interrupts (seed 1); seed 0 is complete
  # before the kill, and the resumed sweep must leave it as it is.
  subprocess.run(
    sweep_command(configs, whole, seeds="1"), cwd=REPO, check=True, capture_output=True
  )
  # The sweep in its own process group, killed (SIGKILL: no clean-up at all) once its first
  # run is complete, while the second one runs.
  proc = subprocess.Popen(
    sweep_command(configs, killed),
    cwd=REPO,
    start_new_session=True,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  first = os.path.join(killed, "uniform_reversed_seed0", "results.json")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    try:
      with open(first) as f:
        if json.load(f).get("status") == "complete":
          break
    except (OSError, ValueError):
      pass
    time.sleep(0.2)
  assert proc.poll() is None, "the sweep ended before it could be killed"
  time.sleep(3.0)  # the second run is under way
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  done = snapshot(os.path.join(killed, "uniform_reversed_seed0"), mtimes=True)
  again = subprocess.run(sweep_command(configs, killed), cwd=REPO, capture_output=True, text=True)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "complete, skipped" in again.stderr and "uniform_reversed_seed0" in again.stderr
  # The completed run is skipped: not one of its files rewritten.
  assert snapshot(os.path.join(killed, "uniform_reversed_seed0"), mtimes=True) == done
  resumed = {seed: load(killed, seed) for seed in (0, 1)}
  for seed, b in resumed.items():
    assert b["status"] == "complete"
    assert b["task_order"]["name"] == "reversed" and b["sequence"] == ["digits", "thermal"]
    assert b["seeds"] == {"model": 0, "data": seed, "retrieval": seed}
  # The interrupted run, resumed, ends as the uninterrupted one.
  a, b = load(whole, 1), resumed[1]
  assert a["status"] == "complete" and a["task_order"] == b["task_order"]
  assert a["seeds"] == b["seeds"]
  for stage_a, stage_b in zip(a["stages"], b["stages"], strict=True):
    assert stage_a["metrics"] == stage_b["metrics"], stage_a["name"]
    assert comparable(stage_a.get("train")) == comparable(stage_b.get("train"))
  # The two seeds differ in data order and retrieval only: same pre-trained model.
  assert resumed[0]["stages"][0]["metrics"] == a["stages"][0]["metrics"]

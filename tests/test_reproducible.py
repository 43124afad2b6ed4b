"""Two runs of one config with the same seed give identical results (issue 12 item 8)."""

import json
import os

import numpy as np
import pytest

from owl_cl import experiment
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.results import comparable


@pytest.mark.slow
def test_same_seed_gives_identical_results(pretrained_cache_dir, tmp_path):
  """Same config, same seed, same cache, two workdirs: every metric of every stage (the
  pre-trained evaluation, each dataset's training summary and evaluations) is equal exactly
  (no tolerance: the same XLA programs on the same device and data order give the same bits;
  a difference means an unseeded or order-dependent step).

  The second run reads its batches in the loop's own thread (data.prefetch_batches 0), the
  first one ahead in the background (the default): the overlap must not change a bit either,
  the final losses and the retrieval records included."""
  config = tiny_config("swil", pretrained_cache_dir)
  # Cheaper, same coverage: fewer evaluated images and sets between stages (every set is still
  # evaluated after pre-training and at the end), and the second run reads the first one's
  # compiled programs from the persistent compilation cache.
  config.max_eval_images = 8
  config.eval.downstream_after_each_dataset = "seen"
  config.eval.pretraining_sets_after_each_dataset = False
  config.compilation_cache_dir = str(tmp_path / "xla")
  results = []
  for name, prefetch in (("a", 1), ("b", 0)):
    workdir = str(tmp_path / name)
    config.data.prefetch_batches = prefetch
    experiment.run(config, workdir)
    with open(os.path.join(workdir, "results.json")) as f:
      results.append(json.load(f))
  a, b = results
  assert a["status"] == b["status"] == "complete"
  assert a["run_id"] != b["run_id"]  # two runs, not one resumed
  assert [s["name"] for s in a["stages"]] == ["pretrained", "thermal", "digits"]
  # The seed of each part is recorded; no stored order (the config's own order).
  assert a["seeds"] == {"model": 0, "data": 0, "retrieval": 0}
  assert a["task_order"] is None and a["sequence_seed"] is None
  for stage_a, stage_b in zip(a["stages"], b["stages"]):
    assert stage_a["metrics"] == stage_b["metrics"], stage_a["name"]
    assert comparable(stage_a.get("train")) == comparable(stage_b.get("train"))
  # Every metric field is a number (a NaN would compare unequal to itself and fail above).
  ap = a["stages"][-1]["metrics"]["thermal"]["AP"]
  assert isinstance(ap, float) and 0.0 <= ap <= 1.0
  assert comparable(a["buffer"]) == comparable(b["buffer"])
  assert [s["train"]["final_loss"] for s in a["stages"][1:]] == [
    s["train"]["final_loss"] for s in b["stages"][1:]
  ]
  for name in ("thermal", "digits"):
    records = [np.load(tmp_path / run / "records" / f"{name}.npz") for run in ("a", "b")]
    assert sorted(records[0]) == sorted(records[1])
    assert all(np.array_equal(records[0][k], records[1][k]) for k in records[0])
  # Each dataset's step time breakdown (wall-clock: its values are not compared): its first
  # step (compilation) left out of 2, so 1 step; non-negative parts that add up to the step.
  for r in results:
    timings = r["timings"]["step_timings"]
    assert sorted(timings) == ["digits", "thermal"]
    for summary in timings.values():
      assert summary["steps"] == 1
      mean = summary["mean"]
      assert all(v >= 0.0 for v in mean.values()), mean
      parts = mean["embed"] + mean["retrieval"] + mean["train_step"] + mean["host_idle"]
      # Each mean is rounded to 1e-6 s.
      assert abs(parts - mean["step_seconds"]) <= 4e-6, mean
      assert mean["gather"] <= mean["host_idle"] + 2e-6
      assert 0.0 <= summary["host_idle_fraction"] <= 1.0

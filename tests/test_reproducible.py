"""Two runs of one config with the same seed give identical results (issue 12 item 8)."""

import json
import os

from owl_cl import experiment
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.results import comparable


def test_same_seed_gives_identical_results(pretrained_cache_dir, tmp_path):
  """Same config, same seed, same cache, two workdirs: every metric of every stage (the
  pre-trained evaluation, each dataset's training summary and evaluations) is equal exactly
  (no tolerance: the same XLA programs on the same device and data order give the same bits;
  a difference means an unseeded or order-dependent step)."""
  config = tiny_config("swil", pretrained_cache_dir)
  # Cheaper, same coverage: fewer evaluated images and sets between stages (every set is still
  # evaluated after pre-training and at the end), and the second run reads the first one's
  # compiled programs from the persistent compilation cache.
  config.max_eval_images = 8
  config.eval.downstream_after_each_dataset = "seen"
  config.eval.pretraining_sets_after_each_dataset = False
  config.compilation_cache_dir = str(tmp_path / "xla")
  results = []
  for name in ("a", "b"):
    workdir = str(tmp_path / name)
    experiment.run(config, workdir)
    with open(os.path.join(workdir, "results.json")) as f:
      results.append(json.load(f))
  a, b = results
  assert a["status"] == b["status"] == "complete"
  assert a["run_id"] != b["run_id"]  # two runs, not one resumed
  assert [s["name"] for s in a["stages"]] == ["pretrained", "thermal", "digits"]
  for stage_a, stage_b in zip(a["stages"], b["stages"]):
    assert stage_a["metrics"] == stage_b["metrics"], stage_a["name"]
    assert comparable(stage_a.get("train")) == comparable(stage_b.get("train"))
  # Every metric field is a number (a NaN would compare unequal to itself and fail above).
  ap = a["stages"][-1]["metrics"]["thermal"]["AP"]
  assert isinstance(ap, float) and 0.0 <= ap <= 1.0
  assert comparable(a["buffer"]) == comparable(b["buffer"])

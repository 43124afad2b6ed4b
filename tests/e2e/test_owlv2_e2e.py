"""End to end: the main job with OWLv2 (`--config=configs/swil.py:owlv2`) on the built-in
benchmark at the tiny budget: pre-training, buffer, DER++ replay with the objectness term,
evaluation."""

import json
import os

import pytest

from owl_cl import experiment
from owl_cl.testing.configs import load_config
from owl_cl.testing.configs import tiny_budget


@pytest.mark.slow  # about 90 s of CPU (its own pre-training), 7 min wall on a loaded machine
def test_owlv2_main_job_runs(pretrained_cache_dir, tmp_path):
  config = load_config("swil", "owlv2,builtin1")  # the tiny budget shrinks version 1
  assert (config.model.variant, config.loss.objectness_weight) == ("owlv2_tiny", 0.5)
  config.cache_dir = pretrained_cache_dir  # the benchmark is shared; OWLv2 pre-trains its own
  config.compilation_cache_dir = ""
  tiny_budget(config)
  config.data.builtin.downstream = ("thermal",)
  config.max_train_steps_per_dataset = 1
  config.max_eval_images = 8
  workdir = str(tmp_path / "owlv2")
  results = experiment.run(config, workdir)
  assert results["status"] == "complete"
  train = results["stages"][1]["train"]
  assert train["steps"] == 1 and train["replayed_images"] == config.train.batch_size
  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved["config"]["model"]["variant"] == "owlv2_tiny"

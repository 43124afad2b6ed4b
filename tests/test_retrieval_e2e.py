"""Smoke test: the main job runs with every retrieval algorithm config (tiny budget, one
shared pre-trained model, buffer and compilation cache) and writes its analysis records."""

import json
import os

import numpy as np

from owl_cl import experiment
from owl_cl.replay import algorithms
from owl_cl.testing.configs import tiny_config

CONFIGS = (
  "uniform",
  "uniform_balanced",
  "grasp",
  "swil",
  "sw_grasp",
  "a_sw_grasp",
  "aser",
  "aser_pc",
  "sw_aser_pc",
)


def test_every_algorithm_config_runs(pretrained_cache_dir, tmp_path):
  assert set(CONFIGS) == set(algorithms.ALGORITHMS)
  cache, xla = pretrained_cache_dir, str(tmp_path / "xla")
  for name in CONFIGS:
    config = tiny_config(name, cache)
    assert config.replay.algorithm == name
    config.compilation_cache_dir = xla  # the train/eval steps compile once for all
    config.data.builtin.downstream = ("thermal",)
    config.max_train_steps_per_dataset = 1
    config.max_eval_images = 8
    workdir = str(tmp_path / name)
    results = experiment.run(config, workdir)
    assert results["status"] == "complete" and results["retrieval"] == name
    train = results["stages"][1]["train"]
    assert train["steps"] == 1 and train["replayed_images"] == config.train.batch_size, name
    records = np.load(os.path.join(workdir, "records", "thermal.npz"))
    assert int(records["calls"]) == 1
    if name != "uniform":  # every replay's class is recorded
      assert records["sampled_class_counts"].sum() == config.train.batch_size, name
    if "aser" in name:
      assert records["knn_sv_counts"].sum() > 0 and records["min_sv_rank_counts"].sum() == 8
    if name in ("swil", "sw_grasp", "a_sw_grasp", "sw_aser_pc"):
      assert records["swil_entropy_counts"].sum() == 8, name
    if name in ("grasp", "sw_grasp"):
      assert records["grasp_entropy_counts"].sum() == 8, name
    with open(os.path.join(workdir, "results.json")) as f:
      assert json.load(f)["config"]["replay"]["algorithm"] == name

"""Smoke test: the main job runs with the retrieval algorithm configs (tiny budget, one shared
pre-trained model, buffer and compilation cache) and writes its analysis records.

Six of the Table 2 algorithms run the main job; between them they use every class step
(balanced, similarity-weighted, adaptive) and every sample step (uniform, prototype-weighted,
ASV with the left term per call and precomputed). Every other algorithm of the registry
(uniform_balanced, swil and aser_pc recombine those steps; one registered later is checked
too) has its config checked to build its algorithm, and
tests/replay/test_retrieval_sharded.py runs every algorithm's jitted retrieval.
"""

import json
import os

import numpy as np
import pytest

from owl_cl import experiment
from owl_cl.replay import setup as replay_setup
from owl_cl.replay.retrieval import registry
from owl_cl.testing.configs import tiny_config

CONFIGS = ("uniform", "grasp", "sw_grasp", "a_sw_grasp", "aser", "sw_aser_pc")


@pytest.mark.slow
def test_every_algorithm_config_runs(pretrained_cache_dir, tmp_path):
  for name in sorted(set(registry.ALGORITHMS) - set(CONFIGS)):  # the registry's others
    config = tiny_config(name, pretrained_cache_dir)
    assert replay_setup.make_algorithm(config).name == name
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

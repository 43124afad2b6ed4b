"""End to end: replay + SWIL + LoRA at tiny size, stopped mid-dataset and resumed bit-identically,
with checkpoints that hold only the adapters (docs/lora.md)."""

import json
import os

import jax
import numpy as np
import pytest

from owl_cl import experiment
from owl_cl import preemption
from owl_cl.configs import base
from owl_cl.detector import Detector
from owl_cl.model import lora
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.results import comparable
from owl_cl.train import checkpointing


def _config(cache_dir, xla_dir):
  c = base.apply_lora(tiny_config("swil", cache_dir))
  c.compilation_cache_dir = xla_dir  # the second and third runs compile nothing
  c.checkpoint.every_steps = 1
  c.eval.pretraining_sets_after_each_dataset = False
  c.eval.downstream_after_each_dataset = "seen"
  return c


def _folder_bytes(folder):
  return sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(folder)
    for name in names
  )


# Three whole runs (reference, stopped, resumed): about 110 s of CPU.
@pytest.mark.slow
def test_lora_with_replay_stopped_and_resumed_equals_the_uninterrupted_run(
  pretrained_cache_dir, tmp_path, monkeypatch
):
  config = _config(pretrained_cache_dir, str(tmp_path / "xla"))
  expected = experiment.run(config, str(tmp_path / "reference"))
  assert expected["status"] == "complete"
  for stage in expected["stages"][1:]:
    assert stage["train"]["steps"] == 2 and stage["train"]["replayed_images"] > 0

  # SIGTERM seen at the 5th check (before each stage and after each step: stage 1, its two
  # steps, stage 2, dataset 2's first step): a step checkpoint is saved and the run stops.
  calls = []
  monkeypatch.setattr(preemption, "requested_here", lambda: (calls.append(1), len(calls) == 5)[1])
  workdir = tmp_path / "stopped"
  with pytest.raises(preemption.Preempted, match="in dataset 2"):
    experiment.run(config, str(workdir))

  # The checkpoints hold the adapters, not the model: stage 1's parameters are the adapter
  # tree (restored into its shapes), and its files a fraction of the model's bytes.
  detector = Detector(config)
  adapters = lora.abstract_adapters(detector.model, detector.lora)
  full_bytes = checkpointing.tree_bytes(jax.eval_shape(lambda: detector.init_params(0)))
  stages = checkpointing.StageCheckpointer(str(workdir / "checkpoints"))
  assert stages.latest_stage() == 1
  like = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), adapters)
  restored, _, _ = stages.restore(1, like, None)
  stages.close()
  assert jax.tree.structure(restored) == jax.tree.structure(like)
  assert any(np.any(leaf) for leaf in jax.tree.leaves(restored))  # trained B != 0
  stage_bytes = _folder_bytes(workdir / "checkpoints" / "1")
  step_bytes = _folder_bytes(workdir / "step_checkpoints")
  # Adapters (rank 8 on 12 layers: ~40 KB) + Adam's two moments + replay state and metadata;
  # the tiny model alone is ~2 MB.
  assert lora.adapter_bytes(adapters) < full_bytes / 10
  assert stage_bytes < full_bytes / 2 and step_bytes < full_bytes

  monkeypatch.setattr(preemption, "requested_here", lambda: False)
  experiment.run(config, str(workdir))
  # Every metric and training summary of the resumed run, exactly (compared through
  # results.json, where NaN metrics are stored as null).
  got, expected = (
    json.loads((tmp_path / name / "results.json").read_text()) for name in ("stopped", "reference")
  )
  assert got["status"] == "complete"
  differing = _differing(comparable(got), comparable(expected))
  assert not differing, differing[:10]


def _differing(a, b, path=""):
  """The paths (with both values) where two results.json trees differ."""
  if isinstance(a, dict) and isinstance(b, dict):
    return [
      d for k in sorted(set(a) | set(b)) for d in _differing(a.get(k), b.get(k), f"{path}/{k}")
    ]
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differing(x, y, f"{path}/{i}")]
  return [] if a == b else [(path, a, b)]


# One whole run of two tasks: about 77 s of CPU (with the compilations), 5 min wall at load 15.
@pytest.mark.slow
def test_per_task_lora_starts_every_task_with_fresh_adapters_on_the_pretrained_base(
  pretrained_cache_dir, tmp_path, monkeypatch
):
  from owl_cl import trainer  # pylint: disable=g-import-not-at-top

  config = base.apply_lora(tiny_config("per_task", pretrained_cache_dir))
  starts = []
  train_on_dataset = trainer.train_on_dataset

  def spy(detector, dataset, params, *args, **kwargs):
    starts.append(jax.device_get(params))
    return train_on_dataset(detector, dataset, params, *args, **kwargs)

  monkeypatch.setattr(trainer, "train_on_dataset", spy)
  results = experiment.run(config, str(tmp_path / "run"))
  assert results["status"] == "complete" and results["schedule"] == "per_task"
  assert len(starts) == 2
  for tree in starts:  # the same start for each task: B = 0 (the pre-trained model)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(starts[0]), strict=True):
      np.testing.assert_array_equal(a, b)
    adapters = lora.adapters_of(tree)
    b_leaves = [v for k, v in jax.tree_util.tree_leaves_with_path(adapters) if "lora_b" in str(k)]
    assert b_leaves and all(not np.any(b) for b in b_leaves)
  # Each stage checkpoint holds its own task's trained adapters.
  detector = Detector(config)
  like = jax.tree.map(
    lambda s: np.zeros(s.shape, s.dtype), lora.abstract_adapters(detector.model, detector.lora)
  )
  stages = checkpointing.StageCheckpointer(str(tmp_path / "run" / "checkpoints"))
  first, second = (stages.restore(i, like, None)[0] for i in (1, 2))
  stages.close()
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)))

"""The `joint` and `per_task` schedules end to end at tiny size: what they train on, from what,
and a run interrupted mid-stage that resumes to the uninterrupted run's results exactly."""

import collections
import json
import os

import jax
import numpy as np
import pytest

from owl_cl import benchmark as benchmark_lib
from owl_cl import config_spec
from owl_cl import experiment
from owl_cl import phases
from owl_cl import preemption
from owl_cl import pretrained
from owl_cl import run_spec
from owl_cl import trainer
from owl_cl.config_fields import ConfigError
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.results import comparable
from owl_cl.train import checkpointing
from owl_cl.train.spec import TrainSpec


def _interrupt_at_step(monkeypatch, n):
  """A kill in the middle of a stage: KeyboardInterrupt at this process's n-th train step
  event (after the step's checkpoint call; that write may not be committed yet)."""
  count = [0]
  original = preemption.checkpoint_event

  def event(name):
    if name == "train_step":
      count[0] += 1
      if count[0] == n:
        raise KeyboardInterrupt("simulated kill")
    original(name)

  monkeypatch.setattr(preemption, "checkpoint_event", event)
  return original


def _interrupted_then_resumed(config, workdir, monkeypatch, step):
  """Runs `config` in `workdir`, interrupted at train step event `step`, then resumed;
  returns the resumed run's results.json."""
  created = []
  init = checkpointing.StepCheckpointer.__init__

  def record(self, *args, **kwargs):
    init(self, *args, **kwargs)
    created.append(self)

  monkeypatch.setattr(checkpointing.StepCheckpointer, "__init__", record)
  original = _interrupt_at_step(monkeypatch, step)
  with pytest.raises(KeyboardInterrupt):
    experiment.run(config, workdir)
  # The kill lands once the step checkpoint in flight is on disk: in one process, the
  # abandoned writer's thread would race the resumed run's clean-up of orbax's temporary
  # folders (a killed process's thread stops with it).
  for checkpointer in created:
    checkpointer.close()
  monkeypatch.setattr(checkpointing.StepCheckpointer, "__init__", init)
  with open(os.path.join(workdir, "results.json")) as f:
    assert json.load(f)["status"] == "running"
  monkeypatch.setattr(preemption, "checkpoint_event", original)
  assert experiment.run(config, workdir)["status"] == "complete"
  with open(os.path.join(workdir, "results.json")) as f:
    return json.load(f)


def _equal_results(a, b):
  for results in (a, b):
    results.pop("config")  # equal configs; their cache folders differ in no way here
  assert comparable(a) == comparable(b)


@pytest.mark.slow  # three tiny runs (one interrupted), replay on: 10 min at load 18 on 2 cores
def test_joint_run_trains_the_sequences_data_at_once_and_resumes(
  pretrained_cache_dir, tmp_path, monkeypatch
):
  config = tiny_config("joint", pretrained_cache_dir)
  config.checkpoint.every_steps = 1
  assert config.train.schedule == "joint" and config.replay.algorithm == "uniform"
  planned = []
  monkeypatch.setattr(
    trainer,
    "joint_phase",
    lambda *a, **k: planned.append(phases.joint_phase(*a, **k)) or planned[-1],
  )
  results = experiment.run(config, str(tmp_path / "reference"))

  # The mixture: the sequence's datasets, their steps (2 each: max_train_steps_per_dataset)
  # and examples (8 per step), in one stage of the sequence's total steps.
  bench = benchmark_lib.load_benchmark(config)
  train = config_spec.from_config(TrainSpec, config.train, "train")
  run = run_spec.run_settings(config)
  sequence = [phases.dataset_phase(train, run, d, i) for i, d in enumerate(bench.sequence, 1)]
  (phase,) = planned
  assert [p.name for p in phase.source.parts] == [d.name for d in bench.sequence]
  assert [p.steps for p in phase.source.parts] == [p.total for p in sequence] == [2, 2]
  assert [p.seed for p in phase.source.parts] == [p.data_seed for p in sequence]
  counts = collections.Counter(phase.source.plan[:, 0].tolist())
  assert counts == {0: 2 * 8, 1: 2 * 8}  # each dataset's share: its share of the steps
  assert phase.total == phase.source.steps == 4

  assert results["status"] == "complete" and results["schedule"] == "joint"
  assert [s["name"] for s in results["stages"]] == ["pretrained", "joint"]
  stage = results["stages"][1]
  assert stage["train"]["steps"] == 4 and stage["train"]["joint"] == {"thermal": 2, "digits": 2}
  assert stage["train"]["replayed_images"] > 0  # uniform replay, as configured
  # Evaluated like the sequence's last stage: every eval set.
  assert set(stage["metrics"]) == {"pretrain_val", "held_out", "thermal", "digits"}

  resumed = _interrupted_then_resumed(config, str(tmp_path / "killed"), monkeypatch, step=3)
  _equal_results(resumed, json.load(open(tmp_path / "reference" / "results.json")))


@pytest.mark.slow  # three tiny runs (one interrupted): 13 min at load 18 on 2 cores
def test_per_task_starts_every_task_from_the_pretrained_model_and_resumes(
  pretrained_cache_dir, tmp_path, monkeypatch
):
  config = tiny_config("per_task", pretrained_cache_dir)
  config.checkpoint.every_steps = 1
  assert config.train.schedule == "per_task" and config.replay.algorithm == "none"
  starts = []
  train_on_dataset = trainer.train_on_dataset

  def spy(detector, dataset, params, *args, **kwargs):
    starts.append((dataset.name, jax.device_get(params)))
    return train_on_dataset(detector, dataset, params, *args, **kwargs)

  monkeypatch.setattr(trainer, "train_on_dataset", spy)
  results = experiment.run(config, str(tmp_path / "reference"))
  bench = benchmark_lib.load_benchmark(config)
  params, _ = pretrained.pretrained_params(Detector(config), bench, None)

  def assert_pretrained(tree):
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(params), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  assert [name for name, _ in starts] == [d.name for d in bench.sequence]
  for _, tree in starts:
    assert_pretrained(tree)
  assert results["schedule"] == "per_task"
  assert [s["name"] for s in results["stages"]] == ["pretrained", "thermal", "digits"]
  for stage in results["stages"][1:]:
    # Each task's model on its own dataset and on what it may forget; not on the others.
    assert set(stage["metrics"]) == {"pretrain_val", "held_out", stage["name"]}
    assert stage["train"]["steps"] == 2

  # Killed in the second task: the resumed run restores stage 1 (a trained model) yet starts
  # the second task from the pre-trained parameters again.
  starts.clear()
  workdir = str(tmp_path / "killed")
  resumed = _interrupted_then_resumed(config, workdir, monkeypatch, step=3)
  assert [name for name, _ in starts] == ["thermal", "digits", "digits"]
  for _, tree in starts:
    assert_pretrained(tree)
  _equal_results(resumed, json.load(open(tmp_path / "reference" / "results.json")))


def test_joint_with_best_validation_carry_is_refused_up_front(pretrained_cache_dir, tmp_path):
  config = tiny_config("joint", pretrained_cache_dir)
  config.train.carry = "best_validation"
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match="schedule='joint' with config.train.carry"):
    experiment.run(config, str(workdir))
  assert not workdir.exists()  # nothing written

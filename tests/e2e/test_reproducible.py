"""Two runs of one config with the same seed give identical results (issue 12 item 8), and
today's code reproduces the committed reference run (issue 49 item 1)."""

import json
import os
import pathlib

import numpy as np
import pytest

from owl_cl import experiment
from owl_cl.testing import reproduction
from owl_cl.testing.results import comparable
from owl_cl.train import step_cache

REPOSITORY = str(pathlib.Path(__file__).resolve().parent.parent.parent)


@pytest.fixture(scope="module")
def first_run(pretrained_cache_dir, tmp_path_factory):
  """(root folder, results.json) of one run of `reproduction.reference_config` (the batches
  read ahead in the background, the default), shared by this module's tests: both the same-seed
  test's first run and the reproduction of the committed reference."""
  root = tmp_path_factory.mktemp("reproducible")
  # Module-scoped: set up before the function-scoped fixtures that clear the shared steps.
  step_cache.clear()
  config = reproduction.reference_config(pretrained_cache_dir, str(root / "xla"))
  config.data.prefetch_batches = 1
  experiment.run(config, str(root / "a"))
  step_cache.clear()
  with open(root / "a" / "results.json") as f:
    return root, json.load(f)


@pytest.mark.slow
def test_same_seed_gives_identical_results(first_run, pretrained_cache_dir):
  """Same config, same seed, same cache, two workdirs: every metric of every stage (the
  pre-trained evaluation, each dataset's training summary and evaluations) is equal exactly
  (no tolerance: the same XLA programs on the same device and data order give the same bits;
  a difference means an unseeded or order-dependent step).

  The second run reads its batches in the loop's own thread (data.prefetch_batches 0), the
  first one ahead in the background (the default): the overlap must not change a bit either,
  the final losses and the retrieval records included. Cheaper, same coverage
  (`reproduction.reference_config`): fewer evaluated images and sets between stages, and the
  second run reads the first one's compiled programs from the persistent compilation cache."""
  tmp_path, first = first_run
  config = reproduction.reference_config(pretrained_cache_dir, str(tmp_path / "xla"))
  config.data.prefetch_batches = 0
  experiment.run(config, str(tmp_path / "b"))
  with open(tmp_path / "b" / "results.json") as f:
    results = [first, json.load(f)]
  a, b = results
  assert a["status"] == b["status"] == "complete"
  assert a["run_id"] != b["run_id"]  # two runs, not one resumed
  assert [s["name"] for s in a["stages"]] == ["pretrained", "thermal", "digits"]
  # The seed of each part is recorded; no stored order (the config's own order).
  assert a["seeds"] == {"model": 0, "data": 0, "retrieval": 0}
  assert a["task_order"] is None and a["sequence_seed"] is None
  for stage_a, stage_b in zip(a["stages"], b["stages"]):
    assert stage_a["metrics"] == stage_b["metrics"], stage_a["name"]
    assert stage_a["per_class"] == stage_b["per_class"], stage_a["name"]
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


@pytest.mark.slow
def test_committed_reference_run_is_reproduced(first_run):
  """Today's code reproduces the committed reference run (`owl_cl.testing.reproduction`):
  bit for bit on the machine that wrote it, the structure elsewhere (module docstring there:
  why no tolerance is stated for another machine). With `reproduction.WRITE_ENV` set, the
  run becomes the new reference instead."""
  _, results = first_run
  folder = os.environ.get(reproduction.WRITE_ENV)
  if folder:
    reproduction.write_reference(folder, results)
    pytest.skip(f"wrote a new reference to {folder}")
  reference, machine = reproduction.load_reference(REPOSITORY)
  assert reference["status"] == results["status"] == "complete"
  assert reproduction.structure(results) == reproduction.structure(reference)
  here = reproduction.fingerprint()
  if here != machine:
    differ = sorted(k for k in set(here) | set(machine) if here.get(k) != machine.get(k))
    pytest.skip(f"the reference ran on another machine ({differ}): bits compared there only")
  ours, theirs = reproduction.compared(results), reproduction.compared(reference)
  for key in sorted(set(ours) | set(theirs)):
    assert ours.get(key) == theirs.get(key), key


def test_a_field_added_after_the_reference_is_taken_at_its_default():
  reference = {"seed": 0, "train": {"b1": 0.9}, "model": {"overrides": {"vision_layers": 1}}}
  defaults = {
    "seed": 1,
    "train": {"b1": 0.5, "wise_ft": {"alpha": 1.0}},
    "model": {"overrides": {"context_length": 8}},
    "eval": {"save_detections": False},
  }
  assert reproduction.with_added_fields(reference, defaults) == {
    "seed": 0,
    "train": {"b1": 0.9, "wise_ft": {"alpha": 1.0}},
    "model": {"overrides": {"vision_layers": 1, "context_length": 8}},
    "eval": {"save_detections": False},
  }

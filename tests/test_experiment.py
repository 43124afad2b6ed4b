"""End to end: the main job with a tiny budget, resume after an interruption, workdir safety."""

import json
import logging
import os
import re

import jax
import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl import experiment
from owl_cl import trainer
from owl_cl.config_fields import ConfigError
from owl_cl.eval import provenance
from owl_cl.replay import setup as replay_setup
from owl_cl.testing.configs import tiny_config
from owl_cl.train import step_cache


@pytest.fixture
def cache_dir(pretrained_cache_dir):
  """The session's cache (built-in benchmark + the tiny pre-trained model, tests/conftest.py)."""
  return pretrained_cache_dir


def _stage_names(results):
  return [s["name"] for s in results["stages"]]


# Two versions of the code (`provenance.code_provenance`'s records): the interrupted run's and
# the resuming one's.
FIRST_CODE = {"commit": "a" * 40, "dirty": False, "commit_source": "git"}
RESUMING_CODE = {"commit": "b" * 40, "dirty": True, "commit_source": "git"}


def _check_per_class(stage, bench_classes):
  """Each evaluation's per-class AP: every class of the set, named; the set's AP their mean
  over the classes with ground truth (pycocotools averages precision over them, each class the
  same number of entries); 1e-12 is float64 rounding of a 16-term mean."""
  assert set(stage["per_class"]) == set(stage["metrics"]), stage["name"]
  for name, per_class in stage["per_class"].items():
    assert list(per_class) == bench_classes[name], (stage["name"], name)
    values = [v["AP"] for v in per_class.values() if v["AP"] is not None]
    assert values, (stage["name"], name)
    assert stage["metrics"][name]["AP"] == pytest.approx(np.mean(values), abs=1e-12)


@pytest.mark.slow
def test_main_job_end_to_end_and_resume(cache_dir, tmp_path, monkeypatch):
  config = tiny_config("swil", cache_dir)
  workdir = str(tmp_path / "run")
  monkeypatch.setattr(provenance, "code_provenance", lambda: dict(FIRST_CODE))

  # Interrupt the first run while it trains on the second downstream dataset.
  original = trainer.train_on_dataset
  calls = []

  def interrupted(detector, dataset, *args, **kwargs):
    calls.append(dataset.name)
    if len(calls) == 2:
      raise KeyboardInterrupt("simulated preemption")
    return original(detector, dataset, *args, **kwargs)

  monkeypatch.setattr(trainer, "train_on_dataset", interrupted)
  with pytest.raises(KeyboardInterrupt):
    experiment.run(config, workdir)
  partial = json.load(open(os.path.join(workdir, "results.json")))
  assert partial["status"] == "running"
  assert _stage_names(partial) == ["pretrained", "thermal"]

  # The same command on the same workdir resumes after the last finished dataset.
  assert {k: partial[k] for k in FIRST_CODE} == FIRST_CODE
  calls.clear()
  monkeypatch.setattr(
    trainer, "train_on_dataset", lambda *a, **k: (calls.append(a[1].name), original(*a, **k))[1]
  )
  monkeypatch.setattr(provenance, "code_provenance", lambda: dict(RESUMING_CODE))
  results = experiment.run(config, workdir)
  assert calls == ["digits"]  # 'thermal' was not trained again
  assert results["status"] == "complete"
  assert _stage_names(results) == ["pretrained", "thermal", "digits"]
  # Metrics of the finished stages are carried over unchanged.
  final = json.load(open(os.path.join(workdir, "results.json")))
  assert final["stages"][1]["metrics"] == partial["stages"][1]["metrics"]
  # The commit: the run's first code at the top, each stage the code that computed it.
  assert {k: final[k] for k in FIRST_CODE} == FIRST_CODE
  assert [s["provenance"] for s in final["stages"]] == [FIRST_CODE, FIRST_CODE, RESUMING_CODE]
  bench = benchmark.load_benchmark(config)
  classes = {name: list(dataset.test.class_names) for name, dataset in bench.eval_sets()}
  for stage in final["stages"]:
    _check_per_class(stage, classes)
  for stage in results["stages"]:
    assert set(stage["metrics"]) == {"pretrain_val", "held_out", "thermal", "digits"}
    for values in stage["metrics"].values():
      assert 0.0 <= values["AP50"] <= 1.0
  assert results["buffer"]["images_kept"] >= 1
  with open(os.path.join(workdir, "results.md")) as f:
    text = f.read()
  assert "swil" in text and "No fine-tuning" in text
  # One trace of the retrieval for every step of both runs and datasets: the replay state
  # goes in placed as the retrieval returns it (`Replay.prepare`), not as host arrays.
  retrievals = [f for k, f in step_cache.kept().items() if k[0] == "retrieve"]
  assert len(retrievals) == 1 and retrievals[0]._cache_size() == 1

  # A third call finds the run complete and trains nothing.
  calls.clear()
  experiment.run(config, workdir)
  assert calls == []
  # (Compared through results.json, where NaN metrics are stored as null.)
  assert json.load(open(os.path.join(workdir, "results.json")))["stages"] == final["stages"]


@pytest.mark.slow
def test_no_replay_reuses_cached_pretrained_model(cache_dir, tmp_path, monkeypatch):
  config = tiny_config("no_replay", cache_dir)
  # The session's cache holds the pre-trained model of the tiny configs (tests/conftest.py).
  pretrained = os.listdir(os.path.join(cache_dir, "pretrained"))
  monkeypatch.setattr(trainer, "pretrain", lambda *a, **k: pytest.fail("re-trained"))
  results = experiment.run(config, str(tmp_path / "run"))
  assert os.listdir(os.path.join(cache_dir, "pretrained")) == pretrained
  assert results["retrieval"] == "none" and results["buffer"] is None
  assert results["stages"][0]["metrics"]  # evaluated after pre-training


def test_workdir_of_another_config_is_refused(cache_dir, tmp_path):
  workdir = str(tmp_path / "run")
  config = tiny_config("swil", cache_dir)
  experiment.check_workdir(workdir, config)
  other = tiny_config("uniform", cache_dir)
  with pytest.raises(ConfigError, match="different config"):
    experiment.check_workdir(workdir, other)
  # Nothing was overwritten.
  run = json.load(open(os.path.join(workdir, "run.json")))
  assert run["config"]["replay"]["algorithm"] == "swil"


def test_unknown_algorithm_is_a_config_error(cache_dir):
  config = tiny_config("swil", cache_dir)
  config.replay.algorithm = "nonexistent"
  with pytest.raises(ConfigError, match="replay.algorithm"):
    replay_setup.make_algorithm(config)


@pytest.mark.slow
def test_loss_adaptivity_reports_replay_fractions(cache_dir, tmp_path, monkeypatch):
  """Paper loss adaptivity end to end: the reported replay fractions count the replays made.

  The pre-forward's per-example losses are replaced by a known pattern (a test double for
  the new images' losses): on every dataset, step 1 has 3 of 8 new images above l, step 2
  none. Expected per dataset: 3 retrieved images, 3 in the loss, samples 3/16, steps 1/2.
  """
  import jax
  import numpy as np

  from owl_cl.train import step as step_lib

  config = tiny_config("swil", cache_dir)
  config.replay.loss_adaptivity.mode = "paper"
  config.replay.loss_adaptivity.threshold = 1.0
  patterns = [np.array([9, 0, 9, 0, 0, 0, 9, 1.0], np.float32), np.ones(8, np.float32)]
  original = step_lib.make_new_loss_step
  calls = []

  def make_patterned(*args, **kwargs):
    fn = original(*args, **kwargs)

    def patterned(*inputs):
      out = dict(fn(*inputs))
      calls.append(out["per_example"].shape)
      out["per_example"] = jax.numpy.asarray(patterns[(len(calls) - 1) % 2])
      return out

    return patterned

  monkeypatch.setattr(step_lib, "make_new_loss_step", make_patterned)
  results = experiment.run(config, str(tmp_path / "run"))
  assert calls == [(8,)] * 4  # 2 datasets x 2 steps, [B] losses
  for stage in results["stages"][1:]:
    train = stage["train"]
    assert train["loss_adaptivity"] == "paper" and train["loss_threshold"] == 1.0
    assert train["steps"] == 2 and train["replay_slots"] == 16
    assert train["replayed_images"] == 3 == train["replays_in_loss"]
    assert train["replay_samples_fraction"] == pytest.approx(3 / 16)
    assert train["replay_steps_fraction"] == pytest.approx(1 / 2)
  with open(os.path.join(str(tmp_path / "run"), "results.md")) as f:
    text = f.read()
  assert "samples replayed (%)" in text
  assert "| all | 4 | 6 | 6 | 50.0 | 18.8 |" in text


def test_unknown_loss_adaptivity_mode_is_a_config_error(cache_dir, tmp_path):
  config = tiny_config("swil", cache_dir)
  config.replay.loss_adaptivity.mode = "sometimes"
  with pytest.raises(ConfigError, match="loss_adaptivity.mode"):
    experiment.run(config, str(tmp_path / "run"))


@pytest.mark.slow  # ~60 s on 2 shared CPU cores (a full tiny run, evaluation included)
def test_lwf_run_distils_to_the_pretrained_model(cache_dir, tmp_path, monkeypatch):
  """`configs/lwf.py` at tiny size: every dataset's train step gets the pre-trained
  parameters as its teacher (not the parameters carried from the previous dataset)."""
  config = tiny_config("no_replay", cache_dir)
  config.experiment_name = "lwf"
  config.train.lwf.weight = 1.0
  seen = []
  with_teacher = trainer._with_teacher
  train_on_dataset = trainer.train_on_dataset

  def spy_train(detector, dataset, params, *args, **kwargs):
    seen.append({"params": jax.device_get(params), "teacher": args[0].teacher})
    return train_on_dataset(detector, dataset, params, *args, **kwargs)

  def spy_teacher(train_step, teacher, mesh):
    seen[-1]["wrapped"] = True
    return with_teacher(train_step, teacher, mesh)

  monkeypatch.setattr(trainer, "train_on_dataset", spy_train)
  monkeypatch.setattr(trainer, "_with_teacher", spy_teacher)
  results = experiment.run(config, str(tmp_path / "run"))
  assert len(seen) == len(results["sequence"]) >= 2
  assert all(s.get("wrapped") for s in seen)
  pretrained = seen[0]["params"]  # the first dataset starts from the pre-trained model
  for s in seen:
    for a, b in zip(jax.tree.leaves(s["teacher"]), jax.tree.leaves(pretrained)):
      np.testing.assert_array_equal(np.asarray(a), b)
  # The second dataset starts from trained parameters, which differ from the teacher.
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(seen[1]["params"]), jax.tree.leaves(pretrained))
  )
  assert len(results["stages"]) == len(results["sequence"]) + 1


@pytest.mark.slow  # a tiny run of 5 steps per dataset from the session's cached model and buffer
def test_log_has_each_stages_metrics_and_no_warning_repeated_within_a_dataset(
  cache_dir, tmp_path, caplog
):
  config = tiny_config("swil", cache_dir)
  # 5 steps of 8 replays per dataset from the tiny buffer (under 48 images): the dedup mask is
  # exhausted and reset automatically more than once per dataset, each reset a warning.
  config.train.num_epochs, config.max_train_steps_per_dataset = 3, 5
  # Between stages the datasets seen so far only (as version 2 and ':paper'), 8 images a set.
  config.eval.downstream_after_each_dataset = "seen"
  config.eval.pretraining_sets_after_each_dataset = False
  config.max_eval_images = 8
  with caplog.at_level(logging.INFO):
    results = experiment.run(config, str(tmp_path / "run"))
  # Fewer than 3 x 8 images: the 3rd call finds under 8 unreplayed and resets, the 5th again.
  assert results["buffer"]["images_kept"] < 3 * 8
  records = [r for r in caplog.records if r.levelno >= logging.INFO]
  # One metrics line per stage, in order, each set's AP (points, 1 decimal) as results.json.
  ends = [i for i, r in enumerate(records) if r.getMessage().startswith("after ")]
  whens = ["pre-training", "thermal (stage 1 of 2)", "digits (stage 2 of 2)"]
  assert len(ends) == len(results["stages"]) == len(whens)
  for end, when, stage in zip(ends, whens, results["stages"]):
    sets = " | ".join(f"{k} AP {100 * v['AP']:.1f}" for k, v in stage["metrics"].items())
    assert records[end].getMessage() == f"after {when}: {sets}"
  # Between two metrics lines (one stage), each place logs at most one warning; the repeats
  # of the dedup reset are one summary line whose count is the resets it stands for.
  starts = [0, *(e + 1 for e in ends[:-1])]
  for index, (start, end) in enumerate(zip(starts, ends)):
    warnings = [r for r in records[start:end] if r.levelno == logging.WARNING]
    summaries = [r.getMessage() for r in warnings if "above was repeated" in r.getMessage()]
    places = [
      (r.pathname, r.lineno) for r in warnings if "above was repeated" not in r.getMessage()
    ]
    assert len(places) == len(set(places)), [r.getMessage() for r in warnings]
    assert len(summaries) == len(set(summaries))
    if index == 0:
      continue
    resets = [
      int(n) for n in re.findall(r"reset #(\d+)", " ".join(r.getMessage() for r in warnings))
    ]
    counted = re.search(r"repeated (\d+) more times? during ", " ".join(summaries))
    assert len(resets) == 2 and counted, [r.getMessage() for r in warnings]
    assert resets[1] - resets[0] == int(counted.group(1)) >= 1  # shown one, then the last

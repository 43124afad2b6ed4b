"""Stored state of a workdir you can trust: checkpoint manifests, fallback, full disk, results.

Step and stage checkpoints get a manifest (`owl_cl.integrity`) once orbax has finished them;
on resume a checkpoint that fails its check (a flipped bit or 64 bytes with size and mtime
kept, a cut file, garbage in its metadata, an emptied folder, no manifest) is set aside with
a warning and the previous one is used, or the run stops with one line naming the file.
"""

import errno
import glob
import json
import os

from absl import logging
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import experiment
from owl_cl import integrity
from owl_cl import main
from owl_cl import preemption
from owl_cl import trainer
from owl_cl import utils
from owl_cl import validation
from owl_cl.config_fields import ConfigError
from owl_cl.eval import results as results_lib
from owl_cl.testing.configs import load_config
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.results import comparable
from owl_cl.train import checkpointing


def _files(folder):
  return sorted(
    f for f in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(f)
  )


def _largest(folder):
  """The largest file of a checkpoint folder (array bytes), manifest aside."""
  files = [f for f in _files(folder) if not f.endswith(integrity.MANIFEST_NAME)]
  return max(files, key=os.path.getsize)


def _rewrite_keeping_stat(path, change):
  """Applies `change(bytearray)` to the file, keeping its size and mtime (a silent corruption)."""
  stat = os.stat(path)
  data = bytearray(open(path, "rb").read())
  change(data)
  with open(path, "wb") as f:
    f.write(data)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert os.path.getsize(path) == stat.st_size


def _flip_bit(folder):
  _rewrite_keeping_stat(_largest(folder), lambda d: d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 1))


def _flip_64_bytes(folder):
  def change(data):
    start = max(0, len(data) // 2 - 32)
    data[start : start + 64] = bytes(255 - b for b in data[start : start + 64])

  _rewrite_keeping_stat(_largest(folder), change)


def _truncate(folder):
  path = _largest(folder)
  os.truncate(path, os.path.getsize(path) // 2)


def _garbage_metadata(folder):
  # The meta item's JSON (step checkpoint: the loop's host state; stage: the metrics so far).
  with open(os.path.join(folder, "meta", "metadata"), "w") as f:
    f.write("{garbage")


def _empty(folder):
  for path in _files(folder):
    os.remove(path)


def _no_manifest(folder):
  # Killed after orbax's rename and before the manifest: not committed.
  os.remove(os.path.join(folder, integrity.MANIFEST_NAME))


CORRUPTIONS = {
  "bit": _flip_bit,
  "64_bytes": _flip_64_bytes,
  "truncated": _truncate,
  "garbage_metadata": _garbage_metadata,
  "emptied": _empty,
  "no_manifest": _no_manifest,
}


def _tree(step):
  return {"w": jnp.arange(256, dtype=jnp.float32) * step, "n": np.arange(step, dtype=np.int64)}


def _like(step):
  return {"tree": {"w": jnp.zeros(256, jnp.float32), "n": np.zeros(step, np.int64)}}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_step_checkpoint_falls_back_to_the_previous_one(tmp_path, corruption, caplog):
  folder = str(tmp_path / "steps")
  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  for step in (1, 2):
    steps.save(1, step, {"tree": _tree(step)}, {"history": {"at": step}})
  steps.close()
  newest = os.path.join(folder, str(checkpointing.PHASE_STRIDE + 2))
  assert integrity.has_manifest(newest)  # committed by close()
  CORRUPTIONS[corruption](newest)

  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  with caplog.at_level(logging.WARNING):
    assert steps.latest(1) == 1
  assert "step 2 of phase 1 failed its integrity check" in caplog.text
  assert "falling back to step 1 of phase 1" in caplog.text
  # Set aside, never deleted: the evidence stays beside the good one.
  names = sorted(os.listdir(folder))
  assert names[0] == str(checkpointing.PHASE_STRIDE + 1)
  assert names[1].startswith(f"{checkpointing.PHASE_STRIDE + 2}.corrupt-")
  items, meta = steps.restore(1, 1, _like(1))
  np.testing.assert_array_equal(items["tree"]["w"], _tree(1)["w"])  # bit-exact
  assert meta["history"] == {"at": 1}
  # The run redoes step 2 and writes it again (the set-aside copy is not in the way).
  steps.save(1, 2, {"tree": _tree(2)}, {"history": {"at": 2}})
  steps.close()
  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  assert steps.latest(1) == 2
  steps.close()


def test_no_intact_step_checkpoint_restarts_the_phase(tmp_path, caplog):
  folder = str(tmp_path / "steps")
  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  for step in (1, 2):
    steps.save(3, step, {"tree": _tree(step)}, {})
  steps.close()
  for step in (1, 2):
    _flip_bit(os.path.join(folder, str(3 * checkpointing.PHASE_STRIDE + step)))
  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  with caplog.at_level(logging.WARNING):
    assert steps.latest(3) is None  # the phase starts over from its stage checkpoint
  assert "none: the phase starts over" in caplog.text
  assert all(".corrupt-" in n for n in os.listdir(folder)) and len(os.listdir(folder)) == 2
  steps.close()


def _stage_checkpoints(folder, stages):
  stage_ckpt = checkpointing.StageCheckpointer(folder)
  for stage in stages:
    stage_ckpt.save(stage, {"w": jnp.full((64,), float(stage))}, None, {"stages": [stage]})
  stage_ckpt.close()


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_stage_checkpoint_falls_back_to_the_previous_one(tmp_path, corruption, caplog):
  folder = str(tmp_path / "checkpoints")
  _stage_checkpoints(folder, (0, 1))
  CORRUPTIONS[corruption](os.path.join(folder, "1"))
  stage_ckpt = checkpointing.StageCheckpointer(folder)
  with caplog.at_level(logging.WARNING):
    assert stage_ckpt.latest_stage() == 0
  assert "stage 1 failed its integrity check" in caplog.text
  params, _, meta = stage_ckpt.restore(0, {"w": jnp.zeros(64)}, None)
  np.testing.assert_array_equal(params["w"], np.zeros(64))
  assert meta == {"stages": [0]}
  # The stage is trained again and saved under its index.
  stage_ckpt.save(1, {"w": jnp.ones(64)}, None, {"stages": [1]})
  assert stage_ckpt.latest_stage() == 1
  stage_ckpt.close()


def test_no_intact_stage_checkpoint_is_one_error_naming_the_file(tmp_path):
  folder = str(tmp_path / "checkpoints")
  _stage_checkpoints(folder, (0,))
  bad = _largest(os.path.join(folder, "0"))
  _flip_bit(os.path.join(folder, "0"))
  stage_ckpt = checkpointing.StageCheckpointer(folder)
  with pytest.raises(integrity.IntegrityError) as raised:
    stage_ckpt.latest_stage()
  message = str(raised.value)
  assert raised.value.path == bad and message.startswith(bad)
  assert "SHA-256 differs" in message and "no intact checkpoint is left" in message
  assert "\n" not in message
  assert os.listdir(folder) == ["0"]  # nothing moved: the user decides
  stage_ckpt.close()


def test_kill_during_a_write_keeps_the_previous_committed_checkpoint(tmp_path):
  # keep=2: while step 3 is written (and until its manifest is), step 2 (committed) stays.
  folder = str(tmp_path / "steps")
  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  for step in (1, 2, 3):
    steps.save(1, step, {"tree": _tree(step)}, {})
  # Killed after orbax finished step 3 and before its manifest: orbax's write done, no commit.
  steps._manager.wait_until_finished()  # pylint: disable=protected-access
  ids = sorted(os.listdir(folder))
  assert ids == [str(checkpointing.PHASE_STRIDE + s) for s in (2, 3)]
  assert integrity.has_manifest(os.path.join(folder, ids[0]))
  assert not integrity.has_manifest(os.path.join(folder, ids[1]))
  resumed = checkpointing.StepCheckpointer(folder, every_steps=1)
  assert resumed.latest(1) == 2  # one interval lost, not two
  resumed.close()


def test_a_finished_write_is_committed_at_the_next_step(tmp_path):
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  steps.save(1, 1, {"tree": _tree(1)}, {})
  steps._manager.wait_until_finished()  # pylint: disable=protected-access
  folder = os.path.join(steps.directory, str(checkpointing.PHASE_STRIDE + 1))
  assert not integrity.has_manifest(folder)
  steps.poll()  # what the loop's checkpoint hook calls after every step
  integrity.verify_directory(folder)
  steps.close()


def test_default_config_writes_step_checkpoints_by_time(tmp_path, monkeypatch):
  config = load_config("swil")
  assert config.checkpoint.every_minutes == 10.0 and config.checkpoint.every_steps is None
  assert load_config("swil", "paper").checkpoint.every_minutes == 10.0
  now = [1000.0]
  monkeypatch.setattr(checkpointing.time, "monotonic", lambda: now[0])
  steps = checkpointing.StepCheckpointer(
    str(tmp_path / "steps"),
    every_steps=config.checkpoint.every_steps,
    every_minutes=config.checkpoint.every_minutes,
  )
  steps.start_phase()
  now[0] += 599.0
  assert not steps.time_due()
  now[0] += 1.0
  assert steps.time_due()  # 600 s after the phase began
  # Not by steps, but at the phase's last step (the evaluation after it is covered).
  assert [s for s in range(1, 6) if steps.step_due(s, 5)] == [5]
  steps.close()


def test_changed_checkpoint_interval_resumes_the_run(tmp_path):
  workdir = str(tmp_path / "run")
  config = load_config("swil")
  run_id = experiment.check_workdir(workdir, config)
  config.checkpoint.every_minutes, config.checkpoint.every_steps = None, 5
  assert experiment.check_workdir(workdir, config) == run_id


def test_full_disk_before_a_step_checkpoint_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  steps.save(1, 1, {"tree": _tree(1)}, {})
  steps.wait()
  monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 3 * 2**20)
  big = {"tree": {"w": np.zeros(2**20, np.float32)}}  # 4 MiB
  with pytest.raises(checkpointing.DiskFullError) as raised:
    steps.save(1, 2, big, {})
  message = str(raised.value)
  assert message == (
    f"no space left for the checkpoint of step 2 (phase 1) in {steps.directory} (device "
    f"mounted at {utils.mount_point(steps.directory)}: about 5.0 MiB needed, 3.0 MiB free); "
    "free space on that device and run the same command to resume (the last committed "
    "checkpoint is kept)"
  )
  assert raised.value.errno == errno.ENOSPC
  assert os.listdir(steps.directory) == [str(checkpointing.PHASE_STRIDE + 1)]
  steps.close()
  monkeypatch.undo()
  # Space freed: the same checkpointer goes on.
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  assert steps.latest(1) == 1
  steps.save(1, 2, big, {})
  steps.close()


def test_full_disk_during_a_write_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  steps.save(1, 1, {"tree": _tree(1)}, {})
  steps.wait()
  steps.save(1, 2, {"tree": _tree(2)}, {})
  steps._manager.wait_until_finished()  # pylint: disable=protected-access

  def full(*args):
    # What orbax raises from its write thread (tensorstore's message, measured on a tmpfs).
    raise ValueError('RESOURCE_EXHAUSTED: Error writing "w/0": No space left on device')

  monkeypatch.setattr(steps._manager, "wait_until_finished", full)  # pylint: disable=protected-access
  with pytest.raises(
    checkpointing.DiskFullError, match=r"^no space left for a step checkpoint in "
  ):
    steps.wait()
  monkeypatch.undo()
  steps.close()
  resumed = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  assert resumed.latest(1) == 1  # the uncommitted step 2 is set aside
  resumed.close()


def test_disk_full_errors_are_recognised():
  assert checkpointing.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
  assert checkpointing.is_disk_full(ValueError("RESOURCE_EXHAUSTED: ... No space left on device"))
  assert not checkpointing.is_disk_full(OSError(errno.EACCES, "Permission denied"))
  assert not checkpointing.is_disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory"))


def test_unreadable_results_files_are_set_aside_and_others_kept(tmp_path):
  workdir = str(tmp_path)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    f.write('{"run_id": "abc", "stages": [')  # cut
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write('<!-- owl_cl-results run_id="abc" -->\n')
  moved = results_lib.set_aside_unreadable(workdir)
  assert len(moved) == 1 and os.path.basename(moved[0]).startswith("results.json.corrupt-")
  assert os.path.exists(os.path.join(workdir, "results.md"))
  with open(moved[0]) as f:
    assert f.read() == '{"run_id": "abc", "stages": ['  # kept as it was


def _stop_in_dataset_2(config, workdir, monkeypatch):
  """Runs until SIGTERM during dataset 2's 1st step, which stops the run at its 2nd (last) one:
  stage checkpoints 0 and 1, step checkpoints 1 and 2 of phase 2 (the tiny configs: the
  pre-trained model cached, 2 steps per dataset)."""
  monkeypatch.setenv(preemption.KILL_HOOK_ENV, "train_step:3:TERM")
  monkeypatch.setattr(preemption, "_event_counts", {})
  with pytest.raises(preemption.Preempted):
    experiment.run(config, workdir)
  monkeypatch.delenv(preemption.KILL_HOOK_ENV)


@pytest.mark.slow
def test_corrupted_workdir_resumes_to_the_uninterrupted_result(
  pretrained_cache_dir, tmp_path, monkeypatch, caplog
):
  # One resume meets a stage checkpoint with a flipped bit (stage 1: falls back to stage 0
  # and trains dataset 1 again), a newest step checkpoint with 64 bytes changed (falls back
  # to step 1 of dataset 2) and a cut results.json (rebuilt from the checkpoints). The result
  # equals the uninterrupted run's.
  config = tiny_config("uniform", pretrained_cache_dir)
  config.checkpoint.every_steps = 1
  # The second run compiles nothing; fewer evaluations between datasets (the last stage
  # still evaluates every set).
  config.compilation_cache_dir = str(tmp_path / "xla")
  config.eval.pretraining_sets_after_each_dataset = False
  config.eval.downstream_after_each_dataset = "seen"
  experiment.run(config, str(tmp_path / "ref"))
  workdir = str(tmp_path / "run")
  _stop_in_dataset_2(config, workdir, monkeypatch)
  step_dirs = sorted(os.listdir(os.path.join(workdir, "step_checkpoints")))
  assert step_dirs == [str(2 * checkpointing.PHASE_STRIDE + s) for s in (1, 2)]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", "1"]
  _flip_bit(os.path.join(workdir, "checkpoints", "1"))
  _flip_64_bytes(os.path.join(workdir, "step_checkpoints", step_dirs[1]))
  with open(os.path.join(workdir, "results.json"), "r+") as f:
    f.truncate(100)

  trained = []
  original = trainer.train_on_dataset
  monkeypatch.setattr(
    trainer, "train_on_dataset", lambda *a, **k: (trained.append(a[1].name), original(*a, **k))[1]
  )
  with caplog.at_level(logging.WARNING):
    got = experiment.run(config, workdir)
  assert trained == ["thermal", "digits"]
  assert "stage 1 failed its integrity check" in caplog.text
  assert "falling back to step 1 of phase 2" in caplog.text
  assert got["status"] == "complete"
  # Compared through results.json (NaN metrics stored as null), every metric, training
  # summary and buffer figure exactly.
  with open(os.path.join(tmp_path, "ref", "results.json")) as f:
    expected = comparable(json.load(f))
  with open(os.path.join(workdir, "results.json")) as f:
    assert comparable(json.load(f)) == expected
  names = os.listdir(workdir)
  assert any(n.startswith("results.json.corrupt-") for n in names)
  assert any(n.startswith("1.corrupt-") for n in os.listdir(os.path.join(workdir, "checkpoints")))


def _reported(error, capsys):
  """main's report of `error`: (exit status, stderr); a known error, without a traceback."""
  assert isinstance(error, main.known_errors())
  with pytest.raises(SystemExit) as exited:
    main.fail(error)
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return exited.value.code, err


def test_unreadable_run_json_is_named(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  config = tiny_config("swil", str(tmp_path / "cache"))
  experiment.check_workdir(workdir, config)
  run_file = os.path.join(workdir, "run.json")
  with open(run_file, "w") as f:
    f.write('{"run_id": "ab')  # cut
  with pytest.raises(ConfigError) as raised:
    experiment.run(config, workdir)
  status, err = _reported(raised.value, capsys)
  assert status == 2
  # One config check's problem (validation.workdir_problem), before any work: one line.
  assert f"error: invalid config: workdir {workdir}: {run_file} cannot be read (" in err
  assert err.count("\n") == 1
  assert "restore it to resume, or use another --workdir" in err
  with pytest.raises(ConfigError, match=r"run\.json cannot be read \(Unterminated string"):
    experiment.existing_run(workdir, config)
  with open(run_file) as f:
    assert f.read() == '{"run_id": "ab'  # untouched


def test_unreadable_results_json_beside_this_runs_run_json_is_not_refused(tmp_path):
  workdir = str(tmp_path)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    f.write("\0" * 64)
  # Without a run.json it cannot be attributed: refused; with this run's: rebuilt.
  assert "which cannot be read" in validation.foreign_results_problem(workdir)
  experiment.check_workdir(workdir, load_config("swil"))
  assert validation.foreign_results_problem(workdir) == ""


def test_full_disk_and_bad_checkpoint_are_one_line(tmp_path, capsys):
  full = checkpointing.DiskFullError(str(tmp_path), 3 * 2**30, 2**29, "the checkpoint of stage 2")
  status, err = _reported(full, capsys)
  assert status == 2
  assert err == (
    f"error: no space left for the checkpoint of stage 2 in {tmp_path} (device mounted at "
    f"{utils.mount_point(str(tmp_path))}: about 3072.0 MiB needed, 512.0 MiB free); free space "
    "on that device and run the same command to resume (the last committed checkpoint is "
    "kept)\n"
  )
  bad = integrity.IntegrityError(str(tmp_path / "f"), "SHA-256 differs from the manifest")
  assert _reported(bad, capsys) == (
    2,
    f"error: {tmp_path / 'f'}: SHA-256 differs from the manifest\n",
  )


def test_kill_before_orbax_renames_a_write_loses_only_that_write(tmp_path):
  # docs/stored_state.md "Known limits": a write killed while orbax writes its temporary folder
  # (`<id>.orbax-checkpoint-tmp`, renamed to `<id>` once complete) is removed when the
  # checkpointer next opens the folder; the committed checkpoint before it is used.
  folder = str(tmp_path / "steps")
  steps = checkpointing.StepCheckpointer(folder, every_steps=1)
  steps.save(1, 1, {"tree": _tree(1)}, {})
  steps.close()
  killed = os.path.join(folder, f"{checkpointing.PHASE_STRIDE + 2}.orbax-checkpoint-tmp")
  os.makedirs(os.path.join(killed, "tree"))
  with open(os.path.join(killed, "tree", "part"), "wb") as f:
    f.write(b"\0" * 100)
  resumed = checkpointing.StepCheckpointer(folder, every_steps=1)
  assert resumed.latest(1) == 1
  # Orbax removes it in the background from opening the folder and awaits that removal
  # before its next save (under load the listing could come first): list after one.
  resumed.save(1, 3, {"tree": _tree(3)}, {})
  resumed.close()
  assert sorted(os.listdir(folder)) == [str(checkpointing.PHASE_STRIDE + s) for s in (1, 3)]

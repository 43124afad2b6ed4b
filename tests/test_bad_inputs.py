"""Bad inputs: each is refused before any work with one message naming the culprit.

Every case checks the exit status `owl_cl.main` gives it, that the message names the field
and value (or the path, pid, host), and that a workdir that already held files is unchanged
byte for byte (nothing is written for a refused run). Most cases call `experiment.run`
in-process and map the error through `main.fail` (a subprocess costs seconds of JAX import
each); a few go through `python -m owl_cl.main` end to end.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from owl_cl import experiment
from owl_cl import main
from owl_cl import trainer
from owl_cl import utils
from owl_cl import validation
from owl_cl.testing.configs import tiny_config
from owl_cl.validation import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(folder) -> dict[str, bytes]:
  """Every file below `folder` (relative path -> bytes)."""
  files = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        files[os.path.relpath(path, folder)] = f.read()
  return files


@pytest.fixture
def workdir(tmp_path):
  """A workdir that already holds a file (it must survive every refused run untouched)."""
  path = tmp_path / "workdir"
  path.mkdir()
  (path / "notes.txt").write_text("kept\n")
  return str(path)


def refuse(config, workdir, capsys) -> tuple[int, str]:
  """Runs `config` in `workdir`; returns (main's exit status, its message) of the error."""
  before = snapshot(workdir) if os.path.isdir(workdir) else None
  with pytest.raises(main.known_errors()) as raised:
    experiment.run(config, workdir)
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  err = capsys.readouterr().err
  assert "Traceback" not in err
  if before is not None:
    assert snapshot(workdir) == before
  assert not os.path.exists(config.cache_dir)  # refused before any cache was touched
  return exited.value.code, err


# (field, bad value, text the message must hold)
BAD_FIELDS = [
  ("train.batch_size", 0, "config.train.batch_size=0 must be >= 1"),
  ("train.num_epochs", 0, "config.train.num_epochs=0 must be >= 1"),
  ("train.learning_rate", -1.0, "config.train.learning_rate=-1.0 must be > 0"),
  ("train.learning_rate", math.inf, "config.train.learning_rate=inf must be a finite number"),
  ("pretrain.learning_rate", 0.0, "config.pretrain.learning_rate=0.0 must be > 0"),
  ("pretrain.batch_size", 0, "config.pretrain.batch_size=0 must be >= 1"),
  ("pretrain.num_steps", 0, "config.pretrain.num_steps=0 must be >= 1"),
  ("replay.ratio", -1.0, "config.replay.ratio=-1.0 must be > 0"),
  ("replay.selection.loss_threshold", math.nan, "loss_threshold=nan must be a finite"),
  ("replay.loss_adaptivity.threshold", math.nan, "adaptivity.threshold=nan must be a finite"),
  ("max_eval_images", 0, "config.max_eval_images=0 must be >= 1 or None"),
  ("max_train_steps_per_dataset", 0, "config.max_train_steps_per_dataset=0 must be >= 1"),
  ("train.eps", 0.0, "config.train.eps=0.0 must be > 0"),
  ("train.layerwise_decay", 1.5, "config.train.layerwise_decay=1.5 must be in (0, 1]"),
  ("replay.dedup_fraction", 0.0, "config.replay.dedup_fraction=0.0 must be in (0, 1]"),
  ("data.eval_batch_size", 0, "config.data.eval_batch_size=0 must be >= 1"),
  ("eval.top_k", 0, "config.eval.top_k=0 must be >= 1"),
  ("checkpoint.max_to_keep", 0, "config.checkpoint.max_to_keep=0 must be >= 1"),
]


@pytest.mark.parametrize("field,value,expected", BAD_FIELDS, ids=[f[0] for f in BAD_FIELDS])
def test_out_of_range_field_is_refused(field, value, expected, tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  section, _, name = field.rpartition(".")
  (_node(config, section) if section else config)[name] = value
  status, err = refuse(config, workdir, capsys)
  assert status == main.EXIT_BAD_INPUT
  assert expected in err


def _node(config, dotted):
  for part in dotted.split("."):
    config = config[part]
  return config


def test_every_bad_field_is_listed_in_one_error(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.train.batch_size = 0
  config.train.learning_rate = -1.0
  config.replay.ratio = -1.0
  config.max_eval_images = 0
  config.train.per_dataset.thermal = {"learning_rate": math.nan}
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert "invalid config (5 problems)" in err
  for text in (
    "train.batch_size=0",
    "train.learning_rate=-1.0",
    "replay.ratio=-1.0",
    "max_eval_images=0",
    "config.train.per_dataset.thermal.learning_rate=nan",
  ):
    assert text in err


def test_batch_not_divisible_by_the_devices():
  config = tiny_config("swil", "/nonexistent")
  config.train.batch_size = 6
  assert validation.range_problems(config, num_devices=3) == [
    "config.pretrain.batch_size=8 is not divisible by the 3 devices; use a multiple of 3"
  ]
  assert validation.range_problems(config, num_devices=4) == [
    "config.train.batch_size=6 is not divisible by the 4 devices; use a multiple of 4"
  ]


def test_defaults_and_paper_config_are_valid():
  from owl_cl.testing.configs import load_config  # pylint: disable=g-import-not-at-top

  assert validation.range_problems(load_config("swil"), num_devices=1) == []
  assert validation.range_problems(load_config("swil", "paper"), num_devices=1) == []


def test_workdir_below_a_file_is_refused(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  config = tiny_config("swil", str(tmp_path / "cache"))
  status, err = refuse(config, str(blocker / "run"), capsys)
  assert status == 2
  assert f"{blocker} is a file, not a folder" in err
  assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_workdir_parent_is_refused(tmp_path, capsys):
  parent = tmp_path / "ro"
  parent.mkdir(mode=0o555)
  config = tiny_config("swil", str(tmp_path / "cache"))
  status, err = refuse(config, str(parent / "run"), capsys)
  assert status == 2
  assert f"{parent} is not writable" in err


@pytest.mark.parametrize("junk", ["notes.txt", "params/garbage.bin"])
def test_init_checkpoint_folder_of_junk_is_refused(junk, tmp_path, workdir, capsys):
  folder = tmp_path / "ckpt"
  (folder / junk).parent.mkdir(parents=True, exist_ok=True)
  (folder / junk).write_text("junk")
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.init_checkpoint = str(folder)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"config.init_checkpoint={folder} is " in err
  assert "no checkpoint" in err or "no orbax _METADATA" in err


def test_missing_init_checkpoint_is_refused(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.init_checkpoint = str(tmp_path / "nowhere")
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"config.init_checkpoint={tmp_path / 'nowhere'} does not exist" in err


def test_unknown_algorithm_is_refused(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.replay.algorithm = "swill"
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert "config.replay.algorithm='swill' is unknown" in err


def test_unknown_loss_adaptivity_mode_is_refused(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.replay.loss_adaptivity.mode = "sometimes"
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert "config.replay.loss_adaptivity.mode='sometimes' is unknown" in err


def test_workdir_of_another_config_is_refused_unchanged(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  with open(os.path.join(workdir, "run.json"), "w") as f:
    json.dump({"run_id": "abc", "config": {"seed": 7}}, f)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"workdir {workdir} holds a run of a different config" in err


def test_training_set_smaller_than_a_batch_is_refused():
  config = tiny_config("swil", "/nonexistent")
  dataset = lambda name, n: types.SimpleNamespace(name=name, train=[0] * n, valid=None)
  bench = types.SimpleNamespace(sequence=[dataset("a", 16), dataset("b", 0)])
  with pytest.raises(ConfigError, match=r"config.train.batch_size=8 is larger .*\['b \(0\)'\]"):
    validation.check_sequence_config(config, bench)


def hold_lock(workdir: str, pid: int, host: str):
  """Takes the workdir's flock like a running owl_cl process would; returns the open fd."""
  fd = os.open(os.path.join(workdir, utils.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  os.write(fd, json.dumps({"pid": pid, "host": host, "started": "then"}).encode())
  return fd


def test_workdir_in_use_is_refused_in_process(tmp_path, workdir, capsys):
  fd = hold_lock(workdir, 4242, "node-7")
  try:
    status, err = refuse(tiny_config("swil", str(tmp_path / "cache")), workdir, capsys)
  finally:
    os.close(fd)
  assert status == 2
  assert f"workdir {workdir} is in use by another run (pid 4242 on host node-7" in err


def test_stale_lock_is_taken_over_with_a_log_line(workdir, caplog):
  path = os.path.join(workdir, utils.LOCK_FILE)
  with open(path, "w") as f:  # the record of a killed run: its flock went with it
    json.dump({"pid": 999999, "host": socket.gethostname(), "started": "then"}, f)
  with caplog.at_level("WARNING"), utils.workdir_lock(workdir):
    with open(path) as f:
      assert json.load(f)["pid"] == os.getpid()
  assert "taking over the lock of pid 999999" in caplog.text
  with open(path) as f:
    assert f.read() == ""  # a clean end leaves no record: the next run logs nothing


def test_two_runs_on_one_workdir_one_is_refused(tmp_path, workdir):
  """The first run holds the lock (this process); `python -m owl_cl.main` is refused."""
  fd = hold_lock(workdir, os.getpid(), socket.gethostname())
  before = snapshot(workdir)
  try:
    result = run_main(tmp_path, workdir)
  finally:
    os.close(fd)
  assert result.returncode == 2, result.stderr
  assert f"pid {os.getpid()} on host {socket.gethostname()}" in result.stderr
  assert "Traceback" not in result.stderr
  assert snapshot(workdir) == before


def run_main(tmp_path, workdir, *overrides) -> subprocess.CompletedProcess:
  """`python -m owl_cl.main --config=configs/no_replay.py` with a tiny built-in benchmark."""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  command = [
    sys.executable,
    "-m",
    "owl_cl.main",
    f"--config={REPO}/configs/no_replay.py",
    f"--workdir={workdir}",
    f"--config.cache_dir={tmp_path / 'cache'}",
    "--config.compilation_cache_dir=",
    *overrides,
  ]
  return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_main_bad_fields_exit_2_without_traceback(tmp_path, workdir):
  before = snapshot(workdir)
  result = run_main(tmp_path, workdir, "--config.train.batch_size=0", "--config.replay.ratio=-1")
  assert result.returncode == 2
  assert "config.train.batch_size=0 must be >= 1" in result.stderr
  assert "config.replay.ratio=-1.0 must be > 0" in result.stderr
  assert "Traceback" not in result.stderr
  assert snapshot(workdir) == before


def test_main_config_typo_is_one_line(tmp_path, workdir):
  before = snapshot(workdir)
  result = run_main(tmp_path, workdir, "--config.train.batchsize=4")
  assert result.returncode == 2
  assert "unknown config field in the command line: 'batchsize'" in result.stderr
  assert 'Did you mean "batch_size"' in result.stderr
  assert "Traceback" not in result.stderr
  assert snapshot(workdir) == before


def test_non_finite_loss_names_phase_step_and_value():
  trainer.check_finite({"loss": 0.5, "grad_norm": 3.0}, "dataset 1: thermal", 20, 3e-4)
  with pytest.raises(trainer.TrainingDivergedError) as raised:
    trainer.check_finite({"loss": 0.5, "grad_norm": math.inf}, "dataset 1: thermal", 20, 1e6)
  message = str(raised.value)
  assert "training diverged in dataset 1: thermal at step 20: grad_norm = inf" in message
  assert "lower learning rate (now 1e+06)" in message
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  assert exited.value.code == main.EXIT_DIVERGED


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_outputs_get_a_normal_files_mode(tmp_path, mask, mode):
  old = os.umask(mask)
  try:
    utils.atomic_write_text(str(tmp_path / "results.json"), "{}")
  finally:
    os.umask(old)
  assert os.stat(tmp_path / "results.json").st_mode & 0o777 == mode


def test_stale_temporaries_are_removed_fresh_ones_kept(tmp_path):
  old, fresh = tmp_path / ".tmp_builtin_v3_x", tmp_path / "abc.tmp-123"
  old.mkdir()
  (old / "img.png").write_bytes(b"x")
  fresh.mkdir()
  (tmp_path / "abcdef0123456789").mkdir()  # a finished cache entry
  hour_ago = time.time() - 2 * utils.STALE_TEMPORARY_SECONDS
  for path in (old, old / "img.png"):
    os.utime(path, (hour_ago, hour_ago))
  assert utils.remove_stale_temporaries(str(tmp_path)) == [str(old)]
  assert sorted(os.listdir(tmp_path)) == ["abc.tmp-123", "abcdef0123456789"]


def test_compilation_cache_follows_cache_dir(tmp_path):
  from owl_cl.testing.configs import load_config  # pylint: disable=g-import-not-at-top

  config = load_config("swil")
  config.cache_dir = str(tmp_path)
  assert experiment.compilation_cache_dir(config) == str(tmp_path / "xla")
  config.compilation_cache_dir = ""
  assert experiment.compilation_cache_dir(config) == ""


def test_step_loop_stops_at_the_first_logged_non_finite_loss(monkeypatch):
  """The loop's own host fetch (every `log_every_steps` steps) carries the guard."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from owl_cl.replay import setup as replay_setup  # pylint: disable=g-import-not-at-top

  batch = {name: np.zeros((1,)) for name in trainer.MODEL_INPUTS}
  detector = types.SimpleNamespace(
    config=types.SimpleNamespace(train=types.SimpleNamespace(log_every_steps=2)),
    train_batches=lambda source, **kwargs: iter([batch] * 8),
    mesh=None,
  )
  monkeypatch.setattr(trainer.sharding_lib, "shard_batch", lambda batch, mesh: batch)
  steps, logged = [], []

  def train_step(state, inputs, replay_inputs, key):
    steps.append(len(steps) + 1)
    return state, {"loss": np.float32(math.nan if len(steps) >= 3 else 1.0)}

  loop = trainer.LoopState(train_state=None, replay_state=None, key=jax.random.PRNGKey(0))
  with pytest.raises(trainer.TrainingDivergedError, match="in pre-training at step 4: loss = nan"):
    trainer.train_loop(
      detector,
      loop,
      train_step=train_step,
      replay=replay_setup.NoReplay(),
      source=None,
      batch_size=1,
      data_seed=0,
      total_steps=8,
      num_epochs=1,
      desc="pre-training",
      on_log=lambda loop, metrics: logged.append(loop.step) or {},
      learning_rate=1e6,
    )
  assert steps == [1, 2, 3, 4] and logged == [2]  # stopped at step 4, nothing logged after


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
  """A tiny copy of the paper's data layout (2 ODinW datasets, Objects365, LVIS)."""
  from owl_cl.testing import fake_data  # pylint: disable=g-import-not-at-top

  root = str(tmp_path_factory.mktemp("data"))
  fake_data.write_fake_odinw(root, ("Pothole", "Dice"), num_images=dict(train=4, val=2, test=4))
  fake_data.write_fake_objects365(root, num_images=dict(train=8, val=4))
  fake_data.write_fake_lvis(root, num_images=dict(train=2, val=4))
  return root


def test_invalid_annotation_json_is_refused_before_the_run_is_claimed(
  fake_root, tmp_path, workdir, capsys
):
  from owl_cl.testing.configs import load_config  # pylint: disable=g-import-not-at-top

  config = load_config("swil", "paper")
  config.data.root = fake_root
  config.data.odinw_datasets = ("Pothole", "Dice")
  config.init_checkpoint = str(tmp_path / "weights.msgpack")
  open(config.init_checkpoint, "w").close()  # exists; never read: the data check comes first
  config.cache_dir = str(tmp_path / "cache")
  config.model.variant, config.model.tokenizer = "tiny", "word_hash"
  annotations = os.path.join(fake_root, "odinw/pothole/train/annotations_without_background.json")
  with open(annotations) as f:
    good = f.read()
  before = snapshot(workdir)
  try:
    with open(annotations, "w") as f:
      f.write(good[:50])
    with pytest.raises(main.known_errors()) as raised:
      experiment.run(config, workdir)
  finally:
    with open(annotations, "w") as f:
      f.write(good)
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  assert exited.value.code == 2
  assert f"{annotations}: not valid json" in capsys.readouterr().err
  # The files already there are unchanged: the declared datasets are checked before the
  # workdir is locked (no lock file; an empty one if a later check refused it), and no
  # run.json, so the corrected command is not refused as another config.
  after = snapshot(workdir)
  assert after.pop(utils.LOCK_FILE, b"") == b""
  assert after == before

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
import logging
import math
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from owl_cl import config_rules
from owl_cl import experiment
from owl_cl import main
from owl_cl import trainer
from owl_cl import utils
from owl_cl import validation
from owl_cl.config_fields import ConfigError
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.files import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  ("replay.budget", 1.5, "config.replay.budget=1.5 must be None, a fraction in (0, 1]"),
  ("replay.budget", 0, "config.replay.budget=0 must be >= 1 (an image count), or None, or a"),
  ("train.lwf.temperature", 0.0, "config.train.lwf.temperature=0.0 must be > 0"),
  ("train.lwf.weight", -1.0, "config.train.lwf.weight=-1.0 must be >= 0"),
  ("train.wise_ft.alpha", 1.5, "config.train.wise_ft.alpha=1.5 must be in [0, 1]"),
  ("train.wise_ft.when", "both", "config.train.wise_ft.when='both' is unknown; known:"),
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
  ("task_order", "random_99", "config.task_order='random_99' is no stored order (names: canon"),
  ("seeds.retrieval", -1, "config.seeds.retrieval=-1 must be >= 0 or None"),
  ("train.schedule", "parallel", "config.train.schedule='parallel' is unknown; known: ['seq"),
  # jax.random.PRNGKey raised OverflowError on it after run.json was written (issue 45, item 3).
  ("seed", 2**63, "config.seed=9223372036854775808 must be <= 4294966 (config.seed stands in"),
  ("pretrain.num_steps", 10**9, "config.pretrain.num_steps=1000000000 must be <= 999999999"),
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


@pytest.mark.parametrize(
  "frozen, expected",
  [
    (("text/.*",), "config.train.frozen: patterns ['text/.*'] match no parameter path"),
    (("heads_only", "("), "config.train.frozen=('heads_only', '(') '(' is neither a preset"),
  ],
)
def test_bad_frozen_pattern_is_refused(frozen, expected, tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.train.frozen = frozen
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert expected in err


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
  bench = types.SimpleNamespace(
    sequence=[dataset("a", 16), dataset("b", 0)], pretrain=dataset("pretrain", 8)
  )
  with pytest.raises(ConfigError, match=r"config.train.batch_size=8 is larger .*\['b \(0\)'\]"):
    validation.check_sequence_config(config, bench)


def test_pretraining_set_smaller_than_a_batch_is_refused():
  """`--config.data.builtin.num_pretrain_train=2` with batch 16 hung at 'pre-training: 0/40'
  after run.json was written (issue 45, item 4): refused with the data checks, unless an
  init checkpoint replaces pre-training."""
  config = tiny_config("swil", "/nonexistent")
  config.pretrain.batch_size = 16
  dataset = lambda name, n: types.SimpleNamespace(name=name, train=[0] * n, valid=None)
  bench = types.SimpleNamespace(sequence=[dataset("a", 16)], pretrain=dataset("pretrain", 2))
  assert validation.split_size_problems(config, bench) == [
    "config.pretrain.batch_size=16 is larger than the pre-training set's training split "
    "(pretrain, 2 images): not one pre-training step could be taken; lower the batch size, give "
    "the set more images (built-in: config.data.builtin.num_pretrain_train) or set "
    "config.init_checkpoint"
  ]
  bench.pretrain.train = [0] * 16  # exactly one batch: fine
  assert validation.split_size_problems(config, bench) == []
  bench.pretrain.train = [0] * 2
  config.init_checkpoint = "/a/checkpoint"  # no pre-training
  assert validation.split_size_problems(config, bench) == []


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_main_bad_fields_exit_2_without_traceback(tmp_path, workdir):
  before = snapshot(workdir)
  result = run_main(tmp_path, workdir, "--config.train.batch_size=0", "--config.replay.ratio=-1")
  assert result.returncode == 2
  assert "config.train.batch_size=0 must be >= 1" in result.stderr
  assert "config.replay.ratio=-1.0 must be > 0" in result.stderr
  assert "Traceback" not in result.stderr
  assert snapshot(workdir) == before


@pytest.mark.slow
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
    train_spec=types.SimpleNamespace(log_every_steps=2),
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
  with open(config.init_checkpoint, "wb") as f:
    f.write(b"\x80")  # an empty msgpack map; never read: the data check comes first
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
  # The files already there are unchanged, byte for byte: the declared datasets are checked
  # before the workdir is locked (no lock file) and claimed (no run.json, so the corrected
  # command is not refused as another config).
  assert snapshot(workdir) == before


# ----------------------------------------------------------------------------- bad data
# A small own-data run (data.sequence / pretrain / held_out declared as COCO folders) whose
# files the cases below break one at a time. Refused by the data checks before the workdir is
# locked or claimed: the workdir stays byte-for-byte as it was.

CATEGORIES = [dict(id=1, name="cup"), dict(id=2, name="plate")]


def write_split(folder, split: str, num_images: int, ext: str = "png") -> str:
  """`folder/<split>.json` + `folder/images/<split>_<k>.<ext>`: noise images 32x24 (W x H),
  one 8x8 box each, classes alternating. Returns the json's path."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top

  os.makedirs(os.path.join(folder, "images"), exist_ok=True)
  rng = np.random.default_rng(len(split) + num_images)
  images, annotations = [], []
  for k in range(num_images):
    name = f"{split}_{k}.{ext}"
    pixels = rng.integers(0, 256, size=(24, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(os.path.join(folder, "images", name))
    images.append(dict(id=k + 1, file_name=name, height=24, width=32))
    annotations.append(dict(id=k + 1, image_id=k + 1, category_id=k % 2 + 1, bbox=[4, 4, 8, 8]))
  path = os.path.join(folder, f"{split}.json")
  with open(path, "w") as f:
    json.dump(dict(images=images, annotations=annotations, categories=CATEGORIES), f)
  return path


def own_data_config(tmp_path, ext: str = "png"):
  """A tiny config whose three roles are COCO folders below tmp_path/data (8 train images,
  4 test images), so no built-in benchmark or pre-trained model is built before the checks."""
  folder = str(tmp_path / "data")
  split = lambda s: dict(
    annotation_file=os.path.join(folder, f"{s}.json"), image_dir=f"{folder}/images"
  )
  write_split(folder, "train", 8, ext)
  write_split(folder, "test", 4, ext)
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.data.sequence = [
    dict(name="kitchen", kind="coco", train=split("train"), test=split("test"))
  ]
  config.data.pretrain = dict(name="pre", kind="coco", train=split("train"), test=split("test"))
  config.data.held_out = dict(name="held", kind="coco", test=split("test"))
  return config, folder


def edit_json(path, edit) -> None:
  with open(path) as f:
    data = json.load(f)
  edit(data)
  with open(path, "w") as f:
    json.dump(data, f)


def refuse_data(config, workdir, capsys) -> tuple[int, str]:
  """`refuse` for a run refused by the data checks: the workdir is byte-for-byte unchanged
  (not even a lock file is added)."""
  before = snapshot(workdir)
  with pytest.raises(main.known_errors()) as raised:
    experiment.run(config, workdir)
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert snapshot(workdir) == before  # no lock, run.json, checkpoints or results
  return exited.value.code, err


@pytest.mark.parametrize("ext", ["jpg", "png"])
def test_truncated_image_is_refused_before_training(ext, tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path, ext)
  bad = os.path.join(folder, "images", f"train_3.{ext}")
  with open(bad, "rb") as f:
    data = f.read()
  with open(bad, "wb") as f:
    f.write(data[: len(data) // 2])  # the header survives: only decoding the pixels fails
  status, err = refuse_data(config, workdir, capsys)
  assert status == 2
  # Named with its dataset and split (the train split serves two roles: 'kitchen', 'pre').
  assert f"split 'train': {folder}/train.json: cannot decode image {bad} (image id 4)" in err
  assert "truncated" in err or "broken" in err


def test_png_cut_before_iend_is_refused_before_training(tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  bad = os.path.join(folder, "images", "test_1.png")
  with open(bad, "rb") as f:
    data = f.read()
  with open(bad, "wb") as f:
    f.write(data[: data.rindex(b"IEND") - 4])  # every pixel there, the IEND chunk cut off
  status, err = refuse_data(config, workdir, capsys)
  assert status == 2
  assert f"split 'test': {folder}/test.json: cannot decode image {bad} (image id 2)" in err


def test_exif_orientation_reaches_every_split_and_keys_the_caches(tmp_path):
  from owl_cl import benchmark  # pylint: disable=g-import-not-at-top
  from owl_cl import cache_keys  # pylint: disable=g-import-not-at-top
  from owl_cl.data import scan  # pylint: disable=g-import-not-at-top

  config, _ = own_data_config(tmp_path)
  default = benchmark.load_benchmark(config)
  config.data.exif_orientation = "apply"
  applied = benchmark.load_benchmark(config)
  splits = lambda bench: [source for _, _, source in scan.benchmark_splits(bench)]
  assert len(splits(applied)) == 5  # pretrain train + test, held-out test, kitchen train + test
  assert {s.exif_orientation for s in splits(default)} == {"ignore"}
  assert {s.exif_orientation for s in splits(applied)} == {"apply"}
  assert applied.fingerprint != default.fingerprint
  # The pre-trained model's and the buffer's cache keys hold the option.
  source = splits(applied)[0]
  assert cache_keys.buffer_key_material(config, source, {})["data"]["exif_orientation"] == "apply"
  config.data.exif_orientation = "ignore"
  assert cache_keys.buffer_key_material(config, source, {})["data"]["exif_orientation"] == "ignore"
  assert scan.split_key(splits(applied)[0]) != scan.split_key(splits(default)[0])


def test_duplicate_annotation_id_is_refused_before_training(tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  train = os.path.join(folder, "train.json")
  edit_json(train, lambda d: d["annotations"][5].update(id=2))
  status, err = refuse(config, workdir, capsys)  # found when the json is read
  assert status == 2
  assert f"{train}: annotations[5] field 'id' has value 2, which annotations[1] also has" in err


def test_every_bad_image_is_listed_and_a_good_scan_is_cached(tmp_path, workdir, capsys):
  from owl_cl import benchmark  # pylint: disable=g-import-not-at-top
  from owl_cl.data import scan  # pylint: disable=g-import-not-at-top

  config, folder = own_data_config(tmp_path)
  for k in (1, 5):
    with open(os.path.join(folder, "images", f"train_{k}.png"), "wb") as f:
      f.write(b"not a png")
  os.remove(os.path.join(folder, "images", "test_2.png"))
  edit_json(os.path.join(folder, "test.json"), lambda d: d["images"][0].update(width=40))
  # The missing file is found when the json is read (one error for every file of the run).
  status, err = refuse_data(config, workdir, capsys)
  assert (
    status == 2 and "image file not found: " + os.path.join(folder, "images", "test_2.png") in err
  )
  assert "dataset 'held' split 'test'" in err and "dataset 'kitchen' split 'test'" in err
  write_split(folder, "test", 4)  # restored; now the scan finds the rest, all in one error
  edit_json(os.path.join(folder, "test.json"), lambda d: d["images"][0].update(width=40))
  status, err = refuse_data(config, workdir, capsys)
  for k in (1, 5):
    assert f"cannot decode image {folder}/images/train_{k}.png (image id {k + 1})" in err
  assert "decodes to 32x24 (WxH) but the json says width=40 height=24" in err
  # Fixed, the scan passes and records each split under the digest of its content: the
  # train (test) split read in two roles is one content, decoded once.
  write_split(folder, "train", 8)
  write_split(folder, "test", 4)
  bench = benchmark.load_benchmark(config)
  assert validation.check_data(config, bench) == {"scanned": 8 + 4, "cached": 8 + 4 + 4}
  records = os.listdir(tmp_path / "cache" / scan.SCAN_FOLDER)
  assert len([n for n in records if n.endswith(".json")]) == 2  # (and their lock files)
  assert validation.check_data(config, bench) == {"scanned": 0, "cached": 28}
  # A changed image file changes its split's key: the test splits are scanned again.
  with open(os.path.join(folder, "images", "test_0.png"), "ab") as f:
    f.write(b"\0")  # after PNG's IEND chunk: still decodes
  bench = benchmark.load_benchmark(config)
  assert validation.check_data(config, bench) == {"scanned": 4, "cached": 24}


def test_image_decoding_can_be_switched_off(tmp_path):
  config, folder = own_data_config(tmp_path)
  with open(os.path.join(folder, "images", "train_0.png"), "wb") as f:
    f.write(b"not a png")
  from owl_cl import benchmark  # pylint: disable=g-import-not-at-top

  bench = benchmark.load_benchmark(config)
  config.data.validate_images = False
  assert validation.check_data(config, bench) == {"scanned": 0, "cached": 0}
  config.data.validate_images = True
  with pytest.raises(main.known_errors(), match="train_0.png"):
    validation.check_data(config, bench)


# (what is broken, the annotation edit, text the message must hold)
BAD_ANNOTATIONS = [
  ("negative box", dict(bbox=[4, 4, -8, 8]), "value [4, 4, -8, 8] is degenerate"),
  ("zero box", dict(bbox=[4, 4, 0, 8]), "value [4, 4, 0, 8] is degenerate"),
  ("NaN box", dict(bbox=[4, math.nan, 8, 8]), "value [4, nan, 8, 8] is not finite"),
  ("out-of-image box", dict(bbox=[30, 4, 8, 8]), "lies outside the 32x24 (WxH) image by more"),
  ("unknown category", dict(category_id=9), "field 'category_id' has value 9, which is not in"),
]


@pytest.mark.parametrize("case,edit,expected", BAD_ANNOTATIONS, ids=[c[0] for c in BAD_ANNOTATIONS])
def test_bad_annotation_is_refused(case, edit, expected, tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  train = os.path.join(folder, "train.json")
  edit_json(train, lambda d: d["annotations"][2].update(edit))
  status, err = refuse_data(config, workdir, capsys)
  assert status == 2
  assert f"{train}: annotations[2] (id 3" in err and expected in err


def test_every_bad_annotation_of_every_file_is_in_one_error(tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  train, test = (os.path.join(folder, f"{s}.json") for s in ("train", "test"))

  def break_all(data):
    for k, (_, edit, _) in enumerate(BAD_ANNOTATIONS):
      data["annotations"][k].update(edit)

  edit_json(train, break_all)
  edit_json(test, lambda d: d["annotations"][1].update(bbox=[4, 4, 8, -1]))
  status, err = refuse_data(config, workdir, capsys)
  assert status == 2
  for k, (_, _, expected) in enumerate(BAD_ANNOTATIONS):
    assert f"{train}: annotations[{k}] (id {k + 1}" in err and expected in err
  assert f"dataset 'held' split 'test': {test}: annotations[1] (id 2, image_id 2)" in err


def test_empty_category_name_is_refused(tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  for split in ("train", "test"):
    edit_json(os.path.join(folder, f"{split}.json"), lambda d: d["categories"][1].update(name=" "))
  status, err = refuse(config, workdir, capsys)  # found by the config checks: nothing written
  assert status == 2
  assert "class 1 has an empty name ' '" in err and f"{folder}/train.json" in err


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_split_is_refused(split, tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  path = os.path.join(folder, f"{split}.json")
  edit_json(path, lambda d: d.update(images=[], annotations=[]))
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"field '{split}' 'annotation_file': {path} has no images" in err


def test_scan_refuses_an_empty_evaluation_set(tmp_path):
  """Any source kind (here an Objects365-style reader's split) with no images."""
  from owl_cl.data import coco  # pylint: disable=g-import-not-at-top
  from owl_cl.data import scan  # pylint: disable=g-import-not-at-top

  folder = str(tmp_path / "data")
  path = write_split(folder, "val", 0)
  source = coco.CocoSource(path, os.path.join(folder, "images"))
  with pytest.raises(coco.DataError, match=f"dataset 'o365' split 'val': {path} has no images"):
    scan.scan_splits([("o365", "val", source)], None)


def paper_config(fake_root, tmp_path):
  """The paper's protocol on `fake_root` with the tiny model (its checks, not its size)."""
  from owl_cl.testing.configs import load_config  # pylint: disable=g-import-not-at-top

  config = load_config("swil", "paper")
  config.data.root = fake_root
  config.data.odinw_datasets = ("Pothole", "Dice")
  config.init_checkpoint = str(tmp_path / "weights.msgpack")
  with open(config.init_checkpoint, "wb") as f:
    f.write(b"\x80")  # an empty msgpack map; never read: the data checks come first
  config.cache_dir = str(tmp_path / "cache")
  config.model.variant, config.model.tokenizer = "tiny", "word_hash"
  return config


def test_empty_category_name_in_objects365_is_refused(fake_root, tmp_path, workdir, capsys):
  config = paper_config(fake_root, tmp_path)
  from owl_cl.data import pretraining  # pylint: disable=g-import-not-at-top

  path, _ = pretraining.objects365_paths(fake_root, "val")
  with open(path) as f:
    good = f.read()
  try:
    edit_json(path, lambda d: d["categories"][0].update(name=""))
    status, err = refuse_data(config, workdir, capsys)
  finally:
    with open(path, "w") as f:
      f.write(good)
  assert status == 2
  assert f"split 'val': {path}: category id " in err and "has an empty name ''" in err


def test_paper_protocol_without_data_root_is_refused(tmp_path, workdir, capsys):
  from owl_cl.testing.configs import load_config  # pylint: disable=g-import-not-at-top

  config = load_config("swil", "paper")
  config.cache_dir = str(tmp_path / "cache")
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert "config.data.root is not set (the folder holding odinw/, objects365/, lvis/)" in err
  config.data.root = str(tmp_path / "nowhere")
  status, err = refuse(config, workdir, capsys)
  assert f"{tmp_path / 'nowhere'} (config.data.root)" in err


def test_paper_protocol_with_a_wrong_layout_is_refused(tmp_path, workdir, capsys):
  root = tmp_path / "root"
  (root / "ODinW" / "pothole").mkdir(parents=True)  # capitalised: not the expected layout
  config = paper_config(str(root), tmp_path)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"{root}/odinw/pothole" in err and f"{root}/objects365" in err
  assert "expected layout below config.data.root:" in err


def test_workdir_of_another_seed_is_refused_unchanged(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  other = json.loads(config.to_json_best_effort())
  other["seed"] = config.seed + 1
  with open(os.path.join(workdir, "run.json"), "w") as f:
    json.dump({"run_id": "abc", "config": other}, f)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"workdir {workdir} holds a run of a different config (differing fields: ['seed'])" in err


def test_run_begun_before_a_config_field_existed_resumes_at_its_default(tmp_path, workdir):
  # run.json of a run begun before `replay.image_cache` existed: resumed while the field is
  # at its default (None), refused, naming it, once it is set.
  config = tiny_config("swil", str(tmp_path / "cache"))
  older = json.loads(config.to_json_best_effort())
  del older["replay"]["image_cache"]
  with open(os.path.join(workdir, "run.json"), "w") as f:
    json.dump({"run_id": "abc", "config": older}, f)
  assert experiment.existing_run(workdir, config)["run_id"] == "abc"
  config.replay.image_cache = str(tmp_path / "images")
  with pytest.raises(ConfigError, match=r"differing fields: \['replay.image_cache'\]"):
    experiment.existing_run(workdir, config)


@pytest.mark.parametrize("run_json", [False, True])
def test_workdir_with_another_runs_results_is_refused(run_json, tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump({"run_id": "theirs", "stages": []}, f)
  if run_json:  # this config's run.json, but the results are another run's
    with open(os.path.join(workdir, "run.json"), "w") as f:
      json.dump({"run_id": "ours", "config": json.loads(config.to_json_best_effort())}, f)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  if run_json:
    assert f"holds {workdir}/results.json of run 'theirs' but run 'ours' (run.json): another" in err
  else:  # perhaps this very run's, its run.json deleted: not called another run's (issue 45)
    assert f"holds {workdir}/results.json of run 'theirs' but no run.json, which records" in err
    assert "another run's" not in err and "restore run.json to resume that run" in err


def test_unknown_dedup_schedule_is_refused(tmp_path, workdir, capsys):
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.replay.dedup = "sometimes"
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert "config.replay.dedup='sometimes' is unknown; known: ['none', 'epoch', " in err


def save_other_model(path) -> None:
  """An owl_cl parameter checkpoint of the tiny model at another width (vision 32, not 64)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from owl_cl import model as model_lib  # pylint: disable=g-import-not-at-top
  from owl_cl.detector import model_fields  # pylint: disable=g-import-not-at-top
  from owl_cl.model import convert  # pylint: disable=g-import-not-at-top
  from owl_cl.train import checkpointing  # pylint: disable=g-import-not-at-top

  config = tiny_config("swil", "/nonexistent")
  config.model.overrides.vision_width = 32
  like = convert.abstract_params(model_lib.create_model("tiny", **model_fields(config)).config)
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), like)
  checkpointing.save_params(str(path), params, {"model": {"variant": "tiny", "vision_width": 32}})


def test_init_checkpoint_of_another_model_is_refused(tmp_path, workdir, capsys):
  save_other_model(tmp_path / "ckpt")
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.init_checkpoint = str(tmp_path / "ckpt")
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"config.init_checkpoint={tmp_path / 'ckpt'} holds another model: variant 'tiny'" in err
  assert '(meta.json: saved from config.model {"variant": "tiny", "vision_width": 32})' in err
  assert "config.model.variant='tiny' with overrides" in err
  assert "differing: vision_width 32 (checkpoint) vs 64 (config)" in err


def test_loader_names_both_models_too(tmp_path):
  """`pretrained.load_init_checkpoint` (called after the checks) says the same, not orbax's
  tree-structure error."""
  from owl_cl import model as model_lib  # pylint: disable=g-import-not-at-top
  from owl_cl import pretrained  # pylint: disable=g-import-not-at-top
  from owl_cl.detector import model_fields  # pylint: disable=g-import-not-at-top
  from owl_cl.model import convert  # pylint: disable=g-import-not-at-top

  save_other_model(tmp_path / "ckpt")
  config = tiny_config("swil", "/nonexistent")
  like = convert.abstract_params(model_lib.create_model("tiny", **model_fields(config)).config)
  with pytest.raises(convert.CheckpointMismatchError, match="vision_width 32 .checkpoint. vs 64"):
    pretrained.load_init_checkpoint(str(tmp_path / "ckpt"), like, "the tiny config")


@pytest.mark.slow
def test_main_init_checkpoint_of_another_model_exits_2(tmp_path, workdir):
  save_other_model(tmp_path / "ckpt")
  before = snapshot(workdir)
  result = run_main(tmp_path, workdir, f"--config.init_checkpoint={tmp_path / 'ckpt'}")
  assert result.returncode == 2, result.stderr
  assert f"config.init_checkpoint={tmp_path / 'ckpt'} holds another model" in result.stderr
  assert "Traceback" not in result.stderr
  assert snapshot(workdir) == before


def test_scan_lists_bad_images_of_every_block_in_order(tmp_path, monkeypatch):
  from owl_cl.data import coco  # pylint: disable=g-import-not-at-top
  from owl_cl.data import scan  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(scan, "_BLOCK", 3)  # 8 images: blocks [0-2], [3-5], [6-7]
  folder = str(tmp_path / "data")
  path = write_split(folder, "train", 8)
  for k in (7, 1, 4):
    with open(os.path.join(folder, "images", f"train_{k}.png"), "wb") as f:
      f.write(b"")
  source = coco.CocoSource(path, os.path.join(folder, "images"))
  with pytest.raises(coco.DataError) as raised:
    scan.scan_splits([("d", "train", source)], str(tmp_path / "cache"), num_threads=2)
  bad = [line for line in str(raised.value).split("\n") if "cannot decode image" in line]
  assert [line.split("(image id ")[1][0] for line in bad] == ["2", "5", "8"]


def test_hf_init_checkpoint_of_another_model_is_refused(tmp_path, workdir, capsys):
  """Told from its config.json alone: the weights (absent here) are never read."""
  from owl_cl import model as model_lib  # pylint: disable=g-import-not-at-top
  from owl_cl.detector import model_fields  # pylint: disable=g-import-not-at-top
  from owl_cl.model import convert  # pylint: disable=g-import-not-at-top

  other = tiny_config("swil", "/nonexistent")
  other.model.overrides.vision_layers = 2
  hf = convert.model_config_to_hf_config(
    model_lib.create_model("tiny", **model_fields(other)).config
  )
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text(hf.to_json_string())
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.init_checkpoint = str(folder)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"config.init_checkpoint={folder} holds another model: variant 'tiny' with" in err
  assert "(its config.json)" in err
  assert "differing: vision_layers 2 (checkpoint) vs 1 (config)" in err


# ----------------------------------------------------------------------------- every field
# Issue 33 items 3 and 5: every field is checked before any work, one line naming the field
# and the value, exit status 2, and the workdir left free (no run.json, results.json or lock):
# the corrected command then starts as if the failed one had never run.


def config_leaves(config, prefix: str = ""):
  """Dotted paths of every leaf of `config`; a field with a rule of its own (a dict-valued
  one such as `model.overrides` or a declared dataset entry) is one leaf."""
  for key in config.keys():
    path = prefix + key
    value = config[key]
    if hasattr(value, "keys") and path not in config_rules.FIELD_RULES:
      yield from config_leaves(value, path + ".")
    else:
      yield path


@pytest.mark.parametrize("arg", ["", "paper", "paper,released", "owlv2", "builtin1", "builtin2"])
def test_every_config_field_has_a_rule(arg):
  from owl_cl.configs import base  # pylint: disable=g-import-not-at-top

  config = base.get_config(arg)
  leaves = list(config_leaves(config))
  assert len(leaves) >= 137  # every section walked (137 leaves in '' when written)
  assert [p for p in leaves if p not in config_rules.FIELD_RULES] == []
  # The defaults pass their own rules: a rule that refuses every value cannot hide here.
  assert validation.range_problems(config, num_devices=1) == []
  assert validation.model_problems(config) == [] and validation.augment_problems(config) == []


def test_every_model_field_has_an_override_rule():
  from owl_cl.model import owl_vit  # pylint: disable=g-import-not-at-top

  fields = set(owl_vit.ModelConfig.__dataclass_fields__)
  assert set(config_rules.MODEL_OVERRIDE_RULES) == fields
  for variant in owl_vit.VARIANTS:
    config = owl_vit.get_variant_config(variant)
    for name, rule in config_rules.MODEL_OVERRIDE_RULES.items():
      if name != "dtype":  # a jnp type in ModelConfig; config.model.dtype names it
        assert rule(config[name]) == "", (variant, name)


def with_field(config, path: str, value):
  """`config` with `path` set to `value`, past ml_collections' type check (a config file or
  a None-valued field can hold any type: the rules must catch it)."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  tree = config.to_dict()
  node = tree
  *parents, name = path.split(".")
  for part in parents:
    node = node[part]
  node[name] = value
  return ml_collections.ConfigDict(tree)


def write_npy(tmp_path) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "weights.npy")
  np.save(path, np.zeros(3, np.float32))
  return path


def hf_folder(tmp_path) -> str:
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text("{}")
  return str(folder)


def vocab_folder_without_merges(tmp_path) -> str:
  folder = tmp_path / "vocab"
  folder.mkdir()
  (folder / "vocab.json").write_text('{"a": 0}')
  return str(folder)


# (case, {field: value} or a function (config, tmp_path) -> config, text the one line holds)
MEASURED_CASES = [
  (
    "image size not a multiple of the patch",
    {"model.overrides.image_size": 100},
    "config.model.overrides.image_size=100 is not a multiple of the patch size patch_size=8 "
    "(of variant 'tiny')",
  ),
  ("patch size 0", {"model.overrides.patch_size": 0}, "overrides.patch_size=0 must be >= 1"),
  (
    "unknown model field",
    {"model.overrides.vision_depth": 2},
    "config.model.overrides.vision_depth=2: no such model field; known: [",
  ),
  ("variant", {"model.variant": "vit_h14"}, "config.model.variant='vit_h14' is unknown; known:"),
  ("tokenizer", {"model.tokenizer": "bert"}, "config.model.tokenizer='bert' is unknown; known:"),
  ("remat", {"model.remat": "blocks"}, "config.model.remat='blocks' is unknown; known: ['none'"),
  ("attention", {"model.attention": "flash"}, "config.model.attention='flash' is unknown"),
  (
    "unknown built-in dataset",
    {"data.builtin.downstream": ("thermal", "sketch")},
    "downstream=('thermal', 'sketch') names unknown built-in datasets ['sketch']; known:",
  ),
  (
    "duplicated built-in dataset",
    {"data.builtin.downstream": ("thermal", "digits", "thermal")},
    "config.data.builtin.downstream=('thermal', 'digits', 'thermal') names ['thermal'] more",
  ),
  (
    "empty built-in sequence",
    {"data.builtin.downstream": ()},
    "config.data.builtin.downstream=() is empty; name at least one built-in dataset",
  ),
  ("negative seed", {"seed": -1}, "config.seed=-1 must be >= 0"),
  (
    "mosaic size 0",
    {"data.augment.mosaic_sizes": (0, 2)},
    "config.data.augment.mosaic_sizes=(0, 2) must hold integers >= 1, not [0]",
  ),
  (
    "mosaic lengths differ",
    {"data.augment.mosaic_sizes": (1, 2)},
    "mosaic_sizes=(1, 2) and mosaic_probs=(0.4, 0.3, 0.3) differ in length (2 vs 3)",
  ),
  (
    "reversed crop range",
    {"data.augment.crop_area_range": (1.0, 0.3)},
    "config.data.augment.crop_area_range=(1.0, 0.3) must satisfy 0 < low <= high <= 1",
  ),
  (
    "top_k above the tokens",
    {"replay.top_k": 65},  # the tiny model at 64 px, patch 8: 8 x 8 = 64 tokens
    "config.replay.top_k=65 is more than the 64 image tokens of the model",
  ),
  (
    "sequence as a string",
    {"data.sequence": "thermal"},
    "config.data.sequence='thermal' must be a list of dataset entries / suites or None",
  ),
  (
    "string where an int belongs",
    lambda c, tmp: with_field(c, "data.num_queries", "24"),
    "config.data.num_queries='24' must be an integer",
  ),
  (
    "string where a bool belongs",
    lambda c, tmp: with_field(c, "data.validate_images", "false"),
    "config.data.validate_images='false' must be True or False",
  ),
  (
    "init_checkpoint a .npy",
    lambda c, tmp: with_field(c, "init_checkpoint", write_npy(tmp)),
    "weights.npy is a file but not a scenic msgpack checkpoint (it is a NumPy .npy array)",
  ),
  (
    "CLIP vocabulary without merges.txt",
    lambda c, tmp: with_field(
      with_field(c, "model.tokenizer", "clip"),
      "model.tokenizer_vocab_path",
      vocab_folder_without_merges(tmp),
    ),
    "vocab holds vocab.json but no merges.txt",
  ),
]


@pytest.mark.parametrize("case,change,expected", MEASURED_CASES, ids=[c[0] for c in MEASURED_CASES])
def test_bad_field_is_one_line_and_leaves_the_workdir_free(
  case, change, expected, tmp_path, workdir, capsys
):
  config = tiny_config("swil", str(tmp_path / "cache"))
  if callable(change):
    config = change(config, tmp_path)
  else:
    for path, value in change.items():
      section, _, name = path.rpartition(".")
      (_node(config, section) if section else config)[name] = value
  status, err = refuse(config, workdir, capsys)  # workdir and cache untouched
  assert status == main.EXIT_BAD_INPUT
  assert err.startswith("error: invalid config: ") and err.count("\n") == 1, err
  assert expected in err, err
  assert sorted(os.listdir(workdir)) == ["notes.txt"]  # no run.json, results.json or lock


def test_hf_checkpoint_without_the_hf_extra_is_refused(tmp_path, workdir, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.init_checkpoint = hf_folder(tmp_path)
  status, err = refuse(config, workdir, capsys)
  assert status == 2 and err.count("\n") == 1
  assert (
    f"config.init_checkpoint={tmp_path / 'hf'}: reading an HF checkpoint folder needs the "
    "optional extra 'hf', which is not installed (missing: transformers); "
    "pip install -e '.[hf]'"
  ) in err
  assert sorted(os.listdir(workdir)) == ["notes.txt"]


def test_faster_coco_eval_without_its_extra_is_refused(tmp_path, workdir, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "faster_coco_eval", None)  # as if not installed
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.eval.coco_backend = "faster_coco_eval"
  status, err = refuse(config, workdir, capsys)
  assert status == 2 and err.count("\n") == 1
  assert (
    "config.eval.coco_backend='faster_coco_eval': COCO scoring with it needs the optional "
    "extra 'fast_coco', which is not installed (missing: faster_coco_eval); "
    "pip install -e '.[fast_coco]'"
  ) in err
  assert sorted(os.listdir(workdir)) == ["notes.txt"]


@pytest.mark.parametrize(
  "argv,expected",
  [
    (["--config.data.builtin.downstream=thermal", "--config.data.builtin.downstream=()"], 2),
    (["--config.data.builtin.downstream", "()", "--config.data.builtin.downstream=tiny"], 2),
    (["--config.data.builtin.downstream=thermal", "--config.data.builtin.downstream=tiny"], 0),
    (["--config.data.builtin.downstream=()"], 0),
    (["--config.seed=1", "--config.seed=()"], 0),  # not a tuple field
  ],
)
def test_repeated_tuple_flag_with_a_tuple_is_refused(argv, expected):
  problem = main.repeated_tuple_problem(["main.py", *argv], {"config.data.builtin.downstream"})
  if expected:
    assert problem.startswith(f"--config.data.builtin.downstream is given {expected} times (")
    assert "a later one does not replace an earlier one" in problem
  else:
    assert problem == ""


@pytest.mark.slow
@pytest.mark.parametrize(
  "overrides,expected",
  [
    (
      ["--config.data.builtin.downstream=thermal", "--config.data.builtin.downstream=()"],
      "error: --config.data.builtin.downstream is given 2 times ('thermal', '()'): the values",
    ),
    (
      ["--config.data.num_queries=abc"],
      "error: bad command line: flag --config.data.num_queries=abc: invalid literal for int()",
    ),
    (
      ["--config.data.builtin.downstream=thermal,digits"],
      "error: invalid config: config.data.builtin.downstream=('thermal,digits',) names unknown",
    ),
  ],
  ids=["repeated tuple flag", "string for an int", "unquoted comma list"],
)
def test_main_refuses_a_bad_command_line_in_one_line(overrides, expected, tmp_path, workdir):
  before = snapshot(workdir)
  result = run_main(tmp_path, workdir, *overrides)
  assert result.returncode == 2, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(expected), result.stderr
  assert "Traceback" not in result.stderr
  assert snapshot(workdir) == before
  assert not os.path.exists(tmp_path / "cache")


def test_detector_refusal_leaves_the_workdir_free(tmp_path, workdir, capsys):
  """The detector's own checks (here a CLIP vocabulary larger than the model's) run before
  the workdir is locked or claimed."""
  folder = tmp_path / "vocab"
  folder.mkdir()
  tokens = {"a": 0, "b": 1, "<|startoftext|>": 2, "<|endoftext|>": 3}
  (folder / "vocab.json").write_text(json.dumps(tokens))
  (folder / "merges.txt").write_text("#version: 0.2\n")
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.model.tokenizer = "clip"
  config.model.tokenizer_vocab_path = str(folder)
  config.model.overrides.vocab_size = 2
  status, err = refuse(config, workdir, capsys)
  assert status == 2 and err.count("\n") == 1
  assert "config.model.tokenizer='clip' has 4 ids but the model's vocab_size is 2" in err
  assert sorted(os.listdir(workdir)) == ["notes.txt"]


def test_scenic_checkpoint_of_another_model_leaves_the_workdir_free(tmp_path, workdir, capsys):
  """A scenic file's parameters are known only once read: it is read before the lock and
  run.json, so the corrected command is not refused as another config."""
  import flax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  path = tmp_path / "other.msgpack"
  path.write_bytes(flax.serialization.msgpack_serialize({"params": {"w": np.zeros(2)}}))
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.init_checkpoint = str(path)
  before = snapshot(workdir)
  with pytest.raises(main.known_errors()) as raised:
    experiment.run(config, workdir)
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  assert exited.value.code == 2
  assert str(path) in capsys.readouterr().err
  assert snapshot(workdir) == before  # no run.json, results.json or lock


# ------------------------------------------------------------------------------------------
# Issue 45, items 3-6: integer ranges, data sizes, the last raw tracebacks.
# ------------------------------------------------------------------------------------------


def integer_rules():
  """(field, rule) of every field whose rule is an `integer` one (it carries its bounds)."""
  from owl_cl.config_fields import PER_DATASET_FIELDS  # pylint: disable=g-import-not-at-top

  rules = dict(config_rules.FIELD_RULES)
  rules.update(
    {
      f"train.per_dataset.thermal.{f}": config_rules.TRAIN_FIELD_RULES[f]
      for f in PER_DATASET_FIELDS
    }
  )
  rules.update({f"model.overrides.{f}": r for f, r in config_rules.MODEL_OVERRIDE_RULES.items()})
  return {path: rule for path, rule in rules.items() if hasattr(rule, "maximum")}


def test_every_integer_field_is_bounded_by_its_consumer():
  """Each integer field refuses one past its consumer's bound (and 2**63, the issue's seed),
  naming the bound and the consumer, and takes the bound itself; every int-valued leaf of
  the config has such a rule."""
  from owl_cl.configs import base  # pylint: disable=g-import-not-at-top

  config = base.get_config("")
  # The int-valued leaves, but those naming one of a set of options (data.builtin.version).
  ints = [
    p
    for p in config_leaves(config)
    if isinstance(_field_value(config, p), int)
    and not isinstance(_field_value(config, p), bool)
    and not getattr(config_rules.FIELD_RULES[p], "is_option", False)
  ]
  rules = integer_rules()
  assert len(rules) >= 60 and len(ints) >= 30  # every section walked (66 and 35 when written)
  assert [p for p in ints if p not in rules] == []
  for path, rule in rules.items():
    assert rule(rule.maximum) == "" and rule(rule.minimum) == "", path
    for bad in (rule.maximum + 1, 2**63):
      assert rule(bad) == f"must be <= {rule.maximum} ({rule.why})", (path, bad)
    assert rule(rule.minimum - 1).startswith(f"must be >= {rule.minimum}"), path
    assert rule(math.inf) and rule(math.nan), path  # refused, not an OverflowError
  # Through the config checks: one line per field, each naming the field and the value.
  wide = config.copy_and_resolve_references()
  for path in ints:
    section, _, name = path.rpartition(".")
    (_node(wide, section) if section else wide)[name] = 2**63
  problems = validation.range_problems(wide, num_devices=1)
  assert sorted(p.split("=")[0] for p in problems) == sorted(f"config.{p}" for p in ints)


def _field_value(config, path):
  for part in path.split("."):
    config = config[part]
  return config


def test_seed_bounds_are_where_jax_keys_would_collide():
  """The seed rules' bounds against JAX itself: the largest key a seed at its bound makes is
  kept whole by `jax.random.PRNGKey` ([0, seed]), one more collides with a smaller seed's key
  (the low 32 bits kept), and 2**63 raises (the crash of issue 45)."""
  import jax  # pylint: disable=g-import-not-at-top

  from owl_cl import config_fields as cf  # pylint: disable=g-import-not-at-top

  stride = cf.DATA_KEY_STRIDE
  largest = {
    "data": cf.DATA_SEED.maximum * stride + stride - 1,  # the LoRA key, index stride - 1
    "model": cf.MODEL_SEED.maximum + cf.MODEL_KEY_OFFSETS - 1,
  }
  for part, key in largest.items():
    assert jax.random.PRNGKey(key).tolist() == [0, key], part
  # The largest key of the seed one past each bound.
  past = {
    "data": (cf.DATA_SEED.maximum + 1) * stride + stride - 1,
    "model": cf.MODEL_SEED.maximum + 1 + cf.MODEL_KEY_OFFSETS - 1,
  }
  for part, key in past.items():
    assert key >= 2**32, part
    assert jax.random.PRNGKey(key).tolist() == jax.random.PRNGKey(key - 2**32).tolist(), part
  assert cf.SEED.maximum == min(r.maximum for r in cf.SEED_RULES.values())
  assert cf.STEPS.maximum < cf.PHASE_STRIDE <= 2**31  # a step's id stays in its phase
  with pytest.raises(OverflowError):
    jax.random.PRNGKey(2**63)


def test_pretraining_set_smaller_than_a_batch_leaves_the_workdir_free(tmp_path, workdir, capsys):
  config, _ = own_data_config(tmp_path)  # 8 training images, the pre-training set's too
  config.pretrain.batch_size = 16
  status, err = refuse(config, workdir, capsys)
  assert status == 2 and err.count("\n") == 1
  assert (
    "config.pretrain.batch_size=16 is larger than the pre-training set's training split " in err
  )


def test_budget_larger_than_the_pool_is_refused(tmp_path, workdir, capsys):
  config, _ = own_data_config(tmp_path)
  config.replay.budget = 100000
  status, err = refuse(config, workdir, capsys)
  assert status == 2 and err.count("\n") == 1
  assert (
    "config.replay.budget=100000 images is more than the 8 images of the pre-training set's "
    "training split (pre), the pool the replay buffer is drawn from: give at most 8"
  ) in err


def test_budget_of_the_whole_pool_and_a_fraction_pass():
  config = tiny_config("swil", "/nonexistent")
  dataset = lambda name, n: types.SimpleNamespace(name=name, train=[0] * n, valid=None)
  bench = types.SimpleNamespace(sequence=[dataset("a", 8)], pretrain=dataset("pretrain", 8))
  for budget in (8, 1.0, 0.5):
    config.replay.budget = budget
    assert validation.split_size_problems(config, bench) == [], budget
  config.replay.budget, config.replay.algorithm = 9, "none"  # no buffer: no pool to fit
  assert validation.split_size_problems(config, bench) == []


def test_training_split_without_annotations_is_refused(tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  train = os.path.join(folder, "train.json")
  edit_json(train, lambda d: d.update(annotations=[]))
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"dataset 'kitchen': its training split {train} holds 8 images but no boxes" in err
  assert f"dataset 'pre': its training split {train} holds 8 images but no boxes" in err


def test_evaluation_split_without_annotations_is_not_refused(tmp_path):
  """The rule is for training splits: a test split with no boxes is only evaluated."""
  from owl_cl import benchmark  # pylint: disable=g-import-not-at-top

  config, folder = own_data_config(tmp_path)
  edit_json(os.path.join(folder, "test.json"), lambda d: d.update(annotations=[]))
  bench = benchmark.load_benchmark(config)
  assert validation.split_size_problems(config, bench) == []


def test_string_image_id_is_refused(tmp_path, workdir, capsys):
  config, folder = own_data_config(tmp_path)
  train = os.path.join(folder, "train.json")

  def string_id(data):
    data["images"][0]["id"] = "one"
    data["annotations"][0]["image_id"] = "one"

  edit_json(train, string_id)
  status, err = refuse(config, workdir, capsys)
  assert status == 2
  assert f"{train}: images[0] field 'id' has value 'one' (str): COCO ids are integers" in err


def test_cache_dir_that_is_a_file_is_refused(tmp_path, workdir, capsys):
  blocker = tmp_path / "cache"
  blocker.write_text("x")
  for cache_dir, expected in (
    (blocker, f"config.cache_dir={blocker} is a file, not a folder"),
    (blocker / "sub", f"config.cache_dir={blocker / 'sub'} cannot be created: {blocker} is a file"),
  ):
    config = tiny_config("swil", str(cache_dir))
    before = snapshot(workdir)
    with pytest.raises(ConfigError) as raised:
      experiment.run(config, workdir)
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    assert snapshot(workdir) == before and blocker.read_text() == "x"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_workdir_under_proc_is_refused(tmp_path, capsys):
  """/proc's modes let root pass `os.access`, but no folder can be made there."""
  config = tiny_config("swil", str(tmp_path / "cache"))
  status, err = refuse(config, "/proc/owl_cl_run/run", capsys)
  assert status == 2 and err.count("\n") == 1
  assert "workdir /proc/owl_cl_run/run cannot be created" in err


@pytest.mark.parametrize(
  "config_arg,expected",
  [
    ("configs/nosuch.py", "error: --config={} cannot be loaded: [Errno 2] No such file or"),
    (
      "configs/swil.py:unknownarg",
      "error: bad command line: flag --config={}: Error whilst parsing config file: ValueError: "
      "unknown config argument 'unknownarg'; known: ",
    ),
  ],
  ids=["missing config file", "unknown config argument"],
)
def test_bad_config_flag_is_one_short_line(config_arg, expected, capsys):
  """Parsed in-process by `main.parse_flags` (a subprocess costs seconds): exit 2 with one
  line before `main` runs (nothing written), without the loader's traceback."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  arg = os.path.join(REPO, config_arg)
  absl_level = logging.getLogger("absl").level
  try:
    with pytest.raises(SystemExit) as exited:
      main.parse_flags(["main.py", f"--config={arg}"])
  finally:
    # unparse_flags resets --verbosity to its default, which sets the 'absl' logger to WARNING
    # for the rest of this xdist worker: later tests reading INFO lines (caplog) saw none.
    flags.FLAGS.unparse_flags()
    logging.getLogger("absl").setLevel(absl_level)
  err = capsys.readouterr().err
  assert exited.value.code == 2
  assert err.startswith(expected.format(arg)) and err.count("\n") == 1, err
  assert "Traceback" not in err and len(err) < 300, err  # with the traceback: ~930


def test_builtin_folder_names_are_the_documented_ones():
  """docs/stored_state.md names the built-in benchmark's folder as the code does: the number
  after 'v' is the files' format, not the benchmark's version (version 1 writes v3)."""
  import re  # pylint: disable=g-import-not-at-top

  from owl_cl.data.builtin import benchmark  # pylint: disable=g-import-not-at-top

  fmt = benchmark.FORMAT_VERSION
  assert re.fullmatch(f"builtin_v{fmt}_[0-9a-f]{{12}}", benchmark.BuiltinSpec(version=1).key())
  assert re.fullmatch(f"builtin2_v{fmt}_[0-9a-f]{{12}}", benchmark.BuiltinSpec(version=2).key())
  with open(os.path.join(REPO, "docs", "stored_state.md")) as f:
    row = next(line for line in f if line.startswith("| built-in benchmark |"))
  assert "`builtin_v<format>_<hash>/` (version 1), `builtin2_v<format>_<hash>/` (version 2)" in row
  assert f"is the files' format ({fmt})" in row

"""A full disk names the device that is full (issue 45 item 2), on real small tmpfs mounts.

The cache, the workdir and the compilation cache may sit on three devices: each case fills a
tmpfs (`owl_cl.testing.mounts.small_tmpfs`) holding one of them and checks that the message
names the path written and the tmpfs's mount point, and that `main` reports it as one line
(exit status 2). Skipped where mounting is not permitted (not root).
"""

import contextlib
import errno
import os

import jax
from jax._src import compilation_cache  # reset_cache: no public equivalent
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import experiment
from owl_cl import main
from owl_cl import utils
from owl_cl.replay import store_cache
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.mounts import small_tmpfs
from owl_cl.train import checkpointing


def _one_line(error, capsys) -> str:
  """main's report of `error` (exit status 2, no traceback): its one line."""
  capsys.readouterr()  # what the test printed before (a progress bar)
  with pytest.raises(SystemExit) as exited:
    main.fail(error)
  err = capsys.readouterr().err
  assert exited.value.code == 2 and err.count("\n") == 1
  return err


def test_a_full_cache_is_named_not_the_workdir(tmp_path, capsys):
  # The replay buffer's build writes with NumPy (its ENOSPC names no file), as the
  # pre-trained model's orbax save; before, main blamed the workdir for it.
  with small_tmpfs(str(tmp_path / "cachefs"), 1 << 20) as fs:
    root = os.path.join(fs, "buffers")

    def build(path, build_dir, key):
      os.makedirs(build_dir, exist_ok=True)
      np.save(os.path.join(build_dir, "examples.npy"), np.zeros(1 << 19, np.float32))  # 2 MiB

    with pytest.raises(checkpointing.DiskFullError) as raised:
      store_cache.cached_store(root, {"k": 1}, build)
    entry = os.path.join(root, utils.digest({"k": 1}))
    assert raised.value.errno == errno.ENOSPC
    message = str(raised.value)
    assert message.startswith(f"no space left for the replay buffer in {entry} (device mounted ")
    assert f"(device mounted at {fs}: " in message
    assert _one_line(raised.value, capsys) == f"error: {message}\n"


@pytest.mark.slow
def test_a_full_cache_before_the_run_is_named_and_nothing_is_written(tmp_path, capsys):
  # The built-in benchmark (about 1.5 MB of the tiny config's) does not fit in 256 KiB.
  workdir = tmp_path / "run"
  workdir.mkdir()
  with small_tmpfs(str(tmp_path / "cachefs"), 256 << 10) as fs:
    with pytest.raises(checkpointing.DiskFullError) as raised:
      experiment.run(tiny_config("swil", fs), str(workdir))
    message = str(raised.value)
    assert message.startswith(f"no space left for the built-in benchmark in {fs}/builtin/")
    assert f"(device mounted at {fs}: " in message
    assert not [n for n in os.listdir(os.path.join(fs, "builtin")) if not n.endswith(".lock")]
  assert os.listdir(workdir) == []  # no run.json, no lock
  _one_line(raised.value, capsys)


def test_a_full_workdir_is_named(tmp_path, capsys):
  with small_tmpfs(str(tmp_path / "workfs"), 2 << 20) as fs:
    steps = checkpointing.StepCheckpointer(os.path.join(fs, "step_checkpoints"), every_steps=1)
    big = {"tree": {"w": jnp.zeros(1 << 20, jnp.float32)}}  # 4 MiB
    with pytest.raises(checkpointing.DiskFullError) as raised:
      steps.save(1, 1, big, {})
    steps.close()
    free = checkpointing.free_bytes(fs)
  assert str(raised.value) == (
    f"no space left for the checkpoint of step 1 (phase 1) in {fs}/step_checkpoints (device "
    f"mounted at {fs}: about 5.0 MiB needed, {free / 2**20:.1f} MiB free); free space on that "
    "device and run the same command to resume (the last committed checkpoint is kept)"
  )
  _one_line(raised.value, capsys)


def test_a_full_compilation_cache_is_named_and_read_only(tmp_path, caplog):
  with small_tmpfs(str(tmp_path / "xlafs"), 1 << 20) as fs:
    folder = os.path.join(fs, "xla")
    with caplog.at_level("WARNING"):
      assert experiment.enable_compilation_cache(folder) is False
  assert jax.config.jax_compilation_cache_dir != folder  # no folder there: not used at all
  assert (
    f"the compilation cache {folder} has 1.0 MiB free on the device mounted at {fs} (under 64 "
    "MiB): its programs are read, no new one is written" in caplog.text
  )
  # (conftest's _keep_xla_cache restores the session's settings after the test.)


def test_a_compilation_cache_that_fills_during_a_run_costs_no_run(tmp_path):
  # The gap (docs/errors.md): JAX's cache reports the failed write as a warning that does
  # not name the folder, and the program runs uncached.
  with small_tmpfs(str(tmp_path / "xlafs"), 80 << 20) as fs:
    folder = os.path.join(fs, "xla")
    assert experiment.enable_compilation_cache(folder) is True
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # write every program
    compilation_cache.reset_cache()  # JAX reads the folder again at the next compilation
    with open(os.path.join(fs, "filler"), "wb") as f:  # the device fills
      with contextlib.suppress(OSError):
        while True:
          f.write(b"\0" * (1 << 20))
    with pytest.warns(
      UserWarning,
      match="Error writing persistent compilation cache entry .*No space left on device",
    ):
      value = jax.jit(lambda x: x * 3 + 1)(jnp.arange(5))
    assert value.tolist() == [1, 4, 7, 10, 13]
  # (conftest's _keep_xla_cache restores the session's cache after the test.)

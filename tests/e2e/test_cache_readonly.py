"""A cache read where it cannot be written (issue 45 item 1), on a real read-only bind mount.

Each test fills a cache folder, bind-mounts it read-only (`owl_cl.testing.mounts`: the kernel
refuses every write there with EROFS, as on a cache shared read-only across a cluster), and
reads it there: intact entries are verified and used without the exclusive lock; a missing
or damaged one is named in one line (`utils.ReadOnlyCacheError`) instead of being built.
Skipped where mounting is not permitted (not root).
"""

import errno
import json
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest

from owl_cl import experiment
from owl_cl import integrity
from owl_cl import main
from owl_cl import pretrained
from owl_cl import utils
from owl_cl.data import builtin as B
from owl_cl.data import scan
from owl_cl.replay import images
from owl_cl.replay import store_cache
from owl_cl.replay.retrieval import asv_left
from owl_cl.testing.configs import MINIMAL_BUILTIN
from owl_cl.testing.configs import tiny_config
from owl_cl.testing.files import snapshot
from owl_cl.testing.mounts import read_only_view
from owl_cl.testing.results import comparable

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools")

TINY = MINIMAL_BUILTIN


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> str:
  """A cache folder holding a tiny built-in benchmark (generated once: about 5 s)."""
  folder = str(tmp_path_factory.mktemp("tiny_cache"))
  B.ensure_benchmark(folder, seed=7, progress=False, **TINY)
  return folder


def _copy(folder: str, tmp_path) -> str:
  """A copy of the cache `folder` of this test's own (it may damage it)."""
  return shutil.copytree(folder, str(tmp_path / "cache"))


def test_the_lock_of_a_read_only_cache_yields_false_and_writes_nothing(tmp_path):
  src = tmp_path / "cache"
  (src / "kind").mkdir(parents=True)
  with utils.cache_entry_lock(str(src / "kind" / "entry")) as writable:
    assert writable is True
    (src / "kind" / "entry").write_text("built")
  before = snapshot(str(src))
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    # An entry with its lock file, one without, one whose folder does not exist.
    for entry in ("kind/entry", "kind/other", "missing/entry"):
      with utils.cache_entry_lock(os.path.join(ro, entry), "test entry") as writable:
        assert writable is False
    with open(os.path.join(ro, "kind", "entry")) as f:
      assert f.read() == "built"
  assert snapshot(str(src)) == before  # no lock file, no folder, no record written


def test_a_reader_of_the_read_only_view_waits_for_a_builder_on_the_writable_path(tmp_path, caplog):
  src = tmp_path / "cache"
  src.mkdir()
  entry = str(src / "entry")
  order = []
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:

    def read_it():
      with utils.cache_entry_lock(os.path.join(ro, "entry"), "test entry", poll_s=0.01):
        order.append(("reader", open(os.path.join(ro, "entry")).read()))

    # The 'absl' logger's own level too: a test that parsed absl flags may have left it at
    # WARNING in this process.
    with caplog.at_level("INFO"), caplog.at_level("INFO", logger="absl"):
      with utils.cache_entry_lock(entry, "test entry") as writable:
        assert writable
        # Touched before the reader starts: its lock file exists, so it takes a shared flock.
        reader = threading.Thread(target=read_it)
        reader.start()
        deadline = time.time() + 60
        while "is being built by" not in caplog.text and time.time() < deadline:
          time.sleep(0.01)
        utils.atomic_write_text(entry, "complete")
        order.append(("builder", None))
      reader.join(timeout=30)
  # The reader waited for the builder's exclusive lock, then read the complete entry.
  assert order == [("builder", None), ("reader", "complete")]
  assert f"is being built by pid {os.getpid()}" in caplog.text


def test_a_damaged_entry_that_cannot_be_set_aside_is_named_with_what_to_do(tmp_path, capsys):
  src = tmp_path / "cache"
  src.mkdir()
  (src / "entry.npz").write_bytes(b"garbage")
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    path = os.path.join(ro, "entry.npz")
    with pytest.raises(utils.ReadOnlyCacheError) as raised:
      integrity.set_aside(path, "unreadable (BadZipFile)")
  assert raised.value.errno == errno.EROFS
  assert str(raised.value) == (
    f"cache entry {path} is damaged (unreadable (BadZipFile)), and the cache cannot be written "
    "there (read-only): build it with the same config and a writable cache_dir, then share "
    "that folder, or set --config.cache_dir to a writable folder"
  )
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  assert exited.value.code == 2
  assert capsys.readouterr().err == f"error: {raised.value}\n"
  assert os.listdir(src) == ["entry.npz"]  # left where it was


def test_a_damaged_pre_trained_model_on_a_read_only_cache_is_named(pretrained_cache_dir, tmp_path):
  src = shutil.copytree(os.path.join(pretrained_cache_dir, "pretrained"), str(tmp_path / "cache"))
  (key,) = [n for n in os.listdir(src) if os.path.isdir(os.path.join(src, n))]
  with read_only_view(src, str(tmp_path / "ro")) as ro:
    assert pretrained.check_cached_model(os.path.join(ro, key))  # intact: verified, usable
    listed = sorted(integrity.read_manifest(os.path.join(src, key))["files"])
    with open(os.path.join(src, key, listed[-1]), "r+b") as f:
      f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with pytest.raises(utils.ReadOnlyCacheError) as raised:
      pretrained.check_cached_model(os.path.join(ro, key))
  assert str(raised.value).startswith(f"cache entry {ro}/{key} is damaged (")
  assert key in os.listdir(src)  # left where it was


def test_builtin_benchmark_is_read_from_a_read_only_cache(tiny_cache, tmp_path):
  src = _copy(tiny_cache, tmp_path)
  built = B.ensure_benchmark(src, seed=7, progress=False, **TINY)  # found, not generated
  with read_only_view(src, str(tmp_path / "ro")) as ro:
    read = B.ensure_benchmark(ro, seed=7, progress=False, **TINY)
    assert read.root == os.path.join(ro, os.path.basename(built.root))
    assert read.splits.keys() == built.splits.keys()
    for key, files in read.splits.items():
      with (
        open(files.annotation_file, "rb") as a,
        open(built.splits[key].annotation_file, "rb") as b,
      ):
        assert a.read() == b.read()
    # Another seed: not in the cache; named, nothing generated.
    with pytest.raises(utils.ReadOnlyCacheError, match=r"^the built-in benchmark .* is not in "):
      B.ensure_benchmark(ro, seed=8, progress=False, **TINY)
    # A damaged file: verified, named as damaged (the manifest's check), left in place.
    listed = integrity.read_manifest(built.root)
    damaged = os.path.join(built.root, sorted(listed["files"])[0])
    with open(damaged, "r+b") as f:
      f.write(bytes([f.read(1)[0] ^ 0xFF]))
    with pytest.raises(utils.ReadOnlyCacheError, match=r" is damaged \("):
      B.ensure_benchmark(ro, seed=7, progress=False, **TINY)
  assert sorted(os.listdir(src)) == sorted(
    [os.path.basename(built.root), os.path.basename(built.root) + ".lock"]
  )


def test_left_term_is_read_from_a_read_only_cache_and_a_missing_one_named(tmp_path):
  rng = np.random.default_rng(0)
  ce = rng.normal(size=(6, 3, 4)).astype(np.float32)
  qe = rng.normal(size=(6, 3, 4)).astype(np.float32)
  src = tmp_path / "buffers"
  src.mkdir()
  options = asv_left.left_term_options(3)
  first = asv_left.cached_left_term(str(src / "0123456789abcdef"), ce, qe, options, progress=False)
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    prefix = os.path.join(ro, "0123456789abcdef")
    calls = []
    again = asv_left.cached_left_term(
      prefix, ce, qe, options, progress=False, chunk_hook=calls.append
    )
    assert calls == []  # loaded, not computed
    for a, b in zip(first, again):
      np.testing.assert_array_equal(a, b)
    other = asv_left.left_term_options(4)
    with pytest.raises(utils.ReadOnlyCacheError, match=r"^the ASER-PC left term .* not in the "):
      asv_left.cached_left_term(prefix, ce, qe, other, progress=False, chunk_hook=calls.append)
    assert calls == []


def test_a_replay_buffer_missing_from_a_read_only_cache_is_named_and_not_built(tmp_path):
  src = tmp_path / "buffers"
  src.mkdir()
  built = []
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    with pytest.raises(utils.ReadOnlyCacheError) as raised:
      store_cache.cached_store(ro, {"k": 1}, lambda *args: built.append(args))
  entry = os.path.join(ro, utils.digest({"k": 1}))
  assert str(raised.value).startswith(f"the replay buffer {entry} is not in the cache, and ")
  assert built == [] and os.listdir(src) == []


def test_data_scan_on_a_read_only_cache_scans_without_recording(tiny_cache, tmp_path):
  src = _copy(tiny_cache, tmp_path)
  bench = B.ensure_benchmark(src, seed=7, progress=False, **TINY)
  splits = [("pretrain", "train", bench.source("pretrain", "train"))]
  splits.append(("pretrain", "val", bench.source("pretrain", "val")))
  # One split's record in the cache, the other's not.
  assert scan.scan_splits(splits[:1], str(src), num_threads=1)["scanned"] == 10
  before = snapshot(str(src))
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    counts = scan.scan_splits(splits, ro, num_threads=1)
    assert counts == {"scanned": 3, "cached": 10}
    # Damaged record: rescanned, left in place (it cannot be set aside there).
    record = next(
      n for n in os.listdir(os.path.join(str(src), scan.SCAN_FOLDER)) if n.endswith("json")
    )
    with open(os.path.join(str(src), scan.SCAN_FOLDER, record), "w") as f:
      f.write("{")
    before = snapshot(str(src))
    assert scan.scan_splits(splits, ro, num_threads=1) == {"scanned": 13, "cached": 0}
  assert snapshot(str(src)) == before


def test_replay_image_cache_on_a_read_only_cache_is_read_and_not_written(tmp_path):
  src = tmp_path / "images"
  cache = images.ImageCache(str(src), "k", num_images=4, image_size=2)
  content = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
  cache.write({1: content})
  cache.close()
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    read = images.ImageCache(ro, "k", num_images=4, image_size=2)
    np.testing.assert_array_equal(read.read(1), content)
    assert read.read(2) is None
    read.write({2: content})  # nothing written (read-only)
    assert read.read(2) is None and read.read_only
    # A changed image (through the writable path): fails its CRC, is decoded, not rewritten.
    with open(src / "k" / "pixels.u8", "r+b") as f:
      f.seek(12)
      f.write(b"\xff")
    assert read.read(1) is None and read.damaged == 1
    read.write({1: content})
    assert read.read(1) is None
    read.close()
    # No folder of this key: the cache is off, every image decoded (read gives None).
    absent = images.ImageCache(ro, "other", num_images=4, image_size=2)
    assert absent.read(1) is None
    absent.write({1: content})
    absent.close()
  assert sorted(os.listdir(src)) == ["k", "k.lock"]
  assert sorted(os.listdir(src / "k")) == ["entries.i32", "meta.json", "pixels.u8"]


def test_compilation_cache_on_a_read_only_cache_is_read_and_not_written(tmp_path, caplog):
  src = tmp_path / "xla"
  src.mkdir()
  with read_only_view(str(src), str(tmp_path / "ro")) as ro:
    with caplog.at_level("WARNING"):
      assert experiment.enable_compilation_cache(ro) is False
    assert jax.config.jax_compilation_cache_dir == ro
    assert jax.config.jax_persistent_cache_min_compile_time_secs == float("inf")
    assert f"the compilation cache {ro} cannot be written (read-only)" in caplog.text
    missing = os.path.join(ro, "xla")  # no folder to read: not used at all
    assert experiment.enable_compilation_cache(missing) is False
    assert jax.config.jax_compilation_cache_dir == ro
  # (conftest's _keep_xla_cache restores the session's settings after the test.)


def _ro_config(cache_dir):
  c = tiny_config("swil", cache_dir)
  c.max_eval_images = 8
  c.eval.pretraining_sets_after_each_dataset = False
  c.replay.image_cache = "replay_images"
  return c


@pytest.mark.parametrize(
  "change, entry",
  [
    ("seeds.model", "the pre-trained model {ro}/pretrained/"),
    ("data.builtin.num_pretrain_val", "the built-in benchmark {ro}/builtin/builtin_v"),
  ],
)
def test_a_read_only_cache_without_an_entry_is_refused_before_any_write(
  pretrained_cache_dir, tmp_path, capsys, change, entry
):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "notes.txt").write_text("kept\n")
  with read_only_view(pretrained_cache_dir, str(tmp_path / "ro")) as ro:
    config = _ro_config(ro)
    section, field = change.rsplit(".", 1)
    target = config
    for name in section.split("."):
      target = target[name]
    target[field] = 7  # another model / benchmark: not in the cache
    with pytest.raises(utils.ReadOnlyCacheError) as raised:
      experiment.run(config, str(workdir))
  assert os.listdir(workdir) == ["notes.txt"]  # no run.json, no lock
  message = str(raised.value)
  assert message.startswith(entry.format(ro=ro)) and "is not in the cache" in message
  with pytest.raises(SystemExit) as exited:
    main.fail(raised.value)
  assert exited.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_on_a_read_only_cache_equals_the_run_that_filled_it(pretrained_cache_dir, tmp_path):
  # The first run adds the data scan records and the replay image cache to the cache.
  experiment.run(_ro_config(pretrained_cache_dir), str(tmp_path / "first"))
  before = snapshot(pretrained_cache_dir)
  with read_only_view(pretrained_cache_dir, str(tmp_path / "ro")) as ro:
    experiment.run(_ro_config(ro), str(tmp_path / "second"))
  assert snapshot(pretrained_cache_dir) == before
  first, second = (
    json.loads((tmp_path / run / "results.json").read_text()) for run in ("first", "second")
  )
  assert first["status"] == second["status"] == "complete"
  assert comparable(second["stages"]) == comparable(first["stages"])
  assert comparable(second["buffer"]) == comparable(first["buffer"])

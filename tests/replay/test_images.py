"""Images by reference (owl_cl/replay/images.py) and the replay store that gathers them.

A small generated source (uint8 images of several sizes and aspect ratios, so that the resize
and the padding both matter) that counts its decodes; the reference is the training pipeline's
own `image_ops.resize_with_pad`, i.e. what a store of pixels held.
"""

import concurrent.futures
import os
import threading

import numpy as np
import pytest

from owl_cl.config_fields import ConfigError
from owl_cl.data import image_ops
from owl_cl.replay import images as images_lib
from owl_cl.replay import store as store_lib

S, N_SOURCE, Q, L, M, T, C = 24, 12, 3, 4, 2, 5, 2
# Buffer image i is source image KEPT[i].
KEPT = np.array([1, 4, 5, 7, 10, 11])
REFERENCE = dict(image_size=S, pad_value=image_ops.TRAIN_PAD_VALUE, squash=False, key="test")


class CountingSource:
  """N_SOURCE images, image i of (10 + 3i) x (30 - 2i) pixels, id 100 + i; counts `load`s."""

  def __init__(self, id_offset=100):
    self.id_offset = id_offset
    self.loads = 0
    self._lock = threading.Lock()

  def __len__(self):
    return N_SOURCE

  def load(self, i):
    with self._lock:
      self.loads += 1
    rng = np.random.default_rng(i)
    image = rng.integers(0, 256, (10 + 3 * i, 30 - 2 * i, 3), dtype=np.uint8)
    return dict(
      image=image, boxes=np.zeros((0, 4)), labels=np.zeros(0), image_id=self.id_offset + i
    )


def _arrays():
  rng = np.random.default_rng(0)
  n = len(KEPT)
  queries = rng.integers(1, 50, (n, Q, L)).astype(np.int32)
  queries[:, -1] = 0
  examples = dict(
    queries=queries,
    labels=rng.integers(0, 2, (n, M, Q)).astype(np.float32),
    boxes=rng.random((n, M, 4)).astype(np.float32),
    query_class=rng.integers(-1, C, (n, Q)).astype(np.int32),
    image_id=(KEPT + 100).astype(np.int64),
  )
  membership = np.ones((n, C), bool)
  buffer = dict(
    class_membership=membership,
    prototypes=rng.normal(size=(C, 4)),
    prototype_distances=np.zeros((n, C)),
    class_embeddings=rng.normal(size=(n, 2, 4)),
    query_embeddings=rng.normal(size=(n, 2, 4)),
  )
  logits = rng.normal(size=(n, T, Q)).astype(np.float32)
  return examples, logits, buffer


def _pixel_store(source):
  """The store as the previous version kept it: the training pipeline's images as pixels."""
  examples, logits, buffer = _arrays()
  images = np.stack([image_ops.resize_with_pad(source.load(int(i))["image"], S, 0.5) for i in KEPT])
  return store_lib.ReplayStore(dict(examples, images=images), logits, buffer, ["a", "b"])


def _saved_store(tmp_path):
  """A store by reference saved under tmp_path/store (arrays only, no source)."""
  examples, logits, buffer = _arrays()
  store = store_lib.ReplayStore(
    dict(examples, source_index=KEPT.astype(np.int64)),
    logits,
    buffer,
    ["a", "b"],
    image_reference=REFERENCE,
  )
  path = str(tmp_path / "store")
  store.save(path)
  return path


def _assert_same_batch(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


INDICES = np.array([3, 0, 3, 5, 1])
VALID = np.array([True, True, False, True, True])


def test_gather_by_reference_equals_the_pixel_store(tmp_path):
  source = CountingSource()
  expected = _pixel_store(source).gather(INDICES, VALID)
  store = store_lib.ReplayStore.load(_saved_store(tmp_path), source=source)
  assert store.by_reference and store.num_images == len(KEPT)
  source.loads = 0
  got = store.gather(INDICES, VALID)
  _assert_same_batch(got, expected)
  # Padding (bottom of wide images, right of tall ones) at the training value, exactly.
  padded = 0
  for image, i in zip(got["images"], KEPT[INDICES]):
    h, w, _, _ = image_ops.resize_geometry(10 + 3 * i, 30 - 2 * i, S)
    assert (image[h:] == 0.5).all() and (image[:, w:] == 0.5).all()
    padded += (S - h) * S + (S - w) * h
  assert padded > S * S
  assert source.loads == len(np.unique(INDICES))  # duplicates decoded once


def test_cache_gives_the_same_batches_and_spares_the_decodes(tmp_path):
  source = CountingSource()
  path = _saved_store(tmp_path)
  expected = store_lib.ReplayStore.load(path, source=source).gather(INDICES, VALID)
  cache_root = str(tmp_path / "cache")
  store = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)
  source.loads = 0
  _assert_same_batch(store.gather(INDICES, VALID), expected)
  assert source.loads == len(np.unique(INDICES))
  # The second gather reads every image from the cache; so does another store object (a
  # later run) on the same folder; an image not cached yet is decoded.
  _assert_same_batch(store.gather(INDICES, VALID), expected)
  again = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)
  _assert_same_batch(again.gather(INDICES, VALID), expected)
  assert source.loads == len(np.unique(INDICES))
  np.testing.assert_array_equal(
    again.gather([2])["images"],
    store_lib.ReplayStore.load(path, source=source).gather([2])["images"],
  )
  assert source.loads == len(np.unique(INDICES)) + 2
  # One folder, named by the buffer's key (and its lock file).
  (folder,) = [n for n in os.listdir(cache_root) if not n.endswith(".lock")]
  assert folder == images_lib.cache_key(REFERENCE, KEPT, KEPT + 100)


class _Killed(BaseException):
  """Stands for the process being killed (not an OSError, which the cache survives)."""


def test_a_fill_killed_before_its_records_leaves_entries_missing(tmp_path, monkeypatch):
  source = CountingSource()
  path = _saved_store(tmp_path)
  expected = store_lib.ReplayStore.load(path, source=source).gather(INDICES, VALID)
  cache_root = str(tmp_path / "cache")
  store = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)

  def kill(fd):
    raise _Killed

  # Killed after the pixels are written, before the records.
  monkeypatch.setattr(images_lib.os, "fdatasync", kill)
  with pytest.raises(_Killed):
    store.gather(INDICES, VALID)
  monkeypatch.undo()
  source.loads = 0
  fresh = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)
  _assert_same_batch(fresh.gather(INDICES, VALID), expected)
  assert source.loads == len(np.unique(INDICES))  # nothing was taken from the torn fill


def test_a_failing_cache_falls_back_to_decoding(tmp_path, monkeypatch):
  source = CountingSource()
  path = _saved_store(tmp_path)
  expected = store_lib.ReplayStore.load(path, source=source).gather(INDICES, VALID)
  store = store_lib.ReplayStore.load(path, source=source, image_cache=str(tmp_path / "c"))

  def full(*args):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(images_lib.os, "pwrite", full)
  _assert_same_batch(store.gather(INDICES, VALID), expected)
  _assert_same_batch(store.gather(INDICES, VALID), expected)
  monkeypatch.undo()
  # A cache folder that cannot be created (its parent is a file).
  (tmp_path / "file").write_text("")
  store = store_lib.ReplayStore.load(path, source=source, image_cache=str(tmp_path / "file" / "c"))
  _assert_same_batch(store.gather(INDICES, VALID), expected)


def test_concurrent_gathers_from_threads(tmp_path):
  source = CountingSource()
  path = _saved_store(tmp_path)
  plain = store_lib.ReplayStore.load(path, source=source)
  store = store_lib.ReplayStore.load(path, source=source, image_cache=str(tmp_path / "c"))
  rng = np.random.default_rng(1)
  draws = [rng.integers(0, len(KEPT), 4) for _ in range(24)]
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    batches = list(pool.map(store.gather, draws))
  for indices, batch in zip(draws, batches):
    _assert_same_batch(batch, plain.gather(indices))


def test_wrong_or_missing_source_is_refused(tmp_path):
  path = _saved_store(tmp_path)
  with pytest.raises(ValueError, match="by reference"):
    store_lib.ReplayStore.load(path).gather([0])
  store = store_lib.ReplayStore.load(path, source=CountingSource(id_offset=500))
  with pytest.raises(ValueError, match="id 501, the buffer was built with id 101"):
    store.gather([0])

  class Short(CountingSource):
    def __len__(self):
      return 8

  with pytest.raises(ValueError, match="has 8 images"):
    store_lib.ReplayStore.load(path, source=Short())


def test_image_cache_folder_from_the_config(tmp_path, monkeypatch):
  from owl_cl.replay import setup as replay_setup  # noqa: PLC0415
  from owl_cl.testing.configs import tiny_config  # noqa: PLC0415

  config = tiny_config("swil", str(tmp_path / "cache"))
  # The built-in default: a folder inside cache_dir.
  assert replay_setup.image_cache_dir(config) == str(tmp_path / "cache" / "replay_images")
  config.replay.image_cache = str(tmp_path / "nvme")  # absolute: as given
  assert replay_setup.image_cache_dir(config) == str(tmp_path / "nvme")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  config.replay.image_cache = "~/images"
  assert replay_setup.image_cache_dir(config) == str(tmp_path / "home" / "images")
  config.replay.image_cache = None
  assert replay_setup.image_cache_dir(config) is None
  # '' is no folder: refused, as the config's validation refuses it before any work.
  config.replay.image_cache = ""
  with pytest.raises(ConfigError, match=r"config.replay.image_cache='' must be a non-empty"):
    replay_setup.image_cache_dir(config)


def _filled_cache(tmp_path):
  """(store path, cache root, cache folder, expected batch) after one gather filled the cache."""
  source = CountingSource()
  path = _saved_store(tmp_path)
  expected = store_lib.ReplayStore.load(path, source=source).gather(INDICES, VALID)
  cache_root = str(tmp_path / "cache")
  store_lib.ReplayStore.load(path, source=source, image_cache=cache_root).gather(INDICES, VALID)
  (folder,) = [n for n in os.listdir(cache_root) if not n.endswith(".lock")]
  return path, cache_root, os.path.join(cache_root, folder), expected


@pytest.mark.parametrize("damage", ["flip", "truncate", "records"])
def test_damaged_cache_entries_are_decoded_again_and_rewritten(tmp_path, caplog, damage):
  path, cache_root, folder, expected = _filled_cache(tmp_path)
  pixels = os.path.join(folder, "pixels.u8")
  stat = os.stat(pixels)
  slot = S * S * 3
  first = int(np.unique(INDICES)[0])  # a cached entry
  if damage == "flip":  # up to 4096 bytes of the first cached entry, size and mtime kept
    with open(pixels, "r+b") as f:
      f.seek(first * slot)
      old = f.read(min(4096, slot))  # one slot: the tiny images' slots are smaller
      f.seek(first * slot)
      f.write(bytes(b ^ 0x5A for b in old))
    damaged = 1
  elif damage == "truncate":  # every entry but the first cut away
    os.truncate(pixels, first * slot + 10)
    damaged = len(np.unique(INDICES))
  else:  # the records file cut: every entry missing
    os.truncate(os.path.join(folder, "entries.i32"), 0)
    damaged = len(np.unique(INDICES))
  os.utime(pixels, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  source = CountingSource()
  store = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)
  with caplog.at_level("WARNING"):
    _assert_same_batch(store.gather(INDICES, VALID), expected)
  assert source.loads == damaged  # the damaged entries decoded again, the others read
  if damage == "flip":
    assert f"{pixels}: entry {first} failed its check (CRC-32 differs" in caplog.text
  else:
    assert "is cut" in caplog.text and folder in caplog.text
  # Rewritten: a later run reads every entry from the cache, without a warning.
  caplog.clear()
  source.loads = 0
  again = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)
  with caplog.at_level("WARNING"):
    _assert_same_batch(again.gather(INDICES, VALID), expected)
  assert source.loads == 0 and "failed its check" not in caplog.text


def test_unreadable_cache_meta_sets_the_folder_aside(tmp_path, caplog):
  path, cache_root, folder, expected = _filled_cache(tmp_path)
  with open(os.path.join(folder, "meta.json"), "w") as f:
    f.write("{not json")
  source = CountingSource()
  store = store_lib.ReplayStore.load(path, source=source, image_cache=cache_root)
  with caplog.at_level("WARNING"):
    _assert_same_batch(store.gather(INDICES, VALID), expected)
  assert source.loads == len(np.unique(INDICES))
  (aside,) = [n for n in os.listdir(cache_root) if ".corrupt-" in n]
  assert os.path.isfile(os.path.join(cache_root, aside, "pixels.u8"))  # kept, not deleted
  assert "failed its integrity check" in caplog.text

"""The replay buffer's images by reference: decoded and preprocessed when a replay gathers them.

The store (`owl_cl/replay/store.py`) keeps no pixels: per buffer image it keeps the index of
the image in the pre-training source (`examples.source_index`) and its image id. `BufferImages`
turns buffer indices into the images of the training examples, decoding each from the source
(`source.load(i)`) and preprocessing it with the training pipeline's own functions
(`image_ops.resized_uint8`, `image_ops.uint8_to_unit`, `image_ops.pad_to_square`: the stages of
`image_ops.resize_with_pad`, which `input_pipeline.preprocess_train_example` applies to a
non-augmented example), so a gathered image equals, bit for bit, the image the builder's
forward saw (docs/reference.md §5, §6).

Optional cache (`replay.image_cache`, `ImageCache`): a folder on local disk, one per buffer
(keyed by what the images depend on), holding each image's resized uint8 content (at most
S x S x 3 bytes) once it has been decoded. The float32 image is rebuilt from it by the same
scaling and padding, so cached and decoded images are identical (uint8 sources; a source
giving float images is decoded every time). Written safely: an entry's pixels are written and
`fdatasync`ed before its validity record, so a run killed at any point (or a power loss)
leaves entries that are complete or marked missing, never torn. Checked on every read: the
record holds the CRC-32 of the entry's pixels, so a changed or cut `pixels.u8` (or records
file) makes the entry count as missing; it is decoded from the source again and rewritten,
with a warning naming the file and the entry. The cache is written incrementally (images are
added as they are replayed), so it has no folder-wide manifest: each record is its own check.
Several threads and processes may share a cache without a lock around appends: positional
reads and writes, and two writers of one entry write the same bytes (the decode is
deterministic); the folder's creation and its repair (a cut file extended, an unreadable
`meta.json`) hold the entry lock (`utils.cache_entry_lock`).
"""

from __future__ import annotations

from concurrent import futures
import hashlib
import json
import os
import threading
from typing import Any
import zlib

from absl import logging
import numpy as np

from owl_cl import integrity
from owl_cl import utils
from owl_cl.data import image_ops

# 2: the record's last field is the CRC-32 of the pixels (1: 0, unchecked; recreated).
CACHE_FORMAT = 2
# An entry's validity record: int32 (marker, content height, content width, CRC-32 of the
# content's bytes as int32), 16 bytes, so it never straddles a disk sector (written in one
# piece).
_RECORD = 4
_MARKER = 0x0C1CA5E1
# Damaged entries named one per warning, then summed up at the cache's close.
_MAX_WARNINGS = 10


def _crc(data: bytes) -> int:
  """zlib's CRC-32 of `data` as the int32 stored in a record (the same 32 bits)."""
  return int(np.uint32(zlib.crc32(data)).view(np.int32))


def cache_key(reference: dict, source_index: np.ndarray, image_id: np.ndarray) -> str:
  """The digest naming a buffer's image cache folder: the store's image preprocessing and
  build key (`meta.json` 'images'), and every element of its source indices and image ids
  int64 [N] (another buffer, or the same one at another resolution, gets another folder)."""

  def sha(array):
    return hashlib.sha256(np.ascontiguousarray(array, np.int64).tobytes()).hexdigest()

  return utils.digest(
    dict(reference=dict(reference), source_index=sha(source_index), image_id=sha(image_id))
  )


class ImageCache:
  """uint8 resized content of the buffer images in `<root>/<key>/` (see the module docstring).

  Layout: `pixels.u8` N slots of S*S*3 bytes (entry i's [h, w, 3] content at the start of slot
  i), `entries.i32` N records int32 [4], `meta.json` (format, N, S, key); the two data files are
  sparse and zero (= missing) until written. The folder is created with
  `utils.atomic_directory` (a concurrent creator's folder is kept).

  Args:
    root: the cache root (`replay.image_cache`, '~' and variables expanded).
    key: what the images depend on (a digest, `BufferImages.cache_key`).
    num_images: N. image_size: S.
  """

  def __init__(self, root: str, key: str, num_images: int, image_size: int):
    self.path = os.path.join(utils.expand_path(root), key)
    self.meta = dict(format=CACHE_FORMAT, images=int(num_images), size=int(image_size), key=key)
    self.slot = int(image_size) ** 2 * 3
    self._fds = None
    self._lock = threading.Lock()
    # Entries found damaged by this object (each decoded again), for the log.
    self.damaged = 0
    # Set when the folder's files open for reading only (a cache that cannot be written).
    self.read_only = False

  def _create(self, if_exists: str) -> None:
    with utils.atomic_directory(self.path, if_exists=if_exists) as tmp:
      for name, size in (("pixels.u8", self.slot), ("entries.i32", 4 * _RECORD)):
        with open(os.path.join(tmp, name), "wb") as f:
          f.truncate(self.meta["images"] * size)  # sparse: every entry missing
      utils.atomic_write_json(os.path.join(tmp, "meta.json"), self.meta)

  def _open(self) -> tuple[int, ...]:
    """(pixels fd, entries fd), creating the folder on first use (thread-safe); () when the
    cache cannot be written and holds no complete folder of this layout (the cache is off)."""
    with self._lock:
      if self._fds is None:
        usable = True
        if self._read_meta() != self.meta or not self._full_size():
          # Created, replaced or repaired by one process at a time (several runs may share it).
          with utils.cache_entry_lock(self.path, "replay image cache") as writable:
            if writable:
              self._prepare()
            usable = writable
        self._fds = self._open_files() if usable else ()
        if not usable:
          # An accelerator, not a result: where it cannot be written, the images are decoded.
          logging.warning(
            "replay image cache %s cannot be written and is not complete: it is not used",
            self.path,
          )
        logging.info("replay image cache: %s", self.path)
      return self._fds

  def _open_files(self) -> tuple[int, ...]:
    """The folder's files open for reading and writing, or for reading only where the cache
    cannot be written (then `write` caches nothing)."""
    names = [os.path.join(self.path, name) for name in ("pixels.u8", "entries.i32")]
    try:
      return tuple(os.open(name, os.O_RDWR) for name in names)
    except OSError as e:
      if e.errno not in utils.READ_ONLY_ERRNOS:
        raise
    self.read_only = True
    logging.info(
      "replay image cache %s is read-only: cached images are read, none added", self.path
    )
    return tuple(os.open(name, os.O_RDONLY) for name in names)

  def _read_meta(self) -> dict | None:
    try:
      with open(os.path.join(self.path, "meta.json")) as f:
        found = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}  # unreadable: damaged
    return found if isinstance(found, dict) else {}

  def _sizes(self) -> dict[str, int]:
    return {"pixels.u8": self.meta["images"] * self.slot, "entries.i32": self.meta["images"] * 16}

  def _full_size(self) -> bool:
    try:
      return all(
        os.path.getsize(os.path.join(self.path, name)) >= size
        for name, size in self._sizes().items()
      )
    except OSError:
      return False

  def _prepare(self) -> None:
    """Makes the folder one of this layout, complete (under the entry lock)."""
    found = self._read_meta()
    if found is None and not os.path.exists(self.path):
      self._create("keep")
      return
    if found != self.meta:
      if found:
        # Another layout (an older cache format): replaced, it holds no other data.
        logging.warning("replay image cache %s is of another layout; recreating it", self.path)
        self._create("replace")
      else:  # meta.json missing or unreadable: kept aside for inspection
        integrity.set_aside(self.path, "meta.json missing or unreadable")
        self._create("keep")
      return
    for name, size in self._sizes().items():
      path = os.path.join(self.path, name)
      if not os.path.exists(path) or os.path.getsize(path) < size:
        # Cut (or lost): the missing part reads as zeros, entries not cached (or failing their
        # CRC), decoded and rewritten.
        logging.warning(
          "replay image cache %s is cut (%s of %d bytes); its missing entries are decoded again",
          path,
          os.path.getsize(path) if os.path.exists(path) else "missing",
          size,
        )
        with open(path, "ab") as f:
          f.truncate(size)

  def read(self, index: int) -> np.ndarray | None:
    """Entry `index`'s uint8 [h, w, 3] content, or None when it is not cached yet or fails its
    check (the pixels' CRC-32 differs from the record's, or are cut short: logged)."""
    fds = self._open()
    if not fds:
      return None
    pixels, entries = fds
    record = np.frombuffer(os.pread(entries, 4 * _RECORD, 4 * _RECORD * index), np.int32)
    if len(record) != _RECORD or record[0] != _MARKER:
      return None
    h, w = int(record[1]), int(record[2])
    if not (0 < h * w * 3 <= self.slot):
      self._damaged("entries.i32", index, f"record of a {h} x {w} image")
      return None
    data = os.pread(pixels, h * w * 3, self.slot * index)
    if len(data) != h * w * 3:
      self._damaged("pixels.u8", index, f"{len(data)} of {h * w * 3} bytes (file cut)")
      return None
    if _crc(data) != int(record[3]):
      self._damaged("pixels.u8", index, "CRC-32 differs from its record (changed on disk)")
      return None
    return np.frombuffer(data, np.uint8).reshape(h, w, 3)

  def _damaged(self, name: str, index: int, reason: str) -> None:
    with self._lock:
      self.damaged += 1
      count = self.damaged
    if count <= _MAX_WARNINGS:
      logging.warning(
        "replay image cache %s: entry %d failed its check (%s); decoding it again",
        os.path.join(self.path, name),
        index,
        reason,
      )

  def write(self, contents: dict[int, np.ndarray]) -> None:
    """Caches {index: uint8 [h, w, 3] content}: pixels, fdatasync, then the records.

    Raises:
      OSError: the disk refused a write (e.g. full).
    """
    fds = self._open() if contents else ()
    if not fds or self.read_only:
      return
    pixels, entries = fds
    for index, content in contents.items():
      data = np.ascontiguousarray(content, np.uint8).tobytes()
      if os.pwrite(pixels, data, self.slot * index) != len(data):
        raise OSError(f"short write to {self.path}/pixels.u8")
    # The records only once the pixels are on disk: a record never points at torn pixels.
    os.fdatasync(pixels)
    for index, content in contents.items():
      crc = _crc(np.ascontiguousarray(content, np.uint8).tobytes())
      record = np.array([_MARKER, content.shape[0], content.shape[1], crc], np.int32).tobytes()
      os.pwrite(entries, record, 4 * _RECORD * index)

  def close(self) -> None:
    """Closes the cache's files (a later read or write opens them again)."""
    with self._lock:
      if self._fds is not None:
        for fd in self._fds:
          os.close(fd)
        self._fds = None
      if self.damaged > _MAX_WARNINGS:
        logging.warning(
          "replay image cache %s: %d damaged entries in all, each decoded again",
          self.path,
          self.damaged,
        )


class BufferImages:
  """Buffer index -> the float32 image of its training example, decoded at gather time.

  Args:
    source: the pre-training source the buffer was built from (`load(i)` -> dict(image uint8
      [H, W, 3], image_id, ...)).
    source_index: int64 [N] the buffer images' indices in `source`.
    image_id: int64 [N] their image ids (each decode checks the source still has them).
    image_size: S. pad_value: the training pad value (0.5). squash: as
      `image_ops.resize_with_pad`.
    resize: 'resize_with_pad' (v1) or 'pad_then_resize' (OWLv2, `image_ops.preprocess_image`:
      no uint8 stage, so its images are decoded every time and never cached).
    cache_dir: root of the optional uint8 cache (`ImageCache`); None: decode every time.
    cache_key: what the images depend on (names the cache folder; required with cache_dir).
    num_threads: threads decoding the images of one call (PIL releases the GIL).
  Raises:
    ValueError: source_index / image_id of different lengths, an index outside the source,
      a cache_dir without cache_key.
  Thread-safe: `__call__` keeps no state but the cache's file descriptors (opened once under a
  lock) and a thread pool.
  """

  def __init__(
    self,
    source: Any,
    source_index: np.ndarray,
    image_id: np.ndarray,
    *,
    image_size: int,
    pad_value: float = image_ops.TRAIN_PAD_VALUE,
    squash: bool = False,
    resize: str = "resize_with_pad",
    cache_dir: str | None = None,
    cache_key: str | None = None,
    num_threads: int = 4,
  ):
    self.source = source
    self.source_index = np.asarray(source_index, np.int64)
    self.image_id = np.asarray(image_id, np.int64)
    if self.source_index.shape != self.image_id.shape or self.source_index.ndim != 1:
      raise ValueError(
        f"source_index {self.source_index.shape} and image_id {self.image_id.shape} must be "
        "[N] of the same N"
      )
    if self.source_index.size and not (
      0 <= self.source_index.min() and self.source_index.max() < len(source)
    ):
      raise ValueError(
        f"the buffer's source indices reach {int(self.source_index.max())} but {source!r} has "
        f"{len(source)} images: not the pre-training set the buffer was built from"
      )
    self.image_size, self.pad_value, self.squash = int(image_size), float(pad_value), bool(squash)
    self.resize = resize
    self.cache = None
    if cache_dir and resize == "resize_with_pad":
      if not cache_key:
        raise ValueError("an image cache needs a cache_key")
      self.cache = ImageCache(cache_dir, cache_key, len(self.source_index), self.image_size)
    self.num_threads = max(1, int(num_threads))
    self._pool = None
    self._lock = threading.Lock()
    self._cache_failed = False

  def _decode(self, i: int) -> np.ndarray:
    """Buffer image i decoded from the source and resized: uint8 [h, w, 3] content, or the
    float32 [S, S, 3] image for a source giving float pixels or OWLv2's `resize`."""
    example = self.source.load(int(self.source_index[i]))
    if int(example["image_id"]) != int(self.image_id[i]):
      raise ValueError(
        f"buffer image {i}: image {int(self.source_index[i])} of {self.source!r} has id "
        f"{int(example['image_id'])}, the buffer was built with id {int(self.image_id[i])}: "
        "the pre-training set changed since the buffer was built"
      )
    image = np.asarray(example["image"])
    if self.resize != "resize_with_pad":
      return image_ops.preprocess_image(
        image, self.image_size, self.pad_value, squash=self.squash, method=self.resize
      )
    if image.dtype != np.uint8:
      return image_ops.resize_with_pad(image, self.image_size, self.pad_value, squash=self.squash)
    return image_ops.resized_uint8(image, self.image_size, squash=self.squash)

  def _map(self, fn, items: list) -> list:
    if len(items) < 2 or self.num_threads == 1:
      return [fn(i) for i in items]
    with self._lock:
      if self._pool is None:
        self._pool = futures.ThreadPoolExecutor(self.num_threads, "replay-images")
    return list(self._pool.map(fn, items))

  def __call__(self, indices: np.ndarray) -> np.ndarray:
    """float32 [n, S, S, 3] images of buffer `indices` int [n] (in [0, N), checked by the
    store): the training images of their examples (pad value in the padding)."""
    indices = np.asarray(indices, np.int64).reshape(-1)
    unique = [int(i) for i in np.unique(indices)]
    cache = None if self._cache_failed else self.cache
    content = {}
    if cache is not None:
      try:
        cached = self._map(cache.read, unique)
      except OSError as e:
        cache, cached = self._cache_error(e), []
      content = {i: c for i, c in zip(unique, cached) if c is not None}
    missing = [i for i in unique if i not in content]
    decoded = dict(zip(missing, self._map(self._decode, missing)))
    content.update(decoded)
    if cache is not None:
      try:
        cache.write({i: c for i, c in decoded.items() if c.dtype == np.uint8})
      except OSError as e:
        self._cache_error(e)
    images = np.empty((len(indices), self.image_size, self.image_size, 3), np.float32)
    for row, i in enumerate(indices):
      c = content[int(i)]
      images[row] = (
        c
        if c.dtype != np.uint8
        else image_ops.pad_to_square(image_ops.uint8_to_unit(c), self.image_size, self.pad_value)
      )
    return images

  def _cache_error(self, error: OSError) -> None:
    """Turns the cache off for good (logged once): a full, missing or failing local disk
    slows the replay down, it does not stop the run."""
    with self._lock:
      if not self._cache_failed:
        self._cache_failed = True
        logging.warning(
          "replay image cache %s failed (%s); decoding the images from now on",
          self.cache.path,
          error,
        )

  def close(self) -> None:
    """Stops the decoding threads and closes the cache files."""
    with self._lock:
      if self._pool is not None:
        self._pool.shutdown()
        self._pool = None
    if self.cache is not None:
      self.cache.close()

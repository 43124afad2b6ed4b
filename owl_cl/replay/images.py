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
leaves entries that are complete or marked missing, never torn. Several threads and processes
may share a cache (positional reads and writes; two writers of one entry write the same bytes).
"""

from __future__ import annotations

from concurrent import futures
import hashlib
import json
import os
import threading
from typing import Any

from absl import logging
import numpy as np

from owl_cl import utils
from owl_cl.data import image_ops

CACHE_FORMAT = 1
# An entry's validity record: int32 (marker, content height, content width, 0), 16 bytes, so
# it never straddles a disk sector (written in one piece).
_RECORD = 4
_MARKER = 0x0C1CA5E1


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

  def _create(self, if_exists: str) -> None:
    with utils.atomic_directory(self.path, if_exists=if_exists) as tmp:
      for name, size in (("pixels.u8", self.slot), ("entries.i32", 4 * _RECORD)):
        with open(os.path.join(tmp, name), "wb") as f:
          f.truncate(self.meta["images"] * size)  # sparse: every entry missing
      utils.atomic_write_json(os.path.join(tmp, "meta.json"), self.meta)

  def _open(self) -> tuple[int, int]:
    """(pixels fd, entries fd), creating the folder on first use (thread-safe)."""
    with self._lock:
      if self._fds is None:
        try:
          with open(os.path.join(self.path, "meta.json")) as f:
            found = json.load(f)
        except (OSError, ValueError):
          found = None
        if found != self.meta:
          # A folder of another layout (an older cache format) is replaced; a missing one is
          # created, keeping a concurrent creator's if it finishes first.
          stale = os.path.exists(self.path)
          if stale:
            logging.warning("replay image cache %s is of another layout; recreating it", self.path)
          self._create("replace" if stale else "keep")
        self._fds = tuple(
          os.open(os.path.join(self.path, name), os.O_RDWR) for name in ("pixels.u8", "entries.i32")
        )
        logging.info("replay image cache: %s", self.path)
      return self._fds

  def read(self, index: int) -> np.ndarray | None:
    """Entry `index`'s uint8 [h, w, 3] content, or None when it is not cached yet."""
    pixels, entries = self._open()
    record = np.frombuffer(os.pread(entries, 4 * _RECORD, 4 * _RECORD * index), np.int32)
    if len(record) != _RECORD or record[0] != _MARKER:
      return None
    h, w = int(record[1]), int(record[2])
    if not (0 < h * w * 3 <= self.slot):
      return None
    data = os.pread(pixels, h * w * 3, self.slot * index)
    if len(data) != h * w * 3:  # a truncated file: treat as missing
      return None
    return np.frombuffer(data, np.uint8).reshape(h, w, 3)

  def write(self, contents: dict[int, np.ndarray]) -> None:
    """Caches {index: uint8 [h, w, 3] content}: pixels, fdatasync, then the records.

    Raises:
      OSError: the disk refused a write (e.g. full).
    """
    if not contents:
      return
    pixels, entries = self._open()
    for index, content in contents.items():
      data = np.ascontiguousarray(content, np.uint8).tobytes()
      if os.pwrite(pixels, data, self.slot * index) != len(data):
        raise OSError(f"short write to {self.path}/pixels.u8")
    # The records only once the pixels are on disk: a record never points at torn pixels.
    os.fdatasync(pixels)
    for index, content in contents.items():
      record = np.array([_MARKER, content.shape[0], content.shape[1], 0], np.int32).tobytes()
      os.pwrite(entries, record, 4 * _RECORD * index)

  def close(self) -> None:
    """Closes the cache's files (a later read or write opens them again)."""
    with self._lock:
      if self._fds is not None:
        for fd in self._fds:
          os.close(fd)
        self._fds = None


class BufferImages:
  """Buffer index -> the float32 image of its training example, decoded at gather time.

  Args:
    source: the pre-training source the buffer was built from (`load(i)` -> dict(image uint8
      [H, W, 3], image_id, ...)).
    source_index: int64 [N] the buffer images' indices in `source`.
    image_id: int64 [N] their image ids (each decode checks the source still has them).
    image_size: S. pad_value: the training pad value (0.5). squash: as
      `image_ops.resize_with_pad`.
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
    self.cache = None
    if cache_dir:
      if not cache_key:
        raise ValueError("an image cache needs a cache_key")
      self.cache = ImageCache(cache_dir, cache_key, len(self.source_index), self.image_size)
    self.num_threads = max(1, int(num_threads))
    self._pool = None
    self._lock = threading.Lock()
    self._cache_failed = False

  def _decode(self, i: int) -> np.ndarray:
    """Buffer image i decoded from the source and resized: uint8 [h, w, 3] content, or the
    float32 [S, S, 3] image for a source giving float pixels."""
    example = self.source.load(int(self.source_index[i]))
    if int(example["image_id"]) != int(self.image_id[i]):
      raise ValueError(
        f"buffer image {i}: image {int(self.source_index[i])} of {self.source!r} has id "
        f"{int(example['image_id'])}, the buffer was built with id {int(self.image_id[i])}: "
        "the pre-training set changed since the buffer was built"
      )
    image = np.asarray(example["image"])
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

"""Host-side replay store: the buffer images' training examples, DER++ logits, buffer arrays.

`ReplayStore` holds, for N buffer images (docs/reference.md §6):
  * the training examples, with the batch-dict keys of CONVENTIONS.md (`queries`, `labels`,
    `boxes`, `query_class`; optionally `image_id`, `orig_size`, and any further per-image key),
    leading dim N, and their images either
      - by reference (what the builder writes): `source_index` int64 [N] (the image's index
        in the pre-training source) and `image_id`, decoded and preprocessed at gather time
        by `replay.images.BufferImages` (the training pipeline's functions, an optional uint8
        cache on local disk: `replay.image_cache`), or
      - as pixels, `images` [N, S, S, 3] (float32, or uint8 returned as float32 / 255): stores
        built in memory (tests) and the stores of earlier versions (format 1), which keep
        working;
  * `stored_logits` [N, T, Q]: the pre-trained model's logits for DER++ (docs/reference.md §3);
  * with an OWLv2 model, `stored_objectness` [N, T]: its objectness logits, distilled by DER++
    as well (docs/owlv2.md); absent from the stores of a v1 model (and those written before);
  * the `ReplayBuffer` arrays used by retrieval (`class_membership`, `prototypes`,
    `prototype_distances`, `class_embeddings`, `query_embeddings`).

`gather(indices)` returns a batch dict (NumPy fancy indexing, images decoded or read from
the pixels) for the train step; it is thread-safe (a background thread may call it).

Storage of the logits (`logits_dtype`): 'float32', 'float16' (default) or 'bfloat16'.
Padded query slots (all-zero token rows: the model's query mask, docs/reference.md §1) are stored as
0
and restored to exactly `pad_logit` (-1e6, scenic) at gather time, so the DER++ MSE of padded
slots stays exactly 0 (-1e6 is not representable in float16 and only approximately in
bfloat16). Real logits are clipped to the float16 range (+-65504) before casting; the
rounding error is relative: 2^-11 (float16) or 2^-8 (bfloat16), e.g. +-0.005 / +-0.04 on a
logit of 10. The objectness logits are stored in the same dtype, clipped the same way (they
have no padded slots). Gathered logits are always float32. Pixel images stored as uint8 are
returned as float32 / 255 (note: the training pad value 0.5 is not exact in uint8); images by
reference are returned exactly as the training pipeline makes them (pad 0.5 included).

On disk (`save`/`load`): a directory with one `.npy` per array (bfloat16 saved as its uint16
bit pattern) and `meta.json` (with `images`: the preprocessing of images by reference); written
to a temporary sibling directory and renamed into place (atomic on POSIX filesystems).
`load(mmap=True)` memory-maps the arrays, so a store larger than RAM is read lazily by
`gather`. The streaming builder (`owl_cl/replay/build.py`) writes the same folder in row blocks
(`ArrayFile`, `write_meta`) without holding the store in memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import json
import os
from typing import Any

from absl import logging
import ml_dtypes
import numpy as np

from owl_cl import integrity
from owl_cl import utils
from owl_cl.data.spec import TRAIN_EXAMPLE_KEYS
from owl_cl.replay import images as images_lib
from owl_cl.replay.state import ReplayBuffer
from owl_cl.replay.state import make_replay_buffer

# The example keys of a gathered batch (the forward's inputs); the store holds all but
# `images` as arrays, and the images as pixels or by reference (`REFERENCE_KEYS`).
REQUIRED_EXAMPLE_KEYS = TRAIN_EXAMPLE_KEYS
TARGET_KEYS = REQUIRED_EXAMPLE_KEYS[1:]
REFERENCE_KEYS = ("source_index", "image_id")
# `meta.json` 'images' of a store by reference: how its images are preprocessed
# (`image_ops.resize_with_pad`) and what they are of (the build key).
IMAGE_REFERENCE_FIELDS = ("image_size", "pad_value", "squash", "key")
# ... and, for an OWLv2 model's store only, `resize` ('pad_then_resize', docs/owlv2.md).
OPTIONAL_IMAGE_REFERENCE_FIELDS = ("resize",)
BUFFER_KEYS = (
  "class_membership",
  "prototypes",
  "prototype_distances",
  "class_embeddings",
  "query_embeddings",
)
LOGITS_DTYPES = {
  "float32": np.dtype(np.float32),
  "float16": np.dtype(np.float16),
  "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# 2: images by reference (`meta.json` 'images'); 1: pixels only (read as pixel stores).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
_FLOAT16_MAX = float(np.finfo(np.float16).max)
# meta.json of a store written with a manifest (`integrity.write_manifest`) says so: such a
# store whose manifest is gone is damaged, not one of an earlier version.
CHECKSUMS_FIELD = "checksums"


def is_row_file(rel: str) -> bool:
  """Whether the store file `rel` holds per-image rows read by `gather` (examples, logits),
  the files a lazy verification checks chunk by chunk as they are read."""
  return rel.endswith(".npy") and (
    rel.startswith("examples.") or rel in ("stored_logits.npy", "stored_objectness.npy")
  )


def query_padding(queries: np.ndarray) -> np.ndarray:
  """bool [..., Q]: padded query slots (all-zero token rows), as the model's mask.

  Source: docs/reference.md §1.
  """
  return np.asarray(queries)[..., 0] == 0


def encode_logits(logits: np.ndarray, queries: np.ndarray, dtype: str = "float16") -> np.ndarray:
  """Converts float [n, T, Q] logits to the storage dtype (padded slots -> 0, see module doc).

  Args:
    logits: float [n, T, Q] (padded query slots hold the model's pad value).
    queries: int [n, Q, L] the images' query tokens.
    dtype: 'float32' | 'float16' | 'bfloat16'.
  Returns:
    np.ndarray [n, T, Q] of the storage dtype.
  Raises:
    ValueError: unknown dtype or shape mismatch.
  """
  if dtype not in LOGITS_DTYPES:
    raise ValueError(f"unknown logits dtype {dtype!r}; known: {sorted(LOGITS_DTYPES)}")
  logits = np.asarray(logits, np.float32)
  pad = query_padding(queries)
  if logits.ndim != 3 or pad.shape != (logits.shape[0], logits.shape[2]):
    raise ValueError(f"logits {logits.shape} do not match queries {np.shape(queries)}")
  logits = np.where(pad[:, None, :], 0.0, np.clip(logits, -_FLOAT16_MAX, _FLOAT16_MAX))
  return logits.astype(LOGITS_DTYPES[dtype])


def encode_objectness(objectness: np.ndarray, dtype: str = "float16") -> np.ndarray:
  """Converts OWLv2's float [n, T] objectness logits to the storage dtype (clipped to the
  float16 range as `encode_logits`; no padded slots).

  Args:
    objectness: float [n, T] the model's `objectness_logits`.
    dtype: 'float32' | 'float16' | 'bfloat16'.
  Returns:
    np.ndarray [n, T] of the storage dtype.
  Raises:
    ValueError: unknown dtype, or objectness not 2-D.
  Source: docs/owlv2.md ("DER++ on the class and objectness logits").
  """
  if dtype not in LOGITS_DTYPES:
    raise ValueError(f"unknown logits dtype {dtype!r}; known: {sorted(LOGITS_DTYPES)}")
  objectness = np.asarray(objectness, np.float32)
  if objectness.ndim != 2:
    raise ValueError(f"objectness logits must be [n, T], got {objectness.shape}")
  return np.clip(objectness, -_FLOAT16_MAX, _FLOAT16_MAX).astype(LOGITS_DTYPES[dtype])


def decode_logits(stored: np.ndarray, queries: np.ndarray, pad_logit: float = -1e6) -> np.ndarray:
  """Inverse of `encode_logits`: float32 [n, T, Q] with padded slots = pad_logit exactly."""
  pad = query_padding(queries)
  return np.where(
    pad[:, None, :], np.float32(pad_logit), np.asarray(stored).astype(np.float32)
  ).astype(np.float32)


def _buffer_dict(buffer: Any) -> dict[str, np.ndarray]:
  if isinstance(buffer, ReplayBuffer):
    buffer = {k: getattr(buffer, k) for k in BUFFER_KEYS + ("image_features",)}
  missing = [k for k in BUFFER_KEYS if k not in buffer]
  if missing:
    raise ValueError(f"buffer arrays missing {missing}")
  arrays = {k: np.asarray(buffer[k]) for k in BUFFER_KEYS}
  # Optional: stored only for ASER on image features.
  if buffer.get("image_features") is not None:
    arrays["image_features"] = np.asarray(buffer["image_features"])
  return arrays


class ReplayStore:
  """Host-side arrays of the N buffer images (see the module docstring).

  Args:
    examples: mapping key -> array with leading dim N; must contain TARGET_KEYS and either
      `images` (pixels) or REFERENCE_KEYS (images by reference, with `image_reference`).
    stored_logits: float [N, T, Q] pre-trained logits (or already encoded, see
      `logits_encoded`).
    buffer: ReplayBuffer or mapping with BUFFER_KEYS (`class_membership` [N, C] bool,
      `prototypes` [C, E], `prototype_distances` [N, C], `class_embeddings` [N, k, E],
      `query_embeddings` [N, k, E]).
    class_names: C strings, contiguous class index -> name.
    logits_dtype: storage dtype of the logits: 'float32' | 'float16' | 'bfloat16'.
    pad_logit: the model's padded-query logit (-1e6 scenic; HF uses float min).
    logits_encoded: True if `stored_logits` (and `stored_objectness`) are already
      `encode_logits` / `encode_objectness` output of `logits_dtype` (used by `load`).
    stored_objectness: OWLv2: float [N, T] the pre-trained model's objectness logits (the
      tokens of `stored_logits`); None for a v1 model.
    image_reference: images by reference: dict of IMAGE_REFERENCE_FIELDS (S, pad value,
      squash, build key), saved in `meta.json`; None for a pixel store.
    images: the `images_lib.BufferImages` that decodes the images by reference (None: the
      store's arrays are readable but `gather` refuses; `load` with a `source` attaches it).
  Raises:
    ValueError: missing keys, inconsistent leading dims / class counts, unknown dtype, both
      or neither of pixels and references; `stored_objectness` not [N, T] of
      `stored_logits`' N and T.
  Source: docs/reference.md §3 (DER++), §6 (buffer contents), §11 (size); docs/owlv2.md.
  """

  def __init__(
    self,
    examples: Mapping[str, np.ndarray],
    stored_logits: np.ndarray,
    buffer: Any,
    class_names: Sequence[str],
    *,
    logits_dtype: str = "float16",
    pad_logit: float = -1e6,
    logits_encoded: bool = False,
    stored_objectness: np.ndarray | None = None,
    image_reference: Mapping[str, Any] | None = None,
    images: images_lib.BufferImages | None = None,
  ):
    by_reference = image_reference is not None
    missing = [
      k
      for k in TARGET_KEYS + (REFERENCE_KEYS if by_reference else ("images",))
      if k not in examples
    ]
    if missing:
      raise ValueError(f"examples missing keys {missing}")
    if by_reference and "images" in examples:
      raise ValueError("a store keeps its images either as pixels or by reference, not both")
    if images is not None and not by_reference:
      raise ValueError("a store of pixels takes no image decoder (images needs image_reference)")
    if by_reference and (
      set(IMAGE_REFERENCE_FIELDS) - set(image_reference)
      or set(image_reference) - set(IMAGE_REFERENCE_FIELDS + OPTIONAL_IMAGE_REFERENCE_FIELDS)
    ):
      raise ValueError(
        f"image_reference has fields {sorted(image_reference)}, expected "
        f"{sorted(IMAGE_REFERENCE_FIELDS)} (and optionally {list(OPTIONAL_IMAGE_REFERENCE_FIELDS)})"
      )
    self.image_reference = dict(image_reference) if by_reference else None
    self.images = images
    if logits_dtype not in LOGITS_DTYPES:
      raise ValueError(f"unknown logits dtype {logits_dtype!r}; known: {sorted(LOGITS_DTYPES)}")
    self.examples = {
      k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in examples.items()
    }
    n = self.examples["queries"].shape[0]
    for k, v in self.examples.items():
      if v.shape[:1] != (n,):
        raise ValueError(f"examples[{k!r}] has leading dim {v.shape[:1]}, expected ({n},)")
    self.logits_dtype = logits_dtype
    self.pad_logit = float(pad_logit)
    if logits_encoded:
      if np.dtype(stored_logits.dtype) != LOGITS_DTYPES[logits_dtype]:
        raise ValueError(
          f"encoded logits have dtype {stored_logits.dtype}, expected {logits_dtype}"
        )
      self.stored_logits = stored_logits
    else:
      self.stored_logits = encode_logits(stored_logits, self.examples["queries"], logits_dtype)
    if self.stored_logits.shape[0] != n:
      raise ValueError(f"stored_logits leading dim {self.stored_logits.shape[0]} != N={n}")
    self.stored_objectness = None
    if stored_objectness is not None:
      if not logits_encoded:
        stored_objectness = encode_objectness(stored_objectness, logits_dtype)
      elif np.dtype(stored_objectness.dtype) != LOGITS_DTYPES[logits_dtype]:
        raise ValueError(
          f"encoded objectness logits have dtype {stored_objectness.dtype}, expected {logits_dtype}"
        )
      if tuple(stored_objectness.shape) != tuple(self.stored_logits.shape[:2]):
        raise ValueError(
          f"stored_objectness {tuple(stored_objectness.shape)} is not [N, T] = "
          f"{tuple(self.stored_logits.shape[:2])} of stored_logits"
        )
      self.stored_objectness = stored_objectness
    self.buffer_arrays = _buffer_dict(buffer)
    membership = self.buffer_arrays["class_membership"]
    if membership.shape[0] != n:
      raise ValueError(f"class_membership leading dim {membership.shape[0]} != N={n}")
    self._class_names = tuple(str(c) for c in class_names)
    if len(self._class_names) != membership.shape[1]:
      raise ValueError(f"{len(self._class_names)} class names for C={membership.shape[1]}")
    # The folder the store was loaded from (`load`); None for a store built in memory. Once-
    # per-buffer results (ASER-PC's left term) are cached next to it.
    self.path: str | None = None
    # Lazy verification (set by `store_cache.cached_store`): an `integrity.LazyVerifier` of the
    # folder, checked by `gather` before it reads rows, and what to do with a damaged store
    # (set it aside) before the error is raised.
    self.verifier: integrity.LazyVerifier | None = None
    self.on_damage = None

  @property
  def num_images(self) -> int:
    """N, the number of buffer images."""
    return int(self.examples["queries"].shape[0])

  @property
  def num_classes(self) -> int:
    """C, the number of buffer classes."""
    return int(self.buffer_arrays["class_membership"].shape[1])

  @property
  def class_names(self) -> tuple:
    """C class names (contiguous index -> text)."""
    return self._class_names

  def replay_buffer(self) -> ReplayBuffer:
    """The retrieval arrays as a `ReplayBuffer` of jnp arrays (on the default device)."""
    return make_replay_buffer(**{k: np.asarray(v) for k, v in self.buffer_arrays.items()})

  @property
  def by_reference(self) -> bool:
    """True when the store keeps its images by reference (decoded at gather time)."""
    return self.image_reference is not None

  def gather(self, indices, valid: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Batch dict of the buffer images `indices` (host-side NumPy fancy indexing).

    Thread-safe: reads the (memory-mapped) arrays and, for images by reference, decodes them
    (`images_lib.BufferImages`, whose only shared state is lock-guarded).

    Args:
      indices: int [n] buffer indices in [0, N) (duplicates allowed).
      valid: optional bool [n] (the retrieval's validity mask); ANDed into `example_mask`.
    Returns:
      dict with `images` float32 [n, S, S, 3] (by reference: the training pipeline's image;
      uint8 pixels -> float32 / 255), every other example key but `source_index` ([n, ...]),
      `stored_logits` float32 [n, T, Q] (padded slots = pad_logit), `stored_objectness`
      float32 [n, T] (OWLv2 stores only), `example_mask` bool [n],
      `buffer_index` int32 [n].
    Raises:
      IndexError: an index outside [0, N). ValueError: valid's shape differs from indices';
      images by reference without a source attached (`load(..., source=...)`), or a source
      whose image ids differ from the store's.
    Source: docs/reference.md §3 (DER++ replay batch), §6 (images by reference),
    CONVENTIONS.md batch dict.
    """
    indices = np.asarray(indices).astype(np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= self.num_images):
      raise IndexError(f"buffer indices must lie in [0, {self.num_images})")
    if valid is not None and np.shape(valid) != indices.shape:
      raise ValueError(f"valid {np.shape(valid)} does not match indices {indices.shape}")
    if self.verifier is not None:
      self._verify_rows(indices)
    batch = {}
    if self.by_reference:
      if self.images is None:
        raise ValueError(
          "this replay store keeps its images by reference: load it with the pre-training "
          "source it was built from (ReplayStore.load(path, source=...))"
        )
      batch["images"] = self.images(indices)
    for k, v in self.examples.items():
      if k == "source_index":
        continue
      x = np.asarray(v[indices])
      if k == "images" and x.dtype == np.uint8:
        x = x.astype(np.float32) / np.float32(255.0)
      batch[k] = x
    batch["stored_logits"] = decode_logits(
      self.stored_logits[indices], batch["queries"], self.pad_logit
    )
    if self.stored_objectness is not None:
      batch["stored_objectness"] = np.asarray(self.stored_objectness[indices]).astype(np.float32)
    mask = np.ones(indices.shape, bool)
    if "example_mask" in batch:
      mask &= batch["example_mask"].astype(bool)
    if valid is not None:
      mask &= np.asarray(valid, bool)
    batch["example_mask"] = mask
    batch["buffer_index"] = indices.astype(np.int32)
    return batch

  def _verify_rows(self, indices: np.ndarray) -> None:
    """Checks the chunks of the per-image files that rows `indices` lie in (lazy verification).

    Raises:
      integrity.IntegrityError: a chunk differs from the manifest (the store is set aside
        first, `on_damage`, so the next run rebuilds it).
    """
    rows = np.unique(indices)
    try:
      for name, array in self._arrays().items():
        rel = name + ".npy"
        if not (isinstance(array, np.memmap) and is_row_file(rel)):
          continue
        row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
        for i in rows:
          start = array.offset + int(i) * row_bytes
          self.verifier.check(rel, start, start + row_bytes)
    except integrity.IntegrityError as e:
      if self.on_damage is not None:
        self.on_damage(e)
      raise integrity.IntegrityError(
        e.path, f"{e.reason}; the replay store was set aside: run again to rebuild it"
      ) from None

  # ------------------------------------------------------------------------- persistence
  def _arrays(self) -> dict[str, np.ndarray]:
    arrays = {f"examples.{k}": v for k, v in self.examples.items()}
    arrays["stored_logits"] = self.stored_logits
    if self.stored_objectness is not None:
      arrays["stored_objectness"] = self.stored_objectness
    arrays.update({f"buffer.{k}": v for k, v in self.buffer_arrays.items()})
    return arrays

  def save(self, path: str) -> None:
    """Writes the store to directory `path` atomically (`utils.atomic_directory`), with the
    manifest of its files' digests last (`integrity.write_manifest`).

    An existing store at `path` is replaced once the new one is complete. Raises OSError on
    filesystem errors (the temporary directory is removed).
    """
    with utils.atomic_directory(path, if_exists="replace") as tmp:
      dtypes = {}
      for name, array in self._arrays().items():
        array = np.asarray(array)
        dtypes[name] = str(array.dtype)
        if array.dtype == LOGITS_DTYPES["bfloat16"]:
          array, dtypes[name] = array.view(np.uint16), "bfloat16"
        with open(os.path.join(tmp, name + ".npy"), "wb") as f:
          np.save(f, array, allow_pickle=False)
          f.flush()
          os.fsync(f.fileno())
      write_meta(
        tmp, self._class_names, self.logits_dtype, self.pad_logit, dtypes, self.image_reference
      )
      integrity.write_manifest(tmp)  # the commit mark, last

  @classmethod
  def load(
    cls,
    path: str,
    mmap: bool = True,
    *,
    source: Any = None,
    image_cache: str | None = None,
    decode_threads: int = 4,
  ) -> ReplayStore:
    """Reads a store written by `save` (or the builder), of format 1 or 2.

    A store of images by reference decodes them from `source` at gather time; a store of
    pixels (format 1, written before images were kept by reference) keeps working from its
    pixels, which one log line says (delete it to rebuild it by reference: the rebuild is a
    pass over the pre-training set, so it is not forced).

    Args:
      path: the store directory.
      mmap: memory-map the arrays (read lazily by `gather`); False loads them into RAM.
      source: the pre-training source the store was built from (`len`, `load(i)`); needed by
        `gather` of a store by reference (None: its arrays are readable, gather refuses).
      image_cache: root folder of the optional uint8 image cache on local disk
        (`replay.image_cache`, `images_lib.ImageCache`); None: decode at every gather.
      decode_threads: threads decoding the images of one gather.
    Raises:
      FileNotFoundError: no store at path. ValueError: unsupported format version; a source
      with fewer images than the store's indices.
    """
    with open(os.path.join(path, "meta.json")) as f:
      meta = json.load(f)
    if meta.get("format_version") not in READABLE_FORMATS:
      raise ValueError(
        f"{path}: unsupported replay store format {meta.get('format_version')} "
        f"(this version reads {list(READABLE_FORMATS)})"
      )
    arrays = {}
    for name, dtype in meta["arrays"].items():
      array = np.load(
        os.path.join(path, name + ".npy"), mmap_mode="r" if mmap else None, allow_pickle=False
      )
      if dtype == "bfloat16":
        array = array.view(LOGITS_DTYPES["bfloat16"])
      arrays[name] = array
    examples = {k[len("examples.") :]: v for k, v in arrays.items() if k.startswith("examples.")}
    buffer = {k[len("buffer.") :]: v for k, v in arrays.items() if k.startswith("buffer.")}
    reference = meta.get("images")
    images = None
    if reference is None and meta["format_version"] == 1:
      logging.info(
        "replay store %s holds its images' pixels (%.2f GB, written before images were kept by "
        "reference): replay reads them; delete the folder to rebuild it by reference",
        path,
        arrays["examples.images"].nbytes / 1e9,
      )
    if reference is not None and source is not None:
      images = images_lib.BufferImages(
        source,
        examples["source_index"],
        examples["image_id"],
        image_size=reference["image_size"],
        pad_value=reference["pad_value"],
        squash=reference["squash"],
        resize=reference.get("resize", "resize_with_pad"),
        cache_dir=image_cache,
        cache_key=images_lib.cache_key(reference, examples["source_index"], examples["image_id"]),
        num_threads=decode_threads,
      )
    store = cls(
      examples,
      arrays["stored_logits"],
      buffer,
      meta["class_names"],
      logits_dtype=meta["logits_dtype"],
      pad_logit=meta["pad_logit"],
      logits_encoded=True,
      stored_objectness=arrays.get("stored_objectness"),
      image_reference=reference,
      images=images,
    )
    store.path = os.path.abspath(path)
    return store


# --------------------------------------------------------------------- writing in chunks
def write_meta(
  folder: str,
  class_names: Sequence[str],
  logits_dtype: str,
  pad_logit: float,
  arrays: Mapping[str, str],
  image_reference: Mapping[str, Any] | None = None,
) -> None:
  """Writes (fsynced) the `meta.json` that makes `folder` a store `ReplayStore.load` reads.

  Args:
    folder: the store folder holding `<name>.npy` for every name of `arrays`.
    class_names: C class names.
    logits_dtype: storage dtype of `stored_logits` ('float32' | 'float16' | 'bfloat16').
    pad_logit: the model's padded-query logit.
    arrays: array name (`examples.<key>`, `stored_logits`, OWLv2's `stored_objectness`,
      `buffer.<key>`) -> dtype name
      ('bfloat16' for arrays saved as their uint16 bit pattern).
    image_reference: images by reference: IMAGE_REFERENCE_FIELDS (S, pad value, squash, build
      key); None for a store of pixels.
  """
  meta = dict(
    format_version=FORMAT_VERSION,
    class_names=[str(c) for c in class_names],
    logits_dtype=logits_dtype,
    pad_logit=float(pad_logit),
    arrays=dict(arrays),
    # The writer commits the folder with a manifest (`integrity.write_manifest`).
    **{CHECKSUMS_FIELD: True},
  )
  if image_reference is not None:
    meta["images"] = dict(image_reference)
  with open(os.path.join(folder, "meta.json"), "w") as f:
    json.dump(meta, f, indent=1)
    f.flush()
    os.fsync(f.fileno())


class ArrayFile:
  """A store array's `<folder>/<name>.npy`, written in blocks of rows by plain file writes.

  No memory mapping: rows written do not stay in the writer's resident memory (a mapped file's
  touched pages count in its RSS until unmapped), so a store larger than RAM can be written.
  bfloat16 arrays are stored as their uint16 bit pattern (as `ReplayStore.save`).

  Args:
    folder: the (build) folder of the store's files.
    name: array name, e.g. 'stored_logits' or 'examples.images'.
    dtype: NumPy dtype of the array (bfloat16 allowed).
    shape: the full shape [N, ...] to create (a sparse, zero-filled file replacing any old
      one), or None to open the existing file (a resumed build).
  Raises:
    FileNotFoundError: opening (shape None) a file that is not there.
    ValueError: the opened file's dtype is not `dtype`.
  """

  def __init__(self, folder: str, name: str, dtype, shape: tuple[int, ...] | None = None):
    self.dtype = np.dtype(dtype)
    self.on_disk = np.dtype(np.uint16) if self.dtype == LOGITS_DTYPES["bfloat16"] else self.dtype
    self.path = os.path.join(folder, name + ".npy")
    if shape is not None:
      # open_memmap writes the header and extends the file without touching its pages.
      created = np.lib.format.open_memmap(
        self.path, mode="w+", dtype=self.on_disk, shape=tuple(shape)
      )
      del created
    self._file = open(self.path, "r+b")  # noqa: SIM115 (closed by `close`)
    version = np.lib.format.read_magic(self._file)
    read_header = (
      np.lib.format.read_array_header_1_0
      if version == (1, 0)
      else np.lib.format.read_array_header_2_0
    )
    self.shape, _, file_dtype = read_header(self._file)
    if file_dtype != self.on_disk:
      self._file.close()
      raise ValueError(f"{self.path} holds {file_dtype}, expected {self.on_disk}")
    self._offset = self._file.tell()
    self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.on_disk.itemsize

  def write(self, start: int, rows: np.ndarray) -> None:
    """Writes `rows` [n, ...] (cast to the array's dtype) as rows start .. start + n - 1."""
    rows = np.ascontiguousarray(np.asarray(rows).astype(self.dtype, copy=False))
    if rows.shape[1:] != tuple(self.shape[1:]) or not 0 <= start <= self.shape[0] - len(rows):
      raise ValueError(f"rows {rows.shape} at {start} do not fit {self.path} {self.shape}")
    self._file.seek(self._offset + start * self._row_bytes)
    self._file.write(rows.view(self.on_disk).tobytes())

  def sync(self) -> None:
    """Makes the rows written so far durable (flush + fsync)."""
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self) -> None:
    self._file.close()


def dtype_name(dtype) -> str:
  """The meta.json name of a store array's dtype ('bfloat16' for bfloat16, else NumPy's)."""
  dtype = np.dtype(dtype)
  return "bfloat16" if dtype == LOGITS_DTYPES["bfloat16"] else str(dtype)

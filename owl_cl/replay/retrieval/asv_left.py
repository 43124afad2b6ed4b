"""ASER-PC's ASV left term over the whole buffer at scale: chunked, sharded over the mesh,
resumable and cached next to the replay store (paper §4 "ASER-PC", suppl. §C; docs/reference.md
§7).

With the buffer as both the candidate and the evaluation set, the left term of buffer image i is
    left(i) = (1/N) sum_j s_j(i),    left_min(i) = min_j s_j(i),
s_j(i) the max-reduced image-level KNN-SV of image i for evaluation image j
(`knn_shapley.image_knn_shapley`, reduction 'max'). All-to-all, every one of the N*k
evaluation tokens sorts all N*k candidate tokens: the time is O((N k)^2 log(N k)) (quadratic in
N k up to the log), the memory of a chunk of c images about 10 float32 arrays of c*k x N*k.

How it runs (`compute_left_term`):
  * the evaluation images in chunks of `chunk_size` (one static shape: the last chunk is
    padded by clamped indices and masked), one jitted function compiled once;
  * each chunk's rows are split over the mesh's 'data' axis (`jax.shard_map`): device d takes
    its c / D rows from the replicated buffer arrays by index, computes their [c / D, N]
    values against every candidate and reduces them to a partial sum and min over its rows;
    `psum` / `pmin` over the devices give the chunk's [N] sum and min, replicated;
  * the chunks' sums are accumulated in float64 on the host (no precision lost over N
    chunks), the min in float32;
  * with a progress folder, every chunk commits (one atomic, fsynced `state.npz`: chunks done,
    the running sum and min, so the sums never run ahead of the commit; as
    `replay/build.py`'s passes). A computation killed at any point resumes from its last
    committed chunk, bit for bit the result of an uninterrupted one (same chunks, devices and
    compiled code: a folder of another shape, option set, chunk size, device count or kind,
    or JAX version is started afresh).

`cached_left_term` keeps the result in `<prefix>.asv_left-<digest of the options>.npz`, the
prefix being the cached replay store's folder (its cache key), written atomically and loaded
instead of recomputed; its progress folder is the same name + `.build`. The file is checked
when read: NumPy's `.npz` is a zip whose members carry a CRC-32, which `zipfile` compares
when a member is read to its end, so a changed or cut file fails to load; it is then set aside
(`.corrupt-<time>`) and recomputed with a warning naming it. Runs sharing the cache take the
file's lock (`<file>.lock`): one computes, the others wait and load its result.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import json
import os
import shutil
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import tqdm

from owl_cl import distributed
from owl_cl import integrity
from owl_cl import preemption
from owl_cl import utils
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.train import sharding as sharding_lib

Array = jax.Array

# Version of the cached file's and of the progress folder's layout (another version: recomputed).
LEFT_TERM_FORMAT = 1


def left_term_options(
  k: int,
  *,
  token_matching: str = "all_to_all",
  distance: str = "l2",
  shapley: str = "knn",
  threshold: float | None = None,
  num_classes: float = knn_shapley.TKNN_NUM_CLASSES,
  features: str = "class_embeddings",
) -> dict:
  """The options the left term depends on, as a JSON-able dict (a cache key's material).

  `features` names the buffer's tokens the distances compare (`replay.aser.asv_features`):
  only recorded, the caller passes those tokens. K counts only for shapley 'knn', the
  threshold and C only for 'tknn' (the others are left out, so that changing an unused option
  does not recompute the left term).

  Raises:
    ValueError: an unknown option value, or K < 1 with 'knn'.
  Source: `knn_shapley.image_knn_shapley`'s options.
  """
  knn_shapley._check_options(token_matching, distance, "max", shapley)  # pylint: disable=protected-access
  options = dict(
    token_matching=token_matching, distance=distance, shapley=shapley, features=str(features)
  )
  if shapley == "knn":
    if int(k) < 1:
      raise ValueError(f"the KNN-SV's K must be >= 1, got {k}")
    options["k"] = int(k)
  else:
    options["threshold"] = None if threshold is None else float(threshold)
    options["num_classes"] = float(num_classes)
  return options


@functools.partial(jax.jit, static_argnames=("mesh", "num_images", "chunk", "options"))
def _chunk_sums(
  start: Array,
  class_tokens: Array,
  query_embeddings: Array,
  *,
  mesh,
  num_images: int,
  chunk: int,
  options: tuple[tuple[str, Any], ...],
) -> tuple[Array, Array]:
  """Sum float32 [N] and min float32 [N] of the max-reduced KNN-SVs over evaluation images
  start .. start + chunk - 1 (int32 []; those >= N masked), rows split over the mesh.

  Args: class tokens float32 [N, t, D], queries float32 [N, t, E], replicated; static: the
  mesh, N, chunk (a multiple of the mesh's data size) and `left_term_options` as sorted
  items (jit compiles once per distinct value and keeps it: no cache of our own).
  """
  devices = mesh.shape[sharding_lib.DATA_AXIS]
  local = chunk // devices
  kwargs = {name: v for name, v in options if name != "features"}
  k = kwargs.pop("k", 1)  # unused by 'tknn'

  def local_rows(start, class_tokens, query_embeddings):
    # Device d evaluates images start + d * local .. start + (d + 1) * local - 1; indices
    # beyond the buffer (the last chunk) are clamped to a real image and masked out.
    index = start + jax.lax.axis_index(sharding_lib.DATA_AXIS) * local + jnp.arange(local)
    valid = index < num_images
    index = jnp.minimum(index, num_images - 1)
    values, _ = knn_shapley.image_knn_shapley(
      class_tokens[index],
      query_embeddings[index],
      class_tokens,
      query_embeddings,
      k,
      reduction="max",
      **kwargs,
    )  # [local, N]
    total = jnp.sum(jnp.where(valid[:, None], values, 0.0), axis=0)
    minimum = jnp.min(jnp.where(valid[:, None], values, jnp.inf), axis=0)
    return (
      jax.lax.psum(total, sharding_lib.DATA_AXIS),
      jax.lax.pmin(minimum, sharding_lib.DATA_AXIS),
    )

  # check_vma=False: the KNN-SV's scan carries a fresh (unvarying) zero vector into values that
  # vary over the devices, which the check rejects; the outputs are replicated by psum / pmin.
  return jax.shard_map(
    local_rows, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()), check_vma=False
  )(start, class_tokens, query_embeddings)


def chunk_function(mesh, num_images: int, chunk: int, options: dict):
  """The jitted computation of one chunk, as `compute_left_term` calls it.

  Args:
    mesh: the device mesh the chunk's rows are split over.
    num_images: N, images of the buffer.
    chunk: evaluation images per call, a multiple of the mesh's data size.
    options: `left_term_options`.

  Returns:
    A function (start int32 [], class tokens float32 [N, t, D], queries float32 [N, t, E],
    both replicated) -> (sum float32 [N], min float32 [N]) over evaluation images
    start .. start + chunk - 1 (`_chunk_sums`). benchmarks/asv_left.py times it.
  """
  return functools.partial(
    _chunk_sums,
    mesh=mesh,
    num_images=num_images,
    chunk=chunk,
    options=tuple(sorted(options.items())),
  )


def _broadcast(value: np.ndarray) -> np.ndarray:
  """The writer's `value` on every process (itself with one process)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  return np.asarray(multihost_utils.broadcast_one_to_all(value))


class _ProgressFolder:
  """The progress of one computation: `manifest.json` (what it is of) and `state.npz` (chunks
  committed, float64 [N] sum and float32 [N] min over them). A folder with another manifest is
  discarded."""

  def __init__(self, path: str, manifest: dict):
    self.path = path
    self.state_path = os.path.join(path, "state.npz")
    utils.open_progress_folder(path, manifest, "ASER-PC left term")

  def state(self) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """(chunks committed, sum float64 [N], min float32 [N]); (0, None, None) before the first."""
    if not os.path.exists(self.state_path):
      return 0, None, None
    with np.load(self.state_path) as z:
      return int(z["chunks"]), z["total"], z["minimum"]

  def commit(self, chunks: int, total: np.ndarray, minimum: np.ndarray) -> None:
    """Records `chunks` done with their running sum and min (atomic and fsynced)."""
    utils.atomic_write(
      self.state_path,
      lambda tmp: np.savez(tmp, chunks=chunks, total=total, minimum=minimum),
      suffix=".npz",
    )


def mesh_of(array, mesh=None):
  """The mesh the left term is computed on.

  Args:
    array: the buffer's tokens (NumPy or `jax.Array`).
    mesh: a `jax.sharding.Mesh` with axis 'data', returned as it is; None: the mesh of
      `array`'s `NamedSharding`, else a 1-device mesh (its first device, or the default).
  Returns:
    `jax.sharding.Mesh` (axis 'data', `sharding.create_mesh`).
  Source: `owl_cl/train/sharding.py`.
  """
  if mesh is not None:
    return mesh
  sharding = getattr(array, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding.mesh
  devices = sorted(array.devices(), key=lambda d: d.id) if isinstance(array, jax.Array) else None
  return sharding_lib.create_mesh(devices[:1] if devices else jax.devices()[:1])


def _check_inputs(class_shape, query_shape, chunk_size) -> int:
  """N of `compute_left_term`'s inputs; ValueError (before any work) for shapes that are not
  [N, t, *] with the same N >= 1 and t, or chunk_size < 1."""
  if len(class_shape) != 3 or len(query_shape) != 3 or class_shape[:2] != query_shape[:2]:
    raise ValueError(
      "ASER-PC left term: the class tokens and query embeddings must be [N, t, D] and "
      f"[N, t, E] with the same N and t; got {class_shape} and {query_shape}"
    )
  num_images = int(class_shape[0])
  if num_images < 1:
    raise ValueError("ASER-PC left term: the buffer has no image")
  if int(chunk_size) < 1:
    raise ValueError(f"ASER-PC left term: chunk_size must be >= 1, got {chunk_size}")
  return num_images


def _manifest(key, class_shape, query_shape, options, chunk, mesh) -> dict:
  """What a progress folder's committed chunks depend on: a folder with another manifest is
  started afresh."""
  return dict(
    format=LEFT_TERM_FORMAT,
    key=key,
    class_tokens=list(class_shape),
    query_embeddings=list(query_shape),
    options=options,
    chunk=chunk,
    devices=mesh.shape[sharding_lib.DATA_AXIS],
    # Bit-identical chunks need the same compiled code: another platform or JAX restarts.
    platform=str(mesh.devices.flat[0].device_kind),
    jax=jax.__version__,
  )


def compute_left_term(
  class_tokens,
  query_embeddings,
  options: dict,
  *,
  mesh=None,
  chunk_size: int = 64,
  folder: str | None = None,
  key: str = "",
  progress: bool = True,
  chunk_hook: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """ASER-PC's left term over the whole buffer, in sharded chunks, optionally resumable.

  Args:
    class_tokens: float [N, t, D]; the tokens the KNN distances compare (the buffer's top-k
      class embeddings, or its image features with `asv_features='image_features'`); NumPy
      or a `jax.Array` (already replicated on `mesh`: not copied).
    query_embeddings: float [N, t, E]; the same tokens' query embeddings (the utilities).
    options: `left_term_options(...)`.
    mesh: the device mesh; each chunk's rows are split over its 'data' axis. None: the mesh
      `class_tokens` is replicated on, else one device.
    chunk_size: evaluation images per chunk (>= 1; capped at N, then rounded up to a multiple
      of the mesh's devices). Memory per device: about 10 float32 arrays of
      (chunk / devices) * t x N * t.
    folder: the progress folder (None: nothing written, nothing resumed). Every chunk
      commits to it; a later call with the same folder and the same inputs' shapes, options,
      chunk, device count and kind and JAX version resumes after its last committed chunk
      (the result is bit for bit that of an uninterrupted call); otherwise the folder is
      started afresh. Only process 0 writes it.
    key: what the computation is of (e.g. the cache key); a folder with another key is
      started afresh.
    progress: show a progress bar (images, rate, ETA) on process 0.
    chunk_hook: test hook, called with the number of chunks done after each chunk is
      accumulated and before it is committed.
  Returns:
    left: float32 [N]; (1/N) sum_j s_j(i), the left term of eq. 3 without w.
    left_min: float32 [N]; min_j s_j(i) (w of eq. 4 over a candidate subset).
    On processes other than 0 a resumed computation returns only the chunks it computed
    itself: read the writer's result (`cached_left_term` does).
  Raises:
    ValueError: class_tokens / query_embeddings not [N, t, *] with the same N >= 1 and t, or
      chunk_size < 1 (before any work).
  Source: paper §4 "ASER-PC", suppl. §C; docs/reference.md §7; the module docstring.
  """
  class_shape, query_shape = np.shape(class_tokens), np.shape(query_embeddings)
  num_images = _check_inputs(class_shape, query_shape, chunk_size)
  mesh = mesh_of(class_tokens, mesh)
  devices = mesh.shape[sharding_lib.DATA_AXIS]
  chunk = -(-min(int(chunk_size), num_images) // devices) * devices
  num_chunks = -(-num_images // chunk)
  writer = distributed.is_writer()
  committed = None
  if folder is not None and writer:
    manifest = _manifest(key, class_shape, query_shape, options, chunk, mesh)
    committed = _ProgressFolder(folder, manifest)
  first, total, minimum = committed.state() if committed is not None else (0, None, None)
  first = int(_broadcast(np.int32(first)))
  if total is None:
    total = np.zeros((num_images,), np.float64)
    minimum = np.full((num_images,), np.inf, np.float32)
  replicated = sharding_lib.replicated(mesh)
  as_replicated = lambda x: (
    x
    if isinstance(x, jax.Array) and x.sharding == replicated
    else sharding_lib.replicate(jnp.asarray(x, jnp.float32), mesh)
  )
  tokens, queries = as_replicated(class_tokens), as_replicated(query_embeddings)
  function = chunk_function(mesh, num_images, chunk, options)
  bar = tqdm.tqdm(
    total=num_images,
    initial=min(first * chunk, num_images),
    desc=f"ASER-PC left term ({chunk} images/chunk, {devices} devices)",
    unit="img",
    mininterval=2.0,
    disable=not (progress and writer),
  )
  hook = chunk_hook or (lambda chunks: None)
  for c in range(first, num_chunks):
    chunk_total, chunk_min = sharding_lib.fetch_replicated(
      function(jnp.int32(c * chunk), tokens, queries)
    )
    total = total + chunk_total.astype(np.float64)
    minimum = np.minimum(minimum, chunk_min)
    hook(c + 1)
    preemption.checkpoint_event("asv_left_chunk")  # test-only kill hook (a no-op otherwise)
    if committed is not None:
      committed.commit(c + 1, total, minimum)
    bar.update(min(chunk, num_images - c * chunk))
  bar.close()
  return (total / num_images).astype(np.float32), minimum.astype(np.float32)


def cache_path(prefix: str, options: dict) -> str:
  """The cached left term's file for the buffer cached at `prefix` (the replay store's folder,
  named by its cache key) and `options`: `<prefix>.asv_left-<digest(format, options)>.npz`."""
  return f"{prefix}.asv_left-{utils.digest([LEFT_TERM_FORMAT, options])}.npz"


def cached_left_term(
  prefix: str,
  class_tokens,
  query_embeddings,
  options: dict,
  **kwargs,
) -> tuple[np.ndarray, np.ndarray]:
  """`compute_left_term` cached next to the replay store at `prefix` (`cache_path`).

  Loaded when the file is there, intact (every member's zip CRC-32 matches) and of these
  options and N images; else computed with the progress folder `<file>.build` (resumed if an
  earlier computation was interrupted), written atomically by process 0 (then the progress
  folder is removed), and read back by every process. A damaged file is set aside
  (`integrity.set_aside`, a warning naming it) and recomputed. Runs sharing the cache take the
  file's lock (`utils.cache_entry_lock`): one computes, the others wait and load its result.

  Args:
    prefix: the replay store's folder (`ReplayStore.path`, `cache_dir/buffers/<key>`).
    class_tokens: as `compute_left_term`.
    query_embeddings: as `compute_left_term`.
    options: as `compute_left_term`.
    **kwargs: `compute_left_term`'s mesh, chunk_size, progress, chunk_hook.
  Returns:
    (left float32 [N], left_min float32 [N]) as `compute_left_term`.
  Raises:
    ValueError: as `compute_left_term`.
    integrity.IntegrityError: the file written by this call does not read back.
  """
  path = cache_path(prefix, options)
  num_images = int(np.shape(class_tokens)[0])
  material = json.dumps(dict(format=LEFT_TERM_FORMAT, options=options), sort_keys=True)

  def load():
    """(left, left_min), None when the file is of other options or N.

    Raises: IntegrityError when it is damaged (zip CRC, a cut or unreadable file)."""
    try:
      with np.load(path, allow_pickle=False) as z:
        if str(z["key"]) != material or z["left"].shape != (num_images,):
          return None
        return z["left"], z["left_min"]
    except FileNotFoundError:
      raise integrity.IntegrityError(path, "missing") from None
    except Exception as e:  # pylint: disable=broad-except
      # zipfile.BadZipFile (CRC, cut file), ValueError, KeyError, EOFError, zlib.error, ...
      raise integrity.IntegrityError(path, f"unreadable ({type(e).__name__}: {e})") from None

  def load_or_set_aside():
    if not os.path.exists(path):
      return None
    try:
      loaded = load()
    except integrity.IntegrityError as e:
      integrity.set_aside(path, str(e))
      logging.warning("ASER-PC left term: %s was damaged; recomputing it", path)
      return None
    if loaded is None:
      logging.warning("ASER-PC left term: %s is of another buffer or options; recomputing", path)
    return loaded

  with distributed.cache_entry_lock(path, "ASER-PC left term") as writable:
    loaded = load_or_set_aside() if distributed.is_writer() else None
    if distributed.writer_value(loaded is not None):
      logging.info("ASER-PC left term: re-using %s", path)
      return loaded if loaded is not None else load()
    if not writable:
      raise utils.ReadOnlyCacheError(path, "the ASER-PC left term", "not in the cache")
    start = time.time()
    left, left_min = compute_left_term(
      class_tokens, query_embeddings, options, folder=path + ".build", key=material, **kwargs
    )
    if distributed.is_writer():
      utils.atomic_write(
        path,
        lambda tmp: np.savez(tmp, left=left, left_min=left_min, key=np.asarray(material)),
        suffix=".npz",
      )
      shutil.rmtree(path + ".build", ignore_errors=True)
      logging.info(
        "ASER-PC left term of %d images: %.1f s, cached in %s",
        num_images,
        time.time() - start,
        path,
      )
    distributed.barrier(f"asv-left-cached-{os.path.basename(path)}")
  return load()

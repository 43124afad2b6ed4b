"""Building the replay buffer from the pre-training set with the pre-trained model
(docs/reference.md §6), streaming and resumable.

The pre-training set flows through the input pipeline (grain, optional worker processes) in
batches over the devices of the mesh (each process reads its rows of every batch), in three
passes of the jitted eval-mode forward of the pre-trained model:

  1. every image: the detection loss (eq. 7 ranks images by it) and the class membership;
     only these ([N] float32 and [N, C] bool, memory-mapped files) are kept;
  selection: `select_buffer` (loss < t, per-class top-up) on those arrays;
  2. the selected images: the examples without their pixels (the images are kept by
     reference: source index and image id, `replay/images.py`), the logits to distil (DER++;
     with OWLv2 also the objectness logits, docs/owlv2.md),
     the top-k class and query embeddings (retrieval features) are written to the store's
     files in chunks, and the
     prototype sums / counts (top-n_c class embeddings per class) are reduced on the device
     and accumulated (float64) on the host;
  3. the selected images again: their prototype distances to the now complete prototypes.

Host memory holds one batch, the [C, E] prototype sums and the selection's per-image arrays
(memory-mapped); it does not grow with the images' size or the buffer's. Every `chunk_images`
images, each pass commits its progress (arrays fsynced, then a small state file written
atomically) in a build folder, so a build killed at any point resumes from its last complete
chunk; the result is identical to an uninterrupted build (the passes are deterministic and the
chunks the same). The finished store is moved into place with `utils.atomic_directory` and the
build folder removed. The store is a `ReplayStore` folder (memory-mapped on load).

Multi-process: every process runs the same batches, reading only its rows of each (the forward
is collective and its outputs replicated); process 0 (the writer) keeps the build folder and
writes the store, and tells the others where to resume, which images were selected and the
prototypes; the others read the store from the shared cache folder.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import hashlib
import json
import os
import shutil
import time

from absl import logging
import grain
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from owl_cl import distributed
from owl_cl import integrity
from owl_cl import utils
from owl_cl.data import image_ops
from owl_cl.data import input_pipeline
from owl_cl.data.spec import ExampleSpec
from owl_cl.replay import buffer_selection
from owl_cl.replay import store as store_lib
from owl_cl.train import losses
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import top_k as top_k_lib
from owl_cl.utils import atomic_write_json
from owl_cl.utils import digest

# The arrays of an example the forward reads (defined once, by the store), and those the store
# keeps: all but the pixels, plus the image id, which with the source index (written from the
# selection) references the image.
EXAMPLE_KEYS = store_lib.REQUIRED_EXAMPLE_KEYS
STORED_EXAMPLE_KEYS = store_lib.TARGET_KEYS + ("image_id",)
# Version of the build folder's layout; a folder of another version is started afresh.
# 2: images by reference (1 wrote the pixels).
BUILD_FORMAT = 2
# Example options that would make a buffer example's image more than the resized source image
# (augmentations): refused, since images by reference are re-made without them.
_AUGMENTATIONS = ("hflip", "random_crop", "mosaic_sizes")
PASSES = ("losses", "features", "distances")
# How `cached_store` checks a cached store when loading it (docs/stored_state.md): 'full'
# hashes every file first; 'lazy' checks sizes and the small files, then each chunk of the
# per-image arrays when `gather` first reads it (`integrity.LazyVerifier`).
STORE_VERIFICATIONS = ("full", "lazy")
_INT32_MAX = np.iinfo(np.int32).max


class BufferExample:
  """Image index -> its fixed training example (a picklable grain transform).

  The example of image i is `input_pipeline.preprocess_train_example(source.load(i), spec,
  rng=input_pipeline.example_rng(seed, 0, i), **options)` restricted to `EXAMPLE_KEYS` and
  `image_id`: its queries and negatives are drawn once, seeded by the image index, so every
  pass (and every resumed build) sees the same example. Not augmented: its image is
  `image_ops.resize_with_pad` of the source image, which the store re-makes at gather time.
  """

  def __init__(self, source, seed: int, spec: ExampleSpec, options: dict):
    self.source, self.seed, self.spec, self.options = source, int(seed), spec, dict(options)

  def __call__(self, index) -> dict[str, np.ndarray]:
    index = int(index)
    example = input_pipeline.preprocess_train_example(
      self.source.load(index),
      self.spec,
      rng=input_pipeline.example_rng(self.seed, 0, index),
      **self.options,
    )
    return {k: example[k] for k in EXAMPLE_KEYS + ("image_id",)}

  @property
  def image_reference(self) -> dict:
    """How the images are made (`store_lib.IMAGE_REFERENCE_FIELDS` but the key, and OWLv2's
    `resize` when set)."""
    reference = dict(
      image_size=self.spec.image_size,
      pad_value=float(self.options.get("pad_value", image_ops.TRAIN_PAD_VALUE)),
      squash=bool(self.options.get("squash", False)),
    )
    # OWLv2's preprocessing (docs/owlv2.md); absent for v1, whose stores keep their fields.
    if self.options.get("resize", "resize_with_pad") != "resize_with_pad":
      reference["resize"] = self.options["resize"]
    return reference


def make_steps(
  model,
  mesh,
  *,
  num_classes: int,
  top_k: int,
  max_per_class: int,
  distance_max_instances: int,
  loss_config: dict,
  prototype_sums_of_all: bool = False,
  image_features: bool = False,
  selection_objectness: bool = False,
) -> dict[str, Callable]:
  """The jitted per-batch functions of the three passes (outputs replicated on the mesh).

  Every function takes (params, batch) with the batch dict's `EXAMPLE_KEYS` [B, ...], plus
  `image_id` int32 [B] and `valid` bool [B] (False for padding rows), sharded along 'data'.

  Returns dict:
    'losses': -> per_image_loss float32 [B] (docs/reference.md §3), membership bool [B, C];
      with `prototype_sums_of_all` also the batch's prototype_sums / prototype_counts (as
      'features': the prototypes over every image, `prototype_images='all'`).
    'features': -> logits float32 [B, T, Q] (OWLv2: and objectness float32 [B, T]),
      top_class_embeddings / top_query_embeddings
      float32 [B, k, E] (`train.top_k.top_k_embeddings`), prototype_sums float32 [C, E]
      and prototype_counts int32 [C] summed over the valid rows
      (`buffer_selection.per_image_class_token_embeddings`), and the batch's examples
      without their pixels (`STORED_EXAMPLE_KEYS`), so that the writer has every process's
      rows; with
      `image_features` also top_image_features [B, k, D] (the ViT output tokens of the top-k
      tokens, `train.top_k.top_k_token_features`).
  With `selection_objectness` (OWLv2), 'losses' adds the objectness term at the loss config's
  `objectness_weight` to each image's loss (docs/owlv2.md, buffer selection); without it, and
  for v1, the loss is the detection loss's class and box terms.
    'distances': (params, batch, prototypes float32 [C, E]) -> prototype_distances float32
      [B, C] (`buffer_selection.prototype_distances` with `distance_max_instances`).
  The functions are module-level `jax.jit`s whose static arguments are the model (a linen
  module: hashed and compared by its configuration), the mesh and these options, so a later
  build with the same ones (a resumed build, the tests) reuses jit's compilations.
  Source: docs/reference.md §6.
  """
  options = dict(
    num_classes=int(num_classes),
    top_k=int(top_k),
    max_per_class=int(max_per_class),
    distance_max_instances=int(distance_max_instances),
    loss_config=tuple(sorted(loss_config.items())),
    prototype_sums_of_all=bool(prototype_sums_of_all),
    image_features=bool(image_features),
    selection_objectness=bool(selection_objectness),
  )
  static = dict(model=model, mesh=mesh, options=tuple(sorted(options.items())))
  return {
    "losses": functools.partial(_losses_step, **static),
    "features": functools.partial(_features_step, **static),
    "distances": functools.partial(_distances_step, **static),
  }


_STATIC = ("model", "mesh", "options")


def _forward(model, options, params, batch):
  out = model.apply({"params": params}, batch["images"], batch["queries"], train=False)
  counts = buffer_selection.instance_counts_from_labels(
    batch["labels"], batch["query_class"], options["num_classes"]
  )
  return out, counts


def _prototype_sums(options, out, counts, batch):
  sums, token_counts = buffer_selection.per_image_class_token_embeddings(
    out["pred_logits"],
    out["class_embeddings"],
    batch["query_class"],
    counts,
    max_per_class=options["max_per_class"],
  )
  # Reduced on the device: the host receives [C, E], not [B, C, E].
  valid = batch["valid"]
  return {
    "prototype_sums": jnp.sum(jnp.where(valid[:, None, None], sums, 0.0), axis=0),
    "prototype_counts": jnp.sum(jnp.where(valid[:, None], token_counts, 0), axis=0),
  }


@functools.partial(jax.jit, static_argnames=_STATIC)
def _losses_step(params, batch, *, model, mesh, options):
  options = dict(options)
  out, counts = _forward(model, options, params, batch)
  det = losses.detection_loss(
    out["pred_logits"],
    out["pred_boxes"],
    batch["labels"],
    batch["boxes"],
    # OWLv2: the objectness term counts in the selection loss only when asked
    # (replay.selection.objectness_in_loss, docs/owlv2.md); v1 has no objectness logits.
    objectness_logits=out.get("objectness_logits") if options["selection_objectness"] else None,
    **dict(options["loss_config"]),
  )
  result = {"per_image_loss": det["per_example"], "membership": counts > 0}
  if options["prototype_sums_of_all"]:
    result.update(_prototype_sums(options, out, counts, batch))
  return jax.lax.with_sharding_constraint(result, sharding_lib.replicated(mesh))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _features_step(params, batch, *, model, mesh, options):
  options = dict(options)
  top_k = options["top_k"]
  out, counts = _forward(model, options, params, batch)
  query_mask = batch["queries"][..., 0] > 0
  top_class, top_query = top_k_lib.top_k_embeddings(
    out["pred_logits"], out["class_embeddings"], out["query_embeddings"], query_mask, top_k
  )
  result = {
    "logits": out["pred_logits"],
    "top_class_embeddings": top_class,
    "top_query_embeddings": top_query,
    **_prototype_sums(options, out, counts, batch),
    **{k: batch[k] for k in STORED_EXAMPLE_KEYS},
  }
  if "objectness_logits" in out:  # OWLv2: distilled by DER++ too (docs/owlv2.md)
    result["objectness"] = out["objectness_logits"]
  if options["image_features"]:
    feature_map = out["feature_map"]
    result["top_image_features"] = top_k_lib.top_k_token_features(
      out["pred_logits"],
      feature_map.reshape(feature_map.shape[0], -1, feature_map.shape[-1]),
      query_mask,
      top_k,
    )
  return jax.lax.with_sharding_constraint(result, sharding_lib.replicated(mesh))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _distances_step(params, batch, prototypes, *, model, mesh, options):
  options = dict(options)
  out, counts = _forward(model, options, params, batch)
  distances = buffer_selection.prototype_distances(
    out["pred_logits"],
    out["class_embeddings"],
    batch["query_class"],
    counts,
    prototypes,
    max_instances=options["distance_max_instances"],
  )
  return jax.lax.with_sharding_constraint(distances, sharding_lib.replicated(mesh))


def _stream(
  transform: BufferExample,
  image_indices: np.ndarray,
  batch_size: int,
  first_batch: int,
  mesh,
  num_workers: int,
):
  """Yields (batch number b, valid rows count, global batch on the mesh) for b >= first_batch.

  Batch b holds images image_indices[b*B : (b+1)*B]; the last one is padded with copies of its
  first image (static shapes; `valid` False there). Each process reads only its rows.
  """
  n = len(image_indices)
  num_batches = -(-n // batch_size)
  rows = sharding_lib.process_rows(batch_size, mesh)
  positions = []
  for b in range(first_batch, num_batches):
    idx = np.arange(b * batch_size, min((b + 1) * batch_size, n))
    positions.append(np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])[rows])
  if not positions:
    return
  ds = grain.MapDataset.source(image_indices[np.concatenate(positions)]).map(transform)
  # Private helper of the pipeline, reused so that worker processes behave as in training.
  batches = input_pipeline._to_batches(  # pylint: disable=protected-access
    ds, rows.stop - rows.start, False, num_workers, num_threads=2, prefetch=2 * batch_size
  )
  for b, batch in zip(range(first_batch, num_batches), batches):
    count = min(batch_size, n - b * batch_size)
    batch["valid"] = (np.arange(batch_size) < count)[rows]
    ids = np.asarray(batch["image_id"], np.int64)
    if np.abs(ids).max() > _INT32_MAX:
      raise ValueError(f"image ids beyond int32 (e.g. {ids.max()}) cannot pass the forward")
    batch["image_id"] = ids.astype(np.int32)
    yield b, count, sharding_lib.shard_batch(batch, mesh)


def _broadcast(value: np.ndarray) -> np.ndarray:
  """The writer's `value` on every process (itself with one process)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  return np.asarray(multihost_utils.broadcast_one_to_all(value))


class _BuildFolder:
  """The build folder of one store: progress, the selection's per-image arrays, the store files.

  Layout: `manifest.json` (what the build is of; a folder of another build is started afresh),
  `<pass>.npz` per pass (batches committed, with the prototype sums / counts accumulated up
  to them: one atomic file, so the sums never run ahead of the commit),
  `per_image_loss.npy` / `membership.npy` (pass 1), `store/` (the store's array files, filled
  in place).
  """

  def __init__(self, path: str, manifest: dict):
    self.path = path
    self.store = os.path.join(path, "store")
    utils.open_progress_folder(path, manifest, "replay buffer build", subfolder="store")

  def state(self, name: str) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """(batches committed by pass `name`, its sums float64 [C, E], counts int64 [C]); (0, None,
    None) before its first commit."""
    path = os.path.join(self.path, name + ".npz")
    if not os.path.exists(path):
      return 0, None, None
    with np.load(path) as z:
      return int(z["batches"]), z["sums"], z["counts"]

  def commit(self, name: str, batches: int, arrays=(), sums=None, counts=None) -> None:
    """Makes `arrays` (`ArrayFile`s) durable, then records `batches` done for pass `name` with
    its prototype sums and counts (atomic)."""
    for a in arrays:
      a.sync()
    utils.atomic_write(
      os.path.join(self.path, name + ".npz"),
      lambda tmp: np.savez(
        tmp,
        batches=batches,
        sums=np.zeros(0) if sums is None else sums,
        counts=np.zeros(0) if counts is None else counts,
      ),
      suffix=".npz",
    )

  def array(self, name: str, dtype, shape=None, in_store: bool = False) -> store_lib.ArrayFile:
    """An array file of the folder (`store/<name>` if `in_store`), created when `shape` is
    given, else opened (`store_lib.ArrayFile`)."""
    return store_lib.ArrayFile(self.store if in_store else self.path, name, dtype, shape)

  def read(self, name: str) -> np.ndarray:
    """The folder's array `name`, memory-mapped read-only."""
    return np.load(os.path.join(self.path, name + ".npy"), mmap_mode="r")


def _fingerprint(value) -> str:
  """A digest of `value` (nested dicts / lists / arrays) that covers every array element."""
  if isinstance(value, dict):
    return digest({k: _fingerprint(v) for k, v in sorted(value.items())})
  if isinstance(value, (list, tuple)):
    return digest([_fingerprint(v) for v in value])
  if isinstance(value, np.ndarray):
    return digest([str(value.dtype), value.shape, hashlib.sha256(value.tobytes()).hexdigest()])
  return digest(value)


def _accumulate(started: bool, sums, counts, out: dict) -> tuple[np.ndarray, np.ndarray]:
  """Adds a batch's device-reduced prototype sums [C, E] and counts [C] to the running ones,
  in float64 / int64 on the host (no precision lost over a million images)."""
  batch_sums = out["prototype_sums"].astype(np.float64)
  batch_counts = out["prototype_counts"].astype(np.int64)
  if not started:
    return batch_sums, batch_counts
  return sums + batch_sums, counts + batch_counts


def _chunk_ends(b: int, total: int, chunk: int) -> bool:
  """True when a chunk ends with batch b (every `chunk` batches, and the last of `total`)."""
  return (b + 1) % chunk == 0 or b + 1 == total


def build_store(
  model,
  params,
  source,
  path: str,
  *,
  spec: ExampleSpec,
  seed: int,
  loss_threshold: float,
  min_per_class: int,
  fill_all_for_rare_classes: bool,
  top_k: int,
  max_per_class: int,
  loss_config: dict,
  batch_size: int,
  example_options: dict | None = None,
  distance_max_instances: int | None = None,
  drop_images_without_class: bool = False,
  top_up_order: str = "class_index",
  budget: int | float | None = None,
  prototype_images: str = "buffer",
  image_features: bool = False,
  selection_objectness: bool = False,
  logits_dtype: str = "float16",
  pad_logit: float = -1e6,
  mesh=None,
  num_workers: int = 0,
  chunk_images: int = 4096,
  build_dir: str | None = None,
  build_key: str = "",
  chunk_hook: Callable[[str, int], None] | None = None,
) -> dict:
  """Selects the buffer from `source` (the pre-training set) and writes its `ReplayStore` to `path`.

  Selection is eq. 7 of the paper (docs/reference.md §6): loss < `loss_threshold`, then each
  class with fewer than `min_per_class` kept images gets its images in ascending loss order
  (`buffer_selection.select_buffer` with `fill_all_for_rare_classes`,
  `drop_images_without_class`, `top_up_order`). Prototypes are the mean of the selected
  images' top-n_c class embeddings (n_c = min(`max_per_class`, #instances)); an image's
  prototype distance takes the min over its min(`distance_max_instances` (None: M),
  #instances) best class-c embeddings. See the module docstring for the passes and resuming.

  Args:
    model, params: the pre-trained OWL-ViT (flax module) and its parameters.
    source: the pre-training set (`len`, `load(i)`, `class_names`).
    path: the store folder to write (replaced atomically if it exists).
    spec, seed, example_options: the fixed training example of each
      image (`BufferExample`; `example_options`: the run's squash, merge_iou,
      negative_weights; no augmentation: the store re-makes the images from the source).
    loss_config: `losses.detection_loss` options. batch_size: images per forward (global, a
      multiple of the mesh's devices).
    budget: `replay.budget`: None keeps eq. 7's selection; a fraction of `source` or an image
      count brings it to exactly that size (`buffer_selection.budget_count`, `apply_budget`,
      seeded by `seed`).
    prototype_images: the prototypes average the kept images ('buffer', the paper) or every
      image of `source` ('all', the released code; their sums are reduced in pass 1).
    image_features: also store the top-k tokens' ViT features (`buffer.image_features`
      [N, k, D], ASER on image features, `replay.aser.asv_features`).
    selection_objectness: OWLv2: the selection loss includes the objectness term (at
      `loss_config['objectness_weight']`; `replay.selection.objectness_in_loss`, docs/owlv2.md).
      False: it does not (and v1 has none). An OWLv2 store also keeps the objectness logits
      (`stored_objectness`) for DER++ whatever this is.
    logits_dtype: storage dtype of the DER++ logits ('float16', 'bfloat16', 'float32').
    mesh: the device mesh (None: all devices).
    num_workers: grain worker processes preprocessing the images (0: in process).
    chunk_images: images per committed chunk (rounded down to whole batches, at least one).
    build_dir: the build folder (default `path + '.build'`), kept until the store is complete.
    build_key: what the build is of (e.g. the cache key); a build folder with another key is
      discarded.
    chunk_hook: test hook, called as (pass name, batches done) after each chunk's arrays are
      written and before it is committed.
  Returns:
    statistics dict: images considered / kept, kept below the threshold, per-class counts, loss
    quantiles.
  Raises:
    ValueError: an empty source, an unknown `prototype_images` or `logits_dtype`, an
      augmentation in `example_options` (before any work), no image selected (threshold and
      minimum both select nothing), or image ids beyond int32.
  """
  num_images = len(source)
  if not num_images:
    raise ValueError(f"the pre-training set {source!r} has no image")
  if prototype_images not in buffer_selection.PROTOTYPE_IMAGES:
    raise ValueError(
      f"replay.selection.prototype_images={prototype_images!r} is unknown; "
      f"known: {list(buffer_selection.PROTOTYPE_IMAGES)}"
    )
  all_images_prototypes = prototype_images == "all"
  augmented = [k for k in _AUGMENTATIONS if (example_options or {}).get(k)]
  if augmented:
    raise ValueError(
      f"the replay buffer's examples are not augmented (their images are re-made from the "
      f"source when replayed), but example_options set {augmented}"
    )
  if logits_dtype not in store_lib.LOGITS_DTYPES:
    raise ValueError(
      f"logits_dtype={logits_dtype!r} is unknown; known: {sorted(store_lib.LOGITS_DTYPES)}"
    )
  num_classes = len(source.class_names)
  mesh = sharding_lib.create_mesh() if mesh is None else mesh
  sharding_lib.check_batch_divisible(batch_size, mesh, "buffer batch size")
  chunk = max(1, chunk_images // batch_size)
  distance_max_instances = (
    spec.max_instances if distance_max_instances is None else distance_max_instances
  )
  transform = BufferExample(source, seed, spec, dict(example_options or {}))
  step_options = dict(
    num_classes=num_classes,
    top_k=top_k,
    max_per_class=max_per_class,
    distance_max_instances=distance_max_instances,
    loss_config=loss_config,
    prototype_sums_of_all=all_images_prototypes,
    image_features=image_features,
    # Only when set: a build folder of before the option existed resumes.
    **({"selection_objectness": True} if selection_objectness else {}),
  )
  steps = make_steps(model, mesh, **step_options)
  params = sharding_lib.replicate(params, mesh)
  writer = distributed.is_writer()
  folder = None
  if writer:
    manifest = dict(
      format=BUILD_FORMAT,
      key=build_key,
      images=num_images,
      classes=num_classes,
      batch_size=batch_size,
      chunk_batches=chunk,
      logits_dtype=logits_dtype,
      # Everything else the passes depend on: a folder left by another build is not resumed.
      options=digest(
        dict(
          step_options,
          selection=[loss_threshold, min_per_class, fill_all_for_rare_classes],
          selection_options=[drop_images_without_class, top_up_order],
          seed=seed,
          example=[spec.image_size, spec.num_queries, spec.max_instances, spec.num_negatives],
          example_options=_fingerprint(example_options or {}),
          tokens=_fingerprint([spec.class_tokens, spec.empty_tokens]),
          pad_logit=pad_logit,
        )
      ),
    )
    folder = _BuildFolder(build_dir or path + ".build", manifest)
  distributed.barrier("buffer-build-open")
  hook = chunk_hook or (lambda name, batches: None)

  # ---------------------------------------------------------------- pass 1: every image
  all_images = np.arange(num_images)
  num_batches = -(-num_images // batch_size)
  first = all_sums = all_counts = 0
  if writer:
    first, all_sums, all_counts = folder.state("losses")
    create = first == 0
    loss = folder.array("per_image_loss", np.float32, (num_images,) if create else None)
    membership = folder.array("membership", bool, (num_images, num_classes) if create else None)
  first = int(_broadcast(np.int32(first)))
  bar = _progress_bar(1, num_images, first * batch_size, writer)
  for b, count, batch in _stream(transform, all_images, batch_size, first, mesh, num_workers):
    out = sharding_lib.fetch_replicated(steps["losses"](params, batch))
    if writer:
      loss.write(b * batch_size, out["per_image_loss"][:count])
      membership.write(b * batch_size, out["membership"][:count])
      if all_images_prototypes:
        all_sums, all_counts = _accumulate(b > 0, all_sums, all_counts, out)
      if _chunk_ends(b, num_batches, chunk):
        hook("losses", b + 1)
        folder.commit("losses", b + 1, (loss, membership), all_sums, all_counts)
    bar.update(count)
  bar.close()

  # ---------------------------------------------------------------- selection (eq. 7)
  if writer:
    loss.close()
    membership.close()
    loss, membership = folder.read("per_image_loss"), folder.read("membership")
    keep = buffer_selection.select_buffer(
      loss,
      membership,
      loss_threshold,
      min_per_class=min_per_class,
      fill_all_for_rare_classes=fill_all_for_rare_classes,
      drop_images_without_class=drop_images_without_class,
      top_up_order=top_up_order,
    )
    if budget is not None:
      count = buffer_selection.budget_count(budget, num_images)
      keep = buffer_selection.apply_budget(keep, loss, membership, count, min_per_class, seed)
    kept = np.flatnonzero(keep)
    del keep
  num_kept = int(_broadcast(np.int32(len(kept) if writer else 0)))
  if not num_kept:
    raise ValueError(
      f"replay.selection selected no image (loss_threshold={loss_threshold}, "
      f"min_per_class={min_per_class})"
    )
  kept = _broadcast(kept if writer else np.zeros(num_kept, np.int64))

  # ---------------------------------------------------------------- pass 2: the kept images
  kept_batches = -(-num_kept // batch_size)
  first, sums, counts = 0, None, None
  store = {}
  if writer:
    first, sums, counts = folder.state("features")
    create = first == 0
    shapes = _store_shapes(transform, steps["features"], params, num_kept, logits_dtype)
    for name, (shape, dtype) in shapes.items():
      store[name] = folder.array(name, dtype, shape if create else None, in_store=True)
    if create:
      store["buffer.class_membership"].write(0, membership[kept])
  first = int(_broadcast(np.int32(first)))
  bar = _progress_bar(2, num_kept, first * batch_size, writer)
  for b, count, batch in _stream(transform, kept, batch_size, first, mesh, num_workers):
    out = sharding_lib.fetch_replicated(steps["features"](params, batch))
    if writer:
      start = b * batch_size
      for k in STORED_EXAMPLE_KEYS:
        store[f"examples.{k}"].write(start, out[k][:count])
      store["examples.source_index"].write(start, kept[start : start + count])
      store["stored_logits"].write(
        start,
        store_lib.encode_logits(out["logits"][:count], out["queries"][:count], logits_dtype),
      )
      if "stored_objectness" in store:
        store["stored_objectness"].write(
          start, store_lib.encode_objectness(out["objectness"][:count], logits_dtype)
        )
      store["buffer.class_embeddings"].write(start, out["top_class_embeddings"][:count])
      store["buffer.query_embeddings"].write(start, out["top_query_embeddings"][:count])
      if image_features:
        store["buffer.image_features"].write(start, out["top_image_features"][:count])
      sums, counts = _accumulate(b > 0, sums, counts, out)
      if _chunk_ends(b, kept_batches, chunk):
        hook("features", b + 1)
        folder.commit("features", b + 1, store.values(), sums, counts)
    bar.update(count)
  bar.close()

  # ---------------------------------------------------------------- pass 3: distances
  prototypes = None
  if writer:
    # 'all' (released code): the prototypes average every pre-training image, not the kept.
    if all_images_prototypes:
      sums, counts = all_sums, all_counts
    valid = counts > 0
    prototypes = np.where(valid[:, None], sums / np.where(valid, counts, 1)[:, None], 0.0)
    prototypes = prototypes.astype(np.float32)
  # The writer's [C, E] prototypes to every process: a broadcast needs the same shape on all
  # of them, and only the writer knows E here, so the shape goes first.
  shape = _broadcast(np.asarray(prototypes.shape if writer else (0, 0), np.int32))
  prototypes = _broadcast(prototypes if writer else np.zeros(tuple(shape), np.float32))
  prototypes_on_mesh = sharding_lib.replicate(jnp.asarray(prototypes), mesh)
  first = int(_broadcast(np.int32(folder.state("distances")[0] if writer else 0)))
  bar = _progress_bar(3, num_kept, first * batch_size, writer)
  for b, count, batch in _stream(transform, kept, batch_size, first, mesh, num_workers):
    out = sharding_lib.fetch_replicated(steps["distances"](params, batch, prototypes_on_mesh))
    if writer:
      distances = store["buffer.prototype_distances"]
      distances.write(b * batch_size, out[:count])
      if _chunk_ends(b, kept_batches, chunk):
        hook("distances", b + 1)
        folder.commit("distances", b + 1, (distances,))
    bar.update(count)
  bar.close()

  # ---------------------------------------------------------------- the store, atomically
  stats = None
  if writer:
    for array in store.values():
      array.close()
    np.save(os.path.join(folder.store, "buffer.prototypes.npy"), prototypes)
    store_lib.write_meta(
      folder.store,
      source.class_names,
      logits_dtype,
      pad_logit,
      {name: store_lib.dtype_name(a.dtype) for name, a in store.items()}
      | {"buffer.prototypes": "float32"},
      dict(transform.image_reference, key=build_key),
    )
    stats = _statistics(loss, membership, kept, loss_threshold, source.class_names)
    with utils.atomic_directory(path, if_exists="replace") as tmp:
      for name in os.listdir(folder.store):
        # Hard links: the build folder stays whole until the store is in place.
        try:
          os.link(os.path.join(folder.store, name), os.path.join(tmp, name))
        except OSError:
          shutil.copy2(os.path.join(folder.store, name), os.path.join(tmp, name))
      # The commit mark, last: the digests of every file of the store (read back once).
      integrity.write_manifest(tmp)
    del loss, membership
    shutil.rmtree(folder.path)
  distributed.barrier("buffer-build-done")
  return stats


_PASS_NAMES = {
  1: "losses of the pre-training images",
  2: "features and logits of the kept images",
  3: "prototype distances of the kept images",
}


def _progress_bar(number: int, total: int, done: int, writer: bool) -> tqdm.tqdm:
  """The progress bar (images, rate, ETA) of pass `number`, starting at `done` images."""
  return tqdm.tqdm(
    total=total,
    initial=min(done, total),
    desc=f"buffer {number}/3: {_PASS_NAMES[number]}",
    unit="img",
    mininterval=2.0,
    disable=not writer,
  )


def _store_shapes(transform, features_step, params, num_kept: int, logits_dtype: str) -> dict:
  """{store array name: (shape [N_kept, ...], dtype)}, from one example and the abstract forward."""
  example = transform(0)
  batch = {k: np.asarray(v)[None] for k, v in example.items()}
  batch["image_id"] = batch["image_id"].astype(np.int32)
  batch["valid"] = np.ones(1, bool)
  abstract = jax.eval_shape(features_step, params, batch)
  shapes = {
    f"examples.{k}": ((num_kept,) + np.shape(example[k]), np.asarray(example[k]).dtype)
    for k in STORED_EXAMPLE_KEYS
  }
  shapes["examples.image_id"] = ((num_kept,), np.dtype(np.int64))
  shapes["examples.source_index"] = ((num_kept,), np.dtype(np.int64))
  shapes["stored_logits"] = (
    (num_kept,) + abstract["logits"].shape[1:],
    store_lib.LOGITS_DTYPES[logits_dtype],
  )
  if "objectness" in abstract:
    shapes["stored_objectness"] = (
      (num_kept,) + abstract["objectness"].shape[1:],
      store_lib.LOGITS_DTYPES[logits_dtype],
    )
  for name in ("class_embeddings", "query_embeddings", "image_features"):
    if f"top_{name}" in abstract:
      shapes[f"buffer.{name}"] = ((num_kept,) + abstract[f"top_{name}"].shape[1:], np.float32)
  num_classes = abstract["prototype_counts"].shape[0]
  shapes["buffer.class_membership"] = ((num_kept, num_classes), np.dtype(bool))
  shapes["buffer.prototype_distances"] = ((num_kept, num_classes), np.float32)
  return shapes


def _statistics(loss, membership, kept, loss_threshold, class_names) -> dict:
  """The build's statistics (images considered / kept, per-class counts, loss quantiles)."""
  kept_membership = membership[kept]
  loss = np.asarray(loss)
  return {
    "images_considered": int(len(loss)),
    "images_kept": int(len(kept)),
    "kept_below_threshold": int((loss < loss_threshold).sum()),
    "images_per_class": {
      name: int(kept_membership[:, c].sum()) for c, name in enumerate(class_names)
    },
    "loss_quantiles": {
      q: float(np.quantile(loss, float(q))) for q in ("0.1", "0.25", "0.5", "0.75", "0.9")
    },
  }


def cached_store(
  cache_root: str,
  key_material: dict,
  build_fn,
  superseded: tuple[tuple[dict, str], ...] = (),
  *,
  source=None,
  image_cache: str | None = None,
  verification: str = "full",
) -> tuple[store_lib.ReplayStore, dict]:
  """Loads the store cached under a digest of `key_material`, or builds and caches it.

  `build_fn(path, build_dir, build_key)` writes the store to `path` atomically (`build_store`),
  keeping its progress in `build_dir` (next to the cache entry) so that an interrupted build
  resumes there; a store is trusted only once its statistics file is written after it, and
  every time it is loaded its files are checked against the manifest written with it (a
  damaged store is set aside and rebuilt with a warning, `_load_cached`). Runs sharing the
  cache take the entry's lock (`<key>.lock`): one builds, the others wait and reuse its store.

  Args:
    cache_root: folder of the cached stores (one sub-folder per key digest).
    key_material: JSON-able dict of everything the store depends on.
    build_fn: `(path, build_dir, build_key) -> stats dict`, run on every process (the forward
      is collective; process 0 writes).
    superseded: (key material, reason) of stores that earlier code versions cached for the
      same run; when one of them is on disk and the current one is not, the rebuild is
      logged with its reason (e.g. class embeddings that were stored unnormalised).
    source: the pre-training source the store's images are decoded from at gather time
      (`store_lib.ReplayStore.load`); None: gather refuses a store of images by reference.
    image_cache: root of the optional uint8 image cache on local disk (`replay.image_cache`).
    verification: 'full' (every file hashed before the store is used) or 'lazy' (sizes and
      the small files first, each chunk of the per-image arrays when first gathered;
      `replay.store_verification`).
  Returns:
    (store memory-mapped from the cache, stats dict with "seconds").
  Raises:
    ValueError: an unknown `verification`.
  """
  if verification not in STORE_VERIFICATIONS:
    raise ValueError(f"verification={verification!r} is not one of {STORE_VERIFICATIONS}")
  key = digest(key_material)
  path = os.path.join(cache_root, key)

  def load(path):
    return store_lib.ReplayStore.load(path, source=source, image_cache=image_cache)

  stats_path = path + ".stats.json"
  # One run builds while the others sharing the cache wait for its store (the lock); whoever
  # gets the lock looks again, since the store may have been cached meanwhile.
  with distributed.cache_entry_lock(path, "replay buffer"):
    found = _load_cached(path, stats_path, load, verification) if distributed.is_writer() else None
    if distributed.writer_value(found is not None):
      if found is None:  # verified by the writer
        with open(stats_path) as f:
          found = load(path), json.load(f)
        if verification == "lazy":
          _attach_lazy_verifier(found[0], path, stats_path)
      logging.info("re-using the cached replay buffer %s", path)
      return found
    for old_material, reason in superseded:
      old_path = os.path.join(cache_root, digest(old_material))
      if os.path.isdir(old_path):
        logging.warning(
          "the replay buffer cached in %s is out of date (%s); rebuilding it in %s",
          old_path,
          reason,
          path,
        )
    start = time.time()
    stats = build_fn(path, path + ".build", key)
    if distributed.is_writer():
      stats["seconds"] = round(time.time() - start, 1)
      atomic_write_json(stats_path, stats, indent=2)
    distributed.barrier("buffer-cached", timeout_s=600.0)
  with open(stats_path) as f:
    stats = json.load(f)
  logging.info(
    "replay buffer: %d of %d images (%.1f s), cached in %s",
    stats["images_kept"],
    stats["images_considered"],
    stats["seconds"],
    path,
  )
  return load(path), stats


def _set_aside_entry(path: str, stats_path: str, error: Exception) -> None:
  """Sets the damaged store `path` and its statistics aside (renamed, a warning each)."""
  if os.path.exists(path):
    integrity.set_aside(path, str(error))
  if os.path.exists(stats_path):
    integrity.set_aside(stats_path, "its replay store was set aside")


def _attach_lazy_verifier(store, path: str, stats_path: str, verifier=None) -> None:
  """Makes `store.gather` check each chunk of its per-image arrays when first read
  (`verifier`: the folder's `_lazy_verifier`, made here when None)."""
  store.verifier = _lazy_verifier(path) if verifier is None else verifier
  store.on_damage = lambda error: _set_aside_entry(path, stats_path, error)


def _lazy_verifier(path: str) -> integrity.LazyVerifier:
  """The `integrity.LazyVerifier` of the store at `path`, with what is read at once checked:
  every size, the small files whole (meta.json, the buffer's arrays, which `replay_buffer`
  reads whole) and the first chunk (the header) of each per-image file.

  Raises:
    IntegrityError: a cut or missing file, a checked part that differs.
  """
  verifier = integrity.LazyVerifier(path)
  for rel in verifier.manifest["files"]:
    verifier.check(rel, 0, 1 if store_lib.is_row_file(rel) else None)
  return verifier


def _load_cached(
  path: str, stats_path: str, load, verification: str = "full"
) -> tuple[store_lib.ReplayStore, dict] | None:
  """The cached store at `path` and its statistics once they pass their integrity check.

  None when there is no complete entry (the store and its statistics file, written after
  it), or when it was damaged: a file of the store differs from its manifest (streamed
  SHA-256 of every file, `integrity.verify_directory`; with `verification` 'lazy' the sizes
  and the small files only, the per-image rows being checked as `gather` reads them), a file
  or the manifest is missing, the statistics are unreadable. A damaged entry is set aside
  (the folder and its statistics renamed `.corrupt-<time>`, never deleted; a warning names
  the file) for the caller to rebuild. A store cached before manifests were written
  (meta.json without `store_lib.CHECKSUMS_FIELD`) is loaded unverified with a warning; one
  that then fails to load is set aside the same way.

  Raises:
    OSError: the entry cannot be renamed aside (e.g. a read-only cache).
  """
  if not (os.path.isdir(path) and os.path.exists(stats_path)):
    return None
  try:
    verified = integrity.has_manifest(path)
    verifier = None
    if verified and verification == "full":
      integrity.verify_directory(path)
    elif verified:
      verifier = _lazy_verifier(path)  # the per-image rows when gathered
    else:
      _check_unverified_store(path)
    try:
      with open(stats_path) as f:
        stats = json.load(f)
      if not isinstance(stats, dict) or "images_kept" not in stats:
        raise ValueError("no 'images_kept'")
    except ValueError as e:
      raise integrity.IntegrityError(stats_path, f"unreadable statistics ({e})") from None
    try:
      store = load(path)
    except Exception as e:  # pylint: disable=broad-except
      if verified:
        raise  # intact files that do not load: not damage, a real error
      # NumPy raises a variety of errors for a damaged .npy of an unverified store.
      raise integrity.IntegrityError(path, f"does not load ({type(e).__name__}: {e})") from e
    if verifier is not None:
      _attach_lazy_verifier(store, path, stats_path, verifier)
  except integrity.IntegrityError as e:
    _set_aside_entry(path, stats_path, e)
    logging.warning("the cached replay buffer was damaged (%s); building it again", e)
    return None
  return store, stats


def _check_unverified_store(path: str) -> None:
  """A store folder without a manifest: one of an earlier version (logged), or a damaged one.

  Raises:
    IntegrityError: meta.json is missing or unreadable, or says a manifest was written.
  """
  meta_path = os.path.join(path, "meta.json")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise integrity.IntegrityError(meta_path, "missing") from None
  except (OSError, ValueError) as e:
    raise integrity.IntegrityError(meta_path, f"unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get(store_lib.CHECKSUMS_FIELD):
    raise integrity.IntegrityError(
      os.path.join(path, integrity.MANIFEST_NAME), "missing (meta.json says it was written)"
    )
  logging.warning(
    "the cached replay buffer %s predates checksums: loaded unverified (delete it to build "
    "it again with checksums)",
    path,
  )

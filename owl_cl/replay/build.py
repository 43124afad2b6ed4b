"""Building the replay buffer from the pre-training set with the pre-trained model
(docs/reference.md §6), streaming and resumable.

The pre-training set flows through the input pipeline (grain, optional worker processes) in
batches over the devices of the mesh (each process reads its rows of every batch), in three
passes of the jitted eval-mode forward of the pre-trained model (`replay/build_steps.py`),
what the buffer is made of given by one frozen `BufferSpec`:

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

The cache of built stores (one per key, checked when loaded) is `replay/store_cache.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import hashlib
import os
import shutil
from typing import Any

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
from owl_cl.replay import build_steps
from owl_cl.replay import store as store_lib
from owl_cl.train import sharding as sharding_lib
from owl_cl.utils import digest

# The arrays of an example the forward reads (defined once, by the store); the store keeps
# `build_steps.STORED_EXAMPLE_KEYS` of them.
EXAMPLE_KEYS = store_lib.REQUIRED_EXAMPLE_KEYS
# Version of the build folder's layout; a folder of another version is started afresh.
# 2: images by reference (1 wrote the pixels).
BUILD_FORMAT = 2
# Example options that would make a buffer example's image more than the resized source image
# (augmentations): refused, since images by reference are re-made without them.
_AUGMENTATIONS = ("hflip", "random_crop", "mosaic_sizes")
PASSES = ("losses", "features", "distances")
_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True, eq=False)
class BufferSpec:
  """What a replay buffer is made of: its examples, its selection (paper eq. 7), its retrieval
  features and its stored logits (docs/reference.md §6). One frozen value, checked when made,
  that `build_store` takes instead of seventeen keywords (`replay.setup.build_options` makes it
  from the run's config). How the build runs (batch size, mesh, workers, chunks) is not part
  of it.

  Attributes:
    example: the fixed training example of each image (`data.spec.ExampleSpec`,
      `BufferExample`).
    seed: seeds each image's queries and negatives (`input_pipeline.example_rng(seed, 0, i)`)
      and the budget's draw.
    loss_threshold: eq. 7's t: images whose detection loss (loss units) is below it are kept.
    min_per_class: each class with fewer kept images gets its images in ascending loss order
      (`buffer_selection.select_buffer`).
    fill_all_for_rare_classes: `buffer_selection.select_buffer`'s option of that name.
    drop_images_without_class: `buffer_selection.select_buffer`'s option of that name.
    top_up_order: `buffer_selection.select_buffer`'s option of that name
      (`buffer_selection.TOP_UP_ORDERS`).
    top_k: k, the tokens per image whose class and query embeddings are stored (the retrieval
      features, `train.top_k.top_k_embeddings`).
    max_per_class: n_c's cap: prototypes are the mean of the selected images' top-n_c class
      embeddings, n_c = min(max_per_class, #instances).
    loss_config: `losses.detection_loss` options (pass 1's per-image loss).
    example_options: the run's squash, merge_iou, negative_weights
      (`input_pipeline.preprocess_train_example`); copied. No augmentation: the store re-makes
      the images from the source.
    distance_max_instances: an image's prototype distance takes the min over its
      min(distance_max_instances, #instances) best class-c embeddings (None: M, the example's
      `max_instances`).
    budget: `replay.budget`: None keeps eq. 7's selection; a fraction of the source or an
      image count brings it to exactly that size (`buffer_selection.budget_count`,
      `apply_budget`, seeded by `seed`).
    prototype_images: the prototypes average the kept images ('buffer', the paper) or every
      image of the source ('all', the released code; their sums are reduced in pass 1).
    image_features: also store the top-k tokens' ViT features (`buffer.image_features`
      [N, k, D], ASER on image features, `replay.aser.asv_features`).
    selection_objectness: OWLv2: the selection loss includes the objectness term (at
      `loss_config['objectness_weight']`; `replay.selection.objectness_in_loss`, docs/owlv2.md).
      False: it does not (and v1 has none). An OWLv2 store also keeps the objectness logits
      (`stored_objectness`) for DER++ whatever this is.
    logits_dtype: storage dtype of the DER++ logits ('float16', 'bfloat16', 'float32').
    pad_logit: the model's padded-query logit (-1e6, scenic), restored at gather time.

  Raises:
    ValueError: an unknown `prototype_images` or `logits_dtype`, or an augmentation in
      `example_options` (the message names the field and its value).
  """

  example: ExampleSpec
  seed: int
  loss_threshold: float
  min_per_class: int
  fill_all_for_rare_classes: bool
  top_k: int
  max_per_class: int
  loss_config: Mapping[str, Any]
  example_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  distance_max_instances: int | None = None
  drop_images_without_class: bool = False
  top_up_order: str = "class_index"
  budget: int | float | None = None
  prototype_images: str = "buffer"
  image_features: bool = False
  selection_objectness: bool = False
  logits_dtype: str = "float16"
  pad_logit: float = -1e6

  def __post_init__(self):
    if self.prototype_images not in buffer_selection.PROTOTYPE_IMAGES:
      raise ValueError(
        f"replay.selection.prototype_images={self.prototype_images!r} is unknown; "
        f"known: {list(buffer_selection.PROTOTYPE_IMAGES)}"
      )
    # Frozen: the copy is set through object.__setattr__ (dataclasses' own way).
    object.__setattr__(self, "example_options", dict(self.example_options or {}))
    augmented = [k for k in _AUGMENTATIONS if self.example_options.get(k)]
    if augmented:
      raise ValueError(
        f"the replay buffer's examples are not augmented (their images are re-made from the "
        f"source when replayed), but example_options set {augmented}"
      )
    if self.logits_dtype not in store_lib.LOGITS_DTYPES:
      raise ValueError(
        f"logits_dtype={self.logits_dtype!r} is unknown; known: {sorted(store_lib.LOGITS_DTYPES)}"
      )

  @property
  def all_images_prototypes(self) -> bool:
    """Whether the prototypes average every image of the source (`prototype_images='all'`)."""
    return self.prototype_images == "all"


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
    example = self.source.load(index)
    # Never augmented (checked by BufferSpec): the image's network input is the one the
    # source kept for pre-training, when it keeps them.
    network_image = input_pipeline.kept_network_image(
      self.source, index, example, self.spec.image_size, self.options
    )
    example = input_pipeline.preprocess_train_example(
      example,
      self.spec,
      rng=input_pipeline.example_rng(self.seed, 0, index),
      network_image=network_image,
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


@dataclasses.dataclass
class _Build:
  """What every pass of one build reads: the examples, the jitted steps, the replicated
  parameters, how the batches are made and the writer's build folder (None on the others)."""

  transform: BufferExample
  steps: dict[str, Callable]
  params: Any
  mesh: Any
  batch_size: int
  chunk: int  # batches per committed chunk
  num_workers: int
  folder: _BuildFolder | None
  hook: Callable[[str, int], None]

  @property
  def writer(self) -> bool:
    """Whether this process writes (process 0: it alone has the build folder)."""
    return self.folder is not None

  def stream(self, image_indices: np.ndarray, first: int):
    """`_stream` of `image_indices` from batch `first` (its (b, count, batch) triples)."""
    return _stream(
      self.transform, image_indices, self.batch_size, first, self.mesh, self.num_workers
    )

  def first_batch(self, first: int) -> int:
    """The writer's resume point `first` (batches committed) on every process."""
    return int(_broadcast(np.int32(first)))


def build_store(
  model,
  params,
  source,
  path: str,
  *,
  buffer_spec: BufferSpec,
  batch_size: int,
  mesh=None,
  num_workers: int = 0,
  chunk_images: int = 4096,
  build_dir: str | None = None,
  build_key: str = "",
  chunk_hook: Callable[[str, int], None] | None = None,
) -> dict:
  """Selects the buffer from `source` (the pre-training set) and writes its `ReplayStore` to `path`.

  Selection is eq. 7 of the paper (docs/reference.md §6): loss < t, then each class with fewer
  than `min_per_class` kept images gets its images in ascending loss order
  (`buffer_selection.select_buffer`), optionally brought to a budget. Prototypes are the mean
  of the selected images' top-n_c class embeddings; an image's prototype distance takes the min
  over its best class-c embeddings (`BufferSpec`). The passes (module docstring): pass 1
  (`_losses_pass`), the selection (`_select`), pass 2 (`_features_pass`), the prototypes
  (`_prototypes`), pass 3 (`_distances_pass`), the store moved into place (`_write_store`).

  Args:
    model: the pre-trained OWL-ViT (flax module).
    params: its parameters.
    source: the pre-training set (`len`, `load(i)`, `class_names`).
    path: the store folder to write (replaced atomically if it exists).
    buffer_spec: what the buffer is made of (`BufferSpec`).
    batch_size: images per forward (global, a multiple of the mesh's devices).
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
    ValueError: an empty source, a batch size the mesh does not divide (before any work), no
      image selected (threshold and minimum both select nothing), or image ids beyond int32.
      (A bad `BufferSpec` is refused when it is made.)
  """
  spec = buffer_spec
  num_images = len(source)
  if not num_images:
    raise ValueError(f"the pre-training set {source!r} has no image")
  num_classes = len(source.class_names)
  mesh = sharding_lib.create_mesh() if mesh is None else mesh
  sharding_lib.check_batch_divisible(batch_size, mesh, "buffer batch size")
  chunk = max(1, chunk_images // batch_size)
  step_options = _step_options(spec, num_classes)
  folder = None
  if distributed.is_writer():
    manifest = _build_manifest(spec, step_options, build_key, num_images, batch_size, chunk)
    folder = _BuildFolder(build_dir or path + ".build", manifest)
  distributed.barrier("buffer-build-open")
  run = _Build(
    transform=BufferExample(source, spec.seed, spec.example, spec.example_options),
    steps=build_steps.make_steps(model, mesh, **step_options),
    params=sharding_lib.replicate(params, mesh),
    mesh=mesh,
    batch_size=batch_size,
    chunk=chunk,
    num_workers=num_workers,
    folder=folder,
    hook=chunk_hook or (lambda name, batches: None),
  )
  loss, membership, all_sums, all_counts = _losses_pass(run, num_images, num_classes, spec)
  kept = _select(run, spec, loss, membership, num_images)
  store, sums, counts = _features_pass(run, spec, kept, membership)
  # 'all' (released code): the prototypes average every pre-training image, not the kept.
  if spec.all_images_prototypes:
    sums, counts = all_sums, all_counts
  prototypes = _prototypes(run, sums, counts)
  _distances_pass(run, kept, prototypes, store)
  stats = None
  if run.writer:
    stats = _statistics(loss, membership, kept, spec.loss_threshold, source.class_names)
    del loss, membership
    _write_store(run, path, spec, store, prototypes, source.class_names, build_key)
  distributed.barrier("buffer-build-done")
  return stats


def _step_options(spec: BufferSpec, num_classes: int) -> dict:
  """`build_steps.make_steps`' options of `spec` for C = `num_classes` (also digested into
  the build folder's manifest)."""
  return dict(
    num_classes=num_classes,
    top_k=spec.top_k,
    max_per_class=spec.max_per_class,
    distance_max_instances=(
      spec.example.max_instances
      if spec.distance_max_instances is None
      else spec.distance_max_instances
    ),
    loss_config=dict(spec.loss_config),
    prototype_sums_of_all=spec.all_images_prototypes,
    image_features=spec.image_features,
    # Only when set: a build folder of before the option existed resumes.
    **({"selection_objectness": True} if spec.selection_objectness else {}),
  )


def _build_manifest(
  spec: BufferSpec,
  step_options: dict,
  build_key: str,
  num_images: int,
  batch_size: int,
  chunk: int,
) -> dict:
  """The build folder's manifest: what the build is of (a folder of another one is restarted)."""
  example = spec.example
  return dict(
    format=BUILD_FORMAT,
    key=build_key,
    images=num_images,
    classes=step_options["num_classes"],
    batch_size=batch_size,
    chunk_batches=chunk,
    logits_dtype=spec.logits_dtype,
    # Everything else the passes depend on: a folder left by another build is not resumed.
    options=digest(
      dict(
        step_options,
        selection=[spec.loss_threshold, spec.min_per_class, spec.fill_all_for_rare_classes],
        selection_options=[spec.drop_images_without_class, spec.top_up_order],
        seed=spec.seed,
        example=[
          example.image_size,
          example.num_queries,
          example.max_instances,
          example.num_negatives,
        ],
        example_options=_fingerprint(spec.example_options),
        tokens=_fingerprint([example.class_tokens, example.empty_tokens]),
        pad_logit=spec.pad_logit,
      )
    ),
  )


def _losses_pass(run: _Build, num_images: int, num_classes: int, spec: BufferSpec):
  """Pass 1 over every image: the per-image detection loss and class membership, and with
  `prototype_images='all'` the prototype sums of every image.

  Returns:
    The writer's (loss float32 [N], membership bool [N, C], both memory-mapped read-only, sums
    float64 [C, E], counts int64 [C] (0 unless 'all')); (None, None, 0, 0) on the others.
  """
  all_images = np.arange(num_images)
  num_batches = -(-num_images // run.batch_size)
  first = all_sums = all_counts = 0
  loss = membership = None
  if run.writer:
    first, all_sums, all_counts = run.folder.state("losses")
    create = first == 0
    loss = run.folder.array("per_image_loss", np.float32, (num_images,) if create else None)
    membership = run.folder.array("membership", bool, (num_images, num_classes) if create else None)
  first = run.first_batch(first)
  bar = _progress_bar(1, num_images, first * run.batch_size, run.writer)
  for b, count, batch in run.stream(all_images, first):
    out = sharding_lib.fetch_replicated(run.steps["losses"](run.params, batch))
    if run.writer:
      loss.write(b * run.batch_size, out["per_image_loss"][:count])
      membership.write(b * run.batch_size, out["membership"][:count])
      if spec.all_images_prototypes:
        all_sums, all_counts = _accumulate(b > 0, all_sums, all_counts, out)
      if _chunk_ends(b, num_batches, run.chunk):
        run.hook("losses", b + 1)
        run.folder.commit("losses", b + 1, (loss, membership), all_sums, all_counts)
    bar.update(count)
  bar.close()
  if not run.writer:
    return None, None, all_sums, all_counts
  loss.close()
  membership.close()
  return run.folder.read("per_image_loss"), run.folder.read("membership"), all_sums, all_counts


def _select(run: _Build, spec: BufferSpec, loss, membership, num_images: int) -> np.ndarray:
  """The selection (eq. 7, then the budget) from pass 1's arrays, made by the writer.

  Returns:
    The kept image indices int64 [N_kept], ascending, on every process.
  Raises:
    ValueError: no image selected.
  """
  kept = None
  if run.writer:
    keep = buffer_selection.select_buffer(
      loss,
      membership,
      spec.loss_threshold,
      min_per_class=spec.min_per_class,
      fill_all_for_rare_classes=spec.fill_all_for_rare_classes,
      drop_images_without_class=spec.drop_images_without_class,
      top_up_order=spec.top_up_order,
    )
    if spec.budget is not None:
      count = buffer_selection.budget_count(spec.budget, num_images)
      keep = buffer_selection.apply_budget(
        keep, loss, membership, count, spec.min_per_class, spec.seed
      )
    kept = np.flatnonzero(keep)
    del keep
  num_kept = int(_broadcast(np.int32(len(kept) if run.writer else 0)))
  if not num_kept:
    raise ValueError(
      f"replay.selection selected no image (loss_threshold={spec.loss_threshold}, "
      f"min_per_class={spec.min_per_class})"
    )
  return _broadcast(kept if run.writer else np.zeros(num_kept, np.int64))


def _features_pass(run: _Build, spec: BufferSpec, kept: np.ndarray, membership):
  """Pass 2 over the kept images: their examples (without pixels), source indices, DER++
  logits, top-k class / query (and image) features written to the store's arrays; their class
  membership written first; the prototype sums and counts accumulated.

  Returns:
    The writer's (store {array name: `store_lib.ArrayFile`}, sums float64 [C, E], counts int64
    [C]); ({}, None, None) on the others.
  """
  num_kept = len(kept)
  batch_size = run.batch_size
  kept_batches = -(-num_kept // batch_size)
  first, sums, counts = 0, None, None
  store = {}
  if run.writer:
    first, sums, counts = run.folder.state("features")
    create = first == 0
    shapes = _store_shapes(
      run.transform, run.steps["features"], run.params, num_kept, spec.logits_dtype
    )
    for name, (shape, dtype) in shapes.items():
      store[name] = run.folder.array(name, dtype, shape if create else None, in_store=True)
    if create:
      store["buffer.class_membership"].write(0, membership[kept])
  first = run.first_batch(first)
  bar = _progress_bar(2, num_kept, first * batch_size, run.writer)
  for b, count, batch in run.stream(kept, first):
    out = sharding_lib.fetch_replicated(run.steps["features"](run.params, batch))
    if run.writer:
      start = b * batch_size
      for k in build_steps.STORED_EXAMPLE_KEYS:
        store[f"examples.{k}"].write(start, out[k][:count])
      store["examples.source_index"].write(start, kept[start : start + count])
      store["stored_logits"].write(
        start,
        store_lib.encode_logits(out["logits"][:count], out["queries"][:count], spec.logits_dtype),
      )
      if "stored_objectness" in store:
        store["stored_objectness"].write(
          start, store_lib.encode_objectness(out["objectness"][:count], spec.logits_dtype)
        )
      store["buffer.class_embeddings"].write(start, out["top_class_embeddings"][:count])
      store["buffer.query_embeddings"].write(start, out["top_query_embeddings"][:count])
      if spec.image_features:
        store["buffer.image_features"].write(start, out["top_image_features"][:count])
      sums, counts = _accumulate(b > 0, sums, counts, out)
      if _chunk_ends(b, kept_batches, run.chunk):
        run.hook("features", b + 1)
        run.folder.commit("features", b + 1, store.values(), sums, counts)
    bar.update(count)
  bar.close()
  return store, sums, counts


def _prototypes(run: _Build, sums, counts) -> np.ndarray:
  """The class prototypes float32 [C, E] (mean class embedding, zero for a class without any)
  from the writer's sums float64 [C, E] and counts int64 [C], on every process."""
  prototypes = None
  if run.writer:
    valid = counts > 0
    prototypes = np.where(valid[:, None], sums / np.where(valid, counts, 1)[:, None], 0.0)
    prototypes = prototypes.astype(np.float32)
  # The writer's [C, E] prototypes to every process: a broadcast needs the same shape on all
  # of them, and only the writer knows E here, so the shape goes first.
  shape = _broadcast(np.asarray(prototypes.shape if run.writer else (0, 0), np.int32))
  return _broadcast(prototypes if run.writer else np.zeros(tuple(shape), np.float32))


def _distances_pass(run: _Build, kept: np.ndarray, prototypes: np.ndarray, store: dict) -> None:
  """Pass 3 over the kept images: their prototype distances float32 [N_kept, C] to the
  complete `prototypes`, written to the writer's `store`."""
  prototypes_on_mesh = sharding_lib.replicate(jnp.asarray(prototypes), run.mesh)
  first = run.first_batch(run.folder.state("distances")[0] if run.writer else 0)
  kept_batches = -(-len(kept) // run.batch_size)
  bar = _progress_bar(3, len(kept), first * run.batch_size, run.writer)
  for b, count, batch in run.stream(kept, first):
    out = sharding_lib.fetch_replicated(
      run.steps["distances"](run.params, batch, prototypes_on_mesh)
    )
    if run.writer:
      distances = store["buffer.prototype_distances"]
      distances.write(b * run.batch_size, out[:count])
      if _chunk_ends(b, kept_batches, run.chunk):
        run.hook("distances", b + 1)
        run.folder.commit("distances", b + 1, (distances,))
    bar.update(count)
  bar.close()


def _write_store(
  run: _Build,
  path: str,
  spec: BufferSpec,
  store: dict,
  prototypes: np.ndarray,
  class_names,
  build_key: str,
) -> None:
  """The writer's last step: the store's prototypes and meta.json, the store moved to `path`
  atomically with its manifest (the commit mark), the build folder removed."""
  folder = run.folder
  for array in store.values():
    array.close()
  np.save(os.path.join(folder.store, "buffer.prototypes.npy"), prototypes)
  store_lib.write_meta(
    folder.store,
    class_names,
    spec.logits_dtype,
    spec.pad_logit,
    {name: store_lib.dtype_name(a.dtype) for name, a in store.items()}
    | {"buffer.prototypes": "float32"},
    dict(run.transform.image_reference, key=build_key),
  )
  with utils.atomic_directory(path, if_exists="replace") as tmp:
    for name in os.listdir(folder.store):
      # Hard links: the build folder stays whole until the store is in place.
      try:
        os.link(os.path.join(folder.store, name), os.path.join(tmp, name))
      except OSError:
        shutil.copy2(os.path.join(folder.store, name), os.path.join(tmp, name))
    # The commit mark, last: the digests of every file of the store (read back once).
    integrity.write_manifest(tmp)
  shutil.rmtree(folder.path)


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
    for k in build_steps.STORED_EXAMPLE_KEYS
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

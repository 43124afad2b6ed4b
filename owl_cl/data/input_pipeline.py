"""Input pipeline: one example's preprocessing (image ops + label ops) and the grain datasets.

Produces the batch dict of docs/CONVENTIONS.md ("Batch dict"):

- `images`       float32 [B, S, S, 3] in [0, 1] (pad 0.5 in training, 0.0 at evaluation)
- `queries`      int32   [B, Q, L]   (training only) query 0 is always '' (the padding query)
- `labels`       float32 [B, M, Q]   (training only) multi-hot, column 0 = padding instance
- `boxes`        float32 [B, M, 4]   (training only) cxcywh / S
- `query_class`  int32   [B, Q]      (training only) contiguous class index, -1 for ''
- `image_id`     int64   [B]         COCO image id, -1 for padding examples
- `orig_size`    int32   [B, 2]      (height, width) of the original image (training: of the
                                     image after crop / mosaic, i.e. what was resized)
- `example_mask` bool    [B]         False for padding examples (last evaluation batch)

Sources: docs/reference.md §3 (targets/queries), §5 (preprocessing); scenic owl_vit
`input_pipeline.py`. The image ops (resize-with-pad, flip, crop, mosaic) are in
`owl_cl.data.image_ops`, the label ops (duplicate merging, queries, targets) in
`owl_cl.data.label_ops`.

Training options (all off by default, so the defaults reproduce the built-in benchmark runs):

- negatives: `negative_weights` [C] (e.g. `label_ops.class_frequencies(source)`: frequency-weighted
  random negatives, docs/reference.md §3 / released code), `annotated_negatives` (LVIS
  `neg_category_ids`
  first; on by default but only federated sources carry them);
- `merge_iou` (0.9 by default): boxes with IoU >= 0.9 become one multi-label instance;
- scenic augmentations (docs/reference.md §5): `hflip`, `random_crop` (area 0.3-1.0, aspect
0.75-1.33,
  boxes keeping < 60% of their area dropped), `mosaic_sizes` / `mosaic_probs` ((1, 2, 3) with
  (.4, .3, .3) as `image_ops.MOSAIC_SIZES` / `MOSAIC_PROBS`);
- `squash=True`: the released code's HF resize to S x S without padding;
- `num_workers` > 0: decoding/preprocessing in grain worker processes (same batches as 0);
- `shard`: host sharding ('jax' = `grain.sharding.ShardByJaxProcess`, or (index, count)).

Randomness: every random choice is drawn from an explicit `numpy.random.Generator`; the
datasets derive one per example from `(seed, epoch, source index)` (`example_rng`), so results
do not depend on worker count, thread scheduling or iteration order, and different images /
epochs get different negatives (docs/reference.md §12: the released code reseeded the per-image
negative RNG
so all images shared the same negatives; not reproduced).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from owl_cl.data.image_ops import CROP_AREA_RANGE
from owl_cl.data.image_ops import CROP_ASPECT_RATIO_RANGE
from owl_cl.data.image_ops import EVAL_PAD_VALUE
from owl_cl.data.image_ops import MOSAIC_PROBS
from owl_cl.data.image_ops import TRAIN_PAD_VALUE
from owl_cl.data.image_ops import augment_example
from owl_cl.data.image_ops import build_mosaic
from owl_cl.data.image_ops import preprocess_image
from owl_cl.data.image_ops import sample_mosaic_size
from owl_cl.data.image_ops import scale_boxes
from owl_cl.data.image_ops import xyxy_to_cxcywh
from owl_cl.data.label_ops import instance_targets
from owl_cl.data.label_ops import merge_duplicate_instances
from owl_cl.data.label_ops import query_tokens
from owl_cl.data.label_ops import sample_queries
from owl_cl.data.spec import ExampleSpec

__all__ = [
  "shard_options",
  "batch_row_positions",
  "example_rng",
  "preprocess_train_example",
  "preprocess_eval_example",
  "padding_eval_example",
  "stack_examples",
  "epoch_permutation",
  "train_map_dataset",
  "train_dataset",
  "apply_shard",
  "iterate_batches",
  "eval_map_dataset",
  "eval_dataset",
]


# ------------------------------------------------------------------------------------------
# Host sharding and the per-example generator.
# ------------------------------------------------------------------------------------------
def shard_options(shard: Any = None):
  """Resolve a host-sharding request to `grain.sharding.ShardOptions` (or None).

  Args:
    shard: None (no sharding), 'jax' (this JAX process of all: `ShardByJaxProcess`, i.e.
      jax.process_index() / jax.process_count(), remainder dropped), a
      `grain.sharding.ShardOptions`, or a (shard_index, shard_count) pair.
  """
  if shard is None:
    return None
  if isinstance(shard, str):
    if shard != "jax":
      raise ValueError(f"shard must be None, 'jax', ShardOptions or (index, count), got {shard!r}")
    return grain.sharding.ShardByJaxProcess(drop_remainder=True)
  if isinstance(shard, grain.sharding.ShardOptions):
    return shard
  index, count = shard
  return grain.sharding.ShardOptions(
    shard_index=int(index), shard_count=int(count), drop_remainder=True
  )


def apply_shard(ds: grain.MapDataset, shard: Any) -> grain.MapDataset:
  """The elements of `ds` this host keeps under `shard` (`shard_options`; remainder dropped).

  Raises:
    ValueError: a shard index outside [0, count).
  """
  opts = shard_options(shard)
  if opts is None or opts.shard_count == 1:
    return ds
  if not 0 <= opts.shard_index < opts.shard_count:
    raise ValueError(f"shard_index {opts.shard_index} outside [0, {opts.shard_count})")
  n = len(ds)
  end = (n // opts.shard_count) * opts.shard_count if opts.drop_remainder else n
  return ds[opts.shard_index : end : opts.shard_count]


def batch_row_positions(num_examples: int, batch_size: int, rows: tuple[int, int]) -> np.ndarray:
  """Positions of rows [start, stop) of every full global batch of `batch_size` examples.

  The per-process view of a data-parallel batch: batch b of the global iterator holds
  positions b*B .. b*B + B - 1; a process whose devices hold rows [start, stop) of each batch
  (`owl_cl.train.sharding.process_rows`) reads only positions b*B + start .. b*B + stop - 1,
  so the processes together read every global batch exactly as one process would.

  Args:
    num_examples: N positions (the remainder N mod B is dropped).
    batch_size: B, the global batch size.
    rows: (start, stop) with 0 <= start < stop <= B.
  Returns:
    int64 [floor(N / B) * (stop - start)], increasing.
  Raises:
    ValueError: rows outside [0, B] or empty (named with its value).
  Source: the batch layout of `_to_batches`.
  """
  start, stop = (int(r) for r in rows)
  if not 0 <= start < stop <= batch_size:
    raise ValueError(f"batch_rows must satisfy 0 <= start < stop <= {batch_size}, got {rows!r}")
  first = np.arange(num_examples // batch_size, dtype=np.int64)[:, None] * batch_size
  return (first + np.arange(start, stop, dtype=np.int64)[None, :]).reshape(-1)


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """The per-example generator, a pure function of (seed, epoch, index) (all ints >= 0)."""
  return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(index)]))


def preprocess_train_example(
  example: dict[str, Any],
  spec: ExampleSpec,
  *,
  rng: np.random.Generator,
  pad_value: float = TRAIN_PAD_VALUE,
  squash: bool = False,
  resize: str = "resize_with_pad",
  merge_iou: float | None = 0.9,
  hflip: bool = False,
  negative_weights: np.ndarray | None = None,
  random_crop: bool = False,
  crop_area_range: tuple[float, float] = CROP_AREA_RANGE,
  crop_aspect_ratio_range: tuple[float, float] = CROP_ASPECT_RATIO_RANGE,
  crop_min_area_fraction: float = 0.6,
  annotated_negatives: bool = True,
  network_image: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """One training example: image resized/padded, queries sampled, targets built.

  Args:
    example: dict(image uint8 [H, W, 3], boxes float [M0, 4] xyxy pixels, labels int [M0]
      contiguous class indices, image_id int), e.g. `CocoSource.load(i)`.
    spec: the class tokens (C classes, one drawn prompt variant per query), S, Q, M and the
      negatives per image (`ExampleSpec`).
    rng: numpy Generator (explicit randomness: negatives, prompts, flip).
    pad_value: padding value (training 0.5, docs/reference.md §5).
    squash: resize ignoring the aspect ratio (released code), see `resize_with_pad`.
    resize: 'resize_with_pad' (v1) or 'pad_then_resize' (OWLv2, docs/owlv2.md): how the image
      becomes S x S (`image_ops.preprocess_image`); the boxes are the same for both.
    merge_iou: boxes with IoU >= merge_iou become one multi-label instance (scenic); None: off.
    hflip: random horizontal flip with p = 0.5 (scenic augmentation; off by default).
    negative_weights: optional float [C] negative sampling weights (default uniform;
      `class_frequencies(source)` for frequency-weighted negatives, docs/reference.md §3).
    random_crop: scenic random crop after the flip (`random_crop_example` with
      crop_area_range, crop_aspect_ratio_range, crop_min_area_fraction; off by default).
    annotated_negatives: use the example's `negative_labels` (LVIS `neg_category_ids`) as the
      first negatives, topped up by random ones (docs/reference.md §3). Classes in
      `excluded_labels` (boxes removed by augmentation) are never negatives.
    network_image: float32 [S, S, 3], the image's `preprocess_image` with these settings, made
      earlier (`kept_network_image`); None: made here. Not with `hflip` or `random_crop`.

  Returns:
    dict with the per-example (unbatched) entries of the batch dict: images float32 [S, S, 3],
    queries int32 [Q, L], labels float32 [M, Q], boxes float32 [M, 4] (cxcywh / S),
    query_class int32 [Q], image_id int64 [], orig_size int32 [2] (H, W), example_mask bool [].

  Truncation rules (documented, deterministic):
    * instances are taken in source order after duplicate merging; those beyond M are dropped;
    * a class whose instances were all dropped is not used as a positive query, and it is never
      used as a negative either (it is present in the image), so it simply does not appear;
    * if more than Q-1 classes remain positive, the first Q-1 (ascending class index) are kept
      and labels of the cut classes are removed from their instances (an instance left with no
      label becomes a padding instance).
  Padding instances (rows >= number of real instances) have labels[m, 0] = 1 and zero boxes.
  Query 0 and padding queries are '' with query_class -1 and all-zero label columns for real
  instances.

  Raises:
    ValueError: labels outside [0, C) (names the image); `network_image` with an augmentation.

  Source: docs/reference.md §3 (targets per image), §5 (preprocessing); scenic owl_vit.
  """
  image_size, max_instances = spec.image_size, spec.max_instances
  example = _checked_annotations(example, spec.num_classes)
  if network_image is not None and (hflip or random_crop):
    raise ValueError("network_image is the image before augmentation: not with hflip/random_crop")
  if hflip or random_crop:
    crop = dict(area_range=crop_area_range, aspect_ratio_range=crop_aspect_ratio_range)
    crop["min_area_fraction"] = crop_min_area_fraction
    example = augment_example(example, rng, hflip, random_crop, crop)
    example = _checked_annotations(example, None)
  image, boxes, labels = example["image"], example["boxes"], example["labels"]
  h, w = int(image.shape[0]), int(image.shape[1])
  inst_boxes, inst_labels = merge_duplicate_instances(boxes, labels, merge_iou)
  inst_boxes, inst_labels = inst_boxes[:max_instances], inst_labels[:max_instances]
  query_class = sample_queries(
    sorted({l for ls in inst_labels for l in ls}),
    _present_classes(example),
    spec.num_classes,
    spec.num_queries,
    spec.num_negatives,
    rng,
    negative_weights,
    example.get("negative_labels", ()) if annotated_negatives else (),
  )
  if network_image is None:
    network_image = preprocess_image(image, image_size, pad_value, squash=squash, method=resize)
  scaled = xyxy_to_cxcywh(scale_boxes(inst_boxes, h, w, image_size, squash=squash)) / image_size
  out_labels, out_boxes = instance_targets(scaled, inst_labels, query_class, max_instances)
  return dict(
    images=network_image,
    queries=query_tokens(query_class, spec.class_tokens, spec.empty_tokens, rng),
    labels=out_labels,
    boxes=out_boxes,
    query_class=query_class,
    image_id=np.int64(example["image_id"]),
    orig_size=np.array([h, w], np.int32),
    example_mask=np.bool_(True),
  )


def _checked_annotations(example: dict[str, Any], num_classes: int | None) -> dict[str, Any]:
  """The example with boxes float32 [M, 4] and labels int64 [M]; with `num_classes` C, labels
  outside [0, C) raise ValueError naming the image."""
  boxes = np.asarray(example["boxes"], np.float32).reshape(-1, 4)
  labels = np.asarray(example["labels"], np.int64).reshape(-1)
  if num_classes is not None and labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(
      f"image {example.get('image_id')}: labels {labels.tolist()} outside [0, {num_classes})"
    )
  return dict(example, boxes=boxes, labels=labels)


def _present_classes(example: dict[str, Any]) -> list[int]:
  """Sorted classes present in the image: its labels and those whose boxes an augmentation
  removed (`excluded_labels`); never sampled as negatives."""
  return sorted(
    {int(l) for l in example["labels"]}
    | {int(l) for l in np.asarray(example.get("excluded_labels", [])).ravel()}
  )


def preprocess_eval_example(
  example: dict[str, Any],
  *,
  image_size: int,
  pad_value: float = EVAL_PAD_VALUE,
  squash: bool = False,
  resize: str = "resize_with_pad",
  network_image: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """One evaluation example.

  Args:
    example: dict(image uint8 [H, W, 3], image_id int, ...).
    image_size: S. pad_value: 0.0 (docs/reference.md §5). squash: see `resize_with_pad`.
    resize: 'resize_with_pad' (v1) or 'pad_then_resize' (OWLv2), `image_ops.preprocess_image`.
    network_image: the image's `preprocess_image` with these settings, computed earlier (see
      `preprocess_train_example`); None: computed here.

  Returns:
    dict(images float32 [S, S, 3], image_id int64 [], orig_size int32 [2] (H, W),
    example_mask bool [] = True).

  Source: docs/reference.md §4-§5.
  """
  image = example["image"]
  if network_image is None:
    network_image = preprocess_image(image, image_size, pad_value, squash=squash, method=resize)
  return dict(
    images=network_image,
    image_id=np.int64(example["image_id"]),
    orig_size=np.array(image.shape[:2], np.int32),
    example_mask=np.bool_(True),
  )


def padding_eval_example(
  image_size: int, pad_value: float = EVAL_PAD_VALUE
) -> dict[str, np.ndarray]:
  """A padding example for the last evaluation batch: images filled with `pad_value`,
  image_id -1, orig_size (0, 0), example_mask False (shapes as `preprocess_eval_example`)."""
  return dict(
    images=np.full((image_size, image_size, 3), pad_value, np.float32),
    image_id=np.int64(-1),
    orig_size=np.zeros((2,), np.int32),
    example_mask=np.bool_(False),
  )


def stack_examples(examples: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Stack per-example dicts into a batch dict (adds the leading B axis, keeps dtypes)."""
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


# ------------------------------------------------------------------------------------------
# grain datasets. Transforms are module-level classes so they pickle to grain workers.
# ------------------------------------------------------------------------------------------
def kept_network_image(
  source, index: int, example: dict[str, Any], size: int, options: dict[str, Any]
) -> np.ndarray:
  """float32 [S, S, 3]: `preprocess_image` of `example`'s image (source index `index`) with
  `options`' pad_value, squash and resize (the keywords of `preprocess_train_example`;
  defaults when absent), kept by the source when it keeps its images (`CocoSource.derived`).

  Without augmentation an image's network input is the same in every epoch, evaluation and
  replay-buffer build, and computing it (resize, scale, pad) was the input pipeline's largest
  cost on the built-in benchmark (docs/host_cost.md). `source` may also be a plain sequence
  of examples (nothing kept).
  """
  pad_value = float(options.get("pad_value", TRAIN_PAD_VALUE))
  squash = bool(options.get("squash", False))
  resize = options.get("resize", "resize_with_pad")
  compute = lambda: preprocess_image(
    example["image"], size, pad_value, squash=squash, method=resize
  )
  derived = getattr(source, "derived", None)
  if derived is None:
    return compute()
  return derived(index, ("network_image", size, pad_value, squash, resize), compute)


class _TrainTransform:
  def __init__(
    self,
    source,
    spec: ExampleSpec,
    perm: np.ndarray,
    seed: int,
    epoch: int,
    kwargs: dict[str, Any],
  ):
    kwargs = dict(kwargs)
    self.spec = spec
    self.mosaic_sizes = kwargs.pop("mosaic_sizes", None)
    self.mosaic_probs = kwargs.pop("mosaic_probs", MOSAIC_PROBS)
    self.source, self.perm, self.seed, self.epoch, self.kwargs = source, perm, seed, epoch, kwargs

  def __call__(self, position: int) -> dict[str, np.ndarray]:
    index = int(self.perm[position])
    rng = example_rng(self.seed, self.epoch, index)
    if self.mosaic_sizes is None:
      return self._single(index, rng)
    k = sample_mosaic_size(rng, self.mosaic_sizes, self.mosaic_probs)
    if k == 1:
      return self._single(index, rng)
    others = rng.integers(0, len(self.source), size=k * k - 1)
    kw = self.kwargs
    mosaic = build_mosaic(
      [self.source[index]] + [self.source[int(j)] for j in others],
      k,
      self.spec.image_size,
      rng,
      pad_value=kw.get("pad_value", TRAIN_PAD_VALUE),
      squash=kw.get("squash", False),
      hflip=kw.get("hflip", False),
      random_crop=kw.get("random_crop", False),
      crop_kwargs=dict(
        area_range=kw.get("crop_area_range", CROP_AREA_RANGE),
        aspect_ratio_range=kw.get("crop_aspect_ratio_range", CROP_ASPECT_RATIO_RANGE),
        min_area_fraction=kw.get("crop_min_area_fraction", 0.6),
      ),
    )
    return preprocess_train_example(
      mosaic, self.spec, rng=rng, **dict(kw, hflip=False, random_crop=False)
    )

  def _single(self, index: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The example of source index `index` alone (no mosaic)."""
    example, kw = self.source[index], self.kwargs
    network_image = None
    if not (kw.get("hflip") or kw.get("random_crop")):
      network_image = kept_network_image(self.source, index, example, self.spec.image_size, kw)
    return preprocess_train_example(example, self.spec, rng=rng, network_image=network_image, **kw)


class _EvalTransform:
  def __init__(
    self,
    source,
    image_size: int,
    pad_value: float,
    squash: bool,
    num_images: int | None = None,
    resize: str = "resize_with_pad",
  ):
    self.source, self.image_size, self.pad_value, self.squash = (
      source,
      image_size,
      pad_value,
      squash,
    )
    self.resize = resize
    # `kept_network_image`'s options, made once rather than per example.
    self.image_options = dict(pad_value=pad_value, squash=squash, resize=resize)
    self.num_images = len(source) if num_images is None else num_images

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    if index >= self.num_images:
      return padding_eval_example(self.image_size, self.pad_value)
    example = self.source[index]
    return preprocess_eval_example(
      example,
      image_size=self.image_size,
      pad_value=self.pad_value,
      squash=self.squash,
      resize=self.resize,
      network_image=kept_network_image(
        self.source, index, example, self.image_size, self.image_options
      ),
    )


class _Select:
  """Position -> element of a parent map dataset (a picklable transform)."""

  def __init__(self, parent: grain.MapDataset):
    self.parent = parent

  def __call__(self, position: int) -> dict[str, np.ndarray]:
    return self.parent[int(position)]


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """int64 [N] the order of source indices in `epoch` (a pure function of seed and epoch)."""
  return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), 0x5EED])).permutation(
    num_examples
  )


def train_map_dataset(
  source,
  spec: ExampleSpec,
  *,
  seed: int,
  epoch: int,
  shard: Any = None,
  positions: np.ndarray | None = None,
  **options,
) -> grain.MapDataset:
  """Unbatched training `grain.MapDataset` of one epoch (length N, shuffled).

  Position p holds `preprocess_train_example(source[perm[p]], spec, rng=example_rng(seed,
  epoch, perm[p]))` with perm = `epoch_permutation(N, seed, epoch)`. `options` are passed on to
  `preprocess_train_example` (pad_value, squash, merge_iou, hflip, negative_weights,
  random_crop, crop_*, annotated_negatives), except:

  * `mosaic_sizes` (e.g. `MOSAIC_SIZES` = (1, 2, 3)) and `mosaic_probs` (`MOSAIC_PROBS` =
    (.4, .3, .3)): per position, k is drawn from the example's generator; for k > 1 the
    position's image becomes tile 0 of a k x k mosaic whose k*k - 1 other tiles are drawn
    uniformly from the source with the same generator (`build_mosaic`; scenic instead groups
    consecutive shuffled examples). Default None: no mosaics.

  `shard` (see `shard_options`; e.g. 'jax' or (index, count)) keeps positions
  index, index + count, ... of the epoch (remainder dropped so every host has
  floor(N / count) examples): hosts get disjoint parts of the same global permutation.
  `positions` (int [K], e.g. `batch_row_positions`) keeps only those positions of the epoch,
  in that order (instead of `shard`).

  Source: docs/reference.md §3, §5; scenic owl_vit input pipeline (mosaics, host sharding).
  """
  perm = epoch_permutation(len(source), seed, epoch)
  if positions is not None:
    if shard is not None:
      raise ValueError(f"give shard or positions, not both (shard={shard!r})")
    ds = grain.MapDataset.source(np.asarray(positions, np.int64))
  else:
    ds = apply_shard(grain.MapDataset.range(len(source)), shard)
  return ds.map(_TrainTransform(source, spec, perm, seed, epoch, options))


def _to_batches(
  ds: grain.MapDataset,
  batch_size: int,
  drop_remainder: bool,
  num_workers: int,
  num_threads: int,
  prefetch: int,
) -> Iterator[dict[str, np.ndarray]]:
  read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  it = ds.to_iter_dataset(read)
  if num_workers > 0:
    # grain's worker code reads absl flags; outside an absl app they are unparsed and reading
    # them raises, so mark them parsed (their defaults are used). No effect inside an app.
    from absl import flags

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    # Workers decode and preprocess single examples (worker w takes elements w, w + n, ...;
    # grain interleaves them back in order); batching happens afterwards, so the batches are
    # identical for every worker count (batching inside the workers would group each
    # worker's elements into its own batches).
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  it = it.batch(batch_size, drop_remainder=drop_remainder, batch_fn=stack_examples)
  return iter(it)


def train_dataset(
  source,
  spec: ExampleSpec,
  *,
  batch_size: int,
  seed: int,
  epoch: int,
  num_workers: int = 0,
  num_threads: int = 2,
  prefetch: int = 64,
  shard: Any = None,
  batch_rows: tuple[int, int] | None = None,
  start_batch: int = 0,
  **options,
) -> Iterator[dict[str, np.ndarray]]:
  """Iterator over the training batches of one epoch, from batch `start_batch` on.

  Args:
    source: random-access source of examples (`CocoSource` or any sequence of
      `CocoSource.load`-style dicts).
    spec: the example's class tokens (tokenizer.encode of the class names, [C, L] or
      [C, P, L]), S, Q, M and negatives per image (`ExampleSpec`).
    batch_size: B. seed, epoch: ints >= 0; the shuffle order and every per-example random
      choice are pure functions of (seed, epoch, source index).
    num_workers: 0 preprocesses in this process (with `num_threads` reader threads);
      > 0 uses grain multiprocessing prefetch (`mp_prefetch`) with that many processes.
    num_threads: grain `ReadOptions.num_threads` of the in-process readers.
    prefetch: grain `ReadOptions.prefetch_buffer_size` of the in-process readers.
    shard: host sharding (`shard_options`: None, 'jax', ShardOptions or (index, count)); each
      host then iterates floor(N / count) / B batches of its disjoint part.
    batch_rows: (start, stop): multi-process data parallelism; keep only rows [start, stop)
      of each global batch of B (`owl_cl.train.sharding.process_rows`), so every process
      iterates the same floor(N / B) batches of stop - start rows and together they form the
      batches of one process. Not with `shard`.
    start_batch: batches of the epoch already consumed (a resumed loop, `owl_cl.trainer
      .LoopState.batch_in_epoch`): the iterator starts at batch `start_batch` of the same
      order, without reading the skipped examples (0 = the whole epoch).
    **options: pad_value, squash, merge_iou, hflip, negative_weights, random_crop, crop_*,
      annotated_negatives (see `preprocess_train_example`), mosaic_sizes, mosaic_probs (see
      `train_map_dataset`).

  Returns:
    iterator of batch dicts (CONVENTIONS.md) with fixed shapes: images [B, S, S, 3],
    queries [B, Q, L], labels [B, M, Q], boxes [B, M, 4], query_class [B, Q], image_id [B],
    orig_size [B, 2], example_mask [B] (all True). floor(N / B) batches (remainder dropped).

  Raises:
    ValueError: a negative `start_batch` (at once); errors of the source
      (DataError) when iterated.

  Source: docs/reference.md §3, §5.
  """
  if start_batch < 0:
    raise ValueError(f"start_batch must be >= 0, got {start_batch}")
  ds = train_map_dataset(
    source,
    spec,
    seed=seed,
    epoch=epoch,
    shard=shard,
    positions=None
    if batch_rows is None
    else batch_row_positions(len(source), batch_size, batch_rows),
    **options,
  )
  local_batch = batch_size if batch_rows is None else batch_rows[1] - batch_rows[0]
  return iterate_batches(ds, local_batch, start_batch, num_workers, num_threads, prefetch)


def iterate_batches(
  ds: grain.MapDataset,
  batch_size: int,
  start_batch: int = 0,
  num_workers: int = 0,
  num_threads: int = 2,
  prefetch: int = 64,
) -> Iterator[dict[str, np.ndarray]]:
  """Full batches of `batch_size` consecutive elements of `ds` (the last partial one
  dropped), from batch `start_batch` on; workers, threads and prefetch as `train_dataset`."""
  if start_batch:
    # Every example is a pure function of (seed, epoch, position), so the slice holds exactly
    # the examples the uninterrupted epoch would have read from this batch on.
    ds = ds[start_batch * batch_size :]
  return _to_batches(ds, batch_size, True, num_workers, num_threads, prefetch)


def eval_map_dataset(
  source,
  *,
  image_size: int,
  batch_size: int,
  pad_value: float = EVAL_PAD_VALUE,
  squash: bool = False,
  max_images: int | None = None,
  resize: str = "resize_with_pad",
) -> grain.MapDataset:
  """Unbatched evaluation `grain.MapDataset` in source order (the first `max_images` images
  when given), padded with `padding_eval_example` up to a multiple of `batch_size`."""
  n = len(source) if max_images is None else min(len(source), int(max_images))
  n_padded = -(-n // batch_size) * batch_size
  return grain.MapDataset.range(n_padded).map(
    _EvalTransform(source, image_size, pad_value, squash, n, resize)
  )


def eval_dataset(
  source,
  *,
  image_size: int,
  batch_size: int,
  num_workers: int = 0,
  num_threads: int = 2,
  prefetch: int = 64,
  pad_value: float = EVAL_PAD_VALUE,
  squash: bool = False,
  max_images: int | None = None,
  batch_rows: tuple[int, int] | None = None,
  resize: str = "resize_with_pad",
) -> Iterator[dict[str, np.ndarray]]:
  """Iterator over evaluation batches, in source order, every image exactly once.

  Args:
    source: random-access source (`CocoSource`). image_size: S. batch_size: B.
    num_workers: as `train_dataset`.
    num_threads: as `train_dataset`.
    prefetch: as `train_dataset`.
    pad_value: 0.0 (docs/reference.md §5).
    squash: see `resize_with_pad`. max_images: evaluate only the first N images (None: all).
    resize: 'resize_with_pad' (v1) or 'pad_then_resize' (OWLv2), `image_ops.preprocess_image`.
    batch_rows: (start, stop): multi-process evaluation; keep rows [start, stop) of each
      global batch of B (as `train_dataset`); every process iterates the same ceil(N / B)
      batches of stop - start rows, and the processes together see every image once.

  Returns:
    iterator of dict(images float32 [B, S, S, 3] (pad 0.0), image_id int64 [B],
    orig_size int32 [B, 2] (H, W), example_mask bool [B]); ceil(N / B) batches, the last one
    filled with padding examples (image_id -1, orig_size (0, 0), example_mask False).

  Source: docs/reference.md §4-§5.
  """
  ds = eval_map_dataset(
    source,
    image_size=image_size,
    batch_size=batch_size,
    pad_value=pad_value,
    squash=squash,
    max_images=max_images,
    resize=resize,
  )
  if batch_rows is not None:
    positions = batch_row_positions(len(ds), batch_size, batch_rows)
    ds = grain.MapDataset.source(positions).map(_Select(ds))
    batch_size = batch_rows[1] - batch_rows[0]
  return _to_batches(ds, batch_size, False, num_workers, num_threads, prefetch)

"""Input pipeline: resize-with-pad, training targets/queries, batched grain datasets.

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

Sources: docs/reference.md §3 (targets/queries), §5 (preprocessing); scenic owl_vit `ResizeWithPad`
(aspect-preserving resize, bottom/right pad) and the released code's HF squash-resize (option
`squash=True`).

Training options (all off by default, so the defaults reproduce the built-in benchmark runs):

- negatives: `negative_weights` [C] (e.g. `class_frequencies(source)`: frequency-weighted
  random negatives, docs/reference.md §3 / released code), `annotated_negatives` (LVIS
  `neg_category_ids`
  first; on by default but only federated sources carry them);
- `merge_iou` (0.9 by default): boxes with IoU >= 0.9 become one multi-label instance;
- scenic augmentations (docs/reference.md §5): `hflip`, `random_crop` (area 0.3-1.0, aspect
0.75-1.33,
  boxes keeping < 60% of their area dropped), `mosaic_sizes` / `mosaic_probs` ((1, 2, 3) with
  (.4, .3, .3) as `MOSAIC_SIZES` / `MOSAIC_PROBS`);
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
from PIL import Image

__all__ = [
  "resize_geometry",
  "resize_with_pad",
  "resized_uint8",
  "pad_to_square",
  "uint8_to_unit",
  "scale_boxes",
  "xyxy_to_cxcywh",
  "example_rng",
  "merge_duplicate_instances",
  "sample_queries",
  "preprocess_train_example",
  "preprocess_eval_example",
  "padding_eval_example",
  "stack_examples",
  "train_map_dataset",
  "train_dataset",
  "eval_map_dataset",
  "eval_dataset",
  "TRAIN_PAD_VALUE",
  "EVAL_PAD_VALUE",
  "class_frequencies",
  "hflip_example",
  "sample_crop_region",
  "crop_example",
  "random_crop_example",
  "build_mosaic",
  "sample_mosaic_size",
  "shard_options",
  "MOSAIC_SIZES",
  "MOSAIC_PROBS",
]

TRAIN_PAD_VALUE = 0.5  # docs/reference.md §5 (scenic): padding value of training images.
EVAL_PAD_VALUE = 0.0  # docs/reference.md §5 (scenic): padding value of evaluation images.

# scenic's random-crop ranges (the defaults of config.data.augment): area fraction and aspect
# ratio of the crop.
CROP_AREA_RANGE = (0.3, 1.0)
CROP_ASPECT_RATIO_RANGE = (0.75, 1.33)


# ------------------------------------------------------------------------------------------
# Geometry.
# ------------------------------------------------------------------------------------------
def resize_geometry(
  height: int, width: int, size: int, *, squash: bool = False
) -> tuple[int, int, float, float]:
  """Target size of the resized image content and the box scale factors.

  Args:
    height, width: original image size in pixels (> 0).
    size: S, side of the square network input in pixels.
    squash: False (default, scenic): keep the aspect ratio, long side = S, i.e.
      scale = S / max(H, W), new size = (round(H*scale), round(W*scale)) clamped to [1, S];
      True (released code, HF processor): resize to S x S ignoring the aspect ratio.

  Returns:
    (new_h, new_w, scale_y, scale_x): content size in pixels and the factors mapping original
    pixel coordinates to padded-frame pixel coordinates. With squash=False both factors equal
    S / max(H, W) exactly (the same continuous factor the evaluator inverts, docs/reference.md §4),
    so boxes
    may deviate from the rounded content edge by < 0.5 px.

  Raises:
    ValueError: non-positive sizes.

  Source: docs/reference.md §5.
  """
  if height <= 0 or width <= 0 or size <= 0:
    raise ValueError(f"sizes must be positive, got height={height} width={width} size={size}")
  if squash:
    return size, size, size / height, size / width
  scale = size / max(height, width)
  new_h = min(size, max(1, int(round(height * scale))))
  new_w = min(size, max(1, int(round(width * scale))))
  return new_h, new_w, scale, scale


def uint8_to_unit(pixels: np.ndarray) -> np.ndarray:
  """float32 pixels in [0, 1] of uint8 `pixels` [...]: x * float32(1/255), the one scaling every
  resize path of this module applies (so a uint8 copy of resized content is exact)."""
  return np.asarray(pixels).astype(np.float32) * np.float32(1 / 255)


def resized_uint8(image: np.ndarray, size: int, *, squash: bool = False) -> np.ndarray:
  """The resized content of a uint8 image, before scaling and padding.

  Args:
    image: uint8 [H, W, 3]. size: S in pixels. squash: as in `resize_geometry`.
  Returns:
    uint8 [new_h, new_w, 3] (`resize_geometry`'s content size): PIL bilinear resize, or
    `image` itself when it already has that size. `resize_with_pad` of a uint8 image is
    `pad_to_square(uint8_to_unit(resized_uint8(image, S)), S, pad_value)`, bit for bit.
  Raises:
    ValueError: image not uint8 [H, W, 3].
  Source: docs/reference.md §5.
  """
  if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
    raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
  new_h, new_w, _, _ = resize_geometry(image.shape[0], image.shape[1], size, squash=squash)
  if image.shape[0] == new_h and image.shape[1] == new_w:
    return image
  return np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.BILINEAR))


def pad_to_square(content: np.ndarray, size: int, pad_value: float) -> np.ndarray:
  """float32 [S, S, 3]: `content` float32 [h, w, 3] (h, w <= S) at the top left, `pad_value`
  in the bottom / right padding (`content` itself when it is S x S). Source: docs/reference.md
  §5 (scenic `ResizeWithPad` pads bottom / right)."""
  new_h, new_w = content.shape[:2]
  if new_h == size and new_w == size:
    return content
  out = np.full((size, size, 3), pad_value, np.float32)
  out[:new_h, :new_w] = content
  return out


def _resize_float(image: np.ndarray, new_h: int, new_w: int) -> np.ndarray:
  """Bilinear resize of a float [H, W, 3] image in [0, 1] to float32 [new_h, new_w, 3]."""
  image = np.asarray(image, np.float32)
  if image.shape[0] == new_h and image.shape[1] == new_w:
    return image.copy()
  chans = [
    np.asarray(
      Image.fromarray(np.ascontiguousarray(image[..., c]), mode="F").resize(
        (new_w, new_h), Image.BILINEAR
      )
    )
    for c in range(image.shape[2])
  ]
  return np.stack(chans, axis=-1).astype(np.float32)


def resize_with_pad(
  image: np.ndarray, size: int, pad_value: float, *, squash: bool = False
) -> np.ndarray:
  """Resize keeping the aspect ratio (long side = S) and pad bottom/right to S x S.

  Args:
    image: [H, W, 3] uint8 (0..255, divided by 255) or float in [0, 1].
    size: S in pixels.
    pad_value: value of the padding pixels (0.5 training, 0.0 evaluation; docs/reference.md §5).
    squash: resize to S x S ignoring the aspect ratio (released code / HF), no padding.

  Returns:
    float32 [S, S, 3] in [0, 1]; content occupies rows [0, new_h) and columns [0, new_w) with
    (new_h, new_w) from `resize_geometry`.

  Interpolation: PIL bilinear (which widens its kernel when downscaling, i.e. antialiased;
  tf.image.resize in scenic is not antialiased: values differ slightly at strong downscaling).

  Raises:
    ValueError: image not [H, W, 3].

  Source: docs/reference.md §5; scenic owl_vit preprocessing `ResizeWithPad`.
  """
  if image.ndim != 3 or image.shape[2] != 3:
    raise ValueError(f"image must be [H, W, 3], got shape {image.shape}")
  if image.dtype == np.uint8:
    # Split at the uint8 content so that the replay store's image cache (replay/images.py)
    # can keep exactly this stage.
    return pad_to_square(uint8_to_unit(resized_uint8(image, size, squash=squash)), size, pad_value)
  new_h, new_w, _, _ = resize_geometry(image.shape[0], image.shape[1], size, squash=squash)
  return pad_to_square(_resize_float(image, new_h, new_w), size, pad_value)


def scale_boxes(
  boxes: np.ndarray, height: int, width: int, size: int, *, squash: bool = False
) -> np.ndarray:
  """Map xyxy pixel boxes of an H x W image into the padded S x S frame.

  Args:
    boxes: float [M, 4] xyxy, pixels of the original image.
    height, width: original image size; size: S.
    squash: as in `resize_geometry`.

  Returns:
    float32 [M, 4] xyxy pixels of the S x S input, clipped to [0, S].

  Source: docs/reference.md §5 ("boxes scale with the image").
  """
  _, _, sy, sx = resize_geometry(height, width, size, squash=squash)
  b = np.asarray(boxes, np.float32).reshape(-1, 4) * np.array([sx, sy, sx, sy], np.float32)
  return np.clip(b, 0.0, float(size))


def xyxy_to_cxcywh(boxes: np.ndarray) -> np.ndarray:
  """float [..., 4] (x0, y0, x1, y1) -> float32 [..., 4] (cx, cy, w, h), same units."""
  b = np.asarray(boxes, np.float32)
  return np.stack(
    [
      (b[..., 0] + b[..., 2]) / 2,
      (b[..., 1] + b[..., 3]) / 2,
      b[..., 2] - b[..., 0],
      b[..., 3] - b[..., 1],
    ],
    axis=-1,
  )


# ------------------------------------------------------------------------------------------
# Augmentations (scenic owl_vit image_ops / mosaic.py; docs/reference.md §5). Pure functions of
# their inputs
# and the explicit numpy Generator. Examples are `CocoSource.load`-style dicts: image [H, W, 3]
# (uint8, or float32 in [0, 1] for mosaics), boxes float [M, 4] xyxy pixels, labels int [M];
# optional `negative_labels` (LVIS) and `excluded_labels` (classes whose boxes an augmentation
# removed: never used as negatives, since parts of them may still be visible).
# ------------------------------------------------------------------------------------------
MOSAIC_SIZES = (1, 2, 3)  # docs/reference.md §5 / scenic configs: mosaic_sizes
MOSAIC_PROBS = (0.4, 0.3, 0.3)  # docs/reference.md §5 / scenic configs: mosaic_probs


def class_frequencies(source) -> np.ndarray:
  """float64 [C] number of images of `source` that contain each class (non-crowd boxes).

  Use as `negative_weights` for frequency-weighted random negatives (docs/reference.md §3; the
  released
  code's `data/add_negatives.py` weights each label by the number of training images listing
  it). Reads `source.targets(i)` (no image decoding) when available, else `source[i]`.
  """
  counts = np.zeros(source.num_classes if hasattr(source, "num_classes") else 0, np.float64)
  get = getattr(source, "targets", None) or (lambda i: source[i])
  for i in range(len(source)):
    labels = np.unique(np.asarray(get(i)["labels"], np.int64))
    if labels.size and labels.max() >= counts.size:
      counts = np.pad(counts, (0, int(labels.max()) + 1 - counts.size))
    counts[labels] += 1
  return counts


def _with(example: dict[str, Any], **updates) -> dict[str, Any]:
  out = dict(example)
  out.update(updates)
  return out


def hflip_example(example: dict[str, Any]) -> dict[str, Any]:
  """Mirror the image left-right; boxes map x -> W - x exactly ([x0, y0, x1, y1] ->
  [W - x1, y0, W - x0, y1]). Source: scenic `RandomFlipLeftRight` (applied with p = 0.5)."""
  image = example["image"]
  w = image.shape[1]
  boxes = np.asarray(example["boxes"], np.float32).reshape(-1, 4)
  boxes = np.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], axis=-1)
  return _with(example, image=np.ascontiguousarray(image[:, ::-1]), boxes=boxes)


def sample_crop_region(
  height: int,
  width: int,
  rng: np.random.Generator,
  *,
  area_range: tuple[float, float] = CROP_AREA_RANGE,
  aspect_ratio_range: tuple[float, float] = CROP_ASPECT_RATIO_RANGE,
  max_attempts: int = 100,
) -> tuple[int, int, int, int]:
  """A random crop window as tf.image.sample_distorted_bounding_box draws it.

  Per attempt: area fraction a ~ U(area_range), aspect ratio r = w / h ~ U(aspect_ratio_range),
  h = round(sqrt(a H W / r)), w = round(r h); the first window that fits is placed uniformly.
  After `max_attempts` misses the whole image is returned.

  Returns:
    (top, left, crop_height, crop_width) in pixels (ints, 1 <= crop <= image).

  Source: scenic `RandomCrop` (area 0.3-1.0, aspect 0.75-1.33; docs/reference.md §5).
  """
  for _ in range(max_attempts):
    area = rng.uniform(*area_range) * height * width
    ratio = rng.uniform(*aspect_ratio_range)
    h = int(round(np.sqrt(area / ratio)))
    w = int(round(ratio * h))
    if 1 <= h <= height and 1 <= w <= width:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return top, left, h, w
  return 0, 0, height, width


def crop_example(
  example: dict[str, Any],
  top: int,
  left: int,
  height: int,
  width: int,
  *,
  min_area_fraction: float = 0.6,
) -> dict[str, Any]:
  """Crop the window [top, top+height) x [left, left+width) and its boxes.

  Boxes are clipped to the window and shifted to its origin; a box is dropped when its area
  inside the window is 0 or less than `min_area_fraction` of its original area (scenic:
  `area_left >= min_area_fraction` keeps it). Labels of dropped boxes are added to
  `excluded_labels`.

  Returns:
    the example with image [height, width, 3], boxes float32 [M', 4], labels int32 [M'].

  Source: scenic `RandomCropBase._drop_degenerate_features` (min_area_fraction 0.6 in the
  OWL-ViT configs; docs/reference.md §5).
  """
  image = example["image"][top : top + height, left : left + width]
  boxes = np.asarray(example["boxes"], np.float32).reshape(-1, 4)
  labels = np.asarray(example["labels"], np.int32).reshape(-1)
  area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
  clipped = boxes - np.array([left, top, left, top], np.float32)
  clipped = np.clip(clipped, 0.0, np.array([width, height, width, height], np.float32))
  new_area = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
  keep = (new_area > 0) & (new_area >= min_area_fraction * area)
  excluded = np.union1d(
    np.asarray(example.get("excluded_labels", []), np.int32), labels[~keep]
  ).astype(np.int32)
  return _with(
    example,
    image=np.ascontiguousarray(image),
    boxes=clipped[keep],
    labels=labels[keep],
    excluded_labels=excluded,
  )


def random_crop_example(
  example: dict[str, Any],
  rng: np.random.Generator,
  *,
  area_range: tuple[float, float] = CROP_AREA_RANGE,
  aspect_ratio_range: tuple[float, float] = CROP_ASPECT_RATIO_RANGE,
  min_area_fraction: float = 0.6,
) -> dict[str, Any]:
  """`crop_example` at a window drawn by `sample_crop_region` (scenic `RandomCrop`)."""
  h, w = example["image"].shape[:2]
  top, left, ch, cw = sample_crop_region(
    h, w, rng, area_range=area_range, aspect_ratio_range=aspect_ratio_range
  )
  return crop_example(example, top, left, ch, cw, min_area_fraction=min_area_fraction)


def sample_mosaic_size(
  rng: np.random.Generator,
  sizes: Sequence[int] = MOSAIC_SIZES,
  probs: Sequence[float] = MOSAIC_PROBS,
) -> int:
  """k, the number of tiles per mosaic side, drawn with probabilities `probs`.

  Source: docs/reference.md §5.
  """
  if len(sizes) != len(probs) or not np.isclose(sum(probs), 1.0):
    raise ValueError(
      f"mosaic sizes {tuple(sizes)} and probs {tuple(probs)} must have equal "
      f"length and probs must sum to 1"
    )
  return int(sizes[int(rng.choice(len(sizes), p=np.asarray(probs, np.float64)))])


def _augment(
  example: dict[str, Any],
  rng: np.random.Generator,
  hflip: bool,
  random_crop: bool,
  crop_kwargs: dict[str, Any],
) -> dict[str, Any]:
  if hflip and rng.random() < 0.5:
    example = hflip_example(example)
  if random_crop:
    example = random_crop_example(example, rng, **crop_kwargs)
  return example


def build_mosaic(
  examples: Sequence[dict[str, Any]],
  mosaic_size: int,
  image_size: int,
  rng: np.random.Generator | None = None,
  *,
  pad_value: float = TRAIN_PAD_VALUE,
  squash: bool = False,
  hflip: bool = False,
  random_crop: bool = False,
  crop_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Assemble k x k examples into one S x S training image (scenic `CreateMosaic`).

  Tile t (row t // k, column t % k) is examples[t], augmented (flip, crop; in that order, with
  `rng`), resized with padding to S / k (`resize_with_pad`) and placed at
  (row * S / k, column * S / k); its boxes are scaled with it and shifted by the same offset.

  Args:
    examples: k*k examples (image [H, W, 3] uint8, boxes [M, 4] xyxy pixels, labels [M]).
    mosaic_size: k >= 1. image_size: S, divisible by k.
    rng: Generator for the augmentations (required when hflip or random_crop).
    pad_value, squash: as `resize_with_pad`. hflip, random_crop, crop_kwargs: per-tile
      augmentations (`random_crop_example` keyword arguments).

  Returns:
    example dict: image float32 [S, S, 3] in [0, 1], boxes float32 [sum M, 4] xyxy pixels of
    the mosaic, labels int32 [sum M], image_id of the first tile, excluded_labels (classes
    dropped by crops), negative_labels (union of the tiles' LVIS negatives minus every class
    present in the mosaic) when any tile has them.

  Raises:
    ValueError: wrong number of examples, S not divisible by k.

  Source: scenic owl_vit `preprocessing/mosaic.py` and `input_pipeline.py` (resize ops divided
  by the mosaic size); docs/reference.md §5.
  """
  k = int(mosaic_size)
  if k < 1 or len(examples) != k * k:
    raise ValueError(f"a {k}x{k} mosaic needs {k * k} examples, got {len(examples)}")
  if image_size % k:
    raise ValueError(f"image_size {image_size} is not divisible by the mosaic size {k}")
  tile = image_size // k
  out = np.empty((image_size, image_size, 3), np.float32)
  boxes, labels, excluded, negatives = [], [], [], []
  has_negatives = False
  for t, ex in enumerate(examples):
    if hflip or random_crop:
      ex = _augment(ex, rng, hflip, random_crop, crop_kwargs or {})
    r, c = divmod(t, k)
    h, w = ex["image"].shape[:2]
    out[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile] = resize_with_pad(
      ex["image"], tile, pad_value, squash=squash
    )
    b = scale_boxes(ex["boxes"], h, w, tile, squash=squash)
    boxes.append(b + np.array([c, r, c, r], np.float32) * tile)
    labels.append(np.asarray(ex["labels"], np.int32).reshape(-1))
    excluded.append(np.asarray(ex.get("excluded_labels", []), np.int32))
    if "negative_labels" in ex:
      has_negatives = True
      negatives.append(np.asarray(ex["negative_labels"], np.int32))
  labels_all = np.concatenate(labels)
  result = dict(
    image=out,
    boxes=np.concatenate(boxes).astype(np.float32),
    labels=labels_all,
    image_id=examples[0]["image_id"],
    excluded_labels=np.unique(np.concatenate(excluded)).astype(np.int32),
  )
  if has_negatives:
    neg = np.unique(np.concatenate(negatives))
    present = np.union1d(labels_all, result["excluded_labels"])
    result["negative_labels"] = np.setdiff1d(neg, present).astype(np.int32)
  return result


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


def _apply_shard(ds: grain.MapDataset, shard: Any) -> grain.MapDataset:
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


# ------------------------------------------------------------------------------------------
# Targets and queries.
# ------------------------------------------------------------------------------------------
def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """The per-example generator, a pure function of (seed, epoch, index) (all ints >= 0)."""
  return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(index)]))


def _pairwise_iou(b: np.ndarray) -> np.ndarray:
  area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
  lt = np.maximum(b[:, None, :2], b[None, :, :2])
  rb = np.minimum(b[:, None, 2:], b[None, :, 2:])
  inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
  union = area[:, None] + area[None, :] - inter
  return inter / np.maximum(union, 1e-9)


def merge_duplicate_instances(
  boxes: np.ndarray, labels: np.ndarray, iou_threshold: float | None = 0.9
) -> tuple[np.ndarray, list[list[int]]]:
  """Merge boxes with IoU >= threshold into one multi-label instance (scenic, docs/reference.md §3).

  Args:
    boxes: float [M, 4] xyxy; labels: int [M] class indices.
    iou_threshold: merge threshold; None disables merging (one label per box).

  Returns:
    (boxes float32 [K, 4] — the first box of each group, in input order;
     label lists: K lists of sorted unique class indices).
  """
  boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
  labels = np.asarray(labels).reshape(-1)
  if iou_threshold is None or len(boxes) < 2:
    return boxes, [[int(l)] for l in labels]
  iou = _pairwise_iou(boxes)
  group = -np.ones(len(boxes), np.int64)
  keep: list[int] = []
  for i in range(len(boxes)):
    if group[i] >= 0:
      continue
    group[i] = len(keep)
    members = np.nonzero((iou[i] >= iou_threshold) & (group < 0))[0]
    group[members] = len(keep)
    keep.append(i)
  label_sets: list[set] = [set() for _ in keep]
  for i, g in enumerate(group):
    label_sets[g].add(int(labels[i]))
  return boxes[keep], [sorted(s) for s in label_sets]


def sample_queries(
  positives: Sequence[int],
  excluded: Sequence[int],
  num_classes: int,
  num_queries: int,
  num_negatives: int,
  rng: np.random.Generator,
  negative_weights: np.ndarray | None = None,
  annotated_negatives: Sequence[int] = (),
) -> np.ndarray:
  """Query classes of one training image: [-1 (''), positives..., negatives..., -1...].

  Args:
    positives: class indices with a target box in the image (deduplicated, order kept); at most
      Q-1 are used (the rest are cut, see `preprocess_train_example`).
    excluded: classes present in the image (never sampled as negatives; includes `positives`).
    num_classes: C, the dataset's class count.
    num_queries: Q (>= 1).
    num_negatives: maximum number of negatives; fewer when the free slots (Q-1-P) or the
      candidate classes run out.
    rng: numpy Generator (explicit randomness).
    negative_weights: optional float [C] sampling weights (e.g. `class_frequencies`,
      docs/reference.md §3); default uniform over the candidates. Negatives are drawn without
      replacement.
    annotated_negatives: classes verified absent (LVIS `neg_category_ids`); they come first
      (in a random order, at most `num_negatives`), the rest is topped up by random sampling
      (docs/reference.md §3). Excluded / positive classes among them are ignored.

  Returns:
    int32 [Q] query_class; -1 marks '' (index 0 and padding).

  Source: docs/reference.md §3 (query list = unique(['', positives, negatives]) padded with '').
  """
  if num_queries < 1:
    raise ValueError(f"num_queries must be >= 1, got {num_queries}")
  pos: list[int] = list(dict.fromkeys(int(p) for p in positives))[: num_queries - 1]
  excl = np.zeros(num_classes, bool)
  excl[np.asarray(list(excluded) + pos, np.int64)] = True
  budget = max(0, min(num_negatives, num_queries - 1 - len(pos)))
  first = np.zeros((0,), np.int64)
  if len(annotated_negatives) and budget > 0:
    ann = np.unique(np.asarray(annotated_negatives, np.int64))
    ann = ann[(ann >= 0) & (ann < num_classes)]
    ann = ann[~excl[ann]]
    first = rng.permutation(ann)[:budget]
    excl[first] = True
  candidates = np.nonzero(~excl)[0]
  n_neg = max(0, min(budget - len(first), len(candidates)))
  if n_neg > 0:
    p = None
    if negative_weights is not None:
      w = np.asarray(negative_weights, np.float64)[candidates]
      if w.sum() > 0:
        p = w / w.sum()
        n_neg = min(n_neg, int(np.count_nonzero(p)))
    neg = rng.choice(candidates, size=n_neg, replace=False, p=p)
  else:
    neg = np.zeros((0,), np.int64)
  neg = np.concatenate([first, np.asarray(neg, np.int64)])
  n_neg = len(neg)
  qc = np.full((num_queries,), -1, np.int32)
  qc[1 : 1 + len(pos)] = pos
  qc[1 + len(pos) : 1 + len(pos) + n_neg] = neg
  return qc


def _query_tokens(
  query_class: np.ndarray,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  rng: np.random.Generator,
) -> np.ndarray:
  """int32 [Q, L]; with class_tokens [C, P, L] a prompt variant is drawn per query."""
  q = len(query_class)
  out = np.broadcast_to(np.asarray(empty_tokens, np.int32), (q, empty_tokens.shape[-1])).copy()
  real = query_class >= 0
  if real.any():
    cls = query_class[real]
    if class_tokens.ndim == 3:
      pick = rng.integers(0, class_tokens.shape[1], size=len(cls))
      out[real] = class_tokens[cls, pick]
    else:
      out[real] = class_tokens[cls]
  return out


def _check_tokens(
  class_tokens: np.ndarray, empty_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  class_tokens = np.asarray(class_tokens, np.int32)
  empty_tokens = np.asarray(empty_tokens, np.int32).reshape(-1)
  if class_tokens.ndim not in (2, 3) or class_tokens.shape[-1] != empty_tokens.shape[0]:
    raise ValueError(
      f"class_tokens must be [C, L] or [C, P, L] with L = len(empty_tokens) "
      f"= {empty_tokens.shape[0]}, got {class_tokens.shape}"
    )
  return class_tokens, empty_tokens


def preprocess_train_example(
  example: dict[str, Any],
  *,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  image_size: int,
  num_queries: int,
  max_instances: int,
  num_negatives: int,
  rng: np.random.Generator,
  pad_value: float = TRAIN_PAD_VALUE,
  squash: bool = False,
  merge_iou: float | None = 0.9,
  hflip: bool = False,
  negative_weights: np.ndarray | None = None,
  random_crop: bool = False,
  crop_area_range: tuple[float, float] = CROP_AREA_RANGE,
  crop_aspect_ratio_range: tuple[float, float] = CROP_ASPECT_RATIO_RANGE,
  crop_min_area_fraction: float = 0.6,
  annotated_negatives: bool = True,
) -> dict[str, np.ndarray]:
  """One training example: image resized/padded, queries sampled, targets built.

  Args:
    example: dict(image uint8 [H, W, 3], boxes float [M0, 4] xyxy pixels, labels int [M0]
      contiguous class indices, image_id int), e.g. `CocoSource.load(i)`.
    class_tokens: int32 [C, L] tokenised class names, or [C, P, L] with P prompt variants
      (one drawn uniformly per query, docs/reference.md §2 training prompts).
    empty_tokens: int32 [L] tokens of '' (query 0 and padding queries).
    image_size: S. num_queries: Q. max_instances: M. num_negatives: negatives per image
      (released code: 50). rng: numpy Generator (explicit randomness: negatives, prompts, flip).
    pad_value: padding value (training 0.5, docs/reference.md §5).
    squash: resize ignoring the aspect ratio (released code), see `resize_with_pad`.
    merge_iou: boxes with IoU >= merge_iou become one multi-label instance (scenic); None: off.
    hflip: random horizontal flip with p = 0.5 (scenic augmentation; off by default).
    negative_weights: optional float [C] negative sampling weights (default uniform;
      `class_frequencies(source)` for frequency-weighted negatives, docs/reference.md §3).
    random_crop: scenic random crop after the flip (`random_crop_example` with
      crop_area_range, crop_aspect_ratio_range, crop_min_area_fraction; off by default).
    annotated_negatives: use the example's `negative_labels` (LVIS `neg_category_ids`) as the
      first negatives, topped up by random ones (docs/reference.md §3). Classes in `excluded_labels`
      (boxes
      removed by augmentation) are never negatives.

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
    ValueError: inconsistent token shapes, labels outside [0, C).

  Source: docs/reference.md §3 (targets per image), §5 (preprocessing); scenic owl_vit.
  """
  class_tokens, empty_tokens = _check_tokens(class_tokens, empty_tokens)
  num_classes = class_tokens.shape[0]
  image = example["image"]
  h, w = int(image.shape[0]), int(image.shape[1])
  boxes = np.asarray(example["boxes"], np.float32).reshape(-1, 4)
  labels = np.asarray(example["labels"], np.int64).reshape(-1)
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(
      f"image {example.get('image_id')}: labels {labels.tolist()} outside [0, {num_classes})"
    )
  if hflip or random_crop:
    example = _augment(
      _with(example, boxes=boxes, labels=labels),
      rng,
      hflip,
      random_crop,
      dict(
        area_range=crop_area_range,
        aspect_ratio_range=crop_aspect_ratio_range,
        min_area_fraction=crop_min_area_fraction,
      ),
    )
    image = example["image"]
    h, w = int(image.shape[0]), int(image.shape[1])
    boxes = np.asarray(example["boxes"], np.float32).reshape(-1, 4)
    labels = np.asarray(example["labels"], np.int64).reshape(-1)

  inst_boxes, inst_labels = merge_duplicate_instances(boxes, labels, merge_iou)
  present = sorted(
    {int(l) for l in labels}
    | {int(l) for l in np.asarray(example.get("excluded_labels", [])).ravel()}
  )
  inst_boxes, inst_labels = inst_boxes[:max_instances], inst_labels[:max_instances]
  positives = sorted({l for ls in inst_labels for l in ls})
  given_negatives = example.get("negative_labels", ()) if annotated_negatives else ()
  query_class = sample_queries(
    positives,
    present,
    num_classes,
    num_queries,
    num_negatives,
    rng,
    negative_weights,
    given_negatives,
  )
  col = {int(c): j for j, c in enumerate(query_class) if c >= 0}

  out_labels = np.zeros((max_instances, num_queries), np.float32)
  out_boxes = np.zeros((max_instances, 4), np.float32)
  scaled = xyxy_to_cxcywh(scale_boxes(inst_boxes, h, w, image_size, squash=squash)) / image_size
  m = 0
  for b, ls in zip(scaled, inst_labels):
    cols = [col[l] for l in ls if l in col]
    if not cols:
      continue
    out_labels[m, cols] = 1.0
    out_boxes[m] = b
    m += 1
  out_labels[m:, 0] = 1.0

  return dict(
    images=resize_with_pad(image, image_size, pad_value, squash=squash),
    queries=_query_tokens(query_class, class_tokens, empty_tokens, rng),
    labels=out_labels,
    boxes=out_boxes,
    query_class=query_class,
    image_id=np.int64(example["image_id"]),
    orig_size=np.array([h, w], np.int32),
    example_mask=np.bool_(True),
  )


def preprocess_eval_example(
  example: dict[str, Any],
  *,
  image_size: int,
  pad_value: float = EVAL_PAD_VALUE,
  squash: bool = False,
) -> dict[str, np.ndarray]:
  """One evaluation example.

  Args:
    example: dict(image uint8 [H, W, 3], image_id int, ...).
    image_size: S. pad_value: 0.0 (docs/reference.md §5). squash: see `resize_with_pad`.

  Returns:
    dict(images float32 [S, S, 3], image_id int64 [], orig_size int32 [2] (H, W),
    example_mask bool [] = True).

  Source: docs/reference.md §4-§5.
  """
  image = example["image"]
  return dict(
    images=resize_with_pad(image, image_size, pad_value, squash=squash),
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
class _TrainTransform:
  def __init__(self, source, perm: np.ndarray, seed: int, epoch: int, kwargs: dict[str, Any]):
    kwargs = dict(kwargs)
    self.mosaic_sizes = kwargs.pop("mosaic_sizes", None)
    self.mosaic_probs = kwargs.pop("mosaic_probs", MOSAIC_PROBS)
    self.source, self.perm, self.seed, self.epoch, self.kwargs = source, perm, seed, epoch, kwargs

  def __call__(self, position: int) -> dict[str, np.ndarray]:
    index = int(self.perm[position])
    rng = example_rng(self.seed, self.epoch, index)
    if self.mosaic_sizes is None:
      return preprocess_train_example(self.source[index], rng=rng, **self.kwargs)
    k = sample_mosaic_size(rng, self.mosaic_sizes, self.mosaic_probs)
    if k == 1:
      return preprocess_train_example(self.source[index], rng=rng, **self.kwargs)
    others = rng.integers(0, len(self.source), size=k * k - 1)
    kw = self.kwargs
    mosaic = build_mosaic(
      [self.source[index]] + [self.source[int(j)] for j in others],
      k,
      kw["image_size"],
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
    return preprocess_train_example(mosaic, rng=rng, **dict(kw, hflip=False, random_crop=False))


class _EvalTransform:
  def __init__(
    self, source, image_size: int, pad_value: float, squash: bool, num_images: int | None = None
  ):
    self.source, self.image_size, self.pad_value, self.squash = (
      source,
      image_size,
      pad_value,
      squash,
    )
    self.num_images = len(source) if num_images is None else num_images

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    if index >= self.num_images:
      return padding_eval_example(self.image_size, self.pad_value)
    return preprocess_eval_example(
      self.source[index], image_size=self.image_size, pad_value=self.pad_value, squash=self.squash
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
  *,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  image_size: int,
  num_queries: int,
  max_instances: int,
  num_negatives: int,
  seed: int,
  epoch: int,
  shard: Any = None,
  positions: np.ndarray | None = None,
  **options,
) -> grain.MapDataset:
  """Unbatched training `grain.MapDataset` of one epoch (length N, shuffled).

  Position p holds `preprocess_train_example(source[perm[p]], rng=example_rng(seed, epoch,
  perm[p]))` with perm = `epoch_permutation(N, seed, epoch)`. `options` are passed on to
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
  class_tokens, empty_tokens = _check_tokens(class_tokens, empty_tokens)
  kwargs = dict(
    class_tokens=class_tokens,
    empty_tokens=empty_tokens,
    image_size=image_size,
    num_queries=num_queries,
    max_instances=max_instances,
    num_negatives=num_negatives,
    **options,
  )
  perm = epoch_permutation(len(source), seed, epoch)
  if positions is not None:
    if shard is not None:
      raise ValueError(f"give shard or positions, not both (shard={shard!r})")
    ds = grain.MapDataset.source(np.asarray(positions, np.int64))
  else:
    ds = _apply_shard(grain.MapDataset.range(len(source)), shard)
  return ds.map(_TrainTransform(source, perm, seed, epoch, kwargs))


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
  *,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  image_size: int,
  num_queries: int,
  max_instances: int,
  num_negatives: int,
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
    class_tokens: int32 [C, L] (or [C, P, L]) tokens of the class names (tokenizer.encode).
    empty_tokens: int32 [L] tokens of ''.
    image_size: S. num_queries: Q. max_instances: M. num_negatives: negatives per image.
    batch_size: B. seed, epoch: ints >= 0; the shuffle order and every per-example random
      choice are pure functions of (seed, epoch, source index).
    num_workers: 0 preprocesses in this process (with `num_threads` reader threads);
      > 0 uses grain multiprocessing prefetch (`mp_prefetch`) with that many processes.
    num_threads, prefetch: grain `ReadOptions` for the in-process readers.
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
    ValueError: bad token shapes or a negative `start_batch` (at once); errors of the source
      (DataError) when iterated.

  Source: docs/reference.md §3, §5.
  """
  if start_batch < 0:
    raise ValueError(f"start_batch must be >= 0, got {start_batch}")
  ds = train_map_dataset(
    source,
    class_tokens=class_tokens,
    empty_tokens=empty_tokens,
    image_size=image_size,
    num_queries=num_queries,
    max_instances=max_instances,
    num_negatives=num_negatives,
    seed=seed,
    epoch=epoch,
    shard=shard,
    positions=None
    if batch_rows is None
    else batch_row_positions(len(source), batch_size, batch_rows),
    **options,
  )
  local_batch = batch_size if batch_rows is None else batch_rows[1] - batch_rows[0]
  if start_batch:
    # Every example is a pure function of (seed, epoch, position), so the slice holds exactly
    # the examples the uninterrupted epoch would have read from this batch on.
    ds = ds[start_batch * local_batch :]
  return _to_batches(ds, local_batch, True, num_workers, num_threads, prefetch)


def eval_map_dataset(
  source,
  *,
  image_size: int,
  batch_size: int,
  pad_value: float = EVAL_PAD_VALUE,
  squash: bool = False,
  max_images: int | None = None,
) -> grain.MapDataset:
  """Unbatched evaluation `grain.MapDataset` in source order (the first `max_images` images
  when given), padded with `padding_eval_example` up to a multiple of `batch_size`."""
  n = len(source) if max_images is None else min(len(source), int(max_images))
  n_padded = -(-n // batch_size) * batch_size
  return grain.MapDataset.range(n_padded).map(
    _EvalTransform(source, image_size, pad_value, squash, n)
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
) -> Iterator[dict[str, np.ndarray]]:
  """Iterator over evaluation batches, in source order, every image exactly once.

  Args:
    source: random-access source (`CocoSource`). image_size: S. batch_size: B.
    num_workers, num_threads, prefetch: as `train_dataset`. pad_value: 0.0 (docs/reference.md §5).
    squash: see `resize_with_pad`. max_images: evaluate only the first N images (None: all).
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
  )
  if batch_rows is not None:
    positions = batch_row_positions(len(ds), batch_size, batch_rows)
    ds = grain.MapDataset.source(positions).map(_Select(ds))
    batch_size = batch_rows[1] - batch_rows[0]
  return _to_batches(ds, batch_size, False, num_workers, num_threads, prefetch)

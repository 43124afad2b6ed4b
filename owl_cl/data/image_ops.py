"""Image ops: resize-with-pad geometry and the scenic augmentations (flip, crop, mosaic).

Pure functions of their inputs and an explicit `numpy.random.Generator`. Examples are
`CocoSource.load`-style dicts: image [H, W, 3] (uint8, or float32 in [0, 1] for mosaics), boxes
float [M, 4] xyxy pixels, labels int [M]; optional `negative_labels` (LVIS) and
`excluded_labels` (classes whose boxes an augmentation removed: never used as negatives, since
parts of them may still be visible). Boxes move with their image.

Sources: docs/reference.md §5 (preprocessing); scenic owl_vit `preprocessing/image_ops.py`
(`ResizeWithPad`: aspect-preserving resize, bottom/right pad; `RandomFlipLeftRight`,
`RandomCrop`) and `mosaic.py`; the released code's HF squash-resize (option `squash=True`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from owl_cl.data import owlv2_images

__all__ = [
  "resize_geometry",
  "resize_with_pad",
  "RESIZE_METHODS",
  "preprocess_image",
  "resized_uint8",
  "pad_to_square",
  "uint8_to_unit",
  "scale_boxes",
  "xyxy_to_cxcywh",
  "TRAIN_PAD_VALUE",
  "EVAL_PAD_VALUE",
  "CROP_AREA_RANGE",
  "CROP_ASPECT_RATIO_RANGE",
  "hflip_example",
  "sample_crop_region",
  "crop_example",
  "random_crop_example",
  "augment_example",
  "build_mosaic",
  "sample_mosaic_size",
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
    height: original image height in pixels (> 0).
    width: original image width in pixels (> 0).
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


# How an image becomes the S x S network input: v1's 'resize_with_pad' (resize the long side
# to S, then pad; scenic `ResizeWithPad`) or OWLv2's 'pad_then_resize' (pad to a square, then
# resize with anti-aliasing; `owlv2_images.pad_then_resize`, HF `Owlv2ImageProcessor`).
RESIZE_METHODS = ("resize_with_pad", "pad_then_resize")


def preprocess_image(
  image: np.ndarray,
  size: int,
  pad_value: float,
  *,
  squash: bool = False,
  method: str = "resize_with_pad",
) -> np.ndarray:
  """The S x S network input of an image by `method` (`RESIZE_METHODS`).

  Both methods put the content at the top left at the scale S / max(H, W), so the boxes of
  either are `scale_boxes(..., squash=False)`'s; only the resampling differs (PIL bilinear;
  OWLv2: Gaussian anti-aliasing then linear zoom of the padded square).

  Args:
    image: [H, W, 3] uint8 (0..255) or float in [0, 1].
    size: S in pixels.
    pad_value: value of the padding pixels.
    squash: `resize_with_pad`'s squash (v1 only: OWLv2 pads to a square by definition).
    method: 'resize_with_pad' (v1, default) or 'pad_then_resize' (OWLv2).

  Returns:
    float32 [S, S, 3] in [0, 1].

  Raises:
    ValueError: an unknown method, squash with 'pad_then_resize', image not [H, W, 3].

  Source: docs/reference.md §5 (v1); docs/owlv2.md (OWLv2, HF `Owlv2ImageProcessor`).
  """
  if method == "resize_with_pad":
    return resize_with_pad(image, size, pad_value, squash=squash)
  if method != "pad_then_resize":
    raise ValueError(f"unknown resize method {method!r}; known: {list(RESIZE_METHODS)}")
  if squash:
    raise ValueError("squash resizes without padding: it has no OWLv2 'pad_then_resize' form")
  return owlv2_images.pad_then_resize(image, size, pad_value)


def scale_boxes(
  boxes: np.ndarray, height: int, width: int, size: int, *, squash: bool = False
) -> np.ndarray:
  """Map xyxy pixel boxes of an H x W image into the padded S x S frame.

  Args:
    boxes: float [M, 4] xyxy, pixels of the original image.
    height: original image height in pixels.
    width: original image width in pixels.
    size: S.
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
# Augmentations (scenic owl_vit image_ops / mosaic.py; docs/reference.md §5).
# ------------------------------------------------------------------------------------------
MOSAIC_SIZES = (1, 2, 3)  # docs/reference.md §5 / scenic configs: mosaic_sizes
MOSAIC_PROBS = (0.4, 0.3, 0.3)  # docs/reference.md §5 / scenic configs: mosaic_probs


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


def augment_example(
  example: dict[str, Any],
  rng: np.random.Generator,
  hflip: bool,
  random_crop: bool,
  crop_kwargs: dict[str, Any],
) -> dict[str, Any]:
  """The training augmentations of one example, in scenic's order: a flip with p = 0.5
  (`hflip_example`, one `rng.random()` draw), then a random crop (`random_crop_example` with
  `crop_kwargs`). Returns the example (a new dict when changed). Source: docs/reference.md §5."""
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
    pad_value: as `resize_with_pad`.
    squash: as `resize_with_pad`.
    hflip: per-tile horizontal flip (as `random_crop_example`).
    random_crop: per-tile random crop (as `random_crop_example`).
    crop_kwargs: `random_crop_example` keyword arguments of the per-tile crop.

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
      ex = augment_example(ex, rng, hflip, random_crop, crop_kwargs or {})
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

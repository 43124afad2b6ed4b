"""Box conversions, IoU and generalised IoU (the box terms of the detection loss).

Boxes are float [..., 4], either (cx, cy, w, h) or (x0, y0, x1, y1), in any one unit (the
losses use coordinates normalised to the padded square). Source: scenic
`scenic/model_lib/base_models/box_utils.py`; docs/reference.md §3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

BOX_EPS = 1e-6  # scenic box_utils eps (IoU and GIoU denominators).


def box_cxcywh_to_xyxy(boxes: Array) -> Array:
  """Converts boxes from (cx, cy, w, h) to (x0, y0, x1, y1).

  Args:
    boxes: float [..., 4] (cx, cy, w, h), any units.

  Returns:
    float [..., 4] (x0, y0, x1, y1) in the same units and dtype.

  Source: scenic `box_utils.box_cxcywh_to_xyxy`.
  """
  cx, cy, w, h = jnp.split(jnp.asarray(boxes), 4, axis=-1)
  return jnp.concatenate([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)


def box_xyxy_to_cxcywh(boxes: Array) -> Array:
  """Converts boxes from (x0, y0, x1, y1) to (cx, cy, w, h).

  Args:
    boxes: float [..., 4] (x0, y0, x1, y1), any units.

  Returns:
    float [..., 4] (cx, cy, w, h) in the same units and dtype.

  Source: scenic `box_utils.box_xyxy_to_cxcywh`.
  """
  x0, y0, x1, y1 = jnp.split(jnp.asarray(boxes), 4, axis=-1)
  return jnp.concatenate([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], axis=-1)


def _iou_and_union(a: Array, b: Array, all_pairs: bool, eps: float):
  area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
  area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
  if all_pairs:
    a, b = a[..., :, None, :], b[..., None, :, :]
    area_a, area_b = area_a[..., :, None], area_b[..., None, :]
  lt = jnp.maximum(a[..., :2], b[..., :2])
  rb = jnp.minimum(a[..., 2:], b[..., 2:])
  wh = jnp.clip(rb - lt, 0.0)
  inter = wh[..., 0] * wh[..., 1]
  union = area_a + area_b - inter
  return inter / (union + eps), union


def _check_boxes(a: Array, b: Array, all_pairs: bool) -> None:
  if a.shape[-1] != 4 or b.shape[-1] != 4:
    raise ValueError(f"boxes must end in 4 coordinates, got {a.shape} and {b.shape}")
  if not all_pairs and a.shape[-2] != b.shape[-2]:
    raise ValueError(
      f"all_pairs=False needs as many boxes in both sets, got {a.shape} and {b.shape}"
    )


def box_iou(boxes1: Array, boxes2: Array, *, all_pairs: bool = True, eps: float = BOX_EPS) -> Array:
  """Intersection over union of xyxy boxes.

  Args:
    boxes1: float [..., N, 4] (x0, y0, x1, y1).
    boxes2: float [..., M, 4] (x0, y0, x1, y1); batch dims broadcast against boxes1's.
    all_pairs: True: every pair -> [..., N, M]. False: corresponding boxes (N == M) -> [..., N].
    eps: added to the union (scenic: 1e-6), so degenerate boxes give 0, not NaN.

  Returns:
    float [..., N, M] or [..., N]: intersection / (union + eps).

  Raises:
    ValueError: last axis not 4, or N != M with all_pairs=False.

  Source: scenic `box_utils.box_iou`.
  """
  boxes1, boxes2 = jnp.asarray(boxes1), jnp.asarray(boxes2)
  _check_boxes(boxes1, boxes2, all_pairs)
  return _iou_and_union(boxes1, boxes2, all_pairs, eps)[0]


def generalized_box_iou(
  boxes1: Array, boxes2: Array, *, all_pairs: bool = True, eps: float = BOX_EPS
) -> Array:
  """Generalised IoU (Rezatofighi et al. 2019) of xyxy boxes, in [-1, 1].

  GIoU = IoU - (C - U) / (C + eps) with U the union and C the area of the smallest box
  enclosing both.

  Args:
    boxes1: float [..., N, 4] (x0, y0, x1, y1).
    boxes2: float [..., M, 4] (x0, y0, x1, y1); batch dims broadcast against boxes1's.
    all_pairs: True: every pair -> [..., N, M]. False: corresponding boxes (N == M) -> [..., N].
    eps: scenic's 1e-6 in both denominators.

  Returns:
    float [..., N, M] or [..., N].

  Raises:
    ValueError: last axis not 4, or N != M with all_pairs=False.

  Source: scenic `box_utils.generalized_box_iou`.
  """
  boxes1, boxes2 = jnp.asarray(boxes1), jnp.asarray(boxes2)
  _check_boxes(boxes1, boxes2, all_pairs)
  iou, union = _iou_and_union(boxes1, boxes2, all_pairs, eps)
  a, b = boxes1, boxes2
  if all_pairs:
    a, b = a[..., :, None, :], b[..., None, :, :]
  lt = jnp.minimum(a[..., :2], b[..., :2])
  rb = jnp.maximum(a[..., 2:], b[..., 2:])
  wh = jnp.clip(rb - lt, 0.0)
  enclosing = wh[..., 0] * wh[..., 1]
  return iou - (enclosing - union) / (enclosing + eps)

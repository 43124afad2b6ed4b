"""OWL-ViT v1 detection loss with exact Hungarian matching, and the DER++ replay loss.

Everything here follows docs/reference.md §3, which transcribes scenic's
`scenic/projects/owl_vit/losses.py` (matching cost),
`scenic/projects/owl_vit/matching_base_models.py` (`loss_function`,
`labels_losses_and_metrics`, `boxes_losses_and_metrics` with `normalization='per_example'`),
`scenic/model_lib/matchers/{common,hungarian}.py` (SciPy matching through a host callback),
`scenic/model_lib/base_models/box_utils.py` (box conversions, IoU, GIoU) and
`scenic/model_lib/base_models/model_utils.py` (`focal_sigmoid_cross_entropy`).

Shapes (docs/CONVENTIONS.md): B images, T image tokens, Q query slots (slot 0 is the padding
query ''), M instances per image, K = M + 1 targets once the padding instance is appended.

Targets. `labels [B, M, Q]` is multi-hot; an instance is *real* iff it has at least one
positive label among columns 1..Q-1 (scenic's rule: column 0 only marks padding, a row that
is all zero in columns 1.. is padding whatever its column 0 says). `boxes [B, M, 4]` are
cxcywh normalised to the padded square; the boxes of padding instances are never used.

Matching. `hungarian_matching` returns, per image, `target_index [B, T]` int32: the target
(column of the cost matrix) assigned to each token. Every real target is assigned to exactly
one token (when T >= #real targets); every other token, and every token that the solver
paired with a padding target, gets K - 1, the appended padding instance. Gradients never
flow through the matching.

Normalisation is per example (scenic `normalization='per_example'`): each image's class loss
is divided by max(#positive (instance, label) pairs, 1), its box losses by max(#matched real
boxes, 1); the batch value is then the (optionally weighted) mean over images.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from owl_cl.train import matching as matching_lib
from owl_cl.train import objectness_loss as objectness_lib

Array = jax.Array

#: Values of `matcher` (config `loss.matcher`): 'scipy' (SciPy on the host through
#: `jax.pure_callback`), 'jax' (`owl_cl.train.matching`, compiled into the step) or 'auto'
#: (per platform: `resolve_matcher`).
MATCHERS = ("auto", "scipy", "jax")
#: What 'auto' picks on each platform: 'jax' everywhere. CPU: measured (benchmarks/step.py,
#: README "Train-step benchmark"): the built-in step (tiny model, 16 + 16 images, 64 tokens,
#: 9 targets) takes 0.34 s with the JAX matcher and 0.44 s with SciPy's host callback.
#: GPU/TPU: no device -> host -> device round trip every step (TPUs cannot run host
#: callbacks inside a compiled step at all).
AUTO_MATCHER = {"cpu": "jax", "gpu": "jax", "tpu": "jax"}

# Slots whose stored logit is at or below this are padded query slots (the model writes
# -1e6 there, docs/reference.md §1); used by `distillation_mse` when no query mask is given.
PADDED_LOGIT_THRESHOLD = -1e5
BOX_EPS = 1e-6  # scenic box_utils eps (IoU and GIoU denominators).

__all__ = [
  "PADDED_LOGIT_THRESHOLD",
  "box_cxcywh_to_xyxy",
  "box_xyxy_to_cxcywh",
  "box_iou",
  "generalized_box_iou",
  "sigmoid_focal_loss",
  "focal_matching_cost",
  "append_padding_instance",
  "real_target_mask",
  "matching_cost",
  "hungarian_matching",
  "MATCHERS",
  "resolve_matcher",
  "detection_loss_per_example",
  "detection_loss",
  "NORMALIZATIONS",
  "distillation_mse",
  "der_plus_plus_loss",
  "loss_adaptive_combination",
  "loss_adaptive_total",
]


# ------------------------------------------------------------------------------------------
# Boxes
# ------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------
# Classification terms
# ------------------------------------------------------------------------------------------


def sigmoid_focal_loss(
  logits: Array, targets: Array, *, alpha: float = 0.3, gamma: float = 2.0
) -> Array:
  """Element-wise sigmoid focal loss (Lin et al. 2017), unreduced.

  loss = -alpha_t (1 - p_t)^gamma log p_t with p_t = sigmoid(x) if y = 1 else 1 - sigmoid(x),
  alpha_t = alpha if y = 1 else 1 - alpha. For soft targets it is scenic's generalisation:
  ce = -(y log s(x) + (1-y) log s(-x)), loss = ce (1 - e^-ce)^gamma (alpha y + (1-alpha)(1-y)).

  Args:
    logits: float [...] (any float dtype; computed in float32).
    targets: float [...] in [0, 1], broadcastable to logits.
    alpha: weight of positives (docs/reference.md §3: 0.3).
    gamma: focusing exponent (docs/reference.md §3: 2.0).

  Returns:
    float32 [...] the loss of every element.

  Source: scenic `model_utils.focal_sigmoid_cross_entropy`.
  """
  x = jnp.asarray(logits, jnp.float32)
  y = jnp.asarray(targets, jnp.float32)
  ce = -(y * jax.nn.log_sigmoid(x) + (1.0 - y) * jax.nn.log_sigmoid(-x))
  one_minus_pt = -jnp.expm1(-ce)  # 1 - exp(-ce), accurate when ce is small
  return ce * one_minus_pt**gamma * (alpha * y + (1.0 - alpha) * (1.0 - y))


def focal_matching_cost(logits: Array, *, alpha: float = 0.3, gamma: float = 2.0) -> Array:
  """Element-wise focal classification cost used for matching: pos - neg.

  pos = alpha * sigmoid(-x)^gamma * (-log sigmoid(x)),
  neg = (1 - alpha) * sigmoid(x)^gamma * (-log sigmoid(-x)).

  Args:
    logits: float [...] (computed in float32).
    alpha, gamma: docs/reference.md §3 (0.3, 2.0).

  Returns:
    float32 [...] the cost of declaring each element positive.

  Source: docs/reference.md §3; scenic `owl_vit/losses.sigmoid_cost(focal_loss=True)`.
  """
  x = jnp.asarray(logits, jnp.float32)
  pos = alpha * jax.nn.sigmoid(-x) ** gamma * -jax.nn.log_sigmoid(x)
  neg = (1.0 - alpha) * jax.nn.sigmoid(x) ** gamma * -jax.nn.log_sigmoid(-x)
  return pos - neg


# ------------------------------------------------------------------------------------------
# Targets, cost and matching
# ------------------------------------------------------------------------------------------


def append_padding_instance(labels: Array, boxes: Array) -> tuple[Array, Array]:
  """Appends one padding instance (label one-hot at column 0, box zeros) to every image.

  Matching needs at least one padding target, to which unmatched tokens are assigned.

  Args:
    labels: float [B, M, Q] multi-hot targets.
    boxes: float [B, M, 4] cxcywh targets.

  Returns:
    (labels [B, M+1, Q], boxes [B, M+1, 4]) in the input dtypes.

  Raises:
    ValueError: ranks or leading shapes disagree.

  Source: scenic `matching_base_models.BaseModelWithMatching.loss_function`.
  """
  labels, boxes = jnp.asarray(labels), jnp.asarray(boxes)
  if (
    labels.ndim != 3
    or boxes.ndim != 3
    or boxes.shape[-1] != 4
    or labels.shape[:2] != boxes.shape[:2]
  ):
    raise ValueError(
      f"expected labels [B,M,Q] and boxes [B,M,4], got {labels.shape} and {boxes.shape}"
    )
  b, _, q = labels.shape
  pad_label = jnp.zeros((b, 1, q), labels.dtype).at[:, :, 0].set(1)
  pad_box = jnp.zeros((b, 1, 4), boxes.dtype)
  return (jnp.concatenate([labels, pad_label], axis=1), jnp.concatenate([boxes, pad_box], axis=1))


def real_target_mask(labels: Array) -> Array:
  """bool [..., K]: True for real instances (any positive label among columns 1..Q-1).

  Args:
    labels: float [..., K, Q] multi-hot targets.

  Source: scenic `owl_vit/losses.compute_cost` (`n_labels_per_instance > 0`).
  """
  return jnp.sum(jnp.asarray(labels, jnp.float32)[..., 1:], axis=-1) > 0


def _check_predictions(pred_logits, pred_boxes, labels, boxes) -> None:
  if (
    pred_logits.ndim != 3
    or pred_boxes.ndim != 3
    or pred_boxes.shape[-1] != 4
    or pred_logits.shape[:2] != pred_boxes.shape[:2]
  ):
    raise ValueError(
      f"expected pred_logits [B,T,Q] and pred_boxes [B,T,4], got "
      f"{pred_logits.shape} and {pred_boxes.shape}"
    )
  if (
    labels.ndim != 3
    or boxes.ndim != 3
    or boxes.shape[-1] != 4
    or labels.shape[:2] != boxes.shape[:2]
  ):
    raise ValueError(
      f"expected labels [B,M,Q] and boxes [B,M,4], got {labels.shape} and {boxes.shape}"
    )
  if labels.shape[0] != pred_logits.shape[0] or labels.shape[2] != pred_logits.shape[2]:
    raise ValueError(
      f"batch or query axis of labels {labels.shape} does not match pred_logits {pred_logits.shape}"
    )
  if labels.shape[2] < 2:
    raise ValueError(f"need Q >= 2 query slots (slot 0 is padding), got {labels.shape[2]}")


def matching_cost(
  pred_logits: Array,
  pred_boxes: Array,
  labels: Array,
  boxes: Array,
  *,
  focal_alpha: float = 0.3,
  focal_gamma: float = 2.0,
  class_weight: float = 1.0,
  bbox_weight: float = 1.0,
  giou_weight: float = 1.0,
) -> tuple[Array, Array]:
  """Matching cost between every token and every target (docs/reference.md §3).

  cost[b, t, k] = class_weight * sum_{q>=1} labels[b,k,q] * (pos - neg)(logit[b,t,q])
                + bbox_weight * |pred_box[b,t] - box[b,k]|_1 (cxcywh)
                - giou_weight * GIoU(pred_box[b,t], box[b,k]) (xyxy).
  Columns of padding targets, and any NaN/inf entry, are set to 1.1 * (max over the image's
  finite real entries) + 10 (11.1 when the image has no real target).

  Args:
    pred_logits: float [B, T, Q] (padded query slots may hold -1e6).
    pred_boxes: float [B, T, 4] cxcywh in [0, 1].
    labels: float [B, K, Q] multi-hot targets, padding instance(s) included.
    boxes: float [B, K, 4] cxcywh targets.
    focal_alpha, focal_gamma: focal class cost (0.3, 2.0).
    class_weight, bbox_weight, giou_weight: cost weights (scenic: the loss weights, all 1).

  Returns:
    (cost float32 [B, T, K], target_mask bool [B, K] True for real targets).

  Raises:
    ValueError: inconsistent shapes.

  Source: scenic `owl_vit/losses.compute_cost`. Difference: the padding value uses the max
  over *finite* real entries (scenic's max is NaN when an entry is NaN).
  """
  pred_logits, pred_boxes = jnp.asarray(pred_logits), jnp.asarray(pred_boxes)
  labels, boxes = jnp.asarray(labels), jnp.asarray(boxes)
  _check_predictions(pred_logits, pred_boxes, labels, boxes)
  out_boxes = pred_boxes.astype(jnp.float32)
  tgt_boxes = boxes.astype(jnp.float32)
  tgt_labels = labels.astype(jnp.float32)
  mask = real_target_mask(tgt_labels)  # [B, K]

  per_query = focal_matching_cost(pred_logits[..., 1:], alpha=focal_alpha, gamma=focal_gamma)
  cost_class = jnp.einsum(
    "btq,bkq->btk", per_query, tgt_labels[..., 1:], precision=jax.lax.Precision.HIGHEST
  )
  cost_bbox = jnp.sum(jnp.abs(out_boxes[:, :, None, :] - tgt_boxes[:, None, :, :]), axis=-1)
  cost_giou = -generalized_box_iou(
    box_cxcywh_to_xyxy(out_boxes), box_cxcywh_to_xyxy(tgt_boxes), all_pairs=True
  )
  cost = class_weight * cost_class + bbox_weight * cost_bbox + giou_weight * cost_giou

  valid = mask[:, None, :] & jnp.isfinite(cost)
  any_valid = jnp.any(valid, axis=(1, 2))
  max_cost = jnp.max(jnp.where(valid, cost, -jnp.inf), axis=(1, 2))
  pad_value = jnp.where(any_valid, max_cost, 1.0) * 1.1 + 10.0  # [B]
  cost = jnp.where(valid, cost, pad_value[:, None, None])
  return cost, mask


def _match_numpy(cost: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """Host side of `hungarian_matching`: cost [..., T, K], mask [..., K] -> [..., T] int32."""
  cost = np.asarray(cost, np.float64)
  mask = np.asarray(mask, bool)
  *batch, t, k = cost.shape
  cost = cost.reshape(-1, t, k)
  mask = np.broadcast_to(mask, (*batch, k)).reshape(-1, k)
  out = np.full((cost.shape[0], t), k - 1, np.int32)
  for i in range(cost.shape[0]):
    cols = np.flatnonzero(mask[i])
    if cols.size == 0 or t == 0:
      continue
    sub = cost[i][:, cols]
    # Guard (the JAX side already replaces non-finite values): SciPy rejects NaN/inf.
    if not np.all(np.isfinite(sub)):
      finite = sub[np.isfinite(sub)]
      sub = np.where(np.isfinite(sub), sub, (finite.max() if finite.size else 1.0) * 1.1 + 10)
    rows, picked = scipy.optimize.linear_sum_assignment(sub)
    out[i, rows] = cols[picked]
  return out.reshape(*batch, t)


def resolve_matcher(matcher: str, platform: str | None = None) -> str:
  """'scipy' or 'jax' for a `matcher` setting ('auto' resolved by `AUTO_MATCHER`).

  Args:
    matcher: one of `MATCHERS`.
    platform: 'cpu' | 'gpu' | 'tpu'; None: `jax.default_backend()`.

  Raises:
    ValueError: unknown matcher (the message lists the known ones).
  """
  if matcher not in MATCHERS:
    raise ValueError(f"matcher={matcher!r} is unknown; known: {list(MATCHERS)}")
  if matcher != "auto":
    return matcher
  return AUTO_MATCHER.get(platform or jax.default_backend(), "jax")


def hungarian_matching(cost: Array, target_mask: Array, matcher: str = "auto") -> Array:
  """Exact minimum-cost assignment of tokens to real targets.

  matcher='scipy': solves `scipy.optimize.linear_sum_assignment` per image on the columns
  of real targets only (equivalent to scenic, whose padding columns all share one constant
  cost), through `jax.pure_callback` with a static output shape, so it runs under `jit`,
  `vmap` (vmap_method='broadcast_all'), `grad` (no gradient flows: the cost is
  stop_gradient'ed) and with a batch sharded over several devices (XLA gathers the operands
  to one device for the callback). matcher='jax': the same optimum computed on the device by
  `owl_cl.train.matching.match_targets` (a shortest-augmenting-path Hungarian algorithm, no
  host callback). Both are exact; under ties (equal total costs) they may pick different
  assignments. 'auto': `resolve_matcher`. NaN/inf costs must already have been replaced
  (`matching_cost` does).

  Args:
    cost: float [..., T, K] (any float dtype; solved in float64). The last column K-1 must
      be a padding target (see `append_padding_instance`).
    target_mask: bool [..., K]: True for real targets. Columns that are False are never
      assigned.

  Returns:
    target_index int32 [..., T]: for each token the column of the real target assigned to
    it, or K-1 (the appended padding instance) for tokens matched to no real target. With
    T >= #real targets every real target appears exactly once.

    matcher: 'auto' | 'scipy' | 'jax' (`MATCHERS`).

  Raises:
    ValueError: shapes of cost and target_mask disagree; unknown matcher.

  Source: docs/reference.md §3 ("exact Hungarian matching; unmatched tokens map to the padding
  instance"); scenic `matchers/hungarian.py`, `matchers/common.py` (`cpu_matcher`, `slicer`),
  `matching_base_models.loss_function` (`pad_matches`), `matchers/hungarian_tpu.py` (the
  role of the 'jax' matcher).
  """
  matcher = resolve_matcher(matcher)
  cost = jnp.asarray(cost)
  target_mask = jnp.asarray(target_mask)
  if cost.ndim < 2 or target_mask.shape != cost.shape[:-2] + cost.shape[-1:]:
    raise ValueError(
      f"expected cost [..., T, K] and target_mask [..., K], got {cost.shape} "
      f"and {target_mask.shape}"
    )
  cost = jax.lax.stop_gradient(cost.astype(jnp.float32))
  target_mask = jax.lax.stop_gradient(target_mask.astype(jnp.bool_))
  if matcher == "jax":
    return matching_lib.match_targets(cost, target_mask)
  out_shape = jax.ShapeDtypeStruct(cost.shape[:-1], jnp.int32)
  return jax.pure_callback(_match_numpy, out_shape, cost, target_mask, vmap_method="broadcast_all")


# ------------------------------------------------------------------------------------------
# Detection loss
# ------------------------------------------------------------------------------------------


def _gather_targets(x: Array, index: Array) -> Array:
  """x [B, K, ...], index [B, T] -> [B, T, ...]."""
  idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


def detection_loss_per_example(
  pred_logits: Array,
  pred_boxes: Array,
  labels: Array,
  boxes: Array,
  target_index: Array,
  *,
  focal_alpha: float = 0.3,
  focal_gamma: float = 2.0,
) -> dict[str, Array]:
  """Per-image normalised loss terms for a given matching.

  Args:
    pred_logits: float [B, T, Q].
    pred_boxes: float [B, T, 4] cxcywh.
    labels: float [B, K, Q] targets, padding instance(s) included (`append_padding_instance`).
    boxes: float [B, K, 4] cxcywh.
    target_index: int [B, T] target of each token (`hungarian_matching`).
    focal_alpha, focal_gamma: focal loss (0.3, 2.0).

  Returns:
    dict of float32 [B]:
      loss_class: sum over all T tokens and columns 1..Q-1 of the focal loss against the
        matched target's labels (zero for tokens matched to padding) / max(#positives, 1),
        #positives = sum of those targets' labels.
      loss_bbox: sum over tokens matched to real targets of |xyxy_pred - xyxy_tgt|_1
        / max(#boxes, 1).
      loss_giou: sum of 1 - GIoU over the same tokens / max(#boxes, 1).
      num_positives, num_boxes: the unclamped normalisers.
      sum_class, sum_bbox, sum_giou: the three sums before normalisation.

  Raises:
    ValueError: inconsistent shapes.

  Source: docs/reference.md §3; scenic `matching_base_models` (`_compute_per_example_class_loss`,
  `boxes_losses_and_metrics`, normalization='per_example').
  """
  pred_logits, pred_boxes = jnp.asarray(pred_logits), jnp.asarray(pred_boxes)
  labels, boxes = jnp.asarray(labels), jnp.asarray(boxes)
  _check_predictions(pred_logits, pred_boxes, labels, boxes)
  if target_index.shape != pred_logits.shape[:2]:
    raise ValueError(
      f"target_index must be [B,T] = {pred_logits.shape[:2]}, got {target_index.shape}"
    )
  target_index = jax.lax.stop_gradient(target_index)
  tgt_labels = _gather_targets(labels.astype(jnp.float32), target_index)[..., 1:]  # [B,T,Q-1]
  focal = sigmoid_focal_loss(pred_logits[..., 1:], tgt_labels, alpha=focal_alpha, gamma=focal_gamma)
  num_pos = jnp.sum(tgt_labels, axis=(1, 2))
  loss_class = jnp.sum(focal, axis=(1, 2)) / jnp.maximum(num_pos, 1.0)

  matched = _gather_targets(real_target_mask(labels), target_index)  # [B, T]
  src = box_cxcywh_to_xyxy(pred_boxes.astype(jnp.float32))
  tgt = box_cxcywh_to_xyxy(_gather_targets(boxes.astype(jnp.float32), target_index))
  l1 = jnp.where(matched, jnp.sum(jnp.abs(src - tgt), axis=-1), 0.0)
  giou = jnp.where(matched, 1.0 - generalized_box_iou(src, tgt, all_pairs=False), 0.0)
  num_boxes = jnp.sum(matched.astype(jnp.float32), axis=1)
  denom = jnp.maximum(num_boxes, 1.0)
  return dict(
    loss_class=loss_class,
    loss_bbox=jnp.sum(l1, axis=1) / denom,
    loss_giou=jnp.sum(giou, axis=1) / denom,
    num_positives=num_pos,
    num_boxes=num_boxes,
    # The unnormalised sums, for normalization='per_batch' (`detection_loss`).
    sum_class=jnp.sum(focal, axis=(1, 2)),
    sum_bbox=jnp.sum(l1, axis=1),
    sum_giou=jnp.sum(giou, axis=1),
  )


def _weighted_mean(values: Array, weights: Array | None) -> Array:
  """Mean over the batch; with weights [B]: sum(w * v) / sum(w), 0 when sum(w) == 0."""
  if weights is None:
    return jnp.mean(values) if values.shape[0] else jnp.zeros((), values.dtype)
  w = jnp.asarray(weights, jnp.float32)
  if w.shape != values.shape[:1]:
    raise ValueError(f"example weights must be [B] = {values.shape[:1]}, got {w.shape}")
  w = w.reshape(w.shape + (1,) * (values.ndim - 1))
  total = jnp.sum(jnp.where(w > 0, w * values, 0.0), axis=0)
  return total / jnp.maximum(jnp.sum(w, axis=0), 1e-12)


# `detection_loss(normalization=...)`: per image (scenic, paper) | per batch (released code).
NORMALIZATIONS = ("per_image", "per_batch")


def detection_loss(
  pred_logits: Array,
  pred_boxes: Array,
  labels: Array,
  boxes: Array,
  *,
  focal_alpha: float = 0.3,
  focal_gamma: float = 2.0,
  class_weight: float = 1.0,
  bbox_weight: float = 1.0,
  giou_weight: float = 1.0,
  example_mask: Array | None = None,
  normalization: str = "per_image",
  matcher: str = "auto",
  objectness_logits: Array | None = None,
  objectness_weight: float = 0.0,
) -> dict[str, Array]:
  """OWL-ViT detection loss: Hungarian matching, focal class loss, L1 + GIoU box losses;
  OWLv2 adds the objectness term (``owl_cl.train.objectness_loss``, docs/owlv2.md).

  Appends one padding instance per image, builds `matching_cost`, matches with
  `hungarian_matching`, computes `detection_loss_per_example` and averages over images.
  The keyword arguments are those of the `loss` config block (configs/base.py), so
  `detection_loss(..., **config.loss)` works.

  Args:
    pred_logits: float [B, T, Q] (padded query slots -1e6; computed in float32).
    pred_boxes: float [B, T, 4] cxcywh in [0, 1].
    labels: float [B, M, Q] multi-hot; an instance with no positive among columns 1.. is
      padding (`labels[b, m, 0] = 1`).
    boxes: float [B, M, 4] cxcywh normalised to the padded square.
    focal_alpha, focal_gamma: focal loss and cost (docs/reference.md §3: 0.3, 2.0).
    class_weight, bbox_weight, giou_weight: weights of the three terms, used both in the
      matching cost and in the total (scenic; docs/reference.md §3: all 1).
    example_mask: optional bool/float [B]. Images with weight 0 contribute nothing; the batch
      values become sum(w * v) / sum(w) (0 if all are masked). scenic's `batch_mask` instead
      divides by B; the two agree when no image is masked.
    normalization: 'per_image' (scenic normalization='per_example', docs/reference.md §3: each
    image's
      sums divided by its own #positives / #boxes, then the weighted mean over images) or
      'per_batch' (as in the released code: the batch's focal, L1 and GIoU sums over its
      (unmasked, weighted) images divided by the batch's total #positives / #boxes, each
      clamped to >= 1; computed over the whole global batch, where the released code
      normalises per device). `per_example` is per image in both.
    matcher: Hungarian solver, 'auto' | 'scipy' | 'jax' (`hungarian_matching`).
    objectness_logits: OWLv2's float [B, T] objectness logits, or None (v1: no term).
    objectness_weight: weight of the objectness term (config ``loss.objectness_weight``);
      with ``objectness_logits=None`` or weight 0 the result is the v1 loss exactly. The term
      is added to ``per_example`` and ``loss``; it does not enter the matching cost.

  Returns:
    dict of float32:
      loss []: weighted mean over images of per_example ('per_image'), or the weighted
        per-batch-normalised terms ('per_batch').
      per_example [B]: class_weight * cls + bbox_weight * l1 + giou_weight * giou of each
        image, each term normalised within the image (independent of the rest of the batch
        and of example_mask; the replay buffer ranks images by it).
      loss_class, loss_bbox, loss_giou []: the unweighted terms, averaged like `loss`.
      loss_objectness []: the unweighted objectness term averaged like `loss` (only with
        objectness logits and a weight > 0).

  Raises:
    ValueError: inconsistent shapes, or an unknown `normalization`.

  Source: docs/reference.md §3; scenic `owl_vit/losses.py`, `owl_vit/matching_base_models.py`
  (normalization='per_example'); 'per_batch' as in the released code.
  """
  if normalization not in NORMALIZATIONS:
    raise ValueError(
      f"loss.normalization={normalization!r} is unknown; known: {list(NORMALIZATIONS)}"
    )
  pred_logits, pred_boxes = jnp.asarray(pred_logits), jnp.asarray(pred_boxes)
  labels, boxes = jnp.asarray(labels), jnp.asarray(boxes)
  _check_predictions(pred_logits, pred_boxes, labels, boxes)
  labels_k, boxes_k = append_padding_instance(labels, boxes)
  cost, mask = matching_cost(
    jax.lax.stop_gradient(pred_logits),
    jax.lax.stop_gradient(pred_boxes),
    labels_k,
    boxes_k,
    focal_alpha=focal_alpha,
    focal_gamma=focal_gamma,
    class_weight=class_weight,
    bbox_weight=bbox_weight,
    giou_weight=giou_weight,
  )
  target_index = hungarian_matching(cost, mask, matcher)
  terms = detection_loss_per_example(
    pred_logits,
    pred_boxes,
    labels_k,
    boxes_k,
    target_index,
    focal_alpha=focal_alpha,
    focal_gamma=focal_gamma,
  )
  per_example = (
    class_weight * terms["loss_class"]
    + bbox_weight * terms["loss_bbox"]
    + giou_weight * terms["loss_giou"]
  )
  obj = None
  if objectness_logits is not None and objectness_weight:
    matched = _gather_targets(real_target_mask(labels_k), target_index)  # [B, T]
    obj = objectness_lib.objectness_loss_per_example(
      objectness_logits, matched, focal_alpha=focal_alpha, focal_gamma=focal_gamma
    )
    per_example = per_example + objectness_weight * obj["loss_objectness"]
  if normalization == "per_batch":
    w = jnp.ones(per_example.shape, jnp.float32) if example_mask is None else example_mask
    w = jnp.asarray(w, jnp.float32)
    if w.shape != per_example.shape:
      raise ValueError(f"example weights must be [B] = {per_example.shape}, got {w.shape}")
    w = jnp.where(w > 0, w, 0.0)

    def total(x):
      return jnp.sum(w * x)

    loss_class = total(terms["sum_class"]) / jnp.maximum(total(terms["num_positives"]), 1.0)
    num_boxes = jnp.maximum(total(terms["num_boxes"]), 1.0)
    loss_bbox = total(terms["sum_bbox"]) / num_boxes
    loss_giou = total(terms["sum_giou"]) / num_boxes
    out = dict(
      loss=class_weight * loss_class + bbox_weight * loss_bbox + giou_weight * loss_giou,
      per_example=per_example,
      loss_class=loss_class,
      loss_bbox=loss_bbox,
      loss_giou=loss_giou,
    )
    if obj is not None:
      out["loss_objectness"] = total(obj["sum_objectness"]) / num_boxes
      out["loss"] = out["loss"] + objectness_weight * out["loss_objectness"]
    return out
  out = dict(
    loss=_weighted_mean(per_example, example_mask),
    per_example=per_example,
    loss_class=_weighted_mean(terms["loss_class"], example_mask),
    loss_bbox=_weighted_mean(terms["loss_bbox"], example_mask),
    loss_giou=_weighted_mean(terms["loss_giou"], example_mask),
  )
  if obj is not None:
    out["loss_objectness"] = _weighted_mean(obj["loss_objectness"], example_mask)
  return out


# ------------------------------------------------------------------------------------------
# DER++
# ------------------------------------------------------------------------------------------


def distillation_mse(
  logits: Array,
  stored_logits: Array,
  *,
  query_mask: Array | None = None,
  example_mask: Array | None = None,
) -> Array:
  """DER++ logit distillation: mean squared error over images, tokens and query slots.

  Each image's squared error is averaged over all T * Q slots (padded slots count in the
  denominator and contribute 0, as the released code's MSE over [-1e6 ; -1e6] slots). Padded
  slots are those with query_mask False or, when query_mask is None, those whose stored logit
  is <= PADDED_LOGIT_THRESHOLD (-1e5); they are zeroed explicitly, so a -1e6 rounded
  differently by bf16 and float32 still contributes 0.

  Args:
    logits: float [B_r, T, Q] current model logits on the replayed images.
    stored_logits: float [B_r, T, Q] the pre-trained model's logits (frozen: no gradient).
    query_mask: optional bool [B_r, Q] True for real query slots.
    example_mask: optional bool/float [B_r]; images with weight 0 contribute nothing, the
      result is sum(w * mse_b) / sum(w) (0 when all are masked).

  Returns:
    float32 [] the mean squared error.

  Raises:
    ValueError: shapes disagree.

  Source: docs/reference.md §3 (DER++, paper §3, released code).
  """
  logits, stored_logits = jnp.asarray(logits), jnp.asarray(stored_logits)
  if logits.ndim != 3 or logits.shape != stored_logits.shape:
    raise ValueError(
      f"expected logits and stored_logits [B,T,Q] of one shape, got "
      f"{logits.shape} and {stored_logits.shape}"
    )
  stored = jax.lax.stop_gradient(stored_logits.astype(jnp.float32))
  if query_mask is None:
    slot_mask = stored > PADDED_LOGIT_THRESHOLD
  else:
    query_mask = jnp.asarray(query_mask)
    if query_mask.shape != (logits.shape[0], logits.shape[2]):
      raise ValueError(
        f"query_mask must be [B,Q] = {(logits.shape[0], logits.shape[2])}, got {query_mask.shape}"
      )
    slot_mask = jnp.broadcast_to(query_mask.astype(bool)[:, None, :], logits.shape)
  sq = jnp.where(slot_mask, jnp.square(logits.astype(jnp.float32) - stored), 0.0)
  return _weighted_mean(jnp.mean(sq, axis=(1, 2)), example_mask)


def der_plus_plus_loss(
  new_outputs: Mapping[str, Array],
  new_targets: Mapping[str, Array],
  replay_outputs: Mapping[str, Array] | None = None,
  replay_targets: Mapping[str, Array] | None = None,
  stored_logits: Array | None = None,
  *,
  replay_mask: Array | None = None,
  replay_query_mask: Array | None = None,
  new_mask: Array | None = None,
  alpha: float = 2.0,
  beta: float = 1.0,
  **loss_kwargs: Any,
) -> dict[str, Array]:
  """DER++ objective: L_det(new) + alpha * MSE(z_replay, z_stored) + beta * L_det(replay).

  The two halves are separate `detection_loss` calls, so their normalisers (per image, then
  the mean over each half's images) are computed separately. With `replay_outputs=None` (no
  replay this step) the result is L_det(new) and the replay terms are 0.

  Args:
    new_outputs: {'pred_logits' [B,T,Q], 'pred_boxes' [B,T,4]} of the new images; OWLv2
      adds 'objectness_logits' [B,T] (its term in both halves with
      ``loss_kwargs['objectness_weight']``, docs/owlv2.md).
    new_targets: {'labels' [B,M,Q], 'boxes' [B,M,4]}.
    replay_outputs: {'pred_logits' [B_r,T,Q], 'pred_boxes' [B_r,T,4]} of the replayed images
      (the same forward pass as the new ones), or None.
    replay_targets: {'labels' [B_r,M_r,Q_r], 'boxes' [B_r,M_r,4]} stored targets.
    stored_logits: float [B_r,T,Q_r] the pre-trained model's logits (no gradient).
    replay_mask: optional bool/float [B_r]: replayed images with weight 0 (e.g. when only r of
      the B_r slots hold a sample) contribute to neither replay term; both replay terms are
      averaged over the remaining images (0 when none remain).
    replay_query_mask: optional bool [B_r, Q_r] for `distillation_mse`.
    new_mask: optional bool/float [B] example mask of the new half.
    alpha: distillation weight (docs/reference.md §3: 2.0).
    beta: replay detection-loss weight (docs/reference.md §3: 1.0).
    **loss_kwargs: focal_alpha, focal_gamma, class_weight, bbox_weight, giou_weight, matcher
      for `detection_loss`.

  Returns:
    dict of float32: loss [], new_loss [], replay_loss [] (L_det of the replay half),
    distill_loss [] (the MSE, before alpha), loss_class / loss_bbox / loss_giou [] (new half),
    replay_loss_class / replay_loss_bbox / replay_loss_giou [], per_example_new [B],
    per_example_replay [B_r].

  Raises:
    ValueError: inconsistent shapes, or replay_outputs given without replay_targets or
      stored_logits.

  Source: docs/reference.md §3 (DER++, paper §3; Buzzega et al. 2020).
  """
  new = detection_loss(
    new_outputs["pred_logits"],
    new_outputs["pred_boxes"],
    new_targets["labels"],
    new_targets["boxes"],
    example_mask=new_mask,
    objectness_logits=new_outputs.get("objectness_logits"),
    **loss_kwargs,
  )
  out = dict(
    new_loss=new["loss"],
    loss_class=new["loss_class"],
    loss_bbox=new["loss_bbox"],
    loss_giou=new["loss_giou"],
    per_example_new=new["per_example"],
  )
  if "loss_objectness" in new:
    out["loss_objectness"] = new["loss_objectness"]
  if replay_outputs is None:
    zero = jnp.zeros((), jnp.float32)
    out.update(
      loss=new["loss"],
      replay_loss=zero,
      distill_loss=zero,
      replay_loss_class=zero,
      replay_loss_bbox=zero,
      replay_loss_giou=zero,
      per_example_replay=jnp.zeros((0,), jnp.float32),
    )
    return out
  if replay_targets is None or stored_logits is None:
    raise ValueError("replay_outputs needs replay_targets and stored_logits")
  replay = detection_loss(
    replay_outputs["pred_logits"],
    replay_outputs["pred_boxes"],
    replay_targets["labels"],
    replay_targets["boxes"],
    example_mask=replay_mask,
    objectness_logits=replay_outputs.get("objectness_logits"),
    **loss_kwargs,
  )
  distill = distillation_mse(
    replay_outputs["pred_logits"],
    stored_logits,
    query_mask=replay_query_mask,
    example_mask=replay_mask,
  )
  out.update(
    loss=new["loss"] + alpha * distill + beta * replay["loss"],
    replay_loss=replay["loss"],
    distill_loss=distill,
    replay_loss_class=replay["loss_class"],
    replay_loss_bbox=replay["loss_bbox"],
    replay_loss_giou=replay["loss_giou"],
    per_example_replay=replay["per_example"],
  )
  return out


# ------------------------------------------------------------------------------------------
# Loss adaptivity (paper eqs. 5-6)
# ------------------------------------------------------------------------------------------


def loss_adaptive_combination(
  new_loss: Array, replay_loss: Array, num_replayed: Array, batch_size: int
) -> Array:
  """Eq. 6 given r: L_T = L_B + (r / |B|) * L_R.

  Args:
    new_loss: float [] L_B, the mean loss of the new batch.
    replay_loss: float [] L_R, the mean loss of the replay batch (for DER++:
      alpha * distillation + beta * replay detection loss, averaged over the replays used).
    num_replayed: int or float [] r, the number of replays (new samples above the threshold).
    batch_size: |B| (static int > 0), the number of new samples.
  Returns:
    float32 [] L_T.
  Raises:
    ValueError: batch_size < 1.
  Source: paper §4 "Loss Adaptivity" eq. 6; docs/reference.md §9.
  """
  if int(batch_size) < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  weight = jnp.asarray(num_replayed, jnp.float32) / float(batch_size)
  return jnp.asarray(new_loss, jnp.float32) + weight * jnp.asarray(replay_loss, jnp.float32)


def loss_adaptive_total(
  new_losses: Array, replay_loss: Array, threshold: float
) -> tuple[Array, Array]:
  """Loss adaptivity: r = |{s in B : loss(s) > l}|, L_T = L_B + (r / |B|) * L_R.

  r counts the new samples whose loss is strictly above the threshold l (a loss equal to l
  does not count, eq. 5); L_B is the mean of `new_losses`. No gradient flows through r
  (a count); gradients flow into L_B and L_R.

  Args:
    new_losses: float [B] per-example loss of each new sample (e.g. `detection_loss(...)
      ['per_example']`), B >= 1.
    replay_loss: float [] L_R, the mean loss over the replayed samples.
    threshold: float [] l (static or traced), in the units of `new_losses`.
  Returns:
    total: float32 [] L_T (eq. 6).
    r: int32 [] number of new samples with loss > threshold, in [0, B].
  Raises:
    ValueError: new_losses is not a non-empty vector.
  Source: paper §4 "Loss Adaptivity" eqs. 5-6; docs/reference.md §9.
  """
  new_losses = jnp.asarray(new_losses, jnp.float32)
  if new_losses.ndim != 1 or new_losses.shape[0] < 1:
    raise ValueError(f"new_losses must be a non-empty vector [B], got shape {new_losses.shape}")
  r = jnp.sum(jax.lax.stop_gradient(new_losses) > threshold, dtype=jnp.int32)
  total = loss_adaptive_combination(jnp.mean(new_losses), replay_loss, r, new_losses.shape[0])
  return total, r

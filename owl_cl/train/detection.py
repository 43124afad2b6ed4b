"""The OWL-ViT detection loss: focal class loss and L1 + GIoU box losses after matching.

Normalisation is per example (scenic `normalization='per_example'`): each image's class loss
is divided by max(#positive (instance, label) pairs, 1), its box losses by max(#matched real
boxes, 1); the batch value is then the (optionally weighted) mean over images.

Source: docs/reference.md §3; scenic `scenic/projects/owl_vit/matching_base_models.py`
(`loss_function`, `labels_losses_and_metrics`, `boxes_losses_and_metrics`) and
`scenic/model_lib/base_models/model_utils.py` (`focal_sigmoid_cross_entropy`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from owl_cl.train.boxes import box_cxcywh_to_xyxy
from owl_cl.train.boxes import generalized_box_iou
from owl_cl.train.matcher import append_padding_instance
from owl_cl.train.matcher import check_predictions
from owl_cl.train.matcher import hungarian_matching
from owl_cl.train.matcher import matching_cost
from owl_cl.train.matcher import real_target_mask
from owl_cl.train.objectness_loss import objectness_loss_per_example

Array = jax.Array


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
    focal_alpha: focal loss alpha (0.3).
    focal_gamma: focal loss gamma (2.0).

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
  check_predictions(pred_logits, pred_boxes, labels, boxes)
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


def weighted_mean(values: Array, weights: Array | None) -> Array:
  """float32 [...]: the mean of values [B, ...] over the batch; with weights float [B]:
  sum(w * v) / sum(w) over the images with w > 0, 0 when sum(w) == 0.

  Raises:
    ValueError: weights is not [B].
  """
  if weights is None:
    return jnp.mean(values) if values.shape[0] else jnp.zeros((), values.dtype)
  w = jnp.asarray(weights, jnp.float32)
  if w.shape != values.shape[:1]:
    raise ValueError(f"example weights must be [B] = {values.shape[:1]}, got {w.shape}")
  w = w.reshape(w.shape + (1,) * (values.ndim - 1))
  total = jnp.sum(jnp.where(w > 0, w * values, 0.0), axis=0)
  return total / jnp.maximum(jnp.sum(w, axis=0), 1e-12)


def _match(pred_logits, pred_boxes, labels, boxes, matcher, **cost_options):
  """The targets with the padding instance appended, labels [B, K, Q] and boxes [B, K, 4],
  and int32 [B, T] the target of each token (`matcher.hungarian_matching` of the
  `matcher.matching_cost` with `cost_options`; no gradient flows through it)."""
  labels_k, boxes_k = append_padding_instance(labels, boxes)
  cost, mask = matching_cost(
    jax.lax.stop_gradient(pred_logits),
    jax.lax.stop_gradient(pred_boxes),
    labels_k,
    boxes_k,
    **cost_options,
  )
  return labels_k, boxes_k, hungarian_matching(cost, mask, matcher)


def _per_image_loss(terms, per_example, example_mask) -> dict[str, Array]:
  """`detection_loss`'s 'per_image' normalisation (scenic): the weighted means over images
  of the per-image normalised terms."""
  return dict(
    loss=weighted_mean(per_example, example_mask),
    per_example=per_example,
    loss_class=weighted_mean(terms["loss_class"], example_mask),
    loss_bbox=weighted_mean(terms["loss_bbox"], example_mask),
    loss_giou=weighted_mean(terms["loss_giou"], example_mask),
  )


def _per_batch_loss(terms, per_example, example_mask, weights) -> dict[str, Array]:
  """`detection_loss`'s 'per_batch' normalisation (the released code): the batch's sums over
  its (unmasked, weighted) images divided by its total #positives / #boxes, each >= 1.
  `weights`: (class_weight, bbox_weight, giou_weight)."""
  class_weight, bbox_weight, giou_weight = weights
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
  return dict(
    loss=class_weight * loss_class + bbox_weight * loss_bbox + giou_weight * loss_giou,
    per_example=per_example,
    loss_class=loss_class,
    loss_bbox=loss_bbox,
    loss_giou=loss_giou,
  )


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
  """OWL-ViT detection loss: matching, focal class, L1 + GIoU box (+ OWLv2's objectness).

  Appends one padding instance per image, matches (`matching_cost`, `hungarian_matching`),
  averages `detection_loss_per_example` over images. The keyword arguments are the `loss`
  config block's (configs/base.py): `detection_loss(..., **config.loss)` works.

  Args:
    pred_logits: float [B, T, Q] (padded query slots -1e6; computed in float32).
    pred_boxes: float [B, T, 4] cxcywh in [0, 1].
    labels: float [B, M, Q] multi-hot; an instance with no positive among columns 1.. is
      padding (`labels[b, m, 0] = 1`).
    boxes: float [B, M, 4] cxcywh normalised to the padded square.
    focal_alpha: focal loss and cost alpha (docs/reference.md §3: 0.3).
    focal_gamma: focal loss and cost gamma (docs/reference.md §3: 2.0).
    class_weight: weight of the focal term, used both in the matching cost and in the total
      (scenic; docs/reference.md §3: 1).
    bbox_weight: weight of the L1 term, likewise (1).
    giou_weight: weight of the GIoU term, likewise (1).
    example_mask: optional bool/float [B]. Images with weight 0 contribute nothing; the batch
      values become sum(w * v) / sum(w) (0 if all are masked). scenic's `batch_mask` instead
      divides by B; the two agree when no image is masked.
    normalization: 'per_image' (scenic's 'per_example', docs/reference.md §3: each image's
      sums over its own #positives / #boxes, then the weighted mean over images) or
      'per_batch' (the released code: the focal, L1 and GIoU sums over the unmasked, weighted
      images over the batch's #positives / #boxes, each clamped to >= 1, on the whole global
      batch where the released code normalises per device). `per_example` is per image.
    matcher: Hungarian solver, 'auto' | 'scipy' | 'jax' (`hungarian_matching`).
    objectness_logits: OWLv2's float [B, T] objectness logits; None: the v1 loss exactly
      (`_add_objectness`).
    objectness_weight: the objectness term's weight (``loss.objectness_weight``); 0: v1's.

  Returns:
    dict of float32:
      loss []: weighted mean over images of per_example ('per_image'), or the weighted
        per-batch-normalised terms ('per_batch').
      per_example [B]: class_weight * cls + bbox_weight * l1 + giou_weight * giou of each
        image, each term normalised within the image (independent of the rest of the batch
        and of example_mask; the replay buffer ranks images by it).
      loss_class, loss_bbox, loss_giou []: the unweighted terms, averaged like `loss`.
      loss_objectness []: the unweighted objectness term (only with the term on).

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
  check_predictions(pred_logits, pred_boxes, labels, boxes)
  weights = (class_weight, bbox_weight, giou_weight)
  terms, obj = _per_example_terms(
    pred_logits,
    pred_boxes,
    labels,
    boxes,
    matcher,
    (focal_alpha, focal_gamma),
    weights,
    objectness_logits if objectness_weight else None,
  )
  return _normalised(terms, weights, example_mask, normalization, obj, objectness_weight)


def _per_example_terms(
  pred_logits, pred_boxes, labels, boxes, matcher, focal, weights, objectness_logits
):
  """`detection_loss`'s per-image terms: the Hungarian matching (`_match`, its cost weighted
  by `weights` = (class, bbox, giou)), then `detection_loss_per_example` with `focal` =
  (alpha, gamma), and OWLv2's objectness term where `objectness_logits` float [B, T] is given
  (a token's target: whether it is matched to a real instance).

  Returns:
    (`detection_loss_per_example`'s dict, `objectness_loss_per_example`'s dict or None).
  """
  focal_alpha, focal_gamma = focal
  class_weight, bbox_weight, giou_weight = weights
  labels_k, boxes_k, target_index = _match(
    pred_logits,
    pred_boxes,
    labels,
    boxes,
    matcher,
    focal_alpha=focal_alpha,
    focal_gamma=focal_gamma,
    class_weight=class_weight,
    bbox_weight=bbox_weight,
    giou_weight=giou_weight,
  )
  terms = detection_loss_per_example(
    pred_logits,
    pred_boxes,
    labels_k,
    boxes_k,
    target_index,
    focal_alpha=focal_alpha,
    focal_gamma=focal_gamma,
  )
  if objectness_logits is None:
    return terms, None
  matched = _gather_targets(real_target_mask(labels_k), target_index)  # [B, T]
  return terms, objectness_loss_per_example(
    objectness_logits, matched, focal_alpha=focal_alpha, focal_gamma=focal_gamma
  )


def _normalised(terms, weights, example_mask, normalization, obj, objectness_weight):
  """`detection_loss`'s result from its per-image terms: `per_example` (the weighted sum of
  the three terms), the batch values by `normalization`, and OWLv2's objectness term `obj`
  (None: off) at `objectness_weight` (`_add_objectness`)."""
  class_weight, bbox_weight, giou_weight = weights
  per_example = (
    class_weight * terms["loss_class"]
    + bbox_weight * terms["loss_bbox"]
    + giou_weight * terms["loss_giou"]
  )
  if normalization == "per_batch":
    out = _per_batch_loss(terms, per_example, example_mask, weights)
  else:
    out = _per_image_loss(terms, per_example, example_mask)
  if obj is None:
    return out
  return _add_objectness(out, obj, objectness_weight, example_mask, normalization)


def _add_objectness(out, obj, weight, example_mask, normalization) -> dict[str, Array]:
  """`detection_loss`'s result `out` with OWLv2's objectness term (`obj`, from
  `objectness_loss_per_example`) at `weight`: weight x the per-image term added to
  `per_example`; `loss_objectness` normalised as the box losses ('per_image': the weighted
  mean of the per-image values; 'per_batch': the batch's sum over its total #boxes); `loss`
  recomputed ('per_image': the weighted mean of the new `per_example`) or weight x
  `loss_objectness` added ('per_batch')."""
  out = dict(out, per_example=out["per_example"] + weight * obj["loss_objectness"])
  if normalization == "per_batch":
    w = jnp.ones(obj["num_boxes"].shape, jnp.float32) if example_mask is None else example_mask
    w = jnp.where(jnp.asarray(w, jnp.float32) > 0, jnp.asarray(w, jnp.float32), 0.0)
    value = jnp.sum(w * obj["sum_objectness"]) / jnp.maximum(jnp.sum(w * obj["num_boxes"]), 1.0)
    out["loss"] = out["loss"] + weight * value
  else:
    value = weighted_mean(obj["loss_objectness"], example_mask)
    out["loss"] = weighted_mean(out["per_example"], example_mask)
  out["loss_objectness"] = value
  return out

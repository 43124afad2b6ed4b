"""The OWL-ViT detection loss: focal class loss and L1 + GIoU box losses after matching.

Normalisation is per example (scenic `normalization='per_example'`): each image's class loss
is divided by max(#positive (instance, label) pairs, 1), its box losses by max(#matched real
boxes, 1); the batch value is then the (optionally weighted) mean over images. The terms
(and OWLv2's objectness term) are the registry `owl_cl.train.loss_terms.TERMS`, each with its
weight field; `detection_loss` sums them in its order.

Source: docs/reference.md §3; scenic `scenic/projects/owl_vit/matching_base_models.py`
(`loss_function`, `labels_losses_and_metrics`, `boxes_losses_and_metrics`) and
`scenic/model_lib/base_models/model_utils.py` (`focal_sigmoid_cross_entropy`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from owl_cl.train import loss_terms
from owl_cl.train.boxes import box_cxcywh_to_xyxy
from owl_cl.train.matcher import append_padding_instance
from owl_cl.train.matcher import check_predictions
from owl_cl.train.matcher import hungarian_matching
from owl_cl.train.matcher import matching_cost
from owl_cl.train.matcher import real_target_mask

Array = jax.Array


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
  """Per-image normalised loss terms for a given matching: the registry's three v1 terms
  (`loss_terms.class_term`, `bbox_term`, `giou_term`).

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
  m = _matched(pred_logits, pred_boxes, labels, boxes, target_index, None, focal_alpha, focal_gamma)
  (sum_class, num_pos), (sum_bbox, num_boxes), (sum_giou, _) = (
    loss_terms.TERMS[name].fn(m) for name in ("loss_class", "loss_bbox", "loss_giou")
  )
  denom = jnp.maximum(num_boxes, 1.0)
  return dict(
    loss_class=sum_class / jnp.maximum(num_pos, 1.0),
    loss_bbox=sum_bbox / denom,
    loss_giou=sum_giou / denom,
    num_positives=num_pos,
    num_boxes=num_boxes,
    # The unnormalised sums (what normalization='per_batch' adds over the batch).
    sum_class=sum_class,
    sum_bbox=sum_bbox,
    sum_giou=sum_giou,
  )


def _matched(
  pred_logits, pred_boxes, labels_k, boxes_k, target_index, objectness_logits, alpha, gamma
) -> loss_terms.Matched:
  """What the terms read (`loss_terms.Matched`) from the predictions, the targets with the
  padding instance, labels_k [B, K, Q] and boxes_k [B, K, 4], and target_index int [B, T]."""
  target_index = jax.lax.stop_gradient(target_index)
  target_labels = _gather_targets(labels_k.astype(jnp.float32), target_index)[..., 1:]
  return loss_terms.Matched(
    pred_logits=pred_logits,
    target_labels=target_labels,
    pred_xyxy=box_cxcywh_to_xyxy(pred_boxes.astype(jnp.float32)),
    target_xyxy=box_cxcywh_to_xyxy(_gather_targets(boxes_k.astype(jnp.float32), target_index)),
    matched=_gather_targets(real_target_mask(labels_k), target_index),
    objectness_logits=objectness_logits,
    focal_alpha=alpha,
    focal_gamma=gamma,
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
  **term_weights: float,
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
      (`loss_terms.objectness_term`).
    objectness_weight: the objectness term's weight (``loss.objectness_weight``); 0: v1's.
    **term_weights: further registered terms' weights by field name; absent: 0 (off).

  Returns:
    dict of float32:
      loss []: weighted mean over images of per_example ('per_image'), or the weighted
        per-batch-normalised terms ('per_batch').
      per_example [B]: class_weight * cls + bbox_weight * l1 + giou_weight * giou (+ each
        further term that is on, weight x value) of each image, each term normalised within
        the image (independent of the rest of the batch and of example_mask; the replay
        buffer ranks images by it).
      loss_class, loss_bbox, loss_giou []: the unweighted terms, averaged like `loss`.
      loss_objectness []: the unweighted objectness term (only with the term on); likewise
        each registered term under its name.

  Raises:
    ValueError: inconsistent shapes, or an unknown `normalization`.
    TypeError: a keyword in `term_weights` is no registered term's weight.

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
  weights = dict(
    class_weight=class_weight,
    bbox_weight=bbox_weight,
    giou_weight=giou_weight,
    objectness_weight=objectness_weight,
    **term_weights,
  )
  unknown = set(weights) - {term.weight for term in loss_terms.TERMS.values()}
  if unknown:
    raise TypeError(f"detection_loss got weights of no registered loss term: {sorted(unknown)}")
  terms = _term_sums(
    pred_logits,
    pred_boxes,
    labels,
    boxes,
    matcher,
    objectness_logits,
    weights,
    (focal_alpha, focal_gamma),
  )
  if normalization == "per_batch":
    return _per_batch(terms, example_mask)
  return _per_image(terms, example_mask)


def _term_sums(pred_logits, pred_boxes, labels, boxes, matcher, objectness_logits, weights, focal):
  """`detection_loss`'s per-image terms: the Hungarian matching (its cost weighted by the
  class, bbox and giou weights of `weights` {weight field: weight}), then each registered
  term that is on, in the registry's order, as (name, weight, sums float32 [B], normalisers
  float32 [B]). `focal`: (alpha, gamma)."""
  focal_alpha, focal_gamma = focal
  class_weight, bbox_weight, giou_weight = (
    weights["class_weight"],
    weights["bbox_weight"],
    weights["giou_weight"],
  )
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
  m = _matched(
    pred_logits,
    pred_boxes,
    labels_k,
    boxes_k,
    target_index,
    objectness_logits,
    focal_alpha,
    focal_gamma,
  )
  terms = []  # (name, weight, per-image sums, per-image normalisers) of the terms that are on
  for term in loss_terms.TERMS.values():
    weight = weights.get(term.weight, 0.0)
    value = term.fn(m) if term.always or weight else None
    if value is not None:
      terms.append((term.name, weight, *value))
  return terms


def _weighted_sum(values):
  """The sum of weight x value over (weight, value) pairs, added in their order (the
  registry's: the order of the float additions is part of the result)."""
  total = None
  for weight, value in values:
    total = weight * value if total is None else total + weight * value
  return total


def _per_image(terms, example_mask) -> dict[str, Array]:
  """`detection_loss`'s 'per_image' normalisation (scenic): each image's term values
  sum / max(normaliser, 1), their weighted sum `per_example`, and the weighted means over the
  images of both."""
  values = {name: total / jnp.maximum(norm, 1.0) for name, _, total, norm in terms}
  per_example = _weighted_sum((weight, values[name]) for name, weight, _, _ in terms)
  out = dict(loss=weighted_mean(per_example, example_mask), per_example=per_example)
  out.update({name: weighted_mean(value, example_mask) for name, value in values.items()})
  return out


def _per_batch(terms, example_mask) -> dict[str, Array]:
  """`detection_loss`'s 'per_batch' normalisation (the released code): each term's sums over
  the (unmasked, weighted) images over the sum of its normalisers, >= 1; the loss their
  weighted sum. `per_example` is per image, as in 'per_image'."""
  per_example = _weighted_sum(
    (weight, total / jnp.maximum(norm, 1.0)) for _, weight, total, norm in terms
  )
  w = jnp.ones(per_example.shape, jnp.float32) if example_mask is None else example_mask
  w = jnp.asarray(w, jnp.float32)
  if w.shape != per_example.shape:
    raise ValueError(f"example weights must be [B] = {per_example.shape}, got {w.shape}")
  w = jnp.where(w > 0, w, 0.0)
  values = {
    name: jnp.sum(w * total) / jnp.maximum(jnp.sum(w * norm), 1.0) for name, _, total, norm in terms
  }
  out = dict(per_example=per_example, **values)
  out["loss"] = _weighted_sum((weight, values[name]) for name, weight, _, _ in terms)
  return out

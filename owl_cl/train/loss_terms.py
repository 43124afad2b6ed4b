"""The detection loss's terms, registered in one place: each is its function and the `LossSpec`
field holding its weight (scenic's `loss_terms_weights`), and `detection_loss` iterates them.

A term's function reads the matching (`Matched`: the targets each token is matched to) and
returns each image's (sum, normaliser): float32 [B] each, or None when the model lacks the
term's input (v1 has no objectness logits). `owl_cl.train.detection.detection_loss` then

* per image: value = sum / max(normaliser, 1); `per_example` = sum over the terms, in the
  registry's order, of weight x value (the replay buffer ranks images by it, loss adaptivity
  counts it);
* 'per_image' (scenic's 'per_example'): the loss is the weighted mean of `per_example`, each
  term's metric the weighted mean of its values;
* 'per_batch' (the released code): each term's metric is its sums over the batch divided by
  its normalisers' sum (>= 1), the loss the sum of weight x metric in the registry's order.

The registry's order is the order of the float additions, so adding a term after the built-in
ones leaves their results bit for bit. A term is added when its weight is non-zero; the three
v1 terms (scenic's) are always computed and reported. docs/extending.md, "A loss term".

Source: scenic `scenic/projects/owl_vit/matching_base_models.py` (`loss_terms_weights`,
`loss_function`); docs/reference.md §3; OWLv2's objectness: docs/owlv2.md.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from owl_cl.train.boxes import generalized_box_iou
from owl_cl.train.objectness_loss import objectness_loss_per_example

Array = jax.Array


class Matched(NamedTuple):
  """What a term reads: the predictions and the targets the Hungarian matching assigns.

  Attributes:
    pred_logits: float [B, T, Q] class logits (query slot 0 is the padding query '').
    target_labels: float32 [B, T, Q-1] the matched target's labels of columns 1.. (0 for
      tokens matched to padding).
    pred_xyxy: float32 [B, T, 4] the predicted boxes as corners.
    target_xyxy: float32 [B, T, 4] the matched target's box as corners.
    matched: bool [B, T] whether the token is matched to a real instance (no gradient).
    objectness_logits: OWLv2's float [B, T] objectness logits; None for v1.
    focal_alpha: the focal loss's alpha (`LossSpec.focal_alpha`).
    focal_gamma: the focal loss's gamma (`LossSpec.focal_gamma`).
  """

  pred_logits: Array
  target_labels: Array
  pred_xyxy: Array
  target_xyxy: Array
  matched: Array
  objectness_logits: Array | None
  focal_alpha: float
  focal_gamma: float


@dataclasses.dataclass(frozen=True)
class LossTerm:
  """One term of the detection loss.

  Attributes:
    name: its metric, e.g. 'loss_class' (`detection_loss` reports it, unweighted).
    weight: the `LossSpec` field (a `detection_loss` keyword) holding its weight.
    fn: `fn(matched: Matched) -> (sum float32 [B], normaliser float32 [B])` of each image, or
      None when the model lacks the term's input.
    always: computed and reported even at weight 0 (the three v1 terms); otherwise the term
      is computed only at a non-zero weight.
  """

  name: str
  weight: str
  fn: Callable[[Matched], tuple[Array, Array] | None]
  always: bool = False


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


def class_term(m: Matched) -> tuple[Array, Array]:
  """The focal class term: the focal loss over all tokens and query columns 1.. against the
  matched target's labels, over #positives (the sum of those labels). Source: scenic
  `labels_losses_and_metrics`."""
  focal = sigmoid_focal_loss(
    m.pred_logits[..., 1:], m.target_labels, alpha=m.focal_alpha, gamma=m.focal_gamma
  )
  return jnp.sum(focal, axis=(1, 2)), jnp.sum(m.target_labels, axis=(1, 2))


def _num_boxes(m: Matched) -> Array:
  """float32 [B]: the tokens matched to a real instance."""
  return jnp.sum(m.matched.astype(jnp.float32), axis=1)


def bbox_term(m: Matched) -> tuple[Array, Array]:
  """The L1 box term: |pred - target|_1 of the corners over the matched tokens, over #boxes.
  Source: scenic `boxes_losses_and_metrics`."""
  l1 = jnp.where(m.matched, jnp.sum(jnp.abs(m.pred_xyxy - m.target_xyxy), axis=-1), 0.0)
  return jnp.sum(l1, axis=1), _num_boxes(m)


def giou_term(m: Matched) -> tuple[Array, Array]:
  """The GIoU term: 1 - GIoU over the matched tokens, over #boxes. Source: scenic
  `boxes_losses_and_metrics`."""
  giou = generalized_box_iou(m.pred_xyxy, m.target_xyxy, all_pairs=False)
  return jnp.sum(jnp.where(m.matched, 1.0 - giou, 0.0), axis=1), _num_boxes(m)


def objectness_term(m: Matched) -> tuple[Array, Array] | None:
  """OWLv2's objectness term (`objectness_loss_per_example`: the focal loss of the objectness
  logit against "matched", over #boxes); None for a v1 model. Source: docs/owlv2.md."""
  if m.objectness_logits is None:
    return None
  obj = objectness_loss_per_example(
    m.objectness_logits, m.matched, focal_alpha=m.focal_alpha, focal_gamma=m.focal_gamma
  )
  return obj["sum_objectness"], obj["num_boxes"]


# The registry, in the order of the loss's additions: scenic's three terms, then OWLv2's.
TERMS: dict[str, LossTerm] = {
  term.name: term
  for term in (
    LossTerm("loss_class", "class_weight", class_term, always=True),
    LossTerm("loss_bbox", "bbox_weight", bbox_term, always=True),
    LossTerm("loss_giou", "giou_weight", giou_term, always=True),
    LossTerm("loss_objectness", "objectness_weight", objectness_term),
  )
}


def register(term: LossTerm) -> None:
  """Adds `term` to the detection loss, after the registered ones.

  Its weight field must be a `LossSpec` field (its default, rule and doc), so that
  `config.loss.<weight>` reaches `detection_loss` as a keyword; a term whose weight field is
  missing is refused only there (`detection_loss` reads the weight from its keywords).

  Raises:
    ValueError: a term of that name or weight field is registered already.
  """
  for other in TERMS.values():
    if term.name == other.name or term.weight == other.weight:
      raise ValueError(
        f"loss term {term.name!r} (weight {term.weight!r}) clashes with the registered "
        f"{other.name!r} (weight {other.weight!r})"
      )
  TERMS[term.name] = term


def unregister(name: str) -> None:
  """Removes the term `name` (a test's throwaway term). Raises KeyError: no such term."""
  del TERMS[name]

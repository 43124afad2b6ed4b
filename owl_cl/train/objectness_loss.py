"""OWLv2's objectness loss (docs/owlv2.md, "The objectness loss").

Neither the OWLv2 paper (Minderer, Gritsenko, Houlsby, NeurIPS 2023, arXiv 2306.09683) nor
scenic's released code gives the loss that trains the objectness head (scenic has the head,
``objectness_predictor``, and no loss). owl_cl's choice, each part with its source:

* target: 1 for a token the Hungarian matcher assigns to a real ground-truth box, 0 otherwise
  (public practice: felix-lindgren/owlv2-torch, docs/loss-notes.md, "objectness as binary
  cross-entropy on matched predictions"; the paper describes objectness as the probability
  that a token's box contains an object). The matching is the detection loss's own (its cost
  has no objectness term), so the objectness loss never changes which token is matched.
* element loss: the sigmoid focal loss of the detection loss's class term with the same alpha
  and gamma (scenic ``focal_sigmoid_cross_entropy``; docs/reference.md §3). The objectness
  target is the class target of one class-agnostic query ("any object"), so the two terms
  are on one scale; focal down-weights the T - #boxes easy negatives that a plain summed BCE
  would let dominate (3,600 tokens at 960 px for a handful of boxes).
* normalisation: each image's sum over its tokens divided by max(#matched real boxes, 1), as
  scenic normalises its class and box losses per example (felix-lindgren/owlv2-torch's own bug
  report: a mean over classes shrank their class loss 46x; normalise by the number of boxes).
* weight: ``loss.objectness_weight`` (0 = off, the v1 loss exactly; 0.5 in the ``owlv2``
  config, felix-lindgren/owlv2-torch's weight).
* gradient: only the objectness head learns from it (its input is under stop_gradient,
  scenic's OWLv2 configs), so it cannot trade detection quality for objectness.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["objectness_loss_per_example"]


def objectness_loss_per_example(
  objectness_logits: Array,
  matched: Array,
  *,
  focal_alpha: float = 0.3,
  focal_gamma: float = 2.0,
) -> dict[str, Array]:
  """Per-image objectness loss: focal loss of the objectness logit against "matched".

  Args:
    objectness_logits: float [B, T] (any float dtype; computed in float32).
    matched: bool [B, T], True where the Hungarian matcher assigned the token to a real
      ground-truth box (no gradient).
    focal_alpha: the focal loss's alpha, the weight of positives (``loss.focal_alpha``: 0.3).
    focal_gamma: the focal loss's gamma (``loss.focal_gamma``: 2.0).

  Returns:
    dict of float32 [B]: ``loss_objectness`` (sum over tokens / max(#matched, 1)),
    ``sum_objectness`` (the sum) and ``num_boxes`` (#matched, unclamped).

  Raises:
    ValueError: shapes differ or are not [B, T].

  Source: docs/owlv2.md; this module's docstring; scenic ``model_utils``
  (``focal_sigmoid_cross_entropy`` at hard targets) and ``matching_base_models``
  (normalization='per_example').
  """
  x = jnp.asarray(objectness_logits, jnp.float32)
  if x.ndim != 2 or tuple(jnp.shape(matched)) != x.shape:
    raise ValueError(
      f"objectness_logits and matched must be [B, T] of one shape, got {x.shape} and "
      f"{tuple(jnp.shape(matched))}"
    )
  y = jax.lax.stop_gradient(jnp.asarray(matched, jnp.float32))
  # Focal loss at hard targets: ce = -log p_t, (1 - p_t)^gamma = (1 - exp(-ce))^gamma.
  ce = -(y * jax.nn.log_sigmoid(x) + (1.0 - y) * jax.nn.log_sigmoid(-x))
  focal = ce * (-jnp.expm1(-ce)) ** focal_gamma * (focal_alpha * y + (1.0 - focal_alpha) * (1 - y))
  total = jnp.sum(focal, axis=1)
  num_boxes = jnp.sum(y, axis=1)
  return dict(
    loss_objectness=total / jnp.maximum(num_boxes, 1.0),
    sum_objectness=total,
    num_boxes=num_boxes,
  )

"""Learning without Forgetting: distillation to the frozen pre-trained model on the new images.

LwF (Li & Hoiem, ECCV 2016 / TPAMI 2017) keeps no stored data: the pre-trained model (the
teacher) scores the current batch and the trained model is pulled towards its responses. For
a detector the responses are dense: Feng et al., CVPR 2022 ("Overcoming Catastrophic
Forgetting in Incremental Object Detection via Elastic Response Distillation", ERD) distil
the classification responses and, for the teacher's confident predictions, the boxes.

Choices (docs/baselines.md "LwF"):
- OWL-ViT scores each (token, query) pair with an independent sigmoid (trained by a focal
  loss; docs/reference.md §3), not a softmax over classes. The class term is therefore the
  binary KL divergence between the tempered teacher and student sigmoids per slot, not
  Li & Hoiem's softmax KL over classes: a softmax over the queries would make the classes
  compete, which the model never learnt. It equals the sigmoid binary cross-entropy with the
  teacher's probability as target minus the teacher's entropy (the same gradient; 0 when the
  two models agree).
- The temperature T softens both sigmoids (z / T) and the term is multiplied by T^2, which
  keeps its gradient's scale independent of T (Hinton et al. 2015; Li & Hoiem use T = 2).
- Boxes (an option, ERD): L1 between the student's and the teacher's boxes on the tokens
  whose teacher score (untempered sigmoid, best real query) is >= a threshold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from owl_cl.train.der import PADDED_LOGIT_THRESHOLD
from owl_cl.train.detection import weighted_mean

Array = jax.Array


def _slots(teacher_logits: Array, query_mask: Array | None) -> Array:
  """bool [B, T, Q]: the real query slots (query_mask, else teacher logit > -1e5)."""
  if query_mask is None:
    return teacher_logits > PADDED_LOGIT_THRESHOLD
  return jnp.broadcast_to(jnp.asarray(query_mask, bool)[:, None, :], teacher_logits.shape)


def lwf_class_loss(
  logits: Array,
  teacher_logits: Array,
  *,
  temperature: float,
  query_mask: Array | None = None,
  example_mask: Array | None = None,
) -> Array:
  """T^2 times the mean binary KL(sigmoid(teacher / T) || sigmoid(student / T)) per slot.

  Args:
    logits: float [B, T_tok, Q] the trained model's class logits on the new images.
    teacher_logits: float [B, T_tok, Q] the pre-trained model's (no gradient flows to it).
    temperature: T > 0 (Li & Hoiem 2017: 2).
    query_mask: optional bool [B, Q] True for real queries; None: the slots whose teacher
      logit is > -1e5 (padded queries score -1e6, docs/reference.md §1).
    example_mask: optional bool/float [B] image weights (padding images 0).

  Returns:
    float32 [] (loss units: nats per slot times T^2): each image's KL averaged over its real
    (token, query) slots, then the weighted mean over images (0 when all are masked).

  Raises:
    ValueError: shapes disagree or temperature <= 0.

  Source: Li & Hoiem 2017 (LwF, eq. 3 with T); Feng et al. CVPR'22 (ERD); docs/baselines.md.
  """
  if logits.ndim != 3 or logits.shape != teacher_logits.shape:
    raise ValueError(f"logits {logits.shape} and teacher_logits {teacher_logits.shape} differ")
  if not temperature > 0:
    raise ValueError(f"train.lwf.temperature must be > 0, got {temperature}")
  teacher = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32))
  slots = _slots(teacher, query_mask)
  # Masked slots get logits 0 in both (a finite KL of 0) so no NaN reaches the gradient.
  zt = jnp.where(slots, teacher, 0.0) / temperature
  zs = jnp.where(slots, logits.astype(jnp.float32), 0.0) / temperature
  pt = jax.nn.sigmoid(zt)
  kl = pt * (jax.nn.log_sigmoid(zt) - jax.nn.log_sigmoid(zs)) + (1.0 - pt) * (
    jax.nn.log_sigmoid(-zt) - jax.nn.log_sigmoid(-zs)
  )
  per_image = jnp.sum(jnp.where(slots, kl, 0.0), axis=(1, 2)) / jnp.maximum(
    jnp.sum(slots, axis=(1, 2)), 1
  )
  return temperature**2 * weighted_mean(per_image, example_mask)


def lwf_box_loss(
  boxes: Array,
  teacher_boxes: Array,
  teacher_logits: Array,
  *,
  threshold: float,
  query_mask: Array | None = None,
  example_mask: Array | None = None,
) -> Array:
  """L1 to the teacher's boxes on its confident tokens (ERD's box distillation, an option).

  Args:
    boxes: float [B, T_tok, 4] cxcywh in [0, 1] of the padded square (the trained model's).
    teacher_boxes: float [B, T_tok, 4], the same of the pre-trained model.
    teacher_logits: float [B, T_tok, Q]; a token is confident when the sigmoid of its best real
      query's teacher logit is >= `threshold`.
    threshold: in [0, 1].
    query_mask: as `lwf_class_loss`.
    example_mask: as `lwf_class_loss`.

  Returns:
    float32 []: the sum over the 4 coordinates of |student - teacher|, averaged over the
    confident tokens of the weighted images (0 when none is confident).

  Source: Feng et al. CVPR'22 (ERD, regression responses of the selected predictions).
  """
  teacher_logits = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32))
  slots = _slots(teacher_logits, query_mask)
  score = jax.nn.sigmoid(jnp.max(jnp.where(slots, teacher_logits, -jnp.inf), axis=-1))
  confident = score >= threshold  # [B, T_tok]
  if example_mask is not None:
    confident = confident & (jnp.asarray(example_mask)[:, None] > 0)
  l1 = jnp.sum(jnp.abs(boxes.astype(jnp.float32) - jax.lax.stop_gradient(teacher_boxes)), -1)
  return jnp.sum(jnp.where(confident, l1, 0.0)) / jnp.maximum(jnp.sum(confident), 1)


def lwf_loss(outputs: dict, teacher: dict, options: dict) -> dict[str, Array]:
  """The LwF terms of one batch: {'lwf_loss', 'lwf_class', 'lwf_box'} float32 [].

  Args:
    outputs: the trained model's `pred_logits` [B, T_tok, Q] and `pred_boxes` [B, T_tok, 4]
      on the new images.
    teacher: the same of the pre-trained model.
    options: `train.lwf`: weight, temperature, box_weight, box_threshold.

  Returns:
    lwf_loss = weight * lwf_class + box_weight * lwf_box (lwf_class already times T^2).
  """
  cls = lwf_class_loss(
    outputs["pred_logits"], teacher["pred_logits"], temperature=options["temperature"]
  )
  box = jnp.zeros((), jnp.float32)
  if options.get("box_weight", 0.0):
    box = lwf_box_loss(
      outputs["pred_boxes"],
      teacher["pred_boxes"],
      teacher["pred_logits"],
      threshold=options["box_threshold"],
    )
  total = options["weight"] * cls + options.get("box_weight", 0.0) * box
  return {"lwf_loss": total, "lwf_class": cls, "lwf_box": box}

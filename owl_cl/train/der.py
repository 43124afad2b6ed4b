"""The DER++ replay loss: detection loss on new and replayed images plus logit distillation.

Source: docs/reference.md §3 (DER++, paper §3; Buzzega et al. 2020; the released code).
OWLv2 (docs/owlv2.md): the distillation also covers the objectness logits, an MSE of its own
at `objectness_distill_weight` relative to the class logits' (ours: DER++ distils "the
network's logits", Buzzega et al. 2020 §3; OWLv2's objectness logit is one more output of
the network, and neither the paper of this project nor OWLv2's says how to weigh it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from owl_cl.train.detection import detection_loss
from owl_cl.train.detection import weighted_mean

Array = jax.Array

# Slots whose stored logit is at or below this are padded query slots (the model writes
# -1e6 there, docs/reference.md §1); used by `distillation_mse` when no query mask is given.
PADDED_LOGIT_THRESHOLD = -1e5


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
  return weighted_mean(jnp.mean(sq, axis=(1, 2)), example_mask)


def objectness_distillation_mse(
  objectness_logits: Array, stored_objectness: Array, *, example_mask: Array | None = None
) -> Array:
  """DER++ distillation of OWLv2's objectness logits: MSE over images and tokens.

  Each image's squared error is averaged over its T tokens (every token is real: objectness
  has no padded slots); the images are then averaged as in `distillation_mse`.

  Args:
    objectness_logits: float [B_r, T] the current model's objectness logits on the replays.
    stored_objectness: float [B_r, T] the pre-trained model's (frozen: no gradient).
    example_mask: optional bool/float [B_r]; the result is sum(w * mse_b) / sum(w) (0 when
      all are masked).

  Returns:
    float32 [] the mean squared error.

  Raises:
    ValueError: shapes disagree or are not [B_r, T].

  Source: Buzzega et al. 2020 (DER++ logit MSE); its use on objectness is ours
  (docs/owlv2.md, "DER++ on the class and objectness logits").
  """
  x = jnp.asarray(objectness_logits, jnp.float32)
  stored = jax.lax.stop_gradient(jnp.asarray(stored_objectness, jnp.float32))
  if x.ndim != 2 or x.shape != stored.shape:
    raise ValueError(
      f"expected objectness_logits and stored_objectness [B,T] of one shape, got "
      f"{x.shape} and {stored.shape}"
    )
  return weighted_mean(jnp.mean(jnp.square(x - stored), axis=1), example_mask)


def der_distillation(
  replay_outputs: Mapping[str, Array],
  stored_logits: Array,
  stored_objectness: Array | None = None,
  *,
  objectness_distill_weight: float = 1.0,
  query_mask: Array | None = None,
  example_mask: Array | None = None,
) -> tuple[Array, Array | None]:
  """DER++'s distillation term: MSE(class logits) + w * MSE(objectness logits).

  The objectness part is there only for an OWLv2 model whose store keeps the objectness
  logits (`replay_outputs['objectness_logits']` and `stored_objectness` both given) and
  w = `objectness_distill_weight` > 0; otherwise the term is `distillation_mse` (v1's, exactly).

  Args:
    replay_outputs: {'pred_logits' [B_r,T,Q], OWLv2: 'objectness_logits' [B_r,T], ...}.
    stored_logits: float [B_r,T,Q] the pre-trained model's class logits.
    stored_objectness: float [B_r,T] the pre-trained model's objectness logits, or None.
    objectness_distill_weight: w >= 0 (config `replay.der_objectness_weight`).
    query_mask: as `distillation_mse`.
    example_mask: as `distillation_mse`.

  Returns:
    (float32 [] the term, float32 [] the objectness MSE before w or None when off).

  Raises:
    ValueError: shapes disagree (`distillation_mse`, `objectness_distillation_mse`).

  Source: Buzzega et al. 2020; docs/reference.md §3; docs/owlv2.md (the objectness part).
  """
  distill = distillation_mse(
    replay_outputs["pred_logits"],
    stored_logits,
    query_mask=query_mask,
    example_mask=example_mask,
  )
  objectness = replay_outputs.get("objectness_logits")
  if objectness is None or stored_objectness is None or not objectness_distill_weight:
    return distill, None
  obj = objectness_distillation_mse(objectness, stored_objectness, example_mask=example_mask)
  return distill + objectness_distill_weight * obj, obj


def _no_replay_terms(new_loss: Array) -> dict[str, Array]:
  """`der_plus_plus_loss`'s replay entries when nothing is replayed: loss = L_det(new),
  zero replay terms, per_example_replay float32 [0]."""
  zero = jnp.zeros((), jnp.float32)
  return dict(
    loss=new_loss,
    replay_loss=zero,
    distill_loss=zero,
    replay_loss_class=zero,
    replay_loss_bbox=zero,
    replay_loss_giou=zero,
    per_example_replay=jnp.zeros((0,), jnp.float32),
  )


def _half_loss(outputs, targets, example_mask, loss_kwargs) -> dict[str, Array]:
  """`detection_loss` of one half of the batch (new or replayed images; OWLv2's objectness
  term when `outputs` has 'objectness_logits')."""
  return detection_loss(
    outputs["pred_logits"],
    outputs["pred_boxes"],
    targets["labels"],
    targets["boxes"],
    example_mask=example_mask,
    objectness_logits=outputs.get("objectness_logits"),
    **loss_kwargs,
  )


def der_plus_plus_loss(
  new_outputs: Mapping[str, Array],
  new_targets: Mapping[str, Array],
  replay_outputs: Mapping[str, Array] | None = None,
  replay_targets: Mapping[str, Array] | None = None,
  stored_logits: Array | None = None,
  *,
  stored_objectness: Array | None = None,
  objectness_distill_weight: float = 1.0,
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
    stored_objectness: OWLv2: float [B_r,T] the pre-trained model's objectness logits (no
      gradient), distilled at `objectness_distill_weight` (`der_distillation`); None: the
      class logits only.
    objectness_distill_weight: weight of the objectness MSE relative to the class logits'
      (config `replay.der_objectness_weight`; both then times alpha).
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
    per_example_replay [B_r]; with the objectness distillation on, distill_loss is
    MSE_class + w * MSE_objectness and distill_objectness [] is MSE_objectness.

  Raises:
    ValueError: inconsistent shapes, or replay_outputs given without replay_targets or
      stored_logits.

  Source: docs/reference.md §3 (DER++, paper §3; Buzzega et al. 2020).
  """
  new = _half_loss(new_outputs, new_targets, new_mask, loss_kwargs)
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
    return {**out, **_no_replay_terms(new["loss"])}
  replay = der_replay_terms(
    replay_outputs,
    replay_targets,
    stored_logits,
    stored_objectness=stored_objectness,
    objectness_distill_weight=objectness_distill_weight,
    replay_mask=replay_mask,
    replay_query_mask=replay_query_mask,
    **loss_kwargs,
  )
  return {
    **out,
    **replay,
    "loss": new["loss"] + alpha * replay["distill_loss"] + beta * replay["replay_loss"],
  }


def der_replay_terms(
  replay_outputs: Mapping[str, Array],
  replay_targets: Mapping[str, Array] | None,
  stored_logits: Array | None,
  *,
  stored_objectness: Array | None = None,
  objectness_distill_weight: float = 1.0,
  replay_mask: Array | None = None,
  replay_query_mask: Array | None = None,
  **loss_kwargs: Any,
) -> dict[str, Array]:
  """DER++'s two replay terms, before alpha and beta: the replays' detection loss and the
  logit distillation (`der_plus_plus_loss`'s arguments of the same names).

  Returns:
    dict of float32: replay_loss [], distill_loss [], replay_loss_class / replay_loss_bbox /
    replay_loss_giou [], per_example_replay [B_r], and distill_objectness [] with the
    objectness distillation on.

  Raises:
    ValueError: inconsistent shapes, or no replay_targets or stored_logits.

  Source: docs/reference.md §3 (DER++, paper §3; Buzzega et al. 2020).
  """
  if replay_targets is None or stored_logits is None:
    raise ValueError("replay_outputs needs replay_targets and stored_logits")
  replay = _half_loss(replay_outputs, replay_targets, replay_mask, loss_kwargs)
  distill, distill_objectness = der_distillation(
    replay_outputs,
    stored_logits,
    stored_objectness,
    objectness_distill_weight=objectness_distill_weight,
    query_mask=replay_query_mask,
    example_mask=replay_mask,
  )
  out = dict(
    replay_loss=replay["loss"],
    distill_loss=distill,
    replay_loss_class=replay["loss_class"],
    replay_loss_bbox=replay["loss_bbox"],
    replay_loss_giou=replay["loss_giou"],
    per_example_replay=replay["per_example"],
  )
  if distill_objectness is not None:
    out["distill_objectness"] = distill_objectness
  return out

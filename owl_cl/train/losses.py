"""The training losses: OWL-ViT v1 detection loss with exact Hungarian matching, DER++ and
loss adaptivity; the one entry point the train step, buffer selection and config checks use.

The terms live in one module per concern and are re-exported here (`__all__`):
  `owl_cl.train.boxes`      box conversions, IoU, GIoU (scenic `box_utils`);
  `owl_cl.train.matcher`    targets, the matching cost and the Hungarian matching glue
                            (the device solver itself: `owl_cl.train.matching`);
  `owl_cl.train.loss_terms` the detection loss's terms (focal class, L1, GIoU, OWLv2's
                            objectness), registered with their weight fields;
  `owl_cl.train.detection`  `detection_loss`, their sum (per image or per batch);
  `owl_cl.train.der`        the DER++ logit distillation and `der_plus_plus_loss`;
  this module               loss adaptivity (paper eqs. 5-6).

Everything follows docs/reference.md §3, which transcribes scenic's
`scenic/projects/owl_vit/losses.py` (matching cost),
`scenic/projects/owl_vit/matching_base_models.py` (`loss_function`,
`labels_losses_and_metrics`, `boxes_losses_and_metrics` with `normalization='per_example'`),
`scenic/model_lib/matchers/{common,hungarian}.py` (SciPy matching through a host callback),
`scenic/model_lib/base_models/box_utils.py` (box conversions, IoU, GIoU) and
`scenic/model_lib/base_models/model_utils.py` (`focal_sigmoid_cross_entropy`).

Shapes (docs/CONVENTIONS.md): B images, T image tokens, Q query slots (slot 0 is the padding
query ''), M instances per image, K = M + 1 targets once the padding instance is appended.
Targets, matching: `owl_cl.train.matcher`; normalisation: `owl_cl.train.detection`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from owl_cl.train.boxes import box_cxcywh_to_xyxy
from owl_cl.train.boxes import box_iou
from owl_cl.train.boxes import box_xyxy_to_cxcywh
from owl_cl.train.boxes import generalized_box_iou
from owl_cl.train.der import PADDED_LOGIT_THRESHOLD
from owl_cl.train.der import der_distillation
from owl_cl.train.der import der_plus_plus_loss
from owl_cl.train.der import der_replay_terms
from owl_cl.train.der import distillation_mse
from owl_cl.train.der import objectness_distillation_mse
from owl_cl.train.detection import NORMALIZATIONS
from owl_cl.train.detection import detection_loss
from owl_cl.train.detection import detection_loss_per_example
from owl_cl.train.loss_terms import sigmoid_focal_loss
from owl_cl.train.matcher import AUTO_MATCHER
from owl_cl.train.matcher import MATCHERS
from owl_cl.train.matcher import append_padding_instance
from owl_cl.train.matcher import focal_matching_cost
from owl_cl.train.matcher import hungarian_matching
from owl_cl.train.matcher import matching_cost
from owl_cl.train.matcher import real_target_mask
from owl_cl.train.matcher import resolve_matcher

Array = jax.Array

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
  "AUTO_MATCHER",
  "resolve_matcher",
  "detection_loss_per_example",
  "detection_loss",
  "NORMALIZATIONS",
  "distillation_mse",
  "objectness_distillation_mse",
  "der_distillation",
  "der_plus_plus_loss",
  "der_replay_terms",
  "loss_adaptive_combination",
  "loss_adaptive_total",
]


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

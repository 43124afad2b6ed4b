"""Targets, the matching cost and the Hungarian matching of tokens to targets.

Targets. `labels [B, M, Q]` is multi-hot; an instance is *real* iff it has at least one
positive label among columns 1..Q-1 (scenic's rule: column 0 only marks padding, a row that
is all zero in columns 1.. is padding whatever its column 0 says). `boxes [B, M, 4]` are
cxcywh normalised to the padded square; the boxes of padding instances are never used.

Matching. `hungarian_matching` returns, per image, `target_index [B, T]` int32: the target
(column of the cost matrix) assigned to each token. Every real target is assigned to exactly
one token (when T >= #real targets); every other token, and every token that the solver
paired with a padding target, gets K - 1, the appended padding instance. Gradients never
flow through the matching. The solver itself, on the device, is `owl_cl.train.matching`.

Source: docs/reference.md §3; scenic `scenic/projects/owl_vit/losses.py` (matching cost),
`scenic/model_lib/matchers/{common,hungarian}.py` (SciPy matching through a host callback).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.train import matching as matching_lib
from owl_cl.train.boxes import box_cxcywh_to_xyxy
from owl_cl.train.boxes import generalized_box_iou

Array = jax.Array

#: Values of `matcher` (config `loss.matcher`): 'scipy' (SciPy on the host through
#: `jax.pure_callback`), 'jax' (`owl_cl.train.matching`, compiled into the step) or 'auto'
#: (per platform: `resolve_matcher`).
MATCHERS = ("auto", "scipy", "jax")
#: What 'auto' picks on each platform: 'jax' everywhere. CPU: measured (benchmarks/step.py,
#: docs/benchmarks.md "Matcher"): the built-in step (tiny model, 16 + 16 images, 64 tokens,
#: 9 targets) takes 0.34 s with the JAX matcher and 0.44 s with SciPy's host callback.
#: GPU/TPU: no device -> host -> device round trip every step (TPUs cannot run host
#: callbacks inside a compiled step at all).
AUTO_MATCHER = {"cpu": "jax", "gpu": "jax", "tpu": "jax"}


def focal_matching_cost(logits: Array, *, alpha: float = 0.3, gamma: float = 2.0) -> Array:
  """Element-wise focal classification cost used for matching: pos - neg.

  pos = alpha * sigmoid(-x)^gamma * (-log sigmoid(x)),
  neg = (1 - alpha) * sigmoid(x)^gamma * (-log sigmoid(-x)).

  Args:
    logits: float [...] (computed in float32).
    alpha: focal alpha, docs/reference.md §3 (0.3).
    gamma: focal gamma, docs/reference.md §3 (2.0).

  Returns:
    float32 [...] the cost of declaring each element positive.

  Source: docs/reference.md §3; scenic `owl_vit/losses.sigmoid_cost(focal_loss=True)`.
  """
  x = jnp.asarray(logits, jnp.float32)
  pos = alpha * jax.nn.sigmoid(-x) ** gamma * -jax.nn.log_sigmoid(x)
  neg = (1.0 - alpha) * jax.nn.sigmoid(x) ** gamma * -jax.nn.log_sigmoid(-x)
  return pos - neg


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
  _check_targets(labels, boxes)
  b, _, q = labels.shape
  pad_label = jnp.zeros((b, 1, q), labels.dtype).at[:, :, 0].set(1)
  pad_box = jnp.zeros((b, 1, 4), boxes.dtype)
  return (jnp.concatenate([labels, pad_label], axis=1), jnp.concatenate([boxes, pad_box], axis=1))


def _check_targets(labels: Array, boxes: Array) -> None:
  """ValueError unless labels are [B, M, Q] and boxes [B, M, 4]."""
  if (
    labels.ndim != 3
    or boxes.ndim != 3
    or boxes.shape[-1] != 4
    or labels.shape[:2] != boxes.shape[:2]
  ):
    raise ValueError(
      f"expected labels [B,M,Q] and boxes [B,M,4], got {labels.shape} and {boxes.shape}"
    )


def real_target_mask(labels: Array) -> Array:
  """bool [..., K]: True for real instances (any positive label among columns 1..Q-1).

  Args:
    labels: float [..., K, Q] multi-hot targets.

  Source: scenic `owl_vit/losses.compute_cost` (`n_labels_per_instance > 0`).
  """
  return jnp.sum(jnp.asarray(labels, jnp.float32)[..., 1:], axis=-1) > 0


def check_predictions(pred_logits, pred_boxes, labels, boxes) -> None:
  """Checks pred_logits [B,T,Q], pred_boxes [B,T,4], labels [B,M,Q], boxes [B,M,4].

  Raises:
    ValueError: a rank or shape disagrees, or Q < 2 (slot 0 is the padding query).
  """
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
  _check_targets(labels, boxes)
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
    focal_alpha: focal class cost alpha (0.3).
    focal_gamma: focal class cost gamma (2.0).
    class_weight: weight of the class cost (scenic: the loss weight, 1).
    bbox_weight: weight of the L1 box cost (1).
    giou_weight: weight of the GIoU cost (1).

  Returns:
    (cost float32 [B, T, K], target_mask bool [B, K] True for real targets).

  Raises:
    ValueError: inconsistent shapes.

  Source: scenic `owl_vit/losses.compute_cost`. Difference: the padding value uses the max
  over *finite* real entries (scenic's max is NaN when an entry is NaN).
  """
  pred_logits, pred_boxes = jnp.asarray(pred_logits), jnp.asarray(pred_boxes)
  labels, boxes = jnp.asarray(labels), jnp.asarray(boxes)
  check_predictions(pred_logits, pred_boxes, labels, boxes)
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
  # Imported here: scipy.optimize takes about 0.25 s to import, which every process paid
  # (`owl_cl.main`, each test worker) though only the 'scipy' matcher needs it.
  from scipy.optimize import linear_sum_assignment

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
    rows, picked = linear_sum_assignment(sub)
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

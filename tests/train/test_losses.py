"""Tests of owl_cl.train.losses against hand-worked NumPy values and SciPy (docs/reference.md
§3)."""

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from owl_cl.testing import devices
from owl_cl.train import losses

A, G = 0.3, 2.0
# Jitted once per shape: eager dispatch of the many small ops is much slower on CPU.
DET = jax.jit(losses.detection_loss)
DETN = jax.jit(losses.detection_loss, static_argnames="normalization")
DERPP = jax.jit(losses.der_plus_plus_loss)
COST = jax.jit(losses.matching_cost)


# ---------------------------------------------------------------- independent NumPy helpers


def np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def np_xyxy(b):
  cx, cy, w, h = np.moveaxis(b, -1, 0)
  return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def np_giou_pair(a, b):
  """GIoU of two single xyxy boxes, textbook formula."""
  iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
  ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
  inter = iw * ih
  union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
  enc = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
  return inter / union - (enc - union) / enc


def np_focal(x, y):
  p = np_sigmoid(x)
  return np.where(y > 0, -A * (1 - p) ** G * np.log(p), -(1 - A) * p**G * np.log(1 - p))


def np_cost(logits, pboxes, labels, boxes):
  """Reference matching cost [T, K] for one image (labels/boxes include padding)."""
  t, k = logits.shape[0], labels.shape[0]
  p = np_sigmoid(logits)
  elem = A * (1 - p) ** G * -np.log(p) - (1 - A) * p**G * -np.log(1 - p)
  real = labels[:, 1:].sum(-1) > 0
  cost = np.zeros((t, k))
  px, bx = np_xyxy(pboxes), np_xyxy(boxes)
  for i in range(t):
    for j in range(k):
      cost[i, j] = (
        (elem[i, 1:] * labels[j, 1:]).sum()
        + np.abs(pboxes[i] - boxes[j]).sum()
        - np_giou_pair(px[i], bx[j])
      )
  pad = (cost[:, real].max() if real.any() else 1.0) * 1.1 + 10
  cost[:, ~real] = pad
  return cost, real


def random_problem(rng, b, t, m, q, n_real=None):
  logits = rng.normal(0, 2, (b, t, q)).astype(np.float32)
  cxcy = rng.uniform(0.2, 0.8, (b, t, 2))
  wh = rng.uniform(0.05, 0.4, (b, t, 2))
  pboxes = np.concatenate([cxcy, wh], -1).astype(np.float32)
  labels = np.zeros((b, m, q), np.float32)
  boxes = np.zeros((b, m, 4), np.float32)
  for i in range(b):
    n = rng.integers(0, m + 1) if n_real is None else n_real
    for j in range(m):
      if j < n:
        labels[i, j, rng.choice(np.arange(1, q), size=rng.integers(1, 3), replace=False)] = 1
        boxes[i, j] = [*rng.uniform(0.2, 0.8, 2), *rng.uniform(0.05, 0.4, 2)]
      else:
        labels[i, j, 0] = 1
    perm = rng.permutation(m)  # padding not only trailing
    labels[i], boxes[i] = labels[i, perm], boxes[i, perm]
  return logits, pboxes, labels, boxes


def with_padding(labels, boxes):
  b, _, q = labels.shape
  pl = np.zeros((b, 1, q), np.float32)
  pl[..., 0] = 1
  return (np.concatenate([labels, pl], 1), np.concatenate([boxes, np.zeros((b, 1, 4))], 1))


# ---------------------------------------------------------------- boxes


def test_box_conversions_roundtrip():
  b = np.array([[0.5, 0.4, 0.2, 0.6]], np.float32)
  xyxy = losses.box_cxcywh_to_xyxy(b)
  np.testing.assert_allclose(xyxy, [[0.4, 0.1, 0.6, 0.7]], atol=1e-7)
  np.testing.assert_allclose(losses.box_xyxy_to_cxcywh(xyxy), b, atol=1e-7)


@pytest.mark.slow
def test_iou_giou_hand_computed():
  a = jnp.array([[0.0, 0.0, 2.0, 2.0]])
  cases = {  # box b: (IoU, GIoU) computed by hand
    "identical": ([0.0, 0.0, 2.0, 2.0], 1.0, 1.0),
    # union 4 + 2 = 6, enclosing [0,0,4,2] = 8 -> GIoU = 0 - 2/8.
    "disjoint": ([3.0, 0.0, 4.0, 2.0], 0.0, -0.25),
    # inside: union = enclosing = 4 -> GIoU = IoU = 1/4.
    "nested": ([0.5, 0.5, 1.5, 1.5], 0.25, 0.25),
    # intersection 1, union 7, enclosing [0,0,3,3] = 9 -> GIoU = 1/7 - 2/9.
    "partial": ([1.0, 1.0, 3.0, 3.0], 1 / 7, 1 / 7 - 2 / 9),
  }
  bs = jnp.array([c[0] for c in cases.values()])
  iou = losses.box_iou(a, bs)
  giou = losses.generalized_box_iou(a, bs)
  assert iou.shape == giou.shape == (1, 4)
  np.testing.assert_allclose(iou[0], [c[1] for c in cases.values()], atol=1e-5)
  np.testing.assert_allclose(giou[0], [c[2] for c in cases.values()], atol=1e-5)
  # Element-wise form and batching.
  pair = losses.generalized_box_iou(jnp.broadcast_to(a, (4, 4)), bs, all_pairs=False)
  np.testing.assert_allclose(pair, giou[0], atol=1e-6)
  batched = losses.generalized_box_iou(jnp.stack([bs, bs]), jnp.stack([bs, bs]))
  assert batched.shape == (2, 4, 4)
  np.testing.assert_allclose(jnp.diagonal(batched, axis1=1, axis2=2), 1.0, atol=1e-5)
  with pytest.raises(ValueError):
    losses.generalized_box_iou(a, bs, all_pairs=False)


# ---------------------------------------------------------------- focal


def test_focal_loss_hand_worked():
  x = np.array([0.0, 0.0, 2.0, -1.0], np.float32)
  y = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
  s2, s1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(1))  # sigmoid(2), sigmoid(-1)
  expected = [
    0.3 * 0.5**2 * math.log(2),  # x=0, y=1
    0.7 * 0.5**2 * math.log(2),  # x=0, y=0
    0.3 * (1 - s2) ** 2 * -math.log(s2),  # x=2, y=1
    0.7 * s1**2 * -math.log(1 - s1),  # x=-1, y=0
  ]
  got = losses.sigmoid_focal_loss(x, y, alpha=0.3, gamma=2.0)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  # The matching cost is pos - neg.
  pos = [0.3 * 0.25 * math.log(2), 0.3 * (1 - s2) ** 2 * -math.log(s2)]
  neg = [0.7 * 0.25 * math.log(2), 0.7 * s2**2 * -math.log(1 - s2)]
  np.testing.assert_allclose(
    losses.focal_matching_cost(jnp.array([0.0, 2.0])), np.subtract(pos, neg), rtol=1e-5
  )
  # Padded query slots (-1e6) cost nothing as negatives.
  assert float(losses.sigmoid_focal_loss(jnp.float32(-1e6), 0.0)) == 0.0


# ---------------------------------------------------------------- cost and matching


def test_matching_cost_matches_numpy():
  rng = np.random.default_rng(0)
  logits, pboxes, labels, boxes = random_problem(rng, 3, 7, 4, 5)
  labels_k, boxes_k = with_padding(labels, boxes)
  cost, mask = COST(logits, pboxes, labels_k, boxes_k)
  for i in range(3):
    ref, real = np_cost(
      logits[i].astype(np.float64),
      pboxes[i].astype(np.float64),
      labels_k[i],
      boxes_k[i].astype(np.float64),
    )
    np.testing.assert_array_equal(mask[i], real)
    np.testing.assert_allclose(cost[i], ref, rtol=1e-4, atol=1e-4)


def test_matching_cost_replaces_nan_and_inf():
  rng = np.random.default_rng(1)
  logits, pboxes, labels, boxes = random_problem(rng, 1, 4, 2, 3, n_real=2)
  labels_k, boxes_k = with_padding(labels, boxes)
  pboxes[0, 1] = np.nan
  cost, _ = COST(logits, pboxes, labels_k, boxes_k)
  assert np.isfinite(np.asarray(cost)).all()
  # All-padding image: constant 11.1.
  empty = np.zeros_like(labels_k)
  empty[..., 0] = 1
  cost, mask = COST(logits, np.nan_to_num(pboxes, nan=0.5), empty, boxes_k)
  assert not np.asarray(mask).any()
  np.testing.assert_allclose(cost, 11.1, rtol=1e-6)


@pytest.mark.parametrize("b,t,m", [(1, 5, 1), (3, 9, 4), (4, 16, 6), (2, 4, 6)])
def test_hungarian_equals_scipy(b, t, m):
  rng = np.random.default_rng(100 * b + t + m)
  q = 5
  logits, pboxes, labels, boxes = random_problem(rng, b, t, m, q)
  labels_k, boxes_k = with_padding(labels, boxes)
  cost, mask = COST(logits, pboxes, labels_k, boxes_k)
  got = np.asarray(jax.jit(losses.hungarian_matching)(cost, mask))
  assert got.shape == (b, t) and got.dtype == np.int32
  for i in range(b):
    ref_cost, real = np_cost(
      logits[i].astype(np.float64),
      pboxes[i].astype(np.float64),
      labels_k[i],
      boxes_k[i].astype(np.float64),
    )
    expected = np.full(t, m, np.int64)  # unmatched -> the appended padding instance (M)
    rows, cols = scipy.optimize.linear_sum_assignment(ref_cost)
    for r, c in zip(rows, cols):
      if real[c]:
        expected[r] = c
    np.testing.assert_array_equal(got[i], expected)
    # The real-target part of the optimum is the same when solving on all columns.
    if t >= m + 1:
      assert sorted(got[i][got[i] != m].tolist()) == np.flatnonzero(real).tolist()


@pytest.mark.slow
def test_hungarian_under_vmap_and_validation():
  rng = np.random.default_rng(3)
  cost = rng.normal(size=(2, 3, 6, 4)).astype(np.float32)
  mask = np.ones((2, 3, 4), bool)
  mask[..., -1] = False
  mask[1, 2, 0] = False
  direct = losses.hungarian_matching(cost, mask)
  vmapped = jax.jit(jax.vmap(losses.hungarian_matching))(cost, mask)
  np.testing.assert_array_equal(direct, vmapped)
  # vmap with an unbatched mask (broadcast to the batch).
  v2 = jax.vmap(losses.hungarian_matching, in_axes=(0, None))(cost, mask[0])
  np.testing.assert_array_equal(v2[0], direct[0])
  with pytest.raises(ValueError):
    losses.hungarian_matching(cost, mask[..., :2])


# ---------------------------------------------------------------- full detection loss


@pytest.mark.slow
def test_detection_loss_hand_worked():
  """T=2 tokens, Q=3 (slot 0 = ''), one real box (label 1) plus one padding instance."""
  logits = np.array(
    [
      [
        [0.5, 2.0, -1.0],  # token 0: confident in label 1, near the box
        [0.0, -1.0, 1.0],
      ]
    ],  # token 1: far away
    np.float32,
  )
  pboxes = np.array([[[0.5, 0.5, 0.2, 0.2], [0.2, 0.2, 0.1, 0.1]]], np.float32)
  labels = np.array([[[0, 1, 0], [1, 0, 0]]], np.float32)
  gt = np.array([0.55, 0.5, 0.2, 0.3])
  boxes = np.array([[gt, [0.0, 0.0, 0.0, 0.0]]], np.float32)

  # Matching by hand: cost(t) = (pos-neg)(x[t,1]) + L1 cxcywh - GIoU.
  def cost(t):
    p = np_sigmoid(logits[0, t, 1].astype(np.float64))
    cls = A * (1 - p) ** G * -np.log(p) - (1 - A) * p**G * -np.log(1 - p)
    return cls + np.abs(pboxes[0, t] - gt).sum() - np_giou_pair(np_xyxy(pboxes[0, t]), np_xyxy(gt))

  assert cost(0) < cost(1)  # token 0 is matched
  # Class loss: token 0 target [1, 0], token 1 target [0, 0], over slots 1..2, / 1 positive.
  x = logits[0, :, 1:].astype(np.float64)
  y = np.array([[1.0, 0.0], [0.0, 0.0]])
  cls = np_focal(x, y).sum() / 1
  src, tgt = np_xyxy(pboxes[0, 0].astype(np.float64)), np_xyxy(gt)
  l1 = np.abs(src - tgt).sum() / 1
  gi = (1 - np_giou_pair(src, tgt)) / 1
  # Worked numbers: src xyxy (0.4,0.4,0.6,0.6), tgt (0.45,0.35,0.65,0.65):
  # L1 = .05+.05+.05+.05 = 0.2; inter = .15*.2 = .03, union = .04+.06-.03 = .07,
  # enclosing = .25*.3 = .075 -> GIoU = 3/7 - .005/.075.
  np.testing.assert_allclose(l1, 0.2, atol=1e-12)
  np.testing.assert_allclose(gi, 1 - (3 / 7 - 0.005 / 0.075), atol=1e-12)

  out = DET(logits, pboxes, labels, boxes)
  np.testing.assert_allclose(out["loss_class"], cls, rtol=1e-5)
  np.testing.assert_allclose(out["loss_bbox"], l1, rtol=1e-5)
  np.testing.assert_allclose(out["loss_giou"], gi, rtol=1e-5)
  np.testing.assert_allclose(out["loss"], cls + l1 + gi, rtol=1e-5)
  np.testing.assert_allclose(out["per_example"], [cls + l1 + gi], rtol=1e-5)
  assert set(out) == {"loss", "per_example", "loss_class", "loss_bbox", "loss_giou"}

  # Weights scale the terms (and the cost; token 0 still matched).
  w = DET(logits, pboxes, labels, boxes, class_weight=2.0, bbox_weight=5.0, giou_weight=0.5)
  np.testing.assert_allclose(w["loss"], 2 * cls + 5 * l1 + 0.5 * gi, rtol=1e-5)

  # Swap the tokens: now token 1 must be matched and the loss is the same.
  sw = DET(logits[:, ::-1], pboxes[:, ::-1], labels, boxes)
  np.testing.assert_allclose(sw["loss"], out["loss"], rtol=1e-6)


def test_perfect_predictions_zero_box_loss_and_padding_ignored():
  rng = np.random.default_rng(5)
  b, t, m, q = 2, 12, 3, 6
  _, _, labels, boxes = random_problem(rng, b, t, m, q, n_real=2)
  logits = np.full((b, t, q), -8.0, np.float32)
  pboxes = np.tile(np.array([0.1, 0.1, 0.05, 0.05], np.float32), (b, t, 1))
  for i in range(b):
    for j, k in enumerate(np.flatnonzero(labels[i, :, 1:].sum(-1) > 0)):
      pboxes[i, 3 * j + 1] = boxes[i, k]
      logits[i, 3 * j + 1] = np.where(labels[i, k] > 0, 8.0, -8.0)
  out = DET(logits, pboxes, labels, boxes)
  assert float(out["loss_bbox"]) < 1e-6
  assert float(out["loss_giou"]) < 1e-3  # GIoU's eps 1e-6 over areas ~1e-2: ~1e-4
  assert float(out["loss_class"]) < 1e-4

  # Garbage boxes on padding instances change nothing.
  junk = boxes.copy()
  pad = labels[..., 1:].sum(-1) == 0
  junk[pad] = [0.9, 0.1, 3.0, 7.0]
  out2 = DET(logits, pboxes, labels, junk)
  for k in out:
    np.testing.assert_allclose(out2[k], out[k], rtol=1e-6, atol=1e-7)
  # An image with no real instance: zero box losses, class loss of negatives only.
  empty = np.zeros_like(labels)
  empty[..., 0] = 1
  out3 = DET(logits, pboxes, empty, junk)
  assert float(out3["loss_bbox"]) == 0.0 and float(out3["loss_giou"]) == 0.0
  np.testing.assert_allclose(
    out3["loss_class"],
    np_focal(logits[..., 1:].astype(np.float64), 0).sum((1, 2)).mean(),
    rtol=1e-5,
  )


@pytest.mark.slow
def test_per_example_normalisation_and_mask():
  rng = np.random.default_rng(7)
  logits, pboxes, labels, boxes = random_problem(rng, 3, 10, 4, 5, n_real=None)
  labels[0, 0, 1:] = 1  # a multi-label instance (more positives than boxes)
  out = DET(logits, pboxes, labels, boxes)
  dup = lambda x: np.concatenate([x, x], 0)
  out2 = DET(dup(logits), dup(pboxes), dup(labels), dup(boxes))
  np.testing.assert_allclose(out2["loss"], out["loss"], rtol=1e-6)
  np.testing.assert_allclose(out2["per_example"], dup(np.asarray(out["per_example"])), rtol=1e-6)
  singles = [
    DET(logits[i : i + 1], pboxes[i : i + 1], labels[i : i + 1], boxes[i : i + 1])["loss"]
    for i in range(3)
  ]
  np.testing.assert_allclose(out["per_example"], singles, rtol=1e-6)
  np.testing.assert_allclose(out["loss"], np.mean(singles), rtol=1e-6)
  # example_mask: masked images contribute nothing, the rest are averaged.
  masked = DET(logits, pboxes, labels, boxes, example_mask=np.array([True, False, True]))
  np.testing.assert_allclose(masked["loss"], (singles[0] + singles[2]) / 2, rtol=1e-6)


@pytest.mark.slow
def test_jit_and_finite_gradients():
  rng = np.random.default_rng(9)
  logits, pboxes, labels, boxes = random_problem(rng, 2, 8, 3, 5)
  logits[:, :, -1] = -1e6  # a padded query slot
  pboxes = jnp.asarray(pboxes)

  def f(lg, pb):
    return losses.detection_loss(lg, pb, labels, boxes)["loss"]

  eager = DET(logits, pboxes, labels, boxes)["loss"]
  val, (gl, gb) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(logits, pboxes)
  np.testing.assert_allclose(val, eager, rtol=1e-6)
  assert np.isfinite(np.asarray(gl)).all() and np.isfinite(np.asarray(gb)).all()
  assert np.abs(np.asarray(gl)).sum() > 0 and np.abs(np.asarray(gb)).sum() > 0
  np.testing.assert_array_equal(np.asarray(gl)[:, :, -1], 0.0)
  # bf16 predictions work and are close.
  bf = DET(jnp.asarray(logits, jnp.bfloat16), pboxes.astype(jnp.bfloat16), labels, boxes)["loss"]
  np.testing.assert_allclose(bf, eager, rtol=0.05)
  with pytest.raises(ValueError):
    DET(logits, pboxes, labels[:, :, :3], boxes)


# ---------------------------------------------------------------- DER++


@pytest.mark.slow
def test_distillation_mse_padding_and_mask():
  rng = np.random.default_rng(11)
  b, t, q = 3, 4, 5
  z = rng.normal(size=(b, t, q)).astype(np.float32)
  s = rng.normal(size=(b, t, q)).astype(np.float32)
  z[:, :, 3:] = s[:, :, 3:] = -1e6  # padded slots in both
  expected = np.square(z[:, :, :3] - s[:, :, :3]).sum() / (b * t * q)
  np.testing.assert_allclose(losses.distillation_mse(z, s), expected, rtol=1e-6)
  # -1e6 rounded by bf16 in the current logits still contributes 0.
  zb = jnp.asarray(z, jnp.bfloat16).astype(jnp.float32)
  assert float(zb[0, 0, 4]) != -1e6
  expected_b = np.square(np.asarray(zb)[:, :, :3] - s[:, :, :3]).sum() / (b * t * q)
  np.testing.assert_allclose(losses.distillation_mse(zb, s), expected_b, rtol=1e-5)
  qm = np.ones((b, q), bool)
  qm[:, 3:] = False
  np.testing.assert_allclose(losses.distillation_mse(zb, s, query_mask=qm), expected_b, rtol=1e-5)
  # Example mask: image 1 ignored, mean over the other two.
  m = np.array([1.0, 0.0, 1.0])
  per = np.square(z[:, :, :3] - s[:, :, :3]).sum((1, 2)) / (t * q)
  np.testing.assert_allclose(
    losses.distillation_mse(z, s, example_mask=m), (per[0] + per[2]) / 2, rtol=1e-6
  )
  np.testing.assert_allclose(losses.distillation_mse(z, s, example_mask=np.zeros(b)), 0.0)
  # No gradient into the stored logits; finite gradient into the current ones.
  g, gs = jax.grad(lambda a, c: losses.distillation_mse(a, c), argnums=(0, 1))(zb, s)
  assert np.isfinite(np.asarray(g)).all() and not np.asarray(gs).any()
  np.testing.assert_array_equal(np.asarray(g)[:, :, 3:], 0.0)


@pytest.mark.slow
def test_der_plus_plus_composition_and_replay_mask():
  rng = np.random.default_rng(13)
  ln, pn, yn, bn = random_problem(rng, 2, 8, 3, 5)
  lr, pr, yr, br = random_problem(rng, 3, 8, 4, 6)
  stored = (lr + rng.normal(size=lr.shape)).astype(np.float32)
  new_o, new_t = dict(pred_logits=ln, pred_boxes=pn), dict(labels=yn, boxes=bn)
  rep_o, rep_t = dict(pred_logits=lr, pred_boxes=pr), dict(labels=yr, boxes=br)
  out = DERPP(new_o, new_t, rep_o, rep_t, stored, alpha=2.0, beta=1.0)
  det_new = DET(ln, pn, yn, bn)["loss"]
  det_rep = DET(lr, pr, yr, br)["loss"]
  mse = np.square(lr - stored).mean()
  np.testing.assert_allclose(out["new_loss"], det_new, rtol=1e-6)
  np.testing.assert_allclose(out["replay_loss"], det_rep, rtol=1e-6)
  np.testing.assert_allclose(out["distill_loss"], mse, rtol=1e-5)
  np.testing.assert_allclose(out["loss"], det_new + 2.0 * mse + 1.0 * det_rep, rtol=1e-5)
  assert out["per_example_new"].shape == (2,) and out["per_example_replay"].shape == (3,)

  # Replay mask: the masked example's content is irrelevant; the rest are averaged.
  mask = np.array([True, False, True])
  lr2, pr2, stored2 = lr.copy(), pr.copy(), stored.copy()
  lr2[1] += 50.0
  pr2[1] = 0.9
  stored2[1] = -7.0
  a = DERPP(new_o, new_t, rep_o, rep_t, stored, replay_mask=mask)
  b = DERPP(new_o, new_t, dict(pred_logits=lr2, pred_boxes=pr2), rep_t, stored2, replay_mask=mask)
  for k in ("loss", "replay_loss", "distill_loss"):
    np.testing.assert_allclose(a[k], b[k], rtol=1e-6)
  per_rep = np.asarray(out["per_example_replay"])
  np.testing.assert_allclose(a["replay_loss"], (per_rep[0] + per_rep[2]) / 2, rtol=1e-6)
  mse_kept = np.square(lr[[0, 2]] - stored[[0, 2]]).mean()
  np.testing.assert_allclose(a["distill_loss"], mse_kept, rtol=1e-5)
  np.testing.assert_allclose(a["loss"], det_new + 2.0 * mse_kept + a["replay_loss"], rtol=1e-5)
  # Everything masked, or no replay at all: L = L_det(new).
  none = DERPP(new_o, new_t, rep_o, rep_t, stored, replay_mask=np.zeros(3, bool))
  np.testing.assert_allclose(none["loss"], det_new, rtol=1e-6)
  np.testing.assert_allclose(DERPP(new_o, new_t)["loss"], det_new, rtol=1e-6)

  # Gradients through the whole objective are finite and masked replay gets none.
  def f(lr_):
    return DERPP(
      new_o, new_t, dict(pred_logits=lr_, pred_boxes=pr), rep_t, stored, replay_mask=mask
    )["loss"]

  g = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(lr)))
  assert np.isfinite(g).all() and not g[1].any() and g[0].any()


# ---------------------------------------------------------------- sharded batch


_SHARDED_SCRIPT = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from owl_cl.train import losses
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    b, t, m, q = 16, 12, 4, 6
    logits = rng.normal(0, 2, (b, t, q)).astype(np.float32)
    pboxes = np.concatenate([rng.uniform(.2, .8, (b, t, 2)), rng.uniform(.05, .4, (b, t, 2))],
                            -1).astype(np.float32)
    labels = np.zeros((b, m, q), np.float32); labels[..., 0] = 1
    boxes = np.zeros((b, m, 4), np.float32)
    for i in range(b):
      for j in range(rng.integers(0, m + 1)):
        labels[i, j] = 0; labels[i, j, rng.integers(1, q)] = 1
        boxes[i, j] = [*rng.uniform(.2, .8, 2), *rng.uniform(.05, .4, 2)]
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))
    args = [jax.device_put(x, data) for x in (logits, pboxes, labels, boxes)]
    def f(lg, pb, lb, bx):
      out = losses.detection_loss(lg, pb, lb, bx)
      g = jax.grad(lambda a: losses.detection_loss(a, pb, lb, bx)["loss"])(lg)
      return out["loss"], out["per_example"], g
    step = jax.jit(f, in_shardings=(data,) * 4)
    loss, per, g = step(*args)
    ref = losses.detection_loss(logits, pboxes, labels, boxes)
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(per, ref["per_example"], rtol=1e-5)
    assert np.isfinite(np.asarray(g)).all()
    print("SHARDED_OK")
""")


@pytest.mark.slow
def test_sharded_batch_over_8_cpu_devices():
  env = devices.cpu_devices_env(8)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  res = subprocess.run(
    [sys.executable, "-c", _SHARDED_SCRIPT],
    env=env,
    cwd=root,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert res.returncode == 0 and "SHARDED_OK" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_per_batch_normalization_hand_worked():
  """normalization='per_batch' (released code): the batch's sums over its total counts.

  Image 0 is the hand-worked image of `test_detection_loss_hand_worked` (1 box, 1 positive:
  L1 0.2, 1 - GIoU = 1 - (3/7 - 0.005/0.075)); image 1 has the same predictions and no real
  instance (0 positives, 0 boxes): its class sum is the focal loss of all its logits against
  0, its box sums are 0. Per batch: class = (cls_0 + neg_1) / 1, L1 = 0.2 / 1,
  GIoU = gi / 1. Per image: the mean over the 2 images of each image's normalised terms.
  """
  logits = np.array([[[0.5, 2.0, -1.0], [0.0, -1.0, 1.0]]], np.float32)
  pboxes = np.array([[[0.5, 0.5, 0.2, 0.2], [0.2, 0.2, 0.1, 0.1]]], np.float32)
  gt = np.array([0.55, 0.5, 0.2, 0.3])
  labels0 = np.array([[[0, 1, 0], [1, 0, 0]]], np.float32)
  labels1 = np.array([[[1, 0, 0], [1, 0, 0]]], np.float32)  # padding only
  boxes = np.array([[gt, [0.0, 0.0, 0.0, 0.0]]], np.float32)
  cat = lambda a, b: np.concatenate([a, b], 0)
  x = logits[0, :, 1:].astype(np.float64)
  cls0 = np_focal(x, np.array([[1.0, 0.0], [0.0, 0.0]])).sum()
  neg1 = np_focal(x, 0).sum()
  l1 = 0.2
  gi = 1 - (3 / 7 - 0.005 / 0.075)
  args = (cat(logits, logits), cat(pboxes, pboxes), cat(labels0, labels1), cat(boxes, boxes))
  batch = DETN(*args, normalization="per_batch")
  # float32 losses of O(1) values: ~1e-7 relative rounding; 1e-5 leaves margin.
  np.testing.assert_allclose(batch["loss_class"], cls0 + neg1, rtol=1e-5)
  np.testing.assert_allclose(batch["loss_bbox"], l1, rtol=1e-5)
  np.testing.assert_allclose(batch["loss_giou"], gi, rtol=1e-5)
  np.testing.assert_allclose(batch["loss"], cls0 + neg1 + l1 + gi, rtol=1e-5)
  image = DETN(*args)  # default 'per_image'
  np.testing.assert_allclose(image["loss"], (cls0 + l1 + gi + neg1) / 2, rtol=1e-5)
  # per_example is per image in both forms.
  np.testing.assert_allclose(batch["per_example"], [cls0 + l1 + gi, neg1], rtol=1e-5)
  # A masked image adds nothing to the sums nor to the counts.
  masked = DETN(*args, normalization="per_batch", example_mask=np.array([True, False]))
  np.testing.assert_allclose(masked["loss"], cls0 + l1 + gi, rtol=1e-5)
  with pytest.raises(ValueError, match="loss.normalization='per_device'"):
    DETN(*args, normalization="per_device")

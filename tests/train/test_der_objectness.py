"""DER++ on OWLv2's class and objectness logits (owl_cl/train/der.py, docs/owlv2.md).

Hand-worked values of the objectness distillation, its place in the DER++ objective, and the
v1 objective unchanged (no objectness logits, no stored objectness, or weight 0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.train import losses


def _problem():
  """One new and two replayed images, T = 2 tokens, Q = 2 queries, M = 1 instance."""
  logits = np.array([[[2.0, -1.0], [0.0, 1.0]]], np.float32)  # [1, 2, 2]
  boxes = np.array([[[0.3, 0.3, 0.2, 0.2], [0.7, 0.7, 0.2, 0.2]]], np.float32)
  labels = np.array([[[0.0, 1.0]]], np.float32)  # the instance is of query 1
  target_boxes = np.array([[[0.3, 0.3, 0.2, 0.2]]], np.float32)
  new_o = dict(pred_logits=logits, pred_boxes=boxes)
  new_t = dict(labels=labels, boxes=target_boxes)
  rep_o = dict(
    pred_logits=np.concatenate([logits, logits + 1.0]),
    pred_boxes=np.concatenate([boxes, boxes]),
    # Objectness of the replays [2, 2].
    objectness_logits=np.array([[1.0, 2.0], [0.0, 0.0]], np.float32),
  )
  rep_t = dict(labels=np.concatenate([labels, labels]), boxes=np.concatenate([target_boxes] * 2))
  stored_logits = rep_o["pred_logits"] - 1.0  # every class slot off by exactly 1: MSE_class 1
  stored_objectness = np.array([[0.0, 0.0], [3.0, -1.0]], np.float32)
  return new_o, new_t, rep_o, rep_t, stored_logits, stored_objectness


def test_objectness_distillation_hand_worked():
  _, _, rep_o, _, _, stored = _problem()
  # Image 0: ((1-0)^2 + (2-0)^2) / 2 = 2.5; image 1: ((0-3)^2 + (0+1)^2) / 2 = 5.
  mse = losses.objectness_distillation_mse(rep_o["objectness_logits"], stored)
  np.testing.assert_allclose(mse, (2.5 + 5.0) / 2, rtol=1e-7)
  masked = losses.objectness_distillation_mse(
    rep_o["objectness_logits"], stored, example_mask=np.array([True, False])
  )
  np.testing.assert_allclose(masked, 2.5, rtol=1e-7)
  # The stored logits get no gradient; d/dx of image 0's term (weight 1/2 of the mean):
  # 2 (x - s) / T / 2 images = (x - s) / 2.
  g, gs = jax.grad(losses.objectness_distillation_mse, argnums=(0, 1))(
    jnp.asarray(rep_o["objectness_logits"]), jnp.asarray(stored)
  )
  np.testing.assert_allclose(g, (rep_o["objectness_logits"] - stored) / 2, rtol=1e-6)
  assert not np.asarray(gs).any()


@pytest.mark.slow
def test_der_plus_plus_with_objectness_hand_worked():
  new_o, new_t, rep_o, rep_t, stored_logits, stored_obj = _problem()
  v1 = losses.der_plus_plus_loss(
    new_o, new_t, rep_o, rep_t, stored_logits, alpha=2.0, beta=1.0
  )  # no stored objectness: the class logits only
  out = losses.der_plus_plus_loss(
    new_o,
    new_t,
    rep_o,
    rep_t,
    stored_logits,
    stored_objectness=stored_obj,
    objectness_distill_weight=0.5,
    alpha=2.0,
    beta=1.0,
  )
  # MSE_class = 1 (every slot off by 1), MSE_objectness = 3.75 (above), w = 0.5.
  np.testing.assert_allclose(v1["distill_loss"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(out["distill_objectness"], 3.75, rtol=1e-6)
  np.testing.assert_allclose(out["distill_loss"], 1.0 + 0.5 * 3.75, rtol=1e-6)
  np.testing.assert_allclose(
    out["loss"], v1["new_loss"] + 2.0 * (1.0 + 0.5 * 3.75) + v1["replay_loss"], rtol=1e-6
  )
  np.testing.assert_allclose(out["loss"] - v1["loss"], 2.0 * 0.5 * 3.75, rtol=1e-5)
  # Replay mask: the masked image's objectness counts nowhere (image 0 only: 2.5).
  masked = losses.der_plus_plus_loss(
    new_o,
    new_t,
    rep_o,
    rep_t,
    stored_logits,
    stored_objectness=stored_obj,
    replay_mask=np.array([True, False]),
  )
  np.testing.assert_allclose(masked["distill_objectness"], 2.5, rtol=1e-6)
  np.testing.assert_allclose(masked["distill_loss"], 1.0 + 1.0 * 2.5, rtol=1e-6)


def test_v1_objective_unchanged():
  """Without objectness logits (v1), without stored objectness (a store of before), or at
  weight 0, the result is the class-logit DER++ bit for bit, with no objectness entry."""
  new_o, new_t, rep_o, rep_t, stored_logits, stored_obj = _problem()
  v1_rep = {k: v for k, v in rep_o.items() if k != "objectness_logits"}
  reference = losses.der_plus_plus_loss(new_o, new_t, v1_rep, rep_t, stored_logits)
  variants = [
    losses.der_plus_plus_loss(
      new_o, new_t, v1_rep, rep_t, stored_logits, stored_objectness=stored_obj
    ),
    losses.der_plus_plus_loss(new_o, new_t, rep_o, rep_t, stored_logits),
    losses.der_plus_plus_loss(
      new_o,
      new_t,
      rep_o,
      rep_t,
      stored_logits,
      stored_objectness=stored_obj,
      objectness_distill_weight=0.0,
    ),
  ]
  for out in variants:
    assert out.keys() == reference.keys()
    for k in reference:
      np.testing.assert_array_equal(out[k], reference[k], err_msg=k)

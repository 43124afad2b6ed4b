"""OWLv2's objectness loss (owl_cl.train.objectness_loss) and its term in detection_loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.train import losses
from owl_cl.train import objectness_loss

LN2 = float(np.log(2.0))


def test_hand_worked_bce_and_focal():
  """Logits 0 and ln 3 (p = 1/2, 3/4), token 0 matched. alpha 0.5, gamma 0: 0.5 ln 2 +
  0.5 ln 4 = 1.5 ln 2 over 1 box. alpha 0.3, gamma 2: 0.3 (1/2)^2 ln 2 + 0.7 (3/4)^2 ln 4."""
  logits = jnp.array([[0.0, np.log(3.0)], [0.0, np.log(3.0)]])
  matched = jnp.array([[True, False], [False, False]])
  out = objectness_loss.objectness_loss_per_example(
    logits, matched, focal_alpha=0.5, focal_gamma=0.0
  )
  # Image 1 has no match: both tokens negative, ln 2 / 2 + ln 4 / 2, divided by max(0, 1).
  np.testing.assert_allclose(out["loss_objectness"], [1.5 * LN2, 0.5 * LN2 + LN2], rtol=1e-6)
  np.testing.assert_array_equal(out["num_boxes"], [1.0, 0.0])
  focal = objectness_loss.objectness_loss_per_example(logits, matched)  # 0.3, 2.0
  want = 0.3 * 0.25 * LN2 + 0.7 * 0.5625 * 2 * LN2
  np.testing.assert_allclose(focal["loss_objectness"][0], want, rtol=1e-6)


def test_equals_the_class_focal_loss_at_hard_targets():
  """Independent reference: losses.sigmoid_focal_loss (scenic's soft-target form)."""
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (3, 7)).astype(np.float32)
  matched = rng.uniform(size=(3, 7)) < 0.3
  out = objectness_loss.objectness_loss_per_example(logits, matched)
  ref = losses.sigmoid_focal_loss(logits, matched.astype(np.float32)).sum(axis=1)
  np.testing.assert_allclose(out["sum_objectness"], ref, rtol=1e-5)
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    objectness_loss.objectness_loss_per_example(logits, matched[:, :3])


def _one_box_case():
  """2 tokens, one real box equal to token 0's box with a high class logit: the matcher must
  pick token 0."""
  pred_logits = jnp.array([[[-1e6, 4.0], [-1e6, -4.0]]])  # [B=1, T=2, Q=2], slot 0 padding
  pred_boxes = jnp.array([[[0.3, 0.3, 0.2, 0.2], [0.7, 0.7, 0.2, 0.2]]])
  labels = jnp.array([[[0.0, 1.0]]])  # [B, M=1, Q]
  boxes = jnp.array([[[0.3, 0.3, 0.2, 0.2]]])
  return pred_logits, pred_boxes, labels, boxes


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["per_image", "per_batch"])
def test_detection_loss_term_and_v1_unchanged(normalization):
  args = _one_box_case()
  kw = dict(focal_alpha=0.5, focal_gamma=0.0, normalization=normalization, matcher="jax")
  v1 = losses.detection_loss(*args, **kw)
  assert "loss_objectness" not in v1
  obj = jnp.array([[0.0, np.log(3.0)]])
  for off in (
    losses.detection_loss(*args, **kw, objectness_logits=obj),  # weight 0 (default)
    losses.detection_loss(*args, **kw, objectness_weight=0.5),  # no logits (v1 model)
  ):
    assert set(off) == set(v1)
    for k in v1:
      np.testing.assert_array_equal(off[k], v1[k], err_msg=k)
  on = losses.detection_loss(*args, **kw, objectness_logits=obj, objectness_weight=0.5)
  # Token 0 matched: 1.5 ln 2 (hand-worked above), weighted 0.5 into loss and per_example.
  np.testing.assert_allclose(on["loss_objectness"], 1.5 * LN2, rtol=1e-6)
  np.testing.assert_allclose(on["loss"], v1["loss"] + 0.75 * LN2, rtol=1e-6)
  np.testing.assert_allclose(on["per_example"], v1["per_example"] + 0.75 * LN2, rtol=1e-6)
  for k in ("loss_class", "loss_bbox", "loss_giou"):
    np.testing.assert_array_equal(on[k], v1[k])


@pytest.mark.slow
def test_der_plus_plus_carries_objectness_in_both_halves():
  pred_logits, pred_boxes, labels, boxes = _one_box_case()
  obj = jnp.array([[0.0, np.log(3.0)]])
  outputs = {"pred_logits": pred_logits, "pred_boxes": pred_boxes, "objectness_logits": obj}
  targets = {"labels": labels, "boxes": boxes}
  kw = dict(focal_alpha=0.5, focal_gamma=0.0, matcher="jax", alpha=0.0, beta=1.0)
  with_obj = losses.der_plus_plus_loss(
    outputs, targets, outputs, targets, pred_logits, objectness_weight=0.5, **kw
  )
  plain = losses.der_plus_plus_loss(
    {k: outputs[k] for k in ("pred_logits", "pred_boxes")},
    targets,
    {k: outputs[k] for k in ("pred_logits", "pred_boxes")},
    targets,
    pred_logits,
    objectness_weight=0.5,
    **kw,
  )
  np.testing.assert_allclose(with_obj["loss"], plain["loss"] + 2 * 0.75 * LN2, rtol=1e-6)
  np.testing.assert_allclose(with_obj["loss_objectness"], 1.5 * LN2, rtol=1e-6)
  # Gradient: the objectness logits get one, as the head's input is cut (model test).
  g = jax.grad(
    lambda o: losses.detection_loss(
      pred_logits, pred_boxes, labels, boxes, objectness_logits=o, objectness_weight=0.5
    )["loss"]
  )(obj)
  assert float(jnp.abs(g).max()) > 0

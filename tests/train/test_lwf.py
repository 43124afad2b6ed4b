"""LwF: distillation to the pre-trained model on the new images (docs/baselines.md "LwF")."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import model as model_lib
from owl_cl.testing.batches import detection_batch
from owl_cl.train import lwf
from owl_cl.train import optim
from owl_cl.train import sharding
from owl_cl.train import step as step_lib
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import LwfSpec

PAD = -1e6  # the model's logit on padded query slots


def test_class_loss_hand_worked():
  # One image, two tokens, queries [real, padded]. Token 0: teacher 0 (p_t = 1/2), student
  # 2 ln 3, so at T = 2 p_s = sigmoid(ln 3) = 3/4: KL = 1/2 ln(2/3) + 1/2 ln(2) = 1/2 ln(4/3).
  # Token 1: both 1.0, KL 0. The padded slot is left out: the mean over the 2 real slots is
  # 1/4 ln(4/3), times T^2 = 4: ln(4/3) = 0.28768.
  teacher = jnp.array([[[0.0, PAD], [1.0, PAD]]])
  student = jnp.array([[[2 * math.log(3.0), 5.0], [1.0, -3.0]]])
  value = lwf.lwf_class_loss(student, teacher, temperature=2.0)
  # float32 logs of O(1) values: a few ulp of 0.29.
  np.testing.assert_allclose(float(value), math.log(4 / 3), rtol=1e-6)
  # The same slots named by a query mask.
  masked = lwf.lwf_class_loss(student, teacher, temperature=2.0, query_mask=jnp.array([[1, 0]]))
  np.testing.assert_allclose(float(masked), math.log(4 / 3), rtol=1e-6)
  # At T = 1: p_s = sigmoid(2 ln 3) = 9/10; KL = 1/2 ln(5/9) + 1/2 ln(5) = 1/2 ln(25/9).
  value = lwf.lwf_class_loss(student, teacher, temperature=1.0)
  np.testing.assert_allclose(float(value), 0.25 * math.log(25 / 9), rtol=1e-6)


@pytest.mark.slow
def test_class_loss_zero_at_agreement_and_weighted_images():
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.normal(size=(2, 3, 4)) * 3, jnp.float32)
  loss, grad = jax.value_and_grad(lambda s: lwf.lwf_class_loss(s, z, temperature=2.0))(z)
  assert abs(float(loss)) < 1e-6  # KL of equal distributions; float32 rounding of O(1) terms
  assert float(jnp.max(jnp.abs(grad))) < 1e-6
  # Example weights: the second image (weight 0) changes nothing.
  other = z.at[1].add(5.0)
  a = lwf.lwf_class_loss(other, z, temperature=2.0, example_mask=jnp.array([1.0, 0.0]))
  assert float(a) == pytest.approx(0.0, abs=1e-6)
  with pytest.raises(ValueError, match="temperature"):
    lwf.lwf_class_loss(z, z, temperature=0.0)


def test_box_loss_on_confident_tokens_only():
  # Token 0: teacher score sigmoid(2) = 0.88 >= 0.5, L1 = 0.1 + 0.2 + 0 + 0 = 0.3; token 1:
  # sigmoid(-2) = 0.12 < 0.5, left out whatever its boxes; the padded query never counts.
  teacher_logits = jnp.array([[[2.0, PAD], [-2.0, PAD]]])
  teacher_boxes = jnp.array([[[0.5, 0.5, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1]]])
  boxes = jnp.array([[[0.6, 0.3, 0.2, 0.2], [0.9, 0.9, 0.9, 0.9]]])
  value = lwf.lwf_box_loss(boxes, teacher_boxes, teacher_logits, threshold=0.5)
  np.testing.assert_allclose(float(value), 0.3, rtol=1e-6)
  none = lwf.lwf_box_loss(boxes, teacher_boxes, teacher_logits, threshold=0.95)
  assert float(none) == 0.0
  options = dict(weight=2.0, temperature=1.0, box_weight=3.0, box_threshold=0.5)
  terms = lwf.lwf_loss(
    {"pred_logits": teacher_logits, "pred_boxes": boxes},
    {"pred_logits": teacher_logits, "pred_boxes": teacher_boxes},
    options,
  )
  # The class term is 0 (same logits): the total is 3 * 0.3.
  np.testing.assert_allclose(float(terms["lwf_loss"]), 0.9, rtol=1e-6)


def _tiny():
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32
  )
  batch = detection_batch(np.random.default_rng(0), 2, num_queries=4, max_boxes=3, query_length=16)
  params = jax.jit(model.init)(
    jax.random.PRNGKey(0), jnp.asarray(batch["images"]), jnp.asarray(batch["queries"])
  )["params"]
  return model, batch, jax.device_get(params)


@pytest.mark.slow
def test_train_step_takes_the_teacher_as_an_argument():
  """One compiled step: teacher = the parameters gives LwF 0; another teacher a positive
  term, and the loss is the detection loss plus weight * the class term."""
  model, batch, params = _tiny()
  mesh = sharding.create_mesh(jax.devices()[:1])
  tx, _ = optim.create_optimizer(params, learning_rate=1e-3, total_steps=10, warmup_steps=0)
  options = dict(weight=2.0, temperature=2.0, box_weight=0.0, box_threshold=0.5)
  spec = step_lib.StepSpec(LossSpec(focal_alpha=0.3, focal_gamma=2.0), lwf=LwfSpec(**options))
  train_step = step_lib.make_train_step(model, tx, mesh, spec)
  inputs = sharding.shard_batch(batch, mesh)
  other = jax.tree.map(lambda x: x + 0.05 * np.sign(x + 1e-3), params)
  results = {}
  for name, teacher in (("self", params), ("other", other)):
    state = sharding.replicate(step_lib.create_train_state(params, tx), mesh)
    _, metrics = train_step(
      state, inputs, None, jax.random.PRNGKey(0), sharding.replicate(teacher, mesh)
    )
    results[name] = jax.device_get(metrics)
  # The tiny model has no dropout: student == teacher gives KL 0 (float32 rounding).
  assert abs(float(results["self"]["lwf_class"])) < 1e-6
  assert float(results["other"]["lwf_class"]) > 1e-4
  for m in results.values():
    np.testing.assert_allclose(m["loss"], m["new_loss"] + 2.0 * m["lwf_class"], rtol=1e-6)
  assert train_step._cache_size() == 1  # the teacher is an argument, not a traced constant

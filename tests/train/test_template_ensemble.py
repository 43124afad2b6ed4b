"""Prompt-template ensembling at evaluation (docs/reference.md §2, §4) against a NumPy
computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import model as model_lib
from owl_cl.eval import detection
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib

P, C, B = 3, 4, 2


@pytest.fixture(scope="module")
def setup():
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32, context_length=8
  )
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(B, 32, 32, 3)).astype(np.float32)
  queries = np.zeros((1, 2, 8), np.int32)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), images[:1], queries)["params"]
  # A non-trivial class head (its kernel starts near 0), so logit shift and scale vary per token.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: (
      x + 0.3 * jax.random.normal(jax.random.PRNGKey(len(str(p))), x.shape)
      if "class_head" in str(p)
      else x
    ),
    params,
  )
  embed_dim = model.config.embed_dim
  query_embeddings = rng.normal(size=(P, C, embed_dim)).astype(np.float32)
  images = jnp.asarray(images)
  forward = jax.jit(
    lambda p, im, q: model.apply(
      {"params": p},
      im,
      None,
      query_embeddings=q,
      query_mask=jnp.ones(q.shape[:2], bool),
      train=False,
    )
  )
  logits, boxes = _per_template_logits(forward, params, images, query_embeddings)
  return dict(
    model=model,
    params=params,
    images=images,
    q=query_embeddings,
    forward=forward,
    logits=logits,
    boxes=boxes,
  )


def _per_template_logits(forward, params, images, query_embeddings):
  """float64 [P, B, T, C]: one plain forward per template (the reference path)."""
  out = []
  for q in query_embeddings:
    res = forward(params, images, jnp.broadcast_to(jnp.asarray(q)[None], (B,) + q.shape))
    out.append(np.asarray(res["pred_logits"], np.float64))
  return np.stack(out), np.asarray(res["pred_boxes"])


def _ensemble_scores(model, params, images, q, mode):
  fn = jax.jit(lambda p, im, q: step_lib.template_ensemble_scores(model, p, im, q, ensemble=mode))
  return fn(params, images, q)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.slow
def test_scores_match_numpy_ensembling(setup):
  model, params, images, q = setup["model"], setup["params"], setup["images"], setup["q"]
  logits, boxes_ref = setup["logits"], setup["boxes"]
  assert logits.std() > 0.1  # the templates give different logits
  expected = {"logits": _sigmoid(logits.mean(0)), "probabilities": _sigmoid(logits).mean(0)}
  for mode, ref in expected.items():
    scores, boxes = _ensemble_scores(model, params, images, jnp.asarray(q), mode)
    assert scores.shape == (B, model.config.num_tokens, C) and scores.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(scores), ref, rtol=1e-5, atol=1e-6, err_msg=mode)
    np.testing.assert_allclose(np.asarray(boxes), boxes_ref, rtol=1e-6, atol=1e-6)
  # The two modes differ, and neither equals scoring the mean query embedding: the class head
  # normalises the query and applies (sim + shift) * scale per token.
  assert np.abs(expected["logits"] - expected["probabilities"]).max() > 1e-3
  mean_q, _ = _per_template_logits(setup["forward"], params, images, q.mean(0, keepdims=True))
  assert np.abs(_sigmoid(mean_q[0]) - expected["logits"]).max() > 1e-3


def test_predict_step_with_one_template_equals_plain_step(setup):
  model, params, images, q = setup["model"], setup["params"], setup["images"], setup["q"]
  mesh = sharding_lib.create_mesh()
  plain = step_lib.make_predict_step(model, mesh, top_k=5, multi_label=False)
  ensemble = step_lib.make_template_predict_step(model, mesh, top_k=5, multi_label=False)
  a = jax.device_get(plain(params, images, jnp.asarray(q[0])))
  b = jax.device_get(ensemble(params, images, jnp.asarray(q[:1])))
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["logits", "probabilities"])
def test_multi_label_predict_step_matches_reference_top_k(setup, mode):
  model, params, images, q = setup["model"], setup["params"], setup["images"], setup["q"]
  logits, boxes_ref = setup["logits"], setup["boxes"]
  ref = _sigmoid(logits.mean(0)) if mode == "logits" else _sigmoid(logits).mean(0)
  step = step_lib.make_template_predict_step(
    model, sharding_lib.create_mesh(), top_k=7, multi_label=True, ensemble=mode
  )
  scores, labels, boxes = jax.device_get(step(params, images, jnp.asarray(q)))
  flat = ref.reshape(B, -1)
  order = np.argsort(-flat, axis=1, kind="stable")[:, :7]
  np.testing.assert_allclose(scores, np.take_along_axis(flat, order, 1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(labels, order % C)
  np.testing.assert_allclose(
    boxes, np.take_along_axis(boxes_ref, (order // C)[..., None], 1), rtol=1e-6, atol=1e-6
  )
  # detection.ensemble_templates agrees on the [B, T, C, P] logits ('probabilities' alias).
  stacked = jnp.asarray(np.moveaxis(logits, 0, -1), jnp.float32)
  np.testing.assert_allclose(
    np.asarray(detection.ensemble_templates(stacked, average=mode)), ref, rtol=1e-5, atol=1e-6
  )


def test_bad_arguments(setup):
  model, params, images, q = setup["model"], setup["params"], setup["images"], setup["q"]
  with pytest.raises(ValueError, match="ensemble"):
    step_lib.template_ensemble_scores(model, params, images, jnp.asarray(q), ensemble="mean")
  with pytest.raises(ValueError, match="ensemble"):
    step_lib.make_template_predict_step(
      model, sharding_lib.create_mesh(), top_k=3, ensemble="probs_"
    )
  with pytest.raises(ValueError, match=r"\[P, C, E\]"):
    step_lib.template_ensemble_scores(model, params, images, jnp.asarray(q[0]))

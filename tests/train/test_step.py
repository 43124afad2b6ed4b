"""Train-step pieces: the distinct-query text path equals the plain forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import model as model_lib
from owl_cl.train import step as step_lib


def _setup():
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32, context_length=8
  )
  rng = np.random.default_rng(0)
  B, Q, L = 4, 6, 8
  vocab = np.zeros((5, L), np.int32)  # 5 distinct queries, row 0 = ''
  vocab[:, 0], vocab[:, 1] = 62, 63
  for i in range(1, 5):
    vocab[i, 1], vocab[i, 2] = i, 63
  queries = vocab[rng.integers(0, 5, (B, Q))]
  queries[:, 0] = vocab[0]
  queries[1, 5] = 0  # an all-zero (masked) padding row
  images = rng.uniform(size=(B, 32, 32, 3)).astype(np.float32)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), images, queries)["params"]
  # Non-trivial class head (its kernel is initialised near 0).
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: (
      x + 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(p))), x.shape)
      if "class_head" in str(p)
      else x
    ),
    params,
  )
  return model, params, jnp.asarray(images), jnp.asarray(queries)


@pytest.mark.slow
def test_distinct_query_path_equals_plain_forward():
  model, params, images, queries = _setup()
  plain = step_lib._forward(model, params, images, queries, train=False)
  for limit in (5, 6, 64):  # fits exactly, fits, generous
    fast = step_lib._forward(model, params, images, queries, train=False, max_unique_queries=limit)
    for key in ("pred_logits", "pred_boxes", "query_embeddings", "class_embeddings"):
      np.testing.assert_allclose(
        np.asarray(fast[key]),
        np.asarray(plain[key]),
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"{key} limit={limit}",
      )
  # Masked rows keep the -1e6 padding value.
  assert np.all(np.asarray(plain["pred_logits"])[1, :, 5] == -1e6)


def test_distinct_query_overflow_falls_back_to_plain_path():
  model, params, images, queries = _setup()
  plain = step_lib._forward(model, params, images, queries, train=False)
  fast = step_lib._forward(model, params, images, queries, train=False, max_unique_queries=3)
  np.testing.assert_allclose(
    np.asarray(fast["pred_logits"]), np.asarray(plain["pred_logits"]), rtol=1e-5, atol=1e-5
  )


@pytest.mark.slow
def test_distinct_query_gradients_match():
  model, params, images, queries = _setup()

  def loss(p, limit):
    out = step_lib._forward(model, p, images, queries, train=False, max_unique_queries=limit)
    logits = jnp.where(out["pred_logits"] > -1e5, out["pred_logits"], 0.0)
    return jnp.sum(jnp.sin(logits)) + jnp.sum(out["pred_boxes"] ** 2)

  grad = jax.jit(jax.grad(loss), static_argnums=1)  # one program each, not op by op
  g_plain = grad(params, None)
  g_fast = grad(params, 8)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_fast)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=3e-5)

"""The JAX Hungarian matcher against scipy.optimize.linear_sum_assignment."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize

from owl_cl import model as model_lib
from owl_cl.train import losses
from owl_cl.train import matching
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib
from owl_cl.train.spec import LossSpec

_SOLVE = jax.jit(matching.linear_sum_assignment)
_MATCH = jax.jit(matching.match_targets)


def _random_cost(rng, n, m, integer):
  if integer:  # few distinct values: many ties, sums exact in float32
    return rng.integers(0, 4, (n, m)).astype(np.float32)
  return rng.normal(size=(n, m)).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("integer", [True, False])
def test_linear_sum_assignment_matches_scipy_both_orientations(integer):
  rng = np.random.default_rng(0 if integer else 1)
  shapes = [(1, 1), (1, 4), (4, 1), (3, 5), (5, 3), (7, 7), (12, 4), (4, 12), (10, 11)]
  for n, m in shapes * 20:  # few shapes (one compilation each), many seeds
    cost = _random_cost(rng, n, m, integer)
    rows, cols = scipy.optimize.linear_sum_assignment(cost)
    want = float(cost[rows, cols].astype(np.float64).sum())
    got_rows, got_cols = (np.asarray(a) for a in _SOLVE(jnp.asarray(cost)))
    # A valid assignment: min(n, m) pairs, no row or column twice.
    assert len(got_rows) == min(n, m)
    assert len(set(got_rows)) == len(got_rows) and len(set(got_cols)) == len(got_cols)
    assert np.all(got_cols >= 0) and np.all(got_cols < m)
    got = float(cost[got_rows, got_cols].astype(np.float64).sum())
    if integer:
      assert got == want, (n, m)
    else:
      # Potentials are float32: each of the <= 12 * 12 updates rounds at ~6e-8 relative to
      # values of O(|cost| sum) <= ~40, so a near-tie could flip at ~1e-5; real gaps between
      # distinct assignments of normal costs are far larger.
      assert abs(got - want) <= 1e-4, (n, m, got, want)


def _check_matching(cost, mask, index):
  """Validity of a [T] target index against cost [T, K], mask [K]; returns its cost."""
  t, k = cost.shape
  real = np.flatnonzero(mask)
  assigned = index[index != k - 1]
  assert set(assigned) <= set(real)  # padded targets are never assigned
  assert len(assigned) == len(set(assigned))  # no target twice
  assert len(assigned) == min(t, len(real))  # as many pairs as possible
  tokens = np.flatnonzero(index != k - 1)
  return float(cost[tokens, index[tokens]].astype(np.float64).sum())


@pytest.mark.slow
@pytest.mark.parametrize("integer", [True, False])
def test_match_targets_equals_scipy_matcher_with_padded_targets(integer):
  rng = np.random.default_rng(2 if integer else 3)
  for t, k in [(16, 5), (9, 9), (4, 7), (3, 10), (30, 12)]:
    for _ in range(12):
      cost = _random_cost(rng, 3 * t, k, integer).reshape(3, t, k)
      mask = rng.random((3, k)) < 0.6
      mask[:, -1] = False  # the appended padding instance
      mask[0, :] = False  # an image with no real target
      got = np.asarray(_MATCH(jnp.asarray(cost), jnp.asarray(mask)))
      want = np.asarray(
        losses.hungarian_matching(jnp.asarray(cost), jnp.asarray(mask), matcher="scipy")
      )
      assert np.all(got[0] == k - 1)
      for b in range(3):
        c_got = _check_matching(cost[b], mask[b], got[b])
        c_want = _check_matching(cost[b], mask[b], want[b])
        if integer:
          assert c_got == c_want, (t, k, b)
        else:  # as above: float32 potentials over <= 30 x 12 entries
          assert abs(c_got - c_want) <= 1e-4, (t, k, b, c_got, c_want)


def test_matcher_names():
  assert losses.resolve_matcher("jax") == "jax"
  assert losses.resolve_matcher("scipy") == "scipy"
  assert losses.resolve_matcher("auto", "gpu") == "jax"
  assert losses.resolve_matcher("auto", "tpu") == "jax"
  assert losses.resolve_matcher("auto", "cpu") in ("jax", "scipy")
  with pytest.raises(ValueError, match="matcher='greedy'"):
    losses.resolve_matcher("greedy")


@pytest.mark.slow
def test_train_step_with_jax_matcher_equals_scipy_matcher():
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32, context_length=8
  )
  rng = np.random.default_rng(0)
  b, q, length, m = 4, 6, 8, 3
  queries = np.zeros((b, q, length), np.int32)
  queries[:, :, 0] = 62
  queries[:, :, 1] = rng.integers(1, 60, (b, q))
  queries[:, :, 2] = 63
  images = rng.uniform(size=(b, 32, 32, 3)).astype(np.float32)
  labels = np.zeros((b, m, q), np.float32)
  labels[:, :, 0] = 1
  labels[:, :2, 0] = 0
  labels[:, 0, 1] = 1
  labels[:, 1, 2] = 1
  labels[1, 1] = 0  # image 1 has one real instance
  labels[1, 1, 0] = 1
  cxcy = rng.uniform(0.2, 0.8, (b, m, 2))
  boxes = np.concatenate([cxcy, rng.uniform(0.1, 0.3, (b, m, 2))], -1).astype(np.float32)
  batch = {k: jnp.asarray(v) for k, v in dict(images=images, queries=queries).items()}
  batch.update(labels=jnp.asarray(labels), boxes=jnp.asarray(boxes))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), images, queries)["params"]
  # Plain SGD: a parameter moves by LR x its gradient. Adam's first step moves every
  # parameter by about LR whatever its gradient's size, so a leaf whose gradient is float32
  # noise (the same noise rounded another way by another program's XLA:CPU partitioning, as
  # on one core) would move by O(LR) one way or the other.
  tx = optax.sgd(1e-3)
  mesh = sharding_lib.create_mesh()
  results = {}
  for matcher in ("scipy", "jax"):
    config = dict(
      focal_alpha=0.3,
      focal_gamma=2.0,
      class_weight=1.0,
      bbox_weight=1.0,
      giou_weight=1.0,
      matcher=matcher,
    )
    train_step = step_lib.make_train_step(model, tx, mesh, step_lib.StepSpec(LossSpec(**config)))
    # The step donates its state: give each run its own copy of the parameters.
    state = step_lib.create_train_state(jax.tree.map(jnp.array, params), tx)
    state, metrics = train_step(state, batch, None, jax.random.PRNGKey(1))
    results[matcher] = (jax.device_get(state.params), jax.device_get(metrics))
  (p_scipy, m_scipy), (p_jax, m_jax) = results["scipy"], results["jax"]
  # Continuous random costs have a unique optimum, so both matchers pick the same pairs and
  # the step computes the same loss and gradients up to float32 rounding (bit for bit here, on
  # one core or two): each parameter p - LR x g then agrees to a few ulps of float32 (rtol
  # 1e-6; atol 1e-7 for parameters near 0). Another pair changes the gradients of the class
  # and box heads by O(1), and this step's updates reach 0.4: far outside that.
  np.testing.assert_allclose(float(m_jax["loss"]), float(m_scipy["loss"]), rtol=1e-6)
  for a, w in zip(jax.tree.leaves(p_jax), jax.tree.leaves(p_scipy), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-6, atol=1e-7)

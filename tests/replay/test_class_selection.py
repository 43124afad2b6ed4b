"""Tests of owl_cl.replay.retrieval.class_selection (docs/reference.md §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay.retrieval import class_selection as cs


def _np_swil(emb, protos, w, eligible):
  """NumPy float64 reference of docs/reference.md §7 SWIL probabilities."""

  def norm(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)

  d = np.clip(1.0 - np.einsum("bke,ce->bkc", norm(emb), norm(protos)), 0, 2).min(axis=1)
  s = (d + 1e-8) ** (-w)
  s = np.where(eligible[None], s, 0.0)
  total = s.sum(-1, keepdims=True)
  return np.where(total > 0, s / np.where(total > 0, total, 1), 0.0)


@pytest.mark.parametrize("w", [0.0, 1.0, 2.5])
def test_similarity_weighted_probs_matches_numpy(w):
  rng = np.random.default_rng(1)
  b, k, e, c = 5, 3, 8, 7
  emb = rng.normal(size=(b, k, e)).astype(np.float32)
  protos = rng.normal(size=(c, e)).astype(np.float32)
  protos[4] = protos[1]  # a tie: identical prototypes
  eligible = np.array([1, 1, 0, 1, 1, 0, 1], bool)
  got = np.asarray(jax.jit(cs.similarity_weighted_probs)(emb, protos, w, eligible))
  want = _np_swil(emb.astype(np.float64), protos.astype(np.float64), w, eligible)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)
  assert np.all(got[:, ~eligible] == 0)
  np.testing.assert_array_equal(got[:, 1], got[:, 4])  # ties get equal probability
  if w == 0.0:
    np.testing.assert_allclose(got[:, eligible], 1 / eligible.sum(), rtol=1e-6)


def test_similarity_weighted_probs_edge_cases():
  rng = np.random.default_rng(2)
  emb = rng.normal(size=(2, 4, 6)).astype(np.float32)
  protos = rng.normal(size=(3, 6)).astype(np.float32)
  protos[2] = 3.0 * emb[0, 1]  # exact match: distance ~0 -> dominates
  p = np.asarray(cs.similarity_weighted_probs(emb, protos, 1.0, np.ones(3, bool)))
  assert p[0, 2] > 0.99
  # huge w: still finite, one-hot on the nearest eligible class.
  p = np.asarray(cs.similarity_weighted_probs(emb, protos, 200.0, np.array([1, 1, 0], bool)))
  assert np.all(np.isfinite(p))
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  # no eligible class -> all zeros, and sample_classes gives -1.
  p = cs.similarity_weighted_probs(emb, protos, 1.0, np.zeros(3, bool))
  np.testing.assert_array_equal(np.asarray(p), 0.0)
  np.testing.assert_array_equal(np.asarray(cs.sample_classes(jax.random.PRNGKey(0), p)), -1)


def test_cosine_distance_zero_vector_and_range():
  a = np.array([[0.0, 0.0], [1.0, 0.0]], np.float32)
  b = np.array([[1.0, 0.0], [-2.0, 0.0]], np.float32)
  d = np.asarray(cs.cosine_distance(a, b))
  np.testing.assert_allclose(d, [[1.0, 1.0], [0.0, 2.0]], atol=1e-6)


def _balanced(pointer, eligible, num, order=None):
  classes, new = jax.jit(cs.balanced_classes, static_argnums=2)(
    jnp.int32(pointer),
    np.asarray(eligible, bool),
    num,
    None if order is None else np.asarray(order, np.int32),
  )
  return np.asarray(classes).tolist(), int(new)


def test_balanced_classes_paper_order():
  everything = np.ones(20, bool)
  assert _balanced(10, everything, 4) == ([11, 12, 13, 14], 14)  # paper §4: 10 -> 11..14
  assert _balanced(14, everything, 4) == ([15, 16, 17, 18], 18)  # -> 15..18 next batch
  assert _balanced(18, everything, 4) == ([19, 0, 1, 2], 2)  # wrap-around
  assert _balanced(-1, everything, 3) == ([0, 1, 2], 2)  # initial pointer


def test_balanced_classes_skips_ineligible():
  eligible = np.ones(20, bool)
  eligible[[0, 12, 19]] = False
  assert _balanced(10, eligible, 4) == ([11, 13, 14, 15], 15)
  assert _balanced(17, eligible, 4) == ([18, 1, 2, 3], 3)
  # the pointer may sit on a class that became ineligible.
  assert _balanced(12, eligible, 2) == ([13, 14], 14)
  # fewer eligible classes than draws: the cycle repeats within the call.
  few = np.zeros(8, bool)
  few[[2, 5]] = True
  assert _balanced(2, few, 5) == ([5, 2, 5, 2, 5], 5)
  # none eligible: all -1 and the pointer is unchanged.
  assert _balanced(3, np.zeros(8, bool), 3) == ([-1, -1, -1], 3)


def test_balanced_classes_order_hook():
  order = [3, 1, 0, 2]
  assert _balanced(-1, np.ones(4, bool), 5, order) == ([3, 1, 0, 2, 3], 0)
  assert _balanced(0, np.array([1, 0, 1, 1], bool), 3, order) == ([0, 2, 3], 0)


def test_sample_classes_distribution_and_determinism():
  probs = np.tile(np.array([[0.2, 0.0, 0.8]], np.float32), (4000, 1))
  key = jax.random.PRNGKey(3)
  drawn = np.asarray(jax.jit(cs.sample_classes)(key, probs))
  assert set(np.unique(drawn)) <= {0, 2}
  assert abs((drawn == 2).mean() - 0.8) < 0.03
  np.testing.assert_array_equal(drawn, np.asarray(cs.sample_classes(key, probs)))
  onehot = np.eye(5, dtype=np.float32)[[4, 0, 3]]
  np.testing.assert_array_equal(np.asarray(cs.sample_classes(key, onehot)), [4, 0, 3])

"""Tests of owl_cl.replay.knn_shapley: exact Shapley values by enumeration, NumPy references."""

import itertools
import math

import numpy as np
import pytest

from owl_cl.replay import knn_shapley


def _knn_utility(subset, d, u, k):
  nearest = sorted(subset, key=lambda i: (d[i], i))[:k]
  return sum(u[i] for i in nearest) / k


def _exact_shapley(d, u, k, valid):
  """Shapley values of U(S) = (1/K) sum of u over the min(K,|S|) nearest, by enumerating all
  permutations of the valid candidates."""
  players = [i for i in range(len(d)) if valid[i]]
  values = np.zeros(len(d))
  for perm in itertools.permutations(players):
    subset = []
    for i in perm:
      before = _knn_utility(subset, d, u, k)
      subset.append(i)
      values[i] += _knn_utility(subset, d, u, k) - before
  return values / math.factorial(len(players))


def _recursion_reference(d, u, k, valid):
  """Straightforward loop over the docs/reference.md §7 recursion (one evaluation point)."""
  idx = [i for i in sorted(range(len(d)), key=lambda i: (d[i], i)) if valid[i]]
  n = len(idx)
  s = np.zeros(len(d))
  if n == 0:
    return s
  s[idx[-1]] = u[idx[-1]] / max(n, k)
  for m in range(n - 1, 0, -1):  # 1-based position m
    a, b = idx[m - 1], idx[m]
    s[a] = s[b] + (u[a] - u[b]) / k * min(k, m) / m
  return s


@pytest.mark.parametrize("k", [1, 3, 20])
def test_knn_shapley_equals_exact_shapley_by_enumeration(k):
  rng = np.random.default_rng(k)
  n_c = 7
  # row 0: 0/1 labels with tied distances; row 1: real utilities; row 2: ties + invalid.
  d = np.stack([rng.integers(0, 3, n_c), rng.random(n_c), rng.integers(0, 2, n_c)])
  u = np.stack([rng.integers(0, 2, n_c), rng.normal(size=n_c), rng.normal(size=n_c)])
  d, u = d.astype(np.float32), u.astype(np.float32)
  valid = np.array([True, True, False, True, True, True, True])
  got = np.asarray(knn_shapley.knn_shapley(d, u, k, valid))
  for j in range(3):
    expected = _exact_shapley(d[j], u[j], k, valid)
    np.testing.assert_allclose(got[j], expected, atol=2e-6)
    # efficiency: the values add up to U(all valid candidates)
    assert got[j].sum() == pytest.approx(
      _knn_utility(np.flatnonzero(valid).tolist(), d[j], u[j], k), abs=2e-6
    )
  assert np.all(got[:, ~valid] == 0)


@pytest.mark.parametrize("k", [1, 20, 45])
def test_knn_shapley_matches_numpy_recursion(k):
  rng = np.random.default_rng(10 + k)
  n_e, n_c = 5, 40
  d = rng.integers(0, 6, (n_e, n_c)).astype(np.float32)  # many ties
  u = rng.uniform(-1, 1, (n_e, n_c)).astype(np.float32)
  valid = rng.random(n_c) < 0.7
  got = np.asarray(knn_shapley.knn_shapley(d, u, k, valid))
  expected = np.stack([_recursion_reference(d[j], u[j], k, valid) for j in range(n_e)])
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_knn_shapley_infinite_and_negative_distances_keep_the_stable_order():
  # The sort maps float distances to int32 keys: +inf valid candidates must still sort
  # before invalid ones (ties by index), negative distances before positive ones.
  rng = np.random.default_rng(7)
  n_e, n_c, k = 4, 30, 3
  d = rng.choice(np.array([-2.0, -0.5, 0.0, 0.5, 3.0, np.inf], np.float32), (n_e, n_c))
  u = rng.uniform(-1, 1, (n_e, n_c)).astype(np.float32)
  valid = rng.random(n_c) < 0.6
  got = np.asarray(knn_shapley.knn_shapley(d, u, k, valid))
  expected = np.stack([_recursion_reference(d[j], u[j], k, valid) for j in range(n_e)])
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_knn_shapley_generic_sort_path_matches_packed_sort(monkeypatch):
  # Above PACKED_SORT_MAX_CANDIDATES (the whole-buffer precomputation) a generic stable sort
  # is used; both orders must give the same values (ties, invalid candidates).
  rng = np.random.default_rng(8)
  d = rng.integers(0, 5, (6, 25)).astype(np.float32)
  u = rng.uniform(-1, 1, (6, 25)).astype(np.float32)
  valid = rng.random(25) < 0.7
  packed = np.asarray(knn_shapley.knn_shapley(d, u, 4, valid))
  packed_order = np.asarray(knn_shapley._sort_order(d, valid))
  monkeypatch.setattr(knn_shapley, "PACKED_SORT_MAX_CANDIDATES", 10)
  generic = np.asarray(knn_shapley.knn_shapley(d, u, 4, valid))
  # The same order, not only the same values: valid by distance then index, invalid last.
  np.testing.assert_array_equal(np.asarray(knn_shapley._sort_order(d, valid)), packed_order)
  key = np.where(valid, d, np.inf)
  np.testing.assert_array_equal(
    packed_order, np.stack([np.lexsort((np.arange(25), row)) for row in key])
  )
  expected = np.stack([_recursion_reference(d[j], u[j], 4, valid) for j in range(6)])
  np.testing.assert_allclose(generic, expected, atol=1e-6)
  np.testing.assert_allclose(packed, expected, atol=1e-6)


def test_knn_shapley_errors_and_no_valid_candidate():
  with pytest.raises(ValueError, match="K must be >= 1"):
    knn_shapley.knn_shapley(np.zeros((1, 2)), np.zeros((1, 2)), 0)
  with pytest.raises(ValueError, match="N_e, N_c"):
    knn_shapley.knn_shapley(np.zeros((1, 2)), np.zeros((1, 3)), 2)
  out = knn_shapley.knn_shapley(np.ones((2, 3)), np.ones((2, 3)), 2, np.zeros(3, bool))
  assert np.all(np.asarray(out) == 0)


def _cos(a, b):
  a = a / np.linalg.norm(a, axis=-1, keepdims=True)
  b = b / np.linalg.norm(b, axis=-1, keepdims=True)
  return a @ b.T


def _l2(a, b):
  return np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0))


def test_image_knn_shapley_all_to_all_and_nearest_token_match_numpy():
  rng = np.random.default_rng(3)
  n_e, n_c, t, e, k = 3, 5, 2, 4, 3
  ec, eq = rng.normal(size=(n_e, t, e)), rng.normal(size=(n_e, t, e))
  cc, cq = rng.normal(size=(n_c, t, e)), rng.normal(size=(n_c, t, e))
  valid = np.array([True, False, True, True, True])
  # all-to-all (paper): tokens are the KNN points; max / min over both token dims.
  d = _l2(ec.reshape(-1, e), cc.reshape(-1, e))
  u = _cos(eq.reshape(-1, e), cq.reshape(-1, e))
  tok_valid = np.repeat(valid, t)
  sv = np.stack([_recursion_reference(d[j], u[j], k, tok_valid) for j in range(n_e * t)])
  sv = sv.reshape(n_e, t, n_c, t)
  for reduction, fn in (("max", np.max), ("min", np.min)):
    got, dist = knn_shapley.image_knn_shapley(ec, eq, cc, cq, k, valid, reduction=reduction)
    np.testing.assert_allclose(np.asarray(got), np.where(valid, fn(sv, axis=(1, 3)), 0), atol=1e-6)
  np.testing.assert_allclose(
    np.asarray(dist)[:, valid], d.reshape(n_e, t, n_c, t).min(axis=(1, 3))[:, valid], rtol=1e-5
  )
  # nearest token (released code), cosine distance.
  dc = 1 - _cos(ec.reshape(-1, e), cc.reshape(-1, e)).reshape(n_e * t, n_c, t)
  nearest = dc.argmin(-1)
  uq = np.stack(
    [
      [_cos(eq.reshape(-1, e)[r : r + 1], cq[i, nearest[r, i]][None])[0, 0] for i in range(n_c)]
      for r in range(n_e * t)
    ]
  )
  ref = (
    np.stack([_recursion_reference(dc.min(-1)[r], uq[r], k, valid) for r in range(n_e * t)])
    .reshape(n_e, t, n_c)
    .min(1)
  )
  got, _ = knn_shapley.image_knn_shapley(
    ec, eq, cc, cq, k, valid, reduction="min", token_matching="nearest_token", distance="cosine"
  )
  np.testing.assert_allclose(np.asarray(got), np.where(valid, ref, 0), atol=1e-5)
  with pytest.raises(ValueError, match="token_matching"):
    knn_shapley.image_knn_shapley(ec, eq, cc, cq, k, token_matching="mean")


def test_precompute_left_term_equals_full_matrix():
  rng = np.random.default_rng(4)
  n, t, e, k = 7, 2, 4, 3
  ce, qe = rng.normal(size=(n, t, e)), rng.normal(size=(n, t, e))
  full, _ = knn_shapley.image_knn_shapley(ce, qe, ce, qe, k, reduction="max")
  left, left_min = knn_shapley.precompute_left_term(ce, qe, k, chunk_size=3)  # 3 does not divide 7
  np.testing.assert_allclose(np.asarray(left), np.asarray(full).mean(0), atol=1e-6)
  np.testing.assert_allclose(np.asarray(left_min), np.asarray(full).min(0), atol=1e-6)

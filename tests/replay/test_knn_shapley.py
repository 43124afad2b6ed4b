"""Tests of owl_cl.replay.retrieval.knn_shapley: exact Shapley values by enumeration, NumPy
references."""

import itertools
import math

import jax
import numpy as np
import pytest

from owl_cl.replay.retrieval import knn_shapley


def _device_sort_order(distances, valid, candidate_major):
  """`knn_shapley._sort_order` through XLA's sort (the path of GPUs and TPUs), on this CPU."""
  key = knn_shapley._order_key(distances, valid)
  return knn_shapley._device_sort_order(distances, valid, key, candidate_major)


@pytest.fixture(params=["host", "device"])
def sort_path(request, monkeypatch):
  """Runs a test with each path of `knn_shapley`: 'host' is this CPU's own (NumPy's sort
  through a callback, the sequential suffix sum), 'device' the one accelerators take (XLA's
  sort, the parallel cumulative sum)."""
  if request.param == "device":
    monkeypatch.setattr(knn_shapley, "_sort_order", _device_sort_order)
    monkeypatch.setattr(knn_shapley, "_platform_suffix_sum", knn_shapley._suffix_sum)
  return request.param


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


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 20])
def test_knn_shapley_equals_exact_shapley_by_enumeration(k, sort_path):
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


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 20, 45])
def test_knn_shapley_matches_numpy_recursion(k, sort_path):
  rng = np.random.default_rng(10 + k)
  n_e, n_c = 5, 40
  d = rng.integers(0, 6, (n_e, n_c)).astype(np.float32)  # many ties
  u = rng.uniform(-1, 1, (n_e, n_c)).astype(np.float32)
  valid = rng.random(n_c) < 0.7
  got = np.asarray(knn_shapley.knn_shapley(d, u, k, valid))
  expected = np.stack([_recursion_reference(d[j], u[j], k, valid) for j in range(n_e)])
  np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.slow
def test_knn_shapley_infinite_and_negative_distances_keep_the_stable_order(sort_path):
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


def _lexsort_rows(key):
  """[N_e, N_c] -> [N_c, N_e]: each row's indices by (key, index), candidate-major."""
  return np.stack([np.lexsort((np.arange(key.shape[1]), row)) for row in key], axis=1)


@pytest.mark.slow
def test_knn_shapley_every_sort_path_gives_the_stable_order(monkeypatch):
  # Four paths give the order: on CPU one NumPy sort of packed (key, index) words; elsewhere
  # the binned sort (N_c <= BINNED_SORT_MAX_CANDIDATES), the packed rank sort, and above
  # PACKED_SORT_MAX_CANDIDATES (the whole-buffer precomputation) a generic stable sort. All
  # must give the same order (valid by distance then index, invalid last), in both layouts,
  # and the same values (ties, invalid candidates).
  rng = np.random.default_rng(8)
  d = rng.integers(0, 5, (6, 25)).astype(np.float32)
  u = rng.uniform(-1, 1, (6, 25)).astype(np.float32)
  valid = rng.random(25) < 0.7
  expected_order = _lexsort_rows(np.where(valid, d, np.inf))
  expected = np.stack([_recursion_reference(d[j], u[j], 4, valid) for j in range(6)])
  key = knn_shapley._order_key(d, valid)
  np.testing.assert_array_equal(
    knn_shapley._numpy_sort_order(np.asarray(key), True), expected_order
  )
  np.testing.assert_array_equal(
    knn_shapley._numpy_sort_order(np.asarray(key), False), expected_order.T
  )
  for candidate_major in (True, False):
    got = np.asarray(knn_shapley._sort_order(d, valid, candidate_major))
    np.testing.assert_array_equal(got, expected_order if candidate_major else expected_order.T)
  np.testing.assert_allclose(
    np.asarray(knn_shapley.knn_shapley(d, u, 4, valid)), expected, atol=1e-6
  )
  monkeypatch.setattr(knn_shapley, "_sort_order", _device_sort_order)
  for binned_max, packed_max in ((4096, 46_340), (10, 46_340), (10, 10)):
    monkeypatch.setattr(knn_shapley, "BINNED_SORT_MAX_CANDIDATES", binned_max)
    monkeypatch.setattr(knn_shapley, "PACKED_SORT_MAX_CANDIDATES", packed_max)
    for candidate_major in (True, False):
      got = np.asarray(_device_sort_order(d, valid, candidate_major))
      np.testing.assert_array_equal(got, expected_order if candidate_major else expected_order.T)
    got = np.asarray(knn_shapley.knn_shapley(d, u, 4, valid))
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_host_sort_order_handles_extreme_keys_and_batch_dims():
  # The packed words must order the whole int32 range (the sign flip to unsigned order) and
  # break ties by index; a vmapped call hands the callback a leading batch dim.
  key = np.array(
    [[2**31 - 1, -(2**31), 0, -1, 0, 2**31 - 1, 5], [3, 3, 3, -7, 3, -(2**31), 2**31 - 1]],
    np.int32,
  )
  expected = _lexsort_rows(key)
  np.testing.assert_array_equal(knn_shapley._numpy_sort_order(key, True), expected)
  batched = np.stack([key, key[::-1]])
  got = jax.jit(jax.vmap(lambda k: knn_shapley._host_sort_order(k, True)))(batched)
  np.testing.assert_array_equal(np.asarray(got), np.stack([expected, _lexsort_rows(key[::-1])]))
  # NaN and infinite distances: the host order is the exact path's (NaN after +inf).
  d = np.array([[0.5, np.nan, -np.inf, 2.0, np.inf, 0.5]], np.float32)
  valid = np.array([True, True, True, False, True, True])
  key = knn_shapley._order_key(d, valid)
  np.testing.assert_array_equal(
    np.asarray(knn_shapley._sort_order(d, valid, False)),
    np.asarray(knn_shapley._exact_sort_order(key)),
  )
  np.testing.assert_array_equal(
    np.asarray(knn_shapley._sort_order(d, valid, False))[0], [2, 0, 5, 4, 3, 1]
  )


def test_knn_shapley_vmapped_equals_per_row_calls():
  rng = np.random.default_rng(12)
  d = rng.random((3, 4, 9)).astype(np.float32)
  u = rng.uniform(-1, 1, (3, 4, 9)).astype(np.float32)
  valid = rng.random(9) < 0.8
  got = jax.jit(jax.vmap(lambda a, b: knn_shapley.knn_shapley(a, b, 2, valid)))(d, u)
  for i in range(3):
    expected = np.stack([_recursion_reference(d[i, j], u[i, j], 2, valid) for j in range(4)])
    np.testing.assert_allclose(np.asarray(got[i]), expected, atol=1e-6)


def _binned(d, valid):
  d = np.asarray(d, np.float32)
  valid = np.asarray(valid, bool)
  key = knn_shapley._order_key(d, valid)
  order, exact = knn_shapley._binned_sort_order(d, valid, key)
  return np.asarray(order), bool(exact)


@pytest.mark.slow
def test_binned_sort_orders_candidates_that_share_a_bin():
  # The row's span (0 to 1e6) puts 1, 1 + 1 ulp and 1 + 2 ulp in one bin (bin width ~2e-3),
  # where the uint32 sort leaves them in index order, i.e. reversed; 7 + 1 ulp and 7 likewise.
  # The fix-up passes must order both groups (sizes 3 and 2) without the fallback.
  one, seven = np.float32(1.0), np.float32(7.0)
  up = lambda x, n: np.nextafter(x, np.float32(np.inf)) if n == 1 else up(up(x, 1), n - 1)
  row = np.array([1e6, up(one, 2), up(one, 1), one, 5.0, up(seven, 1), seven, 3.0, 0.0], np.float32)
  d = np.stack([row, row[::-1], np.roll(row, 3)])
  valid = np.ones(9, bool)
  valid[4] = False
  order, exact = _binned(d, valid)
  assert exact
  np.testing.assert_array_equal(order, _lexsort_rows(np.where(valid, d, np.inf)))


@pytest.mark.slow
def test_binned_sort_reports_groups_it_cannot_order():
  # Four distinct distances in one bin, in reverse order: three passes cannot sort them, the
  # check must say so, and `_sort_order` must still return the exact order (fallback).
  x = np.float32(1.0)
  group = [x]
  for _ in range(3):
    group.append(np.nextafter(group[-1], np.float32(np.inf)))
  row = np.array([1e6] + group[::-1] + [2.0, 0.0], np.float32)
  d = row[None, :]
  valid = np.ones(row.size, bool)
  _, exact = _binned(d, valid)
  assert not exact
  expected = _lexsort_rows(d)
  np.testing.assert_array_equal(np.asarray(_device_sort_order(d, valid, True)), expected)
  # NaN distances spread no bins (the row's min is NaN): the check fails, the fallback orders
  # NaN after +inf like the exact sort.
  d_nan = np.array([[0.5, np.nan, 0.25, 2.0]], np.float32)
  valid = np.array([True, True, True, False])
  _, exact = _binned(d_nan, valid)
  assert not exact
  np.testing.assert_array_equal(
    np.asarray(_device_sort_order(d_nan, valid, True))[:, 0], [2, 0, 3, 1]
  )


@pytest.mark.slow
def test_binned_sort_matches_exact_sort_on_paper_sized_rows():
  # [1344, 1344] (ASER's left term): uniform distances (ties in about 5% of the rows), L2-like
  # distances with a zero diagonal, and coarse distances with many exact ties; the binned path
  # and the exact path must give the same order.
  rng = np.random.default_rng(11)
  n = 1344
  cases = [
    rng.random((n, n), dtype=np.float32),
    np.where(np.eye(n, dtype=bool), 0.0, 1.2 + 0.3 * rng.random((n, n))).astype(np.float32),
    (np.round(rng.random((n, n)) * 300) / 300).astype(np.float32),
  ]
  valid = rng.random(n) < 0.97
  for d in cases:
    key = knn_shapley._order_key(d, valid)
    order, exact = knn_shapley._binned_sort_order(d, valid, key)
    assert bool(exact)
    np.testing.assert_array_equal(
      np.asarray(order), np.asarray(knn_shapley._exact_sort_order(key)).T
    )


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("token_matching", ["all_to_all", "nearest_token"])
def test_image_knn_shapley_in_blocks_equals_one_block(monkeypatch, token_matching):
  # The evaluation images are split into blocks of about EVAL_BLOCK_TOKENS tokens (7 images of
  # 3 tokens, blocks of 2 images: 4 blocks, the last padded). Rows are independent, so the
  # values and distances must equal one block's bit for bit.
  rng = np.random.default_rng(5)
  ec, eq = rng.normal(size=(7, 3, 6)), rng.normal(size=(7, 3, 6))
  cc, cq = rng.normal(size=(9, 3, 6)), rng.normal(size=(9, 3, 6))
  valid = rng.random(9) < 0.8
  call = lambda: knn_shapley.image_knn_shapley(
    ec, eq, cc, cq, 4, valid, reduction="max", token_matching=token_matching
  )
  monkeypatch.setattr(knn_shapley, "EVAL_BLOCK_TOKENS", 10**6)
  whole = [np.asarray(x) for x in call()]
  monkeypatch.setattr(knn_shapley, "EVAL_BLOCK_TOKENS", 6)
  blocked = [np.asarray(x) for x in call()]
  assert blocked[0].shape == (7, 9)
  np.testing.assert_array_equal(blocked[0], whole[0])
  np.testing.assert_array_equal(blocked[1], whole[1])


@pytest.mark.slow
def test_precompute_left_term_equals_full_matrix():
  rng = np.random.default_rng(4)
  n, t, e, k = 7, 2, 4, 3
  ce, qe = rng.normal(size=(n, t, e)), rng.normal(size=(n, t, e))
  full, _ = knn_shapley.image_knn_shapley(ce, qe, ce, qe, k, reduction="max")
  left, left_min = knn_shapley.precompute_left_term(ce, qe, k, chunk_size=3)  # 3 does not divide 7
  np.testing.assert_allclose(np.asarray(left), np.asarray(full).mean(0), atol=1e-6)
  np.testing.assert_allclose(np.asarray(left_min), np.asarray(full).min(0), atol=1e-6)


def test_parallel_suffix_sum_is_the_sequential_one_up_to_rounding():
  # ASER's left term at the paper's sizes: 1,344 candidates (t = 16 tokens x 84 images).
  rng = np.random.default_rng(0)
  delta = rng.normal(size=(1344, 64)).astype(np.float32) / 20.0
  exact = np.cumsum(delta[::-1].astype(np.float64), axis=0)[::-1]
  # Any order of n float32 additions errs by at most (n - 1) * eps * sum |terms| (Higham,
  # "Accuracy and Stability of Numerical Algorithms", eq. 4.4).
  bound = (len(delta) - 1) * np.finfo(np.float32).eps * np.abs(delta).sum(axis=0)
  for suffix_sum in (knn_shapley._sequential_suffix_sum, knn_shapley._suffix_sum):
    got = np.asarray(jax.jit(suffix_sum)(delta), np.float64)
    assert np.all(np.abs(got - exact) <= bound)
  # The CPU takes the sequential path: bit for bit NumPy's float32 order.
  np.testing.assert_array_equal(
    np.asarray(knn_shapley._platform_suffix_sum(delta)), np.cumsum(delta[::-1], axis=0)[::-1]
  )

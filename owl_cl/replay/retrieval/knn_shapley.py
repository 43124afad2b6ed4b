"""KNN Shapley values (KNN-SV) of replay candidates (paper suppl. §C, docs/reference.md §7; Jia et
al. 2019).

The KNN utility of a candidate subset S for an evaluation point j is
    U_j(S) = (1/K) * sum of u_j(i) over the min(K, |S|) members i of S nearest to j,
with u_j(i) a real-valued utility (the paper replaces the label-match indicator by the cosine
similarity of the query embeddings of i and j). Its exact Shapley value follows the recursion
over candidates sorted by distance to j, alpha_1 nearest ... alpha_N farthest (N valid):
    s_j(alpha_N) = u_j(alpha_N) / max(N, K)
    s_j(alpha_m) = s_j(alpha_{m+1}) + (u_j(alpha_m) - u_j(alpha_{m+1})) / K * min(K, m) / m.
(The paper writes u/N for the base case, which is exact only for N >= K; u/max(N, K) is exact
for every N, docs/reference.md §7.) Ties in distance are broken by candidate index (lower index =
nearer),
which is also the tie-break of U_j.

Instance-level KNN-SVs (paper suppl. §C): each image carries its top-k class embeddings
(distance) and the matching query embeddings (utility); `image_knn_shapley` turns them into an
image-level [N_e, N_c] matrix, either all-to-all over tokens ([N_c, k, N_e, k], reduced over
both k dims, the paper) or by the released code's nearest-token matching (option).

`threshold_knn_shapley` is the released code's thresholded variant (TKNN-SV, option).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.replay.retrieval import class_selection

Array = jax.Array

TOKEN_MATCHING = ("all_to_all", "nearest_token")
DISTANCES = ("l2", "cosine")
# Unroll of the KNN-SV recursion's scan (steps per loop iteration). 8 and 32 measured slower than 1
# on CPU at the paper's sizes ([1344, 1344]: 284 ms at 1, 359 at 8, 318 at 32; the scan step is one
# vector add, the sorts dominate).
SCAN_UNROLL = 1
# Largest N_c for the binned sort of `_device_sort_order` (XLA's sort: GPU, TPU): a row's
# distances are cut into 2^(32 - ceil(log2 N_c)) bins (2^20 at N_c = 4096), so four distinct
# distances in one bin, which the fix-up passes cannot order, are about 1e-5 per row there and
# far rarer below.
BINNED_SORT_MAX_CANDIDATES = 4096
# Odd-even transposition passes over the binned order: they sort every group of up to this many
# candidates that share a bin (a group of n needs n passes).
BIN_FIXUP_PASSES = 3
# Largest N_c for the packed int32 rank sort of `_device_sort_order` (N_c^2 < 2^31).
PACKED_SORT_MAX_CANDIDATES = 46_340
# Evaluation tokens per block of `image_knn_shapley`'s KNN-SVs (blocks run one after the other
# in a `lax.map`). Each block's [rows, N_c * t] temporaries are then small enough for the
# allocator to reuse them from call to call: for ASER's left term ([1344, 1344]) a kernel call
# made 14k page faults and took 35 ms in one block, against under 200 faults and 20 ms in
# blocks of 336 rows or fewer, on the 2-core CPU.
EVAL_BLOCK_TOKENS = 256
REDUCTIONS = ("max", "min")
# Shapley value of a candidate for an evaluation point: 'knn' (exact KNN-SV, the paper) |
# 'tknn' (the released code's thresholded KNN-SV, `SV_type='TKNN'`, `threshold_knn_shapley`).
SHAPLEY = ("knn", "tknn")
# C of the TKNN-SV's (u - 1/C) term: the released `tknn_SV` default (its call never sets it).
TKNN_NUM_CLASSES = 400.0


def knn_shapley(distances: Array, utilities: Array, k: int, valid: Array | None = None) -> Array:
  """Exact KNN Shapley value of every candidate for every evaluation point.

  Args:
    distances: float [N_e, N_c]; distance of candidate i to evaluation point j (any metric;
      only the order within a row matters). Ties: lower candidate index counts as nearer.
    utilities: float [N_e, N_c]; u_j(i), the utility of candidate i for evaluation point j
      (paper: cosine similarity of query embeddings; Jia et al.: 1[y_i = y_j]).
    k: K of the KNN utility (static int >= 1; paper 20).
    valid: optional bool [N_c]; invalid candidates get 0 and do not count in N_c.
  Returns:
    float32 [N_e, N_c]; entry [j, i] = s_j(i), the Shapley value of candidate i for the KNN
    utility U_j (module docstring). Rows sum to U_j(all valid candidates) (efficiency).
  Raises:
    ValueError: k < 1 or shapes that disagree.
  Source: paper suppl. §C recursion (base case u / max(N_c, K), docs/reference.md §7); computed
    over candidates sorted by distance as a suffix sum of the recursion's increments (a
    sequential scan on CPU, a parallel cumulative sum elsewhere).
  """
  k = int(k)
  if k < 1:
    raise ValueError(f"knn_shapley: K must be >= 1, got {k}")
  distances = jnp.asarray(distances, jnp.float32)
  utilities = jnp.asarray(utilities, jnp.float32)
  if distances.ndim != 2 or distances.shape != utilities.shape:
    raise ValueError(
      "knn_shapley: distances and utilities must both be [N_e, N_c]; got "
      f"{distances.shape} and {utilities.shape}"
    )
  n_e, n_c = distances.shape
  if valid is None:
    valid = jnp.ones((n_c,), bool)
  valid = jnp.asarray(valid, bool)
  if valid.shape != (n_c,):
    raise ValueError(f"knn_shapley: valid must be [N_c={n_c}], got {valid.shape}")
  n_valid = jnp.sum(valid, dtype=jnp.int32)
  if n_c > BINNED_SORT_MAX_CANDIDATES:
    # Whole-buffer rows (ASER-PC's precomputation): row-major, the layout of their sort (the
    # candidate-major gather and deltas cost 5-15% more there).
    order = _sort_order(distances, valid, candidate_major=False)  # [N_e, N_c]
    u_sorted = jnp.take_along_axis(utilities, order, axis=1)  # [N_e, N_c]
    s_sorted = _sorted_shapley(u_sorted, n_valid, k, candidate_axis=1)  # [N_c, N_e]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n_e, n_c), 0)
    return jnp.zeros((n_e, n_c), jnp.float32).at[rows, order].set(s_sorted.T, unique_indices=True)
  # Candidate-major [N_c, N_e], the layout of the binned sort's fix-up and of the scan.
  order = _sort_order(distances, valid, candidate_major=True)  # [N_c, N_e]
  u_sorted = jnp.take_along_axis(utilities.T, order, axis=0)  # [N_c, N_e]
  s_sorted = _sorted_shapley(u_sorted, n_valid, k, candidate_axis=0)  # [N_c, N_e]
  points = jax.lax.broadcasted_iota(jnp.int32, (n_c, n_e), 1)
  return jnp.zeros((n_e, n_c), jnp.float32).at[points, order].set(s_sorted, unique_indices=True)


def _sorted_shapley(u_sorted: Array, n_valid: Array, k: int, candidate_axis: int) -> Array:
  """float32 [N_c, N_e]: s at each sorted position, from the utilities in sorted order
  (float32 [N_e, N_c] with candidate_axis 1, [N_c, N_e] with 0; module docstring's recursion)."""
  n_c = u_sorted.shape[candidate_axis]
  # The recursion s_m = s_{m+1} + delta_m with delta_m = (u_m - u_{m+1}) / K * min(K, m) / m
  # for m < N, delta_N = u_N / max(N, K) (base case; s_{N+1} = 0) and delta_m = 0 beyond N
  # (invalid candidates, sorted last, get 0). The deltas are computed vectorised in the
  # layout of u_sorted; the scan only accumulates them (one vector add over the N_e evaluation
  # points per candidate).
  shape = [1, 1]
  shape[candidate_axis] = n_c
  m = jnp.arange(1, n_c + 1, dtype=jnp.int32).reshape(shape)  # 1-based position
  coefficient = jnp.minimum(k, m).astype(jnp.float32) / (jnp.float32(k) * m.astype(jnp.float32))
  pad = [(0, 0), (0, 0)]
  pad[candidate_axis] = (0, 1)
  u_next = jnp.pad(jax.lax.slice_in_dim(u_sorted, 1, n_c, axis=candidate_axis), pad)
  base_denominator = jnp.maximum(n_valid, k).astype(jnp.float32)
  delta = jnp.where(
    m < n_valid,
    (u_sorted - u_next) * coefficient,
    jnp.where(m == n_valid, u_sorted / base_denominator, 0.0),
  )

  delta = delta if candidate_axis == 0 else delta.T  # [N_c, N_e]
  return _platform_suffix_sum(delta)


def _platform_suffix_sum(delta: Array) -> Array:
  """float32 [N_c, N_e] -> [N_c, N_e]: the suffix sums along axis 0, sequential on CPU
  (`_sequential_suffix_sum`), parallel elsewhere (`_suffix_sum`)."""
  return jax.lax.platform_dependent(delta, cpu=_sequential_suffix_sum, default=_suffix_sum)


def _sequential_suffix_sum(delta: Array) -> Array:
  """float32 [N_c, N_e] -> [N_c, N_e]: s_m = sum of delta_m' over m' >= m, added from the
  farthest candidate inwards (NumPy's order, the CPU path: each step is one vector add)."""

  def step(s_next, delta_m):
    s = s_next + delta_m
    return s, s

  zeros = jnp.zeros(delta.shape[1:], jnp.float32)
  return jax.lax.scan(step, zeros, delta, reverse=True, unroll=SCAN_UNROLL)[1]


def _suffix_sum(delta: Array) -> Array:
  """`_sequential_suffix_sum` as a parallel reverse cumulative sum (accelerators): on a GPU
  each step of the scan is its own kernel launch, N_c of them per call (the first GPU run:
  ASER 133 ms on an H200 against 41 ms on 2 CPU cores). The order of the additions differs,
  so the values differ from the CPU path's by float32 rounding."""
  return jax.lax.cumsum(delta, axis=0, reverse=True)


def threshold_knn_shapley(
  distances: Array,
  utilities: Array,
  threshold: float | None = None,
  num_classes: float = TKNN_NUM_CLASSES,
  valid: Array | None = None,
) -> Array:
  """Thresholded KNN Shapley value (TKNN-SV) of every candidate for every evaluation point.

  The released code's `SV_type='TKNN'` (with `l2_thresh`). For evaluation point j let
  W_j = {valid i : d_ji < threshold} (every valid candidate when threshold is None),
  c_j = |W_j| and S_j = sum of u_j(i) over W_j. For i in W_j
      s_j(i) = 1[c_j > 2] * A1 * A2(c_j) + (u_j(i) - 1/C) / c_j,
      A1 = u_j(i) / c_j - S_j / (c_j^2 - c_j),
      A2(c) = sum_{k=0}^{N-1} 1/(k+1) * (1 - prod_{m=0}^{k} (N-m-c)/(N-m)) - 1 = H_c - 1
  (H_c the c-th harmonic number; the released code tabulates the sum for N = the buffer size,
  and the sum equals H_c - 1 for every N >= c, docs/reference.md §7), and s_j(i) = 0 for i
  outside W_j. Deviations from the released code, which are bugs there: S_j is summed per
  evaluation point (the released `torch.sum(query_sims[mask], dim=-1)` sums over every token
  of every image of the batch), and c_j <= 2 gives the A term 0 (the released 0 * inf is NaN
  for c_j = 1).

  Args:
    distances: float [N_e, N_c]; distance of candidate i to evaluation point j (L2 in the
      released code; the threshold is in the same units).
    utilities: float [N_e, N_c]; u_j(i) (cosine similarity of query embeddings).
    threshold: float or None (static); candidates at distance >= threshold get 0 and do not
      count in c_j. None = no threshold (released `l2_thresh=None`).
    num_classes: C of the (u - 1/C) term (released 400).
    valid: optional bool [N_c]; invalid candidates get 0 and do not count.
  Returns:
    float32 [N_e, N_c].
  Raises:
    ValueError: shapes that disagree, or num_classes <= 0.
  Source: released code `torch_replay_utils/replay_trainers.py` `C_ASER.tknn_SV`,
    `trainer_utils.precompute_A2` (Wang et al. 2023, "Threshold KNN-Shapley");
    docs/reference.md §7.
  """
  distances = jnp.asarray(distances, jnp.float32)
  utilities = jnp.asarray(utilities, jnp.float32)
  if distances.ndim != 2 or distances.shape != utilities.shape:
    raise ValueError(
      "threshold_knn_shapley: distances and utilities must both be [N_e, N_c]; got "
      f"{distances.shape} and {utilities.shape}"
    )
  if not float(num_classes) > 0:
    raise ValueError(f"threshold_knn_shapley: num_classes must be > 0, got {num_classes}")
  n_c = distances.shape[1]
  valid = jnp.ones((n_c,), bool) if valid is None else jnp.asarray(valid, bool)
  if valid.shape != (n_c,):
    raise ValueError(f"threshold_knn_shapley: valid must be [N_c={n_c}], got {valid.shape}")
  within = jnp.broadcast_to(valid[None, :], distances.shape)
  if threshold is not None:
    within = within & (distances < jnp.float32(threshold))
  count = jnp.sum(within, axis=-1, dtype=jnp.int32)  # c_j [N_e]
  total = jnp.sum(jnp.where(within, utilities, 0.0), axis=-1)  # S_j [N_e]
  # A2(c) = H_c - 1 from a table of harmonic numbers H_0..H_{N_c} (exact sums in float32).
  harmonic = jnp.concatenate(
    [jnp.zeros((1,), jnp.float32), jnp.cumsum(1.0 / jnp.arange(1, n_c + 1, dtype=jnp.float32))]
  )
  a2 = harmonic[count] - 1.0  # [N_e]
  c = jnp.maximum(count, 1).astype(jnp.float32)[:, None]  # safe divisor where count < 1
  many = (count > 2)[:, None]
  pairs = jnp.where(many, c * c - c, 1.0)
  a1 = utilities / c - total[:, None] / pairs
  sv = jnp.where(many, a1 * a2[:, None], 0.0) + (utilities - 1.0 / jnp.float32(num_classes)) / c
  return jnp.where(within, sv, 0.0)


def _sort_order(distances: Array, valid: Array, candidate_major: bool) -> Array:
  """int32 [N_c, N_e] (candidate_major) or [N_e, N_c]: for each evaluation point j, the
  candidates in its order, nearest first (ties: lower index first), invalid candidates after
  every valid one (ties among them by index).

  On CPU one NumPy sort gives the order (`_host_sort_order`, through `jax.pure_callback`).
  On other platforms XLA's sort does (`_device_sort_order`). Both give the same order.
  """
  key = _order_key(distances, valid)
  device = lambda k: _device_sort_order(distances, valid, k, candidate_major)
  return jax.lax.platform_dependent(
    key, cpu=lambda k: _host_sort_order(k, candidate_major), default=device
  )


def _host_sort_order(key: Array, candidate_major: bool) -> Array:
  """`_sort_order` on the host: NumPy sorts (key, index) packed in uint64 along each row.

  Why on CPU: XLA's CPU sort calls a compiled comparator for every comparison, so the
  [1344, 1344] int32 rows of ASER's left term take 33 ms on the 2-core CPU, against 4.5 ms for
  NumPy's vectorised sort of the packed uint64 words (x86-simd-sort; it releases the GIL). The
  whole kernel went from 72 to 31 ms there, and the order of [64, 433,808] rows (ASER-PC's
  precomputation, 8 images against the paper's buffer) from 5.1 to 0.29 s.
  Under a jit over several devices the callback runs once, on the first device, and the others
  receive its result (tests/e2e/test_multihost.py checks this across processes); inside
  `shard_map`, once per device on its own rows. JAX's persistent compilation cache does not
  store programs with host callbacks: they compile again in each process.
  """
  shape = key.shape[:-2] + ((key.shape[-1], key.shape[-2]) if candidate_major else key.shape[-2:])
  return jax.pure_callback(
    lambda k: _numpy_sort_order(k, candidate_major),
    jax.ShapeDtypeStruct(shape, jnp.int32),
    key,
    vmap_method="broadcast_all",
  )


def _numpy_sort_order(key: np.ndarray, candidate_major: bool) -> np.ndarray:
  """int32 [..., N_c, N_e] (candidate_major) or [..., N_e, N_c]: each row of key (int32
  [..., N_e, N_c], `_order_key`) ordered by (key, index), N_c <= 2^32."""
  key = np.asarray(key, np.int32)
  # Each uint64 word is key * 2^32 + index: its high half is the key shifted to unsigned order
  # (x ^ 2^31 maps int32 order onto uint32 order), its low half the candidate index. Sorting
  # the words orders by key, then by index; the low halves are then the order.
  high, low = (1, 0) if sys.byteorder == "little" else (0, 1)
  halves = np.empty(key.shape + (2,), np.uint32)
  halves[..., high] = key.view(np.uint32) ^ np.uint32(0x80000000)
  halves[..., low] = np.arange(key.shape[-1], dtype=np.uint32)
  halves.view(np.uint64)[..., 0].sort(axis=-1)
  order = halves[..., low].view(np.int32)
  return np.ascontiguousarray(np.swapaxes(order, -1, -2) if candidate_major else order)


def _device_sort_order(distances: Array, valid: Array, key: Array, candidate_major: bool) -> Array:
  """`_sort_order` with XLA's sort (accelerators).

  XLA's CPU sort is fast only for a single integer operand (a multi-operand or float sort goes
  through a generic comparator, about 5x slower). Up to `BINNED_SORT_MAX_CANDIDATES` candidates
  one such sort gives the order (`_binned_sort_order`) and a check proves it exact; where the
  check fails, and above that size, `_exact_sort_order` gives it.
  """
  n_c = distances.shape[1]
  if n_c > BINNED_SORT_MAX_CANDIDATES or not candidate_major:
    order = _exact_sort_order(key)
    return order.T if candidate_major else order
  order, exact = _binned_sort_order(distances, valid, key)
  # The fallback runs only when a bin held more than BIN_FIXUP_PASSES distinct distances (or
  # non-finite ones spread the bins): its result is the same order, at the cost of the exact
  # path (96 against 49 ms for the order at [1344, 1344] on the 2-core CPU; the cond itself costs
  # about 10 ms there even when not taken).
  return jax.lax.cond(exact, lambda: order, lambda: _exact_sort_order(key).T)


def _order_key(distances: Array, valid: Array) -> Array:
  """int32 [N_e, N_c]: the distances as int32 in the same order (valid ones clipped to the
  largest finite float32, so that the +inf of invalid candidates sorts strictly after them)."""
  finite_max = jnp.finfo(jnp.float32).max
  key = jnp.where(valid[None, :], jnp.minimum(distances, finite_max), jnp.inf)
  bits = jax.lax.bitcast_convert_type(key, jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _exact_sort_order(key: Array) -> Array:
  """int32 [N_e, N_c]: each row's candidates ordered by (key, index), from `_order_key`'s keys.

  Two single-operand int32 sorts: (1) the keys are sorted, and each candidate's rank r (number
  of strictly smaller keys in its row) is found by binary search; (2) r * N_c + index
  (distinct; < 2^31 for N_c <= 46,340) is sorted, which orders by rank and then by index,
  i.e. a stable sort by distance. Above `PACKED_SORT_MAX_CANDIDATES` candidates (ASER-PC's
  whole-buffer precomputation) the keys are sorted once, stably, with the candidate index as
  a second operand (generic comparator; 30% less time than a stable sort of (invalid, float
  distance, index): 5.4 vs 7.8 CPU-s for [64, 433,808] on the 2-core CPU), which gives the
  same order.
  """
  n_e, n_c = key.shape
  index = jax.lax.broadcasted_iota(jnp.int32, (n_e, n_c), 1)
  if n_c > PACKED_SORT_MAX_CANDIDATES:
    # r * N_c + index would overflow int32: one stable two-operand sort (ties keep index order).
    return jax.lax.sort((key, index), dimension=1, is_stable=True, num_keys=1)[1]
  sorted_key = jax.lax.sort(key, dimension=1)
  rank = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left", method="scan"))(
    sorted_key, key
  ).astype(jnp.int32)
  return jax.lax.sort(rank * n_c + index, dimension=1) % n_c


def _binned_sort_order(distances: Array, valid: Array, key: Array) -> tuple[Array, Array]:
  """The order of `_sort_order` from one single-operand sort, and whether it is exact.

  Each row's valid distances are cut into 2^b equal bins between the row's smallest and largest
  (b = 32 - ceil(log2 N_c); invalid candidates in the last bin), and bin * 2^(32-b) + index is
  sorted as uint32: that orders the candidates by bin and, within a bin, by index. The bin is a
  non-decreasing function of the distance (a difference, a product with a positive scale and a
  floor, each rounded monotonically), so only candidates sharing a bin can be out of order;
  `BIN_FIXUP_PASSES` odd-even transposition passes over each bin's members, comparing the
  int32 keys, put them in order (a bin of equal distances is already in index order; the
  comparison is strict, so the passes keep it). A final check that every column is sorted by
  (key, index) makes the result exact whatever the data: a row where it fails (a bin of more
  than BIN_FIXUP_PASSES distinct distances, or NaN distances) returns exact = False.

  Args:
    distances: float [N_e, N_c], N_c <= 2^31.
    valid: bool [N_c].
    key: int32 [N_e, N_c], `_order_key(distances, valid)`.
  Returns:
    order: int32 [N_c, N_e] (candidate-major, as `_sort_order`).
    exact: bool []; True when order is the order of `_exact_sort_order(key).T`.
  """
  n_e, n_c = distances.shape
  index_bits = max(1, (n_c - 1).bit_length())
  last_bin = (1 << (32 - index_bits)) - 1
  finite_max = jnp.finfo(jnp.float32).max
  mask = valid[None, :]
  d = jnp.minimum(jnp.asarray(distances, jnp.float32), finite_max)
  low = jnp.min(jnp.where(mask, d, jnp.inf), axis=1, keepdims=True)
  high = jnp.max(jnp.where(mask, d, -jnp.inf), axis=1, keepdims=True)
  span = high - low
  scale = jnp.where(span > 0, jnp.float32(last_bin - 1) / span, 0.0)
  bins = jnp.floor((d - low) * scale)
  bins = jnp.clip(jnp.where(jnp.isnan(bins), 0.0, bins), 0, last_bin - 1).astype(jnp.uint32)
  # last_bin - 1 (up to 2^31 - 2) may round up in float32: clip again as an integer.
  bins = jnp.minimum(bins, jnp.uint32(last_bin - 1))
  bins = jnp.where(mask, bins, jnp.uint32(last_bin))
  index = jax.lax.broadcasted_iota(jnp.uint32, (n_e, n_c), 1)
  packed = jax.lax.sort((bins << index_bits) | index, dimension=1).T  # [N_c, N_e]
  order = (packed & jnp.uint32((1 << index_bits) - 1)).astype(jnp.int32)
  group = (packed >> index_bits).astype(jnp.int32)
  sorted_key = jnp.take_along_axis(key.T, order, axis=0)
  for i in range(BIN_FIXUP_PASSES):
    sorted_key, order = _transposition_pass(group, sorted_key, order, parity=i % 2)
  later = (sorted_key[:-1] > sorted_key[1:]) | (
    (sorted_key[:-1] == sorted_key[1:]) & (order[:-1] > order[1:])
  )
  return order, ~jnp.any(later)


def _transposition_pass(group: Array, key: Array, order: Array, parity: int) -> tuple[Array, Array]:
  """One odd-even transposition pass over [N_c, N_e] columns: positions (p, p + 1) with
  p = parity mod 2 swap where both are in one group and key[p] > key[p + 1]."""
  n, n_e = group.shape
  pairs = (n - parity) // 2

  def as_pairs(x):  # [pairs, 2, N_e]: reshaping, not gathering
    return x[parity : parity + 2 * pairs].reshape(pairs, 2, n_e)

  g, k, o = as_pairs(group), as_pairs(key), as_pairs(order)
  swap = ((g[:, 0] == g[:, 1]) & (k[:, 0] > k[:, 1]))[:, None]

  def apply(full, paired):
    moved = jnp.where(swap, paired[:, ::-1], paired).reshape(2 * pairs, n_e)
    return jnp.concatenate([full[:parity], moved, full[parity + 2 * pairs :]], axis=0)

  return apply(key, k), apply(order, o)


def _pairwise_distance(a: Array, b: Array, metric: str) -> Array:
  """[..., E] x [M, E] -> [..., M] float32: Euclidean or cosine distance."""
  if metric == "cosine":
    return class_selection.cosine_distance(a, b)
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  sq = (
    jnp.sum(a * a, -1)[..., None]
    + jnp.sum(b * b, -1)
    - 2.0 * jnp.einsum("...e,me->...m", a, b, precision=jax.lax.Precision.HIGHEST)
  )
  return jnp.sqrt(jnp.maximum(sq, 0.0))


def _cosine_similarity(a: Array, b: Array) -> Array:
  return jnp.einsum(
    "...e,...e->...",
    class_selection.normalize(a),
    class_selection.normalize(b),
    precision=jax.lax.Precision.HIGHEST,
  )


def _check_options(token_matching: str, distance: str, reduction: str, shapley: str = "knn"):
  if shapley not in SHAPLEY:
    raise ValueError(f"shapley must be one of {SHAPLEY}, got {shapley!r}")
  if token_matching not in TOKEN_MATCHING:
    raise ValueError(f"token_matching must be one of {TOKEN_MATCHING}, got {token_matching!r}")
  if distance not in DISTANCES:
    raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def image_knn_shapley(
  eval_class_embeddings: Array,
  eval_query_embeddings: Array,
  candidate_class_embeddings: Array,
  candidate_query_embeddings: Array,
  k: int,
  candidate_valid: Array | None = None,
  *,
  reduction: str = "min",
  token_matching: str = "all_to_all",
  distance: str = "l2",
  shapley: str = "knn",
  threshold: float | None = None,
  num_classes: float = TKNN_NUM_CLASSES,
) -> tuple[Array, Array]:
  """Image-level KNN-SVs of candidate images for evaluation images, from their top-k tokens.

  all_to_all (paper): every candidate token is a KNN candidate (N_c * t of them), every
    evaluation token an evaluation point; distance = `distance` between class embeddings,
    utility = cosine similarity of the tokens' query embeddings; the [N_e, t, N_c, t] KNN-SVs
    are reduced with `reduction` (max for the ASV left term, min for the right) over both
    token dims.
  nearest_token (released code, option): for each evaluation token, each candidate image is
    represented by its token nearest to it (distance = that minimum, utility = cosine of the
    evaluation token's and that token's query embeddings); KNN-SVs [N_e, t, N_c] over N_c
    image candidates, reduced over the evaluation token dim.

  Args:
    eval_class_embeddings: float [N_e, t, D]. The "class" tokens give the distances (the
      class embeddings, D = E, or the ViT image features, released `cls_embeds=False`).
    eval_query_embeddings: float [N_e, t, E]; the queries give the utilities.
    candidate_class_embeddings: float [N_c, t', D], as `eval_class_embeddings`.
    candidate_query_embeddings: float [N_c, t', E], as `eval_query_embeddings`.
    k: K of the KNN utility (static).
    candidate_valid: optional bool [N_c]; invalid candidates (all their tokens) get 0 and do
      not count.
    reduction: 'max' | 'min' over the token dims.
    token_matching: 'all_to_all' | 'nearest_token'.
    distance: 'l2' (the released code) | 'cosine' between class embeddings.
    shapley: 'knn' (exact KNN-SV, `knn_shapley`; k used) | 'tknn' (the released code's
      thresholded KNN-SV, `threshold_knn_shapley`; k unused).
    threshold: of 'tknn' (`threshold_knn_shapley`): distances >= threshold do not count
      (None: no threshold).
    num_classes: of 'tknn' (`threshold_knn_shapley`): C of the 1/C term.
  Returns:
    values: float32 [N_e, N_c] image-level KNN-SVs (0 for invalid candidates).
    image_distances: float32 [N_e, N_c]; min over token pairs of the distance (+inf for
      invalid candidates), for distance-rank records.
  Raises:
    ValueError: unknown option.
  Source: paper suppl. §C (instance level, max/min over k), docs/reference.md §7; released code
    `C_ASER.compute_shapley_values` for nearest_token and L2.
  """
  _check_options(token_matching, distance, reduction, shapley)
  if shapley == "knn":
    point_values = lambda d, u, v: knn_shapley(d, u, k, v)
  else:
    point_values = lambda d, u, v: threshold_knn_shapley(d, u, threshold, num_classes, v)
  eval_class = jnp.asarray(eval_class_embeddings, jnp.float32)
  eval_query = jnp.asarray(eval_query_embeddings, jnp.float32)
  cand_class = jnp.asarray(candidate_class_embeddings, jnp.float32)
  cand_query = jnp.asarray(candidate_query_embeddings, jnp.float32)
  n_e, t_e, e = eval_class.shape
  n_c, t_c, _ = cand_class.shape
  if candidate_valid is None:
    candidate_valid = jnp.ones((n_c,), bool)
  candidate_valid = jnp.asarray(candidate_valid, bool)
  reduce = jnp.max if reduction == "max" else jnp.min
  d = _pairwise_distance(
    eval_class.reshape(n_e * t_e, e), cand_class.reshape(n_c * t_c, e), distance
  ).reshape(n_e, t_e, n_c, t_c)
  image_distances = jnp.where(candidate_valid[None, :], d.min(axis=(1, 3)), jnp.inf)
  if token_matching == "all_to_all":
    u = jnp.einsum(
      "ae,be->ab",
      class_selection.normalize(eval_query.reshape(n_e * t_e, -1)),
      class_selection.normalize(cand_query.reshape(n_c * t_c, -1)),
      precision=jax.lax.Precision.HIGHEST,
    ).reshape(n_e, t_e, n_c, t_c)
    token_valid = jnp.repeat(candidate_valid, t_c)

    def image_values(d_rows, u_rows):  # [n, t, N_c, t] each -> [n, N_c]
      n = d_rows.shape[0]
      flat = lambda x: x.reshape(n * t_e, n_c * t_c)
      sv = point_values(flat(d_rows), flat(u_rows), token_valid).reshape(n, t_e, n_c, t_c)
      return reduce(reduce(sv, axis=3), axis=1)

  else:
    d, u = _nearest_token(d, eval_query, cand_query)

    def image_values(d_rows, u_rows):  # [n, t, N_c] each -> [n, N_c]
      n = d_rows.shape[0]
      flat = lambda x: x.reshape(n * t_e, n_c)
      sv = point_values(flat(d_rows), flat(u_rows), candidate_valid).reshape(n, t_e, n_c)
      return reduce(sv, axis=1)

  values = _map_image_blocks(image_values, d, u, t_e)
  return jnp.where(candidate_valid[None, :], values, 0.0), image_distances


def _nearest_token(d: Array, eval_query: Array, cand_query: Array) -> tuple[Array, Array]:
  """nearest_token matching: each candidate image represented, for each evaluation token, by
  its token nearest to it. d float32 [N_e, t, N_c, t'] -> (distances float32 [N_e, t, N_c],
  utilities float32 [N_e, t, N_c]: cosine of the evaluation token's and that token's query
  embeddings, eval_query [N_e, t, E], cand_query [N_c, t', E])."""
  nearest = jnp.argmin(d, axis=-1)  # [N_e, t, N_c]
  matched = jnp.take_along_axis(
    cand_query[None, None],  # [N_e,t,N_c,E]
    nearest[..., None, None],
    axis=3,
  )[..., 0, :]
  return jnp.min(d, axis=-1), _cosine_similarity(eval_query[:, :, None, :], matched)


def _map_image_blocks(fn, d: Array, u: Array, tokens: int) -> Array:
  """fn over blocks of about `EVAL_BLOCK_TOKENS` evaluation tokens (whole images), one block
  after the other (`lax.map`), the last block padded with zero rows whose results are
  dropped. d, u: [N_e, ...] with equal leading dims; fn: ([n, ...], [n, ...]) -> [n, N_c].
  Rows are independent, so the result is fn(d, u) bit for bit."""
  n_e = d.shape[0]
  num_blocks = -(-n_e * tokens // EVAL_BLOCK_TOKENS)
  if num_blocks <= 1:
    return fn(d, u)
  per_block = -(-n_e // num_blocks)
  num_blocks = -(-n_e // per_block)
  pad = num_blocks * per_block - n_e

  def blocks(x):
    x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape((num_blocks, per_block) + x.shape[1:])

  values = jax.lax.map(lambda rows: fn(*rows), (blocks(d), blocks(u)))
  return values.reshape((num_blocks * per_block,) + values.shape[2:])[:n_e]


def precompute_left_term(
  class_embeddings: Array,
  query_embeddings: Array,
  k: int,
  *,
  chunk_size: int = 64,
  token_matching: str = "all_to_all",
  distance: str = "l2",
  shapley: str = "knn",
  threshold: float | None = None,
  num_classes: float = TKNN_NUM_CLASSES,
) -> tuple[Array, Array]:
  """ASER-PC's precomputed ASV left term over the whole buffer (candidates = evaluation = buffer).

  One jitted scan on one device, without progress or cache: the reference of
  `owl_cl.replay.retrieval.asv_left.compute_left_term`, which runs use (sharded over the devices,
  resumable, cached next to the replay store).

  For evaluation images j in chunks of `chunk_size` (memory: chunk * t * N * t floats), the
  max-reduced image-level KNN-SVs s_j(i) of every buffer image i are computed
  (`image_knn_shapley`, reduction 'max'); their mean and min over j are accumulated.

  Args:
    class_embeddings: float [N, t, E]; the buffer's top-k class embeddings.
    query_embeddings: float [N, t, E]; the buffer's top-k query embeddings.
    k: K of the KNN utility.
    chunk_size: evaluation images per chunk (static, >= 1).
    token_matching: as in `image_knn_shapley`.
    distance: as in `image_knn_shapley`.
    shapley: as in `image_knn_shapley`.
    threshold: as in `image_knn_shapley`.
    num_classes: as in `image_knn_shapley`.
  Returns:
    left_term: float32 [N]; (1/N) sum_j s_j(i) (the left term of eq. 3 without w).
    left_min: float32 [N]; min_j s_j(i) (for w of eq. 4 over a candidate subset).
  Raises:
    ValueError: chunk_size < 1 or unknown options.
  Source: paper §4 "ASER-PC", suppl. §C; docs/reference.md §7.
  """
  if int(chunk_size) < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  class_embeddings = jnp.asarray(class_embeddings, jnp.float32)
  query_embeddings = jnp.asarray(query_embeddings, jnp.float32)
  n = class_embeddings.shape[0]
  chunk = min(int(chunk_size), n)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n
  rows_class = jnp.pad(class_embeddings, ((0, pad), (0, 0), (0, 0)))
  rows_query = jnp.pad(query_embeddings, ((0, pad), (0, 0), (0, 0)))
  row_valid = jnp.arange(num_chunks * chunk) < n

  def one_chunk(carry, rows):
    total, minimum = carry
    r_class, r_query, r_valid = rows
    values, _ = image_knn_shapley(
      r_class,
      r_query,
      class_embeddings,
      query_embeddings,
      k,
      reduction="max",
      token_matching=token_matching,
      distance=distance,
      shapley=shapley,
      threshold=threshold,
      num_classes=num_classes,
    )
    total = total + jnp.sum(jnp.where(r_valid[:, None], values, 0.0), axis=0)
    minimum = jnp.minimum(minimum, jnp.min(jnp.where(r_valid[:, None], values, jnp.inf), 0))
    return (total, minimum), None

  shape = lambda x: x.reshape((num_chunks, chunk) + x.shape[1:])
  (total, minimum), _ = jax.lax.scan(
    one_chunk,
    (jnp.zeros((n,), jnp.float32), jnp.full((n,), jnp.inf, jnp.float32)),
    (shape(rows_class), shape(rows_query), shape(row_valid)),
  )
  return total / n, minimum

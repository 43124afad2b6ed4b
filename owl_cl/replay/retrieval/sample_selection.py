"""Sample-selection primitives (paper §4 "Sample Selection Primitives"; docs/reference.md §7).

A sample-selection primitive picks buffer images, usually one per chosen class. Everything is
jittable; `num` and `without_replacement` are static. Invalid slots (nothing eligible) return
index 0 with valid False, so that gathering them is always safe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.replay import class_index as class_index_lib

Array = jax.Array


def class_eligibility(class_index, eligible_images: Array) -> Array:
  """Classes that still have at least one eligible image.

  Args:
    class_index: `class_index.ClassIndex` (`ReplayBuffer.class_index`), or a concrete bool
      [N, C] membership (the index is then built on the host).
    eligible_images: bool [N] (e.g. `dedup.eligible_images`).
  Returns:
    bool [C]: class_eligible[c] = any_i(class_membership[i, c] and eligible_images[i]).
  Cost: one O(P) pass (P ~ memberships + N, `class_index.pools`), not O(N * C).
  Source: docs/reference.md §7 ("classes with no eligible image get probability 0" / are skipped).
  """
  return class_index_lib.class_eligibility(
    class_index_lib.as_class_index(class_index), eligible_images
  )


def uniform_in_class(
  key: Array,
  class_index,
  eligible: Array,
  classes: Array,
  without_replacement: bool = True,
) -> tuple[Array, Array]:
  """Uniform sample selection: one image uniformly among the eligible members of each class.

  Slots are filled sequentially (lax.scan over the B classes). With `without_replacement`
  (deduplication active) each chosen image is removed from the eligible set before the next
  slot, so no image appears twice in one call. If the slot's class has no eligible member
  left (possible mid-scan, or class = -1), the slot falls back to an image drawn uniformly
  among *all* eligible images of any class; if nothing is eligible at all the slot is invalid
  (index 0, valid False).

  Slot j draws r = randint(key_j, 0, count) and takes the r-th available candidate in
  ascending image order, found through the member index in O(sqrt N) per slot
  (`class_index.rth_available`; one O(P) pass per call builds the availability).

  Args:
    key: PRNG key.
    class_index: `class_index.ClassIndex` (`ReplayBuffer.class_index`), or a concrete bool
      [N, C] membership (indexed on the host; not under jit).
    eligible: bool [N]; eligible images at the start of the call.
    classes: int [B]; class of each slot (-1 = none: fall back to any eligible image).
    without_replacement: static; True = mark as you go (use when dedup is active).
  Returns:
    indices: int32 [B] buffer indices (0 where invalid).
    valid: bool [B].
  Source: paper §4 "Uniform", docs/reference.md §7.
  """
  classes = jnp.asarray(classes, jnp.int32)
  return uniform_in_class_active(
    key,
    class_index,
    eligible,
    classes,
    jnp.ones(classes.shape, bool),
    without_replacement=without_replacement,
  )


def _sequential_sample(key: Array, eligible: Array, num: int) -> Array:
  """int32 [num]: an ordered uniform sample without replacement of the True entries of bool
  [N]: draw i takes the r-th still available entry, r = randint(split(key, num)[i], 0,
  count), found through per-block counts (`class_index.block_pool`): one O(N) sum per call,
  O(sqrt N) per draw, no random number per image. Entries past the number of eligible
  images are 0 (the caller masks them).

  Every ordered num-tuple of distinct eligible images is equally likely (each draw is
  uniform over the remaining ones).
  """
  pool = class_index_lib.block_pool(eligible)
  keys = jax.random.split(key, num)

  def step(pool, k):
    count = jnp.sum(pool.block_counts)
    r = jax.random.randint(k, (), 0, jnp.maximum(count, 1))
    image = class_index_lib.rth_in_block_pool(pool, r)
    found = count > 0
    pool = class_index_lib.remove_from_block_pool(pool, image, found)
    return pool, jnp.where(found, image, 0)

  return jax.lax.scan(step, pool, keys)[1]


def uniform(key: Array, eligible: Array, num: int) -> tuple[Array, Array]:
  """Uniform selection without a class step: `num` distinct images among the eligible ones.

  Sequential uniform draws without replacement (`_sequential_sample`): an exactly uniform
  ordered sample, in one O(N) pass plus O(sqrt N) per image (no permutation of the buffer,
  no random number per buffer image). If fewer than `num` images are eligible the
  remaining slots are invalid (index 0, valid False).

  Args:
    key: PRNG key.
    eligible: bool [N].
    num: number of images (static, <= N).
  Returns:
    indices: int32 [num]; valid: bool [num].
  Raises:
    ValueError: num > N.
  Source: paper Table 2 "Uniform", docs/reference.md §7.
  """
  eligible = jnp.asarray(eligible, bool)
  n = eligible.shape[0]
  if num > n:
    raise ValueError(f"cannot draw {num} distinct images from a buffer of {n}")
  first = _sequential_sample(key, eligible, num)
  valid = jnp.arange(num) < jnp.sum(eligible, dtype=jnp.int32)
  return jnp.where(valid, first, 0), valid


def uniform_in_class_active(
  key: Array,
  class_index,
  eligible: Array,
  classes: Array,
  active: Array,
  without_replacement: bool = True,
  fallback: bool = True,
  pool: class_index_lib.Pools | None = None,
) -> tuple[Array, Array]:
  """`uniform_in_class` with a slot mask: inactive slots pick nothing (valid False).

  Args:
    key: as `uniform_in_class`.
    class_index: as `uniform_in_class`.
    eligible: as `uniform_in_class`.
    classes: as `uniform_in_class`.
    without_replacement: as `uniform_in_class`.
    active: bool [B]; inactive slots return index 0, valid False and remove nothing from the
      eligible set.
    fallback: static; True: a slot whose class has no eligible member left draws among all
      eligible images (as `uniform_in_class`); False: it is invalid (the released code's
      per-image candidate subsets stop at an exhausted class).
    pool: optional `class_index.pools(index, eligible)`, computed once per retrieval call by
      its caller (None: computed here).
  Returns:
    indices int32 [B], valid bool [B].
  Cost: one O(P) pass per call, then O(class_blocks + b) per slot (b ~ sqrt N); the draws
    (key_j = split(key, B)[j], r = randint(key_j, 0, count)) are those of a scan over the
    membership column, image for image.
  Source: paper §4 "Uniform", docs/reference.md §7, §9 (slot mask for loss adaptivity).
  """
  index = class_index_lib.as_class_index(class_index)
  classes = jnp.asarray(classes, jnp.int32)
  active = jnp.asarray(active, bool)
  keys = jax.random.split(key, classes.shape[0])
  pool = class_index_lib.pools(index, eligible) if pool is None else pool

  def step(pool, inputs):
    k, c, on = inputs
    in_class = jnp.where(c >= 0, class_index_lib.segment_count(index, pool, jnp.maximum(c, 0)), 0)
    use_class = in_class > 0
    if fallback:
      count = jnp.where(use_class, in_class, class_index_lib.all_images_count(index, pool))
    else:
      count = in_class
    count = jnp.where(on, count, 0)
    r = jax.random.randint(k, (), 0, jnp.maximum(count, 1))
    found = count > 0
    image = class_index_lib.rth_available(index, pool, c, use_class, r)
    image = jnp.where(found, image, 0)
    if without_replacement:
      pool = class_index_lib.remove_image(index, pool, image, found)
    return pool, (image, found)

  _, (indices, valid) = jax.lax.scan(step, pool, (keys, classes, active))
  return indices, valid


def uniform_active(key: Array, eligible: Array, active: Array) -> tuple[Array, Array]:
  """`uniform` with a slot mask: the i-th active slot gets the i-th image of a uniform ordered
  sample without replacement of the eligible images (`_sequential_sample`, as `uniform`);
  inactive slots get index 0, valid False.

  Args:
    key: PRNG key.
    eligible: bool [N].
    active: bool [num] (num <= N, static length).
  Returns:
    indices int32 [num]; valid bool [num].
  Raises:
    ValueError: num > N.
  Source: paper Table 2 "Uniform", docs/reference.md §7.
  """
  eligible = jnp.asarray(eligible, bool)
  active = jnp.asarray(active, bool)
  n, num = eligible.shape[0], active.shape[0]
  if num > n:
    raise ValueError(f"cannot draw {num} distinct images from a buffer of {n}")
  first = _sequential_sample(key, eligible, num)
  rank = jnp.cumsum(active, dtype=jnp.int32) - 1
  valid = active & (rank < jnp.sum(eligible, dtype=jnp.int32))
  return jnp.where(valid, first[jnp.clip(rank, 0, num - 1)], 0), valid


def prototype_weighted_probs(distances: Array, eligible: Array, w) -> Array:
  """Prototype-weighted (GRASP) distribution over images (paper eqs. 1-2).

  p_i = s_i / sum_{eligible m} s_m with s_i = (d_i + 1e-8)^(-w), computed in float32 in log
  space (a softmax of -w * log(d + 1e-8)), so large w cannot overflow. Entries that are not
  eligible, or whose distance is not finite (+inf marks non-members in
  `ReplayBuffer.prototype_distances`), get probability 0.

  Args:
    distances: float [..., M]; prototype distances d_{i,c} of the M images to the class
      prototype (cosine distances in [0, 2]).
    eligible: bool [..., M]; images that may be drawn (members of the class, not deduplicated).
    w: float >= 0 (may be traced); paper 1.0, released code 0.7. w = 0 gives uniform.
  Returns:
    float32 [..., M]; sums to 1 over the last axis, all zeros where nothing is eligible.
  Source: paper §4 "Prototype-Weighted" eqs. (1)-(2), docs/reference.md §7.
  """
  distances = jnp.asarray(distances, jnp.float32)
  eligible = jnp.asarray(eligible, bool) & jnp.isfinite(distances)
  logits = -jnp.asarray(w, jnp.float32) * jnp.log(jnp.where(eligible, distances, 1.0) + 1e-8)
  logits = jnp.where(eligible, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  unnorm = jnp.where(eligible, jnp.exp(logits - top), 0.0)
  total = unnorm.sum(axis=-1, keepdims=True)
  return jnp.where(total > 0, unnorm / jnp.where(total > 0, total, 1.0), 0.0)


def _log_or_minus_inf(p: Array) -> Array:
  """log p, -inf where p <= 0 (categorical logits of non-negative weights)."""
  return jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)


def prototype_weighted_in_class(
  key: Array,
  class_index,
  eligible: Array,
  classes: Array,
  weights: Array,
  active: Array,
  without_replacement: bool = True,
  fallback: bool = True,
  pool: class_index_lib.Pools | None = None,
) -> tuple[Array, Array]:
  """Prototype-weighted (GRASP) sample selection: one image per slot within its class.

  Slot j draws among the eligible members of `classes[j]` with `prototype_weighted_probs`
  (exponent `weights[j]`; 0 = uniform within the class); slots are filled sequentially
  (lax.scan) and, with `without_replacement`, a drawn image leaves the eligible set. If the
  slot's class has no eligible member left (or is -1) the slot falls back to a uniform draw
  among all eligible images (as `uniform_in_class`); if nothing is eligible, or the slot is
  inactive, it returns index 0, valid False.

  The weighted draw reads the class's own blocks only (`class_index.by_class_size`, O(M_c)
  per slot for the class's size M_c rounded up to a power of two of blocks, not O(N)); it
  picks a block by its probability mass, then a member within it (exactly eq. 2's p_i); the
  fallback draw is `uniform_in_class`'s (same key, same image).

  Args:
    key: PRNG key.
    class_index: `class_index.ClassIndex` built with the prototype distances
      (`ReplayBuffer.class_index`), or a concrete float [N, C] prototype_distances array
      (+inf for non-members; indexed on the host, not under jit).
    eligible: bool [N].
    classes: int [B]; -1 = no class.
    weights: float [B] (or scalar, broadcast); w of eq. 1 per slot.
    active: bool [B].
    without_replacement: static.
    fallback: static; False: a slot whose class has no eligible member left is invalid
      instead of drawing uniformly among all eligible images.
    pool: optional `class_index.pools(index, eligible)` (as `uniform_in_class_active`).
  Returns:
    indices int32 [B], valid bool [B].
  Source: paper §4 "Prototype-Weighted" (eqs. 1-2), docs/reference.md §7.
  """
  if isinstance(class_index, class_index_lib.ClassIndex):
    index = class_index
  else:
    distances = np.asarray(class_index, np.float32)
    index = class_index_lib.build_class_index(np.isfinite(distances), distances)
  classes = jnp.asarray(classes, jnp.int32)
  num = classes.shape[0]
  weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), (num,))
  active = jnp.asarray(active, bool)
  keys = jax.random.split(key, num)
  pool = class_index_lib.pools(index, eligible) if pool is None else pool

  def step(pool, inputs):
    k, c, w, on = inputs
    k_weighted, k_uniform = jax.random.split(k)

    def weighted_draw(blocks):
      members, distances, in_class = class_index_lib.class_slice(index, c, blocks)
      available = class_index_lib.slice_flags(index, pool, c, blocks) & in_class & on
      probs = prototype_weighted_probs(distances, available, w).reshape(blocks, index.block)
      # Two-level draw, exactly p_i: a block with probability sum(p over the block), then a
      # member of it with probability p_i / that sum (blocks + b random numbers, not M).
      k_block, k_member = jax.random.split(k_weighted)
      block = jax.random.categorical(k_block, _log_or_minus_inf(probs.sum(axis=1)))
      member = jax.random.categorical(k_member, _log_or_minus_inf(probs[block]))
      return members[block * index.block + member], jnp.any(probs > 0)

    # Reads the class's own blocks only (rounded up to a power of two).
    weighted, has_member = class_index_lib.by_class_size(index, c, weighted_draw)
    if fallback:
      count = jnp.where(on, class_index_lib.all_images_count(index, pool), 0)
    else:
      count = jnp.zeros((), jnp.int32)
    r = jax.random.randint(k_uniform, (), 0, jnp.maximum(count, 1))
    fallback_index = class_index_lib.rth_available(index, pool, c, jnp.zeros((), bool), r)
    found = has_member | (count > 0)
    index_ = jnp.where(has_member, weighted, fallback_index)
    index_ = jnp.where(found, index_, 0)
    if without_replacement:
      pool = class_index_lib.remove_image(index, pool, index_, found)
    return pool, (index_, found)

  _, (indices, valid) = jax.lax.scan(step, pool, (keys, classes, weights, active))
  return indices, valid


def normalized_entropy(p: Array, axis: int = -1) -> Array:
  """Normalised Shannon entropy H(p) / log(n) of distributions along `axis`.

  Args:
    p: float [..., n, ...]; non-negative, summing to 1 along `axis` (zeros allowed: 0 log 0 = 0).
    axis: the distribution axis; n = p.shape[axis] (the released code normalises by the
      number of outcomes, ineligible classes included).
  Returns:
    float32 with `axis` removed, in [0, 1]; 1 = uniform over all n outcomes. n = 1 gives 0.
  Source: paper §4 "A-SW-GRASP", Figures 3-4; released code `calculate_entropy`.
  """
  p = jnp.asarray(p, jnp.float32)
  n = p.shape[axis]
  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  h = -jnp.sum(plogp, axis=axis)
  if n <= 1:
    return jnp.zeros_like(h)
  return h / jnp.log(jnp.float32(n))


WEIGHT_REDUCTIONS = ("min", "max")


def asv_from_terms(
  left_term: Array,
  left_extreme: Array,
  right_values: Array,
  candidate_valid: Array,
  c,
  weight_reduction: str = "min",
) -> tuple[Array, Array]:
  """ASV (eq. 3) from a left term per candidate and the right term's KNN-SV matrix.

  Args:
    left_term: float [N_c]; mean over evaluation points of the left KNN-SVs of each candidate.
    left_extreme: float []; min over the set S_l (weight_reduction 'min', paper) or max of
      the left term over valid candidates ('max', released code) — the denominator of eq. 4.
    right_values: float [N_e, N_c]; right KNN-SVs (rows = new images).
    candidate_valid: bool [N_c].
    c: float; eq. 4's constant (paper 0.15).
    weight_reduction: 'min' | 'max' (only documents which extreme was passed).
  Returns:
    asv: float32 [N_c], -inf for invalid candidates.
    w: float32 [], eq. 4's weight c |min S_r| / |left_extreme| (c if the denominator is 0).
  Source: paper eqs. (3)-(4), docs/reference.md §7.
  """
  if weight_reduction not in WEIGHT_REDUCTIONS:
    raise ValueError(
      f"weight_reduction must be one of {WEIGHT_REDUCTIONS}, got {weight_reduction!r}"
    )
  valid = jnp.asarray(candidate_valid, bool)
  right_values = jnp.asarray(right_values, jnp.float32)
  right_term = jnp.min(right_values, axis=0)
  right_min = jnp.min(jnp.where(valid, right_term, jnp.inf))
  right_min = jnp.where(jnp.isfinite(right_min), right_min, 0.0)
  denominator = jnp.abs(jnp.asarray(left_extreme, jnp.float32))
  c = jnp.asarray(c, jnp.float32)
  w = jnp.where(
    denominator > 0, c * jnp.abs(right_min) / jnp.where(denominator > 0, denominator, 1.0), c
  )
  asv = w * jnp.asarray(left_term, jnp.float32) - right_term
  return jnp.where(valid, asv, -jnp.inf), w


def adversarial_shapley_value(
  sv_left: Array, sv_right: Array, c, *, valid: Array | None = None, weight_reduction: str = "min"
) -> Array:
  """Adversarial Shapley value of each candidate (paper eqs. 3-4).

  ASV(i) = w * mean_{j in D_c} sv_left[j, i] - min_{j in D_e} sv_right[j, i], with
  w = c * |min S_r| / |min S_l| (eq. 4; S_r, S_l = all entries of sv_right, sv_left over valid
  candidates). weight_reduction 'max' (released code): the denominator is |max of the left
  term| (the mean over rows) instead.

  Args:
    sv_left: float [N_c, N_c]; rows = candidates acting as evaluation points, columns =
      candidates (`knn_shapley` layout), image-level (max-reduced over tokens).
    sv_right: float [N_e, N_c]; rows = new images, columns = candidates (min-reduced).
    c: float (paper 0.15); may be traced.
    valid: optional bool [N_c]; invalid candidates are excluded from rows, means and minima,
      and get -inf.
    weight_reduction: 'min' (paper) | 'max' (released code).
  Returns:
    float32 [N_c]; higher = replay first (take the top-n).
  Raises:
    ValueError: unknown weight_reduction or shapes that disagree.
  Source: paper eqs. (3)-(4), suppl. §C, docs/reference.md §7.
  """
  sv_left = jnp.asarray(sv_left, jnp.float32)
  sv_right = jnp.asarray(sv_right, jnp.float32)
  n_c = sv_left.shape[-1]
  if sv_left.shape != (n_c, n_c) or sv_right.ndim != 2 or sv_right.shape[1] != n_c:
    raise ValueError(
      f"sv_left must be [N_c, N_c] and sv_right [N_e, N_c]; got "
      f"{sv_left.shape} and {sv_right.shape}"
    )
  valid = jnp.ones((n_c,), bool) if valid is None else jnp.asarray(valid, bool)
  left_term, left_extreme = left_term_and_extreme(sv_left, valid, weight_reduction)
  return asv_from_terms(left_term, left_extreme, sv_right, valid, c, weight_reduction)[0]


def left_term_and_extreme(
  sv_left: Array, valid: Array, weight_reduction: str = "min"
) -> tuple[Array, Array]:
  """Left term (mean over valid rows) of [N_c, N_c] left KNN-SVs, and eq. 4's denominator.

  Returns (left_term float32 [N_c], extreme float32 []): extreme = min over valid entries
  (paper) or max of the left term over valid candidates (released code). Source: eqs. (3)-(4).
  """
  valid = jnp.asarray(valid, bool)
  pair = valid[:, None] & valid[None, :]
  count = jnp.maximum(jnp.sum(valid, dtype=jnp.float32), 1.0)
  left_term = jnp.sum(jnp.where(pair, sv_left, 0.0), axis=0) / count
  if weight_reduction == "min":
    extreme = jnp.min(jnp.where(pair, sv_left, jnp.inf))
  else:
    extreme = jnp.max(jnp.where(valid, left_term, -jnp.inf))
  return left_term, jnp.where(jnp.isfinite(extreme), extreme, 0.0)

"""Tests of owl_cl.replay.class_index: the per-class member index and the draws through it
(docs/reference.md §7, issue 10 item 5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import class_index
from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry
from owl_cl.replay.retrieval import sample_selection as ss

# 3 images, 2 classes: class 0 = {0, 1}, class 1 = {1, 2}.
SMALL = np.array([[1, 0], [1, 1], [0, 1]], bool)


def test_index_hand_worked():
  index = class_index.build_class_index(SMALL, np.array([[0.5, np.inf], [0.25, 1.0], [np.inf, 2]]))
  b = index.block
  assert b == 16 and index.class_blocks == 1 and index.image_blocks == 1
  np.testing.assert_array_equal(index.counts, [2, 2])
  # Segments: class 0, class 1, all images; one block each, padded with the sentinel N = 3.
  np.testing.assert_array_equal(index.block_starts, [0, 1, 2, 3])
  members = np.asarray(index.members)
  np.testing.assert_array_equal(members[:b], [0, 1] + [3] * 14)
  np.testing.assert_array_equal(members[b : 2 * b], [1, 2] + [3] * 14)
  np.testing.assert_array_equal(members[2 * b : 3 * b], [0, 1, 2] + [3] * 13)
  assert (members[3 * b :] == 3).all() and members.size == 4 * b  # 3 + 1 blocks, power of 2
  distances = np.asarray(index.member_distances)
  np.testing.assert_array_equal(distances[[0, 1, b, b + 1]], [0.5, 0.25, 1.0, 2.0])
  assert np.isinf(np.delete(distances, [0, 1, b, b + 1])).all()
  # Inverse: image 0 at position 0 (class 0) and 2b (all images); image 1 at 1, b, 2b + 1.
  starts = np.asarray(index.image_starts)
  positions = np.asarray(index.image_positions)
  np.testing.assert_array_equal(starts, [0, 2, 5, 7])
  np.testing.assert_array_equal(positions[:7], [0, 2 * b, 1, b, 2 * b + 1, b + 1, 2 * b + 2])
  assert index.image_entries == 4  # image 1: 3 entries, rounded up to a power of two
  # Eligibility per class through the index.
  pool = class_index.pools(index, jnp.array([False, False, True]))
  np.testing.assert_array_equal(class_index.class_available_counts(index, pool), [0, 1])
  pool = class_index.remove_image(index, pool, jnp.int32(2), jnp.bool_(True))
  np.testing.assert_array_equal(class_index.class_available_counts(index, pool), [0, 0])
  assert int(class_index.all_images_count(index, pool)) == 0


def test_index_errors():
  with pytest.raises(ValueError, match=r"\[N, C\]"):
    class_index.build_class_index(np.ones(3, bool))
  with pytest.raises(ValueError, match="prototype_distances must be"):
    class_index.build_class_index(SMALL, np.ones((3, 3)))
  with pytest.raises(ValueError, match=r"eligible must be \[N=3\]"):
    class_index.pools(class_index.build_class_index(SMALL), jnp.ones(4, bool))
  with pytest.raises(ValueError, match="concrete"):
    jax.jit(class_index.build_class_index)(SMALL)
  buffer = state_lib.make_replay_buffer(
    SMALL, np.ones((2, 4)), np.ones((3, 2)), *[np.ones((3, 1, 4))] * 2
  )
  with pytest.raises(ValueError, match="make_replay_buffer"):
    registry.get_algorithm("uniform_balanced")(
      state_lib.init_replay_state(3, jax.random.PRNGKey(0)), buffer.replace(class_index=None), {}, 2
    )


def _reference_uniform_in_class(key, membership, eligible, classes, active, replace, fallback):
  """The O(N)-per-slot scan over the membership column (the implementation before the
  index): slot j takes the r-th available candidate, r = randint(key_j, 0, count)."""
  membership = jnp.asarray(membership, bool)

  def step(available, inputs):
    k, c, on = inputs
    members = jnp.take(membership, jnp.maximum(c, 0), axis=1) & available & (c >= 0)
    if fallback:
      candidates = jnp.where(members.any(), members, available) & on
    else:
      candidates = members & on
    count = jnp.sum(candidates, dtype=jnp.int32)
    r = jax.random.randint(k, (), 0, jnp.maximum(count, 1))
    found = count > 0
    index = jnp.where(found, jnp.argmax(jnp.cumsum(candidates, dtype=jnp.int32) > r), 0)
    if not replace:
      available = available.at[index].set(available[index] & ~found)
    return available, (index, found)

  keys = jax.random.split(key, classes.shape[0])
  return jax.lax.scan(step, jnp.asarray(eligible, bool), (keys, classes, active))[1]


@pytest.mark.slow
@pytest.mark.parametrize("without_replacement", [True, False])
@pytest.mark.parametrize("fallback", [True, False])
def test_uniform_in_class_equals_the_column_scan(without_replacement, fallback):
  # Same keys -> the same images as the O(N) scan, slot for slot: classes that run out
  # within the call (fallback / invalid), class -1, inactive slots, an empty class, and
  # classes larger than a block (several blocks per class, N > b).
  rng = np.random.default_rng(0)
  n, c, num = 300, 5, 40
  membership = rng.random((n, c)) < np.array([0.9, 0.5, 0.05, 0.01, 0.0])
  index = class_index.build_class_index(membership)
  assert index.class_blocks > 1
  new = jax.jit(ss.uniform_in_class_active, static_argnums=(5, 6))  # pool: argument 7
  old = jax.jit(_reference_uniform_in_class, static_argnums=(5, 6))
  for seed in range(4):
    eligible = rng.random(n) < (0.2, 0.9, 1.0, 0.02)[seed]
    classes = jnp.asarray(rng.integers(-1, c, num), jnp.int32)
    active = jnp.asarray(rng.random(num) < 0.85)
    key = jax.random.PRNGKey(seed)
    want = old(key, membership, eligible, classes, active, not without_replacement, fallback)
    got = new(key, index, eligible, classes, active, without_replacement, fallback)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    # The availability handed in by the caller (one pass per retrieval call) is the same.
    pool = class_index.pools(index, jnp.asarray(eligible))
    handed = new(key, index, eligible, classes, active, without_replacement, fallback, pool)
    np.testing.assert_array_equal(np.asarray(handed[0]), np.asarray(want[0]))
    # ... and it is what the draws read: a pool with nothing available draws nothing.
    empty = class_index.pools(index, jnp.zeros((n,), bool))
    none = new(key, index, eligible, classes, active, without_replacement, fallback, empty)
    assert not np.asarray(none[1]).any()


@pytest.mark.slow
def test_prototype_weighted_matches_exact_probabilities():
  # Chi-square of 4000 draws of a class of 20 members, two blocks of its segment (b = 16:
  # the block-then-member draw), against eq. 2's probabilities p_i = (d_i + 1e-8)^-w / sum,
  # with earlier slots' draws removed: slot 1 draws from the class minus slot 0's image, so
  # its marginal is sum_j p_j * p_i / (1 - p_j) (j != i).
  rng = np.random.default_rng(1)
  n = 60
  distances = np.full((n, 2), np.inf, np.float32)
  members = np.sort(rng.choice(n, 20, replace=False))
  distances[members, 0] = np.linspace(0.1, 1.2, 20)
  distances[rng.choice(n, 10, replace=False), 1] = 0.5
  eligible = np.ones(n, bool)
  eligible[members[7]] = False
  keys = jax.random.split(jax.random.PRNGKey(3), 4000)
  draw = jax.jit(
    jax.vmap(
      lambda k, index: ss.prototype_weighted_in_class(
        k, index, eligible, jnp.array([0, 0]), jnp.array([1.0, 0.5]), jnp.array([True, True])
      )[0],
      in_axes=(0, None),
    )
  )
  index = class_index.build_class_index(np.isfinite(distances), distances)
  assert index.block == 16 and index.class_blocks == 2
  got = np.asarray(draw(keys, index))
  assert (got[:, 0] != got[:, 1]).all()
  pool = members[eligible[members]]
  s0 = 1 / (distances[pool, 0] + 1e-8)
  p0 = s0 / s0.sum()
  s1 = 1 / np.sqrt(distances[pool, 0] + 1e-8)
  p1 = np.array(
    [
      sum(p0[j] * s1[i] / (s1.sum() - s1[j]) for j in range(len(pool)) if j != i)
      for i in range(len(pool))
    ]
  )
  for slot, p in ((0, p0), (1, p1)):
    counts = np.array([np.sum(got[:, slot] == i) for i in pool])
    assert counts.sum() == len(keys)  # only eligible members of class 0
    expected = p * len(keys)
    # 18 degrees of freedom: p = 0.001 critical value 42.3.
    assert ((counts - expected) ** 2 / expected).sum() < 42.3, (slot, counts, expected)


def test_different_buffers_of_the_same_shapes_do_not_recompile(make_buffer):
  traces = []
  algo = registry.get_algorithm("grasp")

  def traced(rstate, buffer, features, num):
    traces.append(1)
    return algo(rstate, buffer, features, num)

  f = jax.jit(traced, static_argnums=3)
  b1, b2 = make_buffer(seed=1), make_buffer(seed=2)
  assert not np.array_equal(b1.class_membership, b2.class_membership)
  s = state_lib.init_replay_state(b1.num_images, jax.random.PRNGKey(0))
  for buffer in (b1, b2, b1):
    idx, valid, s = f(s, buffer, {}, 4)
    assert np.asarray(valid).all()
    assert np.asarray(buffer.class_membership)[np.asarray(idx)].any(1).all()
  assert len(traces) == 1

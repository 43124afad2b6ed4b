"""Tests of owl_cl.replay.retrieval.sample_selection (docs/reference.md §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import class_index
from owl_cl.replay.retrieval import sample_selection as ss

# 6 images, 3 classes.
MEMBERSHIP = np.array(
  [
    [1, 0, 0],
    [1, 1, 0],
    [0, 1, 0],
    [0, 0, 1],
    [1, 0, 0],
    [0, 1, 0],
  ],
  bool,
)


def test_class_eligibility():
  eligible = np.array([0, 0, 1, 1, 0, 0], bool)
  np.testing.assert_array_equal(
    np.asarray(ss.class_eligibility(MEMBERSHIP, eligible)), [False, True, True]
  )


INDEX = class_index.build_class_index(MEMBERSHIP)
_in_class = jax.jit(ss.uniform_in_class, static_argnames="without_replacement")


def test_uniform_in_class_members_unique_and_fallback():
  eligible = np.ones(6, bool)
  for seed in range(10):
    idx, valid = _in_class(
      jax.random.PRNGKey(seed), INDEX, eligible, np.array([0, 0, 0, 2], np.int32)
    )
    idx, valid = np.asarray(idx), np.asarray(valid)
    assert valid.all()
    assert len(set(idx.tolist())) == 4  # never twice within a call
    assert MEMBERSHIP[idx[:3], 0].all()  # class 0 has exactly 3 images
    assert idx[3] == 3
  # class 2 has a single image: the second slot falls back to another eligible image.
  idx, valid = _in_class(jax.random.PRNGKey(0), INDEX, eligible, np.array([2, 2], np.int32))
  assert np.asarray(valid).all() and idx[0] == 3 and idx[1] != 3
  # class -1 means "any eligible image".
  only = np.array([0, 0, 0, 0, 1, 0], bool)
  idx, valid = _in_class(jax.random.PRNGKey(0), INDEX, only, np.array([-1], np.int32))
  assert int(idx[0]) == 4 and bool(valid[0])
  # nothing eligible at all: invalid slots with index 0.
  idx, valid = _in_class(jax.random.PRNGKey(0), INDEX, only, np.array([1, 1], np.int32))
  assert int(idx[0]) == 4 and np.asarray(valid).tolist() == [True, False] and int(idx[1]) == 0


def test_uniform_in_class_with_replacement_allows_repeats():
  idx, valid = _in_class(
    jax.random.PRNGKey(0),
    INDEX,
    np.ones(6, bool),
    np.array([2, 2, 2], np.int32),
    without_replacement=False,
  )
  assert np.asarray(idx).tolist() == [3, 3, 3] and np.asarray(valid).all()


def test_uniform_in_class_is_uniform_over_eligible_members():
  eligible = np.array([1, 1, 0, 1, 0, 1], bool)  # class 1 members 1, 5 eligible
  keys = jax.random.split(jax.random.PRNGKey(5), 3000)
  idx, _ = jax.vmap(
    lambda k: ss.uniform_in_class(k, MEMBERSHIP, eligible, jnp.array([1], jnp.int32))
  )(keys)
  counts = np.bincount(np.asarray(idx)[:, 0], minlength=6)
  assert counts[[0, 2, 3, 4]].sum() == 0
  assert abs(counts[1] / 3000 - 0.5) < 0.04


@pytest.mark.slow
def test_uniform_is_uniform_over_ordered_samples():
  # 4 eligible images, 2 slots: each of the 12 ordered pairs has probability 1/12
  # (chi-square, 11 degrees of freedom; p = 0.001 critical value 31.3). uniform_active's
  # i-th active slot takes the i-th of the same sample.
  eligible = np.array([1, 0, 1, 1, 0, 1], bool)
  keys = jax.random.split(jax.random.PRNGKey(11), 6000)
  idx, valid = jax.vmap(lambda k: ss.uniform(k, eligible, 2))(keys)
  idx = np.asarray(idx)
  assert np.asarray(valid).all() and (idx[:, 0] != idx[:, 1]).all() and eligible[idx].all()
  pairs = [(a, b) for a in (0, 2, 3, 5) for b in (0, 2, 3, 5) if a != b]
  counts = np.array([np.sum((idx[:, 0] == a) & (idx[:, 1] == b)) for a, b in pairs])
  expected = len(idx) / len(pairs)
  assert ((counts - expected) ** 2 / expected).sum() < 31.3
  active = jnp.array([False, True, True])
  idx_a, valid_a = jax.vmap(lambda k: ss.uniform_active(k, eligible, active))(keys[:50])
  np.testing.assert_array_equal(np.asarray(idx_a)[:, 1:], idx[:50])
  assert not np.asarray(valid_a)[:, 0].any()


def test_uniform_without_replacement():
  f = jax.jit(ss.uniform, static_argnums=2)
  eligible = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)
  for seed in range(5):
    idx, valid = f(jax.random.PRNGKey(seed), eligible, 4)
    idx = np.asarray(idx)
    assert np.asarray(valid).all() and len(set(idx.tolist())) == 4 and eligible[idx].all()
  idx, valid = f(jax.random.PRNGKey(0), np.array([0, 1, 0, 1, 0, 0, 0, 0], bool), 4)
  assert np.asarray(valid).tolist() == [True, True, False, False]
  assert sorted(np.asarray(idx)[:2].tolist()) == [1, 3] and np.asarray(idx)[2:].tolist() == [0, 0]
  with pytest.raises(ValueError):
    ss.uniform(jax.random.PRNGKey(0), eligible, 9)

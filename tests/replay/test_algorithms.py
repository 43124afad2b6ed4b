"""Tests of owl_cl.replay.retrieval.registry (paper Table 2, docs/reference.md §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry

ALGOS = ("uniform", "uniform_balanced", "swil")


def _features(seed, b=4, k=3, e=8):
  return {"class_embeddings": np.random.default_rng(seed).normal(size=(b, k, e)).astype(np.float32)}


def test_get_algorithm_errors():
  with pytest.raises(ValueError, match="known: .*'swil'.*'uniform'"):
    registry.get_algorithm("gras")
  with pytest.raises(ValueError, match="swil_weight"):
    registry.get_algorithm("swil", w=1.0)
  with pytest.raises(ValueError, match="unknown hyperparameters"):
    registry.get_algorithm("uniform", swil_weight=1.0)
  with pytest.raises(ValueError):
    registry.get_algorithm("uniform", dedup="weekly")
  algo = registry.get_algorithm("swil", swil_weight=0.5, dedup="none")
  assert algo.class_hyperparameters == (("swil_weight", 0.5),)
  assert set(ALGOS) <= set(registry.ALGORITHMS)


@pytest.mark.parametrize("name", ALGOS)
def test_same_key_same_indices_and_key_advances(name, buffer, rstate):
  algo = jax.jit(registry.get_algorithm(name), static_argnums=3)
  feats = _features(0)
  a = algo(rstate, buffer, feats, 4)
  b = algo(rstate, buffer, feats, 4)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  assert not np.array_equal(np.asarray(a[2].key), np.asarray(rstate.key))
  other = rstate.replace(key=jax.random.PRNGKey(12345))
  draws = {
    tuple(np.asarray(algo(other.replace(key=jax.random.PRNGKey(s)), buffer, feats, 4)[0]))
    for s in range(5)
  }
  assert len(draws) > 1


@pytest.mark.parametrize("name", ALGOS)
def test_buffer_is_an_argument_not_a_constant(name, make_buffer):
  traces = []
  algo = registry.get_algorithm(name)

  def traced(rstate, buffer, features, num):
    traces.append(1)
    return algo(rstate, buffer, features, num)

  f = jax.jit(traced, static_argnums=3)
  b1, b2 = make_buffer(seed=1), make_buffer(seed=2)
  s = state_lib.init_replay_state(b1.num_images, jax.random.PRNGKey(0))
  f(s, b1, _features(0), 4)
  f(s, b2, _features(0), 4)
  assert len(traces) == 1  # one trace for both buffers
  jaxpr = jax.make_jaxpr(algo, static_argnums=3)(s, b1, _features(0), 4)
  big = [c for c in jaxpr.consts if np.size(c) >= b1.num_images]
  assert not big  # no buffer array baked in


def test_uniform_balanced_cycles_classes(make_buffer):
  buffer = make_buffer(seed=8, n=60, c=5, min_members=10)
  membership = np.asarray(buffer.class_membership)
  algo = jax.jit(registry.get_algorithm("uniform_balanced", dedup="dataset"), static_argnums=3)
  s = state_lib.init_replay_state(60, jax.random.PRNGKey(0)).replace(class_pointer=jnp.int32(2))
  expected = [3, 4, 0, 1, 2, 3, 4, 0, 1]
  got = []
  for _ in range(3):
    idx, valid, s = algo(s, buffer, {}, 3)
    assert np.asarray(valid).all()
    got += np.asarray(idx).tolist()
  for image, cls in zip(got, expected):
    assert membership[image, cls]
  assert int(s.class_pointer) == 1


@pytest.mark.slow
def test_swil_follows_similarity(make_buffer):
  c, e = 4, 8
  buffer = make_buffer(seed=9, n=20, c=c, e=e)
  prototypes = np.eye(c, e, dtype=np.float32)
  buffer = buffer.replace(prototypes=jnp.asarray(prototypes))
  membership = np.asarray(buffer.class_membership)
  feats = {
    "class_embeddings": np.stack([np.stack([prototypes[3]] * 3), np.stack([prototypes[1]] * 3)])
  }  # [2, 3, E]
  algo = jax.jit(registry.get_algorithm("swil", swil_weight=1.0, dedup="none"), static_argnums=3)
  s = state_lib.init_replay_state(20, jax.random.PRNGKey(4))
  for _ in range(3):
    idx, valid, s = algo(s, buffer, feats, 2)
    idx = np.asarray(idx)
    assert membership[idx[0], 3] and membership[idx[1], 1]
  # slots beyond the batch reuse new images cyclically (slot j -> image j mod B).
  idx, valid, s = algo(s, buffer, feats, 5)
  assert np.asarray(valid).all()
  assert all(membership[i, 3 if j % 2 == 0 else 1] for j, i in enumerate(np.asarray(idx)))


def test_swil_skips_classes_without_eligible_images(make_buffer):
  buffer = make_buffer(seed=10, n=20, c=4)
  membership = np.asarray(buffer.class_membership)
  prototypes = np.eye(4, 8, dtype=np.float32)
  buffer = buffer.replace(prototypes=jnp.asarray(prototypes))
  feats = {"class_embeddings": np.broadcast_to(prototypes[2], (4, 3, 8)).copy()}
  s = state_lib.init_replay_state(20, jax.random.PRNGKey(0))
  s = s.replace(dedup_mask=jnp.asarray(membership[:, 2]))  # class 2 fully replayed
  algo = jax.jit(registry.get_algorithm("swil", dedup="dataset"), static_argnums=3)
  idx, valid, s2 = algo(s, buffer, feats, 4)
  idx = np.asarray(idx)
  assert np.asarray(valid).all() and not membership[idx, 2].any()
  assert len(set(idx.tolist())) == 4
  assert np.asarray(s2.dedup_mask)[idx].all()

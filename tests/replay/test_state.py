"""Tests of owl_cl.replay.state (ReplayState, ReplayBuffer)."""

import logging

from conftest import random_buffer
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry


def test_init_replay_state():
  s = state_lib.init_replay_state(7, jax.random.key(3))  # typed key -> raw
  assert s.dedup_mask.shape == (7,) and s.dedup_mask.dtype == bool and not s.dedup_mask.any()
  assert s.key.dtype == jnp.uint32 and s.key.shape == (2,)
  assert int(s.class_pointer) == -1 and s.class_pointer.dtype == jnp.int32
  for name in ("num_replayed", "total_replayed", "num_resets"):
    assert getattr(s, name).dtype == jnp.int32 and int(getattr(s, name)) == 0
  assert s.num_images == 7
  leaves = jax.tree_util.tree_leaves(s)
  assert len(leaves) == 11  # a pytree of arrays
  with pytest.raises(ValueError):
    state_lib.init_replay_state(0, jax.random.PRNGKey(0))
  with pytest.raises(ValueError):
    state_lib.init_replay_state(3, jnp.zeros(3))


def test_restore_replay_state_tolerates_missing_fields(caplog):
  s = state_lib.init_replay_state(5, jax.random.PRNGKey(1))
  s = s.replace(dedup_mask=s.dedup_mask.at[2].set(True), class_pointer=jnp.int32(4))
  saved = {k: np.asarray(v) for k, v in flax.serialization.to_state_dict(s).items()}
  template = state_lib.init_replay_state(5, jax.random.PRNGKey(9))
  r = state_lib.restore_replay_state(template, saved)
  for a, b in zip(jax.tree_util.tree_leaves(r), jax.tree_util.tree_leaves(s)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  del saved["auto_reset"]  # an "old" checkpoint
  with caplog.at_level(logging.WARNING):
    r = state_lib.restore_replay_state(template, saved)
  assert "auto_reset" in caplog.text and int(r.class_pointer) == 4
  saved["dedup_mask"] = np.zeros(6, bool)
  with pytest.raises(ValueError, match="shape"):
    state_lib.restore_replay_state(template, saved)


def test_make_replay_buffer_validation():
  m = np.array([[1, 0, 0], [1, 1, 0]], bool)
  buf = state_lib.make_replay_buffer(
    m, np.zeros((3, 4)), np.zeros((2, 3)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4))
  )
  np.testing.assert_array_equal(np.asarray(buf.class_valid), [True, True, False])
  assert buf.prototypes.dtype == jnp.float32
  with pytest.raises(ValueError):
    state_lib.make_replay_buffer(
      m, np.zeros((2, 4)), np.zeros((2, 3)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4))
    )
  with pytest.raises(ValueError):
    state_lib.make_replay_buffer(
      m, np.zeros((3, 4)), np.zeros((2, 3)), np.zeros((2, 2, 5)), np.zeros((2, 2, 4))
    )


@pytest.mark.slow
@pytest.mark.parametrize(
  "name, hyperparameters",
  [
    ("a_sw_grasp", {"balanced_order": "reshuffled"}),
    ("grasp", {"balanced_order": "reshuffled"}),
    ("aser", {"balanced_order": "reshuffled", "num_candidates": 8}),
  ],
)
def test_no_key_is_drawn_twice(monkeypatch, name, hyperparameters):
  """Every key derived (split / fold_in) by the initialisation and by 4 retrieval calls is
  distinct (keys are never reused). The old initial order key fold_in(key, 1) equalled
  split(key, 3)[1], the first call's class key: it would appear twice here."""
  k = jax.random.PRNGKey(0)
  # The collision this test would catch (legacy threefry keys).
  np.testing.assert_array_equal(jax.random.fold_in(k, 1), jax.random.split(k, 3)[1])
  drawn = []
  split, fold_in = jax.random.split, jax.random.fold_in

  def record(fn):
    def wrapped(*args, **kwargs):
      out = fn(*args, **kwargs)
      if not isinstance(out, jax.core.Tracer):  # keys made inside scan bodies are per slot
        data = np.asarray(
          jax.random.key_data(out) if jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key) else out
        )
        drawn.extend(map(tuple, data.reshape(-1, 2)))
      return out

    return wrapped

  monkeypatch.setattr(jax.random, "split", record(split))
  monkeypatch.setattr(jax.random, "fold_in", record(fold_in))
  buffer = random_buffer(n=24, c=6)
  rstate = state_lib.init_replay_state(buffer.num_images, k, num_classes=6)
  algorithm = registry.get_algorithm(name, dedup="none", **hyperparameters)
  rng = np.random.default_rng(0)
  features = {
    "class_embeddings": rng.normal(size=(4, 3, 8)).astype(np.float32),
    "query_embeddings": rng.normal(size=(4, 3, 8)).astype(np.float32),
  }
  for _ in range(4):
    _, _, rstate = algorithm(rstate, buffer, features, 4)
  assert len(drawn) >= 2 + 4 * 3
  assert len(set(drawn)) == len(drawn)


@pytest.mark.slow
def test_a_fresh_state_can_be_donated():
  # Every leaf its own buffer: a retrieval jitted with the state donated (a user's loop may
  # do so to update it in place) must run from init_replay_state, and give what it gives
  # without donation.
  buffer = random_buffer(seed=2, n=40, c=5)
  algorithm = registry.get_algorithm("uniform_balanced")
  fresh = lambda: state_lib.init_replay_state(40, jax.random.PRNGKey(5), 5)  # noqa: E731
  leaves = jax.tree_util.tree_leaves(fresh())
  pointers = [leaf.unsafe_buffer_pointer() for leaf in leaves]
  assert len(set(pointers)) == len(leaves)
  plain = jax.jit(algorithm, static_argnums=3)(fresh(), buffer, {}, 4)
  donated = jax.jit(algorithm, static_argnums=3, donate_argnums=0)(fresh(), buffer, {}, 4)
  for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(donated)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

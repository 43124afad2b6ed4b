"""Tests of owl_cl.replay.state (ReplayState, ReplayBuffer)."""

import logging

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import state as state_lib


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

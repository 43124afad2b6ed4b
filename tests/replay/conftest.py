"""Shared fixtures of the replay tests: small random buffers."""

import jax
import numpy as np
import pytest

from owl_cl.replay import state as state_lib


def random_buffer(seed=0, n=24, c=6, k=3, e=8, min_members=2):
  """A ReplayBuffer with every class having >= min_members images and every image >= 1 class."""
  rng = np.random.default_rng(seed)
  membership = rng.random((n, c)) < 0.3
  membership[np.arange(n), rng.integers(0, c, n)] = True
  for cls in range(c):
    membership[rng.choice(n, min_members, replace=False), cls] = True
  return state_lib.make_replay_buffer(
    membership,
    rng.normal(size=(c, e)).astype(np.float32),
    np.where(membership, rng.random((n, c)), np.inf).astype(np.float32),
    rng.normal(size=(n, k, e)).astype(np.float32),
    rng.normal(size=(n, k, e)).astype(np.float32),
  )


@pytest.fixture
def buffer():
  return random_buffer()


@pytest.fixture
def rstate(buffer):
  return state_lib.init_replay_state(buffer.num_images, jax.random.PRNGKey(0))


@pytest.fixture
def make_buffer():
  """Factory fixture: make_buffer(seed=..., n=..., c=..., ...) -> ReplayBuffer."""
  return random_buffer

"""Tests of owl_cl.replay.retrieval.dedup (docs/reference.md §8) through the algorithms."""

import logging

from conftest import random_buffer
import jax
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import dedup
from owl_cl.replay.retrieval import registry

ALGOS = ("uniform", "uniform_balanced", "swil")


def _features(seed, b=4, k=3, e=8):
  return {"class_embeddings": np.random.default_rng(seed).normal(size=(b, k, e)).astype(np.float32)}


def test_schedule_validation_and_events():
  with pytest.raises(ValueError, match="known"):
    dedup.DedupSchedule("sometimes")
  with pytest.raises(ValueError):
    dedup.DedupSchedule("dataset", fraction=0.3)
  assert dedup.as_schedule("epoch").resets_on("epoch")
  assert dedup.as_schedule("epoch").resets_on("dataset")
  assert not dedup.as_schedule("dataset").resets_on("epoch")
  assert dedup.as_schedule("dataset").resets_on("dataset")
  assert not dedup.as_schedule("none").resets_on("dataset")
  with pytest.raises(ValueError):
    dedup.reset_if(state_lib.init_replay_state(3, jax.random.PRNGKey(0)), "step", "epoch")


def test_mark_and_reset():
  s = state_lib.init_replay_state(5, jax.random.PRNGKey(0))
  s = jax.jit(dedup.mark_replayed)(s, np.array([1, 3, 1]), np.array([True, False, True]))
  np.testing.assert_array_equal(np.asarray(s.dedup_mask), [0, 1, 0, 0, 0])
  assert int(s.num_replayed) == 2 and int(s.total_replayed) == 2
  s_none = dedup.mark_replayed(s, np.array([0]), np.array([True]), "none")
  np.testing.assert_array_equal(np.asarray(s_none.dedup_mask), [0, 1, 0, 0, 0])
  assert int(s_none.total_replayed) == 3
  assert dedup.reset_if(s, "epoch", "dataset") is s
  r = dedup.reset_if(s, "epoch", "epoch")
  assert not np.asarray(r.dedup_mask).any() and int(r.num_resets) == 1
  assert int(r.num_replayed) == 0 and int(r.total_replayed) == 2
  r = dedup.reset_if(s, "dataset", "dataset")
  assert not np.asarray(r.dedup_mask).any()
  assert dedup.reset_if(s, "dataset", "none") is s


@pytest.mark.parametrize("name", ALGOS)
def test_dataset_schedule_never_repeats_until_exhausted(name, make_buffer, caplog):
  n, num = 24, 4
  buffer = make_buffer(seed=3, n=n)
  algo = jax.jit(registry.get_algorithm(name, dedup="dataset"), static_argnums=3)
  s = state_lib.init_replay_state(n, jax.random.PRNGKey(7))
  seen = []
  for step in range(n // num):
    idx, valid, s = algo(s, buffer, _features(step), num)
    assert np.asarray(valid).all() and not bool(s.auto_reset)
    assert not dedup.check_auto_reset(s)
    seen += np.asarray(idx).tolist()
  assert sorted(seen) == list(range(n))  # each image exactly once
  assert np.asarray(s.dedup_mask).all() and int(s.num_replayed) == n
  # the buffer is exhausted: the next call resets automatically and warns on the host.
  idx, valid, s = algo(s, buffer, _features(99), num)
  assert np.asarray(valid).all() and bool(s.auto_reset)
  assert int(s.num_resets) == 1 and int(s.num_replayed) == num
  with caplog.at_level(logging.WARNING):
    assert dedup.check_auto_reset(s)
  assert "exhausted" in caplog.text
  # scheduled reset at the dataset boundary.
  s = dedup.reset_if(s, "dataset", "dataset")
  assert not np.asarray(s.dedup_mask).any() and int(s.num_resets) == 2


@pytest.mark.slow
def test_dataset_schedule_partial_cycle(make_buffer):
  """N not a multiple of the batch: unique until fewer than `num` remain, then reset."""
  n, num = 10, 4
  buffer = make_buffer(seed=4, n=n, c=4)
  algo = jax.jit(registry.get_algorithm("uniform_balanced", dedup="dataset"), static_argnums=3)
  s = state_lib.init_replay_state(n, jax.random.PRNGKey(1))
  first = []
  for _ in range(2):
    idx, valid, s = algo(s, buffer, {}, num)
    first += np.asarray(idx).tolist()
  assert len(set(first)) == 8
  idx, valid, s = algo(s, buffer, {}, num)
  assert bool(s.auto_reset) and np.asarray(valid).all() and len(set(np.asarray(idx).tolist())) == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGOS)
def test_none_schedule_allows_repeats(name, make_buffer):
  n, num = 6, 4
  buffer = make_buffer(seed=5, n=n, c=3, min_members=1)
  algo = jax.jit(registry.get_algorithm(name, dedup="none"), static_argnums=3)
  s = state_lib.init_replay_state(n, jax.random.PRNGKey(2))
  seen = []
  for step in range(6):
    idx, valid, s = algo(s, buffer, _features(step), num)
    assert np.asarray(valid).all()
    seen += np.asarray(idx).tolist()
  assert len(seen) > len(set(seen))  # repeats happen
  assert not np.asarray(s.dedup_mask).any() and int(s.num_resets) == 0
  assert int(s.total_replayed) == 24 and not bool(s.auto_reset)


def test_epoch_schedule_resets_each_epoch(make_buffer):
  n, num = 12, 4
  buffer = make_buffer(seed=6, n=n, c=3)
  algo = jax.jit(registry.get_algorithm("uniform", dedup="epoch"), static_argnums=3)
  s = state_lib.init_replay_state(n, jax.random.PRNGKey(3))
  for _ in range(2):  # two epochs of 2 steps each
    seen = []
    for _ in range(2):
      idx, _, s = algo(s, buffer, {}, num)
      seen += np.asarray(idx).tolist()
    assert len(set(seen)) == 8
    s = dedup.reset_if(s, "epoch", "epoch")
    assert not np.asarray(s.dedup_mask).any()
  assert int(s.num_resets) == 2


@pytest.mark.slow
def test_none_without_replacement_within_call_released():
  """Released 'batch' schedule: nothing is marked across calls, but one call never repeats an
  image. One class of exactly 4 members, 4 replays per call: every call must return those 4
  images (each once); the plain 'none' schedule draws with replacement and repeats some."""
  membership = np.zeros((8, 1), bool)
  membership[:4, 0] = True  # images 4..7 belong to no class and are never drawn
  rng = np.random.default_rng(0)
  buffer = state_lib.make_replay_buffer(
    membership,
    rng.normal(size=(1, 4)).astype(np.float32),
    np.where(membership, 0.5, np.inf).astype(np.float32),
    rng.normal(size=(8, 2, 4)).astype(np.float32),
    rng.normal(size=(8, 2, 4)).astype(np.float32),
  )
  released = registry.get_algorithm(
    "uniform_balanced", dedup=dedup.DedupSchedule("none", without_replacement=True)
  )
  plain = registry.get_algorithm("uniform_balanced", dedup="none")
  rs = state_lib.init_replay_state(8, jax.random.PRNGKey(1))
  rp = rs
  repeats = 0
  for _ in range(10):
    idx, valid, rs = released(rs, buffer, {}, 4)
    assert bool(valid.all()) and sorted(np.asarray(idx).tolist()) == [0, 1, 2, 3]
    assert not bool(rs.dedup_mask.any())  # nothing is marked across calls
    idx, _, rp = plain(rp, buffer, {}, 4)
    repeats += len(set(np.asarray(idx).tolist())) < 4
  assert repeats > 0  # P(4 distinct of 4 with replacement) = 24/256 per call


@pytest.mark.slow
@pytest.mark.parametrize(
  "fraction_reset, expected",
  [
    # fraction 1/3 of N = 12 -> limit 4; 3 replays per call.
    # 'after' (released): reset once more than 4 were replayed, after the call: 3, 6 -> reset.
    ("after", [(3, 0), (0, 1), (3, 1), (0, 2)]),
    # 'before': the call that would pass ceil(4) resets first: 3, reset + 3, reset + 3, ...
    ("before", [(3, 0), (3, 1), (3, 2), (3, 3)]),
  ],
)
def test_fraction_reset_timing(fraction_reset, expected):
  buffer = random_buffer(n=12, c=3)
  schedule = dedup.DedupSchedule("fraction", 1.0 / 3.0, fraction_reset=fraction_reset)
  algorithm = registry.get_algorithm("uniform", dedup=schedule)
  rstate = state_lib.init_replay_state(12, jax.random.PRNGKey(2))
  seen = []
  for want in expected:
    idx, valid, rstate = algorithm(rstate, buffer, {}, 3)
    assert bool(valid.all())
    seen.append(set(np.asarray(idx).tolist()))
    assert (int(rstate.num_replayed), int(rstate.num_resets)) == want
  if fraction_reset == "after":
    assert not seen[0] & seen[1]  # the first two calls share one period: 6 distinct images
  with pytest.raises(ValueError, match="fraction_reset='later'"):
    dedup.DedupSchedule("fraction", 0.5, fraction_reset="later")

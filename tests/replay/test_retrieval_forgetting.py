"""Forgetting-aware retrieval (`owl_cl.replay.retrieval.forgetting`): the scores and draw
probabilities on a hand-worked example, the draw's frequencies against them, the write-back of
a step's replay losses, the reduction to a uniform draw within the class when every rise is
equal, and the registry's compositions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import forgetting
from owl_cl.replay.retrieval import registry

NAN = math.nan
# Hand-worked example: 6 images, class 0 = {0, 1, 2, 3}, class 1 = {3, 4, 5}. Images 0, 1, 3
# observed: rises 3 - 1 = 2, 1 - 1 = 0, 2 - 2.5 = -0.5; images 2, 4, 5 never observed take
# the mean observed rise (2 + 0 - 0.5) / 3 = 0.5.
LATEST = [3.0, 1.0, NAN, 2.0, NAN, NAN]
REFERENCE = [1.0, 1.0, NAN, 2.5, NAN, NAN]
SCORES = [2.0, 0.0, 0.5, -0.5, 0.5, 0.5]
# T = 1, eps = 0.2 over class 0: softmax of (2, 0, 0.5, -0.5) is e^s / 10.644308 =
# (0.694182, 0.093947, 0.154893, 0.056982); p = 0.8 softmax + 0.2 / 4.
CLASS0_PROBS = [0.605343, 0.125158, 0.173914, 0.095585]
# Image 0 unavailable: softmax of (0, 0.5, -0.5) over 3.255252, p = 0.8 softmax + 0.2 / 3.
WITHOUT_0 = [0.0, 0.312423, 0.471851, 0.215726]
# float32 rounding of terms of magnitude <= 1 (~1e-7) and the 6-digit rounding above (5e-7).
TOL = 1e-6


def _buffer():
  membership = np.zeros((6, 2), bool)
  membership[[0, 1, 2, 3], 0] = True
  membership[[3, 4, 5], 1] = True
  rng = np.random.default_rng(0)
  return state_lib.make_replay_buffer(
    membership,
    rng.normal(size=(2, 4)).astype(np.float32),
    np.where(membership, 0.5, np.inf).astype(np.float32),
    rng.normal(size=(6, 2, 4)).astype(np.float32),
    rng.normal(size=(6, 2, 4)).astype(np.float32),
  )


def _state(latest=LATEST, reference=REFERENCE, key=0):
  s = forgetting.initial_state(state_lib.init_replay_state(6, jax.random.PRNGKey(key), 2))
  return s.replace(
    forget_latest=jnp.asarray(latest, jnp.float32),
    forget_reference=jnp.asarray(reference, jnp.float32),
  )


def test_hand_worked_scores_and_probabilities():
  scores = forgetting.forgetting_scores(jnp.asarray(LATEST), jnp.asarray(REFERENCE))
  np.testing.assert_allclose(scores, SCORES, atol=TOL)
  class0 = scores[:4]
  probs = forgetting.forgetting_probs(class0, jnp.ones(4, bool), 1.0, 0.2)
  np.testing.assert_allclose(probs, CLASS0_PROBS, atol=TOL)
  probs = forgetting.forgetting_probs(class0, jnp.array([False, True, True, True]), 1.0, 0.2)
  np.testing.assert_allclose(probs, WITHOUT_0, atol=TOL)
  # Nothing observed: every score is the prior 0; nothing available: no probability.
  np.testing.assert_array_equal(forgetting.forgetting_scores(jnp.full(3, NAN), jnp.full(3, NAN)), 0)
  assert float(forgetting.forgetting_probs(class0, jnp.zeros(4, bool), 1.0, 0.2).sum()) == 0


def _frequencies(draw, count=20000):
  keys = jax.random.split(jax.random.PRNGKey(7), count)
  indices, valid = jax.jit(jax.vmap(draw))(keys)
  assert bool(valid.all())
  return np.bincount(np.asarray(indices).reshape(-1), minlength=6) / count


@pytest.mark.slow  # 20000 draws, jitted: 3-5 s on the loaded 2-core machine
def test_draw_frequencies_follow_the_probabilities():
  buffer, s = _buffer(), _state()
  scores = forgetting.forgetting_scores(s.forget_latest, s.forget_reference)

  def draw(key):
    return forgetting.forgetting_in_class(
      key,
      buffer.class_index,
      jnp.ones(6, bool),
      jnp.array([0]),
      scores,
      jnp.array([True]),
      1.0,
      0.2,
    )

  freq = _frequencies(draw)
  expected = np.array(CLASS0_PROBS + [0.0, 0.0])
  # 5 binomial standard deviations of 20000 draws (at most 0.0035 each).
  sigma = np.sqrt(expected * (1 - expected) / 20000)
  assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), freq


@pytest.mark.slow  # 2 x 20000 jitted retrievals: 2-3 s on the loaded 2-core machine
def test_equal_rises_draw_uniformly_within_the_class():
  """The invariant: with every rise equal (here 0.7) the draw is the class step's uniform one
  (uniform_balanced's): exactly 1/M per member, and so in frequency."""
  latest = [1.7, 2.7, 0.7, 3.7, 1.7, 5.7]
  reference = [1.0, 2.0, 0.0, 3.0, 1.0, 5.0]
  scores = forgetting.forgetting_scores(jnp.asarray(latest), jnp.asarray(reference))
  probs = forgetting.forgetting_probs(scores[:4], jnp.ones(4, bool), 0.3, 0.1)
  np.testing.assert_allclose(probs, 0.25, atol=TOL)
  buffer = _buffer()
  algorithms = [
    registry.get_algorithm(n, dedup="none") for n in ("forgetting_aware", "uniform_balanced")
  ]
  states = [
    algorithms[0].prepare(_state(latest, reference), buffer),
    state_lib.init_replay_state(6, jax.random.PRNGKey(0), 2),
  ]
  for algorithm, s in zip(algorithms, states):
    # The balanced step's first class is class 0, whatever the key.
    freq = _frequencies(lambda k, a=algorithm, s=s: a(s.replace(key=k), buffer, {}, 1)[:2])
    sigma = math.sqrt(0.25 * 0.75 / 20000)
    assert np.all(np.abs(freq[:4] - 0.25) <= 5 * sigma) and freq[4:].sum() == 0, freq


def test_observe_losses_writes_the_valid_slots_only():
  s = forgetting.initial_state(state_lib.init_replay_state(8, jax.random.PRNGKey(0)))
  assert np.isnan(s.forget_latest).all() and np.isnan(s.forget_reference).all()
  # Slot 2 is masked (its loss ignored although image 2 is replayed by slot 0); slot 3's loss
  # is not finite (ignored: image 7 stays unobserved).
  s = jax.jit(forgetting.observe_losses)(
    s,
    jnp.array([2, 5, 2, 7]),
    jnp.array([True, True, False, True]),
    jnp.array([1.5, 2.0, 9.0, NAN]),
  )
  expected = np.full(8, NAN, np.float32)
  expected[[2, 5]] = [1.5, 2.0]
  np.testing.assert_array_equal(s.forget_latest, expected)
  np.testing.assert_array_equal(s.forget_reference, expected)  # first observations
  # A second step: the latest loss moves, the reference stays at the first observation.
  s = forgetting.observe_losses(
    s, jnp.array([5, 0]), jnp.array([True, True]), jnp.array([3.0, 4.0])
  )
  expected_latest = expected.copy()
  expected_latest[[5, 0]] = [3.0, 4.0]
  expected[0] = 4.0
  np.testing.assert_array_equal(s.forget_latest, expected_latest)
  np.testing.assert_array_equal(s.forget_reference, expected)
  np.testing.assert_allclose(
    np.asarray(forgetting.forgetting_scores(s.forget_latest, s.forget_reference))[[0, 2, 5, 7]],
    [0.0, 0.0, 1.0, 1.0 / 3],  # image 7 unobserved: the mean of the rises 0, 0, 1
    atol=TOL,
  )
  s = forgetting.with_reference_losses(s, jnp.zeros(8))
  np.testing.assert_array_equal(s.forget_reference, 0)
  with pytest.raises(ValueError, match=r"must be \[8\]"):
    forgetting.with_reference_losses(s, jnp.zeros(3))


def test_registry_compositions_and_refusals():
  for name, needs in (("forgetting_aware", False), ("sw_forgetting_aware", True)):
    algorithm = registry.get_algorithm(name, forgetting_temperature=0.5)
    assert isinstance(algorithm, forgetting.ForgettingAlgorithm) and algorithm.observes_losses
    assert algorithm.needs_features == needs
    assert dict(algorithm.sample_hyperparameters)["forgetting_temperature"] == 0.5
  with pytest.raises(ValueError, match="forgetting_temperature=0"):
    registry.get_algorithm("forgetting_aware", forgetting_temperature=0)
  with pytest.raises(ValueError, match="forgetting_exploration=1.5"):
    registry.get_algorithm("forgetting_aware", forgetting_exploration=1.5)
  buffer = _buffer()
  plain = state_lib.init_replay_state(6, jax.random.PRNGKey(0), 2)
  with pytest.raises(ValueError, match="prepare"):  # a state the algorithm did not prepare
    forgetting.forgetting_step(None, plain, buffer, {}, jnp.array([0]), None, None, True)
  with pytest.raises(ValueError, match="class step"):
    forgetting.forgetting_step(None, _state(), buffer, {}, None, None, None, True)
  # Other algorithms keep the plain state (their checkpoints' trees are unchanged).
  assert type(registry.get_algorithm("grasp").prepare(plain, buffer)) is state_lib.ReplayState

"""A-SW-GRASP's in-call class redraw (`replay.exhausted_class='redraw'`, the released
`get_SWIL_retrieval_indices(adaptivity='img')`; docs/released_code.md), against the exact
distribution of the released code's draws."""

import collections

import jax
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry

# Class 0: image 0 only; class 1: images 1-3; class 2: images 4-6; prototypes: the unit axes.
MEMBERSHIP = np.zeros((7, 3), bool)
MEMBERSHIP[0, 0] = True
MEMBERSHIP[1:4, 1] = True
MEMBERSHIP[4:7, 2] = True
# Prototype distances of the members (GRASP's within-class weights; +inf: not a member).
DISTANCES = np.where(
  MEMBERSHIP, np.array([0.5, 0.2, 0.4, 0.8, 0.3, 0.3, 0.6])[:, None], np.inf
).astype(np.float32)
# New image 0 is near class 0 (normalised entropy of p_SWIL 0.58: SWIL), new image 1 is
# equally far from all three classes (entropy 1: GRASP); slot j serves new image j mod 2.
EMBEDDINGS = np.array([[[0.9, 0.4, 0.1]], [[1.0, 1.0, 1.0]]], np.float32)
TAU, SWIL_WEIGHT, GRASP_WEIGHT, SLOTS, DRAWS = 0.7, 1.0, 0.7, 4, 4000


def _swil_probs(embedding, classes):
  """p_SWIL of one new image over `classes` (bool [C]), float64: eq. 1 with w = SWIL_WEIGHT."""
  e = embedding[0] / np.linalg.norm(embedding[0])
  inverse = (1.0 - np.eye(3) @ e + 1e-8) ** -SWIL_WEIGHT * classes
  return inverse / inverse.sum()


def _released_distribution() -> dict:
  """{replayed images (one per slot): probability}: every branch of the released draws,
  enumerated with its probability (its `rng.choice` loops that retry until they hit a class
  or an image still available draw from the distribution restricted to them).

  Per slot: the switch reads the normalised entropy of p_SWIL over all classes
  (`calculate_entropy`); above tau, `get_UB_retrieval_indices(1, 'GRASP')`: the next class
  in the (sequential) order with an available image, an image of it with probability
  proportional to (d + 1e-8)^-0.7; else a class from p_SWIL restricted to the classes with an
  available image, an image uniformly among its available ones. One change: a GRASP slot's
  available images exclude this call's earlier replays too (the released one, which starts
  from `current_indices` alone, can replay an image twice in a call that dedups within).
  """
  out = collections.defaultdict(float)

  def within(c, weight, available):
    q = (DISTANCES[:, c].astype(np.float64) + 1e-8) ** -weight * (MEMBERSHIP[:, c] & available)
    return q / q.sum()

  def visit(taken, pointer, probability):
    slot = len(taken)
    if slot == SLOTS:
      out[taken] += probability
      return
    embedding = EMBEDDINGS[slot % len(EMBEDDINGS)]
    available = ~np.isin(np.arange(7), taken)
    has_image = (MEMBERSHIP & available[:, None]).any(axis=0)
    p_all = _swil_probs(embedding, np.ones(3))
    if -(p_all * np.log(p_all)).sum() / np.log(3) > TAU:
      c = next(c % 3 for c in range(pointer + 1, pointer + 4) if has_image[c % 3])
      for i, q in enumerate(within(c, GRASP_WEIGHT, available)):
        if q > 0:
          visit(taken + (i,), c, probability * q)
      return
    p = _swil_probs(embedding, has_image)
    for c in np.flatnonzero(p):
      for i, q in enumerate(within(c, 0.0, available)):
        if q > 0:
          visit(taken + (i,), pointer, probability * p[c] * q)

  visit((), -1, 1.0)
  return dict(out)


def _our_frequencies(exhausted_class: str) -> dict:
  buffer = state_lib.make_replay_buffer(
    MEMBERSHIP,
    np.eye(3, dtype=np.float32),
    DISTANCES,
    np.zeros((7, 1, 3), np.float32),
    np.zeros((7, 1, 3), np.float32),
  )
  algorithm = registry.get_algorithm(
    "a_sw_grasp",
    dedup="dataset",
    swil_weight=SWIL_WEIGHT,
    grasp_weight=GRASP_WEIGHT,
    adaptive_entropy_threshold=TAU,
    adaptive_entropy_classes="all",
    exhausted_class=exhausted_class,
  )
  rstate = state_lib.init_replay_state(7, jax.random.PRNGKey(0), num_classes=3)
  features = {"class_embeddings": EMBEDDINGS}

  def draw(key):
    indices, valid, _, records = algorithm.retrieve_with_records(
      rstate.replace(key=key), buffer, features, SLOTS
    )
    return indices, valid, records

  indices, valid, records = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(1), DRAWS))
  assert bool(np.all(valid))
  counts = collections.Counter(tuple(int(i) for i in row) for row in np.asarray(indices))
  return {outcome: n / DRAWS for outcome, n in counts.items()}, records


@pytest.mark.slow
def test_redraw_matches_the_released_distribution():
  """4 slots over 2 new images: every sequence of replayed images (96 with probability > 0)
  appears as often as the released code draws it. Each frequency of 4000 draws has a binomial
  std sqrt(p (1 - p) / 4000) <= 0.0079; tolerance 4.5 std + 1/4000 (a chance failure among
  the 96: probability under 1e-3). An outcome the released code never draws fails it at once:
  the default 'fallback' replays them (a slot keeps a class that ran out within the call and
  draws among the remaining images)."""
  released = _released_distribution()
  assert len(released) == 96 and abs(sum(released.values()) - 1.0) < 1e-9
  ours, records = _our_frequencies("redraw")
  assert set(ours) <= set(released)  # nothing the released code never draws
  for outcome, p in released.items():
    tolerance = 4.5 * np.sqrt(p * (1 - p) / DRAWS) + 1 / DRAWS
    assert abs(ours.get(outcome, 0.0) - p) <= tolerance, (outcome, ours.get(outcome), p)
  # The records: new image 0's slots use SWIL, new image 1's GRASP, in every draw; the
  # switch entropies over all classes (float32 cosines and logs of O(1) values: ~1e-6).
  entropy = [
    (lambda p: -(p * np.log(p)).sum() / np.log(3))(_swil_probs(e, np.ones(3))) for e in EMBEDDINGS
  ]
  np.testing.assert_allclose(records["swil_entropy"], np.tile(entropy, (DRAWS, 1)), atol=1e-5)
  assert np.array_equal(records["used_grasp"], np.tile([False, True, False, True], (DRAWS, 1)))
  # GRASP's entropy over the class's members at the start of the call, by its class: class 0
  # has one member (0); class 1 (d = 0.2, 0.4, 0.8), w = 0.7: p = (3.085, 1.899, 1.169) /
  # 6.153, H / log 3 = 0.93255; class 2 (d = 0.3, 0.3, 0.6): p = (2.323, 2.323, 1.430) /
  # 6.076, H / log 3 = 0.97912 (4-digit hand arithmetic: tolerance 1e-4).
  grasp_entropy = np.asarray(records["grasp_entropy"])
  assert np.isnan(grasp_entropy[:, ::2]).all()
  classes = np.asarray(records["sampled_classes"])[:, 1::2]
  want = np.array([0.0, 0.93255, 0.97912])[classes]
  np.testing.assert_allclose(grasp_entropy[:, 1::2], want, atol=1e-4)

"""Hand-worked tests of the released code's retrieval options (docs/released_code.md)."""

import jax
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry


def _entropy(p):
  p = np.asarray(p, np.float64)
  nz = p[p > 0]
  return -(nz * np.log(nz)).sum() / np.log(len(p))


@pytest.mark.slow
@pytest.mark.parametrize("form, want_grasp", [("eligible", False), ("all", True)])
def test_adaptive_entropy_classes(form, want_grasp):
  """A-SW-GRASP's switch entropy with an exhausted class.

  Prototypes are the 3 unit axes; the new image's one class embedding is (1, 1, 0)/sqrt(2):
  cosine distances (1 - 1/sqrt(2), 1 - 1/sqrt(2), 1) = (0.29289, 0.29289, 1); with w = 1,
  p_SWIL = (3.41421, 3.41421, 1) / 7.82843 = (0.43613, 0.43613, 0.12774), normalised entropy
  0.89811. Class 1's only image is already replayed: over the eligible classes p = (0.77346,
  0, 0.22654), entropy 0.48704. With tau = 0.7 the released form ('all') switches to GRASP,
  the default form ('eligible') stays with SWIL.
  """
  membership = np.zeros((6, 3), bool)
  membership[[0, 1], 0] = True
  membership[2, 1] = True
  membership[[3, 4, 5], 2] = True
  buffer = state_lib.make_replay_buffer(
    membership,
    np.eye(3, dtype=np.float32),
    np.where(membership, 0.5, np.inf).astype(np.float32),
    np.zeros((6, 1, 3), np.float32),
    np.zeros((6, 1, 3), np.float32),
  )
  rstate = state_lib.init_replay_state(6, jax.random.PRNGKey(0))
  rstate = rstate.replace(dedup_mask=rstate.dedup_mask.at[2].set(True))
  features = {"class_embeddings": np.array([[[1.0, 1.0, 0.0]]], np.float32) / np.sqrt(2.0)}
  algorithm = registry.get_algorithm(
    "a_sw_grasp",
    dedup="dataset",
    swil_weight=1.0,
    adaptive_entropy_threshold=0.7,
    adaptive_entropy_classes=form,
  )
  _, valid, _, records = algorithm.retrieve_with_records(rstate, buffer, features, 1)
  a = 1 / (1 - 1 / np.sqrt(2))
  want = _entropy([a, a, 1] / (2 * a + 1)) if form == "all" else _entropy([a, 0, 1] / (a + 1))
  np.testing.assert_allclose(want, 0.89811 if form == "all" else 0.48704, atol=1e-5)
  # float32 cosines/logs of O(1) values: ~1e-6; the forms differ by 0.4.
  np.testing.assert_allclose(records["swil_entropy"], [want], atol=1e-5)
  assert bool(records["used_grasp"][0]) == want_grasp and bool(valid[0])
  with pytest.raises(ValueError, match="adaptive_entropy_classes='some'"):
    registry.get_algorithm("a_sw_grasp", adaptive_entropy_classes="some")


def test_swil_reduction_mean_hand_worked():
  """SWIL's distance over an image's k embeddings: min (paper) or mean (released 'avg').

  Prototypes = the 3 unit axes; the image's two embeddings are e1 and e2. Cosine distances:
  e1 -> (0, 1, 1), e2 -> (1, 0, 1). Mean: d = (0.5, 0.5, 1), p = (2, 2, 1) / 5 with w = 1;
  min: d = (0, 0, 1), p = (1e8, 1e8, 1) / (2e8 + 1) (the 1e-8 of d + 1e-8).
  """
  from owl_cl.replay.retrieval import class_selection

  emb = np.array([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]], np.float32)
  protos = np.eye(3, dtype=np.float32)
  eligible = np.ones(3, bool)
  mean = class_selection.similarity_weighted_probs(emb, protos, 1.0, eligible, "mean")
  # float32 cosines of unit vectors are exact here; softmax rounding ~1e-7.
  np.testing.assert_allclose(np.asarray(mean), [[0.4, 0.4, 0.2]], atol=1e-6)
  low = class_selection.similarity_weighted_probs(emb, protos, 1.0, eligible)
  np.testing.assert_allclose(np.asarray(low), [[0.5, 0.5, 5e-9]], atol=1e-6)
  alg = registry.get_algorithm("swil", swil_reduction="mean")
  assert dict(alg.class_hyperparameters)["swil_reduction"] == "mean"
  with pytest.raises(ValueError, match="swil_reduction='avg'"):
    registry.get_algorithm("sw_grasp", swil_reduction="avg")


def _three_class_buffer():
  """Class 0: image 0 only; class 1: images 1-3; class 2: images 4-6 (prototypes: axes)."""
  membership = np.zeros((7, 3), bool)
  membership[0, 0] = True
  membership[1:4, 1] = True
  membership[4:7, 2] = True
  return state_lib.make_replay_buffer(
    membership,
    np.eye(3, dtype=np.float32),
    np.where(membership, 0.5, np.inf).astype(np.float32),
    np.zeros((7, 1, 3), np.float32),
    np.zeros((7, 1, 3), np.float32),
  )


@pytest.mark.slow
@pytest.mark.parametrize("key", [0, 1, 2])
def test_exhausted_class_balanced_hand_worked(key):
  """Balanced (sequential order), 4 slots: classes 0, 1, 2, then class 0 again, which ran
  out at slot 0. 'fallback' keeps class 0 for slot 3 (any remaining image); 'redraw'
  (released) skips it: slot 3 gets class 1, and the pointer ends at class 1."""
  buffer = _three_class_buffer()
  rstate = state_lib.init_replay_state(7, jax.random.PRNGKey(key))
  fallback = registry.get_algorithm("uniform_balanced", dedup="dataset")
  released = registry.get_algorithm("uniform_balanced", dedup="dataset", exhausted_class="redraw")
  _, valid, r_fb, rec_fb = fallback.retrieve_with_records(rstate, buffer, {}, 4)
  assert np.asarray(rec_fb["sampled_classes"]).tolist() == [0, 1, 2, 0] and bool(valid.all())
  assert int(r_fb.class_pointer) == 0
  idx, valid, r_rd, rec_rd = released.retrieve_with_records(rstate, buffer, {}, 4)
  assert np.asarray(rec_rd["sampled_classes"]).tolist() == [0, 1, 2, 1] and bool(valid.all())
  idx = np.asarray(idx)
  assert idx[0] == 0 and 1 <= idx[1] <= 3 and 4 <= idx[2] <= 6 and 1 <= idx[3] <= 3
  assert len(set(idx.tolist())) == 4 and int(r_rd.class_pointer) == 1


@pytest.mark.slow
@pytest.mark.parametrize("key", [0, 1, 2])
def test_exhausted_class_swil_hand_worked(key):
  """SWIL, one new image whose embedding is class 0's prototype (p(class 0) ~ 1 - 2e-8), two
  slots. Class 0's single image goes to slot 0. 'fallback' keeps class 0 for slot 1;
  'redraw' (released) redraws among classes 1 and 2 (equal distance 1: probability 1/2
  each) and replays one of that class's images."""
  buffer = _three_class_buffer()
  rstate = state_lib.init_replay_state(7, jax.random.PRNGKey(key))
  features = {"class_embeddings": np.array([[[1.0, 0.0, 0.0]]], np.float32)}
  fallback = registry.get_algorithm("swil", dedup="dataset")
  released = registry.get_algorithm("swil", dedup="dataset", exhausted_class="redraw")
  _, _, _, rec = fallback.retrieve_with_records(rstate, buffer, features, 2)
  assert np.asarray(rec["sampled_classes"]).tolist() == [0, 0]
  idx, valid, _, rec = released.retrieve_with_records(rstate, buffer, features, 2)
  classes = np.asarray(rec["sampled_classes"])
  assert bool(valid.all()) and classes[0] == 0 and int(idx[0]) == 0 and classes[1] in (1, 2)
  assert bool(buffer.class_membership[int(idx[1]), classes[1]])
  with pytest.raises(ValueError, match="exhausted_class='skip'"):
    registry.get_algorithm("swil", exhausted_class="skip")

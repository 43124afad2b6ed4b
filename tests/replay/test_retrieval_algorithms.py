"""Every Table 2 algorithm: jit, determinism, dedup periods, the `active` slot mask, ineligible
classes, A-SW-GRASP's switch and ASER's top-ASV choice (docs/reference.md §7-§8)."""

import functools

from conftest import random_buffer
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import dedup
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import registry
from owl_cl.replay.retrieval import sample_selection

NAMES = (
  "uniform",
  "uniform_balanced",
  "grasp",
  "swil",
  "sw_grasp",
  "a_sw_grasp",
  "aser",
  "aser_pc",
  "sw_aser_pc",
)
N, C, NUM = 24, 6, 4
# Small candidate sets keep the tests fast; the paper's values are the registry defaults.
SMALL = {
  "aser": dict(num_candidates=10, knn_k=3),
  "aser_pc": dict(num_candidates=10, knn_k=3),
  "sw_aser_pc": dict(num_candidates=10, knn_k=3),
}
BALANCED = ("uniform_balanced", "grasp", "aser", "aser_pc")


def _features(seed=0, b=NUM, k=3, e=8):
  rng = np.random.default_rng(seed)
  return {
    "class_embeddings": rng.normal(size=(b, k, e)).astype(np.float32),
    "query_embeddings": rng.normal(size=(b, k, e)).astype(np.float32),
  }


@functools.cache
def _jitted(name, schedule="dataset", **extra):
  algo = registry.get_algorithm(name, dedup=schedule, **{**SMALL.get(name, {}), **extra})
  return algo, jax.jit(algo.retrieve_with_records, static_argnums=3)


@pytest.fixture(scope="module")
def buffer():
  return random_buffer(seed=5, n=N, c=C)


def _state(algo, buffer, key=0):
  s = state_lib.init_replay_state(N, jax.random.PRNGKey(key), num_classes=C)
  return algo.prepare(s, buffer)


ALL_ACTIVE = jnp.ones(NUM, bool)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_dataset_dedup_determinism_and_reset(name, buffer):
  algo, retrieve = _jitted(name)
  s0 = _state(algo, buffer)
  feats = _features()
  a = retrieve(s0, buffer, feats, NUM, ALL_ACTIVE)
  b = retrieve(s0, buffer, feats, NUM, ALL_ACTIVE)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))  # same key, same picks
  s, seen = s0, []
  for call in range(N // NUM):  # one full period: no repeats
    idx, valid, s, _ = retrieve(s, buffer, _features(call), NUM, ALL_ACTIVE)
    assert np.asarray(valid).all() and not bool(s.auto_reset)
    seen += np.asarray(idx).tolist()
  assert sorted(seen) == list(range(N))
  assert int(jnp.sum(s.dedup_mask)) == N
  idx, valid, s, _ = retrieve(s, buffer, _features(9), NUM, ALL_ACTIVE)
  assert bool(s.auto_reset) and np.asarray(valid).all()  # exhausted: reset in call
  assert dedup.check_auto_reset(s)


@pytest.mark.parametrize("name", NAMES)
def test_active_contract(name, buffer):
  algo, retrieve = _jitted(name)
  s0 = _state(algo, buffer).replace(class_pointer=jnp.int32(2))
  feats = _features(1)
  idx, valid, s, _ = retrieve(s0, buffer, feats, NUM, jnp.zeros(NUM, bool))
  assert not np.asarray(valid).any()
  assert not np.asarray(s.dedup_mask).any() and int(s.num_replayed) == 0
  assert int(s.class_pointer) == 2
  active = jnp.array([True, False, True, False])
  idx, valid, s, rec = retrieve(s0, buffer, feats, NUM, active)
  idx, valid = np.asarray(idx), np.asarray(valid)
  assert valid.tolist() == [True, False, True, False]
  assert np.asarray(s.dedup_mask).sum() == 2 and set(np.flatnonzero(s.dedup_mask)) == set(
    idx[valid]
  )
  if name in ("uniform_balanced", "grasp"):
    assert int(s.class_pointer) == 4  # two active slots: classes 3, 4
    np.testing.assert_array_equal(np.asarray(rec["sampled_classes"]), [3, -1, 4, -1])
  if name in ("aser", "aser_pc"):  # candidates consume N_c classes
    assert int(s.class_pointer) == (2 + 10) % C
  with pytest.raises(ValueError, match="active must be bool"):
    retrieve(s0, buffer, feats, NUM, jnp.ones(NUM + 1, bool))


def test_active_none_means_all_active(buffer):
  algo, retrieve = _jitted("grasp")
  s0 = _state(algo, buffer)
  plain = jax.jit(algo, static_argnums=3)(s0, buffer, {}, NUM)
  full = retrieve(s0, buffer, {}, NUM, ALL_ACTIVE)
  np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(full[0]))
  np.testing.assert_array_equal(np.asarray(plain[2].dedup_mask), np.asarray(full[2].dedup_mask))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_classes_without_eligible_image_are_never_drawn(name, buffer):
  algo, retrieve = _jitted(name)
  membership = np.asarray(buffer.class_membership)
  target = 3
  mask = membership[:, target].copy()  # every member of class 3 replayed
  s = _state(algo, buffer).replace(dedup_mask=jnp.asarray(mask))
  for call in range(3):
    idx, valid, s, rec = retrieve(s, buffer, _features(call), NUM, ALL_ACTIVE)
    idx, valid = np.asarray(idx), np.asarray(valid)
    assert valid.all() and not mask[idx].any()
    assert not membership[idx, target].any()
    if "sampled_classes" in rec:
      assert target not in np.asarray(rec["sampled_classes"]).tolist()
    mask[idx] = True
  if name in ("swil", "sw_grasp", "a_sw_grasp"):  # p_SWIL of the class is exactly 0
    from owl_cl.replay.retrieval import class_selection

    eligible = sample_selection.class_eligibility(membership, ~mask)
    p = class_selection.similarity_weighted_probs(
      _features()["class_embeddings"], buffer.prototypes, 1.0, eligible
    )
    assert np.all(np.asarray(p)[:, target] == 0)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name, schedule",
  [("sw_grasp", "epoch"), ("uniform_balanced", "fraction"), ("aser_pc", "fraction")],
)
def test_no_repeat_within_period(name, schedule, buffer):
  algo, retrieve = _jitted(name, schedule)
  s = _state(algo, buffer)
  period, _seen, resets = [], 0, 0
  for call in range(12):
    if schedule == "epoch" and call % 3 == 0 and call:  # an epoch = 3 calls
      s = dedup.reset_if(s, "epoch", algo.dedup)
      period = []
    before = int(s.num_resets)
    idx, valid, s, _ = retrieve(s, buffer, _features(call), NUM, ALL_ACTIVE)
    if int(s.num_resets) > before:
      period = []
      resets += 1
    idx = np.asarray(idx)[np.asarray(valid)].tolist()
    assert not set(idx) & set(period) and len(set(idx)) == len(idx)
    period += idx
    if schedule == "fraction":
      assert len(period) <= algo.dedup.period(N) == 8
  if schedule == "fraction":
    assert resets == 5  # 8 replays per period = 2 calls; resets at 2,4,..,10


@pytest.mark.slow
def test_a_sw_grasp_switch(buffer):
  membership = np.asarray(buffer.class_membership)
  feats = _features(2)
  for tau, grasp in ((-1.0, True), (1.01, False)):
    algo, retrieve = _jitted("a_sw_grasp", adaptive_entropy_threshold=tau)
    s0 = _state(algo, buffer)
    idx, valid, s, rec = retrieve(s0, buffer, feats, NUM, ALL_ACTIVE)
    assert np.asarray(rec["used_grasp"]).all() == grasp
    classes = np.asarray(rec["sampled_classes"])
    assert membership[np.asarray(idx), classes].all()
    if grasp:  # balanced: classes 0, 1, 2, 3
      assert classes.tolist() == [0, 1, 2, 3] and int(s.class_pointer) == 3
    else:
      assert int(s.class_pointer) == -1 and np.isnan(np.asarray(rec["grasp_entropy"])).all()


@pytest.mark.slow
def test_aser_and_aser_pc_pick_the_top_asv_of_the_whole_buffer(buffer):
  """With N_c = N and no dedup the candidate set is the whole buffer, so ASER and ASER-PC
  (left term over the whole buffer) must both replay the top-NUM ASV of the kernels."""
  feats = _features(3)
  ce, qe = np.asarray(buffer.class_embeddings), np.asarray(buffer.query_embeddings)
  right, _ = knn_shapley.image_knn_shapley(
    feats["class_embeddings"], feats["query_embeddings"], ce, qe, 3, reduction="min"
  )
  left, _ = knn_shapley.image_knn_shapley(ce, qe, ce, qe, 3, reduction="max")
  asv = np.asarray(sample_selection.adversarial_shapley_value(left, right, 0.15))
  expected = set(np.argsort(-asv, kind="stable")[:NUM].tolist())
  for name in ("aser", "aser_pc"):
    algo = registry.get_algorithm(name, dedup="none", num_candidates=N, knn_k=3)
    idx, valid, _ = jax.jit(algo, static_argnums=3)(_state(algo, buffer), buffer, feats, NUM)
    assert np.asarray(valid).all() and set(np.asarray(idx).tolist()) == expected, name


def test_reshuffled_balanced_order_and_registry_errors(buffer):
  algo, retrieve = _jitted("uniform_balanced", balanced_order="reshuffled")
  s = _state(algo, buffer)
  drawn = []
  for _call in range(3):
    _, _, s, rec = retrieve(s, buffer, {}, NUM, ALL_ACTIVE)
    drawn += np.asarray(rec["sampled_classes"]).tolist()
  assert sorted(drawn[:C]) == list(range(C)) and sorted(drawn[C : 2 * C]) == list(range(C))
  with pytest.raises(ValueError, match="balanced_order"):
    registry.get_algorithm("grasp", balanced_order="random")
  with pytest.raises(ValueError, match="unknown hyperparameters"):
    registry.get_algorithm("aser", asv_chunk_size=4)  # only the -PC variants
  with pytest.raises(ValueError, match="num_candidates"):
    registry.get_algorithm("aser", num_candidates=2)(
      _state(_jitted("aser")[0], buffer), buffer, _features(), NUM
    )
  assert registry.get_algorithm("aser").num_candidates == 168
  assert registry.get_algorithm("sw_aser_pc").num_candidates == 352

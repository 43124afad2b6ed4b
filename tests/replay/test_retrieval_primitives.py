"""Tests of the GRASP / ASV / entropy primitives, balanced selection with a slot mask and the
reshuffled order, and the 'fraction' dedup schedule (docs/reference.md §7-§8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import class_selection
from owl_cl.replay.retrieval import dedup
from owl_cl.replay.retrieval import sample_selection


def test_prototype_weighted_probs_matches_numpy():
  rng = np.random.default_rng(0)
  d = rng.uniform(0, 2, (3, 9)).astype(np.float32)
  d[0, 2] = 0.0  # exact prototype: huge but finite weight
  d[1, 4] = np.inf  # non-member
  eligible = rng.random((3, 9)) < 0.7
  eligible[2] = False  # nothing eligible -> zeros
  for w in (0.0, 0.7, 1.0, 3.0):
    got = np.asarray(sample_selection.prototype_weighted_probs(d, eligible, w))
    ok = eligible & np.isfinite(d)
    s = np.where(ok, (np.where(ok, d, 1).astype(np.float64) + 1e-8) ** (-w), 0.0)
    ref = s / np.where(ok.any(-1, keepdims=True), s.sum(-1, keepdims=True), 1.0)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(got[:2].sum(-1), 1.0, atol=1e-5)
    assert np.all(got[~ok] == 0) and np.all(got[2] == 0)


def test_normalized_entropy_matches_scipy():
  rng = np.random.default_rng(1)
  p = rng.random((4, 6))
  p[1, :3] = 0
  p /= p.sum(-1, keepdims=True)
  got = np.asarray(sample_selection.normalized_entropy(p))
  np.testing.assert_allclose(got, scipy.stats.entropy(p, axis=-1) / np.log(6), rtol=1e-5)
  assert float(sample_selection.normalized_entropy(np.full(5, 0.2))) == pytest.approx(1.0)
  assert float(sample_selection.normalized_entropy(np.eye(5)[2])) == 0.0
  np.testing.assert_allclose(
    np.asarray(sample_selection.normalized_entropy(p.T, axis=0)), got, rtol=1e-6
  )


def test_adversarial_shapley_value_matches_numpy():
  rng = np.random.default_rng(2)
  n_c, n_e, c = 6, 4, 0.15
  left = rng.normal(size=(n_c, n_c)).astype(np.float32) * 0.01
  right = rng.normal(size=(n_e, n_c)).astype(np.float32) * 0.01
  got = np.asarray(sample_selection.adversarial_shapley_value(left, right, c))
  w = c * abs(right.min()) / abs(left.min())
  np.testing.assert_allclose(got, w * left.mean(0) - right.min(0), rtol=1e-5, atol=1e-8)
  # invalid candidates: excluded from rows, columns and minima; score -inf.
  valid = np.array([True, True, False, True, True, False])
  got = np.asarray(sample_selection.adversarial_shapley_value(left, right, c, valid=valid))
  sub_left = left[np.ix_(valid, valid)]
  w = c * abs(right[:, valid].min()) / abs(sub_left.min())
  np.testing.assert_allclose(
    got[valid], w * sub_left.mean(0) - right[:, valid].min(0), rtol=1e-5, atol=1e-8
  )
  assert np.all(np.isneginf(got[~valid]))
  # released code: w uses the max of the (averaged) left term.
  got = np.asarray(
    sample_selection.adversarial_shapley_value(left, right, c, weight_reduction="max")
  )
  w = c * abs(right.min()) / abs(left.mean(0).max())
  np.testing.assert_allclose(got, w * left.mean(0) - right.min(0), rtol=1e-5, atol=1e-8)
  with pytest.raises(ValueError, match="N_c"):
    sample_selection.adversarial_shapley_value(left, right[:, :3], c)


@pytest.mark.slow
def test_balanced_classes_active_slots_do_not_consume_the_pointer():
  eligible = jnp.array([True, False, True, True, True])
  active = jnp.array([True, False, False, True, True, False, True])
  classes, pointer = class_selection.balanced_classes(jnp.int32(3), eligible, 7, active=active)
  full, _ = class_selection.balanced_classes(jnp.int32(3), eligible, 4)
  np.testing.assert_array_equal(np.asarray(classes)[np.asarray(active)], np.asarray(full))
  assert np.all(np.asarray(classes)[~np.asarray(active)] == -1)
  assert np.asarray(full).tolist() == [4, 0, 2, 3] and int(pointer) == 3
  same, unchanged = class_selection.balanced_classes(
    jnp.int32(3), eligible, 3, active=jnp.zeros(3, bool)
  )
  assert int(unchanged) == 3 and np.all(np.asarray(same) == -1)


def test_balanced_reshuffled_visits_each_eligible_class_once_per_pass():
  c = 7
  eligible = np.ones(c, bool)
  eligible[[1, 5]] = False
  order = np.asarray(jax.random.permutation(jax.random.PRNGKey(0), c), np.int32)
  active = np.ones(20, bool)
  active[[3, 11]] = False
  classes, pointer, new_order = class_selection.balanced_classes_reshuffled(
    jax.random.PRNGKey(1), jnp.int32(-1), order, eligible, active
  )
  drawn = np.asarray(classes)[active]
  assert np.all(np.asarray(classes)[~active] == -1)
  passes = [drawn[i : i + 5] for i in range(0, 15, 5)]
  for p in passes:  # 5 eligible classes per pass
    assert sorted(p.tolist()) == [0, 2, 3, 4, 6]
  assert drawn[:5].tolist() == [x for x in order.tolist() if eligible[x]]  # first pass = order
  assert len({tuple(p) for p in passes}) > 1  # reshuffled between passes
  assert sorted(np.asarray(new_order).tolist()) == list(range(c))


@pytest.mark.slow
def test_prototype_weighted_in_class_distribution():
  d = np.full((6, 2), np.inf, np.float32)
  d[:4, 0] = [0.1, 0.2, 0.4, 0.8]  # class 0 has images 0..3
  d[4:, 1] = 0.5
  eligible = np.array([True, True, True, False, True, True])
  keys = jax.random.split(jax.random.PRNGKey(0), 3000)
  draw = jax.vmap(
    lambda k: sample_selection.prototype_weighted_in_class(
      k, d, eligible, jnp.array([0]), jnp.array([1.0]), jnp.array([True])
    )[0][0]
  )
  counts = np.bincount(np.asarray(draw(keys)), minlength=6) / 3000
  s = 1 / (np.array([0.1, 0.2, 0.4]) + 1e-8)
  np.testing.assert_allclose(counts[:3], s / s.sum(), atol=0.03)
  assert counts[3:].sum() == 0  # ineligible / other class never drawn
  idx, valid = sample_selection.prototype_weighted_in_class(
    jax.random.PRNGKey(1),
    d,
    eligible,
    jnp.array([0, 0, 0, 0, 1]),
    jnp.full(5, 1.0),
    jnp.array([True, True, False, True, True]),
  )
  idx, valid = np.asarray(idx), np.asarray(valid)
  assert valid.tolist() == [True, True, False, True, True]
  assert len(set(idx[valid].tolist())) == 4 and eligible[idx[valid]].all()


def test_fraction_schedule_period_and_errors():
  s = dedup.DedupSchedule("fraction")
  assert s.fraction == pytest.approx(1 / 3) and s.period(30) == 10 and s.period(31) == 11
  assert dedup.as_schedule("fraction").marks_replays
  assert not s.resets_on("epoch") and not s.resets_on("dataset")
  with pytest.raises(ValueError, match=r"\(0, 1\]"):
    dedup.DedupSchedule("fraction", 1.5)
  with pytest.raises(ValueError, match="takes no fraction"):
    dedup.DedupSchedule("dataset", 0.5)
  state = state_lib.init_replay_state(30, jax.random.PRNGKey(0))
  state = dedup.mark_replayed(state, jnp.arange(8), jnp.ones(8, bool), s)
  assert not bool(s.in_call_reset(state, 2))  # 8 + 2 <= 10
  assert bool(s.in_call_reset(state, 3))  # 8 + 3 > 10: new period
  reset = dedup.auto_reset_if_exhausted(state, s, 3)
  assert int(reset.num_replayed) == 0 and not bool(reset.auto_reset)  # scheduled: no warning

"""Tests of owl_cl.replay.buffer_selection (docs/reference.md §6, paper eq. 7)."""

import jax
import numpy as np
import pytest

from owl_cl.replay import buffer_selection
from owl_cl.train import top_k as top_k_lib

# Hand-worked buffer selection example (t = 0.25, min_per_class = 2).
LOSS = np.array([0.1, 0.5, 0.05, 0.9, 0.3, 0.2, 0.7, 0.4])
MEMBERS = {0: [0, 2, 3], 1: [1, 3, 4, 6], 2: [3, 5, 6, 7], 3: [6]}


def _membership():
  m = np.zeros((8, 4), bool)
  for c, images in MEMBERS.items():
    m[images, c] = True
  return m


def test_select_buffer_threshold_and_minimum():
  # threshold keeps {0, 2, 5}. class 0: {0, 2} kept, enough. class 1: none kept -> add its
  # two lowest-loss images 4 (0.3), 1 (0.5). class 2: {5} kept -> add 7 (0.4). class 3 has
  # a single image -> add 6.
  keep = buffer_selection.select_buffer(LOSS, _membership(), 0.25, min_per_class=2)
  assert np.flatnonzero(keep).tolist() == [0, 1, 2, 4, 5, 6, 7]


def test_select_buffer_fill_all_option():
  # class 1 gets all of {1, 3, 4, 6}; class 2 then has {3, 5, 6} kept -> nothing added.
  keep = buffer_selection.select_buffer(
    LOSS, _membership(), 0.25, min_per_class=2, fill_all_for_rare_classes=True
  )
  assert np.flatnonzero(keep).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_select_buffer_zero_threshold_nan_and_errors():
  loss = LOSS.copy()
  loss[4] = np.nan  # NaN sorts last
  keep = buffer_selection.select_buffer(loss, _membership(), 0.0, min_per_class=1)
  # t = 0 keeps nothing by threshold; class 0 -> 2 (0.05); class 1 -> 1 (0.5; 4 is NaN);
  # class 2 -> 5 (0.2); class 3 -> 6.
  assert np.flatnonzero(keep).tolist() == [1, 2, 5, 6]
  keep = buffer_selection.select_buffer(LOSS, _membership(), 1.0, min_per_class=0)
  assert keep.all()
  with pytest.raises(ValueError):
    buffer_selection.select_buffer(LOSS, _membership()[:5], 0.2)


def _random_outputs(seed=0, b=3, t=10, q=5, e=6):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, t, q)).astype(np.float32) * 3
  class_emb = rng.normal(size=(b, t, e)).astype(np.float32)
  query_emb = rng.normal(size=(b, q, e)).astype(np.float32)
  return logits, class_emb, query_emb


def test_top_k_tokens_and_embeddings_match_numpy():
  logits, class_emb, query_emb = _random_outputs()
  mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
  logits[:, :, 2] += 50 * (~mask[:, 2])[:, None]  # masked queries must not count
  k = 4
  idx = np.asarray(jax.jit(top_k_lib.top_k_tokens, static_argnums=2)(logits, mask, k))
  ce, qe = jax.jit(top_k_lib.top_k_embeddings, static_argnums=4)(
    logits, class_emb, query_emb, mask, k
  )
  sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
  for b in range(3):
    score = np.where(mask[b][None], sig[b], -np.inf).max(-1)
    want = np.argsort(-score, kind="stable")[:k]
    assert idx[b].tolist() == want.tolist()
    np.testing.assert_array_equal(np.asarray(ce)[b], class_emb[b, want])
    best_q = np.where(mask[b][None], logits[b, want], -np.inf).argmax(-1)
    np.testing.assert_array_equal(np.asarray(qe)[b], query_emb[b, best_q])


def test_instance_counts_from_labels():
  labels = np.zeros((2, 3, 4), np.float32)  # B=2, M=3, Q=4
  query_class = np.array([[-1, 2, 0, -1], [-1, 1, 3, 0]])
  labels[0, 0, 1] = labels[0, 1, 1] = labels[0, 1, 2] = 1  # two of class 2, one of class 0
  labels[0, 2, 0] = 1  # padding instance
  labels[1, 0, 2] = 1  # class 3; class 0/1 negatives
  counts = np.asarray(
    jax.jit(buffer_selection.instance_counts_from_labels, static_argnums=2)(labels, query_class, 4)
  )
  np.testing.assert_array_equal(counts, [[1, 0, 2, 0], [0, 0, 0, 1]])


def _np_prototype_stats(logits, class_emb, query_class, counts, cap):
  b_, t_, _ = logits.shape
  c_ = counts.shape[1]
  per_image = []  # (b, c) -> list of selected token indices
  for b in range(b_):
    row = {}
    for c in range(c_):
      qs = np.flatnonzero(query_class[b] == c)
      if len(qs) == 0 or counts[b, c] == 0:
        row[c] = []
        continue
      n = min(cap, counts[b, c])
      row[c] = np.argsort(-logits[b, :, qs.max()], kind="stable")[:n].tolist()
    per_image.append(row)
  return per_image


def test_prototypes_and_distances_match_numpy():
  logits, class_emb, _ = _random_outputs(seed=3, b=4, t=12, q=5, e=6)
  query_class = np.array(
    [[-1, 0, 2, 1, -1], [-1, 1, -1, -1, -1], [-1, 2, 0, -1, -1], [-1, 0, 1, 2, -1]]
  )
  counts = np.array([[2, 0, 9, 0], [0, 3, 0, 0], [1, 0, 4, 0], [7, 1, 0, 0]])  # class 3 absent
  sums, cnt = jax.jit(buffer_selection.per_image_class_token_embeddings, static_argnums=4)(
    logits, class_emb, query_class, counts, 6
  )
  sel6 = _np_prototype_stats(logits, class_emb, query_class, counts, 6)
  want_sums = np.zeros((4, 4, 6))
  want_cnt = np.zeros((4, 4), int)
  for b in range(4):
    for c in range(4):
      want_sums[b, c] = class_emb[b, sel6[b][c]].sum(0)
      want_cnt[b, c] = len(sel6[b][c])
  np.testing.assert_array_equal(np.asarray(cnt), want_cnt)
  assert want_cnt[0, 2] == 6 and want_cnt[0, 1] == 0  # cap at 6; a negative query
  np.testing.assert_allclose(np.asarray(sums), want_sums, rtol=1e-5, atol=1e-5)

  protos, valid = buffer_selection.compute_prototypes(sums, cnt)
  np.testing.assert_array_equal(np.asarray(valid), [True, True, True, False])
  want_protos = np.zeros((4, 6))
  for c in range(3):
    want_protos[c] = want_sums[:, c].sum(0) / want_cnt[:, c].sum()
  np.testing.assert_allclose(np.asarray(protos), want_protos, rtol=1e-5, atol=1e-6)
  # accumulating over two batches gives the same prototypes
  p2, _ = buffer_selection.compute_prototypes(
    np.stack([np.asarray(sums[:2]).sum(0), np.asarray(sums[2:]).sum(0)]),
    np.stack([np.asarray(cnt[:2]).sum(0), np.asarray(cnt[2:]).sum(0)]),
  )
  np.testing.assert_allclose(np.asarray(p2), np.asarray(protos), rtol=1e-6, atol=1e-7)

  dist = np.asarray(
    jax.jit(buffer_selection.prototype_distances, static_argnums=5)(
      logits, class_emb, query_class, counts, protos, 12
    )
  )
  sel_all = _np_prototype_stats(logits, class_emb, query_class, counts, 12)
  for b in range(4):
    for c in range(4):
      if not sel_all[b][c]:
        assert dist[b, c] == np.inf
        continue
      e = class_emb[b, sel_all[b][c]].astype(np.float64)
      p = want_protos[c]
      d = 1 - (e @ p) / (np.linalg.norm(e, axis=1) * np.linalg.norm(p))
      np.testing.assert_allclose(dist[b, c], d.min(), rtol=1e-5, atol=1e-6)
  assert len(sel_all[0][2]) == 9  # not capped at 6


@pytest.mark.slow
def test_prototype_from_model_class_embeddings_hand_worked():
  """Class head -> prototype -> prototype distance, worked by hand (scenic/released semantics).

  Class head with identity Dense_0 (zero bias), tokens x = (3, 4) and (0, 10), one query (1, 0).
  scenic returns the normalised embeddings (0.6, 0.8) and (0, 1) (up to the 1e-6 in the norm);
  the prototype of the class (2 instances, both tokens) is their plain mean (0.3, 0.9), not
  re-normalised (released code). Distance of the image: min over its tokens of 1 - cos:
  token 1: 1 - (0.18 + 0.72) / sqrt(0.90) = 0.0513167; token 2: 1 - 0.9 / sqrt(0.90) = the
  same; the raw mean (1.5, 7) would give 1 - (0.9 + 5.6) / sqrt(51.25) = 0.0920477 instead.
  """
  from owl_cl.model import owl_vit

  head = owl_vit.ClassPredictor(out_dim=2)
  params = {
    "Dense_0": {"kernel": np.eye(2, dtype=np.float32), "bias": np.zeros(2, np.float32)},
    "logit_shift": {"kernel": np.zeros((2, 1), np.float32), "bias": np.zeros(1, np.float32)},
    "logit_scale": {"kernel": np.zeros((2, 1), np.float32), "bias": np.zeros(1, np.float32)},
  }
  x = np.array([[[3.0, 4.0], [0.0, 10.0]]], np.float32)  # [B=1, T=2, D=2]
  out = head.apply({"params": params}, x, np.array([[[1.0, 0.0]]], np.float32))
  emb = np.asarray(out["class_embeddings"])
  # 1e-6 in the denominator moves unit-scale values by < 1e-6 (norms 5 and 10).
  np.testing.assert_allclose(emb[0], [[0.6, 0.8], [0.0, 1.0]], atol=1e-6)
  query_class = np.array([[0]])
  counts = np.array([[2]])
  sums, cnt = buffer_selection.per_image_class_token_embeddings(
    out["pred_logits"], out["class_embeddings"], query_class, counts, 2
  )
  protos, _ = buffer_selection.compute_prototypes(sums, cnt)
  np.testing.assert_allclose(np.asarray(protos), [[0.3, 0.9]], atol=1e-6)
  dist = buffer_selection.prototype_distances(
    out["pred_logits"], out["class_embeddings"], query_class, counts, protos, max_instances=2
  )
  # float32 cosines of unit-scale vectors: ~1e-7 rounding; 1e-6 leaves margin, far below the
  # 0.04 gap to the raw-prototype value.
  np.testing.assert_allclose(np.asarray(dist), [[0.0513167]], atol=1e-6)


def test_select_buffer_released_options_hand_worked():
  """Top-up order and images without a class (released code), worked by hand.

  Images (loss; classes): 0 (0.1; c1), 1 (0.9; c0, c1), 2 (0.8; c0), 3 (0.7; c1),
  4 (0.05; none). t = 0.5 keeps {0, 4}; min_per_class = 2.
  class_index order: c0 needs 2 -> adds 2 (0.8), 1 (0.9); c1 then has {0, 1}: done.
  first_appearance order: c1 (in kept image 0) before c0 (first seen in image 1): c1 needs 1
  -> adds 3 (0.7); c0 needs 2 -> adds 2, 1. Dropping images without a class removes 4.
  """
  loss = np.array([0.1, 0.9, 0.8, 0.7, 0.05])
  membership = np.array([[0, 1], [1, 1], [1, 0], [0, 1], [0, 0]], bool)
  by_index = buffer_selection.select_buffer(loss, membership, 0.5, min_per_class=2)
  np.testing.assert_array_equal(np.flatnonzero(by_index), [0, 1, 2, 4])
  released = buffer_selection.select_buffer(
    loss,
    membership,
    0.5,
    min_per_class=2,
    top_up_order="first_appearance",
    drop_images_without_class=True,
  )
  np.testing.assert_array_equal(np.flatnonzero(released), [0, 1, 2, 3])
  with pytest.raises(ValueError, match="top_up_order='loss'"):
    buffer_selection.select_buffer(loss, membership, 0.5, top_up_order="loss")


def test_prototype_distance_capped_instances_hand_worked():
  """Prototype distance over at most `max_instances` tokens (released code: 6).

  One image, one class with 8 instances, T = 8 tokens ranked by the class logit 8, 7, ..., 1.
  Tokens 0..5 point along (0, 1), tokens 6 and 7 along the prototype (1, 0): over all 8
  instances the min distance is 0 (token 6); over the top 6 it is 1 - cos 90 deg = 1.
  """
  logits = np.arange(8, 0, -1, dtype=np.float32).reshape(1, 8, 1)
  emb = np.zeros((1, 8, 2), np.float32)
  emb[0, :6, 1] = 1.0
  emb[0, 6:, 0] = 1.0
  protos = np.array([[1.0, 0.0]], np.float32)
  args = (logits, emb, np.array([[0]]), np.array([[8]]), protos)
  np.testing.assert_allclose(buffer_selection.prototype_distances(*args, max_instances=8), [[0.0]])
  np.testing.assert_allclose(buffer_selection.prototype_distances(*args, max_instances=6), [[1.0]])


# ----------------------------------------------------------------------------- replay budget


@pytest.mark.parametrize(
  "budget, num_images, expected",
  [(0.25, 8, 2), (0.3, 8, 2), (0.001, 100, 1), (1.0, 8, 8), (3, 8, 3), (20, 8, 8)],
)
def test_budget_count_fraction_or_count(budget, num_images, expected):
  # A fraction rounds down (0.3 * 8 = 2.4 -> 2), at least 1; a count is capped at N_pt.
  assert buffer_selection.budget_count(budget, num_images) == expected


@pytest.mark.parametrize("budget", [True, 0, -1, 1.5, 0.0, "1%"])
def test_budget_count_rejects_bad_values(budget):
  with pytest.raises(ValueError, match="replay.budget"):
    buffer_selection.budget_count(budget, 8)


# Six selected images; class 0 in {0, 1, 2}, class 1 in {3, 4}; image 5 in none.
BUDGET_LOSS = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])


def _budget_membership(members):
  m = np.zeros((6, 2), bool)
  for c, images in members.items():
    m[images, c] = True
  return m


def test_budget_keeps_each_class_minimum_when_it_fits():
  # min_per_class 2, budget 4: the quota 2 keeps class 0's two lowest-loss images {0, 1} and
  # class 1's {3, 4}: 4 images, the whole budget, nothing drawn.
  keep = buffer_selection.apply_budget(
    np.ones(6, bool), BUDGET_LOSS, _budget_membership({0: [0, 1, 2], 1: [3, 4]}), 4, 2, seed=0
  )
  assert np.flatnonzero(keep).tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_budget_lowers_the_quota_then_draws_the_rest(seed):
  # Budget 3: quota 2 needs 4 images, so the quota drops to 1: {0} for class 0, {3} for
  # class 1; the third image is one of the others {1, 2, 4, 5}, the same for the same seed.
  membership = _budget_membership({0: [0, 1, 2], 1: [3, 4]})
  keep = buffer_selection.apply_budget(np.ones(6, bool), BUDGET_LOSS, membership, 3, 2, seed)
  kept = np.flatnonzero(keep).tolist()
  assert len(kept) == 3 and {0, 3} <= set(kept) and (set(kept) - {0, 3}) <= {1, 2, 4, 5}
  again = buffer_selection.apply_budget(np.ones(6, bool), BUDGET_LOSS, membership, 3, 2, seed)
  np.testing.assert_array_equal(keep, again)


def test_budget_draw_depends_on_the_seed():
  membership = _budget_membership({0: [0, 1, 2], 1: [3, 4]})
  drawn = {
    tuple(
      np.flatnonzero(
        buffer_selection.apply_budget(np.ones(6, bool), BUDGET_LOSS, membership, 3, 2, s)
      )
    )
    for s in range(20)
  }
  # Four possible third images; 20 seeds draw more than one of them (a constant draw fails).
  assert 1 < len(drawn) <= 4


def test_budget_quota_counts_images_kept_for_earlier_classes():
  # Class 0 in {3, 5}, class 1 in {3, 4}; budget 1, quota 1: class 0 keeps image 3 (its lower
  # loss, 0.4), which is also class 1's: class 1 adds nothing, and the budget is full.
  keep = buffer_selection.apply_budget(
    np.ones(6, bool), BUDGET_LOSS, _budget_membership({0: [3, 5], 1: [3, 4]}), 1, 1, seed=0
  )
  assert np.flatnonzero(keep).tolist() == [3]


def test_budget_above_the_selection_adds_lowest_loss_images():
  # Selected {0, 3}; budget 4 adds the two unselected images of lowest loss: 2 (0.2), 4 (0.3).
  loss = np.array([0.1, 0.6, 0.2, 0.4, 0.3, np.nan])
  keep = np.array([True, False, False, True, False, False])
  out = buffer_selection.apply_budget(keep, loss, np.zeros((6, 2), bool), 4, 2, seed=0)
  assert np.flatnonzero(out).tolist() == [0, 2, 3, 4]
  # All six: the NaN loss (counted +inf) comes last.
  out = buffer_selection.apply_budget(keep, loss, np.zeros((6, 2), bool), 6, 2, seed=0)
  assert out.all()

"""Hand-worked tests of the released code's options of issue 18 item 9 (docs/released_code.md):
GRASP-weighted draws within a class (`bal_prob_type='GRASP'`), ASER without its buffer term
(`no_buff`) and the thresholded KNN-SV (`SV_type='TKNN'`, `l2_thresh`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import registry

ASV_NAMES = ("aser", "aser_pc", "sw_aser_pc")


def _one_class_buffer(distances, class_embeddings, query_embeddings):
  """N images, all in class 0 (prototype e1), with the given prototype distances [N] and
  top-1 embeddings [N, 1, E]."""
  n = len(distances)
  class_embeddings = np.asarray(class_embeddings, np.float32)
  return state_lib.make_replay_buffer(
    np.ones((n, 1), bool),
    np.eye(1, class_embeddings.shape[-1], dtype=np.float32),
    np.asarray(distances, np.float32)[:, None],
    class_embeddings,
    np.asarray(query_embeddings, np.float32),
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["a_sw_grasp", "sw_aser_pc"])
def test_within_class_weighting_frequencies(name):
  """One class with two images at prototype distances 0.1 and 0.4. A-SW-GRASP's SWIL slot
  (tau = 1: one class has entropy 0, never GRASP) and the ASV algorithms' one candidate draw
  image 0 with probability 1/2 (uniform, paper) or, GRASP-weighted with w = 1 (released
  bal_prob_type='GRASP'), 0.1^-1 / (0.1^-1 + 0.4^-1) = 10 / 12.5 = 0.8. With one candidate
  the ASV algorithms replay it. 4000 draws: binomial std <= 0.0079, tolerance 0.035 (4.4 std).
  (The ASV algorithms share one candidate draw; sw_aser_pc stands for aser and aser_pc.)
  """
  buffer = _one_class_buffer([0.1, 0.4], [[[1.0, 0.0]], [[0.0, 1.0]]], [[[1.0, 0.0]], [[0.0, 1.0]]])
  features = {
    "class_embeddings": np.array([[[1.0, 1.0]]], np.float32),
    "query_embeddings": np.array([[[1.0, 0.0]]], np.float32),
  }
  hp = {"within_class_weighting": "grasp", "grasp_weight": 1.0}
  if name == "a_sw_grasp":
    hp["adaptive_entropy_threshold"] = 1.0
  else:
    hp.update(num_candidates=1, knn_k=1)
  algorithm = registry.get_algorithm(name, dedup="dataset", **hp)
  rstate = algorithm.prepare(
    state_lib.init_replay_state(2, jax.random.PRNGKey(0), num_classes=1), buffer
  )

  def draw(key):
    indices, valid, _, records = algorithm.retrieve_with_records(
      rstate.replace(key=key), buffer, features, 1
    )
    return indices[0], valid[0], records.get("used_grasp", jnp.zeros((1,), bool))[0]

  indices, valid, used_grasp = jax.jit(jax.vmap(draw))(
    jax.random.split(jax.random.PRNGKey(1), 4000)
  )
  assert bool(valid.all()) and not bool(used_grasp.any())
  assert abs(float(jnp.mean(indices == 0)) - 0.8) < 0.035
  with pytest.raises(ValueError, match="within_class_weighting='GRASP'"):
    registry.get_algorithm(name, within_class_weighting="GRASP")


def _line_buffer(query_embeddings):
  """Three images (one class) whose single class embeddings lie at x = 1, 2, 3 on a line."""
  return _one_class_buffer(
    [0.5, 0.5, 0.5], [[[1.0, 0.0]], [[2.0, 0.0]], [[3.0, 0.0]]], query_embeddings
  )


# The new image: class embedding at the origin (L2 distances 1, 2, 3 to the candidates),
# query embedding e1.
NEW_IMAGE = {
  "class_embeddings": np.zeros((1, 1, 2), np.float32),
  "query_embeddings": np.array([[[1.0, 0.0]]], np.float32),
}


# sw_aser_pc shares aser_pc's ASV code (it differs in the candidate class step only).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["aser", "aser_pc"])
def test_asv_without_left_term_hand_worked(name):
  """Released no_buff: ASV = -(right term). Candidate query embeddings e2, (1/2, sqrt(3)/2),
  e1 give utilities u = (0, 0.5, 1) (nearest first). KNN-SV with K = 1, N = 3:
  s_3 = u_3 / 3 = 1/3, s_2 = s_3 + (u_2 - u_3) * 1/2 = 1/12, s_1 = s_2 + (u_1 - u_2) * 1/1 =
  -5/12. ASV = (5/12, -1/12, -1/3): the replay order is images 0, 1, 2 and the right-term
  record is {-5/12, 1/12, 1/3}. With the left term (paper, default; max-reduced KNN-SVs of
  the three images among themselves, mean (11/36, 14/36, 11/36), minimum 0 so w = c) and
  c = 10: ASV = (3.472, 3.806, 2.722), order 1, 0, 2: the switch is seen.
  """
  buffer = _line_buffer([[[0.0, 1.0]], [[0.5, np.sqrt(0.75)]], [[1.0, 0.0]]])
  rstate = state_lib.init_replay_state(3, jax.random.PRNGKey(0), num_classes=1)
  small = dict(num_candidates=3, knn_k=1)
  algorithm = registry.get_algorithm(name, asv_left_term=False, **small)
  prepared = algorithm.prepare(rstate, buffer)
  assert not bool(prepared.asv_left_ready)  # nothing to precompute without the left term
  retrieve = jax.jit(algorithm.retrieve_with_records, static_argnums=3)
  indices, valid, _, records = retrieve(prepared, buffer, NEW_IMAGE, 3)
  assert bool(valid.all()) and np.asarray(indices).tolist() == [0, 1, 2]
  # float32 sums of O(1) values: ~1e-7.
  np.testing.assert_allclose(
    np.sort(records["knn_sv"][0]), [-5.0 / 12.0, 1.0 / 12.0, 1.0 / 3.0], atol=1e-6
  )
  paper = registry.get_algorithm(name, asv_c=10.0, **small)
  indices, _, _, _ = jax.jit(paper.retrieve_with_records, static_argnums=3)(
    paper.prepare(rstate, buffer), buffer, NEW_IMAGE, 3
  )
  assert np.asarray(indices).tolist() == [1, 0, 2]
  with pytest.raises(ValueError, match="asv_left_term='no'"):
    registry.get_algorithm(name, asv_left_term="no")


def _tknn_reference(d, u, threshold, num_classes):
  """TKNN-SV of one evaluation point from its definition (docs/reference.md §7), with A2
  from the released code's sum (not the closed form H_c - 1), N = 50."""
  d, u = np.asarray(d, np.float64), np.asarray(u, np.float64)
  within = np.ones_like(d, bool) if threshold is None else d < threshold
  c, total = int(within.sum()), u[within].sum()
  n, ratio, a2 = 50, 1.0, 0.0
  for k in range(n):
    ratio *= (n - k - c) / (n - k)
    a2 += (1.0 / (k + 1)) * (1.0 - ratio)
  a2 -= 1.0
  a1 = u / c - (total / (c * c - c) if c > 1 else 0.0)
  sv = (a1 * a2 if c > 2 else 0.0) + (u - 1.0 / num_classes) / c
  return np.where(within, sv, 0.0)


def test_threshold_knn_shapley_hand_worked():
  """One evaluation point, four candidates at distances 1, 2, 3, 4 with u = (0.5, 0.2, -0.1,
  0.9), C = 400 (1/C = 0.0025).
  Threshold 3.5: W = the first three, c = 3, S = 0.6, A2 = H_3 - 1 = 5/6,
  A1 = u/3 - 0.6/6 = (0.06667, -0.03333, -0.13333), s = A1 A2 + (u - 0.0025)/3 =
  (0.22139, 0.03806, -0.14528, 0).
  Threshold 2.5: c = 2 (no A term), s = (u - 0.0025)/2 = (0.24875, 0.09875, 0, 0).
  No threshold: c = 4, S = 1.5, A2 = H_4 - 1 = 13/12, A1 = u/4 - 1.5/12 = (0, -0.075, -0.15,
  0.1), s = (0.12438, -0.03188, -0.18813, 0.33271).
  Invalid candidate 3 with no threshold: the first case's values (c = 3 again).
  """
  d = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
  u = np.array([[0.5, 0.2, -0.1, 0.9]], np.float32)
  cases = [
    (3.5, None, [0.221389, 0.038056, -0.145278, 0.0]),
    (2.5, None, [0.24875, 0.09875, 0.0, 0.0]),
    (None, None, [0.124375, -0.031875, -0.188125, 0.332708]),
    (None, np.array([True, True, True, False]), [0.221389, 0.038056, -0.145278, 0.0]),
  ]
  for threshold, valid, want in cases:
    got = knn_shapley.threshold_knn_shapley(d, u, threshold, 400.0, valid)
    kept = 3 if valid is not None else 4  # the reference sees the valid candidates only
    reference = _tknn_reference(d[0][:kept], u[0][:kept], threshold, 400.0)
    # Hand values are rounded to 1e-6; float32 sums of O(1) values ~1e-7.
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got)[0][: len(reference)], reference, atol=2e-6)
  with pytest.raises(ValueError, match="num_classes must be > 0"):
    knn_shapley.threshold_knn_shapley(d, u, None, 0.0)


def test_tknn_harmonic_closed_form():
  """A2(c) = sum_{k<N} 1/(k+1) (1 - prod_{m<=k} (N-m-c)/(N-m)) - 1 (the released table)
  equals H_c - 1 for every c <= N: checked in float64 for N = 7 and 30, c = 0..N."""
  for n in (7, 30):
    for c in range(n + 1):
      ratio, a2 = 1.0, -1.0
      for k in range(n):
        ratio *= (n - k - c) / (n - k)
        a2 += (1.0 / (k + 1)) * (1.0 - ratio)
      assert abs(a2 - (sum(1.0 / i for i in range(1, c + 1)) - 1.0)) < 1e-12, (n, c)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["aser", "aser_pc"])
def test_asv_tknn_reaches_both_terms(name):
  """ASER variants with asv_shapley='tknn' (released SV_type='TKNN'): the line buffer of
  `test_asv_without_left_term_hand_worked` with candidate utilities u = (1, 0.5, -1) and no
  threshold: c = 3, S = 0.5, A2 = 5/6, A1 = u/3 - 0.5/6 = (0.25, 0.08333, -0.41667),
  s = A1 A2 + (u - 0.0025)/3 = (0.54083, 0.23528, -0.68139) (the right-term record, in
  candidate order). Threshold 2.5 (released l2_thresh): c = 2, s = (u - 0.0025)/2 =
  (0.49875, 0.24875, 0). Without the left term the replay order is ascending s: 2, 1, 0.
  """
  queries = [[[1.0, 0.0]], [[0.5, np.sqrt(0.75)]], [[-1.0, 0.0]]]
  buffer = _line_buffer(queries)
  rstate = state_lib.init_replay_state(3, jax.random.PRNGKey(0), num_classes=1)
  for threshold, want in ((None, [-0.68139, 0.23528, 0.54083]), (2.5, [0.0, 0.24875, 0.49875])):
    algorithm = registry.get_algorithm(
      name,
      num_candidates=3,
      asv_shapley="tknn",
      asv_distance_threshold=threshold,
      asv_left_term=False,
    )
    indices, valid, _, records = jax.jit(algorithm.retrieve_with_records, static_argnums=3)(
      algorithm.prepare(rstate, buffer), buffer, NEW_IMAGE, 3
    )
    assert bool(valid.all()) and np.asarray(indices).tolist() == [2, 1, 0]
    # Hand values rounded to 1e-5.
    np.testing.assert_allclose(np.sort(records["knn_sv"][0]), want, atol=1e-5)
  # With the left term (precomputed or over the candidate set) TKNN feeds it too: the
  # precomputed left term is the mean over the buffer of the max-reduced TKNN-SVs.
  algorithm = registry.get_algorithm(name, num_candidates=3, asv_shapley="tknn")
  prepared = algorithm.prepare(rstate, buffer)
  if algorithm.precomputed:
    embeddings = np.asarray(buffer.class_embeddings)[:, 0, 0]  # x = 1, 2, 3
    u = np.asarray(queries, np.float64)[:, 0] @ np.asarray(queries, np.float64)[:, 0].T
    rows = [
      _tknn_reference(np.abs(embeddings - embeddings[j]), u[j], None, 400.0) for j in range(3)
    ]
    # float32 of O(1) values: ~1e-7.
    np.testing.assert_allclose(prepared.asv_left, np.mean(rows, axis=0), atol=1e-6)
  with pytest.raises(ValueError, match="asv_shapley='TKNN'"):
    registry.get_algorithm(name, asv_shapley="TKNN")
  with pytest.raises(ValueError, match="asv_distance_threshold=-1.0"):
    registry.get_algorithm(name, asv_distance_threshold=-1.0)


def test_prototypes_over_the_whole_pretraining_set_hand_worked():
  """Released code: prototypes average every pre-training image's class embeddings, not just
  the buffer's. Three images, two classes, E = 2; per image the sum and count of its class
  tokens: image 0 class 0: (2, 0) over 2 tokens; image 1 class 0: (0, 3) over 1 token and
  class 1: (1, 1) over 1; image 2 class 1: (3, 1) over 1. The buffer keeps images 0 and 2.
  'buffer': p_0 = (2, 0)/2 = (1, 0), p_1 = (3, 1)/1 = (3, 1).
  'all': p_0 = (2, 3)/3 = (0.6667, 1), p_1 = (4, 2)/2 = (2, 1).
  """
  from owl_cl.replay import buffer_selection

  sums = np.zeros((3, 2, 2), np.float32)
  sums[0, 0] = (2, 0)
  sums[1, 0] = (0, 3)
  sums[1, 1] = (1, 1)
  sums[2, 1] = (3, 1)
  counts = np.array([[2, 0], [1, 1], [0, 1]], np.int32)
  keep = np.array([True, False, True])
  buffer, valid = buffer_selection.buffer_prototypes(sums, counts, keep)
  # Exact small ratios in float32: ~1e-7.
  np.testing.assert_allclose(buffer, [[1.0, 0.0], [3.0, 1.0]], atol=1e-6)
  whole, valid_all = buffer_selection.buffer_prototypes(sums, counts, keep, "all")
  np.testing.assert_allclose(whole, [[2.0 / 3.0, 1.0], [2.0, 1.0]], atol=1e-6)
  assert bool(valid.all()) and bool(valid_all.all())
  with pytest.raises(ValueError, match="prototype_images='every'"):
    buffer_selection.buffer_prototypes(sums, counts, keep, "every")


@pytest.mark.slow
def test_per_image_candidate_subsets_hand_worked():
  """SW-ASER-PC with per-image candidate subsets (released caser.balanced=True), no left term.

  Classes 0 (images 0-2) and 1 (images 3-5), prototypes e1, e2; new image 0 has class
  embedding e1 (SWIL: class 0 with probability 1 - 1e-8), new image 1 e2 (class 1). N_c = 6,
  B = 2: each image's subset is its class's 3 images. With K = 6 >= N_c the KNN-SV is
  s_b(i) = u_b(i) / K (the recursion telescopes), so ASV(i) = -min_b u_b(i) / 6; both new
  queries are e1 and candidate i's query has cosine u_i = (-0.9, -0.8, 0.5, 0.9, 0.2, -0.1)
  with it: ASV = (0.150, 0.133, -0.083, -0.150, -0.033, 0.017). Shared set (paper): the top
  two are images 0 and 1, both of class 0. Per image: image 0's best of {0, 1, 2} is 0, image
  1's best of {3, 4, 5} is 5.
  """
  membership = np.zeros((6, 2), bool)
  membership[:3, 0] = membership[3:, 1] = True
  u = np.array([-0.9, -0.8, 0.5, 0.9, 0.2, -0.1], np.float32)
  queries = np.stack([u, np.sqrt(1.0 - u**2)], -1)[:, None, :]
  buffer = state_lib.make_replay_buffer(
    membership,
    np.eye(2, dtype=np.float32),
    np.where(membership, 0.5, np.inf).astype(np.float32),
    np.repeat(np.eye(2, dtype=np.float32), 3, axis=0)[:, None, :],
    queries,
  )
  features = {
    "class_embeddings": np.eye(2, dtype=np.float32)[:, None, :],
    "query_embeddings": np.array([[[1.0, 0.0]], [[1.0, 0.0]]], np.float32),
  }
  rstate = state_lib.init_replay_state(6, jax.random.PRNGKey(0), num_classes=2)
  hp = dict(num_candidates=6, knn_k=6, asv_left_term=False)
  for subsets, want in (("shared", [0, 1]), ("per_image", [0, 5])):
    algorithm = registry.get_algorithm("sw_aser_pc", candidate_subsets=subsets, **hp)
    indices, valid, _, records = jax.jit(algorithm.retrieve_with_records, static_argnums=3)(
      rstate, buffer, features, 2
    )
    assert bool(valid.all()) and np.asarray(indices).tolist() == want, subsets
    assert np.asarray(records["sampled_classes"]).tolist() == [0, 0 if subsets == "shared" else 1]
  with pytest.raises(ValueError, match="candidate_subsets='per_image' needs the similarity"):
    registry.get_algorithm("aser_pc", candidate_subsets="per_image")
  algorithm = registry.get_algorithm(
    "sw_aser_pc", candidate_subsets="per_image", num_candidates=5, knn_k=6
  )
  with pytest.raises(ValueError, match="num_candidates=5 divisible by the new batch size 2"):
    algorithm(rstate, buffer, features, 2)


@pytest.mark.parametrize("name", ["aser", "aser_pc"])
def test_asv_on_image_features_hand_worked(name):
  """Released cls_embeds=False: the KNN distances compare the ViT image tokens instead of the
  class embeddings. The line buffer of `test_asv_without_left_term_hand_worked` (class
  embeddings at x = 1, 2, 3, u = (0, 0.5, 1)) gets image features at x = 3, 2, 1 (D = 3) and
  the new image's at the origin, so the distance order reverses: nearest first images 2, 1,
  0 with u = 1, 0.5, 0. K = 1: s(image 0) = 0/3 = 0, s(image 1) = 0 + (0.5 - 0)/2 = 0.25,
  s(image 2) = 0.25 + (1 - 0.5) = 0.75 (class embeddings: -5/12, 1/12, 1/3).
  """
  line = _line_buffer([[[0.0, 1.0]], [[0.5, np.sqrt(0.75)]], [[1.0, 0.0]]])
  image_features = np.array([[[3.0, 0.0, 0.0]], [[2.0, 0.0, 0.0]], [[1.0, 0.0, 0.0]]], np.float32)
  buffer = state_lib.make_replay_buffer(
    line.class_membership,
    line.prototypes,
    line.prototype_distances,
    line.class_embeddings,
    line.query_embeddings,
    image_features,
  )
  features = {**NEW_IMAGE, "image_features": np.zeros((1, 1, 3), np.float32)}
  rstate = state_lib.init_replay_state(3, jax.random.PRNGKey(0), num_classes=1)
  algorithm = registry.get_algorithm(
    name, num_candidates=3, knn_k=1, asv_left_term=False, asv_features="image_features"
  )
  _, valid, _, records = jax.jit(algorithm.retrieve_with_records, static_argnums=3)(
    algorithm.prepare(rstate, buffer), buffer, features, 3
  )
  assert bool(valid.all())
  # float32 sums of O(1) values: ~1e-7.
  np.testing.assert_allclose(np.sort(records["knn_sv"][0]), [0.0, 0.25, 0.75], atol=1e-6)
  with pytest.raises(ValueError, match="needs features \\['image_features'\\]"):
    algorithm(rstate, buffer, NEW_IMAGE, 3)
  with pytest.raises(ValueError, match="needs a buffer with image_features"):
    algorithm(rstate, line, features, 3)
  with pytest.raises(ValueError, match="asv_features='image'"):
    registry.get_algorithm(name, asv_features="image")


def test_top_k_token_features_and_store_round_trip(tmp_path):
  """The image features of the top-k tokens are those of `top_k_embeddings`' tokens: logits
  [1, 3 tokens, 2 queries] = [[0, 5], [9, 1], [2, 3]] with query 1 padded: max over the
  valid query 0 ranks the tokens 1 (9), 2 (2), 0 (0); top-2 = tokens 1, 2. A buffer with
  image features keeps them through `ReplayStore.save` / `load`; one without has none."""
  from owl_cl.replay import store as store_lib
  from owl_cl.train import top_k as top_k_lib

  logits = np.array([[[0.0, 5.0], [9.0, 1.0], [2.0, 3.0]]], np.float32)
  tokens = np.arange(3 * 4, dtype=np.float32).reshape(1, 3, 4)
  mask = np.array([[True, False]])
  got = top_k_lib.top_k_token_features(logits, tokens, mask, 2)
  np.testing.assert_array_equal(got, tokens[:, [1, 2]])
  class_emb, _ = top_k_lib.top_k_embeddings(logits, tokens, tokens, mask, 2)
  np.testing.assert_array_equal(got, class_emb)

  line = _line_buffer([[[0.0, 1.0]], [[0.5, np.sqrt(0.75)]], [[1.0, 0.0]]])
  examples = {
    "images": np.zeros((3, 2, 2, 3), np.float32),
    "queries": np.ones((3, 1, 2), np.int32),
    "labels": np.zeros((3, 1, 1), np.float32),
    "boxes": np.zeros((3, 1, 4), np.float32),
    "query_class": np.zeros((3, 1), np.int32),
  }
  for image_features in (None, np.full((3, 1, 5), 0.25, np.float32)):
    buffer = state_lib.make_replay_buffer(
      line.class_membership,
      line.prototypes,
      line.prototype_distances,
      line.class_embeddings,
      line.query_embeddings,
      image_features,
    )
    store = store_lib.ReplayStore(examples, np.zeros((3, 4, 1), np.float32), buffer, ["a"])
    path = str(tmp_path / f"store_{image_features is None}")
    store.save(path)
    loaded = store_lib.ReplayStore.load(path).replay_buffer()
    if image_features is None:
      assert loaded.image_features is None
    else:
      np.testing.assert_array_equal(loaded.image_features, image_features)
  with pytest.raises(ValueError, match="image_features must be \\[N=3, k=1, D\\]"):
    state_lib.make_replay_buffer(
      line.class_membership,
      line.prototypes,
      line.prototype_distances,
      line.class_embeddings,
      line.query_embeddings,
      np.zeros((3, 2, 5), np.float32),
    )

"""Scoring in category shards (`owl_cl.eval.category_shards`): the split, and the COCO and
LVIS statistics bit for bit equal to one pass, for each backend."""

import math

import numpy as np
import pytest

from owl_cl.eval import category_shards
from owl_cl.eval import coco_eval
from owl_cl.eval import detection
from owl_cl.eval import lvis_eval
from owl_cl.testing import detections as testing_detections

# ------------------------------------------------------------------------------ the split


def test_split_categories_hand_worked():
  # Weights 4,1,1,1,1 (total 8) in 2: the first range closes once it holds half (4).
  assert category_shards.split_categories([1, 2, 3, 4, 5], [4, 1, 1, 1, 1], 2) == [
    [1],
    [2, 3, 4, 5],
  ]
  # Equal weights in 2: 2 of 4 each; in 4: one each.
  assert category_shards.split_categories([2, 5, 9, 11], [3, 3, 3, 3], 2) == [[2, 5], [9, 11]]
  assert category_shards.split_categories([2, 5, 9, 11], [3, 3, 3, 3], 4) == [[2], [5], [9], [11]]
  # No weight at all: the last ranges are opened so that each gets one category.
  assert category_shards.split_categories([1, 2, 3, 4], [0, 0, 0, 0], 3) == [[1, 2], [3], [4]]


def test_split_categories_invariants():
  rng = np.random.default_rng(0)
  for _ in range(200):
    k = int(rng.integers(1, 30))
    cats = sorted(rng.choice(1000, k, replace=False).tolist())
    weights = rng.integers(0, 50, k).tolist()
    shards = int(rng.integers(1, k + 1))
    out = category_shards.split_categories(cats, weights, shards)
    assert len(out) == shards and all(out)
    assert [c for r in out for c in r] == cats


def test_split_and_count_errors():
  with pytest.raises(ValueError, match="sorted and distinct"):
    category_shards.split_categories([2, 1], [1, 1], 1)
  with pytest.raises(ValueError, match="1 weights for 2"):
    category_shards.split_categories([1, 2], [1], 1)
  with pytest.raises(ValueError, match=r"shards must be in \[1, 2\], got 3"):
    category_shards.split_categories([1, 2], [1, 1], 3)
  with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
    category_shards.shard_count(10, 5, 0, None)
  with pytest.raises(ValueError, match="shards must be >= 1 or None, got 0"):
    category_shards.shard_count(10, 5, 1, 0)


def test_shard_count():
  n = category_shards.SHARD_DETECTIONS
  assert category_shards.shard_count(n, 365, 1, None) == 1  # in the calling process
  assert category_shards.shard_count(n + 1, 365, 1, None) == 2  # bounded memory, even at 1
  assert category_shards.shard_count(16 * n, 365, 4, None) == 16
  assert category_shards.shard_count(10, 365, 4, None) == 4
  assert category_shards.shard_count(10, 3, 8, None) == 3  # at most one per category
  assert category_shards.shard_count(10, 365, 1, 7) == 7
  assert category_shards.shard_count(0, 0, 2, None) == 1
  # Shared by 4 hosts: every host's processes get shards, but a set one process scores in one
  # pass is scored so on every host; `shards` is taken as it is.
  assert category_shards.shard_count(n, 365, 1, None, hosts=4) == 1
  assert category_shards.shard_count(n + 1, 365, 1, None, hosts=4) == 4
  assert category_shards.shard_count(10, 365, 2, None, hosts=4) == 8
  assert category_shards.shard_count(16 * n, 365, 2, None, hosts=4) == 16
  assert category_shards.shard_count(10, 365, 1, 3, hosts=4) == 3
  with pytest.raises(ValueError, match="hosts must be >= 1"):
    category_shards.shard_count(10, 365, 1, None, hosts=0)


def test_partition_is_stable_and_names_a_missing_category():
  items = [(3, "a"), (1, "b"), (3, "c"), (2, "d"), (1, "e")]
  got = category_shards.partition(items, lambda x: x[0], [[1, 2], [3]])
  assert got == [[(1, "b"), (2, "d"), (1, "e")], [(3, "a"), (3, "c")]]
  with pytest.raises(KeyError):
    category_shards.partition([(4, "f")], lambda x: x[0], [[1, 2], [3]])


def test_weights_by_category():
  assert category_shards.weights_by_category([1, 2, 5], [1, 1, 5, 9], [2, 5, 5]) == [2, 1, 3]


def test_shard_sets_split_ground_truth_and_detections_by_category():
  dataset = {
    "info": {"v": 1},
    "images": [{"id": 1}, {"id": 2}],
    "categories": [{"id": 1}, {"id": 2}, {"id": 3}],
    "annotations": [{"id": 1, "category_id": 3}, {"id": 2, "category_id": 1}],
  }
  dets = [{"category_id": c, "n": n} for n, c in enumerate([2, 1, 3, 2, 9])]  # 9: not scored
  # Weights (detections + boxes): 1 + 1, 2 + 0, 1 + 1 (total 6); the first range closes once
  # it holds half (after category 2: 4 of 6).
  (first, dets1, cats1), (second, dets2, cats2) = category_shards.shard_sets(
    dataset, dets, [1, 2, 3], 2
  )
  assert (cats1, cats2) == ([1, 2], [3])
  assert first == {
    **dataset,
    "categories": [{"id": 1}, {"id": 2}],
    "annotations": [dataset["annotations"][1]],
  }
  assert second["categories"] == [{"id": 3}] and second["images"] == dataset["images"]
  assert second["annotations"] == [dataset["annotations"][0]] and second["info"] == {"v": 1}
  assert [d["n"] for d in dets1] == [0, 1, 3] and [d["n"] for d in dets2] == [2]


# ------------------------------------------------------------------------------ COCO


def _coco(seed, images=30, classes=9, dets=25):
  """(COCO ground truth, detections) of `testing.detections.coco_set` with category ids
  2, 4, ... and one in five scores rounded to 0.1, so that ties occur."""
  gt, detections = testing_detections.coco_set(
    seed, images, classes, dets, id_step=2, tie_rate=0.2, max_boxes=10
  )
  return testing_detections.as_coco(gt), detections


def _assert_identical(want, got):
  """The same keys and the same floats, exactly (NaN where the other is NaN)."""
  assert set(want) == set(got)
  for name, value in want.items():
    if isinstance(value, dict):
      _assert_identical(value, got[name])
    elif isinstance(value, float) and math.isnan(value):
      assert math.isnan(got[name]), name
    else:
      assert got[name] == value, name


COCO_OPTIONS = [
  {"max_dets": 100, "per_category": True},
  {"max_dets": 10},  # the per-image limit: 25 detections each, 10 kept
  {"max_dets": 100, "cat_ids": [4, 6, 12, 18], "image_ids": list(range(1, 21))},
]


@pytest.mark.parametrize("backend", coco_eval.COCO_BACKENDS)
def test_coco_in_shards_is_one_pass_bit_for_bit(backend):
  if backend == "faster_coco_eval":
    pytest.importorskip("faster_coco_eval")
  coco, detections = _coco(0)
  for options, shards in zip(COCO_OPTIONS, (4, 3, 2)):
    want = coco_eval.coco_evaluate(coco, detections, backend=backend, **options)
    got = coco_eval.coco_evaluate(
      coco, detections, backend=backend, processes=2, shards=shards, **options
    )
    assert 0 < want["AP"] < want["AP50"] < 1  # matches at some thresholds, misses too
    _assert_identical(want, got)


# ------------------------------------------------------------------------------ LVIS


def test_lvis_in_shards_is_one_pass_bit_for_bit():
  gt, detections = testing_detections.lvis_set(0)
  ground = lvis_eval.load_lvis_ground_truth(gt)
  cases = [
    ({"max_dets": 300, "per_category": True}, 5),
    ({"max_dets": 15}, 3),  # the per-image limit (40 detections each), applied before the split
    ({"max_dets": 300, "cat_ids": [1, 4, 13, 19, 28], "image_ids": list(range(5, 26))}, 2),
  ]
  for options, shards in cases:
    want = lvis_eval.lvis_evaluate(ground, detections, **options)
    got = lvis_eval.lvis_evaluate(ground, detections, processes=2, shards=shards, **options)
    assert 0 < want["AP"] < want["AP50"] < 1 and not math.isnan(want["APr"])
    _assert_identical(want, got)


# ------------------------------------------------------------------------------ errors, wiring


def test_bad_processes_and_shards_fail_before_any_work():
  coco, detections = _coco(1, images=3)
  with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
    coco_eval.coco_evaluate(coco, detections, processes=0)
  gt, lvis_detections = testing_detections.lvis_set(1, images=3)
  with pytest.raises(ValueError, match="shards must be >= 1 or None, got 0"):
    lvis_eval.lvis_evaluate(gt, lvis_detections, shards=0)


def test_the_scorings_processes_reach_the_scorer(monkeypatch):
  """`Scoring.processes` (`config.eval.scoring_processes` through `Detector`) is the scorer's
  `processes`."""
  asked = []
  real = coco_eval.coco_evaluate

  def spy(*args, processes, **kwargs):
    asked.append(processes)
    return real(*args, processes=processes, shards=1, **kwargs)

  monkeypatch.setattr(coco_eval, "coco_evaluate", spy)
  coco, detections = _coco(2, images=4)
  source = type("Source", (), {"coco": coco, "category_ids": [2, 4], "name": "s"})()
  batches = [{"image_id": np.array([1]), "orig_size": np.array([[480, 640]])}]

  def predict_fn(batch):
    return np.array([[0.9]]), np.array([[0]]), np.array([[[0.1, 0.1, 0.5, 0.5]]])

  detection.evaluate_source(
    predict_fn, source, batches, detection.Scoring(processes=3), progress=False
  )
  assert asked == [3]

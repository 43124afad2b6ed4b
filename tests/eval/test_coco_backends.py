"""`coco_evaluate(backend='faster_coco_eval')` gives every metric pycocotools gives."""

import math
import types

import pytest

from owl_cl.eval import coco_eval
from owl_cl.eval import detection
from owl_cl.testing import detections as testing_detections

pytest.importorskip("faster_coco_eval")


def _generated(seed, images=40, classes=7, dets=30):
  """(pycocotools COCO ground truth, detections) of `testing.detections.coco_set`: boxes of
  every COCO area range, one in ten a crowd, jittered and random detections."""
  gt, detections = testing_detections.coco_set(seed, images, classes, dets)
  return testing_detections.as_coco(gt), detections


def _assert_same(want, got):
  # Both evaluate the same doubles: the statistics are means of precision / recall entries in
  # [0, 1]; faster-coco-eval's interpolated precision was seen to differ from pycocotools' by
  # one double rounding (2.2e-16) in some entries, so a mean over them differs by no more.
  # 1e-12 leaves room for a few such roundings and still fails any different match or count
  # (one changed match among the few hundred here moves AP by far more than 1e-6).
  assert set(want) == set(got)
  for name, value in want.items():
    if isinstance(value, dict):
      _assert_same(value, got[name])
    elif isinstance(value, float) and math.isnan(value):
      assert math.isnan(got[name]), name
    else:
      assert got[name] == pytest.approx(value, abs=1e-12, rel=0), name


@pytest.mark.parametrize(
  "options",
  [
    {"max_dets": 100, "per_category": True},
    {"max_dets": 10},  # truncation per image: 30 detections each, 10 kept
    {"max_dets": 100, "cat_ids": [2, 3, 5], "image_ids": list(range(1, 31))},
  ],
)
def test_faster_coco_eval_equals_pycocotools(options):
  coco, detections = _generated(0)
  want = coco_eval.coco_evaluate(coco, detections, **options)
  got = coco_eval.coco_evaluate(coco, detections, backend="faster_coco_eval", **options)
  # Neither trivial nor empty: matches at several IoU thresholds, misses too.
  assert 0 < want["AP"] < want["AP50"] < 1
  _assert_same(want, got)


def test_faster_coco_eval_without_detections_and_unknown_backend():
  coco, _ = _generated(1, images=5)
  want = coco_eval.coco_evaluate(coco, [])
  _assert_same(want, coco_eval.coco_evaluate(coco, [], backend="faster_coco_eval"))
  with pytest.raises(ValueError, match="backend='cocoapi' is unknown"):
    coco_eval.coco_evaluate(coco, [], backend="cocoapi")


def test_the_scorings_backend_is_the_one_that_scores(monkeypatch):
  """`Scoring.coco_backend` (`config.eval.coco_backend` through `Detector`) reaches COCOeval:
  each backend is asked for once, and they agree (`_assert_same`'s tolerance)."""
  asked = []
  backend_of = coco_eval._backend
  monkeypatch.setattr(coco_eval, "_backend", lambda name: asked.append(name) or backend_of(name))
  coco, detections = _generated(1, images=12)
  source = types.SimpleNamespace(coco=coco)
  results = {}
  for backend in coco_eval.COCO_BACKENDS:
    scoring = detection.Scoring(coco_backend=backend)
    gt, score, _, _, max_dets = detection._protocol(scoring, source)
    results[backend] = score(gt, detections, max_dets=max_dets)
  assert asked == list(coco_eval.COCO_BACKENDS)
  _assert_same(*results.values())

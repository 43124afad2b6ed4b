"""Per-class AP (results.json `per_class`, issue 49 item 2): pycocotools' and the lvis API's
per-category precision against a hand-worked example and an independent computation."""

import contextlib
import io
import math

import numpy as np
from pycocotools.coco import COCO
import pytest

from owl_cl.eval import coco_eval
from owl_cl.eval import detection
from owl_cl.eval import lvis_eval

# Three 100 x 100 images; class 'a' (id 4) has an object in images 1 and 2, class 'b' (id 9)
# one in image 3, class 'c' (id 13) none. Boxes xywh in pixels.
BOX_1 = [10.0, 10.0, 20.0, 20.0]
BOX_3 = [50.0, 50.0, 30.0, 30.0]
ELSEWHERE = [60.0, 60.0, 20.0, 20.0]  # overlaps no object: IoU 0
CATEGORIES = [(4, "a", "f"), (9, "b", "c"), (13, "c", "r")]
GROUND_TRUTH = [(1, 4, BOX_1), (2, 4, BOX_1), (3, 9, BOX_3)]
# (image, category, box, score): every box matches an object exactly (IoU 1) or none (IoU 0),
# so each detection is a true or a false positive at every IoU threshold and AP = AP50.
DETECTIONS = [
  (1, 4, BOX_1, 0.9),  # a: TP
  (2, 4, ELSEWHERE, 0.8),  # a: FP
  (2, 4, BOX_1, 0.7),  # a: TP
  (3, 9, [0.0, 0.0, 10.0, 10.0], 0.6),  # b: FP
  (3, 9, BOX_3, 0.5),  # b: TP
]
# By hand, COCO's 101-point interpolated AP (recall thresholds 0, 0.01, ..., 1; precision at
# a threshold = the highest precision at any recall >= it):
# a: ranked TP, FP, TP -> (recall, precision) (1/2, 1), (1/2, 1/2), (1, 2/3): precision 1 at the
#    51 thresholds <= 0.5, 2/3 at the 50 above -> (51 + 50 * 2/3) / 101.
# b: ranked FP, TP -> (0, 0), (1, 1/2): precision 1/2 at every threshold -> 1/2.
# c: no ground truth -> no AP (NaN; pycocotools' -1).
AP_A = (51 + 50 * 2 / 3) / 101
AP_B = 0.5


def reference_ap(scores, true_positive, num_objects):
  """101-point interpolated AP of one class from its ranked detections, written from the COCO
  definition (not pycocotools' code): the independent computation."""
  order = np.argsort(-np.asarray(scores), kind="stable")
  tp = np.asarray(true_positive, np.float64)[order]
  recall = np.cumsum(tp) / num_objects
  precision = np.cumsum(tp) / np.arange(1, tp.size + 1)
  points = []
  for threshold in np.linspace(0.0, 1.0, 101):
    reached = precision[recall >= threshold - 1e-12]
    points.append(reached.max() if reached.size else 0.0)
  return float(np.mean(points))


def test_reference_matches_the_hand_worked_values():
  assert reference_ap([0.9, 0.8, 0.7], [1, 0, 1], 2) == pytest.approx(AP_A, rel=1e-12)
  assert reference_ap([0.6, 0.5], [0, 1], 1) == pytest.approx(AP_B, rel=1e-12)


def coco_ground_truth():
  dataset = {
    "images": [{"id": i, "height": 100, "width": 100} for i in (1, 2, 3)],
    "categories": [{"id": c, "name": n} for c, n, _ in CATEGORIES],
    "annotations": [
      {"id": k, "image_id": i, "category_id": c, "bbox": b, "area": b[2] * b[3], "iscrowd": 0}
      for k, (i, c, b) in enumerate(GROUND_TRUTH, start=1)
    ],
  }
  with contextlib.redirect_stdout(io.StringIO()):
    coco = COCO()
    coco.dataset = dataset
    coco.createIndex()
  return coco


def lvis_ground_truth():
  # Every class either annotated in an image or in its neg_category_ids: the federated rules
  # keep every detection of the example.
  annotated = {i: {c for j, c, _ in GROUND_TRUTH if j == i} for i in (1, 2, 3)}
  return {
    "images": [
      {
        "id": i,
        "height": 100,
        "width": 100,
        "neg_category_ids": sorted({4, 9, 13} - annotated[i]),
        "not_exhaustive_category_ids": [],
      }
      for i in (1, 2, 3)
    ],
    "categories": [{"id": c, "name": n, "frequency": f} for c, n, f in CATEGORIES],
    "annotations": [
      {"id": k, "image_id": i, "category_id": c, "bbox": b, "area": b[2] * b[3]}
      for k, (i, c, b) in enumerate(GROUND_TRUTH, start=1)
    ],
  }


def detection_dicts():
  return [
    {"image_id": i, "category_id": c, "bbox": list(b), "score": s} for i, c, b, s in DETECTIONS
  ]


def independent_per_class():
  """{category id: reference AP} from the example's TP / FP labels."""
  out = {}
  for cat, _, _ in CATEGORIES:
    # A detection is a true positive when its box is an object of its class in its image.
    rows = [(s, (i, c, b) in GROUND_TRUTH) for i, c, b, s in DETECTIONS if c == cat]
    objects = sum(c == cat for _, c, _ in GROUND_TRUTH)
    out[cat] = reference_ap(*zip(*rows), objects) if objects else math.nan
  return out


# pycocotools and the lvis API divide by (tp + fp + np.spacing(1)): a relative error of about
# 1e-16 per precision value; 1e-12 leaves room for the 101-term mean and nothing more.
REL = 1e-12


def test_coco_per_category_ap_hand_worked_and_independent():
  result = coco_eval.coco_evaluate(coco_ground_truth(), detection_dicts(), per_category=True)
  per_cat = result["per_category"]
  reference = independent_per_class()
  assert reference[4] == pytest.approx(AP_A, rel=REL) and reference[9] == pytest.approx(AP_B)
  for cat in (4, 9):
    assert per_cat[cat]["AP"] == pytest.approx(reference[cat], rel=REL), cat
    assert per_cat[cat]["AP50"] == pytest.approx(reference[cat], rel=REL), cat
  assert math.isnan(per_cat[13]["AP"]) and math.isnan(per_cat[13]["AP50"])
  # The overall AP is the mean over the classes with ground truth.
  assert result["AP"] == pytest.approx((AP_A + AP_B) / 2, rel=REL)


def test_lvis_per_category_ap_hand_worked_and_independent():
  result = lvis_eval.lvis_evaluate(lvis_ground_truth(), detection_dicts(), per_category=True)
  per_cat = result["per_category"]
  for cat, expected in ((4, AP_A), (9, AP_B)):
    assert per_cat[cat]["AP"] == pytest.approx(expected, rel=REL), cat
    assert per_cat[cat]["AP50"] == pytest.approx(expected, rel=REL), cat
  assert [per_cat[c]["frequency"] for c in (4, 9, 13)] == ["f", "c", "r"]
  assert math.isnan(per_cat[13]["AP"]) and math.isnan(per_cat[13]["AP50"])
  assert result["APf"] == pytest.approx(AP_A, rel=REL)
  assert result["APc"] == pytest.approx(AP_B, rel=REL)


def test_per_class_table_names_and_errors():
  per_category = {4: {"AP": 0.5}, 9: {"AP": 0.25}}
  table = detection.per_class_table(per_category, [9, 4, 13], ["b", "a", "c"])
  # Class-index order, only the categories scored, each with its id.
  assert list(table) == ["b", "a"]
  assert table["a"] == {"category_id": 4, "AP": 0.5}
  shared = detection.per_class_table(per_category, [4, 9], ["x", "x"])
  assert list(shared) == ["x (4)", "x (9)"]
  with pytest.raises(ValueError, match="2 category ids against 1 names"):
    detection.per_class_table(per_category, [4, 9], ["a"])
  with pytest.raises(ValueError, match=r"category ids \[9\] have no class name"):
    detection.per_class_table(per_category, [4], ["a"])


class _Source:
  """The example as an evaluation set: class index i -> CATEGORIES[i]."""

  category_ids = [c for c, _, _ in CATEGORIES]
  class_names = [n for _, n, _ in CATEGORIES]
  name = "example"

  def __init__(self):
    self.coco = coco_ground_truth()
    self.annotation_file = lvis_ground_truth()


def _batches_and_predict(top_k=3):
  """One batch per image; `predict_fn` returns the example's detections of that image (boxes
  cxcywh relative to the 100-pixel square), padded with zero-score class-c boxes that no
  class with ground truth sees."""
  index = {c: k for k, (c, _, _) in enumerate(CATEGORIES)}
  batches, outputs = [], {}
  for image in (1, 2, 3):
    scores = np.zeros((1, top_k), np.float32)
    labels = np.full((1, top_k), index[13], np.int32)
    boxes = np.full((1, top_k, 4), 0.05, np.float32)
    for k, (_, c, (x, y, w, h), s) in enumerate(d for d in DETECTIONS if d[0] == image):
      scores[0, k], labels[0, k] = s, index[c]
      boxes[0, k] = [(x + w / 2) / 100, (y + h / 2) / 100, w / 100, h / 100]
    batch = {"image_id": np.array([image]), "orig_size": np.array([[100, 100]])}
    batches.append(batch)
    outputs[image] = (scores, labels, boxes)
  return batches, lambda batch: outputs[int(batch["image_id"][0])]


@pytest.mark.parametrize("protocol", ["coco", "lvis"])
def test_evaluate_source_per_class_by_name(protocol):
  """`evaluate_source(per_class=True)`: the per-class AP keyed by class name, the metrics
  themselves unchanged."""
  batches, predict_fn = _batches_and_predict()
  by_class = detection.Scoring(protocol=protocol, per_class=True)
  result = detection.evaluate_source(predict_fn, _Source(), batches, by_class, progress=False)
  plain = detection.evaluate_source(
    predict_fn, _Source(), batches, detection.Scoring(protocol=protocol), progress=False
  )
  per_class = result.pop("per_class")
  assert list(per_class) == ["a", "b", "c"] and "per_category" not in result
  assert {n: v["category_id"] for n, v in per_class.items()} == {"a": 4, "b": 9, "c": 13}
  # The boxes pass through float32 (IoU 1 - 1e-7, a match at every threshold): the ranks and
  # matches are the hand-worked ones, so the values are too.
  assert per_class["a"]["AP"] == pytest.approx(AP_A, rel=REL)
  assert per_class["b"]["AP"] == pytest.approx(AP_B, rel=REL)
  assert math.isnan(per_class["c"]["AP"])
  assert result.keys() == plain.keys()
  assert all(result[k] == plain[k] or math.isnan(plain[k]) for k in plain)

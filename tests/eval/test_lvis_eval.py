"""LVIS evaluation (docs/reference.md §4): federated AP, APr/APc/APf, id mapping, against LVISEval
itself."""

import copy
import json

import numpy as np
import pytest

from owl_cl.eval import detection
from owl_cl.eval import lvis_eval

# Categories: non-contiguous ids, one per frequency group (+ a second common one).
CATEGORIES = [
  {
    "id": 3,
    "name": "applesauce",
    "frequency": "r",
    "synonyms": ["applesauce"],
    "def": "puree of stewed apples",
    "synset": "applesauce.n.01",
    "image_count": 2,
    "instance_count": 2,
  },
  {
    "id": 7,
    "name": "bottle_cap",
    "frequency": "c",
    "synonyms": ["bottle_cap", "cap"],
    "def": "a cap that seals a bottle",
    "synset": "bottle_cap.n.01",
    "image_count": 20,
    "instance_count": 30,
  },
  {
    "id": 12,
    "name": "car_(automobile)",
    "frequency": "f",
    "synonyms": ["car", "auto"],
    "def": "a motor vehicle with four wheels",
    "synset": "car.n.01",
    "image_count": 500,
    "instance_count": 900,
  },
  {
    "id": 20,
    "name": "dog",
    "frequency": "c",
    "synonyms": ["dog"],
    "def": "a domesticated canine",
    "synset": "dog.n.01",
    "image_count": 40,
    "instance_count": 60,
  },
]


def _ann(ann_id, image_id, cat, bbox):
  return {
    "id": ann_id,
    "image_id": image_id,
    "category_id": cat,
    "bbox": bbox,
    "area": bbox[2] * bbox[3],
    "segmentation": [
      [
        bbox[0],
        bbox[1],
        bbox[0] + bbox[2],
        bbox[1],
        bbox[0] + bbox[2],
        bbox[1] + bbox[3],
        bbox[0],
        bbox[1] + bbox[3],
      ]
    ],
  }


def lvis_dataset():
  """3 images (LVIS v1 schema): positives per annotations, negatives per neg_category_ids."""
  images = [
    {
      "id": 101,
      "width": 200,
      "height": 100,
      "coco_url": "http://x/101.jpg",
      "file_name": "101.png",
      "license": 1,
      "flickr_url": "",
      "date_captured": "",
      "neg_category_ids": [7],
      "not_exhaustive_category_ids": [],
    },
    {
      "id": 102,
      "width": 120,
      "height": 160,
      "coco_url": "http://x/102.jpg",
      "file_name": "102.png",
      "license": 1,
      "flickr_url": "",
      "date_captured": "",
      "neg_category_ids": [3, 12],
      "not_exhaustive_category_ids": [20],
    },
    {
      "id": 103,
      "width": 64,
      "height": 64,
      "coco_url": "http://x/103.jpg",
      "file_name": "103.png",
      "license": 1,
      "flickr_url": "",
      "date_captured": "",
      "neg_category_ids": [],
      "not_exhaustive_category_ids": [],
    },
  ]
  annotations = [
    _ann(1, 101, 3, [10.0, 10.0, 50.0, 40.0]),
    _ann(2, 101, 12, [100.0, 20.0, 80.0, 60.0]),
    _ann(3, 101, 20, [5.0, 60.0, 30.0, 30.0]),
    _ann(4, 102, 7, [20.0, 30.0, 40.0, 40.0]),
    _ann(5, 102, 20, [60.0, 80.0, 50.0, 70.0]),
    _ann(6, 103, 12, [0.0, 0.0, 64.0, 32.0]),
  ]
  return {
    "info": {"year": 2020},
    "licenses": [],
    "images": images,
    "annotations": annotations,
    "categories": copy.deepcopy(CATEGORIES),
  }


def _gt_detections(dataset, score=0.9):
  return [
    {
      "image_id": a["image_id"],
      "category_id": a["category_id"],
      "bbox": list(a["bbox"]),
      "score": score,
    }
    for a in dataset["annotations"]
  ]


def _direct_lvis_eval(path, detections, max_dets=300):
  """LVISEval called directly on the json file (the independent reference)."""
  api = lvis_eval._lvis_api()
  gt = api.LVIS(path)
  ev = api.LVISEval(
    gt, api.LVISResults(gt, copy.deepcopy(detections), max_dets=max_dets), iou_type="bbox"
  )
  ev.params.max_dets = max_dets
  ev.run()
  return ev.get_results()


@pytest.fixture
def gt_path(tmp_path):
  path = tmp_path / "lvis_v1_val_tiny.json"
  path.write_text(json.dumps(lvis_dataset()))
  return str(path)


def test_perfect_predictions_give_ap_one(gt_path):
  detections = _gt_detections(lvis_dataset())
  # A detection of a category neither annotated in image 103 nor in its neg_category_ids is
  # dropped by the federated evaluation (it would otherwise be a false positive of 'dog').
  detections.append(
    {"image_id": 103, "category_id": 20, "bbox": [1.0, 1.0, 20.0, 20.0], "score": 0.99}
  )
  # An unmatched 'dog' detection in image 102, where 'dog' is not exhaustively annotated: ignored.
  detections.append(
    {"image_id": 102, "category_id": 20, "bbox": [0.0, 0.0, 10.0, 10.0], "score": 0.99}
  )
  result = lvis_eval.lvis_evaluate(gt_path, detections)
  for key in ("AP", "AP50", "AP75", "APr", "APc", "APf", "AR"):
    assert result[key] == pytest.approx(1.0), key
  assert result["num_detections"] == len(detections)
  # The same predictions with a false positive of 'bottle_cap' in image 101 (a negative
  # category there) lower the common AP only.
  fp = detections + [
    {"image_id": 101, "category_id": 7, "bbox": [0.0, 0.0, 30.0, 30.0], "score": 0.95}
  ]
  lowered = lvis_eval.lvis_evaluate(gt_path, fp, per_category=True)
  assert lowered["APr"] == pytest.approx(1.0) and lowered["APf"] == pytest.approx(1.0)
  assert lowered["APc"] < 1.0
  per_cat = lowered["per_category"]
  assert per_cat[3]["frequency"] == "r" and per_cat[3]["AP"] == pytest.approx(1.0)
  # bottle_cap: one true positive ranked after one false positive: precision 1/2 at recall 1.
  assert per_cat[7]["AP"] == pytest.approx(0.5)
  assert lowered["APc"] == pytest.approx((0.5 + 1.0) / 2)
  assert lowered["AP"] == pytest.approx((1.0 + 0.5 + 1.0 + 1.0) / 4)


def test_perturbed_case_agrees_with_lvis_eval_called_directly(gt_path):
  rng = np.random.default_rng(0)
  dataset = lvis_dataset()
  detections = []
  for a in dataset["annotations"]:
    for _ in range(3):
      x, y, w, h = a["bbox"]
      jitter = rng.normal(scale=0.15, size=4) * [w, h, w, h]
      detections.append(
        {
          "image_id": a["image_id"],
          "category_id": int(rng.choice([a["category_id"]] * 3 + [3, 7, 12, 20])),
          "score": float(rng.uniform()),
          "bbox": [
            float(x + jitter[0]),
            float(y + jitter[1]),
            float(max(w + jitter[2], 1)),
            float(max(h + jitter[3], 1)),
          ],
        }
      )
  ours = lvis_eval.lvis_evaluate(gt_path, detections, max_dets=8)
  direct = _direct_lvis_eval(gt_path, detections, max_dets=8)
  for key in ("AP", "AP50", "AP75", "APs", "APm", "APl", "APr", "APc", "APf"):
    expected = float(direct[key])
    if expected == -1:
      assert np.isnan(ours[key]), key
    else:
      assert ours[key] == pytest.approx(expected, abs=1e-12), key
  assert ours["AR"] == pytest.approx(float(direct["AR@8"]))
  assert 0.0 < ours["AP"] < 1.0
  assert ours["num_detections"] <= 8 * 3
  # The ground-truth dict path gives the same numbers; the dict is not modified.
  dataset_copy = copy.deepcopy(dataset)
  assert lvis_eval.lvis_evaluate(dataset, detections, max_dets=8)["AP"] == ours["AP"]
  assert dataset == dataset_copy


def test_no_detections_and_subsets(gt_path):
  empty = lvis_eval.lvis_evaluate(gt_path, [])
  assert empty["AP"] == 0.0 and empty["APr"] == 0.0 and empty["num_detections"] == 0
  # Only image 103 (one frequent category): APr / APc have no ground truth -> NaN.
  only = lvis_eval.lvis_evaluate(gt_path, _gt_detections(lvis_dataset()), image_ids=[103])
  assert only["APf"] == pytest.approx(1.0)
  assert np.isnan(only["APr"]) and np.isnan(only["APc"])


def test_schema_and_id_errors(tmp_path, gt_path):
  bad = lvis_dataset()
  del bad["images"][1]["neg_category_ids"]
  with pytest.raises(ValueError, match=r"images\[1\].*neg_category_ids"):
    lvis_eval.lvis_evaluate(bad, [])
  bad = lvis_dataset()
  bad["categories"][0]["frequency"] = "x"
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(bad))
  with pytest.raises(ValueError, match="bad.json.*frequency"):
    lvis_eval.load_lvis_ground_truth(str(path))
  with pytest.raises(FileNotFoundError, match="missing.json"):
    lvis_eval.load_lvis_ground_truth(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="image ids"):
    lvis_eval.lvis_evaluate(
      gt_path, [{"image_id": 999, "category_id": 3, "bbox": [0, 0, 1, 1], "score": 1.0}]
    )
  with pytest.raises(ValueError, match="category ids"):
    lvis_eval.lvis_evaluate(
      gt_path, [{"image_id": 101, "category_id": 4, "bbox": [0, 0, 1, 1], "score": 1.0}]
    )


class _Source:
  """Minimal LVIS source: contiguous class index -> LVIS category id, annotation file."""

  def __init__(self, path):
    self.annotation_file = path
    self.category_ids = [c["id"] for c in CATEGORIES]  # [3, 7, 12, 20]
    self.class_names = [c["name"] for c in CATEGORIES]
    self.name = "lvis_tiny"


def _batches_from_ground_truth(dataset, index_of, num_tokens=6, num_classes=4):
  """One batch per image whose scores reproduce the ground truth: token t predicts
  annotation t's box (cxcywh relative to the padded square) with its contiguous class."""
  batches = []
  for image in dataset["images"]:
    anns = [a for a in dataset["annotations"] if a["image_id"] == image["id"]]
    side = max(image["width"], image["height"])
    scores = np.zeros((1, num_tokens, num_classes), np.float32)
    boxes = np.full((1, num_tokens, 4), 0.05, np.float32)
    for t, a in enumerate(anns):
      x, y, w, h = a["bbox"]
      boxes[0, t] = [(x + w / 2) / side, (y + h / 2) / side, w / side, h / side]
      scores[0, t, index_of[a["category_id"]]] = 0.9 - 0.1 * t
    batches.append(
      {
        "image_id": np.array([image["id"], -1], np.int64),
        "orig_size": np.array([[image["height"], image["width"]], [0, 0]], np.int32),
        "example_mask": np.array([True, False]),
        "scores": np.concatenate([scores, scores]),
        "boxes": np.concatenate([boxes, boxes]),
      }
    )
  return batches


def test_evaluate_lvis_source_maps_ids_back_and_scores_top_k(gt_path):
  source = _Source(gt_path)
  index_of = {cat: i for i, cat in enumerate(source.category_ids)}
  batches = _batches_from_ground_truth(lvis_dataset(), index_of)

  def predict_fn(batch):  # multi-label top-K over (token, class) pairs, as for LVIS
    return detection.top_predictions(batch["scores"], batch["boxes"], top_k=300, multi_label=True)

  scoring = detection.Scoring(max_dets=300, return_detections=True)
  result = detection.evaluate_lvis_source(predict_fn, source, batches, scoring, progress=False)
  # K = min(300, T*C) = 24 pairs per image, 3 valid images; zero-score pairs count as
  # detections too (they never outrank a true positive here).
  assert result["num_images"] == 3 and len(result["detections"]) == 3 * 24
  assert {d["category_id"] for d in result["detections"]} == {3, 7, 12, 20}
  top = max((d for d in result["detections"] if d["image_id"] == 101), key=lambda d: d["score"])
  assert top["category_id"] == 3
  np.testing.assert_allclose(top["bbox"], [10.0, 10.0, 50.0, 40.0], atol=1e-4)
  for key in ("AP", "APr", "APc", "APf"):
    assert result[key] == pytest.approx(1.0), key
  # Agrees with LVISEval run directly on the same detections.
  direct = _direct_lvis_eval(gt_path, result["detections"])
  assert result["AP"] == pytest.approx(float(direct["AP"]))
  # A wrong id mapping (shifted by one) is caught by the metrics.
  wrong = detection.evaluate_lvis_source(
    predict_fn, source, batches, progress=False, category_ids=[7, 12, 20, 3]
  )
  assert wrong["AP"] < 0.5
  # No valid example: NaN metrics.
  none = detection.evaluate_lvis_source(predict_fn, source, [], progress=False)
  assert none["num_images"] == 0 and np.isnan(none["AP"])

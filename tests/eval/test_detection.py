"""Tests of owl_cl.eval.detection: values checked against NumPy references and pycocotools."""

import contextlib
import copy
import io
import math
import types

import jax
import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
import pytest

from owl_cl.eval import coco_eval
from owl_cl.eval import detection

# Three images with different aspect ratios: (image id, height, width).
IMAGES = [(101, 480, 640), (205, 500, 300), (309, 400, 400)]
CATEGORY_IDS = [3, 7, 11]  # Contiguous index 0, 1, 2 -> non-contiguous COCO ids.
# Ground truth, xywh pixels, (image id, contiguous label, box).
GT = [
  (101, 0, [10.0, 20.0, 200.0, 150.0]),
  (101, 2, [300.0, 100.0, 250.0, 300.0]),
  (101, 1, [500.0, 400.0, 100.0, 60.0]),
  (205, 0, [5.0, 10.0, 100.0, 300.0]),
  (205, 1, [150.0, 200.0, 140.0, 250.0]),
  (309, 2, [50.0, 50.0, 300.0, 300.0]),
  (309, 0, [0.0, 0.0, 40.0, 60.0]),
]


def make_coco(images=IMAGES, gt=GT, category_ids=CATEGORY_IDS):
  dataset = {
    "images": [{"id": i, "height": h, "width": w, "file_name": f"{i}.jpg"} for i, h, w in images],
    "categories": [{"id": c, "name": f"class{c}"} for c in category_ids],
    "annotations": [],
  }
  for n, (img, label, (x, y, w, h)) in enumerate(gt):
    dataset["annotations"].append(
      {
        "id": n + 1,
        "image_id": img,
        "category_id": category_ids[label],
        "bbox": [x, y, w, h],
        "area": w * h,
        "iscrowd": 0,
      }
    )
  with contextlib.redirect_stdout(io.StringIO()):
    coco = COCO()
    coco.dataset = dataset
    coco.createIndex()
  return coco


def gt_to_predictions(gt, images, top_k, rng=None):
  """Ground truth -> (scores [B,K], labels [B,K], boxes [B,K,4] cxcywh rel. padded square)."""
  batch = len(images)
  scores = np.zeros((batch, top_k), np.float32)
  labels = np.zeros((batch, top_k), np.int32)
  boxes = np.zeros((batch, top_k, 4), np.float32)
  for b, (img, h, w) in enumerate(images):
    side = max(h, w)
    k = 0
    for img_id, label, (x, y, bw, bh) in gt:
      if img_id != img:
        continue
      boxes[b, k] = [(x + bw / 2) / side, (y + bh / 2) / side, bw / side, bh / side]
      labels[b, k] = label
      scores[b, k] = 0.9 - 0.1 * k
      k += 1
  return scores, labels, boxes


def image_arrays(images):
  return (
    np.array([i for i, _, _ in images], np.int64),
    np.array([[h, w] for _, h, w in images], np.int32),
  )


def run_cocoeval_directly(coco_gt, detections, max_dets=100):
  """Independent computation: pycocotools' own loadRes + COCOeval + summarize.

  pycocotools' summarize hard-codes maxDets=100 for stats[0], so for max_dets != 100 the
  statistics come from default params (identical while every image has <= 100 detections),
  and AP@[.5:.95] at max_dets is also read from the raw precision array.
  """
  import copy

  with contextlib.redirect_stdout(io.StringIO()):
    coco_dt = coco_gt.loadRes(copy.deepcopy(detections))
    ev = COCOeval(coco_gt, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    stats = ev.stats
    if max_dets != 100:
      ev = COCOeval(coco_gt, coco_gt.loadRes(copy.deepcopy(detections)), "bbox")
      ev.params.maxDets = [1, 10, max_dets]
      ev.evaluate()
      ev.accumulate()
      precision = ev.eval["precision"][:, :, :, 0, -1]
      assert np.mean(precision[precision > -1]) == pytest.approx(stats[0], abs=1e-12)
  return stats


# ---------------------------------------------------------------- scores / ensembling


def test_class_scores_is_sigmoid_float32():
  logits = np.array([[[0.0, 2.0, -1e6]]], np.float32)
  s = detection.class_scores(jax.numpy.asarray(logits, jax.numpy.bfloat16))
  assert s.dtype == np.float32
  np.testing.assert_allclose(np.asarray(s), [[[0.5, 1 / (1 + math.exp(-2.0)), 0.0]]], rtol=1e-2)


def test_ensemble_templates_logits_vs_probs():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 3, 7)).astype(np.float32)
  sig = lambda x: 1 / (1 + np.exp(-x))
  np.testing.assert_allclose(detection.ensemble_templates(logits), sig(logits.mean(-1)), rtol=1e-5)
  np.testing.assert_allclose(
    detection.ensemble_templates(logits, average="probs"), sig(logits).mean(-1), rtol=1e-5
  )
  moved = np.moveaxis(logits, -1, 1)  # [B, P, T, C]
  np.testing.assert_allclose(
    detection.ensemble_templates(moved, template_axis=1), sig(logits.mean(-1)), rtol=1e-5
  )
  mask = np.array([1, 1, 0, 0, 0, 0, 1], bool)
  np.testing.assert_allclose(
    detection.ensemble_templates(logits, template_mask=mask),
    sig(logits[..., mask].mean(-1)),
    rtol=1e-5,
  )
  with pytest.raises(ValueError):
    detection.ensemble_templates(logits, average="max")
  with pytest.raises(ValueError):
    detection.ensemble_templates(logits, template_mask=np.zeros(7, bool))


# ---------------------------------------------------------------- top predictions


def numpy_top_predictions(scores, boxes, top_k, multi_label):
  batch, tokens, classes = scores.shape
  out_s, out_l, out_b = [], [], []
  for b in range(batch):
    if multi_label:
      flat = scores[b].reshape(-1)
      order = np.argsort(-flat, kind="stable")[: min(top_k, flat.size)]
      tok, lab = order // classes, order % classes
      out_s.append(flat[order])
    else:
      lab_all = scores[b].argmax(-1)
      best = scores[b].max(-1)
      tok = np.argsort(-best, kind="stable")[: min(top_k, tokens)]
      lab = lab_all[tok]
      out_s.append(best[tok])
    out_l.append(lab)
    out_b.append(boxes[b, tok])
  return np.stack(out_s), np.stack(out_l), np.stack(out_b)


@pytest.mark.parametrize("multi_label", [True, False])
@pytest.mark.parametrize("top_k", [5, 40])
def test_top_predictions_matches_numpy(multi_label, top_k):
  rng = np.random.default_rng(1)
  scores = rng.uniform(size=(3, 16, 4)).astype(np.float32)
  boxes = rng.uniform(size=(3, 16, 4)).astype(np.float32)
  got = detection.top_predictions(scores, boxes, top_k=top_k, multi_label=multi_label)
  want = numpy_top_predictions(scores, boxes, top_k, multi_label)
  expected_k = min(top_k, 16 * 4 if multi_label else 16)
  assert got[0].shape == (3, expected_k) and got[2].shape == (3, expected_k, 4)
  assert got[1].dtype == np.int32
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=0)


def test_top_predictions_multi_label_yields_several_classes_per_token():
  scores = np.array([[[0.9, 0.8], [0.1, 0.2]]], np.float32)
  boxes = np.array([[[0.1, 0.1, 0.1, 0.1], [0.5, 0.5, 0.2, 0.2]]], np.float32)
  s, l, b = detection.top_predictions(scores, boxes, top_k=2, multi_label=True)
  np.testing.assert_allclose(s, [[0.9, 0.8]])
  np.testing.assert_array_equal(l, [[0, 1]])
  np.testing.assert_allclose(b[0, 0], b[0, 1])
  s, l, b = detection.top_predictions(scores, boxes, top_k=2, multi_label=False)
  np.testing.assert_allclose(s, [[0.9, 0.2]])
  np.testing.assert_array_equal(l, [[0, 1]])


def test_top_predictions_class_mask():
  scores = np.array([[[0.9, 0.3], [0.8, 0.1]]], np.float32)
  boxes = np.zeros((1, 2, 4), np.float32)
  s, l, _ = detection.top_predictions(
    scores, boxes, top_k=2, multi_label=False, class_mask=np.array([False, True])
  )
  np.testing.assert_allclose(s, [[0.3, 0.1]])
  np.testing.assert_array_equal(l, [[1, 1]])
  s, l, _ = detection.top_predictions(
    scores, boxes, top_k=4, multi_label=True, class_mask=np.array([False, True])
  )
  assert np.isinf(np.asarray(s)[0, 2:]).all()
  dets = detection.to_coco_detections(
    s, l, np.zeros((1, 4, 4)), image_ids=[1], orig_sizes=[[10, 10]], category_ids=[5, 6]
  )
  assert len(dets) == 2 and {d["category_id"] for d in dets} == {6}


# ---------------------------------------------------------------- geometry


def test_unpad_geometry_hand_checked():
  # Landscape 480x640 (h, w): the square of side S <-> 640 px. Box centred at (0.5, 0.25)
  # of the square, size (0.25, 0.125): pixels centre (320, 160), size (160, 80).
  xyxy = detection.unpad_boxes(np.array([0.5, 0.25, 0.25, 0.125]), np.array([480, 640]))
  np.testing.assert_allclose(xyxy, [240, 120, 400, 200])
  # Portrait 500x300: square <-> 500 px. A box reaching into the padding (x > 300) is clipped.
  xyxy = detection.unpad_boxes(np.array([0.6, 0.5, 0.2, 0.2]), np.array([500, 300]))
  np.testing.assert_allclose(xyxy, [250, 200, 300, 300])
  # Box over the bottom padding of a landscape image: y clipped to h = 480.
  xyxy = detection.unpad_boxes(np.array([0.5, 0.9, 0.2, 0.2]), np.array([480, 640]))
  np.testing.assert_allclose(xyxy, [256, 480, 384, 480])
  # Exact per-axis variant: 480x640 at S=768 -> resized 576x768; y scale = 768*480/576 = 640.
  xyxy = detection.unpad_boxes(
    np.array([0.5, 0.25, 0.25, 0.125]), np.array([480, 640]), image_size=768, rounded_content=True
  )
  np.testing.assert_allclose(xyxy, [240, 120, 400, 200])
  # image_size alone does not change the (pipeline-exact) default.
  xyxy = detection.unpad_boxes(np.array([0.5, 0.5, 0.2, 0.2]), np.array([333, 500]), image_size=100)
  np.testing.assert_allclose(xyxy, [200, 200, 300, 300])
  with pytest.raises(ValueError):
    detection.unpad_boxes(np.zeros(4), np.array([1, 1]), rounded_content=True)
  # 333x500 at S=100: resized h = round(66.6) = 67 -> y scale 100*333/67 = 497.01..
  xyxy = detection.unpad_boxes(
    np.array([0.5, 0.5, 0.2, 0.2]), np.array([333, 500]), image_size=100, rounded_content=True
  )
  sy = 100 * 333 / 67
  np.testing.assert_allclose(xyxy, [200, 0.4 * sy, 300, min(0.6 * sy, 333)])


def test_to_coco_detections_mapping_and_padding():
  scores = np.array([[0.9, 0.5], [0.7, 0.6], [0.3, 0.2]], np.float32)
  labels = np.array([[0, 2], [1, 0], [2, 2]], np.int32)
  boxes = np.tile(np.array([0.5, 0.5, 0.5, 0.5], np.float32), (3, 2, 1))
  dets = detection.to_coco_detections(
    scores,
    labels,
    boxes,
    image_ids=np.array([1, 2, -1]),
    orig_sizes=np.array([[100, 200], [100, 100], [10, 10]]),
    category_ids=[3, 7, 11],
    example_mask=np.array([True, False, False]),
  )
  assert [d["category_id"] for d in dets] == [3, 11]  # class 0 kept, mapped to id 3
  assert all(d["image_id"] == 1 for d in dets)
  np.testing.assert_allclose(dets[0]["bbox"], [50, 50, 100, 50])  # y clipped to h=100
  assert dets[0]["score"] == pytest.approx(0.9)
  with pytest.raises(ValueError):
    detection.to_coco_detections(
      scores,
      labels + 1,
      boxes,
      image_ids=[1, 2, 3],
      orig_sizes=np.ones((3, 2)) * 10,
      category_ids=[3, 7, 11],
    )


# ---------------------------------------------------------------- COCO AP


def test_perfect_predictions_full_path_ap_one():
  coco = make_coco()
  scores, labels, boxes = gt_to_predictions(GT, IMAGES, top_k=5)
  image_ids, sizes = image_arrays(IMAGES)
  dets = detection.to_coco_detections(
    scores, labels, boxes, image_ids=image_ids, orig_sizes=sizes, category_ids=CATEGORY_IDS
  )
  # Only real predictions have score > 0; zero-score fillers are harmless extra boxes.
  dets = [d for d in dets if d["score"] > 0]
  assert len(dets) == len(GT)
  assert {d["category_id"] for d in dets} == {3, 7, 11}
  metrics = coco_eval.coco_evaluate(coco, dets)
  assert metrics["AP"] == pytest.approx(1.0)
  assert metrics["AP50"] == pytest.approx(1.0)
  assert metrics["AP75"] == pytest.approx(1.0)
  assert metrics["AR"] == pytest.approx(1.0)
  assert math.isnan(metrics["APs"])  # no small objects -> pycocotools -1 -> NaN
  assert metrics["num_detections"] == len(GT)
  # Unfiltered (zero-score filler boxes at the end of the ranking): still AP 1.
  all_dets = detection.to_coco_detections(
    scores, labels, boxes, image_ids=image_ids, orig_sizes=sizes, category_ids=CATEGORY_IDS
  )
  assert len(all_dets) == 3 * 5
  assert coco_eval.coco_evaluate(coco, all_dets)["AP"] == pytest.approx(1.0)


def perturbed_detections():
  """Shifted boxes, a false positive, a missing detection (image 309 label 0)."""
  scores, labels, boxes = gt_to_predictions(GT, IMAGES, top_k=5)
  image_ids, sizes = image_arrays(IMAGES)
  dets = detection.to_coco_detections(
    scores, labels, boxes, image_ids=image_ids, orig_sizes=sizes, category_ids=CATEGORY_IDS
  )
  dets = [d for d in dets if d["score"] > 0]
  out = []
  for n, d in enumerate(dets):
    if d["image_id"] == 309 and d["category_id"] == 3:
      continue  # missing detection
    x, y, w, h = d["bbox"]
    shift = [0.0, 0.05, 0.15, 0.3, 0.5][n % 5] * w
    out.append(dict(d, bbox=[x + shift, y, w, h]))
  out.append(
    {"image_id": 205, "category_id": 7, "bbox": [0.0, 0.0, 50.0, 50.0], "score": 0.95}
  )  # confident false positive
  out.append(
    {"image_id": 101, "category_id": 11, "bbox": [20.0, 30.0, 180.0, 130.0], "score": 0.3}
  )  # wrong class on an object of class 3
  return out


@pytest.mark.parametrize("max_dets", [100, 300])
def test_perturbed_agrees_with_cocoeval(max_dets):
  coco = make_coco()
  dets = perturbed_detections()
  snapshot = copy.deepcopy(dets)
  metrics = coco_eval.coco_evaluate(coco, dets, max_dets=max_dets)
  assert dets == snapshot  # input not mutated, nor the box lists inside it
  stats = run_cocoeval_directly(coco, dets, max_dets=max_dets)
  for name, value in zip(coco_eval.COCO_METRIC_NAMES, stats):
    if value == -1:
      assert math.isnan(metrics[name]), name
    else:
      assert metrics[name] == pytest.approx(value, abs=1e-12), name
  assert 0.0 < metrics["AP"] < 1.0


def test_max_dets_is_per_image():
  coco = make_coco()
  dets = perturbed_detections()
  m1 = coco_eval.coco_evaluate(coco, dets, max_dets=1)
  # Independent: keep the best detection of each image, then pycocotools' default maxDets.
  best = {}
  for d in dets:
    if d["image_id"] not in best or d["score"] > best[d["image_id"]]["score"]:
      best[d["image_id"]] = d
  stats = run_cocoeval_directly(coco, list(best.values()), max_dets=100)
  assert m1["AP"] == pytest.approx(stats[0], abs=1e-12)
  assert m1["AR"] == pytest.approx(stats[8], abs=1e-12)
  assert m1["num_detections"] == len(IMAGES)
  assert m1["AP"] < coco_eval.coco_evaluate(coco, dets, max_dets=100)["AP"]


def test_empty_detections_give_zero_ap():
  coco = make_coco()
  metrics = coco_eval.coco_evaluate(coco, [])
  assert metrics["AP"] == 0.0 and metrics["AP50"] == 0.0 and metrics["AR"] == 0.0
  assert math.isnan(metrics["APs"])
  assert metrics["num_detections"] == 0


def test_subset_of_images_and_categories_and_per_category():
  coco = make_coco()
  dets = perturbed_detections()
  metrics = coco_eval.coco_evaluate(coco, dets, image_ids=[101], cat_ids=[3, 11], per_category=True)
  with contextlib.redirect_stdout(io.StringIO()):
    ev = COCOeval(coco, coco.loadRes([dict(d) for d in dets]), "bbox")
    ev.params.imgIds = [101]
    ev.params.catIds = [3, 11]
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
  assert metrics["AP"] == pytest.approx(ev.stats[0])
  per_cat = metrics["per_category"]
  assert set(per_cat) == {3, 11}
  assert np.mean([per_cat[3]["AP"], per_cat[11]["AP"]]) == pytest.approx(metrics["AP"])


def test_unknown_image_id_raises():
  with pytest.raises(ValueError):
    coco_eval.coco_evaluate(
      make_coco(), [{"image_id": 999, "category_id": 3, "bbox": [0, 0, 1, 1], "score": 1.0}]
    )


def test_coco_evaluate_prints_nothing(capsys):
  coco_eval.coco_evaluate(make_coco(), perturbed_detections())
  assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- driver


def make_batches(images, gt, batch_size, top_k):
  """Fake batches (padding example in the last one) + fake predictions keyed by image id."""
  scores, labels, boxes = gt_to_predictions(gt, images, top_k)
  preds = {img: (scores[b], labels[b], boxes[b]) for b, (img, _, _) in enumerate(images)}
  batches = []
  for start in range(0, len(images), batch_size):
    chunk = images[start : start + batch_size]
    pad = batch_size - len(chunk)
    ids = [i for i, _, _ in chunk] + [-1] * pad
    sizes = [[h, w] for _, h, w in chunk] + [[1, 1]] * pad
    batches.append(
      {
        "image_id": np.array(ids, np.int64),
        "orig_size": np.array(sizes, np.int32),
        "example_mask": np.array([True] * len(chunk) + [False] * pad),
      }
    )
  return batches, preds


def test_evaluate_source_with_fake_predict_fn():
  coco = make_coco()
  batches, preds = make_batches(IMAGES, GT, batch_size=2, top_k=4)
  calls = []

  def predict_fn(batch):
    calls.append(batch["image_id"].tolist())
    out = [
      preds.get(int(i), (np.zeros(4), np.zeros(4, np.int32), np.zeros((4, 4))))
      for i in batch["image_id"]
    ]
    # The padding example predicts garbage with high scores: must be ignored.
    s = np.stack([o[0] for o in out]).astype(np.float32)
    s[batch["image_id"] < 0] = 1.0
    return (
      jax.numpy.asarray(s),
      jax.numpy.asarray(np.stack([o[1] for o in out])),
      jax.numpy.asarray(np.stack([o[2] for o in out]).astype(np.float32)),
    )

  source = types.SimpleNamespace(coco=coco, category_ids=CATEGORY_IDS, name="fake")
  scoring = detection.Scoring(return_detections=True)
  result = detection.evaluate_source(
    predict_fn, source, batches, scoring, progress=False, desc="eval fake @ stage 0"
  )
  assert len(calls) == 2
  assert result["AP"] == pytest.approx(1.0)
  assert result["num_images"] == 3
  assert all(d["image_id"] in (101, 205, 309) for d in result["detections"])

  # Only the first batch: scored on the images seen (all perfect) -> AP 1.
  partial = detection.evaluate_source(predict_fn, source, batches[:1], progress=False)
  assert partial["num_images"] == 2 and partial["AP"] == pytest.approx(1.0)
  # Same, scored on every image of the set: the unseen image's objects are misses.
  everything = detection.Scoring(restrict_to_seen_images=False)
  full = detection.evaluate_source(predict_fn, source, batches[:1], everything, progress=False)
  assert full["AP"] < 1.0
  empty = detection.evaluate_source(predict_fn, source, [], progress=False)
  assert empty["num_images"] == 0 and math.isnan(empty["AP"])


def test_make_predict_fn_end_to_end():
  """A fake model (logits from the GT) through make_predict_fn -> evaluate_source."""
  coco = make_coco()
  tokens, top_k = 6, 6
  images = IMAGES
  batch_size = 2
  batches, _ = make_batches(images, GT, batch_size, top_k=tokens)
  # Per image: token t predicts GT object t with a high logit for its class.
  _, labels, boxes = gt_to_predictions(GT, images, top_k=tokens)
  n_obj = {img: sum(1 for g in GT if g[0] == img) for img, _, _ in images}
  logits = np.full((len(images), tokens, 3, 7), -8.0, np.float32)
  for b, (img, _, _) in enumerate(images):
    for t in range(n_obj[img]):
      logits[b, t, labels[b, t], :] = 3.0 - 0.1 * t
  table = {img: b for b, (img, _, _) in enumerate(images)}
  for batch in batches:
    idx = [table.get(int(i), 0) for i in batch["image_id"]]
    batch["logits"], batch["boxes_pred"] = logits[idx], boxes[idx]

  def outputs_fn(logits, boxes_pred):
    return {"pred_logits": logits, "pred_boxes": boxes_pred}

  for multi_label in (True, False):
    predict_fn = detection.make_predict_fn(
      outputs_fn, top_k=top_k, multi_label=multi_label, batch_keys=("logits", "boxes_pred")
    )
    source = types.SimpleNamespace(coco=coco, category_ids=CATEGORY_IDS, name="fake")
    result = detection.evaluate_source(predict_fn, source, batches, progress=False)
    assert result["AP"] == pytest.approx(1.0), multi_label


def test_unpad_inverts_the_data_pipeline_box_scaling():
  """Boxes as `owl_cl.data.input_pipeline` builds targets -> unpad_boxes gives the pixels back."""
  image_ops = pytest.importorskip("owl_cl.data.image_ops")
  size = 96
  for h, w in [(480, 640), (500, 300), (333, 500), (400, 400)]:
    xyxy = np.array([[10.0, 20.0, 200.0, 150.0], [0.0, 0.0, w, h]], np.float32)
    rel = image_ops.xyxy_to_cxcywh(image_ops.scale_boxes(xyxy, h, w, size)) / size
    back = detection.unpad_boxes(rel, np.array([h, w]), image_size=size)
    np.testing.assert_allclose(back, xyxy, atol=1e-3)

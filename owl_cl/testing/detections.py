"""Synthetic ground truth and detections for tests of the scorers (COCO and LVIS v1 layouts).

Each image holds a few ground-truth boxes of every COCO area range (sides 4 to 300 px:
small < 32^2, medium, large > 96^2); its detections are jittered copies of them (some of a
wrong class) followed by random boxes, with uniform scores, so that AP is neither 0 nor 1 and
matches change between IoU thresholds.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _truth(rng: np.random.Generator, n: int) -> np.ndarray:
  """[n, 4] ground-truth boxes, xywh px, sides 4 to 300."""
  return np.concatenate([rng.uniform(0, 300, (n, 2)), rng.uniform(4, 300, (n, 2))], 1)


def _jittered(rng: np.random.Generator, boxes: np.ndarray) -> np.ndarray:
  """[n, 4] copies of `boxes` moved by 5% of their size (normal)."""
  return np.abs(boxes + rng.normal(0, 0.05, boxes.shape) * boxes[:, 2:].repeat(2, 1))


def _random(rng: np.random.Generator, count: int) -> np.ndarray:
  """[count, 4] random boxes, sides 4 to 200."""
  return np.concatenate([rng.uniform(0, 400, (count, 2)), rng.uniform(4, 200, (count, 2))], 1)


def _append_detections(detections: list, image_id: int, boxes, cats, scores) -> None:
  for box, c, s in zip(boxes, cats, scores):
    detections.append(
      {"image_id": image_id, "category_id": int(c), "bbox": box.tolist(), "score": float(s)}
    )


def _scores(rng: np.random.Generator, count: int, tie_rate: float) -> np.ndarray:
  """Uniform scores; a `tie_rate` share rounded to 0.1, so that equal scores occur (no draw
  for the rounding when `tie_rate` is 0)."""
  scores = rng.uniform(size=count)
  if tie_rate:
    scores = np.where(rng.uniform(size=count) < tie_rate, np.round(scores, 1), scores)
  return scores


def _annotation(gt: dict, image_id: int, category: int, box: np.ndarray, **extra) -> None:
  gt["annotations"].append(
    {
      "id": len(gt["annotations"]) + 1,
      "image_id": image_id,
      "category_id": int(category),
      "bbox": box.tolist(),
      "area": float(box[2] * box[3]),
      **extra,
    }
  )


def coco_set(
  seed: int,
  images: int = 40,
  classes: int = 7,
  dets: int = 30,
  *,
  id_step: int = 1,
  tie_rate: float = 0.0,
  max_boxes: int = 12,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """A COCO ground-truth dict and its detections.

  Args:
    seed: the NumPy generator's seed (the same seed, the same set).
    images: images, ids 1..images, 640 x 480.
    classes: categories, ids id_step, 2 id_step, ... (non-contiguous when id_step > 1).
    dets: detections per image (> max_boxes).
    id_step: the spacing of the category ids.
    tie_rate: the share of scores rounded to 0.1 (ties).
    max_boxes: ground-truth boxes per image are 1..max_boxes; one in ten a crowd.

  Returns:
    ({'images', 'annotations', 'categories'}, [{'image_id', 'category_id', 'bbox', 'score'}]).
  """
  rng = np.random.default_rng(seed)
  ids = np.arange(1, classes + 1) * id_step
  gt: dict[str, Any] = {
    "images": [],
    "annotations": [],
    "categories": [{"id": int(c)} for c in ids],
  }
  detections = []
  for i in range(1, images + 1):
    gt["images"].append({"id": i, "width": 640, "height": 480})
    n = int(rng.integers(1, max_boxes + 1))
    boxes = _truth(rng, n)
    cats = ids[rng.integers(0, classes, n)]
    for box, c in zip(boxes, cats):
      _annotation(gt, i, c, box, iscrowd=int(rng.uniform() < 0.1))
    jitter, extra = _jittered(rng, boxes), _random(rng, dets - n)
    wrong = np.where(rng.uniform(size=n) < 0.2, ids[rng.integers(0, classes, n)], cats)
    all_cats = np.concatenate([wrong, ids[rng.integers(0, classes, dets - n)]])
    scores = _scores(rng, dets, tie_rate)
    _append_detections(detections, i, np.concatenate([jitter, extra]), all_cats, scores)
  return gt, detections


def lvis_set(
  seed: int, images: int = 30, classes: int = 12, dets: int = 40, *, tie_rate: float = 0.2
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """An LVIS v1 ground-truth dict and its detections: category ids 1, 4, 7, ... with
  frequencies r / c / f in turn; each image 1-8 boxes, up to 4 negative categories (absent
  from it) and, one in three, its first box's category not exhaustively annotated; the
  detections of any category, so that the federated rules drop some.

  Returns:
    (LVIS ground-truth dict, [{'image_id', 'category_id', 'bbox', 'score'}]).
  """
  rng = np.random.default_rng(seed)
  ids = np.arange(classes) * 3 + 1
  gt: dict[str, Any] = {
    "images": [],
    "annotations": [],
    "categories": [
      {"id": int(c), "name": f"c{c}", "frequency": "rcf"[j % 3]} for j, c in enumerate(ids)
    ],
  }
  detections = []
  for i in range(1, images + 1):
    n = int(rng.integers(1, 9))
    cats = ids[rng.integers(0, classes, n)]
    others = sorted(set(ids.tolist()) - set(cats.tolist()))
    negative = rng.choice(others, min(4, len(others)), replace=False).tolist()
    gt["images"].append(
      {
        "id": i,
        "width": 640,
        "height": 480,
        "neg_category_ids": sorted(int(c) for c in negative),
        "not_exhaustive_category_ids": [int(cats[0])] if rng.uniform() < 0.3 else [],
      }
    )
    boxes = _truth(rng, n)
    for box, c in zip(boxes, cats):
      _annotation(gt, i, c, box)
    jitter, extra = _jittered(rng, boxes), _random(rng, dets - n)
    all_cats = np.concatenate([cats, ids[rng.integers(0, classes, dets - n)]])
    scores = _scores(rng, dets, tie_rate)
    _append_detections(detections, i, np.concatenate([jitter, extra]), all_cats, scores)
  return gt, detections


def as_coco(gt: dict[str, Any]):
  """A pycocotools `COCO` indexing the ground-truth dict `gt` (not copied)."""
  from pycocotools.coco import COCO  # noqa: PLC0415 (only the COCO tests need it)

  coco = COCO()
  coco.dataset = gt
  coco.createIndex()
  return coco

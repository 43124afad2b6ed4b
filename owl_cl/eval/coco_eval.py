"""COCO box AP with pycocotools (docs/reference.md §4): `coco_evaluate` runs `COCOeval`
(bbox) with a configurable number of detections per image, and returns AP@[.5:.95], AP50,
AP75, APs/m/l and AR as floats in [0, 1], NaN where pycocotools reports -1 ("no ground truth
for this setting"). The detections come from `owl_cl.eval.detection.to_coco_detections`;
LVIS's federated AP is `owl_cl.eval.lvis_eval`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import contextlib
import copy
import io
import logging
import types
from typing import Any

import numpy as np

from owl_cl.eval import category_shards

logger = logging.getLogger(__name__)

# Names of the 12 COCOeval bbox summary statistics, in pycocotools' `stats` order. 'AR1' and
# 'AR10' are AR at 1 and 10 detections per image; 'AR', 'ARs', 'ARm', 'ARl' use `max_dets`.
COCO_METRIC_NAMES = (
  "AP",
  "AP50",
  "AP75",
  "APs",
  "APm",
  "APl",
  "AR1",
  "AR10",
  "AR",
  "ARs",
  "ARm",
  "ARl",
)


def _summarize(
  coco_eval,
  ap: bool,
  iou_thr: float | None = None,
  area: str = "all",
  max_dets: int = 100,
  category_index: int | None = None,
) -> float:
  """Replica of `COCOeval.summarize._summarize` (no printing); -1 when no data."""
  p = coco_eval.params
  a_ind = [i for i, lbl in enumerate(p.areaRngLbl) if lbl == area]
  m_ind = [i for i, m in enumerate(p.maxDets) if m == max_dets]
  if ap:
    s = coco_eval.eval["precision"]  # [T, R, K, A, M]
    if iou_thr is not None:
      s = s[np.where(np.isclose(iou_thr, p.iouThrs))[0]]
    s = s[:, :, :, a_ind, m_ind]
    if category_index is not None:
      s = s[:, :, category_index]
  else:
    s = coco_eval.eval["recall"]  # [T, K, A, M]
    if iou_thr is not None:
      s = s[np.where(np.isclose(iou_thr, p.iouThrs))[0]]
    s = s[:, :, a_ind, m_ind]
    if category_index is not None:
      s = s[:, category_index]
  valid = s[s > -1]
  return float(np.mean(valid)) if valid.size else -1.0


def _no_data_to_nan(value: float) -> float:
  return float("nan") if value == -1.0 else float(value)


#: The COCOeval implementations `coco_evaluate` may run: pycocotools' (the reference) and
#: faster-coco-eval's C++ `COCOeval_faster` (the `fast_coco` extra), whose 12 statistics equal
#: pycocotools' on generated data (tests/eval/test_coco_backends.py), 10x faster at 2,000
#: images x 100 detections of 365 classes (docs/benchmarks.md).
COCO_BACKENDS = ("pycocotools", "faster_coco_eval")


def _backend(backend: str):
  """(COCO class, COCOeval class) of a `COCO_BACKENDS` name; ValueError for another."""
  if backend == "pycocotools":
    from pycocotools.coco import COCO  # pylint: disable=g-import-not-at-top
    from pycocotools.cocoeval import COCOeval  # pylint: disable=g-import-not-at-top

    return COCO, COCOeval
  if backend == "faster_coco_eval":
    from faster_coco_eval import COCO  # pylint: disable=g-import-not-at-top
    from faster_coco_eval import COCOeval_faster  # pylint: disable=g-import-not-at-top

    return COCO, COCOeval_faster
  raise ValueError(f"backend={backend!r} is unknown; known: {list(COCO_BACKENDS)}")


def _result_coco(coco_gt, detections: list[dict[str, Any]], coco_class=None):
  """COCO result object; pycocotools' `loadRes` crashes on an empty list, handle it here."""
  COCO = coco_class or _backend("pycocotools")[0]  # noqa: N806

  if detections:
    # loadRes sets keys of each detection dict ('area', 'id', 'iscrowd', 'segmentation') and
    # changes nothing below them: a copy of each dict keeps the caller's detections as they
    # were (a deep copy of every box list was most of this function's time).
    return coco_gt.loadRes([dict(d) for d in detections])
  res = COCO()
  res.dataset["images"] = list(coco_gt.dataset.get("images", []))
  res.dataset["categories"] = copy.deepcopy(coco_gt.dataset.get("categories", []))
  res.dataset["annotations"] = []
  res.createIndex()
  return res


def _truncate_per_image(
  detections: list[Mapping[str, Any]], max_dets: int
) -> list[Mapping[str, Any]]:
  """The `max_dets` highest-scoring detections of each image (stable for ties)."""
  by_image: dict[int, list[Mapping[str, Any]]] = {}
  for d in detections:
    by_image.setdefault(int(d["image_id"]), []).append(d)
  if all(len(v) <= max_dets for v in by_image.values()):
    return detections
  out = []
  for dets in by_image.values():
    out.extend(sorted(dets, key=lambda d: -float(d["score"]))[:max_dets])
  return out


def _statistics(coco_eval, m: int) -> list[float]:
  """The 12 statistics of `COCOeval.summarize` in `COCO_METRIC_NAMES` order (-1: no data),
  with AP and AR at `m` detections per image."""
  return [
    _summarize(coco_eval, True, max_dets=m),
    _summarize(coco_eval, True, iou_thr=0.5, max_dets=m),
    _summarize(coco_eval, True, iou_thr=0.75, max_dets=m),
    _summarize(coco_eval, True, area="small", max_dets=m),
    _summarize(coco_eval, True, area="medium", max_dets=m),
    _summarize(coco_eval, True, area="large", max_dets=m),
    _summarize(coco_eval, False, max_dets=1),
    _summarize(coco_eval, False, max_dets=10),
    _summarize(coco_eval, False, max_dets=m),
    _summarize(coco_eval, False, area="small", max_dets=m),
    _summarize(coco_eval, False, area="medium", max_dets=m),
    _summarize(coco_eval, False, area="large", max_dets=m),
  ]


def _accumulated(coco_gt, detections, image_ids, cat_ids, max_dets: int, backend: str, classes):
  """COCOeval (bbox) of `backend` (`classes`: its `_backend`) after `evaluate` and
  `accumulate` on these images and categories (None: all of `coco_gt`'s), maxDets
  [1, 10, max_dets]."""
  coco_class, COCOeval = classes  # noqa: N806
  log = io.StringIO()
  with contextlib.redirect_stdout(log):
    ground = coco_gt
    if not isinstance(coco_gt, coco_class):
      # The same ground-truth dict indexed by the backend's own COCO class.
      ground = coco_class()
      ground.dataset = coco_gt.dataset
      ground.createIndex()
    coco_dt = _result_coco(ground, detections, coco_class)
    coco_eval = COCOeval(ground, coco_dt, iouType="bbox")
    if image_ids is not None:
      coco_eval.params.imgIds = list(image_ids)
    if cat_ids is not None:
      coco_eval.params.catIds = list(cat_ids)
    coco_eval.params.maxDets = sorted({1, 10, int(max_dets)})
    coco_eval.evaluate()
    coco_eval.accumulate()
  logger.debug("pycocotools: %s", log.getvalue())
  return coco_eval


def _score_shard(payload: tuple) -> dict[str, Any]:
  """One category shard (a `category_shards.run` worker): `_accumulated` on the shard's ground
  truth dict; returns its [T, R, K_j, A, M] precision, [T, K_j, A, M] recall and the params
  `_summarize` reads."""
  dataset, detections, image_ids, cat_ids, max_dets, backend = payload
  classes = _backend(backend)
  with contextlib.redirect_stdout(io.StringIO()):
    ground = classes[0]()  # indexed once, by the backend's own COCO class
    ground.dataset = dataset
    ground.createIndex()
  coco_eval = _accumulated(ground, detections, image_ids, cat_ids, max_dets, backend, classes)
  p = coco_eval.params
  return {
    "precision": np.asarray(coco_eval.eval["precision"]),
    "recall": np.asarray(coco_eval.eval["recall"]),
    "params": {"iouThrs": p.iouThrs, "areaRngLbl": p.areaRngLbl, "maxDets": p.maxDets},
  }


def _sharded(coco_gt, detections, image_ids, cats, max_dets, backend, n_shards, workers: dict):
  """`_accumulated`'s precision and recall computed in `n_shards` contiguous ranges of the
  sorted categories `cats` by `category_shards.run` (`workers`: its processes, progress and
  peers), concatenated along K: the same arrays bit for bit (`category_shards`). Returns an
  object with `params` and `eval` as `_summarize` reads them."""
  payloads = [
    (dataset, dets, image_ids, r, max_dets, backend)
    for dataset, dets, r in category_shards.shard_sets(coco_gt.dataset, detections, cats, n_shards)
  ]
  parts = category_shards.run(_score_shard, payloads, desc=f"COCO AP, {n_shards} shards", **workers)
  params = types.SimpleNamespace(**parts[0]["params"], catIds=list(cats))
  return types.SimpleNamespace(
    params=params,
    eval=category_shards.concatenate(parts),
  )


def _check_inputs(coco_gt, detections: list, max_dets: int) -> None:
  """`coco_evaluate`'s checks of its inputs, before any work. Raises ValueError."""
  if max_dets < 1:
    raise ValueError(f"max_dets must be >= 1, got {max_dets}.")
  if any("area" not in a for a in coco_gt.dataset.get("annotations", [])):
    raise ValueError("Every ground-truth annotation needs an 'area' (COCOeval's area ranges).")
  unknown = {int(d["image_id"]) for d in detections} - set(coco_gt.getImgIds())
  if unknown:
    raise ValueError(
      f"{len(unknown)} detection image ids are not in the ground truth, e.g. {sorted(unknown)[:5]}."
    )


def coco_evaluate(
  coco_gt,
  detections: Sequence[Mapping[str, Any]],
  *,
  image_ids: Sequence[int] | None = None,
  cat_ids: Sequence[int] | None = None,
  max_dets: int = 100,
  truncate_per_image: bool = True,
  per_category: bool = False,
  backend: str = "pycocotools",
  processes: int = 1,
  shards: int | None = None,
  progress: bool = False,
  peers: category_shards.Peers | None = None,
) -> dict[str, Any]:
  """COCO box AP of detections against a ground truth, via pycocotools' COCOeval.

  Source: docs/reference.md §4.

  Args:
    coco_gt: `pycocotools.coco.COCO` ground truth (e.g. `CocoSource.coco`).
    detections: COCO result dicts {'image_id', 'category_id', 'bbox' [x, y, w, h] pixels,
      'score'} (`to_coco_detections`). Not modified. May be empty (AP 0 for every category
      that has ground truth).
    image_ids: evaluate on these images only (default: all images of `coco_gt`).
    cat_ids: evaluate these category ids only (default: all categories of `coco_gt`); the AP
      is the mean over these categories (e.g. the held-out / rare classes).
    max_dets: detections per image considered (the largest of COCOeval's `maxDets`, which
      become [1, 10, max_dets]); ODinW uses 100, LVIS/O365-style evaluation 300. Note that
      COCOeval itself applies maxDets per (image, category); see `truncate_per_image`.
    truncate_per_image: first keep only the `max_dets` highest-scoring detections of each
      image (the COCO challenge rule, as the LVIS API does), so the limit is per image.
      A no-op for `top_predictions` output with top_k <= max_dets.
    per_category: also return {'per_category': {cat_id: {'AP', 'AP50'}}}.
    backend: the COCOeval implementation (`COCO_BACKENDS`): 'pycocotools' or
      'faster_coco_eval' (the same statistics, its C++ evaluate and accumulate; needs the
      `fast_coco` extra). `coco_gt` stays a pycocotools COCO either way.
    processes: worker processes scoring category shards side by side (spawned; 1: none
      unless the set needs shards, see `shards`).
    shards: contiguous ranges of the sorted categories scored one by one, each in its own
      worker process with its own categories' ground truth and detections; the statistics
      are the same floats as one pass (`category_shards`: COCOeval's per-category arrays
      concatenated). None: max(processes * JAX processes sharing them, ceil(detections /
      category_shards.SHARD_DETECTIONS)); 1: in this process.
    progress: a progress bar over the finished shards.
    peers: the processes of a multi-process run, each holding the same `coco_gt` and
      `detections` (`owl_cl.eval.peers.jax_peers`): each scores its share of the shards and
      receives the others' (`category_shards.run`; collective). The same floats on every
      process as one pass. None: all in this process.

  Returns:
    dict with float keys `COCO_METRIC_NAMES` ('AP' = AP@[.5:.95], 'AP50', 'AP75', 'APs',
    'APm', 'APl', 'AR1', 'AR10', 'AR' = AR@max_dets, 'ARs', 'ARm', 'ARl'), each in [0, 1],
    or NaN where pycocotools reports -1 (no ground truth for that setting, e.g. no small
    objects); plus 'num_detections' (int) and, if requested, 'per_category'.

  Raises:
    ValueError: a detection refers to an image id absent from `coco_gt`, a ground-truth
      annotation lacks 'area', max_dets < 1, processes < 1, shards < 1 or an unknown backend.

  Source: docs/reference.md §4; pycocotools `COCOeval` (iouType 'bbox'): the statistics are computed
  as
  `COCOeval.summarize` does, without its printing (evaluate/accumulate output goes to the
  logger at DEBUG level).
  """
  classes = _backend(backend)  # an unknown backend fails here, before any work
  detections = list(detections)
  _check_inputs(coco_gt, detections, max_dets)
  if truncate_per_image:
    detections = _truncate_per_image(detections, int(max_dets))
  image_ids = None if image_ids is None else sorted({int(i) for i in image_ids})
  cats = sorted(coco_gt.getCatIds()) if cat_ids is None else sorted({int(c) for c in cat_ids})
  hosts = category_shards.host_count(peers)
  n_shards = category_shards.shard_count(len(detections), len(cats), processes, shards, hosts)
  if n_shards == 1:
    chosen = None if cat_ids is None else cats
    coco_eval = _accumulated(coco_gt, detections, image_ids, chosen, max_dets, backend, classes)
  else:
    workers = {"processes": processes, "progress": progress, "peers": peers}
    coco_eval = _sharded(coco_gt, detections, image_ids, cats, max_dets, backend, n_shards, workers)
  m = int(max_dets)
  stats = _statistics(coco_eval, m)
  result: dict[str, Any] = {name: _no_data_to_nan(v) for name, v in zip(COCO_METRIC_NAMES, stats)}
  result["num_detections"] = len(detections)  # after truncation
  if per_category:
    result["per_category"] = {
      int(cat): {
        "AP": _no_data_to_nan(_summarize(coco_eval, True, max_dets=m, category_index=k)),
        "AP50": _no_data_to_nan(
          _summarize(coco_eval, True, iou_thr=0.5, max_dets=m, category_index=k)
        ),
      }
      for k, cat in enumerate(coco_eval.params.catIds)
    }
  return result

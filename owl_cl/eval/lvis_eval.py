"""LVIS evaluation: federated box AP, APr / APc / APf with the `lvis` API (docs/reference.md §4).

* `load_lvis_ground_truth`: an `lvis.LVIS` from a json path, a dict (LVIS v1 schema) or an
  existing object, with the fields LVISEval needs checked up front (clear errors naming the
  file, field and value instead of a KeyError deep inside the API).
* `lvis_evaluate`: `lvis.LVISResults` + `lvis.LVISEval` (iou_type 'bbox'): at most `max_dets`
  (300) detections per image, federated semantics handled by the API: a detection of a
  category that is neither annotated in its image nor in the image's `neg_category_ids` is
  dropped; unmatched detections of a category in `not_exhaustive_category_ids` are ignored.
  Returns AP, AP50, AP75, APs/m/l, APr (rare), APc (common), APf (frequent) and AR@max_dets.
* `detection.evaluate_lvis_source` (beside `evaluate_source`, which scores with this
  module): the `evaluate_source` analogue for an LVIS set: runs a prediction function over
  batches (multi-label top-300 (token, class) pairs, `top_predictions`), maps the contiguous
  label indices back to LVIS category ids explicitly (`to_coco_detections`) and evaluates
  them.

The `lvis` package (0.5.3) still calls `np.float`, which NumPy >= 1.24 removed; `_lvis_api`
sets `numpy.float = float` only when it is missing, before the API runs.

Source: docs/reference.md §4; the `lvis` API (lvis-dataset/lvis-api: `LVIS`, `LVISResults`,
`LVISEval`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
import contextlib
import copy
import io
import json
import logging
import os
from typing import Any
import warnings

import numpy as np

from owl_cl.eval import category_shards

logger = logging.getLogger(__name__)

#: Summary metrics of `lvis_evaluate` (LVISEval.results keys; 'AR' is AR@max_dets and
#: 'ARs'/'ARm'/'ARl' its area splits).
LVIS_METRIC_NAMES = (
  "AP",
  "AP50",
  "AP75",
  "APs",
  "APm",
  "APl",
  "APr",
  "APc",
  "APf",
  "AR",
  "ARs",
  "ARm",
  "ARl",
)
FREQUENCIES = ("r", "c", "f")

_REQUIRED_IMAGE = ("id", "neg_category_ids", "not_exhaustive_category_ids")
_REQUIRED_ANNOTATION = ("id", "image_id", "category_id", "bbox", "area")
_REQUIRED_CATEGORY = ("id", "frequency")


def _lvis_api():
  """The `lvis` module (LVIS, LVISResults, LVISEval), with the NumPy-2 `np.float` shim."""
  if "float" not in np.__dict__:
    np.float = float  # type: ignore[attr-defined]  # lvis 0.5.3 calls np.float (NumPy < 1.24).
  import lvis  # pylint: disable=g-import-not-at-top

  return lvis


def _check_schema(dataset: Any, where: str) -> None:
  """Raises ValueError naming `where`, the field and the value for what LVISEval needs."""
  if not isinstance(dataset, dict):
    raise ValueError(
      f"{where}: LVIS ground truth must be a json object, got {type(dataset).__name__}"
    )
  for key in ("images", "annotations", "categories"):
    if not isinstance(dataset.get(key), list):
      raise ValueError(f"{where}: missing or non-list top-level field '{key}'")
  for kind, fields in (
    ("images", _REQUIRED_IMAGE),
    ("annotations", _REQUIRED_ANNOTATION),
    ("categories", _REQUIRED_CATEGORY),
  ):
    for i, entry in enumerate(dataset[kind]):
      missing = [f for f in fields if f not in entry]
      if missing:
        raise ValueError(
          f"{where}: {kind}[{i}] (id {entry.get('id')!r}) is missing "
          f"field(s) {missing} (LVIS v1 schema)"
        )
  for i, cat in enumerate(dataset["categories"]):
    if cat["frequency"] not in FREQUENCIES:
      raise ValueError(
        f"{where}: categories[{i}] (id {cat['id']}) has frequency "
        f"{cat['frequency']!r}; expected one of {FREQUENCIES}"
      )
  cat_ids = {c["id"] for c in dataset["categories"]}
  image_ids = {im["id"] for im in dataset["images"]}
  for i, ann in enumerate(dataset["annotations"]):
    if ann["category_id"] not in cat_ids:
      raise ValueError(
        f"{where}: annotations[{i}] has category_id {ann['category_id']!r} absent from 'categories'"
      )
    if ann["image_id"] not in image_ids:
      raise ValueError(
        f"{where}: annotations[{i}] has image_id {ann['image_id']!r} absent from 'images'"
      )


def load_lvis_ground_truth(annotations: Any):
  """An `lvis.LVIS` ground truth, schema-checked.

  Args:
    annotations: path of an LVIS json (v1 schema), a dict with that content (copied, not
      modified), or an `lvis.LVIS` (returned as is).

  Returns:
    `lvis.LVIS`.

  Raises:
    FileNotFoundError: the path does not exist.
    ValueError: invalid json or a missing/invalid field (images: `id`, `neg_category_ids`,
      `not_exhaustive_category_ids`; annotations: `id`, `image_id`, `category_id`, `bbox`,
      `area`; categories: `id`, `frequency` in r/c/f), with file, field and value named.

  Source: docs/reference.md §4; `lvis.LVIS`.
  """
  api = _lvis_api()
  if isinstance(annotations, api.LVIS):
    return annotations
  if isinstance(annotations, (str, os.PathLike)):
    path = os.fspath(annotations)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"LVIS annotation file not found: {path}")
    try:
      with open(path) as f:
        dataset = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid json ({e})") from e
    where = path
  else:
    dataset, where = copy.deepcopy(annotations), "LVIS ground truth (dict)"
  _check_schema(dataset, where)
  gt = api.LVIS.__new__(api.LVIS)  # LVIS() only reads files; index the dict the same way.
  gt.logger = logging.getLogger("lvis.lvis")
  gt.dataset = dataset
  gt._create_index()  # pylint: disable=protected-access
  return gt


def _results(api, lvis_gt, detections: list, max_dets: int):
  """`LVISResults` of the detections; an empty list (which LVISResults rejects) gives a
  results object without annotations."""
  if detections:
    return api.LVISResults(lvis_gt, copy.deepcopy(detections), max_dets=max_dets)
  res = api.LVISResults.__new__(api.LVISResults)
  res.logger = logging.getLogger("lvis.results")
  res.dataset = dict(lvis_gt.dataset, annotations=[])
  res._create_index()  # pylint: disable=protected-access
  return res


def _valid_mean(values: np.ndarray) -> float:
  """Mean of the entries > -1 (LVISEval's "no ground truth" marker), NaN if there are none."""
  valid = values[values > -1]
  return float(np.mean(valid)) if valid.size else float("nan")


def _no_data_to_nan(value: float) -> float:
  value = float(value)
  return float("nan") if value == -1.0 else value


@contextlib.contextmanager
def _quiet():
  """The API's printing sent to the logger at DEBUG level, and lvis 0.5.3's deprecated
  `Logger.warn` silenced."""
  log = io.StringIO()
  with contextlib.redirect_stdout(log), warnings.catch_warnings():
    warnings.filterwarnings(
      "ignore", message="The 'warn' method is deprecated", category=DeprecationWarning
    )
    yield
  logger.debug("lvis: %s", log.getvalue())


def _accumulated(gt, detections: list, image_ids, cat_ids, max_dets: int):
  """`lvis.LVISEval` (bbox) after `evaluate` and `accumulate` on these images and categories
  (None: all of `gt`'s), at most `max_dets` detections per image."""
  api = _lvis_api()
  with _quiet():
    dt = _results(api, gt, detections, max_dets)
    evaluator = api.LVISEval(gt, dt, iou_type="bbox")
    evaluator.params.max_dets = max_dets
    if image_ids is not None:
      evaluator.params.img_ids = list(image_ids)
    if cat_ids is not None:
      evaluator.params.cat_ids = list(cat_ids)
    evaluator.evaluate()
    evaluator.accumulate()
  return evaluator


def _score_shard(payload: tuple) -> dict[str, Any]:
  """One category shard (a `category_shards.run` worker): `_accumulated` on the shard's ground
  truth dict; returns its [T, R, K_j, A] precision and [T, K_j, A] recall."""
  dataset, detections, image_ids, cat_ids, max_dets = payload
  # Its "Assuming user provided the results in correct format" once per shard is noise.
  logging.getLogger("lvis.results").setLevel(logging.ERROR)
  evaluator = _accumulated(
    load_lvis_ground_truth(dataset), detections, image_ids, cat_ids, max_dets
  )
  return {"precision": evaluator.eval["precision"], "recall": evaluator.eval["recall"]}


def _sharded(gt, limited: list, image_ids, cats, max_dets: int, n_shards: int, workers: dict):
  """An `LVISEval` whose `eval` holds `_accumulated`'s precision and recall computed in
  `n_shards` contiguous ranges of the sorted categories `cats` (`category_shards.run`,
  `workers` its processes, progress and peers; arrays concatenated along K: the same bit for bit,
  `category_shards`), ready for `summarize`.
  `limited`: the detections after the per-image limit."""
  api = _lvis_api()
  payloads = [
    (dataset, dets, image_ids, r, max_dets)
    for dataset, dets, r in category_shards.shard_sets(gt.dataset, limited, cats, n_shards)
  ]
  parts = category_shards.run(_score_shard, payloads, desc=f"LVIS AP, {n_shards} shards", **workers)
  # The unsharded evaluator's state that `summarize` and `get_results` read.
  evaluator = api.LVISEval.__new__(api.LVISEval)
  evaluator.logger = logging.getLogger("lvis.eval")
  evaluator.lvis_gt = gt
  evaluator.params = api.eval.Params(iou_type="bbox")
  evaluator.params.max_dets = max_dets
  evaluator.params.cat_ids = list(cats)
  evaluator.params.img_ids = sorted(gt.get_img_ids()) if image_ids is None else list(image_ids)
  evaluator.freq_groups = evaluator._prepare_freq_group()  # pylint: disable=protected-access
  evaluator.results = collections.OrderedDict()
  evaluator.eval = category_shards.concatenate(parts)
  return evaluator


def _results_of(evaluator, gt, num_detections: int, m: int, per_category: bool) -> dict[str, Any]:
  """`lvis_evaluate`'s dict from an accumulated `LVISEval` (its `summarize`, then the
  per-category AP from its precision array)."""
  with _quiet():
    evaluator.summarize()
  raw = evaluator.get_results()
  keys = {"AR": f"AR@{m}", "ARs": f"ARs@{m}", "ARm": f"ARm@{m}", "ARl": f"ARl@{m}"}
  result: dict[str, Any] = {
    name: _no_data_to_nan(raw[keys.get(name, name)]) for name in LVIS_METRIC_NAMES
  }
  result["num_detections"] = num_detections
  if per_category:
    precision = evaluator.eval["precision"]  # [iou, recall, category, area]; area 0 = all
    at_50 = np.flatnonzero(np.isclose(evaluator.params.iou_thrs, 0.5))
    per_cat = {}
    for k, cat in enumerate(evaluator.params.cat_ids):
      per_cat[int(cat)] = {
        "AP": _valid_mean(precision[:, :, k, 0]),
        "AP50": _valid_mean(precision[at_50, :, k, 0]),
        "frequency": gt.cats[cat]["frequency"],
      }
    result["per_category"] = per_cat
  return result


def lvis_evaluate(
  lvis_gt: Any,
  detections: Sequence[Mapping[str, Any]],
  *,
  image_ids: Sequence[int] | None = None,
  cat_ids: Sequence[int] | None = None,
  max_dets: int = 300,
  per_category: bool = False,
  processes: int = 1,
  shards: int | None = None,
  progress: bool = False,
  peers: category_shards.Peers | None = None,
) -> dict[str, Any]:
  """LVIS box AP of detections (docs/reference.md §4), via `lvis.LVISEval`.

  Args:
    lvis_gt: ground truth (path, dict or `lvis.LVIS`, see `load_lvis_ground_truth`).
    detections: COCO-style result dicts {'image_id', 'category_id' (LVIS id), 'bbox'
      [x, y, w, h] pixels, 'score'} (`detection.to_coco_detections`); not modified. May be
      empty (AP 0 for every category with ground truth).
    image_ids: evaluate these images only (default: all images of the ground truth).
    cat_ids: evaluate these category ids only (default: all).
    max_dets: detections kept per image, highest scores first (LVIS: 300), applied by
      `LVISResults`; also LVISEval's `max_dets`.
    per_category: also return {'per_category': {cat_id: {'AP', 'AP50', 'frequency'}}}: each
      evaluated category's AP@[.5:.95] and AP at IoU 0.5 over all areas (LVISEval's
      `eval['precision']` [iou, recall, category, area] of that category, averaged over its
      entries > -1), NaN for a category without ground truth among the evaluated images.
    processes: worker processes scoring category shards side by side (spawned), as
      `coco_eval.coco_evaluate` does: the same floats as one pass (`category_shards`); the
      per-image limit is applied before the split.
    shards: the number of contiguous category ranges, each scored in its own worker process;
      None: max(processes * JAX processes sharing them, ceil(detections /
      category_shards.SHARD_DETECTIONS)); 1: in this process.
    progress: a progress bar over the finished shards.
    peers: the processes of a multi-process run share the shards, each scoring its share and
      receiving the others' (collective; as `coco_eval.coco_evaluate`). None: all here.

  Returns:
    dict of floats `LVIS_METRIC_NAMES` in [0, 1]: 'AP' (AP@[.5:.95]), 'AP50', 'AP75',
    'APs'/'APm'/'APl' (area), 'APr'/'APc'/'APf' (rare / common / frequent categories), 'AR'
    (AR@max_dets), 'ARs'/'ARm'/'ARl'; NaN where the API reports -1 (e.g. no rare category
    with ground truth among the evaluated images). Plus 'num_detections' (int, after the
    per-image limit) and, if requested, 'per_category'.

  Raises:
    ValueError: a detection's image id or category id is absent from the ground truth,
      max_dets < 1, processes < 1, shards < 1, or a ground-truth schema error (see
      `load_lvis_ground_truth`).

  Source: docs/reference.md §4; `lvis.LVISEval` (federated: detections of categories neither
  annotated in
  the image nor in its `neg_category_ids` are dropped; `not_exhaustive_category_ids`).
  """
  api = _lvis_api()
  if max_dets < 1:
    raise ValueError(f"max_dets must be >= 1, got {max_dets}.")
  gt = load_lvis_ground_truth(lvis_gt)
  detections = list(detections)
  unknown_images = {int(d["image_id"]) for d in detections} - set(gt.imgs)
  if unknown_images:
    raise ValueError(
      f"{len(unknown_images)} detection image ids are not in the LVIS ground "
      f"truth, e.g. {sorted(unknown_images)[:5]}."
    )
  unknown_cats = {int(d["category_id"]) for d in detections} - set(gt.cats)
  if unknown_cats:
    raise ValueError(
      f"{len(unknown_cats)} detection category ids are not in the LVIS ground "
      f"truth, e.g. {sorted(unknown_cats)[:5]}."
    )
  image_ids = None if image_ids is None else sorted({int(i) for i in image_ids})
  cats = sorted(gt.get_cat_ids()) if cat_ids is None else sorted({int(c) for c in cat_ids})
  hosts = category_shards.host_count(peers)
  n_shards = category_shards.shard_count(len(detections), len(cats), processes, shards, hosts)
  if n_shards == 1:
    chosen = None if cat_ids is None else cats
    evaluator = _accumulated(gt, detections, image_ids, chosen, int(max_dets))
    num_detections = len(evaluator.lvis_dt.dataset["annotations"])
  else:
    # The one step across categories, the per-image limit, before the split (LVISResults'
    # own function: its `self` is unused).
    limited = api.LVISResults.limit_dets_per_image(None, detections, int(max_dets))
    workers = {"processes": processes, "progress": progress, "peers": peers}
    evaluator = _sharded(gt, limited, image_ids, cats, int(max_dets), n_shards, workers)
    num_detections = len(limited)
  return _results_of(evaluator, gt, num_detections, int(max_dets), per_category)

"""Detection evaluation: scores, top-k decoding, COCO conversion, COCO AP (docs/reference.md §4).

Pipeline for one evaluation set (docs/reference.md §4):

1. `class_scores` / `ensemble_templates`: model logits -> per-(token, class) scores in [0, 1].
   Scenic averages the *logits* over the 7 prompt templates and then applies the sigmoid; the
   released PyTorch code averaged sigmoid *probabilities* (option `average="probs"`).
2. `top_predictions` (jittable): top-K (token, class) pairs over all T*C for multi-label
   datasets (LVIS), or argmax class per token then top-K tokens for datasets with exclusive
   labels (ODinW, O365). No score threshold, no NMS.
3. `to_coco_detections` (host): un-pad the boxes (relative to the padded square) to original
   image pixels, clip to the image, convert to COCO `[x, y, w, h]`, map the contiguous label
   index to the dataset's category id explicitly (class index 0 is a real class; COCO ids need
   not be contiguous - scenic's evaluator gets both wrong, we do neither).
4. `owl_cl.eval.coco_eval.coco_evaluate`: pycocotools `COCOeval` (bbox) with a configurable
   number of detections per image; returns AP@[.5:.95], AP50, AP75, APs/m/l and AR as floats
   in [0, 1], NaN where pycocotools reports -1 ("no ground truth for this setting").
5. `evaluate_source`: drives 1-4 over an iterable of batches with a progress bar. The
   prediction function is supplied by the caller (`make_predict_fn` builds one from any
   function returning `pred_logits` / `pred_boxes`), so the driver is testable with fakes.

LVIS's federated AP (the `lvis` API: APr/APc/APf, `neg_category_ids`) is computed by
`owl_cl.eval.lvis_eval`, through `evaluate_source(..., Scoring(protocol='lvis'))` or
`evaluate_lvis_source`; `coco_eval.coco_evaluate(..., cat_ids=...)` gives the plain COCO AP
over a subset of categories (e.g. the held-out / rare classes of a stand-in set).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from owl_cl import preemption
from owl_cl.eval import category_shards
from owl_cl.eval import coco_eval
from owl_cl.eval import lvis_eval

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------
# Scores.
# ------------------------------------------------------------------------------------------


def class_scores(pred_logits: jax.Array) -> jax.Array:
  """Per-(token, class) detection scores: sigmoid of the logits (docs/reference.md §4).

  Args:
    pred_logits: [B, T, C] logits (any float dtype, e.g. bf16). Padded queries carry -1e6
      (scenic) and therefore score 0.

  Returns:
    float32 [B, T, C] scores in [0, 1].

  Source: docs/reference.md §4; scenic `owl_vit` evaluator (sigmoid of `pred_logits`).
  """
  return jax.nn.sigmoid(jnp.asarray(pred_logits).astype(jnp.float32))


def ensemble_templates(
  pred_logits: jax.Array,
  *,
  average: str = "logits",
  template_axis: int = -1,
  template_mask: jax.Array | None = None,
) -> jax.Array:
  """Prompt-template ensembling of class scores (docs/reference.md §2, §4).

  Args:
    pred_logits: [B, T, C, P] logits, one slice per prompt template (P = 7 evaluation
      templates of docs/reference.md §2) along `template_axis`.
    average: 'logits' (default, scenic): sigmoid(mean_p logits); 'probs' or 'probabilities'
      (as in the released code): mean_p sigmoid(logits).
    template_axis: the axis holding the templates (default last).
    template_mask: optional bool [P]; only templates with True are averaged.

  Returns:
    float32 scores in [0, 1], the input shape without the template axis ([B, T, C]).

  Raises:
    ValueError: unknown `average`, or a `template_mask` selecting no template.

  Source: docs/reference.md §2 ("Scenic averages the logits over templates; the released code
  averaged
  sigmoid probabilities (option)").
  """
  logits = jnp.asarray(pred_logits).astype(jnp.float32)
  logits = jnp.moveaxis(logits, template_axis, -1)
  if template_mask is None:
    weights = jnp.full((logits.shape[-1],), 1.0 / logits.shape[-1], jnp.float32)
  else:
    if isinstance(template_mask, (np.ndarray, list, tuple)) and not np.any(template_mask):
      raise ValueError("template_mask selects no template.")
    mask = jnp.asarray(template_mask, jnp.float32).reshape(-1)
    weights = mask / jnp.maximum(mask.sum(), 1.0)
  if average == "logits":
    return jax.nn.sigmoid(jnp.einsum("...p,p->...", logits, weights))
  if average in ("probs", "probabilities"):
    return jnp.einsum("...p,p->...", jax.nn.sigmoid(logits), weights)
  raise ValueError(f"average must be 'logits' or 'probs' ('probabilities'), got {average!r}.")


# ------------------------------------------------------------------------------------------
# Top-k decoding (jittable).
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("top_k", "multi_label"))
def top_predictions(
  scores: jax.Array,
  pred_boxes: jax.Array,
  *,
  top_k: int,
  multi_label: bool,
  class_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-K detections per image, without threshold or NMS (docs/reference.md §4). Jitted.

  Args:
    scores: float [B, T, C] class scores in [0, 1] (`class_scores` / `ensemble_templates`).
    pred_boxes: float [B, T, 4] cxcywh boxes relative to the padded square.
    top_k: K (static). Clamped to T*C (multi-label) or T (exclusive) when larger, so the
      output has K' = min(top_k, T*C) or min(top_k, T) columns.
    multi_label: static. True (LVIS): top-K over all T*C (token, class) pairs, a token can
      yield several detections with different classes. False (exclusive datasets: ODinW,
      O365): each token keeps its argmax class, then the top-K tokens.
    class_mask: optional bool [C] or [B, C]; False columns (e.g. padded queries) get score
      -inf and are never selected while valid pairs remain (`to_coco_detections` drops
      non-finite scores).

  Returns:
    scores float32 [B, K'] (descending), labels int32 [B, K'] (column index into C),
    boxes float32 [B, K', 4] (cxcywh, relative to the padded square).
    Ties are resolved towards the lower flat index (`jax.lax.top_k`).

  Raises:
    ValueError: rank/shape mismatch or top_k < 1 (at trace time).

  Source: docs/reference.md §4; scenic `owl_vit` evaluator (top-k over logits without NMS).
  """
  scores = jnp.asarray(scores).astype(jnp.float32)
  pred_boxes = jnp.asarray(pred_boxes).astype(jnp.float32)
  if scores.ndim != 3 or pred_boxes.ndim != 3 or pred_boxes.shape[-1] != 4:
    raise ValueError(
      f"Expected scores [B,T,C] and boxes [B,T,4], got {scores.shape} and {pred_boxes.shape}."
    )
  if scores.shape[:2] != pred_boxes.shape[:2]:
    raise ValueError(f"scores {scores.shape} and boxes {pred_boxes.shape} disagree on B, T.")
  if top_k < 1:
    raise ValueError(f"top_k must be >= 1, got {top_k}.")
  batch, num_tokens, num_classes = scores.shape
  if class_mask is not None:
    mask = jnp.broadcast_to(
      jnp.asarray(class_mask, bool).reshape((-1, 1, num_classes)), scores.shape
    )
    scores = jnp.where(mask, scores, -jnp.inf)
  if multi_label:
    k = min(top_k, num_tokens * num_classes)
    top_scores, flat_idx = jax.lax.top_k(scores.reshape(batch, num_tokens * num_classes), k)
    token_idx = flat_idx // num_classes
    labels = flat_idx % num_classes
  else:
    k = min(top_k, num_tokens)
    labels_all = jnp.argmax(scores, axis=-1)
    token_scores = jnp.max(scores, axis=-1)
    top_scores, token_idx = jax.lax.top_k(token_scores, k)
    labels = jnp.take_along_axis(labels_all, token_idx, axis=1)
  boxes = jnp.take_along_axis(pred_boxes, token_idx[..., None], axis=1)
  return top_scores, labels.astype(jnp.int32), boxes


# ------------------------------------------------------------------------------------------
# Conversion to COCO detections (host side).
# ------------------------------------------------------------------------------------------


def unpad_boxes(
  boxes: np.ndarray,
  orig_sizes: np.ndarray,
  image_size: int | None = None,
  *,
  rounded_content: bool = False,
) -> np.ndarray:
  """Boxes relative to the padded square -> clipped xyxy pixels of the original image.

  The evaluation image is the original resized (aspect ratio kept) so that its long side is
  the square's side S, placed at the top-left of the square and padded bottom/right
  (docs/reference.md §5).
  Hence the square of side S corresponds to max(h, w) original pixels on both axes:
  `x_px = x_rel * max(h, w)`, `y_px = y_rel * max(h, w)` (docs/reference.md §4: divide by
  (w, h) / max(h, w) to get image-relative coordinates, then multiply by (w, h)).

  Args:
    boxes: float [..., 4] cxcywh relative to the padded square.
    orig_sizes: int/float [..., 2] (height, width) of the original image in pixels,
      broadcastable against boxes[..., 0].
    image_size: optional S (pixels); only used with `rounded_content`. The default
      un-pad is exact for `owl_cl.data.image_ops`, which scales boxes by the single factor
      S / max(h, w) (`resize_geometry`), so it does not depend on S.
    rounded_content: for a pipeline that instead scales boxes by the realised per-axis
      factors of a resize to (round(h * S / max), round(w * S / max)) pixels (requires
      `image_size`): `x_px = x_rel * S * w / round(w * S / max(h, w))` (same for y). The
      difference to the default is below half a resized pixel.

  Returns:
    float64 [..., 4] (x0, y0, x1, y1) pixels, clipped to [0, w] x [0, h].

  Raises:
    ValueError: rounded_content without image_size.

  Source: docs/reference.md §4, §5; scenic `owl_vit` evaluator (un-padding by (w, h) / max(h, w)).
  """
  boxes = np.asarray(boxes, np.float64)
  sizes = np.asarray(orig_sizes, np.float64)
  h, w = sizes[..., 0], sizes[..., 1]
  long_side = np.maximum(h, w)
  if not rounded_content:
    scale_x = scale_y = long_side
  elif image_size is None:
    raise ValueError("rounded_content=True needs image_size.")
  else:
    s = float(image_size)
    scale_x = s * w / np.maximum(np.round(w * s / long_side), 1.0)
    scale_y = s * h / np.maximum(np.round(h * s / long_side), 1.0)
  cx, cy, bw, bh = (boxes[..., i] for i in range(4))
  x0 = np.clip((cx - 0.5 * bw) * scale_x, 0.0, w)
  x1 = np.clip((cx + 0.5 * bw) * scale_x, 0.0, w)
  y0 = np.clip((cy - 0.5 * bh) * scale_y, 0.0, h)
  y1 = np.clip((cy + 0.5 * bh) * scale_y, 0.0, h)
  return np.stack([x0, y0, x1, y1], axis=-1)


def to_coco_detections(
  scores: np.ndarray,
  labels: np.ndarray,
  boxes: np.ndarray,
  *,
  image_ids: np.ndarray,
  orig_sizes: np.ndarray,
  category_ids: Sequence[int] | np.ndarray,
  example_mask: np.ndarray | None = None,
  image_size: int | None = None,
) -> list[dict[str, Any]]:
  """Top-K predictions of a batch -> COCO result dicts (docs/reference.md §4).

  Args:
    scores: float [B, K] detection scores (`top_predictions`).
    labels: int [B, K] contiguous class indices (columns of the score matrix).
    boxes: float [B, K, 4] cxcywh relative to the padded square.
    image_ids: int [B] COCO image ids; examples with id < 0 are skipped.
    orig_sizes: int [B, 2] (height, width) of the original images in pixels.
    category_ids: int [C] dataset category id of each contiguous class index (e.g.
      `CocoSource.category_ids`). Mapped explicitly: index 0 is a real class and ids need not
      be contiguous. Entries < 0 mark columns that are not classes (e.g. padded queries);
      their detections are skipped.
    example_mask: optional bool [B]; False examples (batch padding) are skipped.
    image_size: optional padded square side S in pixels, see `unpad_boxes` (no effect on the
      default un-pad, which is exact for `owl_cl.data.image_ops`).

  Returns:
    list of dicts {'image_id': int, 'category_id': int, 'bbox': [x, y, w, h] float pixels
    of the original image (clipped to it), 'score': float}, in batch order, then descending
    score. Non-finite scores (masked classes) are dropped; boxes that clip to zero area are
    kept (they count as false positives, as in scenic).

  Raises:
    ValueError: inconsistent shapes or a label outside [0, C).

  Source: docs/reference.md §4; COCO results format (pycocotools `COCO.loadRes`).
  """
  scores = np.asarray(scores, np.float64)
  labels = np.asarray(labels, np.int64)
  boxes = np.asarray(boxes, np.float64)
  image_ids = np.asarray(image_ids, np.int64).reshape(-1)
  orig_sizes = np.asarray(orig_sizes, np.float64).reshape(-1, 2)
  category_ids = np.asarray(category_ids, np.int64).reshape(-1)
  batch = scores.shape[0]
  if (
    scores.ndim != 2
    or labels.shape != scores.shape
    or boxes.shape != scores.shape + (4,)
    or image_ids.shape != (batch,)
    or orig_sizes.shape != (batch, 2)
  ):
    raise ValueError(
      f"Inconsistent shapes: scores {scores.shape}, labels {labels.shape}, boxes "
      f"{boxes.shape}, image_ids {image_ids.shape}, orig_sizes {orig_sizes.shape}."
    )
  if example_mask is None:
    example_mask = np.ones((batch,), bool)
  example_mask = np.asarray(example_mask, bool).reshape(-1)
  if example_mask.shape != (batch,):
    raise ValueError(f"example_mask has shape {example_mask.shape}, expected ({batch},).")
  keep_example = example_mask & (image_ids >= 0)
  if labels.size and keep_example.any():
    used = labels[keep_example]
    if used.min() < 0 or used.max() >= len(category_ids):
      raise ValueError(
        f"Labels must lie in [0, {len(category_ids)}), got range [{used.min()}, {used.max()}]."
      )
  xyxy = unpad_boxes(boxes, orig_sizes[:, None, :], image_size)
  detections = []
  for b in np.flatnonzero(keep_example):
    cats = category_ids[labels[b]]
    valid = np.isfinite(scores[b]) & (cats >= 0)
    img = int(image_ids[b])
    for k in np.flatnonzero(valid):
      x0, y0, x1, y1 = xyxy[b, k]
      detections.append(
        {
          "image_id": img,
          "category_id": int(cats[k]),
          "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
          "score": float(scores[b, k]),
        }
      )
  return detections


# ------------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------------

PredictFn = Callable[[Mapping[str, Any]], tuple[Any, Any, Any]]


def make_predict_fn(
  outputs_fn: Callable[..., Mapping[str, Any]],
  *,
  top_k: int,
  multi_label: bool,
  batch_keys: Sequence[str] = ("images",),
  average: str = "logits",
  template_axis: int = -1,
  class_mask: Any = None,
  jit: bool = True,
) -> PredictFn:
  """Builds `predict_fn(batch) -> (scores, labels, boxes)` for `evaluate_source`.

  Args:
    outputs_fn: `outputs_fn(**{key: batch[key] for key in batch_keys}) -> dict` with
      'pred_logits' [B, T, C] (or [B, T, C, P] with P prompt templates) and 'pred_boxes'
      [B, T, 4]; typically a closure over the model and its variables, e.g.
      `lambda images: model.apply(variables, images, queries=None, query_embeddings=q,
      query_mask=m)`.
    top_k: see `top_predictions`.
    multi_label: see `top_predictions`.
    class_mask: see `top_predictions`.
    batch_keys: batch entries passed to `outputs_fn` (only these cross into the jit, so int64
      host fields like `image_id` are never converted).
    average: template ensembling for 4-D logits, see `ensemble_templates`.
    template_axis: template ensembling for 4-D logits, see `ensemble_templates`.
    jit: wrap the whole prediction in `jax.jit` (default True).

  Returns:
    predict_fn(batch) -> (scores float32 [B, K], labels int32 [B, K], boxes float32 [B, K, 4])
    as (asynchronously computed) jax arrays.

  Source: docs/reference.md §4.
  """

  def _predict(inputs):
    outputs = outputs_fn(**inputs)
    logits = outputs["pred_logits"]
    if logits.ndim == 4:
      scores = ensemble_templates(logits, average=average, template_axis=template_axis)
    else:
      scores = class_scores(logits)
    return top_predictions(
      scores, outputs["pred_boxes"], top_k=top_k, multi_label=multi_label, class_mask=class_mask
    )

  compiled = jax.jit(_predict) if jit else _predict

  def predict_fn(batch):
    return compiled({key: batch[key] for key in batch_keys})

  return predict_fn


def collect_detections(
  predict_fn: PredictFn,
  batches: Iterable[Mapping[str, Any]],
  category_ids: Sequence[int],
  *,
  image_size: int | None = None,
  progress: bool = True,
  total: int | None = None,
  desc: str = "eval",
) -> tuple[list[dict[str, Any]], set[int]]:
  """Runs `predict_fn` over batches and converts the outputs to COCO detections.

  Source: docs/reference.md §4.

  Batch i + 1 is dispatched before the outputs of batch i are fetched to the host, so the
  (asynchronous) device computation overlaps the conversion.

  Args:
    predict_fn: `predict_fn(batch) -> (scores [B, K], labels [B, K], boxes [B, K, 4])`.
    batches: iterable of batch dicts with `image_id` int [B], `orig_size` int [B, 2] (h, w) and
      optionally `example_mask` bool [B].
    category_ids: int [C] dataset category id of each label index (`to_coco_detections`).
    image_size: see `unpad_boxes`. progress, total, desc: the tqdm progress bar.

  Returns:
    (detections: list of COCO result dicts, in batch order; seen: set of the image ids of the
    valid examples).

  Raises:
    ValueError: from `to_coco_detections`.

  Source: docs/reference.md §4.
  """
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  if total is None and hasattr(batches, "__len__"):
    total = len(batches)  # type: ignore[arg-type]
  detections: list[dict[str, Any]] = []
  seen: set[int] = set()

  def collect(batch, outputs):
    scores, labels, boxes = jax.device_get(outputs)
    image_ids = np.asarray(batch["image_id"]).reshape(-1)
    mask = batch.get("example_mask")
    mask = np.ones(image_ids.shape, bool) if mask is None else np.asarray(mask, bool)
    seen.update(int(i) for i in image_ids[mask & (image_ids >= 0)])
    detections.extend(
      to_coco_detections(
        scores,
        labels,
        boxes,
        image_ids=image_ids,
        orig_sizes=batch["orig_size"],
        category_ids=category_ids,
        example_mask=mask,
        image_size=image_size,
      )
    )

  pending = None
  for batch in tqdm(batches, desc=desc, total=total, disable=not progress, leave=False):
    preemption.checkpoint_event("eval_batch")  # test-only kill hook (a no-op otherwise)
    outputs = predict_fn(batch)  # Dispatched asynchronously.
    if pending is not None:
      collect(*pending)
    pending = (batch, outputs)
  if pending is not None:
    collect(*pending)
  return detections, seen


@dataclasses.dataclass(frozen=True)
class Scoring:
  """How `evaluate_source` scores an evaluation set's detections.

  Attributes:
    protocol: 'coco' (pycocotools AP, `coco_eval.coco_evaluate`) or 'lvis' (the federated
      LVIS AP, `lvis_eval.lvis_evaluate`).
    ground_truth: overrides the source's ground truth: a pycocotools COCO ('coco'), or an LVIS
      json path, dict or `lvis.LVIS` ('lvis'); None: `source.coco` / `source.annotation_file`.
    max_dets: detections per image scored; None: the protocol's (100 'coco', 300 'lvis').
    cat_ids: the categories scored (see `coco_eval.coco_evaluate`); None: all.
    restrict_to_seen_images: score only the images present in the batches (a partial pass
      over a set is scored on what was predicted), else every image of the ground truth.
    per_category: also return 'per_category' (see `coco_eval.coco_evaluate`).
    per_class: also return 'per_class' (`per_class_table`, names from `source.class_names`).
    return_detections: also return the COCO result dicts under 'detections'.
    coco_backend: protocol 'coco''s COCOeval implementation (`coco_eval.COCO_BACKENDS`).
    processes: worker processes that score category shards side by side (the scorers'
      `processes`; the same floats as one pass).
    peers: the processes of a multi-process run that share the shards (the scorers' `peers`,
      `owl_cl.eval.peers.jax_peers`; collective). The Detector sets it in such a run.
  """

  protocol: str = "coco"
  ground_truth: Any = None
  max_dets: int | None = None
  cat_ids: Sequence[int] | None = None
  restrict_to_seen_images: bool = True
  per_category: bool = False
  per_class: bool = False
  return_detections: bool = False
  coco_backend: str = "pycocotools"
  processes: int = 1
  peers: category_shards.Peers | None = None


def _protocol(scoring: Scoring, source):
  """`evaluate_source`'s protocol: (ground truth, scoring function, metric names, a function
  counting the ground truth's images, max_dets with the protocol's default).

  Raises:
    ValueError: an unknown protocol; 'lvis' without ground truth.
  """
  ground_truth, max_dets = scoring.ground_truth, scoring.max_dets
  if scoring.protocol == "coco":
    gt = source.coco if ground_truth is None else ground_truth
    score = functools.partial(coco_eval.coco_evaluate, backend=scoring.coco_backend)
    metric_names = coco_eval.COCO_METRIC_NAMES
    count_images = lambda: len(gt.getImgIds())
    max_dets = 100 if max_dets is None else max_dets
  elif scoring.protocol == "lvis":
    if ground_truth is None:
      ground_truth = getattr(source, "annotation_file", None)
      if ground_truth is None:
        raise ValueError("LVIS evaluation needs lvis_gt (the source has no annotation_file)")
    gt = lvis_eval.load_lvis_ground_truth(ground_truth)
    score, metric_names = lvis_eval.lvis_evaluate, lvis_eval.LVIS_METRIC_NAMES
    count_images = lambda: len(gt.imgs)
    max_dets = 300 if max_dets is None else max_dets
  else:
    raise ValueError(f"protocol must be 'coco' or 'lvis', got {scoring.protocol!r}")
  return gt, score, metric_names, count_images, max_dets


def evaluate_source(
  predict_fn: PredictFn,
  source: Any,
  batches: Iterable[Mapping[str, Any]],
  scoring: Scoring = Scoring(),
  *,
  category_ids: Sequence[int] | None = None,
  image_size: int | None = None,
  progress: bool = True,
  desc: str | None = None,
) -> dict[str, Any]:
  """Runs `predict_fn` over batches of one evaluation set and scores them: the one evaluator
  of the COCO and the LVIS protocol.

  The batches are run and converted by `collect_detections` (device work overlaps the
  host-side conversion); the detections are then scored as `scoring` says
  (`coco_eval.coco_evaluate` for protocol 'coco': pycocotools AP, exclusive classes;
  `lvis_eval.lvis_evaluate` for 'lvis': the federated LVIS AP with APr / APc / APf).

  Args:
    predict_fn: `predict_fn(batch) -> (scores [B, K], labels [B, K], boxes [B, K, 4])`
      (`top_predictions` semantics; e.g. from `make_predict_fn`; for LVIS the multi-label
      top-300 (token, class) pairs). Supplied by the caller.
    source: the evaluation set, e.g. `owl_cl.data.coco.CocoSource`; uses `source.coco`
      ('coco') or `source.annotation_file` ('lvis') when `scoring` gives no ground truth,
      `source.category_ids` (if `category_ids` is None) and `source.name` (messages).
    batches: iterable of batch dicts (CONVENTIONS.md) with at least `image_id` int [B],
      `orig_size` int [B, 2] (h, w) and optionally `example_mask` bool [B].
    scoring: the protocol and what is returned (`Scoring`).
    category_ids: int [C] dataset category id of each label index (see `to_coco_detections`).
    image_size: padded square side S, see `unpad_boxes` (not needed by the default un-pad).
    progress: show a tqdm progress bar (its total: `len(batches)` where it has one).
    desc: progress-bar text (default f"eval {source.name}").

  Returns:
    The protocol's metric dict plus 'num_images' (int, evaluated images). With
    `scoring.restrict_to_seen_images` and no valid example in `batches`, every metric is NaN.

  Raises:
    ValueError: an unknown protocol; 'lvis' without ground truth (no `annotation_file`);
      from `to_coco_detections` / the scoring (bad labels, unknown image ids).

  Source: docs/reference.md §4 (evaluation protocols); scenic's owl_vit evaluator.
  """
  gt, score, metric_names, count_images, max_dets = _protocol(scoring, source)
  category_ids = source.category_ids if category_ids is None else category_ids
  name = getattr(source, "name", None) or ("eval" if scoring.protocol == "coco" else "lvis")
  detections, seen = collect_detections(
    predict_fn,
    batches,
    category_ids,
    image_size=image_size,
    progress=progress,
    desc=desc or f"eval {name}",
  )
  restrict, per_category = scoring.restrict_to_seen_images, scoring.per_category
  if restrict and not seen:
    logger.warning("evaluate_source(%s): no images were evaluated; metrics are NaN.", name)
    result: dict[str, Any] = {key: float("nan") for key in metric_names}
    result.update(num_detections=0, num_images=0)
    if per_category or scoring.per_class:
      result["per_category"] = {}
  else:
    result = score(
      gt,
      detections,
      image_ids=sorted(seen) if restrict else None,
      cat_ids=scoring.cat_ids,
      max_dets=max_dets,
      per_category=per_category or scoring.per_class,
      processes=scoring.processes,
      progress=progress,
      peers=scoring.peers,
    )
    result["num_images"] = len(seen) if restrict else count_images()
  if scoring.per_class:
    _add_per_class(result, per_category, category_ids, source.class_names)
  if scoring.return_detections:
    result["detections"] = detections
  return result


def _add_per_class(result: dict, keep_per_category: bool, category_ids, class_names) -> None:
  """Adds `result['per_class']` (`per_class_table` of `result['per_category']`), keeping
  'per_category' only when it was asked for too."""
  by_id = result["per_category"] if keep_per_category else result.pop("per_category")
  result["per_class"] = per_class_table(by_id, category_ids, class_names)


def per_class_table(
  per_category: Mapping[int, Mapping[str, Any]],
  category_ids: Sequence[int],
  class_names: Sequence[str],
) -> dict[str, dict[str, Any]]:
  """The per-category AP of `coco_evaluate` / `lvis_evaluate` keyed by class name (results.json
  `per_class`; JSON keys are strings, and a name reads without the dataset's id table).

  Args:
    per_category: {category id: {'AP', 'AP50', ... (floats in [0, 1] or NaN)}}.
    category_ids: int [C] category id of each class index (the source's `category_ids`).
    class_names: [C] the classes' names, in the same order.

  Returns:
    {class name: {'category_id': int, **per_category[id]}} in class-index order, for every
    class of `per_category`; a name that two classes share gets ' (<category id>)' appended.

  Raises:
    ValueError: `category_ids` and `class_names` differ in length, or a category of
      `per_category` is not among `category_ids`.
  """
  if len(category_ids) != len(class_names):
    raise ValueError(
      f"per_class_table: {len(category_ids)} category ids against {len(class_names)} names"
    )
  name_of = {int(c): str(n) for c, n in zip(category_ids, class_names)}
  unknown = sorted(set(int(c) for c in per_category) - set(name_of))
  if unknown:
    raise ValueError(f"per_class_table: category ids {unknown} have no class name")
  count = collections.Counter(name_of.values())
  per_category = {int(c): v for c, v in per_category.items()}
  out = {}
  for cat in (int(c) for c in category_ids):
    if cat in per_category:
      name = f"{name_of[cat]} ({cat})" if count[name_of[cat]] > 1 else name_of[cat]
      out[name] = {"category_id": cat, **per_category[cat]}
  return out


def evaluate_lvis_source(
  predict_fn: PredictFn,
  source: Any,
  batches: Iterable[Mapping[str, Any]],
  scoring: Scoring = Scoring(protocol="lvis", max_dets=300),
  **options,
) -> dict[str, Any]:
  """`evaluate_source` with protocol 'lvis' (the one evaluator): `scoring`'s protocol is set
  to 'lvis' (its `ground_truth`: an LVIS json path, dict or `lvis.LVIS`; default
  `source.annotation_file`); `options`: `evaluate_source`'s keywords.

  Returns:
    `lvis_eval.lvis_evaluate`'s dict plus 'num_images'.

  Raises:
    ValueError: see `evaluate_source`.
  """
  scoring = dataclasses.replace(scoring, protocol="lvis")
  return evaluate_source(predict_fn, source, batches, scoring, **options)

"""Label ops: duplicate merging, query sampling, query tokens and the per-image targets.

Sources: docs/reference.md §3 (targets and queries per image); scenic owl_vit (duplicate
boxes merged into multi-label instances); the released code (frequency-weighted negatives).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
  "class_frequencies",
  "merge_duplicate_instances",
  "sample_queries",
  "check_tokens",
  "query_tokens",
  "instance_targets",
]


def class_frequencies(source) -> np.ndarray:
  """float64 [C] number of images of `source` that contain each class (non-crowd boxes).

  Use as `negative_weights` for frequency-weighted random negatives (docs/reference.md §3; the
  released
  code's `data/add_negatives.py` weights each label by the number of training images listing
  it). Reads `source.targets(i)` (no image decoding) when available, else `source[i]`.
  """
  counts = np.zeros(source.num_classes if hasattr(source, "num_classes") else 0, np.float64)
  get = getattr(source, "targets", None) or (lambda i: source[i])
  for i in range(len(source)):
    labels = np.unique(np.asarray(get(i)["labels"], np.int64))
    if labels.size and labels.max() >= counts.size:
      counts = np.pad(counts, (0, int(labels.max()) + 1 - counts.size))
    counts[labels] += 1
  return counts


def _pairwise_iou(b: np.ndarray) -> np.ndarray:
  area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
  lt = np.maximum(b[:, None, :2], b[None, :, :2])
  rb = np.minimum(b[:, None, 2:], b[None, :, 2:])
  inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
  union = area[:, None] + area[None, :] - inter
  return inter / np.maximum(union, 1e-9)


def merge_duplicate_instances(
  boxes: np.ndarray, labels: np.ndarray, iou_threshold: float | None = 0.9
) -> tuple[np.ndarray, list[list[int]]]:
  """Merge boxes with IoU >= threshold into one multi-label instance (scenic, docs/reference.md §3).

  Args:
    boxes: float [M, 4] xyxy; labels: int [M] class indices.
    iou_threshold: merge threshold; None disables merging (one label per box).

  Returns:
    (boxes float32 [K, 4] — the first box of each group, in input order;
     label lists: K lists of sorted unique class indices).
  """
  boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
  labels = np.asarray(labels).reshape(-1)
  if iou_threshold is None or len(boxes) < 2:
    return boxes, [[int(l)] for l in labels]
  iou = _pairwise_iou(boxes)
  group = -np.ones(len(boxes), np.int64)
  keep: list[int] = []
  for i in range(len(boxes)):
    if group[i] >= 0:
      continue
    group[i] = len(keep)
    members = np.nonzero((iou[i] >= iou_threshold) & (group < 0))[0]
    group[members] = len(keep)
    keep.append(i)
  label_sets: list[set] = [set() for _ in keep]
  for i, g in enumerate(group):
    label_sets[g].add(int(labels[i]))
  return boxes[keep], [sorted(s) for s in label_sets]


def sample_queries(
  positives: Sequence[int],
  excluded: Sequence[int],
  num_classes: int,
  num_queries: int,
  num_negatives: int,
  rng: np.random.Generator,
  negative_weights: np.ndarray | None = None,
  annotated_negatives: Sequence[int] = (),
) -> np.ndarray:
  """Query classes of one training image: [-1 (''), positives..., negatives..., -1...].

  Args:
    positives: class indices with a target box in the image (deduplicated, order kept); at most
      Q-1 are used (the rest are cut, see `input_pipeline.preprocess_train_example`).
    excluded: classes present in the image (never sampled as negatives; includes `positives`).
    num_classes: C, the dataset's class count.
    num_queries: Q (>= 1).
    num_negatives: maximum number of negatives; fewer when the free slots (Q-1-P) or the
      candidate classes run out.
    rng: numpy Generator (explicit randomness).
    negative_weights: optional float [C] sampling weights (e.g. `class_frequencies`,
      docs/reference.md §3); default uniform over the candidates. Negatives are drawn without
      replacement.
    annotated_negatives: classes verified absent (LVIS `neg_category_ids`); they come first
      (in a random order, at most `num_negatives`), the rest is topped up by random sampling
      (docs/reference.md §3). Excluded / positive classes among them are ignored.

  Returns:
    int32 [Q] query_class; -1 marks '' (index 0 and padding).

  Source: docs/reference.md §3 (query list = unique(['', positives, negatives]) padded with '').
  """
  if num_queries < 1:
    raise ValueError(f"num_queries must be >= 1, got {num_queries}")
  pos: list[int] = list(dict.fromkeys(int(p) for p in positives))[: num_queries - 1]
  excl = np.zeros(num_classes, bool)
  excl[np.asarray(list(excluded) + pos, np.int64)] = True
  budget = max(0, min(num_negatives, num_queries - 1 - len(pos)))
  first = np.zeros((0,), np.int64)
  if len(annotated_negatives) and budget > 0:
    ann = np.unique(np.asarray(annotated_negatives, np.int64))
    ann = ann[(ann >= 0) & (ann < num_classes)]
    ann = ann[~excl[ann]]
    first = rng.permutation(ann)[:budget]
    excl[first] = True
  candidates = np.nonzero(~excl)[0]
  n_neg = max(0, min(budget - len(first), len(candidates)))
  if n_neg > 0:
    p = None
    if negative_weights is not None:
      w = np.asarray(negative_weights, np.float64)[candidates]
      if w.sum() > 0:
        p = w / w.sum()
        n_neg = min(n_neg, int(np.count_nonzero(p)))
    neg = rng.choice(candidates, size=n_neg, replace=False, p=p)
  else:
    neg = np.zeros((0,), np.int64)
  neg = np.concatenate([first, np.asarray(neg, np.int64)])
  n_neg = len(neg)
  qc = np.full((num_queries,), -1, np.int32)
  qc[1 : 1 + len(pos)] = pos
  qc[1 + len(pos) : 1 + len(pos) + n_neg] = neg
  return qc


def query_tokens(
  query_class: np.ndarray,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  rng: np.random.Generator,
) -> np.ndarray:
  """int32 [Q, L] tokens of the queries `query_class` int [Q] (-1: `empty_tokens` int32 [L]).

  With `class_tokens` int32 [C, L] each class has one prompt; with [C, P, L] one of its P prompt
  variants is drawn uniformly per query from `rng` (docs/reference.md §2 training prompts).
  """
  q = len(query_class)
  out = np.broadcast_to(np.asarray(empty_tokens, np.int32), (q, empty_tokens.shape[-1])).copy()
  real = query_class >= 0
  if real.any():
    cls = query_class[real]
    if class_tokens.ndim == 3:
      pick = rng.integers(0, class_tokens.shape[1], size=len(cls))
      out[real] = class_tokens[cls, pick]
    else:
      out[real] = class_tokens[cls]
  return out


def check_tokens(
  class_tokens: np.ndarray, empty_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """(class_tokens int32 [C, L] or [C, P, L], empty_tokens int32 [L]) as arrays.

  Raises:
    ValueError: class_tokens not 2-D / 3-D or their L not that of `empty_tokens`.
  """
  class_tokens = np.asarray(class_tokens, np.int32)
  empty_tokens = np.asarray(empty_tokens, np.int32).reshape(-1)
  if class_tokens.ndim not in (2, 3) or class_tokens.shape[-1] != empty_tokens.shape[0]:
    raise ValueError(
      f"class_tokens must be [C, L] or [C, P, L] with L = len(empty_tokens) "
      f"= {empty_tokens.shape[0]}, got {class_tokens.shape}"
    )
  return class_tokens, empty_tokens


def instance_targets(
  boxes: np.ndarray,
  label_sets: Sequence[Sequence[int]],
  query_class: np.ndarray,
  max_instances: int,
) -> tuple[np.ndarray, np.ndarray]:
  """The per-image targets: multi-hot labels over the queries and the instances' boxes.

  Args:
    boxes: float [K, 4] instance boxes (any units; the caller's cxcywh / S), K <= M.
    label_sets: K lists of class indices, one per instance (`merge_duplicate_instances`).
    query_class: int [Q] the image's query classes (`sample_queries`; -1: '').
    max_instances: M.

  Returns:
    (labels float32 [M, Q], boxes float32 [M, 4]): instance m's row marks the query columns
    of its classes; an instance none of whose classes is a query is left out (the rows move
    up); rows after the last instance are padding instances (labels[m, 0] = 1, zero boxes).

  Source: docs/reference.md §3 (targets per image).
  """
  num_queries = len(query_class)
  col = {int(c): j for j, c in enumerate(query_class) if c >= 0}
  out_labels = np.zeros((max_instances, num_queries), np.float32)
  out_boxes = np.zeros((max_instances, 4), np.float32)
  m = 0
  for b, ls in zip(boxes, label_sets):
    cols = [col[l] for l in ls if l in col]
    if not cols:
      continue
    out_labels[m, cols] = 1.0
    out_boxes[m] = b
    m += 1
  out_labels[m:, 0] = 1.0
  return out_labels, out_boxes

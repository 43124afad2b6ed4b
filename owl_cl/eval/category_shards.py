"""Scoring an evaluation set in category shards, in parallel processes (docs/reference.md §4).

COCO's and LVIS's box AP are exact when computed one range of categories at a time:

* `COCOeval.evaluate` / `LVISEval.evaluate` match each (image, category) pair on its own
  (its ground truth, its detections sorted by score with a stable sort);
* `accumulate` builds each category's precision / recall from that category's pairs alone
  (the detections of all images concatenated in image order, then a stable sort by score);
* the summary statistics are means over the [T, R, K, A(, M)] precision and [T, K, A(, M)]
  recall arrays, K the sorted category ids.

So a scorer run over a contiguous range of the sorted category ids, with the ground truth and
the detections of those categories only, gives that range's slice of both arrays bit for bit,
and the slices concatenated along K are the unsharded arrays (tested for pycocotools,
faster-coco-eval and the `lvis` API: tests/eval/test_category_shards.py). The one
cross-category step, the per-image limit on detections, is applied before the split.

Why shards at all: the scorers hold every detection as a Python dict plus per-(image,
category) tables, about 5.6 KB per detection at peak (docs/benchmarks.md): Objects365 val's
8 million detections need about 45 GB in one process, and LVIS val takes 10+ minutes of one
core. By default a shard holds about `SHARD_DETECTIONS` detections, and `processes`
spawned workers score the shards side by side, each worker process used for one shard only
(its memory goes back to the system when it exits). In a multi-process JAX run (`Peers`) every
process holds the whole gathered set; each scores every P-th shard and the parts are exchanged
(`owl_cl.distributed.gather_objects`), so P hosts share the scoring instead of each repeating
all of it. This module imports no JAX: the spawned workers import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
import concurrent.futures
import dataclasses
import multiprocessing
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

#: Detections per shard when `shard_count` chooses the number of shards: at about 5.6 KB per
#: detection at a scorer's peak (docs/benchmarks.md, "The paper's protocol at full size"),
#: about 2.8 GB per worker, so that two workers and the caller's detections fit in 16 GB.
SHARD_DETECTIONS = 500_000


@dataclasses.dataclass(frozen=True)
class Peers:
  """The processes of a multi-process run that share the shards (`owl_cl.eval.peers.jax_peers`
  builds them from JAX's runtime).

  Attributes:
    index: this process, in [0, count).
    count: the processes, >= 1.
    gather: `gather(value) -> [every process's value]` in process order; collective (every
      process calls it at the same point), e.g. `owl_cl.distributed.gather_objects`.
  """

  index: int
  count: int
  gather: Callable[[Any], list]


def shard_count(
  num_detections: int,
  num_categories: int,
  processes: int,
  shards: int | None,
  hosts: int = 1,
) -> int:
  """How many category shards to score in: `shards` if given; else 1 for a set that one
  process scores in one pass (processes 1, at most SHARD_DETECTIONS detections: on every host,
  where spawning and exchanging would cost more than the scoring); else
  max(processes * hosts, ceil(num_detections / SHARD_DETECTIONS)). At most one per category.

  Args:
    num_detections: detections to score (after the per-image limit).
    num_categories: categories scored (K).
    processes: worker processes per host, >= 1.
    shards: the number asked for (>= 1), or None to choose it.
    hosts: processes that share the shards (`Peers.count`), >= 1.

  Returns:
    int in [1, max(1, num_categories)]; 1 means scoring in the calling process.

  Raises:
    ValueError: processes < 1, shards < 1 or hosts < 1.
  """
  if processes < 1:
    raise ValueError(f"processes must be >= 1, got {processes}.")
  if shards is not None and shards < 1:
    raise ValueError(f"shards must be >= 1 or None, got {shards}.")
  if hosts < 1:
    raise ValueError(f"hosts must be >= 1, got {hosts}.")
  by_size = -(-num_detections // SHARD_DETECTIONS)
  wanted = 1 if max(processes, by_size) == 1 else max(processes * hosts, by_size)
  return max(1, min(wanted if shards is None else shards, num_categories))


def host_count(peers: Peers | None) -> int:
  """The processes that share the shards: `peers.count`, 1 without peers."""
  return 1 if peers is None else peers.count


def split_categories(
  cat_ids: Sequence[int], weights: Sequence[int], shards: int
) -> list[list[int]]:
  """Contiguous ranges of the sorted `cat_ids` with about equal total weight.

  Args:
    cat_ids: [K] distinct category ids, sorted ascending (the scorers' K order).
    weights: [K] a non-negative cost per category (its detections + ground-truth boxes).
    shards: the number of ranges, 1 <= shards <= K.

  Returns:
    `shards` non-empty lists whose concatenation is `cat_ids`: range j ends where the
    cumulative weight first reaches j / shards of the total (and leaves at least one category
    for each later range).

  Raises:
    ValueError: cat_ids not sorted and distinct, lengths that differ, or shards out of range.
  """
  k = len(cat_ids)
  if list(cat_ids) != sorted(set(cat_ids)):
    raise ValueError("cat_ids must be sorted and distinct.")
  if len(weights) != k:
    raise ValueError(f"{len(weights)} weights for {k} categories.")
  if not 1 <= shards <= max(k, 1):
    raise ValueError(f"shards must be in [1, {k}], got {shards}.")
  total = sum(weights) or 1
  out: list[list[int]] = [[]]
  cumulative = 0
  for i, (cat, weight) in enumerate(zip(cat_ids, weights)):
    out[-1].append(int(cat))
    cumulative += weight
    left_after = k - i - 1
    ranges_to_open = shards - len(out)
    due = cumulative * shards >= len(out) * total
    if ranges_to_open and left_after and (due or left_after == ranges_to_open):
      out.append([])
  return out


def partition(
  items: Iterable[T], key: Callable[[T], int], shards: Sequence[Sequence[int]]
) -> list[list[T]]:
  """`items` split by the shard that holds `key(item)` (a category id), in their order
  (a stable partition: the scorers' stable sorts see each pair's items as before).

  Raises:
    KeyError: an item's category is in no shard.
  """
  where = {cat: j for j, cats in enumerate(shards) for cat in cats}
  out: list[list[T]] = [[] for _ in shards]
  for item in items:
    out[where[key(item)]].append(item)
  return out


def run(
  fn: Callable[[Any], T],
  payloads: Sequence[Any],
  processes: int,
  *,
  progress: bool = False,
  desc: str = "scoring shards",
  peers: Peers | None = None,
) -> list[T]:
  """`[fn(p) for p in payloads]`, in spawned worker processes, one process per payload.

  Spawned, not forked: the caller may hold JAX's threads, which a fork would copy in an
  unknown state. `fn` must be a module-level function (it is pickled by reference).

  Args:
    fn: the shard scorer.
    payloads: one picklable argument per shard.
    processes: at most this many workers at a time (per process of `peers`).
    progress: a tqdm bar over the finished shards (rate and ETA).
    desc: its text.
    peers: process p of P runs payloads p, p + P, p + 2P, ... (the shards are balanced, so
      each gets about 1 / P of the work) and the results are exchanged (`peers.gather`).
      Collective: every peer calls `run` with the same payloads at the same point. None or
      one process: all here.

  Returns:
    The results in the order of `payloads` (every result on every peer).

  Raises:
    Exception: whatever `fn` raised in a worker, re-raised here (a peer then waits in the
      exchange until the run's runtime ends it: `owl_cl.distributed.fail_fast`).
    concurrent.futures.process.BrokenProcessPool: a worker died (e.g. killed out of memory).
  """
  if host_count(peers) == 1:
    return _run_here(fn, payloads, processes, progress, desc)
  mine = list(range(peers.index, len(payloads), peers.count))
  local = _run_here(fn, [payloads[j] for j in mine], processes, progress, desc)
  merged: dict[int, Any] = {}
  for part in peers.gather(dict(zip(mine, local))):
    merged.update(part)
  return [merged[j] for j in range(len(payloads))]


def _run_here(fn, payloads, processes: int, progress: bool, desc: str) -> list:
  """`run` in this JAX process alone."""
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  if not payloads:
    return []
  results: list[Any] = [None] * len(payloads)
  with concurrent.futures.ProcessPoolExecutor(
    max_workers=max(1, min(processes, len(payloads))),
    mp_context=multiprocessing.get_context("spawn"),
    max_tasks_per_child=1,
  ) as pool:
    futures = {pool.submit(fn, payload): j for j, payload in enumerate(payloads)}
    bar = tqdm(total=len(payloads), desc=desc, disable=not progress, leave=False)
    try:
      for future in concurrent.futures.as_completed(futures):
        results[futures[future]] = future.result()
        bar.update(1)
    finally:
      bar.close()
  return results


def weights_by_category(cat_ids: Sequence[int], *groups: Iterable[int]) -> list[int]:
  """[K] how many entries of `groups` (iterables of category ids) fall in each category."""
  count = dict.fromkeys(cat_ids, 0)
  for group in groups:
    for cat in group:
      if cat in count:
        count[cat] += 1
  return [count[c] for c in cat_ids]


def _category(entry: Mapping[str, Any]) -> int:
  return int(entry["category_id"])


def shard_sets(
  dataset: Mapping[str, Any],
  detections: Sequence[Mapping[str, Any]],
  cats: Sequence[int],
  shards: int,
) -> list[tuple[dict[str, Any], list, list[int]]]:
  """The ground truth and detections of each of `shards` contiguous ranges of `cats`,
  balanced by their detections + ground-truth boxes (`split_categories`).

  Args:
    dataset: a COCO or LVIS ground-truth dict ('images', 'annotations', 'categories', ...).
    detections: result dicts with 'category_id'; those of other categories than `cats` are
      left out (a scorer evaluating `cats` does not read them).
    cats: [K] the scored category ids, sorted ascending.
    shards: 1 <= shards <= K.

  Returns:
    Per range: (its ground-truth dict: `dataset`'s other keys as they are, every image, the
    annotations and category entries of its categories; its detections in their order; its
    category ids).
  """
  kept = set(cats)
  annotations = [a for a in dataset.get("annotations", []) if _category(a) in kept]
  detections = [d for d in detections if _category(d) in kept]
  weights = weights_by_category(cats, map(_category, detections), map(_category, annotations))
  ranges = split_categories(cats, weights, shards)
  dets = partition(detections, _category, ranges)
  anns = partition(annotations, _category, ranges)
  by_id = {int(c["id"]): c for c in dataset.get("categories", [])}
  rest = {k: v for k, v in dataset.items() if k not in ("annotations", "categories")}
  return [
    (
      {**rest, "annotations": anns[j], "categories": [by_id[c] for c in r if c in by_id]},
      dets[j],
      r,
    )
    for j, r in enumerate(ranges)
  ]


def concatenate(parts: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """The shards' 'precision' [T, R, K_j, A(, M)] and 'recall' [T, K_j, A(, M)] (COCOeval's and
  LVISEval's `eval` layout) joined along K, in the shards' order."""
  return {
    "precision": np.concatenate([part["precision"] for part in parts], axis=2),
    "recall": np.concatenate([part["recall"] for part in parts], axis=1),
  }

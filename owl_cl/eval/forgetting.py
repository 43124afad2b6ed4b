"""Continual-learning summaries of an accuracy matrix: forgetting, BWT, FWT, retention.

The accuracy matrix A has one row per *stage* and one column per *evaluation set*:
A[i, j] = metric (e.g. COCO AP in [0, 1]) on evaluation set j after stage i, where stage 0 is
the model after pre-training (before any downstream dataset) and stage i >= 1 the model after
training on the i-th downstream dataset; T = A.shape[0] - 1 is the final stage. Missing
evaluations are NaN.

`trained_at[j]` is the stage at which evaluation set j was learned: i >= 1 for the downstream
set trained at stage i, 0 for sets that were never trained in the sequence (the pre-training
set, i.e. the O365 stand-in, the open-vocabulary LVIS stand-in and its held-out classes).
Sets with trained_at >= 1 are the "downstream" sets.

Formulas (all NaN-safe: NaN entries are ignored in max/mean, an empty selection gives NaN):

* Forgetting of set j (Chaudhry et al. 2018, "Riemannian Walk for Incremental Learning",
  eq. 5): f_j = max_{l in L_j} A[l, j] - A[T, j], with L_j = {trained_at[j], ..., T - 1}
  (the stages at which j had been learned; `since="all"` uses {0, ..., T - 1}, which differs
  only by the zero-shot accuracy of downstream sets). NaN for the set trained at the final
  stage (L_j empty). Positive = forgotten.
* Average forgetting (Chaudhry et al. 2018, eq. 6): F = mean of f_j over downstream sets with
  1 <= trained_at[j] <= T - 1.
* Backward transfer (Lopez-Paz & Ranzato 2017, "Gradient Episodic Memory", eq. 3):
  BWT = mean over downstream j with trained_at[j] <= T - 1 of A[T, j] - A[trained_at[j], j].
  Negative = forgetting.
* Forward transfer (Lopez-Paz & Ranzato 2017, eq. 4, with the reference accuracy b_j taken as
  the pre-trained model's zero-shot accuracy A[0, j] instead of a random initialisation):
  FWT = mean over downstream j with trained_at[j] >= 2 of A[trained_at[j] - 1, j] - A[0, j].
* Retained fraction of set j: A[T, j] / A[0, j] (NaN where A[0, j] <= 0 or missing); for the
  pre-training set this is how much of the pre-training metric survives the sequence.
* Downstream mean at stage i (the ODinW score of docs/reference.md §4 / the paper's Table 3 when i =
T):
  the unweighted mean of A[i, j] over downstream sets j. With `skipna=False` (default) a
  missing set makes the mean NaN rather than silently averaging fewer sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from typing import Any
import warnings

import numpy as np


def _nanmax(x: np.ndarray) -> float:
  x = np.asarray(x, np.float64)
  x = x[~np.isnan(x)]
  return float(x.max()) if x.size else float("nan")


def _nanmean(x) -> float:
  x = np.asarray(x, np.float64).reshape(-1)
  x = x[~np.isnan(x)]
  return float(x.mean()) if x.size else float("nan")


def _check(
  A: np.ndarray, trained_at: Sequence[int] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
  A = np.asarray(A, np.float64)
  if A.ndim != 2 or A.shape[0] < 1:
    raise ValueError(f"A must be [stages, eval_sets] with >= 1 stage, got shape {A.shape}.")
  if trained_at is None:
    trained_at = np.zeros((A.shape[1],), np.int64)
  trained_at = np.asarray(trained_at, np.int64).reshape(-1)
  if trained_at.shape != (A.shape[1],):
    raise ValueError(f"trained_at has shape {trained_at.shape}, expected ({A.shape[1]},).")
  if trained_at.size and (trained_at.min() < 0 or trained_at.max() >= A.shape[0]):
    raise ValueError(f"trained_at must lie in [0, {A.shape[0] - 1}], got {trained_at}.")
  return A, trained_at


def accuracy_matrix(
  stages: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
  eval_sets: Sequence[str] | None = None,
  *,
  metric: str = "AP",
) -> tuple[np.ndarray, list[str], list[str]]:
  """Builds the accuracy matrix from per-stage metrics.

  Args:
    stages: either the results.json form, a list of {'name': str, 'metrics': {eval_set:
      {metric: float | None}}} in stage order (stage 0 = after pre-training), or a dict
      {stage_name: {eval_set: float | {metric: float | None}}} in insertion order.
    eval_sets: column order (default: eval sets in order of first appearance).
    metric: key read when a cell is a dict (e.g. 'AP', 'AP50').

  Returns:
    (A float64 [S, J] with NaN for missing / None values, stage names [S], eval set names [J]).

  Raises:
    ValueError: a stage without a name.
  """
  if isinstance(stages, Mapping):
    items = [(str(name), metrics) for name, metrics in stages.items()]
  else:
    items = []
    for stage in stages:
      if "name" not in stage:
        raise ValueError(f"Stage without 'name': {stage!r:.200}")
      items.append((str(stage["name"]), stage.get("metrics", {}) or {}))
  if eval_sets is None:
    eval_sets = []
    for _, metrics in items:
      for key in metrics:
        if key not in eval_sets:
          eval_sets.append(key)
  eval_sets = list(eval_sets)
  A = np.full((len(items), len(eval_sets)), np.nan)
  for i, (_, metrics) in enumerate(items):
    for j, name in enumerate(eval_sets):
      cell = metrics.get(name)
      if isinstance(cell, Mapping):
        cell = cell.get(metric)
      if cell is not None:
        A[i, j] = float(cell)
  return A, [name for name, _ in items], eval_sets


def trained_at_from_names(
  stage_names: Sequence[str],
  eval_sets: Sequence[str],
  downstream: Mapping[str, str] | Sequence[str] | None = None,
) -> np.ndarray:
  """The stage at which each evaluation set was learned.

  Args:
    stage_names: [S] stage names; stage 0 is the pre-trained model.
    eval_sets: [J] evaluation set names.
    downstream: which eval sets are downstream and the stage that trains each: a mapping
      {eval_set: stage_name}, or a list of eval-set names that equal their stage names. Default:
      every eval set whose name equals the name of a stage >= 1.

  Returns:
    int64 [J]: stage index (>= 1) for downstream sets, 0 otherwise.

  Raises:
    ValueError: a mapped stage name that is not among stages 1..S-1.
  """
  stage_index = {name: i for i, name in enumerate(stage_names) if i >= 1}
  if downstream is None:
    mapping = {name: name for name in eval_sets if name in stage_index}
  elif isinstance(downstream, Mapping):
    mapping = dict(downstream)
  else:
    mapping = {name: name for name in downstream}
  out = np.zeros((len(eval_sets),), np.int64)
  for j, name in enumerate(eval_sets):
    if name in mapping:
      stage = mapping[name]
      if stage not in stage_index:
        # A downstream set whose stage has not run yet (partial results): not trained yet.
        if stage in stage_names:
          raise ValueError(f"Eval set {name!r} mapped to stage 0 ({stage!r}).")
        continue
      out[j] = stage_index[stage]
  return out


def forgetting(
  A: np.ndarray, trained_at: Sequence[int] | np.ndarray | None = None, *, since: str = "trained"
) -> np.ndarray:
  """Per-set forgetting f_j = max_{l in L_j} A[l, j] - A[T, j] (Chaudhry et al. 2018, eq. 5).

  Args:
    A: [S, J] accuracy matrix (module docstring), NaN = missing.
    trained_at: int [J] (default all 0: every set counts from stage 0).
    since: 'trained' (L_j = trained_at[j] .. T-1, default) or 'all' (L_j = 0 .. T-1).

  Returns:
    float64 [J], in metric units (AP points in [0, 1] for AP); NaN when L_j is empty
    (trained at the final stage, or a single stage), all of A[L_j, j] is NaN, or A[T, j] is NaN.

  Raises:
    ValueError: bad shapes / trained_at range, unknown `since`.
  """
  A, trained_at = _check(A, trained_at)
  if since not in ("trained", "all"):
    raise ValueError(f"since must be 'trained' or 'all', got {since!r}.")
  final = A.shape[0] - 1
  out = np.full((A.shape[1],), np.nan)
  for j in range(A.shape[1]):
    start = int(trained_at[j]) if since == "trained" else 0
    best = _nanmax(A[start:final, j])
    out[j] = best - A[final, j]
  return out


def _downstream_before_final(A: np.ndarray, trained_at: np.ndarray) -> np.ndarray:
  final = A.shape[0] - 1
  return (trained_at >= 1) & (trained_at <= final - 1)


def average_forgetting(
  A: np.ndarray, trained_at: Sequence[int] | np.ndarray, *, since: str = "trained"
) -> float:
  """Average forgetting over downstream sets learned before the final stage.

  F = mean_{j : 1 <= trained_at[j] <= T-1} f_j (Chaudhry et al. 2018, eq. 6), NaN-safe.

  Args:
    A: [S, J] accuracy matrix; trained_at: int [J]; since: see `forgetting`.

  Returns:
    float (metric units); NaN if no such set has a defined forgetting.
  """
  A, trained_at = _check(A, trained_at)
  f = forgetting(A, trained_at, since=since)
  return _nanmean(f[_downstream_before_final(A, trained_at)])


def backward_transfer(A: np.ndarray, trained_at: Sequence[int] | np.ndarray) -> float:
  """Backward transfer BWT = mean_j (A[T, j] - A[trained_at[j], j]) (Lopez-Paz & Ranzato 2017).

  The mean runs over downstream sets with 1 <= trained_at[j] <= T - 1 (eq. 3 of "Gradient
  Episodic Memory for Continual Learning": BWT = 1/(T-1) sum_{i<T} R_{T,i} - R_{i,i}).

  Args:
    A: [S, J] accuracy matrix; trained_at: int [J].

  Returns:
    float (metric units; negative = forgetting); NaN if undefined for every such set.
  """
  A, trained_at = _check(A, trained_at)
  final = A.shape[0] - 1
  sel = np.flatnonzero(_downstream_before_final(A, trained_at))
  return _nanmean([A[final, j] - A[trained_at[j], j] for j in sel])


def forward_transfer(A: np.ndarray, trained_at: Sequence[int] | np.ndarray) -> float:
  """Forward transfer FWT = mean_j (A[trained_at[j] - 1, j] - A[0, j]).

  Lopez-Paz & Ranzato 2017, eq. 4, with the reference accuracy b_j = A[0, j] (the pre-trained
  model's zero-shot metric) instead of a random initialisation's; over downstream sets with
  trained_at[j] >= 2 (for trained_at = 1 the difference is 0 by construction).

  Args:
    A: [S, J] accuracy matrix; trained_at: int [J].

  Returns:
    float (metric units); NaN if undefined for every such set.
  """
  A, trained_at = _check(A, trained_at)
  sel = np.flatnonzero(trained_at >= 2)
  return _nanmean([A[trained_at[j] - 1, j] - A[0, j] for j in sel])


def retained_fraction(A: np.ndarray) -> np.ndarray:
  """Fraction of the after-pre-training metric kept at the end: A[T, j] / A[0, j].

  Args:
    A: [S, J] accuracy matrix.

  Returns:
    float64 [J]; NaN where A[0, j] is missing or <= 0, or A[T, j] is missing.
  """
  A, _ = _check(A, None)
  first, last = A[0], A[-1]
  with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
    warnings.simplefilter("ignore")
    out = np.where(first > 0, last / np.where(first > 0, first, 1.0), np.nan)
  return np.where(np.isnan(first) | np.isnan(last), np.nan, out)


def downstream_mean(
  A: np.ndarray, trained_at: Sequence[int] | np.ndarray, *, stage: int = -1, skipna: bool = False
) -> float:
  """Unweighted mean over downstream sets of A[stage, j] (the ODinW score, docs/reference.md §4).

  Args:
    A: [S, J] accuracy matrix; trained_at: int [J] (downstream sets: trained_at >= 1).
    stage: row (default the final stage).
    skipna: ignore missing sets (default False: any missing downstream set gives NaN, so a
      partial average is never reported as the benchmark score).

  Returns:
    float (metric units); NaN if there is no downstream set.
  """
  A, trained_at = _check(A, trained_at)
  values = A[stage, trained_at >= 1]
  if values.size == 0:
    return float("nan")
  if skipna:
    return _nanmean(values)
  return float(values.mean())


def forgetting_summary(
  A: np.ndarray,
  stage_names: Sequence[str],
  eval_sets: Sequence[str],
  trained_at: Sequence[int] | np.ndarray,
  *,
  since: str = "trained",
) -> dict[str, Any]:
  """All of the above for one metric, as a JSON-friendly dict.

  Args:
    A: [S, J] accuracy matrix; stage_names: [S]; eval_sets: [J]; trained_at: int [J];
    since: see `forgetting`.

  Returns:
    {'final_stage': name of stage T,
     'per_set': {eval_set: {'trained_at': stage name or None, 'initial': A[0, j],
                            'best_before_final': max_{l in L_j} A[l, j], 'final': A[T, j],
                            'forgetting': f_j, 'retained_fraction': A[T, j] / A[0, j]}},
     'average_forgetting': F, 'bwt': BWT, 'fwt': FWT,
     'downstream_mean_initial': mean_j A[0, j], 'downstream_mean_final': mean_j A[T, j],
     'num_downstream': number of downstream sets}
    Floats are Python floats, NaN where undefined.

  Raises:
    ValueError: inconsistent lengths.
  """
  A, trained_at = _check(A, trained_at)
  if len(stage_names) != A.shape[0] or len(eval_sets) != A.shape[1]:
    raise ValueError(
      f"{len(stage_names)} stage names / {len(eval_sets)} eval sets for a "
      f"matrix of shape {A.shape}."
    )
  final = A.shape[0] - 1
  f = forgetting(A, trained_at, since=since)
  kept = retained_fraction(A)
  per_set = {}
  for j, name in enumerate(eval_sets):
    start = int(trained_at[j]) if since == "trained" else 0
    per_set[name] = {
      "trained_at": stage_names[trained_at[j]] if trained_at[j] >= 1 else None,
      "initial": float(A[0, j]),
      "best_before_final": _nanmax(A[start:final, j]),
      "final": float(A[final, j]),
      "forgetting": float(f[j]),
      "retained_fraction": float(kept[j]),
    }
  return {
    "final_stage": stage_names[final],
    "per_set": per_set,
    "average_forgetting": average_forgetting(A, trained_at, since=since),
    "bwt": backward_transfer(A, trained_at),
    "fwt": forward_transfer(A, trained_at),
    "downstream_mean_initial": downstream_mean(A, trained_at, stage=0),
    "downstream_mean_final": downstream_mean(A, trained_at, stage=final),
    "num_downstream": int((trained_at >= 1).sum()),
  }


def is_nan(value: Any) -> bool:
  """True for None or a float NaN (helper for results formatting)."""
  return value is None or (isinstance(value, float) and math.isnan(value))

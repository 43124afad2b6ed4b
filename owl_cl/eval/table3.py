"""The paper's Table 3 rows and columns of a results dict: roles, cells, downstream means.

A results.json (`owl_cl.eval.results`, its module docstring gives the schema) names which eval
set plays which Table-3 column in its `roles`: the pre-training set (O365 stand-in), the
open-vocabulary set (LVIS stand-in), the held-out (rare) classes and the downstream sets whose
mean is the ODinW-style score. This module normalises those roles and reads one stage's row of
the table from its metrics. Metric values are fractions in [0, 1]; missing values are NaN.

Source: the paper's Table 3 (tab:main): O365 | LVIS | LVIS rare | ODinW mean; docs/reference.md
§4.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from typing import Any

import numpy as np

from owl_cl import config_fields

_DEFAULT_LABELS = {
  "pretrain": "O365 stand-in",
  "open_vocab": "LVIS stand-in",
  "held_out": "held-out (rare)",
}
# Label of the held-out column when there is no separate open-vocabulary (LVIS) column.
_HELD_OUT_ONLY_LABEL = "LVIS stand-in / held-out (rare)"
_DEFAULT_DOWNSTREAM_LABEL = "ODinW stand-in mean"
# The Table-3 columns a role names an eval set for, left to right (the downstream mean last).
COLUMNS = ("pretrain", "open_vocab", "held_out")


def num(value: Any) -> float:
  """A metric value as a float: None (missing; JSON null) -> NaN, else `float(value)`.

  Raises:
    TypeError, ValueError: `value` is not a number.
  """
  return float("nan") if value is None else float(value)


def _normalize_role(role: Any, key: str) -> dict[str, Any]:
  if role is None:
    role = {}
  elif isinstance(role, str):
    role = {"eval_set": role}
  role = dict(role)
  role.setdefault("eval_set", None)
  role.setdefault("AP", "AP")
  role.setdefault("AP50", "AP50")
  role.setdefault("label", _DEFAULT_LABELS[key])
  return role


def normalize_roles(
  roles: Mapping[str, Any] | None, sequence: Sequence[str], stages: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
  """The results.json `roles` with every default filled (module docstring of eval.results).

  Args:
    roles: the caller's roles (or legacy `eval_sets`), None for none: per column of `COLUMNS`
      a dict {'eval_set', 'AP', 'AP50', 'label'} or a str naming the eval set; optional
      'downstream' (eval set names) and 'downstream_label'.
    sequence: the downstream datasets in training order; the default 'downstream'.
    stages: the results' stages; without a sequence, the downstream sets are the datasets
      trained on at stages 1.. that some stage evaluated.

  Returns:
    {'pretrain', 'open_vocab', 'held_out': {'eval_set': str | None, 'AP': str, 'AP50': str,
    'label': str}, 'downstream': [str], 'downstream_label': str}.
  """
  roles = dict(roles or {})
  out = {key: _normalize_role(roles.get(key), key) for key in COLUMNS}
  if (
    out["open_vocab"]["eval_set"] is None
    and out["held_out"]["eval_set"] is not None
    and not (isinstance(roles.get("held_out"), Mapping) and "label" in roles["held_out"])
  ):
    out["held_out"]["label"] = _HELD_OUT_ONLY_LABEL
  downstream = roles.get("downstream")
  if downstream is None:
    if sequence:
      downstream = list(sequence)
    else:
      keys = [s.get("trained_on") or s["name"] for s in stages[1:]]
      downstream = [k for k in keys if any(k in (s.get("metrics") or {}) for s in stages)]
  out["downstream"] = [str(d) for d in downstream]
  out["downstream_label"] = roles.get("downstream_label", _DEFAULT_DOWNSTREAM_LABEL)
  return out


def stage_value(stage: Mapping[str, Any], eval_set: str | None, key: str | None) -> float:
  """One stage's metric `key` on `eval_set` (a fraction in [0, 1]); NaN when either is None or
  the stage has no such value."""
  if eval_set is None or key is None:
    return float("nan")
  cell = (stage.get("metrics") or {}).get(eval_set)
  if not isinstance(cell, Mapping):
    return float("nan")
  return num(cell.get(key))


def downstream_mean(stage: Mapping[str, Any], downstream: Sequence[str], key: str) -> float:
  """Mean of metric `key` over the `downstream` eval sets at one stage (the ODinW-style score,
  in [0, 1]); NaN when there are none or any of them is missing."""
  values = [stage_value(stage, d, key) for d in downstream]
  if not values or any(math.isnan(v) for v in values):
    return float("nan")  # Never report a partial average as the benchmark score.
  return float(np.mean(values))


def table3_row(stage: Mapping[str, Any], roles: Mapping[str, Any]) -> dict[str, Any]:
  """The Table-3 row (pre-training set, open-vocabulary set, held-out, downstream mean).

  Args:
    stage: a results.json stage ({'name', 'metrics': {eval_set: {metric: value}}}).
    roles: normalised roles (results.json 'roles').

  Returns:
    {'stage': name, 'pretrain_AP', 'pretrain_AP50', 'open_vocab_AP', 'open_vocab_AP50',
     'held_out_AP', 'held_out_AP50', 'downstream_mean_AP', 'downstream_mean_AP50'}: floats in
    [0, 1] or NaN (missing; the downstream mean is NaN if any downstream set is missing).

  Source: the paper's Table 3 (tab:main): O365 | LVIS | LVIS rare | ODinW mean; docs/reference.md
  §4.
  """
  row: dict[str, Any] = {"stage": stage.get("name")}
  for key in COLUMNS:
    role = roles[key]
    row[f"{key}_AP"] = stage_value(stage, role["eval_set"], role["AP"])
    row[f"{key}_AP50"] = stage_value(stage, role["eval_set"], role["AP50"])
  row["downstream_mean_AP"] = downstream_mean(stage, roles["downstream"], "AP")
  row["downstream_mean_AP50"] = downstream_mean(stage, roles["downstream"], "AP50")
  return row


def eval_set_order(results: Mapping[str, Any]) -> list[str]:
  """The eval sets of a results dict in display order: the Table-3 columns' sets, then the
  downstream sets, then any other set some stage evaluated (first appearance), each once."""
  roles = results["roles"]
  order: list[str] = []
  for name in [roles[k]["eval_set"] for k in COLUMNS] + list(roles["downstream"]):
    if name is not None and name not in order:
      order.append(name)
  for stage in results["stages"]:
    for name in stage.get("metrics") or {}:
      if name not in order:
        order.append(name)
  return order


def mean_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Cell-wise mean of Table-3 rows (`table3_row`), NaN cells left out (NaN if all are).

  Returns:
    {'pretrain_AP', 'pretrain_AP50', ..., 'downstream_mean_AP50'}: floats in [0, 1] or NaN.
  """
  out = {}
  for key in ("pretrain", "open_vocab", "held_out", "downstream_mean"):
    for suffix in ("AP", "AP50"):
      values = [num(r.get(f"{key}_{suffix}")) for r in rows]
      values = [v for v in values if not math.isnan(v)]
      out[f"{key}_{suffix}"] = float(np.mean(values)) if values else float("nan")
  return out


# results.json `schedule`: config `train.schedule`'s values (docs/baselines.md); absent:
# 'sequence'.
SCHEDULES = config_fields.SCHEDULES


def _mean_cells(cells: Sequence[Any]) -> dict[str, float]:
  """Metric-wise mean of eval cells ({metric: value}); a metric missing (or NaN) in any cell,
  or a missing cell, gives NaN (a partial mean is never reported)."""
  keys = list(dict.fromkeys(k for c in cells if isinstance(c, Mapping) for k in c))
  out = {}
  for key in keys:
    values = [num(c.get(key)) if isinstance(c, Mapping) else math.nan for c in cells]
    out[key] = float(np.mean(values)) if values else math.nan
  return out


def per_task_stage(stages: Sequence[Mapping[str, Any]], roles: Mapping[str, Any]) -> dict:
  """The final "stage" of a `per_task` run (one model per task): each downstream set by its
  own task's model, the Table-3 columns' other sets (pre-training, held-out) by the mean over
  the task models.

  Args:
    stages: the run's stages (stage i >= 1: the model of task i, `trained_on` its set).
    roles: normalised roles.

  Returns:
    {'name': 'per_task', 'metrics': {eval_set: {metric: value}}}: a downstream set whose task
    has not run yet is absent (the downstream mean is then NaN).
  """
  tasks = stages[1:]
  metrics = {}
  for stage in tasks:
    own = stage.get("trained_on") or stage["name"]
    if own in (stage.get("metrics") or {}):
      metrics[own] = dict(stage["metrics"][own])
  for key in COLUMNS:
    name = roles[key]["eval_set"]
    if name is not None and name not in metrics:
      metrics[name] = _mean_cells([(s.get("metrics") or {}).get(name) for s in tasks])
  return {"name": "per_task", "metrics": metrics}


def final_stage(
  stages: Sequence[Mapping[str, Any]], roles: Mapping[str, Any], schedule: str | None
) -> Mapping[str, Any]:
  """The stage the run's Table-3 row reads: the last one, or for a `per_task` run with a
  task done `per_task_stage` (the mean over its task models)."""
  if schedule == "per_task" and len(stages) > 1:
    return per_task_stage(stages, roles)
  return stages[-1]


def own_task_summary(
  stages: Sequence[Mapping[str, Any]], roles: Mapping[str, Any], schedule: str | None
) -> dict[str, Any]:
  """Each downstream set's AP right after its own training: at the stage trained on it
  ('sequence', 'per_task'), at the one joint stage ('joint').

  Args:
    stages: the run's stages (finalised: `trained_on` set). roles: normalised roles.
    schedule: one of `SCHEDULES` (None: 'sequence').

  Returns:
    {'per_set': {set: {'AP', 'AP50'}}, 'mean_AP', 'mean_AP50', 'min_AP', 'min_AP50'}:
    fractions in [0, 1]; NaN for a set not trained yet, and means / minima over a partial
    set of datasets are NaN.

  Source: the diagonal A[i, i] of the accuracy matrix (Lopez-Paz & Ranzato 2017); its
  minimum is the "min own" of the README's table (the least plastic dataset), the `per_task`
  run's the plasticity ceiling (docs/baselines.md).
  """
  by_name = {s.get("trained_on") or s["name"]: s for s in stages[1:]}
  joint = stages[-1] if schedule == "joint" and len(stages) > 1 else None
  per_set = {}
  for name in roles["downstream"]:
    stage = joint or by_name.get(name) or {}
    per_set[name] = {key: stage_value(stage, name, key) for key in ("AP", "AP50")}
  out: dict[str, Any] = {"per_set": per_set}
  for key in ("AP", "AP50"):
    values = [cell[key] for cell in per_set.values()]
    partial = not values or any(math.isnan(v) for v in values)
    out[f"mean_{key}"] = math.nan if partial else float(np.mean(values))
    out[f"min_{key}"] = math.nan if partial else float(np.min(values))
  return out

"""Reading finished (or running) workdirs for analysis: results, stage matrices, curves.

A workdir of `python -m owl_cl.main` holds `results.json` (schema: `owl_cl.eval.results`,
docs/runs.md "Outputs") and `records/<dataset>.npz` (keys: `owl_cl.replay.records`). Everything
here is a pure function of those files / dicts; nothing imports JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import glob
import os
from typing import Any

import numpy as np

from owl_cl.eval import forgetting as forgetting_lib
from owl_cl.eval import results as results_lib
from owl_cl.replay import records as records_lib

RECORDS_DIR = "records"
# Every key `owl_cl.replay.records.RetrievalRecords.save` writes.
RECORD_KEYS = tuple(records_lib.RetrievalRecords(1).as_dict())
_ROLE_COLUMNS = ("pretrain", "open_vocab", "held_out")


@dataclasses.dataclass(frozen=True)
class Run:
  """One workdir's outputs.

  Attributes:
    workdir: the folder given to `load_run`.
    results: the finalised results dict (`owl_cl.eval.results.load_results`).
    records: {dataset name: {record key: np.ndarray}} from `records/<dataset>.npz`, in the
      run's training order (datasets not in `results['sequence']` follow, sorted); {} when
      the run wrote no records (`replay.records=False`, `no_replay`, or not reached yet).
  """

  workdir: str
  results: dict[str, Any]
  records: dict[str, dict[str, np.ndarray]]

  @property
  def label(self) -> str:
    """`<algorithm> (<workdir basename>)`: a legend label."""
    return f"{self.results['algorithm']} ({os.path.basename(os.path.normpath(self.workdir))})"


def load_records(path: str) -> dict[str, np.ndarray]:
  """Reads one `records/<dataset>.npz` file.

  Args:
    path: the .npz written by `owl_cl.replay.records.RetrievalRecords.save`.

  Returns:
    {key: np.ndarray} with every key of `RECORD_KEYS` (shapes in `owl_cl.replay.records`:
    `sampled_class_counts` int64 [C], `swil_entropy_counts` / `grasp_entropy_counts` int64
    [50] over `entropy_bin_edges` float64 [51], `knn_sv_counts` int64 [400] over
    `knn_sv_bin_edges` float64 [401], `min_sv_rank_counts` / `selected_rank_counts` int64
    [R + 1], `used_grasp` int64 [2], `calls` int64 []).

  Raises:
    FileNotFoundError: no such file; ValueError: a key is missing (names the file and key).
  """
  with np.load(path) as data:
    missing = [k for k in RECORD_KEYS if k not in data.files]
    if missing:
      raise ValueError(
        f"{path}: not an owl_cl retrieval records file, missing keys {missing} "
        f"(expected {list(RECORD_KEYS)})."
      )
    return {k: np.asarray(data[k]) for k in data.files}


def load_run(workdir: str) -> Run:
  """Loads a workdir's `results.json` and every `records/<dataset>.npz`.

  Args:
    workdir: a run folder of `python -m owl_cl.main`.

  Returns:
    `Run(workdir, results, records)` (see `Run`).

  Raises:
    FileNotFoundError: no `<workdir>/results.json` (the message names the path);
    ValueError: not an owl_cl results file, or a records file missing a key.
  """
  path = os.path.join(workdir, results_lib.RESULTS_JSON)
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"{path} does not exist: is {workdir!r} an owl_cl workdir whose "
      "first evaluation has finished?"
    )
  results = results_lib.load_results(path)
  files = {
    os.path.splitext(os.path.basename(p))[0]: p
    for p in glob.glob(os.path.join(workdir, RECORDS_DIR, "*.npz"))
    if not p.endswith(".tmp.npz")
  }
  order = [d for d in results.get("sequence") or [] if d in files]
  order += sorted(d for d in files if d not in order)
  return Run(workdir=workdir, results=results, records={d: load_records(files[d]) for d in order})


def eval_set_order(results: Mapping[str, Any]) -> list[str]:
  """Column order of the per-stage matrix: the Table-3 role sets (pre-training,
  open-vocabulary, held-out), then the downstream sets in training order, then any other
  set in order of first appearance (as `results.md`).

  Args:
    results: a finalised results dict (`roles` filled by `owl_cl.eval.results`).

  Returns:
    Eval set names, each once.
  """
  roles = results.get("roles") or {}
  order: list[str] = []
  names = [(roles.get(k) or {}).get("eval_set") for k in _ROLE_COLUMNS]
  names += list(roles.get("downstream") or [])
  for stage in results["stages"]:
    names += list(stage.get("metrics") or {})
  for name in names:
    if name is not None and name not in order:
      order.append(name)
  return order


def stage_matrix(
  results: Mapping[str, Any], metric: str = "AP50", eval_sets: Sequence[str] | None = None
) -> tuple[list[str], list[str], np.ndarray]:
  """The per-stage, per-eval-set metric matrix of one run.

  Args:
    results: a results dict (`Run.results` or `owl_cl.eval.results.load_results`).
    metric: the metric key of each cell, e.g. 'AP' (COCO mAP@[.5:.95]), 'AP50', 'APr'.
    eval_sets: column order; default `eval_set_order(results)`.

  Returns:
    (row names [S]: `"<i>: <stage name>"` with stage 0 = after pre-training; column names
    [E]: eval sets; values float64 [S, E]: fractions in [0, 1], NaN where the set was not
    evaluated at that stage or has no such metric).

  Raises:
    ValueError: a stage without a name (`owl_cl.eval.forgetting.accuracy_matrix`).

  Source: the per-dataset matrix of `results.md` (owl_cl.eval.results, docs/reference.md §4).
  """
  if eval_sets is None:
    eval_sets = eval_set_order(results)
  values, stage_names, columns = forgetting_lib.accuracy_matrix(
    results["stages"], eval_sets, metric=metric
  )
  rows = [f"{i}: {name}" for i, name in enumerate(stage_names)]
  return rows, columns, values


def forgetting_curve(
  results: Mapping[str, Any], eval_set: str | None = None, metric: str = "AP"
) -> tuple[np.ndarray, np.ndarray]:
  """One eval set's metric after every stage (the paper's forgetting view when `eval_set` is
  the pre-training set: how much of the O365 AP survives each downstream dataset).

  Args:
    results: a results dict.
    eval_set: the eval set; default the pre-training role's set (`roles.pretrain.eval_set`).
    metric: metric key, e.g. 'AP', 'AP50', or 'APr' on the LVIS set.

  Returns:
    (stage indices int64 [S] = 0..S-1, values float64 [S] in [0, 1], NaN where not
    evaluated at that stage).

  Raises:
    KeyError: `eval_set` was never evaluated in this run (the message lists those that were);
    ValueError: no eval set given and the run has no pre-training role.
  """
  if eval_set is None:
    eval_set = ((results.get("roles") or {}).get("pretrain") or {}).get("eval_set")
    if eval_set is None:
      raise ValueError(
        f"run {results.get('run_id')!r} has no pre-training eval set "
        "(roles.pretrain); pass eval_set."
      )
  known = eval_set_order(results)
  if eval_set not in known:
    raise KeyError(
      f"eval set {eval_set!r} not in run {results.get('run_id')!r}; evaluated: {known}"
    )
  _, _, values = stage_matrix(results, metric=metric, eval_sets=[eval_set])
  return np.arange(values.shape[0], dtype=np.int64), values[:, 0]

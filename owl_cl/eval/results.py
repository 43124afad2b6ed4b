"""Run results: `results.json` (versioned schema) and `results.md` (the paper's Table 3 layout).

## results.json, schema version 1

```
{
  "schema": "owl_cl.results",        # constant
  "schema_version": 1,
  "run_id": str,                      # required; identifies the run that owns the workdir
  "algorithm": str,                   # required; e.g. "no_replay", "uniform", "swil"
  "config": dict,                     # the run's config (ConfigDict -> dict), {} if absent
  "seed": int | null,
  "status": str | null,               # optional, e.g. "running" / "complete"
  "sequence": [str, ...],             # downstream datasets in training order
  "schedule": str | null,             # 'sequence' (null: the same), 'joint' (one stage named
                                      # 'joint'), 'per_task' (stage i: task i's own model)
  "wall_times": {str: float},         # seconds, e.g. {"total": 812.5, "<stage name>": 60.1}
  "metadata": dict,                   # free form: host, jax version, ...
  "commit": str | null,               # the code that started the run (owl_cl.eval.provenance):
  "dirty": bool | null,               # git HEAD and whether a tracked file differed from it,
  "commit_source": str | null,        # 'git' / 'package metadata' / 'unknown: <why>'; null
                                      # in files written before these were recorded
  "created_at": str, "updated_at": str,   # ISO 8601 UTC, set by write_results
  "roles": {                          # which eval set plays which Table-3 column
    "pretrain":   {"eval_set": str|null, "AP": "AP", "AP50": "AP50"|null, "label": str},
    "open_vocab": {...same...},       # the LVIS stand-in
    "held_out":   {...same...},       # held-out (rare) classes: own set, or e.g. AP key "APr"
    "downstream": [str, ...],         # eval sets averaged into the ODinW-style mean
    "downstream_label": str
  },                                  # input may give `eval_sets` {pretrain, held_out, ...}
                                      # instead; a role given as a str names its eval set
  ...                                 # any other caller key (timings, pretraining, ...) is
                                      # kept verbatim (JSON-sanitised)
  "stages": [                         # stage 0 = after pre-training, stage i = after dataset i
    {"name": str, "index": int, "trained_on": str|null, "wall_time_s": float|null,
     "metrics": {eval_set: {"AP": float|null, "AP50": float|null, "AP75": ..., ...}},
     "provenance": {"commit", "dirty", "commit_source"},   # the code that computed the
                                      # stage (a resumed run's later stages may differ)
     "per_class": {eval_set: {class name: {"category_id": int, "AP": float|null,
                   "AP50": float|null}}},  # AP of each class with ground truth in the set
                                      # (COCO: AP, AP50; LVIS: AP, frequency); absent in
                                      # files written before per-class AP was recorded
     "train": {...},                  # optional training summary of the stage; with replay:
                                      # steps, replayed_images (retrieved), replays_in_loss,
                                      # replay_slots, replay_steps, replay_steps_fraction,
                                      # replay_samples_fraction (paper Table 4),
                                      # loss_adaptivity, loss_threshold
     ...},                            # other stage keys (train metrics, seconds) kept
    ...
  ],
  "summary": {                        # the Table-3 rows (metric values in [0, 1], null = NaN)
    "no_finetuning": ROW, "final": ROW,   # per_task: "final" = each set by its own task's
                                          # model, the other columns the task models' mean
    "own": {"per_set": {set: {"AP", "AP50"}}, "mean_AP", "mean_AP50", "min_AP", "min_AP50"},
                                      # each downstream set right after its own training
    "num_downstream": int, "stages_completed": int, "stages_expected": int|null
  },
  "forgetting": {"AP": F, "AP50": F}, # F = owl_cl.eval.forgetting.forgetting_summary(...)
  "ivlod": {...}                      # optional: the IVLOD metric block (owl_cl.eval.ivlod),
                                      # recomputed from the stages when the input names its
                                      # sets {zero_shot_set, lvis_set, datasets (default: the
                                      # downstream sets)}
}
ROW = {"stage": str, "pretrain_AP", "pretrain_AP50", "open_vocab_AP", "open_vocab_AP50",
       "held_out_AP", "held_out_AP50", "downstream_mean_AP", "downstream_mean_AP50"}
```

Metric values are fractions in [0, 1] (pycocotools' convention); NaN is stored as JSON `null`
(strict JSON has no NaN). `results.md` shows them in % with one decimal, as the paper.
"No fine-tuning" = stage 0, the run's algorithm row = the last stage written.

Writing is atomic (temporary file in the same directory, fsync, `os.replace`) and serialised
by an advisory lock; `write_results` refuses (`ResultsConflictError`) to overwrite files that
belong to another `run_id` and re-writes only its own run's files (e.g. after every stage).

This module completes, writes and reads the schema and merges several runs into one Table 3;
the Table-3 rows and columns are `owl_cl.eval.table3`, the `results.md` text
`owl_cl.eval.results_markdown`, the forgetting / BWT / FWT summaries `owl_cl.eval.forgetting`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import datetime
import json
import math
import os
import re
from typing import Any

import numpy as np

from owl_cl import integrity
from owl_cl.eval import forgetting as forgetting_lib
from owl_cl.eval import ivlod as ivlod_lib
from owl_cl.eval import results_markdown
from owl_cl.eval import table3
from owl_cl.utils import atomic_write_text

SCHEMA = "owl_cl.results"
SCHEMA_VERSION = 1
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
_MD_MARKER = re.compile(r"<!--\s*owl_cl-results\s+run_id=\"([^\"]*)\"")


class ResultsConflictError(FileExistsError):
  """The target results files exist and belong to another run (or cannot be attributed)."""


# ------------------------------------------------------------------------------------------
# Sanitising and schema completion.
# ------------------------------------------------------------------------------------------


def _to_jsonable(value: Any) -> Any:
  """numpy / ConfigDict / NaN -> plain JSON values (NaN and inf -> None)."""
  if hasattr(value, "to_dict") and callable(value.to_dict):  # ml_collections.ConfigDict
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {str(k): _to_jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return _to_jsonable(value.tolist())
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    value = float(value)
    return value if math.isfinite(value) else None
  if value is None or isinstance(value, str):
    return value
  return str(value)


def finalize_results(results: Mapping[str, Any]) -> dict[str, Any]:
  """Validates a results dict and fills the derived schema fields (module docstring).

  Args:
    results: at least {'run_id': str, 'algorithm': str, 'stages': [{'name', 'metrics'}]};
      optional 'config', 'seed', 'sequence', 'wall_times', 'metadata', 'roles'. Metric
      values are fractions in [0, 1] (NaN / None for missing).

  Returns:
    A new JSON-ready dict with 'schema', 'schema_version', normalised 'roles' and 'stages'
    ('index', 'trained_on'), and recomputed 'summary' and 'forgetting' (and 'ivlod' when
    the input has that key, `owl_cl.eval.ivlod`). NaN -> None.

  Raises:
    ValueError: missing/empty run_id or algorithm, no stages, a stage without a name,
      duplicate stage names, an unknown `schedule`.
  """
  for key in ("run_id", "algorithm"):
    if not isinstance(results.get(key), str) or not results.get(key):
      raise ValueError(f"results[{key!r}] must be a non-empty string.")
  stages_in = results.get("stages")
  if not stages_in:
    raise ValueError("results['stages'] must hold at least stage 0 (after pre-training).")
  stages = []
  for i, stage in enumerate(stages_in):
    if not stage.get("name"):
      raise ValueError(f"Stage {i} has no name.")
    out_stage = dict(stage)
    out_stage["index"] = i
    out_stage.setdefault("trained_on", None if i == 0 else stage["name"])
    out_stage.setdefault("wall_time_s", None)
    out_stage["metrics"] = dict(stage.get("metrics") or {})
    stages.append(out_stage)
  names = [s["name"] for s in stages]
  if len(set(names)) != len(names):
    raise ValueError(f"Duplicate stage names: {names}.")
  sequence = [str(s) for s in (results.get("sequence") or [])]
  out = {
    key: value
    for key, value in results.items()
    if key not in ("summary", "forgetting", "eval_sets")
  }
  out.update(
    {
      "schema": SCHEMA,
      "schema_version": SCHEMA_VERSION,
      "run_id": results["run_id"],
      "algorithm": results["algorithm"],
      "config": results.get("config") or {},
      "seed": results.get("seed"),
      "status": results.get("status"),
      "sequence": sequence,
      "wall_times": results.get("wall_times") or {},
      "metadata": results.get("metadata") or {},
      "commit": results.get("commit"),
      "dirty": results.get("dirty"),
      "commit_source": results.get("commit_source"),
      "created_at": results.get("created_at"),
      "updated_at": results.get("updated_at"),
      "roles": table3.normalize_roles(
        results.get("roles") or results.get("eval_sets"), sequence, stages
      ),
      "stages": stages,
    }
  )
  schedule = results.get("schedule")
  if schedule is not None and schedule not in table3.SCHEDULES:
    raise ValueError(f"results['schedule']={schedule!r}; known: {table3.SCHEDULES}.")
  out["summary"] = _summary(stages, out["roles"], sequence, schedule)
  out["forgetting"] = _forgetting(stages, out, schedule)
  spec = results.get("ivlod")
  if isinstance(spec, Mapping):
    out["ivlod"] = ivlod_lib.ivlod_block(
      stages,
      spec.get("datasets") or out["roles"]["downstream"],
      spec.get("zero_shot_set"),
      spec.get("lvis_set"),
    )
  return _to_jsonable(out)


def _summary(stages, roles, sequence, schedule) -> dict[str, Any]:
  """results.json `summary`: the Table-3 rows ("final": `table3.final_stage`'s), each
  downstream set's own-task AP (`table3.own_task_summary`) and the stage counts (a joint run
  has one stage after pre-training)."""
  expected = (2 if schedule == "joint" else len(sequence) + 1) if sequence else None
  return {
    "no_finetuning": table3.table3_row(stages[0], roles),
    "final": table3.table3_row(table3.final_stage(stages, roles, schedule), roles),
    "own": table3.own_task_summary(stages, roles, schedule),
    "num_downstream": len(roles["downstream"]),
    "stages_completed": len(stages),
    "stages_expected": expected,
  }


def _forgetting(stages, out: Mapping[str, Any], schedule) -> dict[str, Any]:
  """results.json `forgetting` per metric (`forgetting_lib.forgetting_summary`). A per-task
  run's matrix is [stage 0, `table3.per_task_stage`] with nothing trained in it: no model
  learns two tasks, so forgetting and BWT are NaN, and "retained" is the task models' mean
  over the pre-trained model's."""
  roles = out["roles"]
  eval_sets = table3.eval_set_order(out)
  if schedule == "per_task" and len(stages) > 1:
    stages = [stages[0], table3.per_task_stage(stages, roles)]
  names = [s["name"] for s in stages]
  keys = [s.get("trained_on") or s["name"] for s in stages]
  downstream = [d for d in roles["downstream"] if d in eval_sets]
  if schedule == "per_task":
    downstream = []
  trained_at = forgetting_lib.trained_at_from_names(keys, eval_sets, downstream=downstream)
  forgetting = {}
  for metric in ("AP", "AP50"):
    A, _, _ = forgetting_lib.accuracy_matrix(stages, eval_sets, metric=metric)
    forgetting[metric] = forgetting_lib.forgetting_summary(A, names, eval_sets, trained_at)
  return forgetting


# ------------------------------------------------------------------------------------------
# Writing.
# ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(workdir: str) -> Iterator[None]:
  """Advisory exclusive lock on `workdir/.results.lock` (no-op where fcntl is missing)."""
  try:
    import fcntl  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover (non-POSIX)
    yield
    return
  fd = os.open(os.path.join(workdir, ".results.lock"), os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _owner_of_json(path: str) -> tuple[str | None, dict[str, Any] | None]:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise ResultsConflictError(
      f"{path} exists but cannot be read ({e}); refusing to overwrite it."
    ) from e
  run_id = data.get("run_id") if isinstance(data, dict) else None
  if not isinstance(run_id, str):
    raise ResultsConflictError(f"{path} exists but has no run_id; refusing to overwrite it.")
  return run_id, data


def _owner_of_md(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      first = f.readline()
  except OSError as e:
    raise ResultsConflictError(f"{path} exists but cannot be read ({e}).") from e
  match = _MD_MARKER.search(first)
  if not match:
    raise ResultsConflictError(
      f"{path} exists but has no owl_cl run marker; refusing to overwrite it."
    )
  return match.group(1)


def set_aside_unreadable(workdir: str) -> list[str]:
  """Moves an unreadable `results.json` / `results.md` of `workdir` aside, for a rebuild.

  For the run that owns `workdir` (its run.json checked first): everything in these files is
  rebuilt from the stage checkpoints by the run's next `write_results`, so a file that cannot
  be parsed (or has no run_id / run marker) is renamed (`integrity.set_aside`:
  `<file>.corrupt-<time>`, never deleted) instead of blocking the resume. A readable file of
  another run is left alone (`write_results` refuses it).

  Returns:
    The new paths of the files moved aside (empty when both were readable or absent).

  Raises:
    OSError: a rename failed.
  """
  moved = []
  for name, owner in ((RESULTS_JSON, _owner_of_json), (RESULTS_MD, _owner_of_md)):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
      continue
    try:
      owner(path)
    except ResultsConflictError as e:
      cause = f"unreadable: {e.__cause__}" if e.__cause__ else "no run_id / run marker"
      moved.append(integrity.set_aside(path, f"{cause}; rebuilt from the checkpoints"))
  return moved


def write_results(workdir: str, results: Mapping[str, Any]) -> dict[str, Any]:
  """Writes `results.json` and `results.md` of one run into `workdir`, atomically.

  Args:
    workdir: the run's directory (created if missing).
    results: see `finalize_results` (at least run_id, algorithm, stages). May be called again
      after every stage: the run's own files are replaced, `created_at` is kept.

  Returns:
    The finalised results dict that was written (NaN stored as None).

  Raises:
    ResultsConflictError (a FileExistsError): `results.json` or `results.md` exists in
      `workdir` and belongs to a different run_id, or its owner cannot be determined. Nothing
      is written in that case.
    ValueError: invalid results (see `finalize_results`).
    OSError: the files could not be written (the previous files are left intact).
  """
  final = finalize_results(results)
  os.makedirs(workdir, exist_ok=True)
  json_path = os.path.join(workdir, RESULTS_JSON)
  md_path = os.path.join(workdir, RESULTS_MD)
  with _locked(workdir):
    created_at = None
    if os.path.exists(json_path):
      owner, old = _owner_of_json(json_path)
      if owner != final["run_id"]:
        raise ResultsConflictError(
          f"{json_path} belongs to run {owner!r}, not {final['run_id']!r}; refusing to "
          "overwrite another run's results."
        )
      created_at = (old or {}).get("created_at")
    if os.path.exists(md_path):
      owner = _owner_of_md(md_path)
      if owner != final["run_id"]:
        raise ResultsConflictError(
          f"{md_path} belongs to run {owner!r}, not {final['run_id']!r}; refusing to "
          "overwrite another run's results."
        )
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    final["created_at"] = created_at or final.get("created_at") or now
    final["updated_at"] = now
    atomic_write_text(json_path, json.dumps(final, indent=2, allow_nan=False) + "\n")
    atomic_write_text(md_path, results_markdown.render_results_markdown(final) + "\n")
  return final


def load_results(path: str) -> dict[str, Any]:
  """Reads a results.json (or the results.json inside a directory) and finalises it.

  Args:
    path: a results.json file or a run directory containing one.

  Returns:
    The finalised results dict (derived fields recomputed, so older files get the current
    summary).

  Raises:
    FileNotFoundError; ValueError: not an owl_cl results file or a newer schema version.
  """
  if os.path.isdir(path):
    path = os.path.join(path, RESULTS_JSON)
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, dict) or data.get("schema") != SCHEMA:
    raise ValueError(f"{path} is not an {SCHEMA} file.")
  if int(data.get("schema_version", 0)) > SCHEMA_VERSION:
    raise ValueError(
      f"{path} has schema_version {data.get('schema_version')}, newer than {SCHEMA_VERSION}."
    )
  return finalize_results(data)


# ------------------------------------------------------------------------------------------
# Several runs -> one Table 3.
# ------------------------------------------------------------------------------------------


def merge_results_tables(paths: Sequence[str], *, group_by_algorithm: bool = True) -> str:
  """One Table 3 (markdown) from several runs' results.json files.

  Args:
    paths: results.json files (or run directories), e.g. the no_replay, uniform and swil runs.
      Row order = order of first appearance of each algorithm.
    group_by_algorithm: average the final rows of runs with the same algorithm (the paper
      averages over dataset orderings; the 'runs' column gives the count), else one row per
      run (labelled `algorithm (run_id)`).

  Returns:
    Markdown: an AP table and an AP50 table (%, one decimal) with a "No fine-tuning" row (mean
    of the runs' stage-0 rows; a note is added if they differ by more than 0.05 points) and
    one row per algorithm (or run); partial runs are flagged.

  Raises:
    ValueError: no paths, or runs whose Table-3 columns use different eval sets.
  """
  if not paths:
    raise ValueError("merge_results_tables needs at least one results file.")
  runs = [load_results(p) for p in paths]
  reference = runs[0]["roles"]

  def signature(roles):
    return (
      [(roles[k]["eval_set"], roles[k]["AP"]) for k in table3.COLUMNS],
      sorted(roles["downstream"]),
    )

  for run in runs[1:]:
    if signature(run["roles"]) != signature(reference):
      raise ValueError(
        f"Run {run['run_id']!r} uses different evaluation sets "
        f"({signature(run['roles'])}) than {runs[0]['run_id']!r} "
        f"({signature(reference)}); refusing to merge."
      )
  groups: dict[str, list[dict[str, Any]]] = {}
  for run in runs:
    key = run["algorithm"] if group_by_algorithm else f"{run['algorithm']} ({run['run_id']})"
    groups.setdefault(key, []).append(run)

  baseline_rows = [r["summary"]["no_finetuning"] for r in runs]
  baseline = table3.mean_rows(baseline_rows)
  spread = 0.0
  for key, _value in baseline.items():
    values = [table3.num(r.get(key)) for r in baseline_rows]
    values = [v for v in values if not math.isnan(v)]
    if values:
      spread = max(spread, max(values) - min(values))

  header = ["Algorithm", "runs"] + results_markdown.column_titles(reference)
  lines: list[str] = []
  for suffix, title in (("AP", "mAP@[.5:.95]"), ("AP50", "AP50")):
    lines += [f"### Table 3 layout: {title} (%) after the final stage", ""]
    rows = [
      ["No fine-tuning", str(len(runs))] + results_markdown.row_cells(baseline, suffix, reference)
    ]
    for label, members in groups.items():
      partial = any(results_markdown.partial_note(m["summary"]) for m in members)
      mean = table3.mean_rows([m["summary"]["final"] for m in members])
      rows.append(
        [label + (" (partial)" if partial else ""), str(len(members))]
        + results_markdown.row_cells(mean, suffix, reference)
      )
    lines += results_markdown.table(header, rows) + [""]
  if spread > 0.0005:
    lines.append(
      f"Note: the runs' after-pre-training (No fine-tuning) values differ by up to "
      f"{100 * spread:.1f} points; the row shows their mean."
    )
    lines.append("")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m owl_cl.eval.results RUN [RUN ...] [--per-run]`: prints one Table 3 (markdown)
  merging the runs' results.json (workdirs or files), e.g. no_replay, uniform and swil.

  Raises:
    SystemExit: bad arguments (argparse); ValueError: see `merge_results_tables`.
  """
  import argparse  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(
    prog="python -m owl_cl.eval.results", description=main.__doc__.splitlines()[0]
  )
  parser.add_argument("runs", nargs="+", help="workdirs or results.json files")
  parser.add_argument(
    "--per-run",
    action="store_true",
    help="one row per run instead of averaging runs of the same algorithm",
  )
  args = parser.parse_args(argv)
  print(merge_results_tables(args.runs, group_by_algorithm=not args.per_run))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

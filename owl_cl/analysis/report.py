"""The report of repeated runs: per-algorithm intervals, paired differences, noise floor, figures.

`python -m owl_cl.report DIR... [--reference uniform] [--stage K] [--out DIR] [--order A,B]`
(docs/experiments.md, "Report"): reads every run below the DIRs (a workdir holds
`results.json`; a sweep folder holds workdirs), refuses incomplete runs and runs of different
configs (other than the swept fields, `SWEPT_FIELDS`), and writes `report.md`, `report.json`
and PNG figures.

* A summary table (`render_summary_table`, the README's): "No fine-tuning" (stage 0) and each
  algorithm's mean ± 95% half-width of the Table 3 stand-ins, tail AP, min own, BWT, kept %.

* Per algorithm and metric (`METRICS`; with IVLOD runs also `IVLOD_METRICS`: Avg, ZCOCO,
  LVIS APr): mean, standard deviation, n and a 95% t-interval.
* Paired differences against the reference algorithm over the runs that share (seeds, task
  order) (`pair_key`): mean difference with its 95% t-interval, the paired t-test and the
  Wilcoxon signed-rank test, and Holm-corrected p-values across the comparisons of each
  metric; the same for every pair of algorithms.
* The noise floor of each metric: the median half-width of the paired-difference intervals
  against the reference (a difference smaller than it is not resolved by this sweep).
* Figures: the pre-training set's AP over the stages per algorithm with interval bands, and
  a forest plot of the paired differences against the reference.

Metrics are in percentage points (results store fractions), wall time in minutes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from owl_cl.analysis import claims
from owl_cl.analysis import ivlod_orders
from owl_cl.analysis import stats
from owl_cl.analysis import wise_ft_curve
from owl_cl.analysis.report_figures import plot_forest
from owl_cl.analysis.report_figures import plot_forgetting_bands
from owl_cl.analysis.report_figures import plot_wise_ft_curve
from owl_cl.eval import ivlod
from owl_cl.eval import results as results_lib
from owl_cl.eval import table3
from owl_cl.utils import atomic_write_text

__all__ = [
  "METRICS",
  "IVLOD_METRICS",
  "SWEPT_FIELDS",
  "ReportError",
  "RunPoint",
  "find_runs",
  "load_points",
  "build_report",
  "render_markdown",
  "plot_forgetting_bands",
  "plot_forest",
  "write_report",
  "main",
]

# (key, label): the Table 3 columns (mAP@[.5:.95]), each dataset's AP right after its own
# training (mean, and the lowest AP50: the plasticity that `per_task` bounds), forgetting,
# BWT, kept %, replayed %, time.
METRICS = (
  ("pretrain_AP", "pre-training set AP"),
  ("open_vocab_AP", "open-vocabulary AP"),
  ("held_out_AP", "held-out AP"),
  # Version 2 of the built-in benchmark: the eval set of its 5 rarest pre-training classes.
  ("tail_AP", "pre-training tail classes AP"),
  ("downstream_mean_AP", "downstream mean AP"),
  ("own_mean_AP", "own-task AP (mean)"),
  ("own_min_AP50", "own-task AP50 (min own)"),
  ("forgetting_AP", "average forgetting (AP)"),
  ("bwt_AP", "backward transfer (AP)"),
  ("kept_AP50", "pre-training AP50 kept (%)"),
  ("replayed", "replayed samples (%)"),
  ("wall_minutes", "wall time (min)"),
)
# The IVLOD block's metrics (owl_cl.eval.ivlod, docs/ivlod.md), reported when some run has
# them (configs/ivlod_odinw13.py): its Avg, ZCOCO and LVIS APr at the reported stage.
IVLOD_METRICS = (
  ("ivlod_Avg", "IVLOD Avg (downstream mean AP)"),
  ("ivlod_ZCOCO", "ZCOCO (COCO val AP)"),
  ("ivlod_LVIS_APr", "LVIS APr"),
)
# Config fields a sweep varies between runs (never part of the compared config): the seeds,
# the order, the run's name and where caches live. `replay` may differ between algorithms
# (each algorithm's settings live there) but not between runs of one algorithm.
SWEPT_FIELDS = (
  "seed",
  "seeds",
  "sequence_seed",
  "task_order",
  "experiment_name",
  "cache_dir",
  "compilation_cache_dir",
)
_ALGORITHM_FIELDS = (
  "replay",
  "train.schedule",
  "train.lwf",
  "train.frozen",
  "train.lora",
  "train.wise_ft",
)
BUILTIN_VERSION_FIELD = "data.builtin.version"
TAIL_EVAL_SET = "pretrain_tail"  # owl_cl.data.builtin.TAIL_DATASET
# The metrics that exist after pre-training (stage 0).
_INITIAL = ("pretrain_AP", "open_vocab_AP", "held_out_AP", "tail_AP", "downstream_mean_AP")
REPORT_MD, REPORT_JSON = "report.md", "report.json"
FIGURE_FORGETTING, FIGURE_FOREST = "forgetting_curves.png", "forest_plot.png"
FIGURE_WISE_FT = "wise_ft_curve.png"


class ReportError(ValueError):
  """Runs that cannot be compared (the message names the run and the field)."""


@dataclasses.dataclass(frozen=True)
class RunPoint:
  """One complete run, reduced to what the report compares.

  Attributes:
    path: its workdir. algorithm: `results['algorithm']`. run_id: its run id.
    pair: `pair_key` (seeds and order): runs of two algorithms with equal keys are paired.
    values: {metric key: float, NaN when the run has no such value}.
    curve: float64 [S]: the pre-training set's AP (points) after each stage.
    initial: {metric key: float}: the evaluations after pre-training (stage 0, the "No
      fine-tuning" row; equal in every run that shares the pre-trained model).
    per_set: {eval set: AP (points)} at the reported stage (empty for a `per_task` run, whose
      last stage holds only its last task's model).
    settings: {dotted config field: value}: its algorithm's settings (the fields under
      `_ALGORITHM_FIELDS`: replay, schedule, lwf, frozen, lora, wise_ft).
  """

  path: str
  algorithm: str
  run_id: str
  pair: str
  values: dict[str, float]
  curve: np.ndarray
  initial: dict[str, float] = dataclasses.field(default_factory=dict)
  per_set: dict[str, float] = dataclasses.field(default_factory=dict)
  settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def find_runs(paths: Sequence[str]) -> list[str]:
  """The workdirs below `paths` (a folder with `results.json`, or any folder under one),
  sorted, each once.

  Raises:
    ReportError: a path that does not exist, or no run at all (names the paths).
  """
  found = []
  for path in paths:
    if not os.path.isdir(path):
      raise ReportError(f"{path}: no such folder (give run workdirs or sweep folders)")
    for folder, dirs, files in os.walk(path):
      dirs.sort()
      if results_lib.RESULTS_JSON in files:
        found.append(os.path.normpath(folder))
        dirs.clear()  # a run's own subfolders (checkpoints, records) hold no runs
  found = sorted(dict.fromkeys(found))
  if not found:
    raise ReportError(f"no {results_lib.RESULTS_JSON} below {list(paths)}")
  return found


def pair_key(results: Mapping[str, Any]) -> str:
  """What two runs must share to be paired: the seeds (`seeds`, else `seed`) and the task
  order (the downstream sequence as trained), as a JSON string."""
  seeds = results.get("seeds") or {"seed": results.get("seed")}
  return json.dumps({"seeds": seeds, "order": list(results.get("sequence") or [])}, sort_keys=True)


def _pct(value: Any) -> float:
  return math.nan if value is None else 100.0 * float(value)


def _stage_index(results: Mapping[str, Any], stage: int | None) -> int:
  """The index in `results['stages']` of `stage` (None: the last, the final evaluations)."""
  return len(results["stages"]) - 1 if stage is None else stage


def _run_values(results: Mapping[str, Any], stage: int | None) -> dict[str, float]:
  stages = results["stages"]
  index = _stage_index(results, stage)
  final = index == len(stages) - 1
  # The final row is the schedule's (a per-task run's: the mean over its task models).
  row = results["summary"]["final"] if final else table3.table3_row(stages[index], results["roles"])
  values = {k: _pct(row[k]) for k in ("pretrain_AP", "open_vocab_AP", "held_out_AP")}
  values["downstream_mean_AP"] = _pct(row["downstream_mean_AP"])
  # NaN for a run without the set (version 1, real data) or a stage that did not evaluate it.
  tail = (stages[index].get("metrics") or {}).get(TAIL_EVAL_SET) or {}
  values["tail_AP"] = _pct(tail.get("AP"))
  own = results["summary"].get("own") or {}
  values["own_mean_AP"] = _pct(own.get("mean_AP")) if final else math.nan
  values["own_min_AP50"] = _pct(own.get("min_AP50")) if final else math.nan
  forgetting = results.get("forgetting") or {}
  ap = forgetting.get("AP") or {}
  # Forgetting, BWT, kept and time describe a whole sequence: final evaluations only.
  values["forgetting_AP"] = _pct(ap.get("average_forgetting")) if final else math.nan
  values["bwt_AP"] = _pct(ap.get("bwt")) if final else math.nan
  pretrain_set = results["roles"]["pretrain"]["eval_set"]
  kept = ((forgetting.get("AP50") or {}).get("per_set") or {}).get(pretrain_set) or {}
  values["kept_AP50"] = _pct(kept.get("retained_fraction")) if final else math.nan
  fractions = [
    s["train"]["replay_samples_fraction"]
    for s in stages[1 : index + 1]
    if (s.get("train") or {}).get("replay_samples_fraction") is not None
  ]
  # The mean over the datasets trained so far of the paper's Table 4 fraction.
  values["replayed"] = 100.0 * float(np.mean(fractions)) if fractions else math.nan
  wall = (results.get("timings") or {}).get("wall_seconds")
  values["wall_minutes"] = float(wall) / 60.0 if wall is not None and final else math.nan
  block = results.get("ivlod")
  row = (
    ivlod.ivlod_row(stages[index], block["datasets"], block["zero_shot_set"], block["lvis_set"])
    if block
    else {}
  )
  for key, _ in IVLOD_METRICS:
    values[key] = _pct(row.get(key.removeprefix("ivlod_")))
  return values


def _per_set(results: Mapping[str, Any], stage: int | None) -> dict[str, float]:
  """{eval set: AP (points)} of the stage (None: the last); {} for a per-task run."""
  if results.get("schedule") == "per_task":
    return {}
  metrics = results["stages"][_stage_index(results, stage)].get("metrics") or {}
  return {name: _pct(m.get("AP")) for name, m in metrics.items() if isinstance(m, Mapping)}


def _metrics(points: Sequence[RunPoint]) -> tuple[tuple[str, str], ...]:
  """`METRICS`, then `IVLOD_METRICS` when some run has an IVLOD value."""
  ivlod_values = [p.values.get(k, math.nan) for p in points for k, _ in IVLOD_METRICS]
  has_ivlod = any(not math.isnan(v) for v in ivlod_values)
  return METRICS + (IVLOD_METRICS if has_ivlod else ())


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def _builtin_version(config: Mapping[str, Any]) -> int | None:
  """The run's built-in benchmark version: `data.builtin.version`, 1 for a config with a
  `data.builtin` section that predates the field, None without one."""
  builtin = (config.get("data") or {}).get("builtin")
  if not isinstance(builtin, Mapping):
    return None
  return builtin.get("version", 1)


def _compared_config(config: Mapping[str, Any], ignore: Sequence[str]) -> dict[str, Any]:
  flat = _flatten(config)
  version = _builtin_version(config)
  if version is not None:  # a run that predates the field ran version 1
    flat[BUILTIN_VERSION_FIELD] = version
  skip = tuple(SWEPT_FIELDS) + tuple(ignore)
  return {k: v for k, v in flat.items() if not any(k == f or k.startswith(f + ".") for f in skip)}


def _differences(a: Mapping[str, Any], b: Mapping[str, Any], fields) -> list[str]:
  keys = sorted(
    k for k in set(a) | set(b) if fields(k) and a.get(k, "<missing>") != b.get(k, "<missing>")
  )
  return [f"{k}={a.get(k, '<missing>')!r} vs {b.get(k, '<missing>')!r}" for k in keys[:5]]


def load_points(
  workdirs: Sequence[str], *, stage: int | None = None, ignore_fields: Sequence[str] = ()
) -> list[RunPoint]:
  """Reads and checks the runs: complete, comparable configs, each (algorithm, pair) once.

  Args:
    workdirs: run folders (`find_runs`).
    stage: None: final evaluations; k: the evaluations after the k-th dataset (0 = after
      pre-training), for every run.
    ignore_fields: further config fields (dotted, a prefix covers its subtree) that may differ.

  Returns:
    [RunPoint] in the order of `workdirs`.

  Raises:
    ReportError: an incomplete run (status not 'complete'), a stage index the run lacks, runs
      of different built-in benchmark versions (a run without the field: version 1), a run
      whose config differs from the first run's outside the swept fields (or, for one
      algorithm, inside `replay`), or two runs of one algorithm with one (seeds, order); each
      message names the run(s) and the first differing fields.
  """
  points, configs, first = [], {}, None
  seen: dict[tuple[str, str], str] = {}
  for workdir in workdirs:
    try:
      results = results_lib.load_results(workdir)
    except (OSError, ValueError) as e:
      raise ReportError(f"{workdir}: cannot read its results ({e})") from None
    if results.get("status") != "complete":
      raise ReportError(
        f"{workdir}: run {results['run_id']!r} is incomplete (status "
        f"{results.get('status')!r}, {results['summary']['stages_completed']} of "
        f"{results['summary']['stages_expected']} stages); finish it (re-run its command) or "
        "leave it out."
      )
    if stage is not None and not 0 <= stage < len(results["stages"]):
      raise ReportError(f"{workdir}: --stage {stage} but the run has {len(results['stages'])}")
    config = _compared_config(results.get("config") or {}, ignore_fields)
    # Checked on the run's own config: --ignore-field never makes two versions comparable.
    version = _builtin_version(results.get("config") or {})
    algorithm = results["algorithm"]
    if first is None:
      first = (workdir, config, version)
    else:
      if version != first[2]:
        raise ReportError(
          f"{workdir}: built-in benchmark version {version} ({BUILTIN_VERSION_FIELD}), "
          f"{first[0]}: version {first[2]}; runs of different benchmark versions are not "
          "comparable: report them separately."
        )
      diff = _differences(first[1], config, lambda k: not k.startswith(_ALGORITHM_FIELDS))
      if diff:
        raise ReportError(
          f"{workdir}: its config differs from {first[0]}'s outside the swept fields "
          f"({'; '.join(diff)}); report them separately or pass --ignore-field."
        )
    if algorithm in configs:
      other, other_config = configs[algorithm]
      diff = _differences(other_config, config, lambda k: k.startswith(_ALGORITHM_FIELDS))
      if diff:
        raise ReportError(
          f"{workdir}: algorithm {algorithm!r} with other replay settings than {other} "
          f"({'; '.join(diff)}); report them separately."
        )
    else:
      configs[algorithm] = (workdir, config)
    key = pair_key(results)
    if (algorithm, key) in seen:
      raise ReportError(
        f"{workdir} and {seen[(algorithm, key)]}: two {algorithm!r} runs with the same seeds and "
        f"order ({key}); keep one."
      )
    seen[(algorithm, key)] = workdir
    curve = np.array(
      [_pct(table3.table3_row(s, results["roles"])["pretrain_AP"]) for s in results["stages"]]
    )
    points.append(
      RunPoint(
        workdir,
        algorithm,
        results["run_id"],
        key,
        _run_values(results, stage),
        curve,
        {k: v for k, v in _run_values(results, 0).items() if k in _INITIAL},
        _per_set(results, stage),
        {k: v for k, v in config.items() if k.startswith(_ALGORITHM_FIELDS)},
      )
    )
  return points


def _finite(values: Sequence[float]) -> list[float]:
  return [v for v in values if not math.isnan(v)]


def _compare(points, a: str, b: str, metric: str) -> dict[str, Any]:
  """Paired difference a - b of `metric` over the pairs where both have a value."""
  va = {p.pair: p.values[metric] for p in points if p.algorithm == a}
  vb = {p.pair: p.values[metric] for p in points if p.algorithm == b}
  pairs = sorted(k for k in va if k in vb and not math.isnan(va[k]) and not math.isnan(vb[k]))
  out = stats.paired_difference([va[k] for k in pairs], [vb[k] for k in pairs])
  out["unpaired_runs"] = len(va) + len(vb) - 2 * len(pairs)
  return out


def _with_holm(comparisons: dict[str, dict[str, dict]], metric_keys) -> None:
  for metric in metric_keys:
    names = list(comparisons)
    adjusted = stats.holm([comparisons[n][metric]["p"] for n in names])
    for name, value in zip(names, adjusted):
      comparisons[name][metric]["p_holm"] = float(value)


def build_report(
  points: Sequence[RunPoint],
  reference: str | None = None,
  *,
  stage: int | None = None,
  plan: claims.Plan | None = None,
) -> dict[str, Any]:
  """The report's numbers (report.json) from checked runs.

  Args:
    points: `load_points`' runs.
    reference: the algorithm every other is compared with; default 'uniform' when present,
      else the first algorithm.
    stage: recorded in the report (None: final evaluations).
    plan: the analysis plan whose comparisons are confirmatory (`claims.PLANS`), or None.

  Returns:
    dict(stage, reference, confidence, metrics {key: label}, algorithms [names, first seen],
    runs [{path, algorithm, run_id, pair}], summary {algorithm: {metric: `stats.summarize`}},
    versus_reference {algorithm: {metric: `stats.paired_difference` + p_holm, unpaired_runs}},
    pairwise {'a - b': {...same...}}, noise_floor {metric: {median, max, comparisons}} (the
    half-widths of the paired intervals against the reference, points), pretrained {metric:
    `stats.summarize`} (stage 0 over the pre-trained models, the "No fine-tuning" row),
    per_set {algorithm: {eval set: `stats.summarize` of its AP}}, curves {algorithm:
    {mean [S], low [S], high [S]}}, with IVLOD runs ivlod_orders {algorithm: {IVLOD metric:
    `ivlod_orders.over_orders`}}, with rows at several WiSE-FT alphas wise_ft_curve
    (`wise_ft_curve.section`), and `claims.sections`' plan, power, variance and
    confirmatory). Holm's correction is over the comparisons of one metric (against the
    reference: the other algorithms; pairwise: every pair); the plan's across its comparisons.

  Raises:
    ReportError: no runs, an unknown reference algorithm, or a plan the runs do not fit.
  """
  if not points:
    raise ReportError("no runs to report")
  algorithms = list(dict.fromkeys(p.algorithm for p in points))
  if reference is None:
    reference = "uniform" if "uniform" in algorithms else algorithms[0]
  if reference not in algorithms:
    raise ReportError(f"--reference {reference!r} has no runs; algorithms: {algorithms}")
  metrics = _metrics(points)
  keys = [k for k, _ in metrics]
  summary = {
    a: {
      m: stats.summarize(_finite([p.values[m] for p in points if p.algorithm == a])) for m in keys
    }
    for a in algorithms
  }
  versus = {
    a: {m: _compare(points, a, reference, m) for m in keys} for a in algorithms if a != reference
  }
  _with_holm(versus, keys)
  pairwise = {
    f"{a} - {b}": {m: _compare(points, a, b, m) for m in keys}
    for i, a in enumerate(algorithms)
    for b in algorithms[i + 1 :]
  }
  _with_holm(pairwise, keys)
  noise = _noise_floor(versus, keys)
  pretrained = _pretrained(points)
  sets = list(dict.fromkeys(name for p in points for name in p.per_set))
  per_set = {
    a: {
      n: stats.summarize(_finite([p.per_set.get(n, math.nan) for p in points if p.algorithm == a]))
      for n in sets
    }
    for a in algorithms
  }
  curves = _curves(points, algorithms)
  # IVLOD runs: each metric also as a mean and spread over the task orders (docs/ivlod.md).
  ivlod_keys = [k for k, _ in IVLOD_METRICS if k in keys]
  extra = {"ivlod_orders": ivlod_orders.by_algorithm(points, ivlod_keys)} if ivlod_keys else {}
  if curve := wise_ft_curve.section(points):  # rows at several WiSE-FT alphas
    extra["wise_ft_curve"] = curve
  out = dict(
    **extra,
    stage="final" if stage is None else stage,
    reference=reference,
    confidence=stats.CONFIDENCE,
    metrics=dict(metrics),
    algorithms=algorithms,
    runs=[dict(path=p.path, algorithm=p.algorithm, run_id=p.run_id, pair=p.pair) for p in points],
    summary=summary,
    versus_reference=versus,
    pairwise=pairwise,
    noise_floor=noise,
    pretrained=pretrained,
    per_set=per_set,
    curves=curves,
  )
  try:
    return {**out, **claims.sections(points, out, plan)}
  except ValueError as e:
    raise ReportError(str(e)) from None


def _noise_floor(versus: dict, keys: Sequence[str]) -> dict[str, dict]:
  """{metric: {median, max, comparisons}} of the paired intervals' half-widths (points)."""
  noise = {}
  for m in keys:
    widths = _finite([versus[a][m]["half_width"] for a in versus])
    noise[m] = dict(
      median=float(np.median(widths)) if widths else math.nan,
      max=float(np.max(widths)) if widths else math.nan,
      comparisons=len(widths),
    )
  return noise


def _curves(points: Sequence[RunPoint], algorithms: Sequence[str]) -> dict[str, dict]:
  """{algorithm: {mean [S], low [S], high [S]}} of the stage curves (runs of one length)."""
  curves = {}
  for a in algorithms:
    lengths = {p.curve.shape[0] for p in points if p.algorithm == a}
    if len(lengths) != 1:
      continue  # runs of different lengths: no common stage axis
    matrix = np.stack([p.curve for p in points if p.algorithm == a])
    cols = [stats.summarize(_finite(matrix[:, s])) for s in range(matrix.shape[1])]
    curves[a] = {k: [c[k] for c in cols] for k in ("mean", "low", "high")}
  return curves


def _pretrained(points: Sequence[RunPoint]) -> dict[str, dict]:
  """`stats.summarize` of each stage-0 metric over the pre-trained models (model seeds), each
  model once: its runs share one evaluation after pre-training, which n runs do not repeat."""
  by_model: dict[str, list[RunPoint]] = {}
  for p in points:
    by_model.setdefault(claims.run_factors(p.pair)[0], []).append(p)
  return {
    m: stats.summarize(
      _finite([float(np.mean([p.initial[m] for p in runs])) for runs in by_model.values()])
    )
    for m in _INITIAL
  }


def _fmt(value: float, digits: int = 2) -> str:
  return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _p(value: float) -> str:
  if value is None or math.isnan(value):
    return "n/a"
  return f"{value:.3g}" if value >= 1e-3 else "<0.001"


_HEADLINE = ("pretrain_AP", "downstream_mean_AP")
# The summary table's columns (the README's): the Table 3 stand-ins, the tail classes, the
# plasticity bound, BWT and kept %; stage 0 has the first five.
SUMMARY_COLUMNS = (
  "pretrain_AP",
  "tail_AP",
  "held_out_AP",
  "downstream_mean_AP",
  "own_min_AP50",
  "bwt_AP",
  "kept_AP50",
)
NO_FINETUNING = "No fine-tuning"


def _cell(summary: Mapping[str, Any] | None) -> str:
  """'mean ± half-width' to 0.1 point; the mean alone with n = 1; '-' without values."""
  if not summary or not summary["n"]:
    return "-"
  hw = summary["half_width"]
  return _fmt(summary["mean"], 1) + ("" if math.isnan(hw) else f" ± {_fmt(hw, 1)}")


def render_summary_table(
  report: Mapping[str, Any], order: Sequence[str] = (), columns: Sequence[str] = SUMMARY_COLUMNS
) -> str:
  """The summary table (markdown, the README's): a "No fine-tuning" row (the evaluations after
  pre-training, n = the pre-trained models), then one row per algorithm in `order` (algorithms
  not named follow in the report's order); each cell the mean ± 95% half-width, n in its own column.

  Raises:
    ReportError: a name in `order` without runs, or an unknown column.
  """
  metrics = report["metrics"]
  unknown = [c for c in columns if c not in metrics]
  missing = [a for a in order if a not in report["algorithms"]]
  if unknown or missing:
    raise ReportError(
      f"summary table: unknown columns {unknown} / algorithms without runs {missing}"
    )
  rows = list(order) + [a for a in report["algorithms"] if a not in order]

  header = ["algorithm", "n"] + [metrics[c] for c in columns]
  lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
  initial = report.get("pretrained") or {}
  n0 = max((s["n"] for s in initial.values()), default=0)
  lines.append(
    "| " + " | ".join([NO_FINETUNING, str(n0)] + [_cell(initial.get(c)) for c in columns]) + " |"
  )
  for a in rows:
    summary = report["summary"][a]
    n = max(summary[c]["n"] for c in columns)
    lines.append("| " + " | ".join([a, str(n)] + [_cell(summary[c]) for c in columns]) + " |")
  return "\n".join(lines) + "\n"


def render_labelled_summary(
  reports: Mapping[str, Mapping[str, Any]],
  order: Sequence[str] = (),
  columns: Sequence[str] = SUMMARY_COLUMNS,
) -> str:
  """One summary table of several reports that cannot share one (e.g. one per model): each
  report's `render_summary_table` rows in the order of `reports`, the first cell prefixed by
  its label ("OWLv2: swil", "OWLv2: No fine-tuning").

  Raises:
    ReportError: as `render_summary_table`, or no reports.
  """
  if not reports:
    raise ReportError("labelled summary: no reports")
  lines: list[str] = []
  for label, report in reports.items():
    table = render_summary_table(report, order, columns).splitlines()
    lines = lines or table[:2]
    lines += [f"| {label}: {row[2:]}" for row in table[2:]]
  return "\n".join(lines) + "\n"


def render_markdown(
  report: Mapping[str, Any], alpha: float = 0.05, order: Sequence[str] = ()
) -> str:
  """report.md: noise floor first, the summary table (`render_summary_table`, rows in `order`),
  then per-algorithm intervals, paired differences against the reference, and the pairs that
  differ (Holm-adjusted p <= `alpha`)."""
  metrics = report["metrics"]
  conf = int(round(100 * report["confidence"]))
  stage = report["stage"]
  when = "final evaluations" if stage == "final" else f"evaluations after stage {stage}"
  lines = ["# Sweep report", ""]
  floor = report["noise_floor"]
  parts = [
    f"{metrics[m]}: {_fmt(floor[m]['median'])} points (max {_fmt(floor[m]['max'])})"
    for m in _HEADLINE
  ]
  lines += [
    f"**Noise floor** (median half-width of the {conf}% paired-difference intervals against "
    f"`{report['reference']}`, over {floor[_HEADLINE[0]]['comparisons']} comparisons): "
    + "; ".join(parts)
    + ". A difference of this size is detected with about 50% power, uncorrected; smaller ones "
    "are not resolved by these runs.",
    "",
    claims.power_sentence(report, _HEADLINE),
    "",
    f"{len(report['runs'])} runs, {len(report['algorithms'])} algorithms, {when}; "
    f"mean ± {conf}% t-interval half-width (n). Metrics in points, wall time in minutes.",
    "",
    "## Summary",
    "",
    render_summary_table(report, order),
  ]
  header = ["algorithm"] + [metrics[m] for m in metrics]
  lines += ["## Per algorithm", "", "| " + " | ".join(header) + " |"]
  lines.append("|" + "---|" * len(header))
  for a in report["algorithms"]:
    cells = [stats.describe(report["summary"][a][m]) for m in metrics]
    lines.append("| " + " | ".join([a] + cells) + " |")
  ivlod_labels = {k: metrics[k] for k, _ in IVLOD_METRICS if k in metrics}
  lines += ["", *ivlod_orders.render_lines(report.get("ivlod_orders") or {}, ivlod_labels)]
  lines += [f"## Paired differences against `{report['reference']}`", ""]
  lines.append(
    "Over the runs that share seeds and order: mean difference ± half-width (n), paired t-test "
    "p, Holm-adjusted p (over the algorithms, per metric), Wilcoxon signed-rank p. Exploratory "
    "unless listed as confirmatory under 'Confirmatory and exploratory claims'."
  )
  lines += [
    "",
    "| algorithm | metric | difference | p | p (Holm) | p (Wilcoxon) |",
    "|---|---|---|---|---|---|",
  ]
  for a, by_metric in report["versus_reference"].items():
    for m in metrics:
      r = by_metric[m]
      lines.append(
        f"| {a} | {metrics[m]} | {stats.describe(r)} | {_p(r['p'])} | {_p(r['p_holm'])} | "
        f"{_p(r['wilcoxon_p'])} |"
      )
  lines += ["", *_per_set_lines(report, order)]
  lines += ["", *wise_ft_curve.render_lines(report)] if report.get("wise_ft_curve") else []
  lines += ["", *claims.pairs_lines(report, alpha)]
  lines += ["", *claims.render_lines(report)]
  return "\n".join(lines)


def _per_set_lines(report: Mapping[str, Any], order: Sequence[str]) -> list[str]:
  """The per-eval-set AP table (mean ± half-width; algorithms in `order`, then the rest)."""
  per_set = report.get("per_set") or {}
  sets = list(dict.fromkeys(n for by_set in per_set.values() for n in by_set))
  if not sets:
    return []
  lines = [
    "## AP per eval set",
    "",
    "Points, mean ± 95% half-width over the runs (`per_task` runs are left out: their last",
    "stage holds only the last task's model).",
    "",
    "| algorithm | " + " | ".join(f"`{n}`" for n in sets) + " |",
    "|---|" + "---:|" * len(sets),
  ]
  for a in list(order) + [a for a in report["algorithms"] if a not in order]:
    cells = [_cell(per_set[a][n]) for n in sets]
    if any(c != "-" for c in cells):
      lines.append(f"| {a} | " + " | ".join(cells) + " |")
  return lines


def _jsonable(value: Any) -> Any:
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (float, np.floating)):
    return float(value) if math.isfinite(value) else None
  if isinstance(value, np.integer):
    return int(value)
  return value


def write_report(
  report: Mapping[str, Any], out_dir: str, order: Sequence[str] = ()
) -> dict[str, str]:
  """Writes report.md (its tables' rows in `order`), report.json and the two figures into
  `out_dir` (each atomically), and the WiSE-FT curve's figure when the report has one.

  Returns:
    {'md' | 'json' | 'forgetting' | 'forest' [| 'wise_ft']: path}.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {
    "md": os.path.join(out_dir, REPORT_MD),
    "json": os.path.join(out_dir, REPORT_JSON),
    "forgetting": os.path.join(out_dir, FIGURE_FORGETTING),
    "forest": os.path.join(out_dir, FIGURE_FOREST),
  }
  atomic_write_text(paths["md"], render_markdown(report, order=order))
  clean = _jsonable(report)  # NaN -> null (strict JSON)
  atomic_write_text(paths["json"], json.dumps(clean, indent=1) + "\n")
  figures = [
    ("forgetting", plot_forgetting_bands(report)),
    ("forest", plot_forest(report, order=order)),
  ]
  if report.get("wise_ft_curve"):
    paths["wise_ft_curve"] = os.path.join(out_dir, FIGURE_WISE_FT)
    figures.append(("wise_ft_curve", plot_wise_ft_curve(report)))
  for key, fig in figures:
    tmp = paths[key] + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, paths[key])
  return paths


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m owl_cl.report DIR... [--reference A] [--stage K] [--out DIR]`: module docstring.

  Returns:
    0, or 2 after printing a `ReportError` (names the run) to stderr.
  """
  import argparse  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(
    prog="python -m owl_cl.report", description=__doc__.splitlines()[0]
  )
  parser.add_argument("dirs", nargs="+", help="run workdirs or sweep folders")
  parser.add_argument("--reference", help="algorithm compared with (default uniform)")
  parser.add_argument("--stage", type=int, help="evaluations after this stage (default final)")
  parser.add_argument("--out", help="output folder (default the first DIR)")
  parser.add_argument(
    "--plan", choices=sorted(claims.PLANS), help="analysis plan: its comparisons confirmatory"
  )
  parser.add_argument(
    "--order", default="", help="summary table's row order: a,b,c (others follow)"
  )
  parser.add_argument(
    "--ignore-field", action="append", default=[], help="config field that may differ (repeatable)"
  )
  args = parser.parse_args(argv)
  try:
    points = load_points(find_runs(args.dirs), stage=args.stage, ignore_fields=args.ignore_field)
    plan = claims.PLANS[args.plan] if args.plan else None
    report = build_report(points, args.reference, stage=args.stage, plan=plan)
    order = [a for a in args.order.split(",") if a]
    markdown = render_markdown(report, order=order)  # refuses an unknown name in --order
  except ReportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  paths = write_report(report, args.out or args.dirs[0], order)
  print(markdown)
  print(f"wrote {', '.join(paths.values())}", file=sys.stderr)
  return 0

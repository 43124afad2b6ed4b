"""What a sweep report may claim: the analysis plan, power, variance components, labels.

`report.build_report(..., plan=...)` adds three entries computed here, and
`report.render_markdown` renders them:

* `power`: beside the noise floor, per metric, the paired difference detectable at 80% power
  (`power.detectable_difference`) under the correction the report uses, over the
  retrieval-vs-reference comparisons only (the baselines of `owl_cl.configs.BASELINES`, whose
  differences from replay are large by construction, left out).
* `variance`: per summary metric, the model / order / residual components of the retrieval
  algorithms' runs (`variance.variance_components`, the algorithm a fixed effect).
* `confirmatory`: the plan's comparisons (`PLANS`, written down before the runs; the design
  is docs/design_round2.md), Holm-corrected across all of them together, every metric
  included; everything else in the report is exploratory. Without a plan every comparison is
  exploratory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import math
from typing import Any

import numpy as np

from owl_cl import configs
from owl_cl.analysis import power
from owl_cl.analysis import stats
from owl_cl.analysis import variance

__all__ = [
  "Comparison",
  "Plan",
  "ROUND2",
  "PLANS",
  "retrieval_algorithms",
  "run_factors",
  "power_section",
  "variance_section",
  "confirmatory_section",
  "sections",
  "render_lines",
]

# `variance.variance_components`' methods that need no note under the table.
PLAIN_VARIANCE_METHODS = ("REML", "pooled within-group variance")
# The metrics whose variance the report decomposes: the primary metrics of the plan's factors
# (docs/design_round2.md) and the plasticity one (each fit costs about 0.06 CPU-s).
VARIANCE_METRICS = ("pretrain_AP", "tail_AP", "downstream_mean_AP")


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One confirmatory comparison: `algorithm` - the plan's reference on `metric` (a key of
  `report.METRICS`), predicted positive, for design factor `factor` (docs/design_round2.md)."""

  factor: str
  algorithm: str
  metric: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """An analysis plan fixed before the runs: its reference and its confirmatory comparisons."""

  name: str
  reference: str
  confirmatory: tuple[Comparison, ...]


# The second design's plan (docs/design_round2.md, "Analysis plan"): one primary metric per
# factor with a directional prediction, Holm's correction across these five together.
ROUND2 = Plan(
  name="round2",
  reference="uniform",
  confirmatory=(
    Comparison("1. similarity-weighted replay", "swil", "pretrain_AP"),
    Comparison("1. similarity-weighted replay", "sw_grasp", "pretrain_AP"),
    Comparison("2. long tail", "uniform_balanced", "tail_AP"),
    Comparison("2. long tail", "swil", "tail_AP"),
    Comparison("2. long tail", "sw_grasp", "tail_AP"),
  ),
)
PLANS = {ROUND2.name: ROUND2}


def retrieval_algorithms(algorithms: Sequence[str]) -> list[str]:
  """The names among `algorithms` that are retrieval algorithms: not a baseline of
  `owl_cl.configs.BASELINES` (`no_replay`, `lwf`, `joint`, ...), nor a row of one: a design's
  row is named by its config, then '(<alpha>)' or '+<blend>(<alpha>)' (launch/designs.py), so
  'wise_ft(0.25)' is the baseline's and 'swil+wise_ft(0.5)' swil's, with WiSE-FT."""
  return [a for a in algorithms if a.split("+")[0].split("(")[0] not in configs.BASELINES]


def run_factors(pair: str) -> tuple[str, str]:
  """(pre-trained model, task order) of a run from its `report.pair_key`: the model seed
  (`seeds.model`, else `seed`) and the downstream sequence as trained, as strings."""
  key = json.loads(pair)
  seeds = key.get("seeds") or {}
  model = seeds.get("model", seeds.get("seed"))
  return str(model), ",".join(key.get("order") or [])


def power_section(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """{metric: dict(median, max (points, NaN without comparisons), comparisons (retrieval vs
  reference), m (the size of the Holm family the report corrects over: every algorithm
  compared with the reference that has a test), n (median pairs))}: the differences
  detectable at `power.POWER` at level `power.ALPHA` / m (Holm's first step)."""
  versus = report["versus_reference"]
  names = retrieval_algorithms(list(versus))
  out = {}
  for metric in report["metrics"]:
    m = sum(1 for a in versus if not math.isnan(versus[a][metric]["p"]))
    found = [
      power.detectable_difference(versus[a][metric]["std"], versus[a][metric]["n"], max(m, 1))
      for a in names
      if versus[a][metric]["n"] >= 2
    ]
    found = [d for d in found if not math.isnan(d)]
    ns = [versus[a][metric]["n"] for a in names]
    out[metric] = dict(
      median=float(np.median(found)) if found else math.nan,
      max=float(np.max(found)) if found else math.nan,
      comparisons=len(found),
      m=m,
      n=int(np.median(ns)) if ns else 0,
    )
  return out


def variance_section(points: Sequence[Any]) -> dict[str, dict[str, Any]]:
  """{metric: `variance.variance_components`} over the retrieval algorithms' runs (`points`:
  `report.RunPoint`s), the algorithm a fixed effect; metrics with fewer than 3 runs left out."""
  keep = set(retrieval_algorithms(list(dict.fromkeys(p.algorithm for p in points))))
  out = {}
  for metric in VARIANCE_METRICS:
    runs = [p for p in points if p.algorithm in keep and not math.isnan(p.values[metric])]
    if len(runs) < 3:
      continue
    factors = [run_factors(p.pair) for p in runs]
    out[metric] = variance.variance_components(
      [p.values[metric] for p in runs],
      [f[0] for f in factors],
      [f[1] for f in factors],
      group=[p.algorithm for p in runs],
    )
  return out


def confirmatory_section(report: Mapping[str, Any], plan: Plan) -> list[dict[str, Any]]:
  """The plan's comparisons, each `report['versus_reference'][algorithm][metric]`'s paired
  difference with `p_holm_plan` (Holm across all the plan's comparisons together) and
  `detectable` (points, at 80% power and level alpha / len(plan)).

  Raises:
    ValueError: the report's reference is not the plan's, or a comparison without runs.
  """
  if report["reference"] != plan.reference:
    raise ValueError(
      f"plan {plan.name!r} compares with {plan.reference!r}, the report with "
      f"{report['reference']!r}: pass --reference {plan.reference}"
    )
  rows = []
  for c in plan.confirmatory:
    if c.algorithm not in report["versus_reference"] or c.metric not in report["metrics"]:
      raise ValueError(f"plan {plan.name!r}: no runs of {c.algorithm!r} with {c.metric!r}")
    r = report["versus_reference"][c.algorithm][c.metric]
    m = len(plan.confirmatory)
    rows.append(
      dict(
        dataclasses.asdict(c),
        **r,
        detectable=power.detectable_difference(r["std"], r["n"], m),
      )
    )
  adjusted = stats.holm([r["p"] for r in rows])
  for row, p in zip(rows, adjusted):
    row["p_holm_plan"] = float(p)
  return rows


def sections(points: Sequence[Any], report: Mapping[str, Any], plan: Plan | None) -> dict:
  """The report's entries `plan` (name or None), `power`, `variance` and `confirmatory`
  ([] without a plan)."""
  return dict(
    plan=plan.name if plan else None,
    power=power_section(report),
    variance=variance_section(points),
    confirmatory=confirmatory_section(report, plan) if plan else [],
  )


def _fmt(value: float, digits: int = 2) -> str:
  return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def power_sentence(report: Mapping[str, Any], metrics: Sequence[str]) -> str:
  """The line beside the noise floor: the detectable differences of `metrics`."""
  found = report["power"]
  parts = [
    f"{report['metrics'][m]}: {_fmt(found[m]['median'])} points (max {_fmt(found[m]['max'])}; "
    f"Holm over m = {found[m]['m']}, n = {found[m]['n']})"
    for m in metrics
  ]
  return (
    f"**Detectable at {int(100 * power.POWER)}% power** (two-sided paired t-test at level "
    f"{power.ALPHA} / m, Holm's first step; median over the "
    f"{found[metrics[0]]['comparisons']} retrieval-vs-`{report['reference']}` comparisons, "
    "baselines left out): " + "; ".join(parts) + "."
  )


def pairs_lines(report: Mapping[str, Any], alpha: float = 0.05) -> list[str]:
  """'Pairs that differ': per metric (every one), the pairs of retrieval algorithms whose
  Holm-adjusted p (over all pairs of the metric) is <= alpha, each with its difference, then
  how many of the pairs with a baseline differ; report.json's `pairwise` holds every pair."""
  metrics = report["metrics"]
  retrieval = set(retrieval_algorithms(report["algorithms"]))
  total = len(report["pairwise"])
  lines = [
    f"## Pairs that differ (Holm-adjusted p <= {alpha} over all {total} pairs, every metric; "
    "exploratory)",
    "",
    "Pairs of retrieval algorithms by name; pairs with a baseline counted. report.json "
    "(`pairwise`) holds every pair's difference, p and Holm-adjusted p.",
    "",
  ]
  for m in metrics:
    named, baseline, with_baseline = [], 0, 0
    for name, r in report["pairwise"].items():
      pair_is_retrieval = set(name.split(" - ")) <= retrieval
      with_baseline += not pair_is_retrieval
      if math.isnan(r[m]["p_holm"]) or r[m]["p_holm"] > alpha:
        continue
      if pair_is_retrieval:
        named.append(f"{name} ({stats.describe(r[m])}, p Holm {_fmt(r[m]['p_holm'], 3)})")
      else:
        baseline += 1
    text = "; ".join(named) if named else "none"
    lines.append(
      f"- {metrics[m]}: retrieval pairs: {text}; pairs with a baseline: {baseline} of "
      f"{with_baseline}"
    )
  return lines


def render_lines(report: Mapping[str, Any]) -> list[str]:
  """The markdown of the claims' label, the confirmatory table and the variance components."""
  lines = ["## Confirmatory and exploratory claims", ""]
  rows = report.get("confirmatory") or []
  if not report.get("plan"):
    lines += [
      "No analysis plan was given (`--plan`): every comparison in this report is exploratory.",
      "",
    ]
  else:
    lines += [
      f"Plan `{report['plan']}` (docs/design_round2.md), fixed before the runs: its "
      f"{len(rows)} comparisons are **confirmatory**, Holm-corrected across all of them "
      "together; every other comparison in this report is **exploratory**.",
      "",
      "| factor | comparison | metric | difference | p (Holm, plan) | detectable (80%) |",
      "|---|---|---|---|---|---|",
    ]
    for r in rows:
      lines.append(
        f"| {r['factor']} | {r['algorithm']} - {report['reference']} | "
        f"{report['metrics'][r['metric']]} | {stats.describe(r)} | {_fmt(r['p_holm_plan'], 3)} "
        f"| {_fmt(r['detectable'])} |"
      )
    lines.append("")
  lines += _variance_lines(report)
  return lines


def _variance_lines(report: Mapping[str, Any]) -> list[str]:
  found = report.get("variance") or {}
  if not found:
    return []
  first = next(iter(found.values()))
  lines = [
    "## Variance components (exploratory)",
    "",
    f"Retrieval algorithms' runs, {first['models']} pre-trained model(s) x {first['orders']} "
    "order(s): REML estimates of a mixed model with crossed random intercepts for the model "
    "seed and the task order and the algorithm as a fixed effect (`owl_cl.analysis.variance`); "
    "variance in points², its share in parentheses; n/a: one level, not estimable.",
    "",
    "| metric | n | model | order | residual |",
    "|---|---:|---:|---:|---:|",
  ]
  for metric, r in found.items():
    cells = [
      f"{_fmt(r['variance'][c])} ({_fmt(100 * r['fraction'][c], 0)}%)"
      if not math.isnan(r["variance"][c])
      else "n/a"
      for c in variance.COMPONENTS
    ]
    lines.append(f"| {report['metrics'][metric]} | {r['n']} | " + " | ".join(cells) + " |")
  lines.append("")
  # A fit to read with care: statsmodels' last iterate when REML did not converge, or a
  # method other than the plain fit (confounded factors, a singular fit).
  flagged = [
    f"- {report['metrics'][m]}: "
    + "; ".join(
      ([] if r["converged"] else ["the REML fit did not converge (its last iterate is shown)"])
      + ([r["method"]] if r["method"] not in PLAIN_VARIANCE_METHODS else [])
    )
    for m, r in found.items()
    if not r["converged"] or r["method"] not in PLAIN_VARIANCE_METHODS
  ]
  return lines + flagged + ([""] if flagged else [])

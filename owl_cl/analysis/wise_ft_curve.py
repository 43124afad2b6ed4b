"""WiSE-FT's retention / plasticity trade-off over its mixing coefficient alpha, for the report.

WiSE-FT (Wortsman et al., CVPR 2022, eq. 1; `owl_cl.train.wise_ft`) blends the fine-tuned
parameters with the pre-trained ones, (1 - alpha) x pre-trained + alpha x fine-tuned: alpha 1
is fine-tuning without the blend, alpha 0 the pre-trained model. A sweep that runs one
setting (e.g. `no_replay`, or `swil`) at several alphas traces a curve: retention, the
pre-training set's AP, against plasticity, the downstream mean AP (docs/design_round2.md).

`section(points)` groups the report's rows by their algorithm settings other than
`train.wise_ft` (`report.RunPoint.settings`): the rows of one group differ only in the blend.
A group with a row at alpha < 1 is a curve; its row at alpha 1 (no blend), when the sweep
has one, is the curve's end and the baseline of its paired differences. Every number is
over the rows' runs at the report's stage, in points: mean ± 95% t-interval half-width
(`stats.summarize`), and the paired difference from the alpha-1 row over the (seeds, order)
pairs both have (`stats.paired_difference`). Exploratory: no plan names a comparison here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import json
import math
from typing import Any

from owl_cl.analysis import stats

__all__ = ["AXES", "section", "render_lines"]

# (metric key of `report.METRICS`, role): the curve's two axes.
AXES = (("pretrain_AP", "retention"), ("downstream_mean_AP", "plasticity"))
_PREFIX = "train.wise_ft."


def _blend(settings: Mapping[str, Any]) -> tuple[float, str]:
  """(alpha, when) of a row's settings; a run without the section (older) has alpha 1."""
  alpha = float(settings.get(_PREFIX + "alpha", 1.0))
  return alpha, str(settings.get(_PREFIX + "when", "each")) if alpha < 1.0 else ""


def _values(points: Sequence[Any], algorithm: str, metric: str) -> dict[str, float]:
  """{pair: value} of the algorithm's runs with a finite value of `metric`."""
  found = {p.pair: p.values[metric] for p in points if p.algorithm == algorithm}
  return {k: v for k, v in found.items() if not math.isnan(v)}


def _row(points: Sequence[Any], algorithm: str, alpha: float, end: str | None) -> dict:
  row: dict[str, Any] = dict(algorithm=algorithm, alpha=alpha)
  for metric, role in AXES:
    mine = _values(points, algorithm, metric)
    row[role] = stats.summarize(list(mine.values()))
    if end is None or end == algorithm:
      continue
    theirs = _values(points, end, metric)
    pairs = sorted(k for k in mine if k in theirs)
    row[f"{role}_difference"] = stats.paired_difference(
      [mine[k] for k in pairs], [theirs[k] for k in pairs]
    )
  return row


def section(points: Sequence[Any]) -> list[dict[str, Any]]:
  """The WiSE-FT curves of the report's runs (module docstring).

  Args:
    points: `report.RunPoint`s (each with `settings`: its algorithm settings, flattened).

  Returns:
    [dict(label, when, end, rows)], one per curve in the order of first appearance: `label`
    the alpha-1 row's name (else the first row's), `when` the blend's `train.wise_ft.when`,
    `end` the alpha-1 row or None, `rows` sorted by alpha (ties by name): dict(algorithm,
    alpha, retention, plasticity: `stats.summarize`, and for rows other than `end`
    retention_difference, plasticity_difference: `stats.paired_difference` row - end).
    [] when no run blends.
  """
  info: dict[str, tuple[str, float, str]] = {}  # algorithm -> (base, alpha, when)
  for p in points:
    if p.algorithm not in info:
      base = {k: v for k, v in p.settings.items() if not k.startswith(_PREFIX)}
      info[p.algorithm] = (json.dumps(base, sort_keys=True, default=str), *_blend(p.settings))
  blended: dict[tuple[str, str], list[str]] = {}
  for a, (base, alpha, when) in info.items():
    if alpha < 1.0:
      blended.setdefault((base, when), []).append(a)
  curves = []
  for (base, when), names in blended.items():
    ends = [a for a, (b, alpha, _) in info.items() if b == base and alpha == 1.0]
    end = ends[0] if ends else None
    names = sorted(names, key=lambda a: (info[a][1], a)) + ([end] if end else [])
    rows = [_row(points, a, info[a][1], end) for a in names]
    curves.append(dict(label=end or names[0], when=when, end=end, rows=rows))
  return curves


def _cell(summary: Mapping[str, Any] | None) -> str:
  """'mean ± half-width' to 0.1 point (the mean alone with n = 1; '-' without values)."""
  if not summary or not summary["n"]:
    return "-"
  hw = summary["half_width"]
  return f"{summary['mean']:.1f}" + ("" if math.isnan(hw) else f" ± {hw:.1f}")


def render_lines(report: Mapping[str, Any]) -> list[str]:
  """report.md's section of the curves (`report['wise_ft_curve']`); [] without one."""
  curves = report.get("wise_ft_curve") or []
  if not curves:
    return []
  conf = int(round(100 * report["confidence"]))
  lines = [
    "## WiSE-FT: retention and plasticity over alpha (exploratory)",
    "",
    "Retention: pre-training set AP; plasticity: downstream mean AP; points, mean ± "
    f"{conf}% t-interval half-width over the runs (n), and the paired difference from the "
    "curve's row without the blend (alpha 1) over the (seeds, order) pairs both have. Alpha 0 "
    "is the pre-trained model (the summary's 'No fine-tuning' row). Figure: "
    "`wise_ft_curve.png`.",
    "",
    "| curve | row | alpha | n | retention | plasticity | retention vs alpha 1 | "
    "plasticity vs alpha 1 |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for c in curves:
    label = c["label"] + (f" (when: {c['when']})" if c["when"] != "each" else "")
    for r in c["rows"]:
      n = max(r[role]["n"] for _, role in AXES)
      diffs = [_cell(r.get(f"{role}_difference")) for _, role in AXES]
      cells = [label, r["algorithm"], f"{r['alpha']:g}", str(n)]
      cells += [_cell(r[role]) for _, role in AXES] + diffs
      lines.append("| " + " | ".join(cells) + " |")
  return lines

"""An IVLOD result as a mean and spread over the task orders, never one number (docs/ivlod.md).

In ZiRa's and DitHub's released code the task order alone moves the ODinW-13 Avg by about
1.3-1.6 AP (chiara-cap/DitHub issue #2: 57.87 and 56.60 under two orders; JarintotionDin/
ZiRaGroundingDINO issue #5), so one run, one order, does not say how a method does. The sweep
report (`owl_cl.analysis.report`) gives, per algorithm and IVLOD metric: the mean over the
task orders of the per-order means (the runs of one order, other seeds, averaged first, so an
order with more seeds does not weigh more), the standard deviation over the orders, their
minimum and maximum, and how many orders and runs. With one order the spread is NaN and the
table says "1 order: not an IVLOD result".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import json
import math
from typing import Any

import numpy as np

__all__ = ["over_orders", "by_algorithm", "render_lines"]


def over_orders(values: Sequence[tuple[str, float]]) -> dict[str, Any]:
  """One algorithm's metric summarised over task orders.

  Args:
    values: (order key, value) per run, in the metric's units (points); NaN values (a run
      without the metric) are left out.

  Returns:
    dict(orders: int, runs: int, mean, std (ddof 1, over the per-order means), min, max:
    floats, per_order {order key: mean of its runs}); std NaN with fewer than 2 orders;
    mean, min and max NaN with none.
  """
  groups: dict[str, list[float]] = {}
  for order, value in values:
    if not math.isnan(value):
      groups.setdefault(order, []).append(float(value))
  per_order = {order: float(np.mean(v)) for order, v in groups.items()}
  x = np.array(list(per_order.values()), np.float64)
  nan = math.nan
  return dict(
    orders=int(x.size),
    runs=sum(len(v) for v in groups.values()),
    mean=float(x.mean()) if x.size else nan,
    std=float(x.std(ddof=1)) if x.size > 1 else nan,
    min=float(x.min()) if x.size else nan,
    max=float(x.max()) if x.size else nan,
    per_order=per_order,
  )


def _order_of(pair: str) -> str:
  """The task order (the sequence as trained) of a `report.pair_key` string, as JSON."""
  return json.dumps(json.loads(pair).get("order") or [])


def by_algorithm(points: Sequence[Any], metric_keys: Sequence[str]) -> dict[str, dict]:
  """{algorithm: {metric: `over_orders`}} of `report.RunPoint`s (their `pair` names the
  order, their `values` the metrics), algorithms in first-seen order; {} for no metric."""
  out: dict[str, dict] = {}
  for algorithm in dict.fromkeys(p.algorithm for p in points):
    runs = [p for p in points if p.algorithm == algorithm]
    out[algorithm] = {
      m: over_orders([(_order_of(p.pair), p.values.get(m, math.nan)) for p in runs])
      for m in metric_keys
    }
  return out


def _cell(s: Mapping[str, Any]) -> str:
  if s["orders"] == 0:
    return "-"
  if s["orders"] == 1:
    return f"{s['mean']:.2f} (1 order: not an IVLOD result)"
  return f"{s['mean']:.2f} ± {s['std']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"


def render_lines(section: Mapping[str, Mapping[str, Mapping]], labels: Mapping[str, str]):
  """report.md's "IVLOD over task orders" section of `by_algorithm`'s result (`labels`: metric
  key -> column title); [] when no algorithm has an IVLOD value."""
  if not any(s["orders"] for by in section.values() for s in by.values()):
    return []
  metrics = list(labels)
  lines = [
    "## IVLOD over task orders",
    "",
    "Points: mean over the task orders ± standard deviation over the orders [min, max]; the "
    "runs of one order (other seeds) are averaged first. The order alone moves the references' "
    "Avg by about 1.3-1.6 AP (docs/ivlod.md): one order is not an IVLOD result.",
    "",
    "| algorithm | orders (runs) | " + " | ".join(labels[m] for m in metrics) + " |",
    "|---|---:|" + "---:|" * len(metrics),
  ]
  for algorithm, by in section.items():
    first = by[metrics[0]]
    cells = [_cell(by[m]) for m in metrics]
    lines.append(
      f"| {algorithm} | {first['orders']} ({first['runs']}) | " + " | ".join(cells) + " |"
    )
  return lines + [""]

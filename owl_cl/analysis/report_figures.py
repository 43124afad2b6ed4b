"""The sweep report's figures (`owl_cl.analysis.report`): forgetting bands, a forest plot and
WiSE-FT's retention / plasticity curve.

Matplotlib on an Agg canvas (no display); each function takes a `report.build_report` dict and
returns the Figure, which `report.write_report` saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np

__all__ = ["plot_forgetting_bands", "plot_forest", "plot_wise_ft_curve"]


def _figure(width: float, height: float) -> Figure:
  fig = Figure(figsize=(width, height), layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def plot_forgetting_bands(report: Mapping[str, Any]) -> Figure:
  """The pre-training set's AP (points) after each stage: per algorithm its mean over runs and
  its t-interval as a band (stage 0 = after pre-training)."""
  fig = _figure(6.4, 4.0)
  ax = fig.add_subplot()
  for a, c in report["curves"].items():
    # Stages that did not evaluate the set (`eval.pretraining_sets_after_each_dataset` off)
    # are skipped: the line joins the stages that did.
    mean = np.asarray(c["mean"], float)
    x = np.flatnonzero(np.isfinite(mean))
    line = ax.plot(x, mean[x], marker="o", label=a)[0]
    low, high = np.asarray(c["low"], float)[x], np.asarray(c["high"], float)[x]
    if np.isfinite(low).any():
      ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
  ax.set_xlabel("stage (0 = after pre-training, i = after the i-th dataset)")
  ax.set_ylabel("pre-training set AP (points)")
  ax.set_title(f"Forgetting: mean and {int(round(100 * report['confidence']))}% interval")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig


def plot_forest(
  report: Mapping[str, Any],
  metrics: Sequence[str] = ("pretrain_AP", "downstream_mean_AP"),
  order: Sequence[str] = (),
) -> Figure:
  """Forest plot: each algorithm's paired difference from the reference (points) with its
  interval, one panel per metric, a vertical line at 0; rows top-down in `order` (the others
  after)."""
  versus = report["versus_reference"]
  ordered = [a for a in order if a in versus] + [a for a in versus if a not in order]
  names = ordered[::-1]  # the y axis grows upwards: the first name on top
  fig = _figure(4.0 * len(metrics), 1.0 + 0.35 * max(1, len(names)))
  axes = fig.subplots(1, len(metrics), squeeze=False)[0]
  for ax, m in zip(axes, metrics):
    y = np.arange(len(names))
    means = np.array([versus[n][m]["mean"] for n in names], float)
    half = np.array([versus[n][m]["half_width"] for n in names], float)
    ax.errorbar(means, y, xerr=np.nan_to_num(half), fmt="o", capsize=3)
    ax.axvline(0.0, color="k", linewidth=0.8)
    ax.set_yticks(y, names)
    ax.set_xlabel(f"difference from {report['reference']} (points)")
    ax.set_title(report["metrics"][m], fontsize=9)
    ax.grid(alpha=0.3, axis="x")
  return fig


def plot_wise_ft_curve(report: Mapping[str, Any]) -> Figure:
  """WiSE-FT's trade-off (`report['wise_ft_curve']`, `owl_cl.analysis.wise_ft_curve`): per
  curve, retention (pre-training set AP, y) against plasticity (downstream mean AP, x), points,
  each row's mean with its interval on both axes, joined in the order of alpha and labelled
  with it; the pre-trained model (alpha 0, `report['pretrained']`) as a star."""
  fig = _figure(5.6, 4.4)
  ax = fig.add_subplot()
  for curve in report["wise_ft_curve"]:
    rows = curve["rows"]
    x = np.array([r["plasticity"]["mean"] for r in rows], float)
    y = np.array([r["retention"]["mean"] for r in rows], float)
    xerr = np.nan_to_num([r["plasticity"]["half_width"] for r in rows])
    yerr = np.nan_to_num([r["retention"]["half_width"] for r in rows])
    ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o-", capsize=3, label=curve["label"])
    for r, xi, yi in zip(rows, x, y):
      ax.annotate(f"{r['alpha']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4))
  initial = report.get("pretrained") or {}
  if "pretrain_AP" in initial and "downstream_mean_AP" in initial:
    x0, y0 = initial["downstream_mean_AP"]["mean"], initial["pretrain_AP"]["mean"]
    ax.plot([x0], [y0], "k*", markersize=10, label="pre-trained (alpha 0)")
  ax.set_xlabel("plasticity: downstream mean AP (points)")
  ax.set_ylabel("retention: pre-training set AP (points)")
  conf = int(round(100 * report["confidence"]))
  ax.set_title(f"WiSE-FT over alpha: mean and {conf}% intervals", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig

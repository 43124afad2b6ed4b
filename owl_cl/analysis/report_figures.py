"""The sweep report's figures (`owl_cl.analysis.report`): forgetting bands and a forest plot.

Matplotlib on an Agg canvas (no display); each function takes a `report.build_report` dict and
returns the Figure, which `report.write_report` saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np

__all__ = ["plot_forgetting_bands", "plot_forest"]


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

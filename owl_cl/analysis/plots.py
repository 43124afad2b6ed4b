"""Figures of a run: per-stage heat map, forgetting curves, retrieval records (paper Figs. 3-5).

Every function returns a new `matplotlib.figure.Figure` attached to an Agg canvas (no
pyplot, no display, no global backend change): save it with `fig.savefig('x.png')`, or show
it in a notebook with `display(fig)`. Values are shown in % (results store fractions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np

from owl_cl.analysis import runs as runs_lib


def _figure(width: float, height: float) -> Figure:
  fig = Figure(figsize=(width, height), layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _results_of(run: Any) -> Mapping[str, Any]:
  return run.results if isinstance(run, runs_lib.Run) else run


def _label_of(run: Any) -> str:
  if isinstance(run, runs_lib.Run):
    return run.label
  return f"{run['algorithm']} ({run['run_id']})"


def plot_stage_heatmap(
  results: Mapping[str, Any], metric: str = "AP50", title: str | None = None
) -> Figure:
  """Heat map of the per-stage, per-eval-set metric (`stage_matrix`), cells annotated in %.

  Args:
    results: a results dict (or a `Run`).
    metric: cell metric, e.g. 'AP' or 'AP50'.
    title: axes title; default `<algorithm>: <metric> (%) after each stage`.

  Returns:
    Figure with 2 axes (the matrix [S rows, E columns], its colour bar); NaN cells are blank
    and annotated '-'.
  """
  results = _results_of(results)
  rows, columns, values = runs_lib.stage_matrix(results, metric=metric)
  fig = _figure(1.2 + 0.9 * len(columns), 1.2 + 0.45 * len(rows))
  ax = fig.add_subplot()
  image = ax.imshow(
    np.ma.masked_invalid(100 * values),
    cmap="viridis",
    vmin=0,
    vmax=max(1.0, float(np.nanmax(100 * values, initial=0.0))),
    aspect="auto",
  )
  ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right")
  ax.set_yticks(range(len(rows)), rows)
  ax.set_xlabel("evaluation set")
  ax.set_ylabel("after stage (trained on)")
  for i in range(values.shape[0]):
    for j in range(values.shape[1]):
      v = values[i, j]
      ax.text(
        j,
        i,
        "-" if np.isnan(v) else f"{100 * v:.1f}",
        ha="center",
        va="center",
        fontsize=8,
        color="w" if np.isnan(v) or v < 0.6 * np.nanmax(values) else "k",
      )
  ax.set_title(title or f"{results['algorithm']}: {metric} (%) after each stage")
  fig.colorbar(image, ax=ax, label=f"{metric} (%)")
  return fig


def plot_forgetting_curves(
  runs: Sequence[Any],
  eval_set: str | None = None,
  metric: str = "AP",
  labels: Sequence[str] | None = None,
) -> Figure:
  """One eval set's metric over the stages for several runs (the paper's forgetting view:
  pre-training AP after each downstream dataset, no_replay vs replay algorithms).

  Args:
    runs: `Run`s or results dicts.
    eval_set: default each run's pre-training set (`forgetting_curve`).
    metric: e.g. 'AP', 'AP50', 'APr'.
    labels: legend labels [len(runs)]; default `<algorithm> (<workdir or run_id>)`.

  Returns:
    Figure with 1 axes and one line per run (x: stage index, 0 = after pre-training;
    y: metric in %).

  Raises:
    ValueError: no runs, or len(labels) != len(runs); KeyError: see `forgetting_curve`.
  """
  if not runs:
    raise ValueError("plot_forgetting_curves needs at least one run.")
  if labels is not None and len(labels) != len(runs):
    raise ValueError(f"{len(labels)} labels for {len(runs)} runs.")
  fig = _figure(6.4, 4.0)
  ax = fig.add_subplot()
  names = []
  for n, run in enumerate(runs):
    results = _results_of(run)
    stages, values = runs_lib.forgetting_curve(results, eval_set, metric=metric)
    names.append(eval_set or results["roles"]["pretrain"]["eval_set"])
    ax.plot(
      stages, 100 * values, marker="o", label=labels[n] if labels is not None else _label_of(run)
    )
  ax.set_xlabel("stage (0 = after pre-training, i = after the i-th dataset)")
  ax.set_ylabel(f"{metric} (%)")
  ax.set_title(f"{metric} on {', '.join(dict.fromkeys(names))} over the sequence")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig


def plot_sampled_classes(
  records: Mapping[str, np.ndarray],
  class_names: Sequence[str] | None = None,
  title: str = "Replays per buffer class",
) -> Figure:
  """Bar chart of how often each buffer class was the class step's choice (paper Fig. 4's
  view of SWIL's class preference; uniform_balanced gives a flat chart).

  Args:
    records: one dataset's records (`Run.records[name]`); uses `sampled_class_counts` [C].
    class_names: [C] tick labels; default class indices.
    title: axes title.

  Returns:
    Figure with 1 axes and C bars (counts).

  Raises:
    ValueError: len(class_names) != C.
  """
  counts = np.asarray(records["sampled_class_counts"])
  if class_names is not None and len(class_names) != counts.shape[0]:
    raise ValueError(
      f"{len(class_names)} class names for {counts.shape[0]} classes (sampled_class_counts)."
    )
  fig = _figure(max(4.0, 0.12 * counts.shape[0] + 2), 3.5)
  ax = fig.add_subplot()
  ax.bar(np.arange(counts.shape[0]), counts, width=0.9)
  if class_names is not None:
    ax.set_xticks(range(counts.shape[0]), class_names, rotation=90, fontsize=6)
  ax.set_xlabel("buffer class")
  ax.set_ylabel("replays")
  ax.set_title(f"{title} (total {int(counts.sum())})")
  return fig


def _histogram_bars(ax, edges: np.ndarray, counts: np.ndarray) -> None:
  edges = np.asarray(edges, np.float64)
  ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge")


def plot_entropy_histograms(records: Mapping[str, np.ndarray]) -> Figure:
  """Histograms of normalised entropies H(p) / log(support) of the SWIL class distributions
  (one per new image) and the GRASP within-class distributions (one per replay).

  Args:
    records: one dataset's records; uses `entropy_bin_edges` [51] over [0, 1],
      `swil_entropy_counts` [50], `grasp_entropy_counts` [50], `used_grasp` [2] (A-SW-GRASP
      slots served by SWIL / GRASP, shown in the title when non-zero).

  Returns:
    Figure with 2 axes (SWIL, GRASP), 50 bars each.

  Source: paper Figure 3 (GRASP) and Figure 4 (SWIL), section "Analysis".
  """
  fig = _figure(8.0, 3.2)
  axes = fig.subplots(1, 2)
  for ax, key, name in (
    (axes[0], "swil_entropy_counts", "SWIL (over classes)"),
    (axes[1], "grasp_entropy_counts", "GRASP (over samples in a class)"),
  ):
    counts = np.asarray(records[key])
    _histogram_bars(ax, records["entropy_bin_edges"], counts)
    ax.set_xlim(0, 1)
    ax.set_xlabel("normalised entropy")
    ax.set_ylabel("distributions")
    ax.set_title(f"{name}, n = {int(counts.sum())}", fontsize=9)
  used = np.asarray(records["used_grasp"])
  if used.sum():
    fig.suptitle(f"A-SW-GRASP: {int(used[1])} of {int(used.sum())} replays used GRASP", fontsize=9)
  return fig


def plot_knn_sv_histogram(records: Mapping[str, np.ndarray]) -> Figure:
  """Histogram of the right-term KNN-SVs of valid ASER candidates.

  Args:
    records: one dataset's records; uses `knn_sv_bin_edges` [401] over [-0.1, 0.1] (values
      outside are counted in the end bins) and `knn_sv_counts` [400].

  Returns:
    Figure with 1 axes and 400 bars.

  Source: paper Figure 5 (left).
  """
  fig = _figure(6.0, 3.2)
  ax = fig.add_subplot()
  counts = np.asarray(records["knn_sv_counts"])
  _histogram_bars(ax, records["knn_sv_bin_edges"], counts)
  ax.set_xlabel("KNN-SV")
  ax.set_ylabel("candidates")
  ax.set_title(f"KNN-SVs of candidates, n = {int(counts.sum())}", fontsize=9)
  return fig


def plot_distance_ranks(records: Mapping[str, np.ndarray]) -> Figure:
  """Histograms of distance ranks (1 = nearest to the new image) among the N_c candidates of
  (left) the lowest-KNN-SV candidate of each new image and (right) the replayed candidates.

  Args:
    records: one dataset's records; uses `min_sv_rank_counts` and `selected_rank_counts`
      [R + 1] (index r = rank r; index 0 is unused and not drawn).

  Returns:
    Figure with 2 axes, R bars each (ranks 1..R).

  Source: paper Figure 5 (right; there a higher rank means closer, here rank 1 is nearest).
  """
  fig = _figure(8.0, 3.2)
  axes = fig.subplots(1, 2)
  for ax, key, name in (
    (axes[0], "min_sv_rank_counts", "lowest-KNN-SV candidate"),
    (axes[1], "selected_rank_counts", "replayed candidates"),
  ):
    counts = np.asarray(records[key])[1:]
    ax.bar(np.arange(1, counts.shape[0] + 1), counts, width=1.0)
    ax.set_xlabel("distance rank (1 = nearest)")
    ax.set_ylabel("count")
    ax.set_title(f"{name}, n = {int(counts.sum())}", fontsize=9)
  return fig


def records_figures(
  records: Mapping[str, np.ndarray], class_names: Sequence[str] | None = None
) -> dict[str, Figure]:
  """All record figures of one dataset, skipping those whose histograms are all zero (the
  run's algorithm does not produce them, e.g. no KNN-SVs for SWIL).

  Args:
    records: one dataset's records (`Run.records[name]`).
    class_names: see `plot_sampled_classes`.

  Returns:
    {'sampled_classes' | 'entropy' | 'knn_sv' | 'distance_ranks': Figure}.
  """
  out = {}
  if np.any(records["sampled_class_counts"]):
    out["sampled_classes"] = plot_sampled_classes(records, class_names)
  if np.any(records["swil_entropy_counts"]) or np.any(records["grasp_entropy_counts"]):
    out["entropy"] = plot_entropy_histograms(records)
  if np.any(records["knn_sv_counts"]):
    out["knn_sv"] = plot_knn_sv_histogram(records)
  if np.any(records["min_sv_rank_counts"]) or np.any(records["selected_rank_counts"]):
    out["distance_ranks"] = plot_distance_ranks(records)
  return out

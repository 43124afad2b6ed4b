"""Analysis of finished runs: results and retrieval records -> matrices, curves, figures.

`load_run(workdir)`, `stage_matrix`, `forgetting_curve` (owl_cl/analysis/runs.py) and the
matplotlib figures (owl_cl/analysis/plots.py, Agg canvas, no display). Repeated runs:
`owl_cl.analysis.stats` (t-intervals, paired tests, Holm), `owl_cl.analysis.power`
(detectable differences), `owl_cl.analysis.variance` (model / order / residual components)
and `owl_cl.analysis.report` (`python -m owl_cl.report`, docs/experiments.md). Example:
notebooks/analysis.ipynb.
"""

from owl_cl.analysis.plots import plot_distance_ranks
from owl_cl.analysis.plots import plot_entropy_histograms
from owl_cl.analysis.plots import plot_forgetting_curves
from owl_cl.analysis.plots import plot_knn_sv_histogram
from owl_cl.analysis.plots import plot_sampled_classes
from owl_cl.analysis.plots import plot_stage_heatmap
from owl_cl.analysis.plots import records_figures
from owl_cl.analysis.runs import Run
from owl_cl.analysis.runs import eval_set_order
from owl_cl.analysis.runs import forgetting_curve
from owl_cl.analysis.runs import load_records
from owl_cl.analysis.runs import load_run
from owl_cl.analysis.runs import stage_matrix

__all__ = [
  "plot_distance_ranks",
  "plot_entropy_histograms",
  "plot_forgetting_curves",
  "plot_knn_sv_histogram",
  "plot_sampled_classes",
  "plot_stage_heatmap",
  "records_figures",
  "Run",
  "eval_set_order",
  "forgetting_curve",
  "load_records",
  "load_run",
  "stage_matrix",
]

"""Variance components of repeated runs: pre-trained model, task order and residual.

A sweep that crosses model seeds (each its own pre-training and buffer) with stored task
orders measures a metric y of run r of group g (an algorithm) as

    y_r = mu_g + u_model(r) + v_order(r) + e_r,

u ~ N(0, s2_model), v ~ N(0, s2_order) and e ~ N(0, s2_residual) independent, the model and
order effects shared by every algorithm's run of that model or order (crossed random
intercepts; the residual holds the data and retrieval seeds and every interaction). The
components are estimated by restricted maximum likelihood with `statsmodels`' MixedLM, the
crossed effects written as variance components of one all-runs group (the statsmodels
documentation's recipe for crossed random effects). For a balanced design (every model with
every order, one run per cell and group) and positive estimates, REML equals the ANOVA
(expected mean squares) estimates; tests/analysis/test_variance.py checks that.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
import warnings

import numpy as np

__all__ = ["COMPONENTS", "variance_components"]

COMPONENTS = ("model", "order", "residual")


def variance_components(
  values: Sequence[float] | np.ndarray,
  model: Sequence[object],
  order: Sequence[object],
  group: Sequence[object] | None = None,
) -> dict:
  """Model / order / residual variance of `values` by a crossed random-intercepts mixed model.

  Args:
    values: float [n], one metric of n runs (e.g. AP points); no NaN.
    model: [n] hashables, each run's pre-trained model (its model seed).
    order: [n] hashables, each run's task order.
    group: [n] hashables or None, each run's algorithm: a fixed effect (a mean per group),
      so that differences between algorithms do not enter the components.

  Returns:
    dict(n, models, orders (distinct levels), variance {model, order, residual} (squared
    units of values, >= 0), fraction {same / their sum}, converged (bool), method 'REML').
    With fewer than 2 models or 2 orders that component is not estimable: the model is fitted
    without it and its variance is NaN; with neither, the residual is the pooled within-group
    variance (method 'pooled within-group variance'). When the runs' models and orders are
    confounded (each model seed with one order and each order with one model, as in the first
    cells of a crossed design), the two components are one effect: it is fitted once, both
    are NaN, the residual is that fit's, and `method` says so. A fit that statsmodels cannot
    solve (a singular matrix) gives NaN everywhere, converged False and the error in `method`.

  Raises:
    ValueError: lengths that differ, a NaN value, or fewer than 3 runs.

  Source: Searle, Casella & McCulloch (1992), "Variance Components" (REML, ch. 6; the
  balanced ANOVA estimators, ch. 4); `statsmodels.regression.mixed_linear_model.MixedLM`.
  """
  import pandas as pd  # pylint: disable=g-import-not-at-top

  y = np.asarray(values, dtype=np.float64).reshape(-1)
  n = y.size
  group = ["all"] * n if group is None else list(group)
  if not len(model) == len(order) == len(group) == n:
    raise ValueError(
      f"variance_components: {n} values, {len(model)} models, {len(order)} orders, "
      f"{len(group)} groups; one each per run"
    )
  if np.isnan(y).any():
    raise ValueError("variance_components: NaN among the values (drop runs without the metric)")
  if n < 3:
    raise ValueError(f"variance_components: {n} runs; at least 3 are needed")
  frame = pd.DataFrame(
    dict(
      y=y,
      model=[str(m) for m in model],
      order=[str(o) for o in order],
      group=[str(g) for g in group],
    )
  )
  levels = {c: frame[c].nunique() for c in ("model", "order")}
  crossed = {c: f"0 + C({c})" for c in ("model", "order") if levels[c] >= 2}
  formula = "y ~ C(group)" if frame["group"].nunique() > 1 else "y ~ 1"
  if crossed:
    variance, fraction, converged, method = _components(frame, formula, crossed)
  else:
    variance, fraction, converged, method = _pooled(frame)
  return dict(
    n=n,
    models=levels["model"],
    orders=levels["order"],
    variance=variance,
    fraction=fraction,
    converged=converged,
    method=method,
  )


def _pooled(frame) -> tuple[dict, dict, bool, str]:
  """One model and one order: nothing random but the residual, the pooled within-group
  variance (the group means the fixed effect; ddof: one per group)."""
  groups = frame.groupby("group")["y"]
  dof = len(frame) - frame["group"].nunique()
  residual = float(((frame["y"] - groups.transform("mean")) ** 2).sum() / dof) if dof else math.nan
  variance = {c: residual if c == "residual" else math.nan for c in COMPONENTS}
  fraction = {c: 1.0 if c == "residual" else math.nan for c in COMPONENTS}
  return variance, fraction, True, "pooled within-group variance"


def _components(frame, formula: str, crossed: dict) -> tuple[dict, dict, bool, str]:
  """(variance, fraction, converged, method) of the REML fit of the `crossed` components."""
  variance = {c: math.nan for c in COMPONENTS}
  method = "REML"
  if len(crossed) == 2 and _confounded(frame["model"], frame["order"]):
    # The same partition of the runs twice: their two design blocks are equal up to column
    # order, REML's information matrix is singular, and no data can tell the two apart.
    crossed = {"model": crossed["model"]}
    method = "REML; model and order confounded (each model with one order): not separable"
  fitted = _reml(frame, formula, crossed)
  if isinstance(fitted, str):
    return variance, dict(variance), False, f"not estimable (statsmodels: {fitted})"
  if method == "REML":
    names = list(fitted.model.exog_vc.names)
    for name, value in zip(names, np.asarray(fitted.vcomp, dtype=np.float64)):
      variance[name] = max(0.0, float(value))
  variance["residual"] = float(fitted.scale)
  total = sum(v for v in variance.values() if not math.isnan(v))
  fraction = {c: (v / total if total > 0 else math.nan) for c, v in variance.items()}
  return variance, fraction, bool(fitted.converged), method


def _reml(frame, formula: str, crossed: dict):
  """statsmodels' REML fit of the crossed components `crossed` as variance components of one
  all-runs group, or the error's text when its matrix is singular."""
  from statsmodels.regression.mixed_linear_model import MixedLM  # pylint: disable=g-import-not-at-top

  frame = frame.assign(all=1)  # one group holding every run: the crossed effects are its components
  try:
    with warnings.catch_warnings():
      # A component estimated on the boundary (0) warns; the estimate is still the REML one.
      warnings.simplefilter("ignore")
      return MixedLM.from_formula(
        formula, data=frame, groups="all", vc_formula=crossed, re_formula="0"
      ).fit(reml=True)
  except np.linalg.LinAlgError as e:
    return str(e)


def _confounded(model, order) -> bool:
  """Whether two labelings of the runs are one partition (a one-to-one map between levels)."""
  pairs = set(zip(model, order))
  return len(pairs) == len(set(model)) == len(set(order))

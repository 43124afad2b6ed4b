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
(expected mean squares) estimates; tests/analysis/test_power_variance.py checks that.
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
    units of values, >= 0), fraction {same / their sum}, converged (bool: the REML
    objective's largest gradient component under 1e-4 per run), method 'REML').
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
  result = _reml(frame, formula, crossed)
  if isinstance(result, str):
    return variance, dict(variance), False, f"not estimable (statsmodels: {result})"
  fitted, converged = result
  if method == "REML":
    names = list(fitted.model.exog_vc.names)
    for name, value in zip(names, np.asarray(fitted.vcomp, dtype=np.float64)):
      variance[name] = max(0.0, float(value))
  variance["residual"] = float(fitted.scale)
  total = sum(v for v in variance.values() if not math.isnan(v))
  fraction = {c: (v / total if total > 0 else math.nan) for c, v in variance.items()}
  return variance, fraction, converged, method


def _reml(frame, formula: str, crossed: dict):
  """statsmodels' REML fit of the crossed components `crossed` as variance components of one
  all-runs group and whether it is a stationary point (`_STATIONARY`), or the error's text
  when its matrix is singular."""
  from statsmodels.regression.mixed_linear_model import MixedLM  # pylint: disable=g-import-not-at-top

  frame = frame.assign(all=1)  # one group holding every run: the crossed effects are its components
  try:
    with warnings.catch_warnings():
      # A component estimated on the boundary (0) warns; the estimate is still the REML one.
      warnings.simplefilter("ignore")
      model = MixedLM.from_formula(
        formula, data=frame, groups="all", vc_formula=crossed, re_formula="0"
      )
      fitted = model.fit(reml=True, method="bfgs")
      if _gradient(model, fitted) > _STATIONARY:
        # BFGS stops short of a flat or boundary optimum when its line search loses precision.
        # statsmodels' own fallback (L-BFGS from where BFGS stopped) calls a fit converged by a
        # relative change in the objective: on the first committed sweep's pre-training AP it
        # stopped with a gradient of 3e-3 and the order component 14% above the optimum, called
        # converged on one CPU and not on another. Powell's derivative-free search from the
        # usual start values (not from where BFGS stopped, which varies with the CPU) reaches
        # the optimum's basin; BFGS from there ends at a gradient under 1e-5.
        start = model.fit(reml=True, method="powell")
        fitted = model.fit(reml=True, method="bfgs", start_params=start.params_object)
      return fitted, _gradient(model, fitted) <= _STATIONARY
  except np.linalg.LinAlgError as e:
    return str(e)


# The largest gradient component of the REML objective (statsmodels' optimiser units: the
# negative log-likelihood per run, in the square-root parametrisation of the components)
# at which a fit counts as converged: scipy's BFGS stops at a gradient norm of 1e-5, so this
# leaves a tenfold margin; the fits that stopped short measured 1.4e-4, 2.9e-3 and 5.1e-2.
_STATIONARY = 1e-4


def _gradient(model, fitted) -> float:
  """The largest absolute component of the REML objective's gradient at `fitted`."""
  packed = fitted.params_object.get_packed(use_sqrt=model.use_sqrt, has_fe=False)
  return float(np.abs(model.score(packed)).max() / model.nobs)


def _confounded(model, order) -> bool:
  """Whether two labelings of the runs are one partition (a one-to-one map between levels)."""
  pairs = set(zip(model, order))
  return len(pairs) == len(set(model)) == len(set(order))

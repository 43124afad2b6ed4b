"""owl_cl.analysis.power (detectable differences) and owl_cl.analysis.variance (mixed model).

Power: checked against the exact non-central t power computed with scipy (an independent
route to the same quantity) and the normal approximation worked by hand. Variance: synthetic
crossed designs whose ANOVA (expected mean squares) estimates are known exactly, which REML
reproduces on balanced data with positive components.
"""

import math
import os

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as scipy_stats

from owl_cl.analysis import claims
from owl_cl.analysis import power
from owl_cl.analysis import report as report_lib
from owl_cl.analysis import variance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _t_test_power(d: float, n: int, level: float) -> float:
  """Power of the two-sided one-sample t-test of n values at `level` when the mean is d
  standard deviations: P(|T'| > t_crit), T' ~ non-central t(n - 1, d sqrt(n))."""
  crit = scipy_stats.t.ppf(1 - level / 2, n - 1)
  nct = scipy_stats.nct(n - 1, d * math.sqrt(n))
  return float(nct.sf(crit) + nct.cdf(-crit))


@pytest.mark.parametrize("n, m", [(10, 14), (12, 1), (12, 9), (30, 45)])
def test_detectable_effect_has_the_stated_power(n, m):
  d = power.detectable_effect(n, comparisons=m)
  # The solver's tolerance (statsmodels' brentq) is far below 1e-4 in power.
  assert _t_test_power(d, n, 0.05 / m) == pytest.approx(0.8, abs=1e-4)
  # A smaller effect has less power: d is the smallest with 80%.
  assert _t_test_power(0.97 * d, n, 0.05 / m) < 0.79


def test_detectable_effect_against_the_normal_approximation():
  # Worked by hand: at n = 2000 the t-test is the z-test, d ~ (z_{1-a/2} + z_{0.8}) / sqrt(n):
  # (1.95996 + 0.84162) / 44.7214 = 0.062645 for a = 0.05. The t's heavier tail adds O(1/n).
  assert power.detectable_effect(2000) == pytest.approx(0.062645, rel=2e-3)
  # The figure: n = 10 pairs, Holm over 14 comparisons (first step at 0.05 / 14):
  # d = 1.560, so a standard deviation of 0.81 point gives about 1.26 points.
  assert power.detectable_effect(10, 14) == pytest.approx(1.560, abs=2e-3)


def test_detectable_difference_scales_with_the_spread():
  d = power.detectable_effect(12, 9)
  assert power.detectable_difference(0.5, 12, 9) == pytest.approx(0.5 * d, rel=1e-12)
  assert power.detectable_difference(0.0, 12, 9) == 0.0
  assert math.isnan(power.detectable_difference(math.nan, 12))
  assert math.isnan(power.detectable_difference(1.0, 1))
  # More comparisons, a stricter level, a larger detectable difference.
  assert power.detectable_effect(12, 45) > power.detectable_effect(12, 9)
  with pytest.raises(ValueError, match="comparisons"):
    power.detectable_effect(12, 0)
  with pytest.raises(ValueError, match="std"):
    power.detectable_difference(-1.0, 12)


def _anova(y: np.ndarray) -> tuple[float, float, float]:
  """The balanced two-way (no replicate) ANOVA estimators: (MS_model - MS_E) / O,
  (MS_order - MS_E) / M, MS_E (Searle, Casella & McCulloch 1992, ch. 4)."""
  m, o = y.shape
  grand = y.mean()
  ms_model = o * ((y.mean(1) - grand) ** 2).sum() / (m - 1)
  ms_order = m * ((y.mean(0) - grand) ** 2).sum() / (o - 1)
  resid = y - y.mean(1, keepdims=True) - y.mean(0, keepdims=True) + grand
  ms_e = (resid**2).sum() / ((m - 1) * (o - 1))
  return (ms_model - ms_e) / o, (ms_order - ms_e) / m, ms_e


def _cells(m: int, o: int):
  return [i for i in range(m) for _ in range(o)], [j for _ in range(m) for j in range(o)]


def test_known_components_are_recovered():
  # 3 model seeds x 4 orders, one run per cell, built so that the ANOVA estimators are
  # exactly model 4, order 1, residual 0.25: effects scaled to sample variances 4 + 0.25 / 4
  # and 1 + 0.25 / 3 (E[MS_model] = s2_e + O s2_model), a double-centred residual scaled to
  # MS_E = 0.25.
  rng = np.random.default_rng(0)
  m, o = 3, 4
  u = rng.normal(size=m)
  u = (u - u.mean()) / u.std(ddof=1) * math.sqrt(4 + 0.25 / o)
  v = rng.normal(size=o)
  v = (v - v.mean()) / v.std(ddof=1) * math.sqrt(1 + 0.25 / m)
  e = rng.normal(size=(m, o))
  e = e - e.mean(1, keepdims=True) - e.mean(0, keepdims=True) + e.mean()
  e *= math.sqrt(0.25 * (m - 1) * (o - 1) / (e**2).sum())
  y = 20.0 + u[:, None] + v[None, :] + e
  assert _anova(y) == pytest.approx((4.0, 1.0, 0.25), rel=1e-12)
  models, orders = _cells(m, o)
  got = variance.variance_components(y.reshape(-1), models, orders)
  # REML = ANOVA here; 1e-3: the optimizer's convergence (its estimates agree to ~1e-5).
  assert got["variance"] == pytest.approx(dict(model=4.0, order=1.0, residual=0.25), rel=1e-3)
  assert got["fraction"]["model"] == pytest.approx(4.0 / 5.25, rel=1e-3)
  assert (got["n"], got["models"], got["orders"], got["converged"]) == (12, 3, 4, True)


@pytest.mark.parametrize("seed", [1, 2])
def test_reml_equals_anova_on_random_balanced_designs_with_a_group_shift(seed):
  rng = np.random.default_rng(seed)
  m, o = 3, 4
  y = rng.normal(0, 2, m)[:, None] + rng.normal(0, 1, o)[None, :] + rng.normal(0, 0.5, (m, o))
  want = _anova(y)
  assert min(want) > 0  # REML = ANOVA holds for positive estimates
  models, orders = _cells(m, o)
  plain = variance.variance_components(y.reshape(-1), models, orders)
  assert [plain["variance"][c] for c in variance.COMPONENTS] == pytest.approx(want, rel=1e-3)
  # Two algorithms whose runs are the same up to a constant: the group's fixed effect takes
  # the shift. Worked by hand from the single design's mean squares: each mean square of model
  # and order doubles (twice the runs per level), the residual sum of squares doubles over
  # 24 - 2 (groups) - 2 (models) - 3 (orders) = 17 degrees of freedom instead of 6.
  ms_e = want[2]
  ms_model, ms_order = o * want[0] + ms_e, m * want[1] + ms_e
  ms_e2 = 2 * ms_e * (m - 1) * (o - 1) / 17
  both = variance.variance_components(
    np.concatenate([y.reshape(-1), y.reshape(-1) + 7.0]),
    models * 2,
    orders * 2,
    group=["a"] * 12 + ["b"] * 12,
  )
  assert both["variance"]["model"] == pytest.approx((2 * ms_model - ms_e2) / (2 * o), rel=1e-3)
  assert both["variance"]["order"] == pytest.approx((2 * ms_order - ms_e2) / (2 * m), rel=1e-3)
  assert both["variance"]["residual"] == pytest.approx(ms_e2, rel=1e-3)


def test_one_model_seed_leaves_its_component_unestimated():
  # The first committed sweep's design: one pre-trained model, two orders.
  rng = np.random.default_rng(3)
  y = np.repeat([10.0, 12.0], 6) + rng.normal(0, 0.3, 12)
  got = variance.variance_components(y, [0] * 12, [0] * 6 + [1] * 6)
  assert math.isnan(got["variance"]["model"]) and got["models"] == 1
  assert got["variance"]["order"] > got["variance"]["residual"] > 0


def test_confounded_model_and_order_are_one_effect():
  # The first cells of a crossed design: model seed k only with order k (3 cells), 4
  # algorithms (a fixed effect), one run per cell and algorithm.
  rng = np.random.default_rng(4)
  cells, groups = 3, 4
  y = (
    rng.normal(0, 1.0, (groups, 1))
    + rng.normal(0, 2.0, (1, cells))
    + rng.normal(0, 0.5, (groups, cells))
  )
  model = [c for _ in range(groups) for c in range(cells)]
  order = [f"random_{c}" for c in model]
  group = [g for g in range(groups) for _ in range(cells)]
  got = variance.variance_components(y.reshape(-1), model, order, group=group)
  assert math.isnan(got["variance"]["model"]) and math.isnan(got["variance"]["order"])
  assert got["method"].startswith("REML; model and order confounded")
  # The residual is the additive two-way ANOVA's (balanced, one run per group and cell):
  # sum (y_gc - y_g. - y_.c + y_..)^2 / ((G - 1)(C - 1)).
  interaction = y - y.mean(1, keepdims=True) - y.mean(0, keepdims=True) + y.mean()
  ms_error = (interaction**2).sum() / ((groups - 1) * (cells - 1))
  assert got["variance"]["residual"] == pytest.approx(ms_error, rel=1e-3)
  assert got["fraction"]["residual"] == 1.0 and got["converged"]


def _profile_reml(y: np.ndarray, fixed: np.ndarray, random: np.ndarray) -> tuple[float, float]:
  """(random-effect variance, residual variance) maximising the restricted likelihood of
  y = X b + Z u + e, u ~ N(0, s2_u I), e ~ N(0, s2 I), written out independently of
  statsmodels: with H = I + g Z Z' and s2 profiled out (r' H^-1 r / (n - p)), -2 log L_R is
  (n - p) log s2 + log|H| + log|X' H^-1 X| up to a constant (Searle, Casella & McCulloch
  1992, ch. 6), minimised over log g by scipy's bounded Brent search; g = e^-20 is 0."""
  n, p = fixed.shape

  def profile(log_g: float) -> tuple[float, float]:
    h = np.eye(n) + math.exp(log_g) * random @ random.T
    h_inv = np.linalg.inv(h)
    info = fixed.T @ h_inv @ fixed
    r = y - fixed @ np.linalg.solve(info, fixed.T @ h_inv @ y)
    s2 = float(r @ h_inv @ r) / (n - p)
    return (n - p) * math.log(s2) + np.linalg.slogdet(h)[1] + np.linalg.slogdet(info)[1], s2

  best = optimize.minimize_scalar(
    lambda t: profile(t)[0], bounds=(-20.0, 8.0), method="bounded", options=dict(xatol=1e-10)
  )
  s2 = profile(best.x)[1]
  return math.exp(best.x) * s2, s2


def test_a_boundary_optimum_is_found_where_bfgs_stops_short():
  # 12 algorithms x 3 model seeds, every model's mean residual exactly 0: REML's model
  # component is 0 and the residual the fixed-effects fit's, RSS / (n - 12), worked by hand.
  # BFGS stops at its start here (gradient 5e-2); statsmodels' fallback L-BFGS then called
  # a model variance of 7.6 converged.
  rng = np.random.default_rng(0)
  groups, models = 12, 3
  e = rng.normal(size=(groups, models))
  e -= e.mean(0, keepdims=True)
  y = rng.normal(0, 3, (groups, 1)) + e
  got = variance.variance_components(
    y.reshape(-1),
    [m for _ in range(groups) for m in range(models)],
    [0] * y.size,
    group=[g for g in range(groups) for _ in range(models)],
  )
  rss = ((e - e.mean(1, keepdims=True)) ** 2).sum()
  assert got["converged"]
  # 1e-6 point^2: the model component's square-root parameter ends within 1e-5 of 0.
  assert got["variance"]["model"] == pytest.approx(0.0, abs=1e-6)
  assert got["variance"]["residual"] == pytest.approx(rss / (y.size - groups), rel=1e-9)


@pytest.mark.slow
def test_first_committed_sweep_is_the_reml_optimum():
  # The first committed sweep's pre-training AP (90 retrieval runs, 9 algorithms, 2 orders):
  # BFGS stops short (gradient 3e-3) and statsmodels' fallback ended 14% above the optimum's
  # order component, converged on one CPU and not on another.
  points = report_lib.load_points(
    report_lib.find_runs([os.path.join(ROOT, "benchmarks", "results", "sweep_builtin", "runs")])
  )
  # The runs the report's section fits (`claims.variance_section`), rebuilt here as the
  # reference's design matrices: the algorithm a fixed effect, the order a random one.
  keep = set(claims.retrieval_algorithms(list(dict.fromkeys(p.algorithm for p in points))))
  runs = [p for p in points if p.algorithm in keep]
  run_orders = [claims.run_factors(p.pair)[1] for p in runs]
  algorithms, orders = sorted(keep), sorted(set(run_orders))
  y = np.array([p.values["pretrain_AP"] for p in runs])
  fixed = np.eye(len(algorithms))[[algorithms.index(p.algorithm) for p in runs]]
  random = np.eye(len(orders))[[orders.index(o) for o in run_orders]]
  want = _profile_reml(y, fixed, random)
  got = claims.variance_section(points)["pretrain_AP"]
  assert got["converged"] and (got["n"], got["orders"]) == (90, 2)
  # 1e-2: the restricted likelihood is flat in the order component (2 levels); a stationary
  # point (gradient under 1e-5 per run) is within about 1e-3 of its maximiser in relative terms.
  assert got["variance"]["order"] == pytest.approx(want[0], rel=1e-2)
  assert got["variance"]["residual"] == pytest.approx(want[1], rel=1e-4)


def test_bad_inputs_are_refused():
  with pytest.raises(ValueError, match="one each per run"):
    variance.variance_components([1.0, 2.0, 3.0], [0, 1], [0, 1, 2])
  with pytest.raises(ValueError, match="NaN"):
    variance.variance_components([1.0, math.nan, 3.0], [0, 1, 2], [0, 1, 2])

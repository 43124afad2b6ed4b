"""The difference a paired comparison detects at a given power, under a multiplicity correction.

The noise floor (`report`'s median half-width of the 95% paired intervals) is the difference a
sweep detects with about 50% power and no correction. A comparison tested under Holm's
correction over m comparisons is, at its first step, tested at alpha / m (Holm 1979: every
later step tests at a larger level, so alpha / m is the conservative level for any one
comparison); the difference it detects with probability `power` is

    delta = d * s_d,

where s_d is the standard deviation of the n paired differences and d the standardized effect
at which the two-sided one-sample t-test of n values at level alpha / m has that power: the
solution of P(|T'| > t_{1 - alpha / (2m), n - 1}) = power, T' non-central t with n - 1
degrees of freedom and non-centrality d * sqrt(n). `statsmodels.stats.power.TTestPower`
solves it (Cohen 1988, ch. 2; the exact non-central t, not the normal approximation).
"""

from __future__ import annotations

import math

from statsmodels.stats.power import TTestPower

__all__ = ["POWER", "ALPHA", "detectable_effect", "detectable_difference"]

# The power and family-wise level the report states (the issue's: 80%, alpha 0.05).
POWER = 0.8
ALPHA = 0.05


def detectable_effect(
  n: int, comparisons: int = 1, alpha: float = ALPHA, power: float = POWER
) -> float:
  """The standardized paired difference d (mean / standard deviation of the differences) that a
  two-sided paired t-test of n pairs at level alpha / comparisons detects with `power`.

  Args:
    n: int, the number of pairs (>= 2).
    comparisons: int >= 1, m of the correction (Bonferroni's level, Holm's first step).
    alpha: the family-wise level, in (0, 1).
    power: the wanted power, in (alpha / comparisons, 1).

  Returns:
    d > 0, a float (unitless); NaN when n < 2 (no t-test).

  Raises:
    ValueError: comparisons < 1, or alpha or power outside (0, 1).

  Source: the non-central t power of the one-sample t-test (Cohen 1988), solved by
  `statsmodels.stats.power.TTestPower.solve_power`.
  """
  if comparisons < 1:
    raise ValueError(f"detectable_effect: comparisons must be >= 1, got {comparisons}")
  if not (0.0 < alpha < 1.0 and 0.0 < power < 1.0):
    raise ValueError(f"detectable_effect: alpha {alpha} and power {power} must be in (0, 1)")
  if n < 2:
    return math.nan
  level = alpha / comparisons
  effect = TTestPower().solve_power(
    effect_size=None, nobs=n, alpha=level, power=power, alternative="two-sided"
  )
  return float(effect)


def detectable_difference(
  std: float, n: int, comparisons: int = 1, alpha: float = ALPHA, power: float = POWER
) -> float:
  """The paired difference (in the values' units, e.g. AP points) detected with `power` by a
  paired t-test of n pairs whose differences have standard deviation `std`, at level
  alpha / comparisons: `detectable_effect(n, comparisons, alpha, power) * std`.

  Args:
    std: float >= 0, the sample standard deviation (ddof 1) of the paired differences, or NaN.
    n: int, the number of pairs.
    comparisons: as `detectable_effect`.
    alpha: as `detectable_effect`.
    power: as `detectable_effect`.

  Returns:
    float >= 0 in std's units; NaN when n < 2 or std is NaN.

  Raises:
    ValueError: as `detectable_effect`, or std < 0.
  """
  if std < 0:
    raise ValueError(f"detectable_difference: std must be >= 0, got {std}")
  if math.isnan(std):
    return math.nan
  return detectable_effect(n, comparisons, alpha, power) * std

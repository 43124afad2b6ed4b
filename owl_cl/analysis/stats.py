"""Statistics of repeated runs: t-intervals, paired differences, paired tests, Holm's correction.

Pure NumPy / SciPy, no JAX. Quantiles and tests come from `scipy.stats` (`t.ppf`,
`ttest_rel`, `wilcoxon`); Holm's step-down correction (which SciPy lacks) is written out in
`holm` and tested against a hand-worked example. The formulas are in docs/experiments.md
("Statistics").
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

__all__ = ["CONFIDENCE", "summarize", "paired_difference", "holm", "describe"]

# Two-sided coverage of every interval in reports.
CONFIDENCE = 0.95


def _values(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
  x = np.asarray(values, dtype=np.float64).reshape(-1)
  if np.isnan(x).any():
    raise ValueError(f"{name}: NaN among the values {x.tolist()} (drop missing runs first)")
  return x


def summarize(values: Sequence[float] | np.ndarray, confidence: float = CONFIDENCE) -> dict:
  """Mean, sample standard deviation and Student-t interval of independent values.

  Args:
    values: float [n], e.g. one algorithm's final mAP (points) over its runs; no NaN.
    confidence: two-sided coverage of the interval, in (0, 1).

  Returns:
    dict(n, mean, std (ddof 1), sem = std / sqrt(n), half_width = t_{(1+c)/2, n-1} * sem,
    low, high): floats (n an int) in the values' units; std, sem, half_width, low and high are
    NaN when n < 2 (no spread can be estimated from one run), mean NaN when n == 0.

  Raises:
    ValueError: a NaN value, or confidence outside (0, 1).
  """
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  x = _values(values, "summarize")
  n = int(x.size)
  mean = float(x.mean()) if n else math.nan
  if n < 2:
    nan = math.nan
    return dict(n=n, mean=mean, std=nan, sem=nan, half_width=nan, low=nan, high=nan)
  std = float(x.std(ddof=1))
  sem = std / math.sqrt(n)
  half = float(scipy_stats.t.ppf(0.5 + confidence / 2, n - 1)) * sem
  return dict(n=n, mean=mean, std=std, sem=sem, half_width=half, low=mean - half, high=mean + half)


def paired_difference(
  a: Sequence[float] | np.ndarray,
  b: Sequence[float] | np.ndarray,
  confidence: float = CONFIDENCE,
) -> dict:
  """The paired difference a - b over runs that share everything but the compared factor.

  Args:
    a: float [n], `a[i]` from the run of (seed, order) i; no NaN.
    b: float [n], `b[i]` from the run of the same (seed, order) as `a[i]`; no NaN.
    confidence: coverage of the interval of the mean difference.

  Returns:
    `summarize(a - b)` plus t and p (two-sided paired t-test, `scipy.stats.ttest_rel`) and
    wilcoxon_p (two-sided Wilcoxon signed-rank test, `scipy.stats.wilcoxon`; NaN when n < 2 or
    every difference is 0). t and p are NaN when n < 2; with n >= 2 and all differences equal,
    p is 0 if they are non-zero and 1 if they are all 0 (SciPy gives NaN there: a zero
    variance).

  Raises:
    ValueError: different lengths, or a NaN.
  """
  a = _values(a, "paired_difference a")
  b = _values(b, "paired_difference b")
  if a.shape != b.shape:
    raise ValueError(f"paired_difference: {a.size} values against {b.size}; pairs must match")
  d = a - b
  out = summarize(d, confidence)
  out.update(t=math.nan, p=math.nan, wilcoxon_p=math.nan)
  if d.size < 2:
    return out
  if np.all(d == d[0]):
    # ttest_rel divides by a zero standard deviation: a constant non-zero shift is as sure as
    # a difference can be, a constant zero no difference at all.
    out.update(t=math.copysign(math.inf, d[0]) if d[0] else 0.0, p=0.0 if d[0] else 1.0)
  else:
    test = scipy_stats.ttest_rel(a, b)
    out.update(t=float(test.statistic), p=float(test.pvalue))
  if np.any(d != 0):
    out["wilcoxon_p"] = float(scipy_stats.wilcoxon(a, b).pvalue)
  return out


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
  """Holm's step-down adjusted p-values (family-wise error control over the comparisons).

  With the m non-NaN p-values sorted ascending, p_(1) <= ... <= p_(m), the adjusted value of
  p_(i) is max_{j <= i} min(1, (m - j + 1) p_(j)); a comparison is significant at level alpha
  when its adjusted p-value is <= alpha. NaN entries (comparisons without a test) stay NaN and
  do not count in m.

  Args:
    pvalues: float [m'] in [0, 1] or NaN.

  Returns:
    float64 [m'] adjusted p-values, in the input's order.

  Raises:
    ValueError: a value outside [0, 1].

  Source: Holm (1979), "A simple sequentially rejective multiple test procedure".
  """
  p = np.asarray(pvalues, dtype=np.float64).reshape(-1)
  valid = ~np.isnan(p)
  if np.any((p[valid] < 0) | (p[valid] > 1)):
    raise ValueError(f"holm: p-values must be in [0, 1], got {p.tolist()}")
  out = np.full(p.shape, np.nan)
  index = np.flatnonzero(valid)
  m = index.size
  if m == 0:
    return out
  order = index[np.argsort(p[index], kind="stable")]
  scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
  out[order] = np.maximum.accumulate(scaled)
  return out


def describe(result: dict[str, Any], digits: int = 2) -> str:
  """`mean ± half_width (n = n)` of a `summarize` / `paired_difference` dict, e.g.
  '1.25 ± 0.40 (n = 5)'; '±' is omitted when the half-width is NaN."""
  mean = result["mean"]
  text = "n/a" if math.isnan(mean) else f"{mean:.{digits}f}"
  if not math.isnan(result["half_width"]):
    text += f" ± {result['half_width']:.{digits}f}"
  return f"{text} (n = {result['n']})"

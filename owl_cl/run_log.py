"""What a user reads in a run's log: each evaluation's headline metrics as it completes, and
repeated warnings counted instead of repeated.

`metrics_line(when, metrics)` is the one line `experiment.run` logs after each stage's
evaluation (TensorBoard gets every metric as before). `summarised_warnings()` installs a
`RepeatedWarnings` filter on the root logger's handlers for the run: the first WARNING of each
kind in a period (pre-training, one dataset) is shown, the later ones are counted, and
`RepeatedWarnings.summarise(period)` logs one line per repeated kind at the period's end (e.g.
version 1 of the built-in benchmark resets its dedup mask five times per dataset: one warning
and one "repeated 4 more times" line instead of five warnings).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading

from absl import logging as absl_logging

# The headline metrics of an evaluation set: COCO's mAP@[.5:.95] ('AP'), and LVIS's rare-class
# AP ('APr') where the set has it (the paper's Table 3 columns).
HEADLINE_METRICS = ("AP", "APr")

# Record attributes: the filter's decision (one per record, however many handlers ask) and
# the mark of a summary line (never counted itself).
_DECIDED = "owl_cl_repeat_decision"
_SUMMARY = "owl_cl_repeat_summary"


def _points(value) -> str:
  """A metric in [0, 1] as points with one decimal (as results.md); 'nan' for NaN."""
  value = float(value)
  return "nan" if math.isnan(value) else f"{100.0 * value:.1f}"


def metrics_line(when: str, metrics: dict) -> str:
  """One line of an evaluation's headline metrics.

  Args:
    when: the stage, as the line names it ('pre-training', 'thermal (stage 1 of 5)').
    metrics: {eval set: {metric name: float in [0, 1], NaN where undefined}}, as
      `Detector.evaluate_dataset` returns them per set, in evaluation order.

  Returns:
    'after <when>: <set> AP 25.8 | <set> AP 15.4 APr 10.1 | ...': `HEADLINE_METRICS` in points
    (x 100, one decimal), each set's that it has.
  """
  parts = []
  for name, values in metrics.items():
    shown = [f"{key} {_points(values[key])}" for key in HEADLINE_METRICS if key in values]
    parts.append(" ".join([name, *shown]))
  return f"after {when}: " + " | ".join(parts)


class RepeatedWarnings(logging.Filter):
  """A handler filter that shows the first WARNING of each kind per period and counts the rest.

  A kind is the place that logs it (source file and line), as the 'default' action of Python's
  `warnings` module: "print the first occurrence of matching warnings for each location (module
  + line number) where the warning is issued" (docs.python.org/3/library/warnings.html, "The
  Warnings Filter"). Records of other levels pass untouched. Installed on several handlers, it
  decides once per record (the decision is stored on the record). Thread-safe: the loop's
  background threads log too.
  """

  def __init__(self):
    super().__init__()
    self._lock = threading.Lock()
    self._seen: set[tuple[str, int]] = set()
    self._repeats: dict[tuple[str, int], list] = {}  # kind -> [count, last record]

  def filter(self, record: logging.LogRecord) -> bool:
    decided = getattr(record, _DECIDED, None)
    if decided is None:
      decided = self._decide(record)
      setattr(record, _DECIDED, decided)
    return decided

  def _decide(self, record: logging.LogRecord) -> bool:
    if record.levelno != logging.WARNING or getattr(record, _SUMMARY, False):
      return True
    kind = (record.pathname, record.lineno)
    with self._lock:
      if kind not in self._seen:
        self._seen.add(kind)
        return True
      entry = self._repeats.setdefault(kind, [0, None])
      entry[0] += 1
      entry[1] = record
    return False

  def summarise(self, period: str) -> list[str]:
    """Logs one WARNING per kind repeated during `period` (how many more times, and the last
    one's message), then starts a new period: the next warning of each kind is shown again.

    Returns:
      The lines logged, one per repeated kind, in the order the kinds first repeated.
    """
    with self._lock:
      repeats = list(self._repeats.items())
      self._repeats.clear()
      self._seen.clear()
    lines = []
    for (path, line), (count, last) in repeats:
      times = "time" if count == 1 else "times"
      lines.append(
        f"the warning of {os.path.basename(path)}:{line} above was repeated {count} more "
        f"{times} during {period}; the last: {last.getMessage()}"
      )
    for text in lines:
      absl_logging.warning("%s", text, extra={_SUMMARY: True})
    return lines


@contextlib.contextmanager
def summarised_warnings(period: str = "the run"):
  """A `RepeatedWarnings` on every handler the root logger has at entry, for the block.

  Yields the filter (the caller calls `summarise` at the end of each period); on exit, however
  the block ends, what is left is summarised as `period` and the filter removed. A handler
  added inside the block does not get it.
  """
  repeats = RepeatedWarnings()
  handlers = list(logging.getLogger().handlers)
  for handler in handlers:
    handler.addFilter(repeats)
  try:
    yield repeats
  finally:
    repeats.summarise(period)
    for handler in handlers:
      handler.removeFilter(repeats)

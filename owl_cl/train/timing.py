"""Per-step time breakdown of the training loop (issue 10 item 4): where a step's wall time goes.

A step's device work is a chain: the previous train step -> the new images' features (embed,
or the new-loss forward with the paper's loss adaptivity) -> the retrieval -> (host: the
retrieved indices are fetched, the replay batch gathered from the store and transferred) ->
the train step. The device runs the chain in order (each link needs the one before it), so a
step's wall time, from the previous train step's completion to its own, splits exactly into
the device time of each link and the gaps where the device had nothing queued because the host
had not yet dispatched the next link: **host idle**.

How it is measured, without adding a sync to the loop: the loop records the host time at
which it dispatches each device call (`StepTimer.device`), and a watcher thread
(`ThreadPoolExecutor` with one worker) calls `jax.block_until_ready` on one output of the call
and records when it returns; the retrieval's completion is the moment its indices reach the
host (the loop waits for them anyway). For the i-th call of a step, with dispatch time D_i,
completion C_i and C_0 the previous step's train-step completion:

  idle_i = max(0, D_i - C_{i-1})         the device waited for the host
  busy_i = C_i - max(D_i, C_{i-1})        the call's device time (it starts when both its
                                          dispatch and the call before it are done)

so step = C_n - C_0 = sum(busy_i) + sum(idle_i) exactly (`step_record`). Host-side durations
are recorded besides (not part of the partition): **gather** (fetching the retrieved indices'
examples from the store and transferring them: inside host idle when done in the loop's
thread, since the train step needs them; in the background during the previous train step
when the replay lookahead prepared them, `Replay.look_ahead`) and **input** (the loop's wait
for the next new batch: decoding + transfer when read in line, ~0 when prefetched in the
background, `owl_cl.train.prefetch`).

Accuracy: a completion is timestamped when the watcher thread wakes, up to a few ms late when
the main thread holds the GIL (Python's switch interval is 5 ms); the loop mostly waits for
the retrieval with the GIL released at that moment, so the error is usually well below that.
The first step of every loop (it compiles the programs) is left out of the summaries.

Calls prepared ahead (`Replay.look_ahead`: the next step's features and retrieval, dispatched
before this step's train step) are recorded with the step they belong to: they start before
its C_0, so they count 0 s of their own unless they end after it (their device time lies in
the previous step's train-step interval), and they do not bound the previous step's end.
"""

from __future__ import annotations

from concurrent import futures
import dataclasses
import statistics
import time
from typing import Any

import jax

# Device calls of a step, in order, and the host durations recorded besides them.
DEVICE_COMPONENTS = ("embed", "retrieval", "train_step")
HOST_COMPONENTS = ("gather", "input")
# Every field of a step's record (`step_record`); all in seconds.
COMPONENTS = DEVICE_COMPONENTS + ("host_idle",) + HOST_COMPONENTS


def _ready_time(output: Any) -> float:
  """`time.perf_counter()` once every array of `output` is computed (watcher thread)."""
  try:
    jax.block_until_ready(output)
  except RuntimeError:
    # A donated or deleted buffer was consumed by a later call: it was computed before that.
    pass
  return time.perf_counter()


def step_record(
  previous_done: float | None,
  calls: list[tuple[str, float, float]],
  next_done: float | None = None,
) -> dict:
  """The time breakdown of one step from its device calls (module docstring).

  Args:
    previous_done: C_0, perf_counter seconds at which the previous step's last call finished
      (None for a loop's first step: its idle before the first call is then 0).
    calls: [(name, dispatch D_i, completion C_i)] in dispatch order; names from
      `DEVICE_COMPONENTS` (a name may repeat: its times add up). Each call needs the one
      before it (features -> retrieval -> host gather -> train step).
    next_done: the completion of the next step's first call when it needs this step's last
      one (the next features or train step need the parameters), else None.

  Returns:
    {'step_seconds', 'host_idle', and each name of `calls`: seconds (float >= 0)};
    step_seconds = sum of the others exactly (up to float rounding).

  A completion can only be timestamped late (the watcher wakes after the call finished), never
  early, so every C_i is first lowered to the earliest completion of a call that needs it
  (C_i <= C_{i+1} <= next_done). A completion still earlier than its call's start counts as 0
  busy seconds and moves the chain's end to that start, which keeps the sum exact.
  """
  record = {"host_idle": 0.0}
  if not calls:
    record["step_seconds"] = 0.0
    return record
  bounded = []
  upper = float("inf") if next_done is None else next_done
  for name, dispatch, completion in reversed(calls):
    upper = min(completion, upper)
    bounded.append((name, dispatch, upper))
  calls = bounded[::-1]
  done = calls[0][1] if previous_done is None else previous_done
  start_of_step = done
  for name, dispatch, completion in calls:
    start = max(dispatch, done)
    record["host_idle"] += start - done
    completion = max(completion, start)
    record[name] = record.get(name, 0.0) + completion - start
    done = completion
  record["step_seconds"] = done - start_of_step
  return record


def summarize(records: list[dict]) -> dict:
  """results.json's summary of step records: mean and median of every component (seconds),
  the host-idle fraction sum(host_idle) / sum(step_seconds), and the number of steps.

  Returns {} for no records. Components a record lacks (no embed for uniform retrieval, no
  retrieval without replay) count as 0.
  """
  if not records:
    return {}
  names = ("step_seconds",) + COMPONENTS
  columns = {name: [float(r.get(name, 0.0)) for r in records] for name in names}
  total = sum(columns["step_seconds"])
  return {
    "steps": len(records),
    "mean": {name: round(statistics.fmean(v), 6) for name, v in columns.items()},
    "median": {name: round(statistics.median(v), 6) for name, v in columns.items()},
    "host_idle_fraction": round(sum(columns["host_idle"]) / total, 6) if total > 0 else 0.0,
  }


@dataclasses.dataclass
class _Step:
  calls: list  # [(name, dispatch, completion future | float)]
  host: dict


class StepTimer:
  """Records the per-step breakdown of one training loop (module docstring).

  Per step the loop calls `host(name, seconds)` for host durations, `device(name, dispatch,
  output)` for each device call (in dispatch order; `output`: one array it returns, or the
  completion time when the caller knows it), and `end_step()`. `collect()` returns the
  records of the steps finished since the last call (waiting for the watcher to timestamp
  their completions: call it where the loop has synced anyway, e.g. at a logged step);
  `summary()` the summary of all records but the first; `close()` stops the watcher.
  """

  def __init__(self):
    self._watcher = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-timer")
    self._current = _Step([], {})
    self._finished: list[_Step] = []
    self._previous_done: float | None = None  # C_0 of the next step to collect
    self._records: list[dict] = []
    self._collected = 0

  def host(self, name: str, seconds: float) -> None:
    """Adds `seconds` of host time under `name` (`HOST_COMPONENTS`) to the current step."""
    self._current.host[name] = self._current.host.get(name, 0.0) + seconds

  def device(self, name: str, dispatch: float, output: Any) -> None:
    """Records a device call of the current step dispatched at `dispatch` (perf_counter s).

    `output`: an array (or pytree) the call returns, timestamped by the watcher when ready,
    or a float: the completion time itself.
    """
    if isinstance(output, float):
      done = output
    else:
      done = self._watcher.submit(_ready_time, output)
    self._current.calls.append((name, dispatch, done))

  def end_step(self) -> None:
    """Closes the current step (its record is computed by the next `collect`)."""
    self._finished.append(self._current)
    self._current = _Step([], {})

  def collect(self) -> list[dict]:
    """The records of the steps ended since the last `collect` (waits for their completion
    timestamps: their outputs must be computed or on their way)."""
    resolved = [
      [(n, d, c if isinstance(c, float) else c.result()) for n, d, c in step.calls]
      for step in self._finished
    ]
    for i, (step, calls) in enumerate(zip(self._finished, resolved)):
      # The next step's first call bounds this step's end when it needs it (features and
      # train steps need the parameters; a retrieval without features does not, nor does a
      # call dispatched before this step's last one: prepared ahead, `Replay.look_ahead`).
      after = resolved[i + 1] if i + 1 < len(resolved) else []
      needs_this = after and calls and after[0][0] != "retrieval" and after[0][1] >= calls[-1][1]
      next_done = min(c for _, _, c in after) if needs_this else None
      record = step_record(self._previous_done, calls, next_done)
      if calls:
        # The chain's end as `step_record` clamps it: the next step's C_0.
        start = calls[0][1] if self._previous_done is None else self._previous_done
        self._previous_done = start + record["step_seconds"]
      record.update(step.host)
      self._records.append(record)
    self._finished = []
    new = self._records[self._collected :]
    self._collected = len(self._records)
    return new

  def summary(self) -> dict:
    """`summarize` of every step collected so far but the loop's first (compilation)."""
    self.collect()
    return summarize(self._records[1:])

  def close(self) -> None:
    """Stops the watcher thread (after the calls it was given)."""
    self._watcher.shutdown(wait=True)


class NullTimer:
  """A `StepTimer` that records nothing (the default of the calls that take a timer)."""

  def host(self, name: str, seconds: float) -> None:
    del name, seconds

  def device(self, name: str, dispatch: float, output: Any) -> None:
    del name, dispatch, output

  def end_step(self) -> None:
    pass


NULL_TIMER = NullTimer()


def means(records: list[dict]) -> dict:
  """TensorBoard scalars of `records` (`collect()`): the mean of every component (seconds)
  and `host_idle_fraction`; {} for none."""
  summary = summarize(records)
  if not summary:
    return {}
  return dict(summary["mean"], host_idle_fraction=summary["host_idle_fraction"])

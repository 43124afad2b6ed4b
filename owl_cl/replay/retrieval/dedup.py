"""Deduplication schedules (paper §4 "Deduplication Schedules", docs/reference.md §8).

A dedup mask over the buffer (`ReplayState.dedup_mask`) marks images already replayed; they
are ineligible until the next reset. Only replays are marked (never candidate sets).

Schedules (by name):
  'none'     nothing is ever marked ineligible; repeats are allowed, even within one call
             (with `without_replacement=True`, as in the released code, not within a call).
  'epoch'    reset at the end of every epoch (a dataset's end also ends its last epoch).
  'dataset'  reset at the end of every dataset (the paper's best).
  'fraction' reset once ceil(fraction * N) images were replayed since the last reset
             (paper: 1/3 of the buffer); the reset happens inside the retrieval call that
             would exceed the period (`auto_reset_if_exhausted`), not at an event; with
             `fraction_reset='after'` (the released code) after the call whose replays take
             the count past fraction * N (`reset_after_call`).

Resets happen in three ways:
  * scheduled: the training loop calls `reset_if(state, 'epoch'|'dataset', schedule)` at the
    event; it resets iff the schedule resets on that event.
  * automatic, inside the jitted retrieval call: `auto_reset_if_exhausted` resets the mask
    *before* selection when fewer unreplayed images remain than the call needs (the buffer is
    exhausted for this cycle), and sets `state.auto_reset`. The few leftover images (< the
    number of replays per call) then simply start the next cycle as eligible again. Doing this
    inside jit keeps every replay slot valid, needs no host sync and keeps replicated state
    identical on every host.
  * the host calls `check_auto_reset(state)` after a call (whenever convenient: it reads one
    scalar) to log a warning when an automatic reset happened.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from owl_cl.replay.state import ReplayState
from owl_cl.train.sharding import fetch_replicated

Array = jax.Array

EVENTS = ("epoch", "dataset")
# name -> events on which the schedule resets, whether replays are marked.
_SCHEDULES = {
  "none": dict(events=(), marks=False),
  "epoch": dict(events=("epoch", "dataset"), marks=True),
  "dataset": dict(events=("dataset",), marks=True),
  "fraction": dict(events=(), marks=True),
}
FRACTION_RESETS = ("before", "after")
DEFAULT_FRACTION = 1.0 / 3.0  # paper §4: "within 1/3 of the replay buffer that is replayed"


@dataclasses.dataclass(frozen=True)
class DedupSchedule:
  """A deduplication schedule (static config; hashable, so usable as a jit static argument).

  Attributes:
    name: one of `SCHEDULE_NAMES` ('none', 'epoch', 'dataset', 'fraction').
    fraction: the 'fraction' schedule's period as a fraction of the buffer, in (0, 1]
      (None -> 1/3, the paper's); must be None for the other schedules.
    without_replacement: 'none' only: False (default) lets one call replay an image twice;
      True samples each call without replacement (the released code's 'batch' schedule).
      The marking schedules always sample without replacement.
    fraction_reset: 'fraction' only: 'before' (default) resets inside the call that would
      take the period past ceil(fraction * N); 'after' (the released code's 'proportion')
      resets after the call once more than fraction * N images were replayed.
  Raises:
    ValueError: unknown name, a fraction outside (0, 1], a fraction given to a schedule
      that does not take one, or an unknown fraction_reset.
  Source: paper §4, docs/reference.md §8; the released code's `ReplayBuffer.append_indices`.
  """

  name: str = "dataset"
  fraction: float | None = None
  without_replacement: bool = False
  fraction_reset: str = "before"

  def __post_init__(self):
    if self.name not in _SCHEDULES:
      raise ValueError(f"unknown dedup schedule {self.name!r}; known: {sorted(_SCHEDULES)}")
    if self.name == "fraction":
      if self.fraction is None:
        object.__setattr__(self, "fraction", DEFAULT_FRACTION)
      if not 0.0 < float(self.fraction) <= 1.0:
        raise ValueError(f"dedup fraction must be in (0, 1], got {self.fraction!r}")
      object.__setattr__(self, "fraction", float(self.fraction))
    elif self.fraction is not None:
      raise ValueError(f"dedup schedule {self.name!r} takes no fraction")
    if self.fraction_reset not in FRACTION_RESETS:
      raise ValueError(
        f"dedup fraction_reset={self.fraction_reset!r} is unknown; known: {FRACTION_RESETS}"
      )
    object.__setattr__(self, "without_replacement", bool(self.without_replacement))

  def period(self, num_images: int) -> int:
    """Replays per dedup period of the 'fraction' schedule: ceil(fraction * N) (>= 1)."""
    return max(1, math.ceil(self.fraction * int(num_images) - 1e-9))

  @property
  def marks_replays(self) -> bool:
    """Whether replayed images become ineligible (False only for 'none')."""
    return _SCHEDULES[self.name]["marks"]

  @property
  def samples_without_replacement(self) -> bool:
    """Whether one retrieval call replays each image at most once (all but plain 'none')."""
    return self.marks_replays or self.without_replacement

  def resets_on(self, event: str) -> bool:
    """Whether the schedule resets at `event` ('epoch' | 'dataset'); ValueError otherwise."""
    if event not in EVENTS:
      raise ValueError(f"unknown dedup event {event!r}; known: {EVENTS}")
    return event in _SCHEDULES[self.name]["events"]

  def in_call_reset(self, state: ReplayState, num_needed) -> Array:
    """bool []: whether a retrieval call needing `num_needed` images resets first (jittable).

    True iff replays are marked and either fewer than `num_needed` images are unreplayed
    (`exhausted`) or, for 'fraction', this call would take the period past
    ceil(fraction * N) replays (`period_over`). `num_needed` may be traced.
    """
    return self.exhausted(state, num_needed) | self.period_over(state, num_needed)

  def exhausted(self, state: ReplayState, num_needed) -> Array:
    """bool []: replays are marked and fewer than `num_needed` images are unreplayed."""
    if not self.marks_replays:
      return jnp.zeros((), bool)
    num_eligible = jnp.sum(~state.dedup_mask, dtype=jnp.int32)
    return num_eligible < num_needed

  def period_over(self, state: ReplayState, num_needed) -> Array:
    """bool []: 'fraction' only: num_replayed + num_needed > ceil(fraction * N), i.e. this
    call's replays would not all fit in the current period (so it starts a new one)."""
    if self.name != "fraction" or self.fraction_reset == "after":
      return jnp.zeros((), bool)
    period = self.period(state.dedup_mask.shape[0])
    return (state.num_replayed > 0) & (state.num_replayed + num_needed > period)


SCHEDULE_NAMES = tuple(_SCHEDULES)


def reset_after_call(state: ReplayState, schedule: str | DedupSchedule) -> ReplayState:
  """The released code's 'fraction' reset (jittable): after a call's replays are marked,
  resets (like `reset`) iff `fraction_reset == 'after'` and num_replayed > fraction * N.

  Args:
    state: ReplayState after `mark_replayed`.
    schedule: schedule name or DedupSchedule (static).
  Returns:
    the (possibly) reset state; unchanged for every other schedule.
  Source: the released code's `ReplayBuffer.append_indices` ('proportion':
    `dedup_prop * len(buffer) < len(current_indices)` -> reset).
  """
  schedule = as_schedule(schedule)
  if schedule.name != "fraction" or schedule.fraction_reset != "after":
    return state
  over = state.num_replayed.astype(jnp.float32) > schedule.fraction * state.dedup_mask.shape[0]
  return jax.tree_util.tree_map(lambda a, b: jnp.where(over, a, b), reset(state), state)


def as_schedule(schedule: str | DedupSchedule) -> DedupSchedule:
  """Returns `schedule` as a DedupSchedule (a name is looked up); ValueError if unknown."""
  if isinstance(schedule, DedupSchedule):
    return schedule
  if isinstance(schedule, str):
    return DedupSchedule(schedule)
  raise ValueError(f"expected a dedup schedule name or DedupSchedule, got {schedule!r}")


def eligible_images(state: ReplayState, schedule: str | DedupSchedule) -> Array:
  """bool [N]: buffer images that may be replayed now (all True with schedule 'none').

  Source: docs/reference.md §8. Jittable (schedule static).
  """
  schedule = as_schedule(schedule)
  if not schedule.marks_replays:
    return jnp.ones_like(state.dedup_mask)
  return ~state.dedup_mask


def mark_replayed(
  state: ReplayState, indices: Array, valid: Array, schedule: str | DedupSchedule | None = None
) -> ReplayState:
  """Records replays: marks `indices[valid]` in the dedup mask and updates the counters.

  Args:
    state: ReplayState.
    indices: int [B] buffer indices that were replayed (duplicates allowed).
    valid: bool [B]; only valid entries are marked/counted.
    schedule: optional; with a schedule that marks nothing ('none') only the counters change.
      None = always mark.
  Returns:
    the new ReplayState (num_replayed and total_replayed += number of valid entries).
  Source: docs/reference.md §8. Jittable.
  """
  indices = jnp.asarray(indices, jnp.int32)
  valid = jnp.asarray(valid, bool)
  count = jnp.sum(valid, dtype=jnp.int32)
  mask = state.dedup_mask
  if schedule is None or as_schedule(schedule).marks_replays:
    # invalid entries point past the end and are dropped.
    mask = mask.at[jnp.where(valid, indices, mask.shape[0])].set(True, mode="drop")
  return state.replace(
    dedup_mask=mask,
    num_replayed=state.num_replayed + count,
    total_replayed=state.total_replayed + count,
  )


def reset(state: ReplayState) -> ReplayState:
  """Unconditional reset: all images eligible again, num_replayed 0, num_resets + 1. Jittable."""
  return state.replace(
    dedup_mask=jnp.zeros_like(state.dedup_mask),
    num_replayed=jnp.zeros_like(state.num_replayed),
    num_resets=state.num_resets + 1,
  )


def reset_if(state: ReplayState, event: str, schedule: str | DedupSchedule) -> ReplayState:
  """Scheduled reset: resets iff `schedule` resets on `event`.

  Args:
    state: ReplayState.
    event: 'epoch' (end of an epoch) or 'dataset' (end of a dataset). Static.
    schedule: schedule name or DedupSchedule. Static.
  Returns:
    the (possibly) reset state; unchanged otherwise.
  Raises:
    ValueError: unknown event or schedule.
  Source: paper §4, docs/reference.md §8.
  """
  if as_schedule(schedule).resets_on(event):
    return reset(state)
  return state


def auto_reset_if_exhausted(
  state: ReplayState, schedule: str | DedupSchedule, num_needed: int
) -> ReplayState:
  """In-call automatic reset (jittable): resets before selection when the buffer is exhausted.

  Resets (like `reset`) iff `schedule.in_call_reset(state, num_needed)`, i.e. replays are
  marked and fewer than `num_needed` images are unreplayed (exhausted), or the 'fraction'
  schedule's period would be exceeded by this call; sets `state.auto_reset` to the exhausted
  flag only (False otherwise) so the host can log a warning (`check_auto_reset`).

  Args:
    state: ReplayState.
    schedule: schedule name or DedupSchedule (static).
    num_needed: replays the call will make (int, may be traced: the number of active slots).
  Source: docs/reference.md §8; this module's docstring.
  """
  schedule = as_schedule(schedule)
  exhausted = schedule.exhausted(state, num_needed)
  flag = exhausted | schedule.period_over(state, num_needed)
  reset_state = reset(state)
  new = jax.tree_util.tree_map(lambda a, b: jnp.where(flag, a, b), reset_state, state)
  # Only an exhausted buffer is worth a warning; a 'fraction' period ending is scheduled.
  return new.replace(auto_reset=exhausted & ~schedule.period_over(state, num_needed))


def check_auto_reset(state: ReplayState, logger: logging.Logger | None = None) -> bool:
  """Host-side: logs a warning and returns True iff the last call reset automatically.

  Reads the scalar `state.auto_reset` (a device->host transfer of one bool).
  """
  if not bool(fetch_replicated(state.auto_reset)):
    return False
  (logger or logging.getLogger(__name__)).warning(
    "Replay buffer exhausted: every image was replayed since the last dedup reset; "
    "the dedup mask was reset automatically (reset #%d, %d replays in total).",
    int(fetch_replicated(state.num_resets)),
    int(fetch_replicated(state.total_replayed)),
  )
  return True

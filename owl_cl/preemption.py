"""Preemption: SIGTERM asks the run to save a step checkpoint and stop at the next safe point.

SLURM (`--requeue`, `scancel`, the end of `--time` with `--signal`) and Cloud TPU maintenance
send SIGTERM some seconds before SIGKILL. `handle_sigterm()` (installed by
`owl_cl.experiment.run`) turns it into a flag; the training loop reads it after every step
(`requested`), saves a step checkpoint and raises `Preempted`; `owl_cl.main` logs one line and
exits with `EXIT_PREEMPTED`, so a job script can requeue on that status. The same command on
the same workdir then resumes from that checkpoint.

Safe points: after a training step (a step checkpoint is written first) and after a finished
dataset's stage checkpoint. During an evaluation or the buffer's selection the run goes on to
the next safe point; if SIGKILL comes first, the resume starts from the last complete
checkpoint instead (the result is the same, only the work since that checkpoint is redone).

A test-only hook, `OWL_CL_TEST_KILL_AT='<event>:<n>[:TERM]'`, makes the process SIGKILL (or
SIGTERM) itself at the n-th (1-based) occurrence of `<event>` (`checkpoint_event`); the
kill-and-resume test uses it to stop a run at chosen moments. Unset (always, outside the
tests) it costs one environment lookup per event.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import os
import signal
import threading

from absl import logging
import jax
import numpy as np

# Exit status of a run stopped by SIGTERM after saving its checkpoint: EX_TEMPFAIL of
# sysexits.h ("temporary failure, the user is invited to retry"), distinct from 0 (complete),
# 1 (diverged), 2 (bad input) and 128 + n (killed by signal n).
EXIT_PREEMPTED = 75

KILL_HOOK_ENV = "OWL_CL_TEST_KILL_AT"

_requested = threading.Event()
_event_counts: dict[str, int] = {}


class Preempted(Exception):  # noqa: N818 (a state, not a failure)
  """The run saved its checkpoint after SIGTERM and stops; the message says where."""


def _on_sigterm(signum, frame) -> None:
  del frame
  # Only a flag: the handler runs between two Python bytecodes of the main thread, anywhere;
  # the loop saves and stops at its next step boundary.
  _requested.set()
  logging.warning("signal %d received: saving a checkpoint at the next step, then stopping", signum)


@contextlib.contextmanager
def handle_sigterm() -> Iterator[None]:
  """Within the block SIGTERM sets the preemption flag instead of ending the process.

  Outside the main thread (where Python cannot install handlers) it does nothing. The
  previous handler is restored and the flag cleared on exit.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, _on_sigterm)
  _requested.clear()
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
    _requested.clear()


def request() -> None:
  """Sets the flag as SIGTERM would (for callers that learn of a preemption otherwise)."""
  _requested.set()


def requested_here() -> bool:
  """Whether this process received SIGTERM (no communication with other processes)."""
  return _requested.is_set()


def any_process(*flags: bool) -> tuple[bool, ...]:
  """Each of `flags` OR-ed over all processes (one small all-gather; local with 1 process).

  Every process must call it at the same point: the decision to save a checkpoint (a
  collective write) or to stop must be the same everywhere, while SIGTERM and the clock
  reach the processes at slightly different moments.
  """
  if jax.process_count() == 1:
    return tuple(bool(f) for f in flags)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))
  return tuple(bool(v) for v in np.asarray(gathered).reshape(-1, len(flags)).max(axis=0))


def checkpoint_event(name: str) -> None:
  """Marks one occurrence of event `name` (test-only SIGKILL hook, see module docstring).

  Events: 'train_step' (after a step of pre-training or of a dataset), 'eval_batch', 'save'
  (a step checkpoint's write has begun and is not finished), 'buffer' (the buffer's
  selection is about to start).
  """
  target = os.environ.get(KILL_HOOK_ENV)
  if not target:
    return
  event, count, *how = target.split(":")
  if event != name:
    return
  _event_counts[name] = _event_counts.get(name, 0) + 1
  if _event_counts[name] == int(count):
    signum = signal.SIGTERM if how == ["TERM"] else signal.SIGKILL
    logging.warning("test hook %s=%s: signal %d", KILL_HOOK_ENV, target, signum)
    logging.flush()
    os.kill(os.getpid(), signum)

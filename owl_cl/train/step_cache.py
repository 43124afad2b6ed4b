"""Jitted steps shared by the runs of one process that build them with the same static settings.

A run builds its jitted steps (train step, retrieval, prediction, text embeddings) from static
settings: the model (a linen module, hashed and compared by its configuration), the mesh, the
optimiser's settings and schedule length, the loss options. Each new function object is a new
entry of jit's cache, traced and lowered again even when its program is the same: on CPU that
was most of a tiny run's time (seconds per step function), and it is paid again by every
fine-tuning phase and every run of a notebook or a test. `shared(key, build)` returns the
function built for an equal `key` earlier in this process instead, so jit's caches of traces,
lowerings and executables are hit.

The key must name everything `build` reads (the callers put the model, the mesh and every
option in it); the functions hold no state of their own (parameters, optimiser state and keys
are their arguments), so sharing them changes no result. The newest `MAX_ENTRIES` are kept
(each holds its compiled executables); `clear()` forgets them all (the test session does,
before each test, so that no test sees what another one built).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
import threading
from typing import Any

# Entries kept: a run builds about ten step functions; a sweep of configs in one notebook more.
MAX_ENTRIES = 64

_lock = threading.Lock()
_entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()


def shared(key: Hashable, build: Callable[[], Any]) -> Any:
  """`build()`, or what it returned for an equal `key` earlier in this process.

  Args:
    key: hashable; equal only when `build` would make the same function (model, mesh and
      every static option it reads).
    build: makes the function (e.g. `step.make_train_step(...)`), called at most once per key
      while the entry is kept.
  Returns:
    what `build` returned for `key`.
  Raises:
    TypeError: `key` is not hashable. Whatever `build` raises (nothing is kept then).
  """
  with _lock:
    if key in _entries:
      _entries.move_to_end(key)
      return _entries[key]
  value = build()  # outside the lock: building may trace (and take seconds)
  with _lock:
    value = _entries.setdefault(key, value)
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
      _entries.popitem(last=False)
  return value


def clear() -> None:
  """Forgets every kept function (their executables are freed with the last reference)."""
  with _lock:
    _entries.clear()


def size() -> int:
  """The number of kept functions."""
  with _lock:
    return len(_entries)


def kept() -> dict[Hashable, Any]:
  """A copy of the kept functions by key, oldest first (to inspect: tests, notebooks)."""
  with _lock:
    return dict(_entries)

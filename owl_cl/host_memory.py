"""glibc malloc settings of the main job: freed host memory kept for reuse, not returned to the OS.

Why (docs/host_cost.md): XLA:CPU allocates the temporary buffer of every execution with
`malloc` (about 400 MB for the built-in benchmark's pre-training step) and frees it when the
execution ends. glibc serves a request above its mmap threshold (at most 32 MiB, however it is
set) with a fresh `mmap` and returns it with `munmap` on free, and XLA's worker threads allocate
from per-thread arenas, which also `mmap` any request larger than their 64 MiB heaps. So every
step mapped and unmapped hundreds of MB, and the kernel faulted in and zeroed every page again:
about 100k minor page faults per step, a third of the run's CPU time spent in the kernel.

`keep_freed_memory` makes glibc serve every allocation from the one main heap (`M_ARENA_MAX`
1), never by a separate `mmap` (`M_MMAP_MAX` 0), and keep freed memory at the heap's top
(`M_TRIM_THRESHOLD` unbounded): the next step reuses the pages already mapped. The cost: the
process keeps its peak heap (its RSS does not shrink after a large step), and threads share
one arena (malloc's lock: negligible beside XLA's large, infrequent allocations). The
computation is unchanged, so are the results: only where the bytes live.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# The environment variables of the same settings (glibc's tunables): a user who set any of
# them chose their own malloc behaviour, which is then left alone.
ENV_VARS = (
  "MALLOC_ARENA_MAX",
  "MALLOC_MMAP_MAX_",
  "MALLOC_MMAP_THRESHOLD_",
  "MALLOC_TRIM_THRESHOLD_",
  "MALLOC_TOP_PAD_",
  "GLIBC_TUNABLES",
)

# "Never trim": the largest value mallopt takes (its argument is a C int).
_UNBOUNDED = 2**31 - 1


def keep_freed_memory(environ: dict | None = None) -> str:
  """Sets glibc malloc to keep freed memory for reuse (module docstring); call it first thing.

  Must run before the threads that allocate exist (XLA's, created when JAX initializes its
  backend): a thread keeps the arena it was given. Settings of this process only; a child
  process starts with glibc's defaults.

  Args:
    environ: the environment to read the user's own malloc settings from (default
      `os.environ`).

  Returns:
    what was done, for the log: 'set', or why not ('not Linux', 'not glibc', 'left to the
    environment (MALLOC_ARENA_MAX)', 'mallopt refused <parameter>'). Never raises: the
    settings only save time.
  """
  environ = os.environ if environ is None else environ
  if not sys.platform.startswith("linux"):
    return "not Linux"
  chosen = [name for name in ENV_VARS if name in environ]
  if chosen:
    return f"left to the environment ({', '.join(chosen)})"
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
  except (OSError, AttributeError):
    return "not glibc"
  for name, parameter, value in (
    ("M_ARENA_MAX", M_ARENA_MAX, 1),
    ("M_MMAP_MAX", M_MMAP_MAX, 0),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, _UNBOUNDED),
  ):
    # mallopt returns 1 on success, 0 on error.
    if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1:
      return f"mallopt refused {name}"
  return "set"

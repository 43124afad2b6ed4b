"""Small helpers the whole package shares, each written once.

- `atomic_write` / `atomic_write_text`: write to a temporary file next to the target, then
  `os.replace` it, so a reader (or a resumed run) never sees a half-written file.
- `digest` / `file_digest`: the short content digests that key the caches (pre-trained model,
  replay buffer, real-data fingerprint).
- `shuffled`: the seeded permutation that orders the downstream sequence (`sequence_seed`).
- `expand_path`: `~` and relative paths of the config made absolute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

# Hex characters kept of a SHA-256 digest: 64 bits, plenty to tell cache entries apart.
DIGEST_CHARS = 16


def expand_path(path: str) -> str:
  """`path` with `~` expanded, made absolute (relative to the working directory)."""
  return os.path.abspath(os.path.expanduser(path))


def digest(obj: Any) -> str:
  """A 16-hex-character SHA-256 of `obj` as sorted-key JSON (non-JSON values via `str`).

  Equal for equal contents whatever the dict order, so it keys caches by their settings.
  """
  text = json.dumps(obj, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def file_digest(path: str) -> str:
  """A 16-hex-character SHA-256 of the bytes of the file at `path`.

  Raises:
    FileNotFoundError: no file at `path`.
  """
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:DIGEST_CHARS]


def shuffled(items: Sequence[T], seed: int | None) -> list[T]:
  """`items` in the order of NumPy's `default_rng(seed).permutation`; unchanged when seed is None.

  The run's downstream sequence order (config.sequence_seed): the same seed gives the same
  order on every machine (NumPy's PCG64 stream is fixed across versions).
  """
  items = list(items)
  if seed is None:
    return items
  order = np.random.default_rng(seed).permutation(len(items))
  return [items[i] for i in order]


def atomic_write(path: str, write: Callable[[str], None], *, suffix: str = "") -> None:
  """Calls `write(tmp)` on a temporary path next to `path`, fsyncs it, then renames it to `path`.

  `os.replace` is atomic on POSIX within one file system, so `path` holds either its old
  contents or the complete new ones, never a partial file (an interrupted run, a crash).

  Args:
    path: the file to (re)write; its folder is created when missing.
    write: writes the whole file at the path it is given.
    suffix: ending of the temporary name, for writers that append one otherwise (np.savez
      adds '.npz' to a name without it).

  Raises:
    Whatever `write` raises; the temporary file is removed first.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(
    dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp" + suffix
  )
  os.close(fd)
  try:
    write(tmp)
    with open(tmp, "rb+") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` atomically (`atomic_write`)."""

  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)

  atomic_write(path, write)


def atomic_write_json(path: str, obj: Any, **dump_kwargs) -> None:
  """Writes `obj` as JSON (`json.dumps(obj, **dump_kwargs)`) to `path` atomically."""
  atomic_write_text(path, json.dumps(obj, **dump_kwargs))

"""What a folder holds, to check that a refused, killed or skipped run left it untouched."""

from __future__ import annotations

import os


def snapshot(folder: str, mtimes: bool = False) -> dict[str, bytes | tuple[bytes, int]]:
  """Every file below `folder`, by path relative to it.

  Args:
    folder: a directory (a missing one gives {}).
    mtimes: also give each file's modification time (ns), so that a file rewritten with
      the same bytes differs too.
  Returns:
    {relative path: bytes}, or {relative path: (bytes, st_mtime_ns)} with `mtimes`.
  Raises:
    OSError: a file that cannot be read.
  """
  files = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        data = f.read()
      key = os.path.relpath(path, folder)
      files[key] = (data, os.stat(path).st_mtime_ns) if mtimes else data
  return files

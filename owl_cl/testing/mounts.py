"""Real file systems for the tests of a read-only cache and of a full disk.

`read_only_view` bind-mounts a folder read-only at another path (the kernel then refuses
every write there with EROFS, as on a cache shared read-only across a cluster); `small_tmpfs`
mounts a tmpfs of a given size (a write past it fails with ENOSPC, as on a full disk). Both
need the right to mount (root, or CAP_SYS_ADMIN): without it the test is skipped, with the
mount command's own message as the reason. Each view is unmounted when its block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import os
import subprocess

import pytest


def _mount(*args: str) -> None:
  """Runs `mount *args`; skips the calling test when mounting is not permitted here."""
  try:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
  except FileNotFoundError:
    pytest.skip("no `mount` command on this machine")
  if done.returncode != 0:
    pytest.skip(f"mounting is not permitted here (needs root): {done.stderr.strip()}")


def _umount(path: str) -> None:
  # Lazy: detached at once, released when its last file closes (a finished run's memory-mapped
  # replay store may still be mapped until garbage-collected).
  subprocess.run(["umount", "--lazy", path], capture_output=True, check=True)


@contextlib.contextmanager
def read_only_view(source: str, view: str) -> Iterator[str]:
  """`source` bind-mounted read-only at `view` (created) while the block runs.

  The same files as `source` (a write through `source` shows at `view`), none of them
  writable through `view`: `mount --bind` then `mount -o remount,bind,ro` (Linux). Unmounted
  however the block ends (`os.path.ismount` cannot tell a bind mount of the same file
  system, so the mount is tracked, not tested).
  """
  os.makedirs(view, exist_ok=True)
  _mount("--bind", source, view)
  try:
    _mount("-o", "remount,bind,ro", view)
    yield view
  finally:
    _umount(view)


@contextlib.contextmanager
def small_tmpfs(folder: str, size_bytes: int) -> Iterator[str]:
  """A tmpfs of `size_bytes` mounted at `folder` (created) while the block runs."""
  os.makedirs(folder, exist_ok=True)
  _mount("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", folder)
  try:
    yield folder
  finally:
    _umount(folder)

"""Where a run's code comes from: the commit and whether the tree was dirty (results.json).

`code_provenance()` describes the `owl_cl` package this process imported:

1. **git**, when the package is a tracked folder of a git checkout (`owl_cl/__init__.py` known
   to `git ls-files`, so a package merely installed inside some other repository, e.g. a
   virtual environment kept in a project's checkout, is not credited with that repository's
   commit): `commit` = `git rev-parse HEAD`, `dirty` = whether `git status --porcelain
   --untracked-files=no` lists anything, i.e. a tracked file differs from the commit (staged or
   not). Untracked files do not count: a checkout's workdirs, caches and notebooks' outputs
   would otherwise mark every run dirty.
2. **package metadata**, otherwise: the installed distribution's `direct_url.json` (PEP 610),
   written by pip when it installs from a version-control URL (`pip install git+https://...`):
   `commit` = its `vcs_info.commit_id`, `dirty` = False (pip builds from a clean clone of
   that commit). Used only when that distribution's files are the imported package's.
3. neither: `commit` and `dirty` None and `commit_source` a sentence saying why.

Nothing here raises: a missing git, a timeout or an unreadable metadata file gives case 3 (a
run never fails for its provenance). Source: git-rev-parse(1), git-status(1) ("porcelain"
format), git-ls-files(1); PEP 610 ("Recording the Direct URL Origin of installed
distributions"); `importlib.metadata`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from typing import Any

__all__ = ["code_provenance", "from_distribution", "from_git", "unknown"]

# The distribution `setup.py` installs.
DISTRIBUTION = "owl_cl"
# A git call that takes longer than this is given up (a hung network file system): the run
# goes on with an unknown commit rather than waiting.
GIT_TIMEOUT_S = 20.0
# `commit_source` values of the two known cases; an unknown commit's says why instead.
SOURCE_GIT = "git"
SOURCE_METADATA = "package metadata"


def unknown(reason: str) -> dict[str, Any]:
  """The record of an unknown commit: {'commit': None, 'dirty': None, 'commit_source':
  'unknown: <reason>'}."""
  return {"commit": None, "dirty": None, "commit_source": f"unknown: {reason}"}


def _git(folder: str, *args: str) -> tuple[int, str]:
  """(exit status, stdout stripped) of `git -C folder args`; (-1, why) if it could not run."""
  try:
    done = subprocess.run(
      ["git", "-C", folder, *args],
      capture_output=True,
      text=True,
      timeout=GIT_TIMEOUT_S,
      check=False,
      env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},  # `status` must not write the index.
    )
  except (OSError, subprocess.SubprocessError) as e:
    return -1, f"git could not run ({type(e).__name__}: {e})"
  if done.returncode != 0:
    return done.returncode, (done.stderr.strip().splitlines() or ["(no message)"])[-1]
  return 0, done.stdout.strip()


def from_git(package_dir: str) -> dict[str, Any] | None:
  """The git record of the package folder `package_dir`, or None when it is not a tracked
  folder of a git checkout (or git cannot run).

  Returns:
    {'commit': 40-hex str, 'dirty': bool, 'commit_source': 'git'} or None.
  """
  status, _ = _git(package_dir, "ls-files", "--error-unmatch", "__init__.py")
  if status != 0:
    return None
  status, commit = _git(package_dir, "rev-parse", "--verify", "HEAD")
  if status != 0:
    return None
  status, changes = _git(package_dir, "status", "--porcelain", "--untracked-files=no")
  if status != 0:
    return None
  return {"commit": commit, "dirty": bool(changes), "commit_source": SOURCE_GIT}


def from_distribution(
  distribution: importlib.metadata.Distribution, package_file: str
) -> dict[str, Any] | str:
  """The record of an installed distribution's `direct_url.json` (PEP 610), or a sentence
  saying why there is none.

  Args:
    distribution: e.g. `importlib.metadata.distribution('owl_cl')`.
    package_file: the imported package's `__init__.py`: the distribution counts only if it
      installed that very file.

  Returns:
    {'commit': str, 'dirty': False, 'commit_source': 'package metadata'}, or a str reason.
  """
  installed = os.path.realpath(str(distribution.locate_file("owl_cl/__init__.py")))
  if installed != os.path.realpath(package_file):
    return f"the installed {DISTRIBUTION} distribution is not the imported package"
  try:
    text = distribution.read_text("direct_url.json")
    record = json.loads(text) if text else None
  except (OSError, ValueError) as e:
    return f"its direct_url.json cannot be read ({e})"
  if not isinstance(record, dict):
    return "it was not installed from a URL (no direct_url.json)"
  commit = (record.get("vcs_info") or {}).get("commit_id")
  if not isinstance(commit, str) or not commit:
    return "it was installed from a URL without a version-control commit (direct_url.json)"
  return {"commit": commit, "dirty": False, "commit_source": SOURCE_METADATA}


def code_provenance(package_file: str | None = None) -> dict[str, Any]:
  """The commit of the imported `owl_cl` and whether its tree was dirty (module docstring).

  Args:
    package_file: the package's `__init__.py` (default: the imported `owl_cl`'s); tests pass
      another package's.

  Returns:
    {'commit': str | None, 'dirty': bool | None, 'commit_source': 'git' | 'package metadata' |
    'unknown: <reason>'}. Never raises.
  """
  if package_file is None:
    # owl_cl/eval/provenance.py -> owl_cl/__init__.py (without importing the package root).
    package_file = os.path.join(os.path.dirname(os.path.dirname(__file__)), "__init__.py")
  record = from_git(os.path.dirname(os.path.abspath(package_file)))
  if record is not None:
    return record
  try:
    distribution = importlib.metadata.distribution(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    return unknown(f"not a git checkout, and no {DISTRIBUTION} distribution is installed")
  except Exception as e:  # pylint: disable=broad-except  # a broken metadata folder
    return unknown(f"not a git checkout, and the installed metadata cannot be read ({e})")
  found = from_distribution(distribution, package_file)
  return found if isinstance(found, dict) else unknown(f"not a git checkout, and {found}")

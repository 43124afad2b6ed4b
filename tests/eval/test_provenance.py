"""owl_cl.eval.provenance: the commit of the code and whether its tree was dirty (issue 49
item 1), from a git checkout, from an installed distribution's direct_url.json, or unknown
with a reason; never an exception."""

import importlib.metadata
import json
import pathlib
import subprocess

import pytest

from owl_cl.eval import provenance

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def _git(repo, *args):
  subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
  """A git repository with a committed package `pkg/` (and an untracked `other/` package)."""
  repo = tmp_path / "repo"
  (repo / "pkg").mkdir(parents=True)
  (repo / "pkg" / "__init__.py").write_text("x = 1\n")
  (repo / "README").write_text("readme\n")
  _git(repo, "init", "-q", "-b", "main")
  _git(repo, "add", ".")
  _git(repo, "commit", "-q", "-m", "first")
  (repo / "other").mkdir()
  (repo / "other" / "__init__.py").write_text("")
  return repo


def _head_from_files(repo: pathlib.Path) -> str:
  """HEAD's commit read from .git's files (not through git): the independent reference."""
  ref = (repo / ".git" / "HEAD").read_text().split(": ")[1].strip()
  return (repo / ".git" / ref).read_text().strip()


def test_git_checkout_commit_and_dirty(checkout):
  package = str(checkout / "pkg")
  commit = _head_from_files(checkout)
  assert len(commit) == 40
  assert provenance.from_git(package) == {"commit": commit, "dirty": False, "commit_source": "git"}
  # Untracked files (workdirs, caches in a checkout) leave the tree clean.
  (checkout / "notes.txt").write_text("scratch\n")
  assert provenance.from_git(package)["dirty"] is False
  # A tracked file changed (anywhere in the tree), then staged: dirty, same commit.
  (checkout / "README").write_text("changed\n")
  assert provenance.from_git(package) == {"commit": commit, "dirty": True, "commit_source": "git"}
  _git(checkout, "add", "README")
  assert provenance.from_git(package)["dirty"] is True
  _git(checkout, "commit", "-q", "-m", "second")
  second = provenance.from_git(package)
  assert second == {"commit": _head_from_files(checkout), "dirty": False, "commit_source": "git"}
  assert second["commit"] != commit


def test_untracked_package_or_no_git_is_not_a_checkout(checkout, tmp_path, monkeypatch):
  # A package inside a repository that does not track it (a virtual environment kept in a
  # project's checkout) is not credited with that repository's commit.
  assert provenance.from_git(str(checkout / "other")) is None
  outside = tmp_path / "plain" / "pkg"
  outside.mkdir(parents=True)
  assert provenance.from_git(str(outside)) is None
  # No git on PATH: no record, no exception; code_provenance says why it has none (the tmp
  # package is not the installed owl_cl's, whatever is installed).
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  assert provenance.from_git(str(checkout / "pkg")) is None
  record = provenance.code_provenance(str(checkout / "pkg" / "__init__.py"))
  assert record["commit"] is None and record["dirty"] is None
  assert record["commit_source"].startswith("unknown: not a git checkout, and ")


def _distribution(site: pathlib.Path, direct_url=None):
  """An installed-looking owl_cl in `site`: its package and its .dist-info (PEP 610's
  direct_url.json when given)."""
  (site / "owl_cl").mkdir(parents=True)
  (site / "owl_cl" / "__init__.py").write_text("")
  info = site / "owl_cl-0.1.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: owl_cl\nVersion: 0.1.0\n")
  if direct_url is not None:
    (info / "direct_url.json").write_text(json.dumps(direct_url))
  return importlib.metadata.PathDistribution(info)


def test_installed_distribution_direct_url(tmp_path):
  vcs = {"url": "https://example.org/owl_cl.git", "vcs_info": {"vcs": "git", "commit_id": "c0ffee"}}
  dist = _distribution(tmp_path / "vcs", vcs)
  package = str(tmp_path / "vcs" / "owl_cl" / "__init__.py")
  assert provenance.from_distribution(dist, package) == {
    "commit": "c0ffee",
    "dirty": False,
    "commit_source": "package metadata",
  }
  # The distribution must have installed the imported package.
  other = tmp_path / "elsewhere.py"
  other.write_text("")
  assert "not the imported package" in provenance.from_distribution(dist, str(other))
  folder = _distribution(tmp_path / "dir", {"url": "file:///src", "dir_info": {}})
  assert "without a version-control commit" in provenance.from_distribution(
    folder, str(tmp_path / "dir" / "owl_cl" / "__init__.py")
  )
  plain = _distribution(tmp_path / "plain")
  assert "no direct_url.json" in provenance.from_distribution(
    plain, str(tmp_path / "plain" / "owl_cl" / "__init__.py")
  )
  (tmp_path / "plain" / "owl_cl-0.1.0.dist-info" / "direct_url.json").write_text("{not json")
  assert "cannot be read" in provenance.from_distribution(
    plain, str(tmp_path / "plain" / "owl_cl" / "__init__.py")
  )


def test_unknown_record():
  assert provenance.unknown("why") == {
    "commit": None,
    "dirty": None,
    "commit_source": "unknown: why",
  }

"""mkdocs hook: the benchmark pages that live outside docs/ become pages of the site.

benchmarks/README.md and benchmarks/results/*.md sit beside the scripts that write them; the
docs link to them with repository-relative paths (`../benchmarks/README.md`), which work on
GitHub. This hook adds those files to the site under `benchmarks/` and rewrites such links to
their site paths, so `mkdocs build --strict` checks them like any other link. Nothing is
copied into docs/: each page is written once, where its script writes it.
"""

import os
import posixpath
import re

from mkdocs.structure.files import File
from mkdocs.structure.files import InclusionLevel

# Repository folders (relative to the repository root) whose Markdown files join the site at
# the same relative path. benchmarks/README.md is in the nav; the result tables are reached
# through its links (a new result file needs no nav entry). `*_smoke.md` (the scripts' smoke
# mode, never committed) is left out.
REPO_PAGE_DIRS = ("benchmarks", "benchmarks/results")
NAV_PAGES = ("benchmarks/README.md",)

# An inline Markdown link or image target: `](target)` or `](target "title")`.
_LINK = re.compile(r"\]\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")


def _repo_root(config) -> str:
  return os.path.dirname(os.path.abspath(config["config_file_path"]))


def on_files(files, config):
  """Adds every Markdown file of REPO_PAGE_DIRS to the site (mkdocs hook)."""
  root = _repo_root(config)
  for folder in REPO_PAGE_DIRS:
    for name in sorted(os.listdir(os.path.join(root, folder))):
      if name.endswith(".md") and not name.endswith("_smoke.md"):
        src_uri = f"{folder}/{name}"
        inclusion = InclusionLevel.INCLUDED if src_uri in NAV_PAGES else InclusionLevel.NOT_IN_NAV
        path = os.path.join(root, folder, name)
        files.append(File.generated(config, src_uri, abs_src_path=path, inclusion=inclusion))
  return files


def on_page_markdown(markdown, page, config, files):
  """Rewrites links from docs/ pages to the repository's pages into site links (mkdocs hook)."""
  docs_rel = os.path.relpath(config["docs_dir"], _repo_root(config)).replace(os.sep, "/")
  if page.file.abs_src_path and not os.path.abspath(page.file.abs_src_path).startswith(
    os.path.abspath(config["docs_dir"]) + os.sep
  ):
    return markdown  # a page added by on_files: its links are already site-relative
  page_dir = posixpath.dirname(page.file.src_uri)

  def rewrite(match):
    target, title = match.group(1), match.group(2)
    if "://" in target or target.startswith("#"):
      return match.group(0)
    path, _, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(docs_rel, page_dir, path))
    if not any(posixpath.dirname(repo_path) == d for d in REPO_PAGE_DIRS):
      return match.group(0)
    site_path = posixpath.relpath(repo_path, page_dir or ".")
    return f"]({site_path}{'#' + anchor if anchor else ''}{title})"

  return _LINK.sub(rewrite, markdown)

"""mkdocs hook: the repository's Markdown pages outside docs/ become pages of the site.

README.md (the site's home page), benchmarks/README.md and benchmarks/results/*.md live where
GitHub shows them and where the scripts write them; the pages link to each other with
repository-relative paths (`docs/configs.md` from the README, `../benchmarks/README.md` from a
docs page), which work on GitHub. This hook adds those files to the site and rewrites every
link between pages to its site path, so `mkdocs build --strict` checks them like any other
link. Nothing is copied into docs/: each page is written once. It also fails the strict build
for a module of owl_cl that no page of the API reference (docs/api/*.md) renders.
"""

import glob
import logging
import os
import posixpath
import re

from mkdocs.structure.files import File
from mkdocs.structure.files import InclusionLevel

log = logging.getLogger("mkdocs.hooks.repo_pages")

# Repository file -> its path on the site. The README is the home page (docs/ has no index.md).
# benchmarks/README.md gets a name of its own: as `benchmarks/README.md` it would be the site's
# benchmarks/index.html, the path of docs/benchmarks.md too, and one page would replace the
# other.
REPO_PAGES = {"README.md": "index.md", "benchmarks/README.md": "benchmarks/methods.md"}
# Repository folders whose Markdown files (and PNG figures) join the site at the same path.
# benchmarks/README.md is in the nav; the result tables are reached through its links, so a new
# result file needs no nav entry. `*_smoke.md` (the scripts' smoke mode, never committed) is
# left out. benchmarks/results/sweep_builtin holds the committed sweep's report and figures
# (the README shows them; its runs/ subfolder holds only results.json files), as
# benchmarks/results/sweep_round2 the second's (with protection.md), and
# benchmarks/results/owlv2_builtin/{v1,v2} the reports of OWLv2 beside v1, and
# benchmarks/results/gpu_{second,third,fourth}_session/call* the raw output of GPU calls, and
# benchmarks/results/coco_backends/* the COCO scoring time of each backend, and
# benchmarks/results/scoring_hosts the scoring shared by the processes of a multi-process run.
REPO_PAGE_DIRS = (
  "benchmarks",
  "benchmarks/results",
  "benchmarks/results/sweep_builtin",
  "benchmarks/results/sweep_builtin/by_order/random_0",
  "benchmarks/results/sweep_builtin/by_order/random_1",
  "benchmarks/results/sweep_round2",
  "benchmarks/results/sweep_round2/by_order/random_0",
  "benchmarks/results/sweep_round2/by_order/random_1",
  "benchmarks/results/sweep_round2/by_order/random_2",
  "benchmarks/results/sweep_round2/by_order/random_3",
  "benchmarks/results/owlv2_builtin/v1",
  "benchmarks/results/owlv2_builtin/v2",
  "benchmarks/results/gpu_second_session/call1",
  "benchmarks/results/gpu_second_session/call2",
  "benchmarks/results/gpu_third_session/call1",
  "benchmarks/results/gpu_third_session/call2",
  "benchmarks/results/gpu_third_session/call3",
  "benchmarks/results/gpu_third_session/call4/peak1",
  "benchmarks/results/gpu_third_session/call4/peak2",
  "benchmarks/results/gpu_fourth_session/call1",
  "benchmarks/results/gpu_fourth_session/call2",
  "benchmarks/results/coco_backends/pycocotools",
  "benchmarks/results/coco_backends/faster_coco_eval",
  "benchmarks/results/scoring_hosts",
)
NAV_PAGES = ("index.md", "benchmarks/methods.md")

# An inline Markdown link or image target: `](target)` or `](target "title")`.
_LINK = re.compile(r"\]\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")


def _repo_root(config) -> str:
  return os.path.dirname(os.path.abspath(config["config_file_path"]))


def _repo_pages(config) -> dict[str, str]:
  """{repository path: site path} of every page (and figure) outside docs/."""
  root = _repo_root(config)
  pages = dict(REPO_PAGES)
  for folder in REPO_PAGE_DIRS:
    for name in sorted(os.listdir(os.path.join(root, folder))):
      if name.endswith((".md", ".png")) and not name.endswith(("_smoke.md", "_smoke.png")):
        pages.setdefault(f"{folder}/{name}", f"{folder}/{name}")
  return pages


def _undocumented_modules(root: str, docs_dir: str) -> list[str]:
  """owl_cl's modules that no `::: owl_cl.<module>` line of docs/api/*.md renders."""
  documented = set()
  for page in glob.glob(os.path.join(docs_dir, "api", "*.md")):
    with open(page) as f:
      documented.update(re.findall(r"^::: (owl_cl[\w.]*)\s*$", f.read(), re.M))
  missing = []
  for path in sorted(glob.glob(os.path.join(root, "owl_cl", "**", "*.py"), recursive=True)):
    rel = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
    # configs/examples/ holds example config files, not modules (no __init__.py; docs/data.md
    # shows own_data.py whole).
    if rel.endswith((".__init__", ".__main__")) or rel.startswith("owl_cl.configs.examples."):
      continue
    if rel not in documented:
      missing.append(rel)
  return missing


def on_files(files, config):
  """Adds the pages outside docs/ to the site (mkdocs hook).

  Also warns (so the strict build fails) for every owl_cl module the API reference leaves out.
  """
  root = _repo_root(config)
  for module in _undocumented_modules(root, config["docs_dir"]):
    log.warning(f"API reference: module {module} is on no docs/api/*.md page (add '::: {module}')")
  for repo_path, site_path in _repo_pages(config).items():
    inclusion = InclusionLevel.INCLUDED if site_path in NAV_PAGES else InclusionLevel.NOT_IN_NAV
    abs_path = os.path.join(root, repo_path)
    files.append(File.generated(config, site_path, abs_src_path=abs_path, inclusion=inclusion))
  return files


def on_page_markdown(markdown, page, config, files):
  """Rewrites repository-relative links between pages into site links (mkdocs hook)."""
  root = _repo_root(config)
  docs_rel = os.path.relpath(config["docs_dir"], root).replace(os.sep, "/")
  pages = _repo_pages(config)
  site_to_repo = {site: repo for repo, site in pages.items()}
  site_path = page.file.src_uri
  page_repo_path = site_to_repo.get(site_path, posixpath.join(docs_rel, site_path))
  page_repo_dir = posixpath.dirname(page_repo_path)
  page_site_dir = posixpath.dirname(site_path)

  def rewrite(match):
    target, title = match.group(1), match.group(2)
    if "://" in target or target.startswith(("#", "mailto:")):
      return match.group(0)
    path, hash_, anchor = target.partition("#")
    repo_target = posixpath.normpath(posixpath.join(page_repo_dir, path))
    if repo_target in pages:
      site_target = pages[repo_target]
    elif repo_target.startswith(docs_rel + "/"):
      site_target = repo_target[len(docs_rel) + 1 :]
    else:
      return match.group(0)  # not a page of the site: mkdocs reports it
    rel = posixpath.relpath(site_target, page_site_dir or ".")
    return f"]({rel}{hash_}{anchor}{title})"

  return _LINK.sub(rewrite, markdown)

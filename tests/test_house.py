"""The house rules of `owl_cl/` (issue 31; docs/CONVENTIONS.md, docs/architecture.md "Layers"),
checked on the source with `ast` so that they stay true: no file over 800 lines, no function
over 100 lines, no import of the package's own modules inside a function. Each rule has an
explicit exception list below, every entry with its reason; an entry that no longer applies
fails too, so the lists only shrink.
"""

import ast
import collections
import os
import pathlib
import re

import pytest
import setuptools

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "owl_cl"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100

# Functions over MAX_FUNCTION_LINES ('<file>:<qualified name>' -> reason): only where a long
# function reads better whole (said in a comment beside it), or while it is being split.
LONG_FUNCTIONS = {}

# In-function imports of owl_cl modules ((file, imported module) -> reason): only where the
# module imported needs torch, transformers or tensorflow (docs/architecture.md, "Layers").
FUNCTION_IMPORTS = {}


def file_lines(source: str) -> int:
  """The number of lines of a file's text (a last line without a newline counts)."""
  return len(source.splitlines())


def long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
  """{qualified name: lines} of the functions (methods, nested functions) of a parsed module
  longer than `limit` lines, from the `def` line (decorators not counted) to the last line of
  the body, docstring and comments inside included."""
  found = {}

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = prefix + child.name
        if not isinstance(child, ast.ClassDef):
          lines = child.end_lineno - child.lineno + 1
          if lines > limit:
            found[name] = lines
        visit(child, name + ".")
      else:
        visit(child, prefix)

  visit(tree, "")
  return found


def function_imports(tree: ast.Module, package: str) -> set[str]:
  """The owl_cl modules that the functions of a parsed module of the package `package` (e.g.
  'owl_cl.replay') import inside their bodies; relative imports are resolved, and
  `from owl_cl.x import y` names `owl_cl.x.y` when that is a module of the repository, else
  `owl_cl.x`."""
  found = set()

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
        found.update(n for n in _imported(child, package) if n.split(".")[0] == PACKAGE)
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

  visit(tree, False)
  return found


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
  """The modules an import statement of a module of `package` imports (dotted, absolute)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = node.module or ""
  if node.level:
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
  return [
    f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base for alias in node.names
  ]


def top_level_imports(tree: ast.Module, package: str) -> set[str]:
  """The modules a parsed module of `package` imports when it is imported: its imports outside
  function bodies (dotted, absolute, as `_imported` names them)."""
  found = set()

  def visit(node: ast.AST) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        found.update(_imported(child, package))
      elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        visit(child)

  visit(tree)
  return found


def import_chain(sources: dict, start: str, third_party: str) -> list[str] | None:
  """The shortest chain of imports by which importing the module `start` (dotted) imports the
  top-level package `third_party`, statically from `sources` ({'owl_cl/...py': (text, tree)}):
  [start, ..., the module that imports it, third_party]; None when none does. Importing
  'a.b.c' runs 'a' and 'a.b' too."""
  paths = {}
  for path in sources:
    name = path.removesuffix(".py").replace("/", ".")
    paths[name.removesuffix(".__init__")] = path
  parent = {start: None}
  queue = [start]
  while queue:
    name = queue.pop(0)
    path = paths[name]
    package = path.rsplit("/", 1)[0].replace("/", ".")
    for imported in sorted(top_level_imports(sources[path][1], package)):
      parts = imported.split(".")
      if parts[0] == third_party:
        chain = [third_party, name]
        while parent[chain[-1]] is not None:
          chain.append(parent[chain[-1]])
        return chain[::-1]
      for i in range(1, len(parts) + 1):
        module = ".".join(parts[:i])
        if module in paths and module not in parent:
          parent[module] = name
          queue.append(module)
  return None


def _is_module(name: str) -> bool:
  """Whether `name` (dotted) is a module or package of the repository."""
  path = REPO.joinpath(*name.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[str, ast.Module]]:
  """{path relative to the repository ('owl_cl/...py'): (text, parsed)} of every module of
  owl_cl, parsed once for all the rules (0.5 s of CPU)."""
  sources = {}
  for path in sorted((REPO / PACKAGE).rglob("*.py")):
    text = path.read_text(encoding="utf-8")
    sources[path.relative_to(REPO).as_posix()] = text, ast.parse(text, str(path))
  return sources


# ------------------------------------------------------------------------------------------
# The checkers, on hand-made sources (a rule that cannot fail checks nothing).
# ------------------------------------------------------------------------------------------


def test_long_functions_counts_def_to_last_line_with_qualified_names():
  body = "".join(f"  x{i} = {i}\n" for i in range(99))
  source = (
    "@decorator\n"
    f"def exactly_100():\n{body}\n"  # def + 99 lines: at the limit, not over
    f"def over():\n{body}  y = 1\n\n"  # def + 100 lines
    "class A:\n"
    "  def method(self):\n"
    "    def inner():\n"  # def + 99 lines: at the limit
    + "".join(f"      x{i} = {i}\n" for i in range(99))
    + "    return inner\n"  # method: def + inner's 100 + this line
  )
  found = long_functions(ast.parse(source))
  assert found == {"over": 101, "A.method": 102}
  assert long_functions(ast.parse(source), limit=200) == {}


def test_function_imports_finds_own_modules_only_inside_functions():
  source = (
    "from owl_cl import utils\n"  # top level: allowed
    "import numpy\n"
    "def f():\n"
    "  from owl_cl import integrity\n"  # a module of the package
    "  from owl_cl.trainer import TrainingDivergedError\n"  # a name of a module
    "  import json\n"
    "  from . import store\n"  # relative: owl_cl.replay.store
    "  class C:\n"
    "    def g(self):\n"
    "      import owl_cl.eval.results\n"
    "  return C\n"
  )
  assert function_imports(ast.parse(source), "owl_cl.replay") == {
    "owl_cl.integrity",
    "owl_cl.trainer",
    "owl_cl.replay.store",
    "owl_cl.eval.results",
  }
  assert function_imports(ast.parse("from owl_cl import utils\n"), "owl_cl") == set()


# ------------------------------------------------------------------------------------------
# The rules, on owl_cl/.
# ------------------------------------------------------------------------------------------


def test_no_file_over_800_lines(sources):
  long = {path: file_lines(text) for path, (text, _) in sources.items()}
  assert {p: n for p, n in long.items() if n > MAX_FILE_LINES} == {}
  assert len(sources) > 50  # the package was found (a wrong path would check nothing)


def test_no_function_over_100_lines_but_the_listed(sources):
  found = {
    f"{path}:{name}": lines
    for path, (_, tree) in sources.items()
    for name, lines in long_functions(tree).items()
  }
  unlisted = {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS}
  assert unlisted == {}, "split them, or list them in LONG_FUNCTIONS with the reason"
  stale = sorted(set(LONG_FUNCTIONS) - set(found))
  assert stale == [], "no longer over the limit (or gone): remove them from LONG_FUNCTIONS"


def test_no_in_function_import_of_owl_cl_but_the_listed(sources):
  found = set()
  for path, (_, tree) in sources.items():
    package = path.rsplit("/", 1)[0].replace("/", ".")
    found.update((path, imported) for imported in function_imports(tree, package))
  unlisted = sorted(found - set(FUNCTION_IMPORTS))
  assert unlisted == [], "import them at the top, or list them in FUNCTION_IMPORTS with why"
  stale = sorted(set(FUNCTION_IMPORTS) - found)
  assert stale == [], "no longer imported in a function: remove them from FUNCTION_IMPORTS"


def test_import_chain_follows_top_level_imports_and_parent_packages():
  sources = {
    path: (text, ast.parse(text))
    for path, text in {
      "owl_cl/configs/base.py": "from owl_cl.train import spec\n",
      "owl_cl/train/__init__.py": "",
      "owl_cl/train/spec.py": "import os\ndef f():\n  import orbax\nfrom . import step\n",
      "owl_cl/train/step.py": "import orbax.checkpoint as ocp\n",
      "owl_cl/model/__init__.py": "import jax\n",
    }.items()
  }
  chain = import_chain(sources, "owl_cl.configs.base", "orbax")
  assert chain == ["owl_cl.configs.base", "owl_cl.train.spec", "owl_cl.train.step", "orbax"]
  assert import_chain(sources, "owl_cl.configs.base", "jax") is None  # model is not imported
  assert import_chain(sources, "owl_cl.train.spec", "os") == ["owl_cl.train.spec", "os"]


def test_a_config_file_imports_no_orbax(sources):
  # configs/base.py, which every config file imports, imports the specs: none of them may
  # pull in the checkpoint library (0.2 s and ~290 modules; CheckpointSpec has its own light
  # module). jax still comes in (the specs take option lists from the JAX modules).
  chain = import_chain(sources, "owl_cl.configs.base", "orbax")
  assert chain is None, " -> ".join(chain)


def test_every_exception_has_a_reason():
  for reason in list(LONG_FUNCTIONS.values()) + list(FUNCTION_IMPORTS.values()):
    assert isinstance(reason, str) and len(reason.split()) >= 3, reason


def test_installing_adds_only_the_owl_cl_name():
  # A top-level `configs` package in site-packages would collide with any other project's.

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "setup.py")) as f:
    include = ast.literal_eval(re.search(r"find_packages\(include=(\[.*?\])\)", f.read())[1])
  found = setuptools.find_packages(where=root, include=include)
  assert "owl_cl.configs" in found
  assert {name.split(".")[0] for name in found} == {"owl_cl"}
  assert os.path.realpath(os.path.join(root, "configs")) == os.path.join(root, "owl_cl", "configs")


# Test folders beside the package's sub-packages: whole runs and cross-cutting behaviour
# (e2e), the benchmark scripts (benchmarks), the launch scripts (launch), committed reference
# outputs (reference_runs).
TEST_FOLDERS_BESIDE_THE_PACKAGE = {"e2e", "benchmarks", "launch", "reference_runs"}
# Top-level test files named after no one module: the package's house rules, the bad inputs
# of every layer, refused before any work, and the names written by hand (test_names.py).
TOP_LEVEL_TESTS_OF_THE_WHOLE = {"test_house.py", "test_bad_inputs.py", "test_names.py"}


def test_tests_mirror_the_package():
  tests = pathlib.Path(__file__).parent
  package = tests.parent / "owl_cl"
  subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
  folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders - subpackages - TEST_FOLDERS_BESIDE_THE_PACKAGE == set()
  modules = {p.stem for p in package.glob("*.py")}
  for test in tests.glob("test_*.py"):
    named = test.stem.removeprefix("test_")
    assert test.name in TOP_LEVEL_TESTS_OF_THE_WHOLE or any(
      named == m or named.startswith(m + "_") for m in modules
    ), f"{test.name}: name it after the top-level module it tests, or move it to its folder"


def test_no_two_test_files_share_a_name():
  # pytest imports a test file by its base name (no __init__.py in tests/): a second file of
  # the same name anywhere under tests/ is an error of the whole collection, not of one file.
  tests = pathlib.Path(__file__).parent
  names = collections.Counter(p.name for p in tests.rglob("test_*.py"))
  assert [name for name, count in names.items() if count > 1] == []

"""notebooks/analysis.ipynb: valid nbformat 4 JSON, code cells compile, allowed imports only."""

import ast
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPO, "notebooks", "analysis.ipynb")
ALLOWED = {"owl_cl", "numpy", "matplotlib", "json", "os", "glob"}


def test_notebook_valid_and_compiles():
  with open(NOTEBOOK, encoding="utf-8") as f:
    nb = json.load(f)
  assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
  assert isinstance(nb["metadata"], dict) and nb["cells"]
  code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
  assert len(code_cells) >= 4
  names_used = set()
  for n, cell in enumerate(nb["cells"]):
    assert cell["cell_type"] in ("code", "markdown") and isinstance(cell["metadata"], dict)
    assert isinstance(cell["source"], list) and all(isinstance(s, str) for s in cell["source"])
    if cell["cell_type"] != "code":
      continue
    assert cell["outputs"] == [] and cell["execution_count"] is None  # not executed
    source = "".join(cell["source"])
    tree = compile(source, f"{NOTEBOOK}[cell {n}]", "exec", ast.PyCF_ONLY_AST)
    compile(source, f"{NOTEBOOK}[cell {n}]", "exec")
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        roots = {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        roots = {(node.module or "").split(".")[0]}
      else:
        if (
          isinstance(node, ast.Attribute)
          and isinstance(node.value, ast.Name)
          and node.value.id == "analysis"
        ):
          names_used.add(node.attr)
        continue
      assert roots <= ALLOWED, f"cell {n} imports {roots - ALLOWED}"
  # Every owl_cl.analysis function the notebook calls exists.
  from owl_cl import analysis

  assert names_used >= {
    "load_run",
    "plot_stage_heatmap",
    "plot_forgetting_curves",
    "forgetting_curve",
    "records_figures",
  }
  assert all(hasattr(analysis, name) for name in names_used)


def test_notebook_runs_on_fake_sweep(tmp_path, monkeypatch):
  """Executes the code cells (display stubbed) on two fake runs below workdirs/sweep."""
  from matplotlib.figure import Figure
  from test_analysis import make_results  # same folder (rootdir-less tests)
  from test_analysis import write_records  # same folder (rootdir-less tests)

  from owl_cl.eval import results as rl

  for run_id, algorithm in (("a", "no_replay"), ("b", "swil")):
    workdir = tmp_path / "workdirs" / "sweep" / f"{algorithm}_seed0"
    results = make_results(run_id=run_id, algorithm=algorithm)
    rl.write_results(str(workdir), dict(results, status="complete"))
  write_records(str(tmp_path / "workdirs" / "sweep" / "swil_seed0" / "records" / "D1.npz"))
  monkeypatch.chdir(tmp_path)
  with open(NOTEBOOK, encoding="utf-8") as f:
    nb = json.load(f)
  shown = []
  namespace = {"display": shown.append}
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      exec(compile("".join(cell["source"]), NOTEBOOK, "exec"), namespace)  # pylint: disable=exec-used
  # 2 heat maps + the report's 2 figures (one run each: swil against no_replay, paired on
  # seed 0 and the order) + 1 forgetting figure + 4 records figures of swil / D1.
  assert len(shown) == 9 and all(isinstance(f, Figure) for f in shown)

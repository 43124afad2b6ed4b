"""notebooks/analysis.ipynb: committed without outputs, and executed end to end by a Jupyter
kernel (nbclient, the execution engine of nbconvert and papermill) on the committed sweep and
on a fake sweep with retrieval records."""

import ast
import base64
import os
import struct
import subprocess
import sys
import types

import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPO, "notebooks", "analysis.ipynb")
SWEEP_RUNS = os.path.join(REPO, "benchmarks", "results", "sweep_builtin", "runs")
ALLOWED = {"owl_cl", "numpy", "matplotlib", "json", "os", "glob", "subprocess", "sys"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _read():
  return nbformat.read(NOTEBOOK, as_version=nbformat.NO_CONVERT)


def _python_of(cell) -> str:
  """The cell's source as IPython runs it (`%matplotlib inline` -> a `get_ipython()` call)."""
  from IPython.core.inputtransformer2 import TransformerManager

  return TransformerManager().transform_cell(cell.source)


def test_notebook_valid_stripped_and_compiles():
  nb = _read()
  nbformat.validate(nb)  # nbformat 4 schema, cell ids included
  code_cells = [c for c in nb.cells if c.cell_type == "code"]
  assert len(code_cells) >= 4
  # The file is committed without outputs: what a run drew stays on the machine that ran it.
  for cell in code_cells:
    assert cell.outputs == [] and cell.execution_count is None, (
      f"{NOTEBOOK}: cell {cell.id} has outputs; clear them before committing "
      "(Jupyter: Edit > Clear Outputs of All Cells)"
    )
    assert "execution" not in cell.metadata, f"{NOTEBOOK}: cell {cell.id} has execution timings"
  assert [c.id for c in nb.cells if "parameters" in c.metadata.get("tags", [])] == ["parameters"]
  names_used = set()
  for cell in code_cells:
    source = _python_of(cell)
    tree = compile(source, f"{NOTEBOOK}[{cell.id}]", "exec", ast.PyCF_ONLY_AST)
    compile(source, f"{NOTEBOOK}[{cell.id}]", "exec")
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
      assert roots <= ALLOWED, f"cell {cell.id} imports {roots - ALLOWED}"
  from owl_cl import analysis

  assert names_used >= {"load_run", "plot_stage_heatmap", "forgetting_curve", "records_figures"}
  assert all(hasattr(analysis, name) for name in names_used)


def _install_cell(monkeypatch, on_colab: bool, repo_url: str = ""):
  """Runs the first code cell in this process with `subprocess.run` recorded (nothing is
  cloned or installed) and `google.colab` imported or not; returns the recorded commands."""
  (cell,) = [c for c in _read().cells if c.get("id") == "install"]
  source = cell.source.replace('REPO_URL = ""', f"REPO_URL = {repo_url!r}")
  assert source.count(f"REPO_URL = {repo_url!r}") == 1
  if on_colab:
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
  else:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
  monkeypatch.setattr(sys, "path", list(sys.path))  # the cell prepends the clone
  commands = []
  monkeypatch.setattr(subprocess, "run", lambda args, **kw: commands.append((args, kw)))
  exec(compile(source, NOTEBOOK, "exec"), {})  # pylint: disable=exec-used
  return commands


def test_install_cell_acts_on_colab_only(monkeypatch):
  assert _install_cell(monkeypatch, on_colab=False) == []  # a local kernel: nothing
  with pytest.raises(ValueError, match="Colab: set REPO_URL in this cell"):
    _install_cell(monkeypatch, on_colab=True)
  url = "https://example.org/owl_cl.git"
  commands = _install_cell(monkeypatch, on_colab=True, repo_url=url)
  assert commands == [
    (["git", "clone", "--depth=1", url, "/content/owl_cl"], {"check": True}),
    ([sys.executable, "-m", "pip", "install", "-q", "-e", "/content/owl_cl"], {"check": True}),
  ]


def _execute(tmp_path, monkeypatch, parameters: str | None = None):
  """Runs every cell in a fresh kernel whose working folder is an empty tmp folder; returns
  the executed notebook. `parameters`: code run after the `parameters` cell (as papermill
  injects a cell there). IPython's and Jupyter's own files go below tmp_path too, not into
  the home folder."""
  import nbclient

  # JUPYTER_DATA_DIR: also hides a user's own `python3` kernel spec, which could name another
  # interpreter; the kernel is this environment's (ipykernel's spec runs sys.executable).
  for name, sub in (
    ("IPYTHONDIR", "ipython"),
    ("JUPYTER_DATA_DIR", "jupyter_data"),
    ("JUPYTER_RUNTIME_DIR", "jupyter_runtime"),
  ):
    os.makedirs(tmp_path / sub)
    monkeypatch.setenv(name, str(tmp_path / sub))
  cwd = tmp_path / "cwd"
  os.makedirs(cwd)
  nb = _read()
  if parameters is not None:
    at = [c.id for c in nb.cells].index("parameters") + 1
    nb.cells.insert(at, nbformat.v4.new_code_cell(parameters))
  client = nbclient.NotebookClient(
    nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
  )
  client.execute()  # raises CellExecutionError (with the traceback) when a cell fails
  assert os.listdir(cwd) == []  # FIGURES_DIR is None: the notebook writes nothing
  return nb


def _outputs(nb, cell_id):
  (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
  assert not [o for o in cell.outputs if o.output_type == "error"]
  text = "".join(o.text for o in cell.outputs if o.output_type == "stream")
  pngs = [
    base64.b64decode(o.data["image/png"])
    for o in cell.outputs
    if o.output_type == "display_data" and "image/png" in o.data
  ]
  # Each figure is displayed as a PNG (IPython's inline formatter), not only as its text
  # repr '<Figure size ...>'. The smallest figure, the forest plot of one compared algorithm,
  # is 1.35 in tall: over 100 px at the inline backend's 100 dpi.
  for png in pngs:
    assert png.startswith(PNG_SIGNATURE)
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk, first after the signature
    assert min(width, height) >= 100, (width, height)
  assert len(pngs) == sum(o.output_type == "display_data" for o in cell.outputs)
  return text, len(pngs)


def _files(*folders):
  """{path: (size, mtime in ns)} of every file below `folders`."""
  out = {}
  for folder in folders:
    for parent, _, names in os.walk(folder):
      for name in names:
        stat = os.stat(os.path.join(parent, name))
        out[os.path.join(parent, name)] = (stat.st_size, stat.st_mtime_ns)
  return out


@pytest.mark.slow
def test_notebook_runs_on_committed_sweep(tmp_path, monkeypatch):
  """The notebook as committed, as a user opens it: it reads the committed sweep and draws
  every figure, writing nothing into the checkout or its working folder."""
  # The folders it reads and lives in (FIGURES_DIR or a relative path would land there).
  before = _files(SWEEP_RUNS, os.path.dirname(NOTEBOOK))
  nb = _execute(tmp_path, monkeypatch)
  assert _files(SWEEP_RUNS, os.path.dirname(NOTEBOOK)) == before
  algorithms = sorted({n.rsplit("_random_", 1)[0] for n in os.listdir(SWEEP_RUNS)})
  assert len(algorithms) == 15  # docs/experiments.md: 10 retrieval + 5 baselines
  text, images = _outputs(nb, "load")
  assert text.startswith(f"150 runs below {SWEEP_RUNS}\n")
  assert all(f"| {a} | 10 |" in text for a in algorithms)  # the merged Table 3, 10 runs each
  text, images = _outputs(nb, "report")
  assert text.startswith("# Sweep report") and images == 2  # forgetting bands, forest plot
  assert _outputs(nb, "heatmaps")[1] == len(algorithms)  # one per algorithm
  text, images = _outputs(nb, "forgetting")
  assert images == 1 and len(text.splitlines()) == len(algorithms)
  # After pre-training and after each of the 7 datasets (`joint`: after its one stage). As the
  # notebook's text says, the sweep evaluates the pre-training set only first (the one
  # pre-trained model: 21.8, the report's "No fine-tuning") and last, but for `per_task`.
  for line in text.splitlines():
    values = line.split(": ")[1].split(", ")
    assert len(values) == (2 if line.startswith("joint ") else 8), line
    assert values[0] == "21.8" and values[-1] != "nan", line
    if line.startswith("per_task "):
      assert "nan" not in values, line
    else:
      assert set(values[1:-1]) <= {"nan"}, line
  text, images = _outputs(nb, "records")
  # No records committed: the output says so and how to produce them, and draws nothing.
  assert text.startswith("0 of 150 runs have retrieval records.\nFigures 3-5 read a run's")
  assert "--config=configs/swil.py:builtin2 --workdir=workdirs/swil" in text and images == 0


@pytest.mark.slow
def test_notebook_runs_on_fake_sweep_with_records(tmp_path, monkeypatch):
  """SWEEP set to two fake runs, one with retrieval records: the records figures are drawn."""
  from test_analysis import make_results  # same folder (rootdir-less tests)
  from test_analysis import write_records  # same folder (rootdir-less tests)

  from owl_cl.eval import results as rl

  sweep = tmp_path / "sweep"
  for run_id, algorithm in (("a", "no_replay"), ("b", "swil")):
    results = make_results(run_id=run_id, algorithm=algorithm)
    rl.write_results(str(sweep / f"{algorithm}_seed0"), dict(results, status="complete"))
  write_records(str(sweep / "swil_seed0" / "records" / "D1.npz"))
  nb = _execute(tmp_path, monkeypatch, parameters=f"SWEEP = {str(sweep)!r}")
  assert _outputs(nb, "load")[0].startswith(f"2 runs below {sweep}\n")
  # The report's 2 figures (swil against no_replay, paired on seed 0 and the order), one heat
  # map per algorithm, one forgetting figure.
  assert _outputs(nb, "report")[1] == 2
  assert _outputs(nb, "heatmaps")[1] == 2
  assert _outputs(nb, "forgetting")[1] == 1
  text, images = _outputs(nb, "records")
  assert text.startswith("1 of 2 runs have retrieval records.\n") and "Figures 3-5" not in text
  assert "swil (swil_seed0) / D1: 2 retrieval calls\n" in text
  # write_records fills all four kinds: classes, entropies, KNN-SVs, distance ranks.
  assert images == 4

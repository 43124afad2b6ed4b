"""A run over a user-declared sequence: two COCO folders and a TFDS dataset (docs/data.md).

The "Your own data" quick-try commands of docs/data.md are read from that page and run as written,
as subprocesses from the repository root: `python -m owl_cl.testing.own_data ...` writes the
data (two COCO folders and a TFDS ArrayRecord dataset, from the built-in benchmark's images)
and `python -m owl_cl.main --config=configs/examples/own_data.py:<dir>,quick ...` runs the
worked example with the tiny budget. Only the folders `/tmp/own_data`, `/tmp/own_run` and
`/tmp/owl_cl_quick` (the cache, pointed at the session's `pretrained_cache_dir`, which holds
the tiny benchmark and pre-trained model that run uses) are replaced, and `python` by this
interpreter.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow_datasets", reason="writing the TFDS fixture needs it")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGE = os.path.join(REPO, "docs", "data.md")
WRITE = "python -m owl_cl.testing.own_data "
RUN = "python -m owl_cl.main --config=configs/examples/own_data.py:"
# The page's quick-try folders, replaced by the test's.
DATA, WORKDIR, CACHE = "/tmp/own_data", "/tmp/own_run", "/tmp/owl_cl_quick"


def _page_section() -> str:
  with open(PAGE) as f:
    text = f.read()
  start = text.index("## Your own data")
  end = text.index("\n## ", start + 1)
  return text[start:end]


def _commands() -> dict[str, list[str]]:
  """{'write' | 'run', 'full' | 'quick'}: the page's command lines, split as a shell does."""
  lines = [line for line in _page_section().splitlines() if line.startswith((WRITE, RUN))]
  out = {}
  for line in lines:
    key = ("write" if line.startswith(WRITE) else "run", "quick" if "quick" in line else "full")
    assert key not in out, f"two lines of the page for {key}: {line}"
    out[key] = shlex.split(line)
  assert sorted(out) == [("run", "full"), ("run", "quick"), ("write", "full"), ("write", "quick")]
  return out


def _without_quick(tokens: list[str], data: str) -> list[str]:
  """A quick-try command as the full one: no --quick / cache flags, `data` for DATA."""
  out = []
  for t in tokens:
    if t == "--quick" or t.startswith(("--cache_dir=", "--config.cache_dir=")):
      continue
    out.append(t.replace(f"{DATA},quick", data).replace(DATA, data))
  return out


def test_page_config_file_is_the_shipped_one():
  with open(os.path.join(REPO, "configs", "examples", "own_data.py")) as f:
    shipped = f.read()
  for block in re.findall(r"```python\n(.*?)```", _page_section(), re.S):
    if "def get_config" in block:
      assert block.strip() in shipped, block
      break
  else:
    pytest.fail("docs/data.md 'Your own data' shows no config file")
  # The full commands are the quick try's without the quick options (same tools, flags, config).
  commands = _commands()
  data = commands["write", "full"][3]
  assert commands["write", "full"] == _without_quick(commands["write", "quick"], data)
  workdir = next(a for a in commands["run", "full"] if a.startswith("--workdir="))
  quick_run = _without_quick(commands["run", "quick"], data)
  assert commands["run", "full"] == [
    workdir if a.startswith("--workdir=") else a for a in quick_run
  ]


@pytest.mark.slow
def test_page_quick_try_runs_as_written(pretrained_cache_dir, tmp_path):
  """The page's two quick-try lines, run as written; results.json / results.md checked."""
  commands = _commands()
  data_dir, workdir = str(tmp_path / "own"), str(tmp_path / "run")
  folders = {DATA: data_dir, WORKDIR: workdir, CACHE: pretrained_cache_dir}
  for key in (("write", "quick"), ("run", "quick")):
    argv = commands[key]
    assert argv[:2] == ["python", "-m"], argv
    line = " ".join(argv)
    for placeholder in (DATA, CACHE) + ((WORKDIR,) if key[0] == "run" else ()):
      assert placeholder in line, (placeholder, line)
    for placeholder, folder in folders.items():
      argv = [a.replace(placeholder, folder) for a in argv]
    done = subprocess.run(
      [sys.executable, *argv[1:]],
      cwd=REPO,
      capture_output=True,
      text=True,
      check=False,
      timeout=600,
    )
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"

  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  assert results["status"] == "complete"
  assert results["sequence"] == ["kitchen", "warehouse", "shelf"]
  assert [s["name"] for s in results["stages"]] == ["pretrained", "kitchen", "warehouse", "shelf"]
  everything = {"pretrain_val", "held_out", "kitchen", "warehouse", "shelf"}
  for stage in results["stages"]:
    last = stage["name"] in ("pretrained", "shelf")
    assert set(stage["metrics"]) == (everything if last else {"kitchen", "warehouse", "shelf"})
    for values in stage["metrics"].values():
      assert values["num_images"] == 8  # the quick try's max_eval_images
      assert 0.0 <= values["AP50"] <= 1.0
  with open(os.path.join(workdir, "results.md")) as f:
    text = f.read()
  assert "- status: complete" in text
  assert "- sequence (3): kitchen -> warehouse -> shelf" in text
  # The per-dataset table: a column per eval set, a row per stage.
  header = "| Stage | `pretrain_val` | `held_out` | `kitchen` | `warehouse` | `shelf` |"
  assert header in text
  for row in ("| 0: pretrained |", "| 1: kitchen |", "| 2: warehouse |", "| 3: shelf |"):
    assert row in text, row
  assert "| No fine-tuning |" in text
  # The same dataset read from COCO json and from TFDS: warehouse and shelf are both the
  # built-in 'digits', so every stage scores them the same.
  for stage in results["stages"]:
    for key in ("AP", "AP50"):
      want = stage["metrics"]["warehouse"][key]
      assert stage["metrics"]["shelf"][key] == pytest.approx(want, abs=1e-6, nan_ok=True)

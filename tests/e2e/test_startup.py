"""What a run's process imports at start-up: only what every run uses.

Each `python -m owl_cl.main` process (and each test worker) pays its imports; the modules below
are imported by the functions that need them (a LoRA run, the 'scipy' matcher, the built-in
benchmark's renderer and version-2 design, the HF converters), never at start-up.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_AT_START = ("qwix", "scipy.optimize", "matplotlib", "torch", "transformers", "tensorflow")


def _python(code: str) -> str:
  """The standard output of `python -c code` in a fresh process (fails on a non-zero exit)."""
  done = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(os.environ, PYTHONPATH=REPO),
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout


@pytest.mark.slow
def test_importing_main_leaves_the_optional_heavy_modules_unimported():
  code = (
    "import sys\n"
    "import owl_cl.main\n"
    f"print(sorted(m for m in {NOT_AT_START!r} if m in sys.modules))\n"
  )
  assert _python(code).strip().splitlines()[-1] == "[]"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_importing_the_writer_leaves_torch_unimported_but_importable():
  # tensorboardX imports torch whenever it is installed (owl_cl.summary_writer hides it).
  code = (
    "import sys\n"
    "import owl_cl.summary_writer\n"
    "assert 'torch' not in sys.modules, 'torch was imported'\n"
    "import torch\n"
    "assert torch.zeros(2).sum().item() == 0.0\n"
  )
  _python(code)

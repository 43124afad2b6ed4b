"""owl_cl.utils.atomic_directory: a folder appears complete or not at all."""

import os
import platform
import subprocess
import sys

import pytest

from owl_cl import utils


def _write(folder: str, text: str) -> None:
  with open(os.path.join(folder, "a.txt"), "w") as f:
    f.write(text)


def _read(folder: str) -> str:
  with open(os.path.join(folder, "a.txt")) as f:
    return f.read()


def test_complete_folder_appears_and_no_temporary_is_left(tmp_path):
  path = tmp_path / "out"
  with utils.atomic_directory(str(path)) as tmp:
    assert os.path.dirname(tmp) == str(tmp_path) and os.listdir(tmp) == []
    _write(tmp, "new")
    assert not path.exists()  # invisible until the block ends
  assert _read(str(path)) == "new"
  assert os.listdir(tmp_path) == ["out"]


def test_failing_block_leaves_nothing(tmp_path):
  path = tmp_path / "out"
  with pytest.raises(RuntimeError, match="boom"):
    with utils.atomic_directory(str(path)) as tmp:
      _write(tmp, "half")
      raise RuntimeError("boom")
  assert os.listdir(tmp_path) == []


def test_existing_folder_is_refused_before_any_work(tmp_path):
  path = tmp_path / "out"
  path.mkdir()
  _write(str(path), "old")
  entered = []
  with pytest.raises(FileExistsError, match="out"):
    with utils.atomic_directory(str(path)):
      entered.append(True)
  assert not entered and _read(str(path)) == "old"
  assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("policy,expected", [("replace", "new"), ("keep", "old")])
def test_existing_folder_replaced_or_kept(tmp_path, policy, expected):
  path = tmp_path / "out"
  path.mkdir()
  _write(str(path), "old")
  with utils.atomic_directory(str(path), if_exists=policy) as tmp:
    _write(tmp, "new")
  assert _read(str(path)) == expected
  assert os.listdir(tmp_path) == ["out"]


def test_failing_replacement_keeps_the_old_folder(tmp_path):
  path = tmp_path / "out"
  path.mkdir()
  _write(str(path), "old")
  with pytest.raises(RuntimeError):
    with utils.atomic_directory(str(path), if_exists="replace") as tmp:
      _write(tmp, "new")
      raise RuntimeError("killed mid-write")
  assert _read(str(path)) == "old"
  assert os.listdir(tmp_path) == ["out"]


def test_unknown_policy_is_refused(tmp_path):
  with pytest.raises(ValueError, match="overwrite"):
    with utils.atomic_directory(str(tmp_path / "out"), if_exists="overwrite"):
      pass


def test_killed_writer_leaves_only_a_stale_temporary(tmp_path):
  """A process killed inside the block leaves no `out`, and its temporary is recognised."""
  code = (
    "import os, sys\n"
    "from owl_cl import utils\n"
    "with utils.atomic_directory(sys.argv[1]) as tmp:\n"
    "  open(os.path.join(tmp, 'a.txt'), 'w').write('half')\n"
    "  os._exit(9)\n"  # no cleanup runs, as with SIGKILL
  )
  path = tmp_path / "out"
  result = subprocess.run([sys.executable, "-c", code, str(path)], check=False)
  assert result.returncode == 9
  assert not path.exists()
  (leftover,) = os.listdir(tmp_path)
  removed = utils.remove_stale_temporaries(str(tmp_path), min_age_seconds=0.0)
  assert removed == [str(tmp_path / leftover)] and os.listdir(tmp_path) == []


def test_cpu_model_is_the_model_name_of_proc_cpuinfo():
  names = []
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
  assert utils.cpu_model() == (names[0] if names else platform.processor() or "unknown")

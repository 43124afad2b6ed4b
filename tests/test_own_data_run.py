"""A run over a user-declared sequence: two COCO folders and a TFDS dataset (README example).

The data is written by the test from the built-in benchmark's images
(`owl_cl.testing.own_data`); the config is the README's worked example
(`configs/examples/own_data.py`, loaded as `--config=configs/examples/own_data.py:<dir>`
loads it) with the tiny budget of `owl_cl.testing.configs.tiny_config` on top.
"""

import importlib.util
import json
import os
import re
import shlex

import pytest

from owl_cl import experiment
from owl_cl.data import builtin
from owl_cl.testing.configs import tiny_config

pytest.importorskip("tensorflow_datasets", reason="writing the TFDS fixture needs it")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REPO = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(REPO, "README.md")


def _readme_section() -> str:
  with open(README) as f:
    text = f.read()
  start = text.index("## Your own data")
  end = text.index("\n## ", start + 1)
  return text[start:end]


def _readme_command() -> list[str]:
  """The worked example's command, as the README shows it (the line with own_data.py)."""
  lines = [
    line
    for line in _readme_section().splitlines()
    if "owl_cl.main" in line and "configs/examples/own_data.py" in line
  ]
  assert len(lines) == 1, lines
  return shlex.split(lines[0])


def _load_config(flag: str, data_dir: str):
  """`--config=<file>:<arg>` as ml_collections' config_flags loads it, `arg` -> `data_dir`."""
  path, _ = flag.removeprefix("--config=").split(":", 1)
  spec = importlib.util.spec_from_file_location("own_data_example", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(data_dir)


def test_readme_example_runs_on_a_declared_three_dataset_sequence(pretrained_cache_dir, tmp_path):
  from owl_cl.testing import own_data

  command = _readme_command()
  assert command[:3] == ["python", "-m", "owl_cl.main"]
  config_flag = next(a for a in command if a.startswith("--config="))
  assert config_flag.startswith("--config=configs/examples/own_data.py:")
  # The README shows the config file as it is.
  with open(os.path.join(REPO, "configs", "examples", "own_data.py")) as f:
    shipped = f.read()
  for block in re.findall(r"```python\n(.*?)```", _readme_section(), re.S):
    if "def get_config" in block:
      assert block.strip() in shipped, block
      break
  else:
    pytest.fail("README 'Your own data' shows no config file")

  # The data, from the images of the built-in benchmark the tiny configs use.
  tiny = tiny_config("swil", pretrained_cache_dir)
  b = tiny.data.builtin
  bench = builtin.ensure_benchmark(
    os.path.join(pretrained_cache_dir, "builtin"),
    seed=b.seed,
    num_pretrain_train=b.num_pretrain_train,
    num_pretrain_val=b.num_pretrain_val,
    num_held_out_val=b.num_held_out_val,
    num_downstream_train=b.num_downstream_train,
    num_downstream_test=b.num_downstream_test,
    downstream=tuple(b.downstream),
  )
  data_dir = str(tmp_path / "own")
  own_data.write_own_data(data_dir, bench)
  example = _load_config(config_flag, data_dir)
  # The example's datasets with the tiny budget (model, steps, images) of the other e2e tests.
  tiny.experiment_name = example.experiment_name
  tiny.data.sequence = example.data.sequence
  # Kept under a minute: the pre-training / held-out sets only at stage 0 and the end.
  tiny.eval.pretraining_sets_after_each_dataset = False
  tiny.max_eval_images = 8
  assert example.data.pretrain is None and example.data.held_out is None
  workdir = str(tmp_path / "run")
  results = experiment.run(tiny, workdir)

  assert results["status"] == "complete"
  assert results["sequence"] == ["kitchen", "warehouse", "shelf"]
  assert [s["name"] for s in results["stages"]] == ["pretrained", "kitchen", "warehouse", "shelf"]
  everything = {"pretrain_val", "held_out", "kitchen", "warehouse", "shelf"}
  for stage in results["stages"]:
    last = stage["name"] in ("pretrained", "shelf")
    assert set(stage["metrics"]) == (everything if last else {"kitchen", "warehouse", "shelf"})
    for values in stage["metrics"].values():
      assert 0.0 <= values["AP50"] <= 1.0
  on_disk = json.load(open(os.path.join(workdir, "results.json")))
  assert on_disk["sequence"] == results["sequence"]
  with open(os.path.join(workdir, "results.md")) as f:
    text = f.read()
  for name in ("kitchen", "warehouse", "shelf", "No fine-tuning"):
    assert name in text, name
  # The same dataset read from COCO json and from TFDS: warehouse and shelf are both the
  # built-in 'digits', so every stage scores them the same.
  for stage in results["stages"]:
    for key in ("AP", "AP50"):
      want = stage["metrics"]["warehouse"][key]
      assert stage["metrics"]["shelf"][key] == pytest.approx(want, abs=1e-6, nan_ok=True)

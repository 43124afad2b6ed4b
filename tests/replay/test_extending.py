"""docs/extending.md, "A retrieval algorithm": two files, its step and its config, run end to end.

The step module below is written to a temporary folder exactly as a user would write it: a
class step from the existing protocol and its registration (`registry.register`); the config
file imports it and names the algorithm. Nothing else is edited: validation, the spec's option
list and `setup.make_algorithm` read the registry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import textwrap

import numpy as np
import pytest

from owl_cl import experiment
from owl_cl import validation
from owl_cl.replay import setup as replay_setup
from owl_cl.replay.retrieval import compose
from owl_cl.replay.retrieval import registry
from owl_cl.replay.retrieval import steps
from owl_cl.testing.configs import TINY_ARG
from owl_cl.testing.configs import tiny_budget

# File 1: the step (a class drawn uniformly among the classes that still hold an unreplayed
# image) and its registration, composed with an existing sample step.
STEP_MODULE = '''
import jax
import jax.numpy as jnp

from owl_cl.replay.retrieval import registry
from owl_cl.replay.retrieval.compose import Composition
from owl_cl.replay.retrieval.steps import uniform_in_class_step


def uniform_class_step(key, rstate, buffer, features, class_eligible, active):
  """A class per active slot, uniform over the eligible classes (-1 when none is)."""
  del buffer, features
  weights = class_eligible.astype(jnp.float32)
  classes = jax.random.choice(
    key, class_eligible.shape[0], (active.shape[0],), p=weights / jnp.maximum(weights.sum(), 1)
  )
  classes = jnp.where(active & class_eligible.any(), classes, -1).astype(jnp.int32)
  return classes, rstate, {}


registry.register("uniform_class", Composition(uniform_class_step, uniform_in_class_step))
'''

# File 2: its config.
CONFIG_MODULE = """
import uniform_class_step  # registers the algorithm

from owl_cl.configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("uniform_class", "uniform_class", arg)
"""


@pytest.fixture
def scratch_registry(monkeypatch, tmp_path):
  """A copy of the registry for the test, and the temporary folder on sys.path; the step
  module is forgotten afterwards, so no other test sees the throwaway algorithm."""
  monkeypatch.setattr(registry, "ALGORITHMS", dict(registry.ALGORITHMS))
  monkeypatch.syspath_prepend(str(tmp_path))
  yield tmp_path
  sys.modules.pop("uniform_class_step", None)


def _load(path: str):
  spec = importlib.util.spec_from_file_location("uniform_class_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_a_retrieval_algorithm_in_two_files_runs_end_to_end(scratch_registry, pretrained_cache_dir):
  folder = scratch_registry
  (folder / "uniform_class_step.py").write_text(textwrap.dedent(STEP_MODULE))
  (folder / "uniform_class.py").write_text(textwrap.dedent(CONFIG_MODULE))
  config = tiny_budget(_load(str(folder / "uniform_class.py")).get_config(TINY_ARG))
  config.cache_dir, config.compilation_cache_dir = pretrained_cache_dir, ""
  config.data.builtin.downstream = ("thermal",)
  config.max_train_steps_per_dataset = 1
  config.max_eval_images = 8
  assert validation.range_problems(config) == []  # a valid replay.algorithm now
  assert replay_setup.make_algorithm(config).name == "uniform_class"
  workdir = str(folder / "run")
  results = experiment.run(config, workdir)
  assert results["status"] == "complete" and results["retrieval"] == "uniform_class"
  train = results["stages"][1]["train"]
  assert train["steps"] == 1 and train["replayed_images"] == config.train.batch_size
  # The retrieval's records are written for it too (its step records nothing of its own).
  records = np.load(os.path.join(workdir, "records", "thermal.npz"))
  assert int(records["calls"]) == 1
  with open(os.path.join(workdir, "results.json")) as f:
    assert json.load(f)["config"]["replay"]["algorithm"] == "uniform_class"


def test_docs_show_the_two_files_of_this_test():
  with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "extending.md")) as f:
    section = f.read().split("## A retrieval algorithm")[1].split("\n## ")[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks[:2] == [
    textwrap.dedent(STEP_MODULE).lstrip(),
    textwrap.dedent(CONFIG_MODULE).lstrip(),
  ]


def test_register_refuses_a_taken_name_and_a_hyperparameter_without_a_field(scratch_registry):
  entry = compose.Composition(steps.balanced_step, steps.uniform_in_class_step)
  with pytest.raises(ValueError, match="'swil' is already registered"):
    registry.register("swil", entry)
  with pytest.raises(ValueError, match="'none' is already registered"):
    registry.register("none", entry)

  def step(key, rstate, buffer, features, class_eligible, active, *, tau: float = 1.0):
    raise AssertionError("never called")

  with pytest.raises(ValueError, match=r"hyperparameters \['tau'\] that are no field"):
    registry.register("with_tau", compose.Composition(step, steps.uniform_in_class_step))
  assert "with_tau" not in registry.ALGORITHMS
  registry.register("balanced_uniform", entry)
  assert registry.get_algorithm("balanced_uniform", balanced_order="reshuffled").name == (
    "balanced_uniform"
  )

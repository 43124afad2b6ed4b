"""Continual fine-tuning with `uniform_balanced` retrieval; see configs/base.py for every field.

`get_config('')` runs on the built-in benchmark.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "owl_cl_configs_base", os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(arg: str = ""):
  config = base.get_config(arg)
  config.experiment_name = "uniform_balanced"
  config.replay.algorithm = "uniform_balanced"
  return config

"""Continual fine-tuning with `sw_grasp` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("sw_grasp", "sw_grasp", arg)

"""Continual fine-tuning with `a_sw_grasp` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("a_sw_grasp", "a_sw_grasp", arg)

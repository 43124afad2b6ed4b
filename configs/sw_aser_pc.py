"""Continual fine-tuning with `sw_aser_pc` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.
"""

from configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("sw_aser_pc", "sw_aser_pc", arg)
  c.replay.aser.num_candidates = 352  # N_c, paper suppl. Table 7
  return c

"""Continual fine-tuning with `none` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/no_replay.py:paper`) runs the paper's protocol on real data (README).
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("no_replay", "none", arg)

"""Continual fine-tuning with `uniform_balanced` retrieval (paper Table 2).

Every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/uniform_balanced.py:paper`) runs the paper's protocol on real data (README).
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("uniform_balanced", "uniform_balanced", arg)

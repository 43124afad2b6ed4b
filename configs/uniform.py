"""Continual fine-tuning with `uniform` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/uniform.py:paper`) runs the paper's protocol on real data (README).
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("uniform", "uniform", arg)

"""Continual fine-tuning with `sw_grasp` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/sw_grasp.py` (paper's protocol:
`--config=configs/sw_grasp.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 26.0 % on the pre-training validation set (O365 stand-in), 15.4 % on the
held-out classes (LVIS-rare stand-in), 16.2 % mean over the downstream sets (ODinW stand-in);
98% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("sw_grasp", "sw_grasp", arg)

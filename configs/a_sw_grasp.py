"""Continual fine-tuning with `a_sw_grasp` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/a_sw_grasp.py` (paper's protocol:
`--config=configs/a_sw_grasp.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 25.7 % on the pre-training validation set (O365 stand-in), 15.3 % on the
held-out classes (LVIS-rare stand-in), 15.0 % mean over the downstream sets (ODinW stand-in);
97% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("a_sw_grasp", "a_sw_grasp", arg)

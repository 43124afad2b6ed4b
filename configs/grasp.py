"""Continual fine-tuning with `grasp` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/grasp.py` (paper's protocol:
`--config=configs/grasp.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 25.9 % on the pre-training validation set (O365 stand-in), 15.8 % on the
held-out classes (LVIS-rare stand-in), 15.9 % mean over the downstream sets (ODinW stand-in);
98% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("grasp", "grasp", arg)

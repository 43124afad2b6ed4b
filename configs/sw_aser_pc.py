"""Continual fine-tuning with `sw_aser_pc` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/sw_aser_pc.py` (paper's protocol:
`--config=configs/sw_aser_pc.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 25.7 % on the pre-training validation set (O365 stand-in), 15.5 % on the
held-out classes (LVIS-rare stand-in), 15.6 % mean over the downstream sets (ODinW stand-in);
97% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  # N_c = 352 candidates per call (paper suppl. Table 7) is the algorithm's own default.
  return base.algorithm_config("sw_aser_pc", "sw_aser_pc", arg)

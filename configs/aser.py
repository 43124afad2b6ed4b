"""Continual fine-tuning with `aser` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/aser.py` (paper's protocol:
`--config=configs/aser.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 25.8 % on the pre-training validation set (O365 stand-in), 15.5 % on the
held-out classes (LVIS-rare stand-in), 15.2 % mean over the downstream sets (ODinW stand-in);
98% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  # N_c = 168 candidates per call (paper suppl. Table 7) is the algorithm's own default.
  return base.algorithm_config("aser", "aser", arg)

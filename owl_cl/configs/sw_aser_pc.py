"""Continual fine-tuning with `sw_aser_pc` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/sw_aser_pc.py` (paper's protocol:
`--config=configs/sw_aser_pc.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark version 2 (the default; the committed sweep of 94b889c, seeds 0-4
on orders `random_0` and `random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95]
after the 7th dataset 18.9 ± 0.5 on the pre-training set, 20.3 ± 0.5 on the held-out classes, 7.2 ±
1.0 downstream mean; 89.7 ± 2.4% of the pre-trained model's pre-training set AP50 kept.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  # N_c = 352 candidates per call (paper suppl. Table 7) is the algorithm's own default.
  return base.algorithm_config("sw_aser_pc", "sw_aser_pc", arg)

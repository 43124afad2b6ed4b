"""Continual fine-tuning with `aser` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/aser.py` (paper's protocol:
`--config=configs/aser.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark version 2 (the default; the committed sweep of 94b889c, seeds 0-4
on orders `random_0` and `random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95]
after the 7th dataset 18.5 ± 0.7 on the pre-training set, 20.1 ± 0.9 on the held-out classes, 6.8 ±
1.2 downstream mean; 88.2 ± 3.0% of the pre-trained model's pre-training set AP50 kept.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  # N_c = 168 candidates per call (paper suppl. Table 7) is the algorithm's own default.
  return base.algorithm_config("aser", "aser", arg)

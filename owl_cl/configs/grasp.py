"""Continual fine-tuning with `grasp` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark.

Run: `python -m owl_cl.main --config=configs/grasp.py` (paper's protocol:
`--config=configs/grasp.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark version 2 (the default; the committed sweep of 94b889c, seeds 0-4
on orders `random_0` and `random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95]
after the 7th dataset 19.1 ± 0.4 on the pre-training set, 20.4 ± 0.7 on the held-out classes, 6.8 ±
0.9 downstream mean; 91.5 ± 1.6% of the pre-trained model's pre-training set AP50 kept.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("grasp", "grasp", arg)

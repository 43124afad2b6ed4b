"""Continual fine-tuning with `uniform_balanced` retrieval (paper Table 2).

Every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/uniform_balanced.py:paper`) runs the paper's protocol on real data
(docs/paper_protocol.md).

Run: `python -m owl_cl.main --config=configs/uniform_balanced.py` (paper's protocol:
`--config=configs/uniform_balanced.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark version 2 (the default; the committed sweep of 94b889c, seeds 0-4
on orders `random_0` and `random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95]
after the 7th dataset 19.3 ± 0.6 on the pre-training set, 20.3 ± 0.6 on the held-out classes, 6.7 ±
0.9 downstream mean; 91.1 ± 2.4% of the pre-trained model's pre-training set AP50 kept.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("uniform_balanced", "uniform_balanced", arg)

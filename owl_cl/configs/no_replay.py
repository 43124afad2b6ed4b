"""Continual fine-tuning with `none` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/no_replay.py:paper`) runs the paper's protocol on real data
(docs/paper_protocol.md).

Run: `python -m owl_cl.main --config=configs/no_replay.py` (paper's protocol:
`--config=configs/no_replay.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark version 2 (the default; the committed sweep of 94b889c, seeds 0-4
on orders `random_0` and `random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95]
after the 7th dataset 0.4 ± 0.3 on the pre-training set, 3.8 ± 1.4 on the held-out classes, 5.8 ±
1.1 downstream mean; 3.2 ± 1.8% of the pre-trained model's pre-training set AP50 kept.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("no_replay", "none", arg)

"""Continual fine-tuning with `uniform_balanced` retrieval (paper Table 2).

Every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/uniform_balanced.py:paper`) runs the paper's protocol on real data
(docs/paper_protocol.md).

Run: `python -m owl_cl.main --config=configs/uniform_balanced.py` (paper's protocol:
`--config=configs/uniform_balanced.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 26.0 % on the pre-training validation set (O365 stand-in), 15.6 % on the
held-out classes (LVIS-rare stand-in), 16.3 % mean over the downstream sets (ODinW stand-in);
96% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("uniform_balanced", "uniform_balanced", arg)

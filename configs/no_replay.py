"""Continual fine-tuning with `none` retrieval (paper Table 2); every field: configs/base.py.

`get_config('')` runs on the built-in benchmark; `get_config('paper')`
(`--config=configs/no_replay.py:paper`) runs the paper's protocol on real data
(docs/paper_protocol.md).

Run: `python -m owl_cl.main --config=configs/no_replay.py` (paper's protocol:
`--config=configs/no_replay.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on the built-in benchmark (defaults, one seed; README "Results"): mAP@[.5:.95] after
the 5th dataset 0.8 % on the pre-training validation set (O365 stand-in), 1.3 % on the
held-out classes (LVIS-rare stand-in), 9.7 % mean over the downstream sets (ODinW stand-in);
4% of the pre-trained model's pre-training validation AP50 kept.
"""

from configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("no_replay", "none", arg)

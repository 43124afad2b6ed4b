"""Continual fine-tuning of the heads alone, no replay (frozen parts; docs/baselines.md).

The class and box heads train on each downstream dataset; the image and text towers (and the
LayerNorm after the image tower) stay at their pre-trained values, with no optimizer state
(`train.frozen = ('heads_only',)`, owl_cl.train.optim.frozen_labels). Measures how much of
the forgetting of sequential fine-tuning (`no_replay.py`) the towers carry, and how much
plasticity the heads alone have. Freezing composes with every retrieval algorithm:
`--config=configs/swil.py --config.train.frozen="('text_tower',)"`.

Run: `python -m owl_cl.main --config=configs/heads_only.py` (paper's protocol:
`--config=configs/heads_only.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on built-in version 2 (`:builtin2`; the committed sweep, seeds 0-4 on orders `random_0` and
`random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95] after the 7th dataset 2.8
± 1.5 on the pre-training set, 2.3 ± 0.3 downstream mean; min own AP50 1.0 (the heads barely learn
in 23 steps at the full model's learning rate).
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("heads_only", "none", arg)
  c.train.frozen = ("heads_only",)
  return c

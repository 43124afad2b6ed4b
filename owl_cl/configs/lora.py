"""Continual fine-tuning of LoRA adapters alone, no replay (docs/lora.md, docs/baselines.md).

Low-rank adapters (Hu et al., ICLR 2022; rank 8, alpha 16, dropout 0.05: `base.apply_lora`)
on the attention query / key / value / out and MLP Dense layers of both towers train on each
downstream dataset, one set of adapters carried through the sequence; the pre-trained model
stays frozen (no optimizer state) and evaluation merges the adapters into it. Measures how
much of sequential fine-tuning's (`no_replay.py`) forgetting a low-rank update avoids, and
at what cost in plasticity. LoRA composes with replay and every retrieval algorithm through
the ':lora' config argument: `--config=configs/swil.py:lora` is replay + SWIL + LoRA.

Run: `python -m owl_cl.main --config=configs/lora.py` (paper's protocol:
`--config=configs/lora.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on built-in version 2 (`:builtin2`; the committed sweep, seeds 0-4 on orders `random_0` and
`random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95] after the 7th dataset 7.3
± 1.1 on the pre-training set, 5.0 ± 0.4 downstream mean; min own AP50 1.4 (the adapters barely
learn in 23 steps at the full model's learning rate, 3e-4).
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("lora", "none", arg)
  return base.apply_lora(c)

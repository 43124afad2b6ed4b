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
Yields on the built-in benchmark: not yet measured.
"""

from configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("lora", "none", arg)
  return base.apply_lora(c)

"""Continual fine-tuning with `sw_forgetting_aware` retrieval: SWIL's similarity-weighted classes,
then within each class the images whose training loss rose most (beyond the paper; after mix-cd,
arXiv 2402.08096).

Definition, cost and limitations: docs/reference.md "Forgetting-aware retrieval"; the sample
step is `configs/forgetting_aware.py`'s (same `replay.forgetting_*` hyperparameters), the class
step SWIL's (`replay.swil_weight`).

Run: `python -m owl_cl.main --config=configs/sw_forgetting_aware.py:builtin2` (paper's protocol:
`--config=configs/sw_forgetting_aware.py:paper --config.data.root=...
--config.init_checkpoint=...`).
Not yet in a committed sweep: no yields to quote.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("sw_forgetting_aware", "sw_forgetting_aware", arg)

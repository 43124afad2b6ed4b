"""Continual fine-tuning with `forgetting_aware` retrieval: balanced classes, then within each
class the images whose training loss rose most (beyond the paper; after mix-cd, arXiv 2402.08096).

Definition, cost and limitations: docs/reference.md "Forgetting-aware retrieval"
(`owl_cl.replay.retrieval.forgetting`). Within the slot's class, image i is drawn with
p_i = (1 - eps) softmax(rise_i / T) + eps / M, rise_i its latest replay loss minus its first
(`replay.forgetting_temperature` T = 1.0 loss unit, `replay.forgetting_exploration` eps = 0.1);
images not yet replayed score the mean observed rise. The losses are the train step's own per-
replay losses (no extra forward pass). `configs/sw_forgetting_aware.py` takes SWIL's classes
instead.

Run: `python -m owl_cl.main --config=configs/forgetting_aware.py:builtin2` (paper's protocol:
`--config=configs/forgetting_aware.py:paper --config.data.root=...
--config.init_checkpoint=...`).
Not yet in a committed sweep: no yields to quote.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  return base.algorithm_config("forgetting_aware", "forgetting_aware", arg)

"""Learning without Forgetting: distillation to the pre-trained model, no replay.

Definition and sources: docs/baselines.md "LwF".

No stored data: on each batch of new images the frozen pre-trained model (the teacher, passed
to the train step) scores every (token, query) slot and the trained model is pulled towards
its tempered sigmoids (`train.lwf.weight` 1, temperature 2 as Li & Hoiem 2017; binary KL, since
OWL-ViT's classes are independent sigmoids). Box distillation on the teacher's confident
tokens (Feng et al. CVPR'22, ERD) is an option: `--config.train.lwf.box_weight=1.0`.
Measures what distillation without stored images keeps of the pre-trained model, between
sequential fine-tuning (`no_replay.py`) and replay (`uniform.py`, the retrieval algorithms).
Composes with replay: `--config=configs/swil.py --config.train.lwf.weight=1.0`.

Run: `python -m owl_cl.main --config=configs/lwf.py` (paper's protocol:
`--config=configs/lwf.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on built-in version 2 (`:builtin2`; the committed sweep, seeds 0-4 on orders `random_0` and
`random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95] after the 7th dataset 0.6
± 0.2 on the pre-training set (`no_replay.py`: 0.4), 6.5 ± 1.4 downstream mean.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("lwf", "none", arg)
  c.train.lwf.weight = 1.0
  return c

"""WiSE-FT: sequential fine-tuning whose model is blended with the pre-trained one, no replay.

Definition and sources: docs/baselines.md "WiSE-FT".

After every downstream dataset (`train.wise_ft.when = 'each'`) the fine-tuned parameters are
replaced by (1 - alpha) x pre-trained + alpha x fine-tuned (Wortsman et al., CVPR 2022, eq. 1;
`owl_cl.train.wise_ft`): that blend is evaluated, checkpointed and trained on by the next
dataset. alpha = 0.5 (`train.wise_ft.alpha`), the fixed coefficient the paper reports beside the
per-distribution optimum. `--config.train.wise_ft.when=end` blends only after the last dataset.
Measures how much of sequential fine-tuning's (`no_replay.py`) forgetting moving back toward the
pre-trained weights undoes, and what it costs in plasticity; `--config.train.wise_ft.alpha=...`
traces the trade-off. Composes with replay: `--config=configs/swil.py
--config.train.wise_ft.alpha=0.5 --config.experiment_name='swil+wise_ft(0.5)'` (a run of its
own name, so a report keeps it apart from `swil`; the second sweep's name of that row), and
with LoRA (`:lora`: the adapters' B factors are scaled by alpha, which is the blend of the
merged weights).

Run: `python -m owl_cl.main --config=configs/wise_ft.py` (paper's protocol:
`--config=configs/wise_ft.py:paper --config.data.root=... --config.init_checkpoint=...`).
Not yet in a committed sweep: no yields to quote.
"""

from owl_cl.configs import base

# Wortsman et al. 2022's fixed mixing coefficient (their other choice tunes it per target).
ALPHA = 0.5


def get_config(arg: str = ""):
  c = base.algorithm_config("wise_ft", "none", arg)
  c.train.wise_ft.alpha = ALPHA
  c.train.wise_ft.when = "each"
  return c

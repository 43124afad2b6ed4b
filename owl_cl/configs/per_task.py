"""One model per task ("independent"), the plasticity ceiling: each dataset alone, no replay.

Definition and sources: docs/baselines.md "Joint and per-task".

`train.schedule = 'per_task'`: stage i fine-tunes the pre-trained model on dataset i alone
(its usual steps and settings, `train.per_dataset` included) and evaluates that model on its
own dataset and on the pre-training and held-out sets; nothing is carried between datasets.
Its own-task AP is the most each dataset can gain from fine-tuning: the ceiling of a
sequential run's own-task AP right after each dataset (results.md "Own-task AP": mean and
min; the report's "own-task AP" rows), and its pre-training / held-out columns are the mean
over the task models (what fine-tuning on one dataset alone costs). Replay composes
(`--config.replay.algorithm=uniform`: each task's model with replay from the pre-trained
buffer).

Run: `python -m owl_cl.main --config=configs/per_task.py` (paper's protocol:
`--config=configs/per_task.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on built-in version 2 (`:builtin2`; the committed sweep, seeds 0-4 on orders `random_0` and
`random_1`, n = 10, mean ± 95% half-width, README "Results"): own-task AP50 min 28.0 ± 2.2 (the
sequences: 8.2-11.7), downstream mean 17.5 ± 0.3 (each dataset by its own model), pre-training set
3.2 ± 0.1 (the mean over the task models).
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("per_task", "none", arg)
  c.train.schedule = "per_task"
  return c

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
Yields on the built-in benchmark: not yet measured (expected: own-task AP at or above
`no_replay.py`'s right after each dataset, which starts all but the first from a model
trained on the others).
"""

from configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("per_task", "none", arg)
  c.train.schedule = "per_task"
  return c

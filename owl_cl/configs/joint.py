"""Joint training, the upper bound: every downstream dataset at once, with uniform replay.

Definition and sources: docs/baselines.md "Joint and per-task".

`train.schedule = 'joint'`: one training stage over the union of the downstream datasets:
exactly the examples the sequence trains on (each image as often, with the same
augmentations), shuffled together (`owl_cl.data.mixture.joint_plan`), for the same total
steps as the sequence; then evaluated like the sequence's last stage (every eval set). Replay
as configured: here `uniform` from the same buffer, so that `joint` differs from `uniform.py`
only in the order of the new data (the continual-learning literature's "joint" / "offline"
upper bound of the same method); without replay: `--config.replay.algorithm=none`. The
optimiser settings are `train.*` (no `train.per_dataset` entry applies). Measures how much of
the gap between the pre-trained model and the best a replay algorithm could reach is due to
learning the datasets one after another.

Run: `python -m owl_cl.main --config=configs/joint.py` (paper's protocol:
`--config=configs/joint.py:paper --config.data.root=... --config.init_checkpoint=...`).
Yields on built-in version 2 (`:builtin2`; the committed sweep, seeds 0-4 on orders `random_0` and
`random_1`, n = 10, mean ± 95% half-width, README "Results"): mAP@[.5:.95] 21.0 ± 0.1 on the
pre-training set and 11.9 ± 0.2 downstream mean, above every sequential algorithm (`uniform`: 18.6,
7.0), as expected of the upper bound.
"""

from owl_cl.configs import base


def get_config(arg: str = ""):
  c = base.algorithm_config("joint", "uniform", arg)
  c.train.schedule = "joint"
  return c

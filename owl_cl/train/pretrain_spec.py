"""The `pretrain` config section, written once (`config_spec`): pre-training on the built-in
benchmark's pre-training set, used only when no `init_checkpoint` is given.

`trainer.pretrain` reads it; every field enters the pre-trained model's cache key
(`pretrained.cache_entry`).
"""

from __future__ import annotations

import dataclasses

from owl_cl import config_spec
from owl_cl.config_fields import FRACTION
from owl_cl.config_fields import NON_NEGATIVE
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import STEPS
from owl_cl.config_fields import WARMUP_STEPS
from owl_cl.config_fields import integer


@dataclasses.dataclass(frozen=True)
class PretrainSpec:
  """`config.pretrain`: the optimiser and budget of pre-training from scratch."""

  batch_size: int = config_spec.field(32, integer(1), "Images per pre-training step.")
  # 1200: on 2 idle CPU cores (version 1) ~0.37 s/step; validation AP50 0.66 at step 800,
  # 0.70 at 1200 of a 1500-step run (0.68 and 0.71 in the 1,200-step run of caf8374), so
  # pre-training stays under 10 minutes.
  num_steps: int = config_spec.field(
    1200, STEPS, "Pre-training steps; 1200 keep it under 10 minutes on 2 CPU cores."
  )
  learning_rate: float = config_spec.field(1e-3, POSITIVE, "Peak learning rate.")
  warmup_steps: int = config_spec.field(100, WARMUP_STEPS, "Linear warmup steps.")
  text_lr_multiplier: float = config_spec.field(
    1.0, NON_NEGATIVE, "The text tower's learning rate over the peak: from scratch, 1."
  )
  layerwise_decay: float = config_spec.field(
    1.0, FRACTION, "Layer-wise learning-rate decay per block (1: none)."
  )
  weight_decay: float = config_spec.field(0.0, NON_NEGATIVE, "AdamW's weight decay.")
  max_unique_queries: int = config_spec.field(
    64,
    integer(0),
    "The text tower embeds each distinct query row of a batch once, up to this many "
    "distinct rows (more: every row); 0 disables it.",
  )
  eval_every_steps: int | None = config_spec.field(
    400,
    integer(0, maximum=STEPS.maximum, why=STEPS.why, optional=True),
    "Validation AP on the pre-training val split every this many steps (the curve stored "
    "with the model).",
    type_=int,
  )

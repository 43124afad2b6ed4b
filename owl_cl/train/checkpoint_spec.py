"""The `checkpoint` config section, written once (`config_spec`): how many phase checkpoints
stay and when step checkpoints are written.

`owl_cl.train.checkpointing` (`StepCheckpointer`) and `experiment` read it; no field enters a
cache key, and a resumed run may change any of them (`experiment.RESUMABLE_FIELDS`). Its own
module, light to import (no orbax, no jax), as config files import it (`configs/base.py`).
Source: docs/stored_state.md.
"""

from __future__ import annotations

import dataclasses

from owl_cl import config_fields
from owl_cl import config_spec

# Why no checkpoint field enters a cache key: a resumed run continues bit-identically.
_WHEN_NOT_WHAT = "when checkpoints are written, not what a run computes (resuming is exact)"


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  """`config.checkpoint`: how many phase checkpoints stay and when step checkpoints are
  written (`config_spec`; docs/stored_state.md)."""

  max_to_keep: int | None = config_spec.field(
    None,
    config_fields.integer(1, optional=True),
    "Phase checkpoints kept in the workdir, the newest first. None: all of them.",
    key=_WHEN_NOT_WHAT,
    type_=int,
  )
  every_steps: int | None = config_spec.field(
    None,
    config_fields.OPTIONAL_STEPS,
    "A step checkpoint (the newest 2 kept) every this many steps of pre-training and of "
    "each dataset, and at a phase's last step. None: by time only.",
    key=_WHEN_NOT_WHAT,
    type_=int,
  )
  every_minutes: float | None = config_spec.field(
    10.0,
    config_fields.real(0.0, low_open=True, optional=True),
    "A step checkpoint every this many minutes: a kill loses at most that much training. "
    "10 min: the built-in model's checkpoint blocks the loop 0.13 s (2 CPU cores, measured). "
    "None for both: only SIGTERM writes one.",
    key=_WHEN_NOT_WHAT,
    type_=float,
  )

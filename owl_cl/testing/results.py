"""Comparing results.json files of runs that must agree (resumed vs uninterrupted, two seeds).

Only fields that measure time or name the run (`VOLATILE_FIELDS`) may differ between two runs
of one config on one platform; `comparable` drops them so the rest compares with `==`.
"""

from __future__ import annotations

from typing import Any

# Wall-clock measurements and the run's identity: the only results.json fields (at any
# depth) that differ between two runs of the same computation.
VOLATILE_FIELDS = frozenset(
  {
    "seconds",
    "wall_seconds",
    "pretrain_seconds",
    "steps_per_second",
    "step_timings",
    "created_at",
    "updated_at",
    "run_id",
  }
)


def comparable(value: Any) -> Any:
  """`value` (a results.json tree) without its `VOLATILE_FIELDS` keys, at any depth."""
  if isinstance(value, dict):
    return {k: comparable(v) for k, v in value.items() if k not in VOLATILE_FIELDS}
  if isinstance(value, list):
    return [comparable(v) for v in value]
  return value

"""The config's errors, field rules and predicates: the leaf every layer may import.

`ConfigError` / `MissingInputsError`, the range rules (`integer`, `real` and their named
instances) and the predicates and mode checks that modules below `owl_cl.validation` need
(`uses_real_data`, `loss_adaptivity_mode`, `check_downstream_eval_mode`, `check_carry_mode`,
`clip_vocabulary_problem`, `check_per_dataset_fields`). It imports nothing of owl_cl, so
`validation` (the top of the config checks) and every module below it import it without a
cycle (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from collections.abc import Callable
import math
import numbers
from typing import Any

import ml_collections

# Fields a `train.per_dataset.<dataset name>` entry may set; each replaces the `train.*` field
# of the same name while training on that dataset (`trainer.dataset_train_settings`).
PER_DATASET_FIELDS = (
  "num_epochs",
  "warmup_epochs",
  "warmup_steps",
  "learning_rate",
  "text_lr_multiplier",
  "layerwise_decay",
)
DOWNSTREAM_EVAL_MODES = ("all", "seen")
CARRY_MODES = ("last", "best_validation")
# config.replay.loss_adaptivity.mode (paper eq. 5; `train.losses.loss_adaptive_total`).
LOSS_ADAPTIVITY_MODES = ("none", "paper", "released_gate")


class ConfigError(ValueError):
  """A config value the run cannot use; the message names the field and the value."""


class MissingInputsError(ConfigError):
  """Files or folders the run needs are missing; the message lists all of them and the layout."""


# ----------------------------------------------------------------------------- ranges

# A rule takes a field's value and returns what is wrong with it ('' when fine).
Rule = Callable[[Any], str]


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(minimum: int, *, optional: bool = False) -> Rule:
  """An int >= `minimum` (None allowed when `optional`)."""

  def rule(value):
    if value is None and optional:
      return ""
    if not _is_number(value) or int(value) != value:
      return "must be an integer" + (" or None" if optional else "")
    return "" if value >= minimum else f"must be >= {minimum}" + (" or None" * optional)

  return rule


def real(
  low: float = -math.inf,
  high: float = math.inf,
  *,
  low_open: bool = False,
  high_open: bool = False,
  optional: bool = False,
) -> Rule:
  """A finite number in [low, high] (an end excluded when `*_open`; None when `optional`)."""

  def rule(value):
    if value is None and optional:
      return ""
    if not _is_number(value) or not math.isfinite(value):
      return "must be a finite number" + (" or None" if optional else "")
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
      if high == math.inf:
        return f"must be {'>' if low_open else '>='} {low:g}"
      left, right = "(" if low_open else "[", ")" if high_open else "]"
      return f"must be in {left}{low:g}, {high:g}{right}"
    return ""

  return rule


POSITIVE = real(0.0, low_open=True)  # learning rates, eps, replay ratio
NON_NEGATIVE = real(0.0)  # loss weights, weight decay, multipliers
FINITE = real()  # thresholds (a NaN compares False with everything: it must not pass)
FRACTION = real(0.0, 1.0, low_open=True)  # layer-wise decay, dedup fraction
BETA = real(0.0, 1.0, high_open=True)  # Adam's b1 / b2


# ----------------------------------------------------------------------------- predicates


def uses_real_data(config: ml_collections.ConfigDict) -> bool:
  """True for the paper's protocol (a `:paper` config, or any config with data.root set)."""
  return config.data.root is not None or "odinw_datasets" in config.data


def loss_adaptivity_mode(config: ml_collections.ConfigDict) -> str:
  """config.replay.loss_adaptivity.mode, checked (paper eq. 5).

  Raises:
    ConfigError: a mode outside `LOSS_ADAPTIVITY_MODES`.
  """
  mode = config.replay.loss_adaptivity.mode
  if mode not in LOSS_ADAPTIVITY_MODES:
    raise ConfigError(
      f"config.replay.loss_adaptivity.mode={mode!r} is unknown; known: "
      f"{list(LOSS_ADAPTIVITY_MODES)}"
    )
  return mode


def check_downstream_eval_mode(config: ml_collections.ConfigDict) -> str:
  """config.eval.downstream_after_each_dataset, checked. Raises ConfigError if unknown."""
  mode = config.eval.downstream_after_each_dataset
  if mode not in DOWNSTREAM_EVAL_MODES:
    raise ConfigError(f"config.eval.downstream_after_each_dataset={mode!r}; use 'all' or 'seen'")
  return mode


def check_carry_mode(config: ml_collections.ConfigDict) -> str:
  """config.train.carry ('last' when unset), checked. Raises ConfigError if unknown."""
  carry = config.train.get("carry", "last")
  if carry not in CARRY_MODES:
    raise ConfigError(f"config.train.carry={carry!r}; use 'last' or 'best_validation'")
  return carry


def clip_vocabulary_problem(config: ml_collections.ConfigDict) -> str | None:
  """The message for a CLIP tokenizer without `model.tokenizer_vocab_path`; None when fine."""
  if config.model.tokenizer == "clip" and not config.model.get("tokenizer_vocab_path"):
    return (
      "config.model.tokenizer_vocab_path is not set (config.model.tokenizer='clip' needs the "
      "CLIP BPE vocabulary: an HF checkpoint folder with vocab.json + merges.txt, or OpenAI's "
      "bpe_simple_vocab_16e6.txt.gz)"
    )
  return None


def check_per_dataset_fields(config: ml_collections.ConfigDict, name: str) -> dict:
  """The `train.per_dataset.<name>` overrides ({} when none), fields checked.

  Raises:
    ConfigError: a field outside `PER_DATASET_FIELDS`.
  """
  overrides = dict(config.train.per_dataset.get(name, {}) or {})
  unknown = sorted(set(overrides) - set(PER_DATASET_FIELDS))
  if unknown:
    raise ConfigError(
      f"config.train.per_dataset.{name}: unknown fields {unknown}; "
      f"allowed: {list(PER_DATASET_FIELDS)}"
    )
  return overrides

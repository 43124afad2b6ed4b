"""The config's errors, field rules and predicates: the leaf every layer may import.

`ConfigError` / `MissingInputsError`, the range rules (`integer`, `real` and their named
instances) and the predicates and mode checks that modules below `owl_cl.validation` need
(`uses_real_data`, `loss_adaptivity_mode`, `check_carry_mode`,
`clip_vocabulary_problem`, `check_per_dataset_fields`). It imports nothing of owl_cl, so
`validation` (the top of the config checks) and every module below it import it without a
cycle (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
import numbers
from typing import Any

import ml_collections

# Fields a `train.per_dataset.<dataset name>` entry may set; each replaces the `train.*` field
# of the same name while training on that dataset (`phases.dataset_train_settings`).
PER_DATASET_FIELDS = (
  "num_epochs",
  "num_steps",
  "warmup_epochs",
  "warmup_steps",
  "learning_rate",
  "text_lr_multiplier",
  "layerwise_decay",
)
CARRY_MODES = ("last", "best_validation")
# config.train.schedule (docs/baselines.md): how the downstream datasets are trained.
# 'sequence': one after another (continual learning); 'joint': all at once, the upper bound;
# 'per_task': each alone from the pre-trained model, one model per task.
SCHEDULES = ("sequence", "joint", "per_task")
# config.replay.loss_adaptivity.mode (paper eq. 5; `train.losses.loss_adaptive_total`).
LOSS_ADAPTIVITY_MODES = ("none", "paper", "released_gate")


class ConfigError(ValueError):
  """A config value the run cannot use; the message names the field and the value."""


class MissingInputsError(ConfigError):
  """Files or folders the run needs are missing; the message lists all of them and the layout."""


# ----------------------------------------------------------------------------- ranges

# A rule takes a field's value and returns what is wrong with it ('' when fine).
Rule = Callable[[Any], str]


# ----------------------------------------------------------------------------- integer limits

# What consumes the integer fields bounds them (one bound per consumer, named at its rule):
# - JAX with 32-bit integers (`jax_enable_x64` off, its default) holds counts, steps and
#   shapes as int32: at most INT32_MAX. It is every integer field's bound unless a stricter
#   consumer below names its own.
# - `jax.random.PRNGKey(seed)` keeps only a seed's low 32 bits (PRNGKey(2**32) ==
#   PRNGKey(0): two seeds, one key) and raises OverflowError from 2**63, so every key a seed
#   makes must stay below PRNG_SEEDS: the model seed makes keys seed + 0..2
#   (`trainer`, `replay.setup.initial_replay_state`), the data seed seed * DATA_KEY_STRIDE +
#   index, index < DATA_KEY_STRIDE (each dataset's step key, `trainer`; the LoRA adapters',
#   `experiment.LORA_SEED_OFFSET`).
# - A step checkpoint's id is phase * PHASE_STRIDE + step (`train.checkpointing`): a step count
#   of PHASE_STRIDE or more would take the next phase's ids.
INT32_MAX = 2**31 - 1
PRNG_SEEDS = 2**32
DATA_KEY_STRIDE = 1000
MODEL_KEY_OFFSETS = 3  # keys seed, seed + 1, seed + 2
PHASE_STRIDE = 10**9


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(
  minimum: int, *, maximum: int = INT32_MAX, why: str = "JAX's int32", optional: bool = False
) -> Rule:
  """An int in [minimum, maximum] (None allowed when `optional`); `why` names the consumer
  that sets `maximum` (the message says it). The rule carries `minimum`, `maximum` and `why`
  as attributes (tests/test_bad_inputs.py walks them)."""

  def rule(value):
    if value is None and optional:
      return ""
    if not _is_number(value) or not math.isfinite(value) or int(value) != value:
      return "must be an integer" + (" or None" if optional else "")
    if value < minimum:
      return f"must be >= {minimum}" + (" or None" * optional)
    return "" if value <= maximum else f"must be <= {maximum} ({why})"

  rule.minimum, rule.maximum, rule.why = minimum, maximum, why
  return rule


def _seed(maximum: int, keys: str) -> Rule:
  return integer(
    0, maximum=maximum, optional=True, why=f"{keys} must stay below 2**32, JAX's PRNG seeds"
  )


# The seed rules, one per consumer (`seed_of`): `config.seed` stands in for every part, so it
# takes the strictest bound.
MODEL_SEED = _seed(PRNG_SEEDS - MODEL_KEY_OFFSETS, "its PRNG keys seed + 0..2")
RETRIEVAL_SEED = MODEL_SEED  # the replay state's key is seed + 2 (`initial_replay_state`)
DATA_SEED = _seed(
  PRNG_SEEDS // DATA_KEY_STRIDE - 1, f"its PRNG keys seed * {DATA_KEY_STRIDE} + dataset index"
)
SEED_RULES = {"model": MODEL_SEED, "data": DATA_SEED, "retrieval": RETRIEVAL_SEED}
SEED = integer(
  0, maximum=DATA_SEED.maximum, why=f"config.seed stands in for seeds.data: {DATA_SEED.why}"
)
# Step counts and step intervals (a step checkpoint id, phase * PHASE_STRIDE + step).
STEPS = integer(1, maximum=PHASE_STRIDE - 1, why="a step checkpoint's id, phase * 10**9 + step")
OPTIONAL_STEPS = integer(1, maximum=STEPS.maximum, why=STEPS.why, optional=True)
WARMUP_STEPS = integer(0, maximum=STEPS.maximum, why=STEPS.why)


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


# ----------------------------------------------------------------------------- seeds

# What each part of `config.seeds` controls (docs/experiments.md, "Seeds"); each unset part
# takes `config.seed`, so a config that sets only `seed` behaves as before the split.
SEED_PARTS = ("model", "data", "retrieval")


def seed_of(config: ml_collections.ConfigDict, part: str) -> int:
  """The seed of one part of a run: `config.seeds.<part>` when set, else `config.seed`.

  Args:
    config: the run's config.
    part: 'model' (pre-training: initialisation, its data order and augmentation, the buffer's
      per-image queries; keys the cached pre-trained model and buffer), 'data' (each downstream
      dataset's image order and augmentation, and its train-step key) or 'retrieval' (the
      replay state's PRNG key: every sampling step of the retrieval algorithms).

  Returns:
    int.

  Raises:
    ValueError: an unknown part.
  """
  if part not in SEED_PARTS:
    raise ValueError(f"unknown seed part {part!r}; known: {SEED_PARTS}")
  seeds = config.get("seeds")
  value = seeds.get(part) if seeds is not None else None
  return int(config.seed if value is None else value)


def choice(options: Sequence[Any] | Callable[[], Sequence[Any]], *, optional: bool = False) -> Rule:
  """One of `options` (or a function returning them, called when checking: a registry that
  can grow, e.g. the tokenizers); None too when `optional`. `validation.option_problems`
  lists the fields with such a rule (`is_option`)."""

  def rule(value):
    if value is None and optional:
      return ""
    known = list(options() if callable(options) else options)
    # Strict types: True == 1 and 1.0 == 1 must not pass for a name.
    if any(type(value) is type(k) and value == k for k in known):
      return ""
    return f"is unknown; known: {known}" + (" or None" if optional else "")

  rule.is_option, rule.options = True, options
  return rule


def boolean(value: Any) -> str:
  """Rule: True or False (not 0 / 1 or 'false': a string 'false' would be truthy)."""
  return "" if isinstance(value, bool) else "must be True or False"


def text(*, optional: bool = False, empty: bool = False) -> Rule:
  """A non-empty string (None too when `optional`, '' too when `empty`): names, paths."""

  def rule(value):
    if (value is None and optional) or (value == "" and empty):
      return ""
    if not isinstance(value, str) or not value.strip():
      return "must be a non-empty string" + (" or None" if optional else "")
    return ""

  return rule


def interval(low: float, high: float = math.inf) -> Rule:
  """A pair (a, b) of finite numbers with low < a <= b <= high: a sampling range."""

  def rule(value):
    if (
      not isinstance(value, (list, tuple))
      or len(value) != 2
      or not all(_is_number(v) and math.isfinite(v) for v in value)
    ):
      return "must be a pair (low, high) of finite numbers"
    a, b = value
    if not low < a <= b <= high:
      top = "" if high == math.inf else f" <= {high:g}"
      return f"must satisfy {low:g} < low <= high{top} (a reversed or empty range?)"
    return ""

  return rule


def integers(minimum: int, *, optional: bool = False) -> Rule:
  """A non-empty list / tuple of ints >= `minimum` (None too when `optional`)."""

  def rule(value):
    if value is None and optional:
      return ""
    if not isinstance(value, (list, tuple)) or not value:
      return "must be a non-empty tuple of integers" + (" or None" if optional else "")
    bad = [v for v in value if integer(minimum)(v)]
    return f"must hold integers >= {minimum}, not {bad}" if bad else ""

  return rule


def probabilities(value: Any) -> str:
  """Rule: a non-empty list / tuple of numbers >= 0 that sum to 1 (within 1e-6)."""
  if not isinstance(value, (list, tuple)) or not value:
    return "must be a non-empty tuple of probabilities"
  if not all(_is_number(v) and math.isfinite(v) and v >= 0 for v in value):
    return "must hold finite numbers >= 0"
  # 1e-6: decimal literals such as (0.4, 0.3, 0.3) sum to 1 within ~1e-16.
  return "" if abs(sum(value) - 1.0) <= 1e-6 else f"must sum to 1 (sums to {sum(value):g})"


def names(known: Callable[[], Sequence[str]] | None = None, *, what: str = "name") -> Rule:
  """A non-empty list / tuple of distinct strings, each in `known()` when given."""

  def rule(value):
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      return f"must be a tuple of {what}s, e.g. ('a', 'b')"
    if not value:
      return f"is empty; name at least one {what}"
    if not all(isinstance(v, str) for v in value):
      return f"must hold {what}s (strings)"
    twice = sorted({v for v in value if value.count(v) > 1})
    if twice:
      return f"names {twice} more than once"
    if known is not None:
      unknown = [v for v in value if v not in known()]
      if unknown:
        # An unquoted comma list on the command line arrives as one name.
        hint = (
          '; on the command line a tuple is one quoted value, \'("a", "b")\', or the '
          "flag given once per name"
          if any("," in v for v in unknown)
          else ""
        )
        return f"names unknown {what}s {unknown}; known: {list(known())}{hint}"
    return ""

  return rule


def budget(value: Any) -> str:
  """`replay.budget`: None, a fraction in (0, 1] (float) or an image count in [1, INT32_MAX]
  (int: the store's image indices are JAX int32; a count over the pool is refused against the
  data, `validation.split_size_problems`)."""
  if value is None or (isinstance(value, float) and 0.0 < value <= 1.0):
    return ""
  if isinstance(value, int) and not isinstance(value, bool):
    problem = _BUDGET_COUNT(value)
    return f"{problem} (an image count), or None, or a fraction in (0, 1]" if value < 1 else problem
  return "must be None, a fraction in (0, 1] (e.g. 0.01) or an image count >= 1 (e.g. 500)"


# The count form of `budget`: its bounds are the rule's (tests/test_bad_inputs.py walks them).
_BUDGET_COUNT = integer(1, why="JAX's int32 image indices of the replay store")
budget.minimum, budget.maximum, budget.why = 1, _BUDGET_COUNT.maximum, _BUDGET_COUNT.why


def step_table(value: Any) -> str:
  """Rule: None or a non-empty tuple of (dataset name, steps >= 1) pairs, each name once (a
  table by name, since dataset names such as 'Raccoon_Raccoon.v2-raw.coco' hold dots, which a
  ConfigDict key cannot)."""
  if value is None:
    return ""
  shape = "must be None or a tuple of (dataset name, steps) pairs, e.g. (('pothole', 250),)"
  if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
    return shape
  for pair in value:
    if isinstance(pair, str) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
      return f"{shape}; got the item {pair!r}"
    if not isinstance(pair[0], str) or not pair[0] or STEPS(pair[1]):
      return f"{shape} with steps >= 1 and <= {STEPS.maximum}; got the item {tuple(pair)!r}"
  names_ = [p[0] for p in value]
  twice = sorted({n for n in names_ if names_.count(n) > 1})
  return f"names {twice} more than once" if twice else ""


def mapping(value: Any) -> str:
  """Rule: a dict (ConfigDict) of fields, checked further by the code that reads it."""
  return "" if hasattr(value, "keys") else "must be a dict of fields"


def declared(kind: type) -> Rule:
  """None or a `kind` (list: `data.sequence`; dict: one dataset entry); the entries
  themselves are checked by `check_datasets`."""

  def rule(value):
    if value is None:
      return ""
    ok = isinstance(value, (list, tuple)) if kind is list else hasattr(value, "keys")
    what = "a list of dataset entries / suites" if kind is list else "one dataset entry (a dict)"
    return "" if ok else f"must be {what} or None"

  return rule


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


def schedule_of(config: ml_collections.ConfigDict) -> str:
  """config.train.schedule ('sequence' when unset: configs made before the field existed)."""
  return config.train.get("schedule", "sequence")


def check_per_dataset_fields(per_dataset: Any, name: str) -> dict:
  """The overrides of dataset `name` in `per_dataset` (`train.per_dataset`: a mapping
  {dataset name: {field: value}}; {} when none), fields checked.

  Raises:
    ConfigError: a field outside `PER_DATASET_FIELDS`.
  """
  overrides = dict(per_dataset.get(name, {}) or {})
  unknown = sorted(set(overrides) - set(PER_DATASET_FIELDS))
  if unknown:
    raise ConfigError(
      f"config.train.per_dataset.{name}: unknown fields {unknown}; "
      f"allowed: {list(PER_DATASET_FIELDS)}"
    )
  return overrides

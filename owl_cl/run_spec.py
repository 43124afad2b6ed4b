"""The config's top-level fields, written once (`config_spec`): a run's name, seeds, order,
cache folders, starting checkpoint and debugging budgets.

`RunSpec` is the schema of the fields outside every section (`SeedsSpec` the `seeds`
section's): `owl_cl/configs/base.py` takes its defaults, `config_rules.FIELD_RULES` its rules
(under the paths '' + field), and `experiment` converts the config's top-level fields to it
once (`run_settings`). Its module sits above `data` (the stored task orders) and below
`configs` (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from owl_cl import config_spec
from owl_cl.config_fields import OPTIONAL_STEPS
from owl_cl.config_fields import SEED
from owl_cl.config_fields import SEED_RULES
from owl_cl.config_fields import integer
from owl_cl.config_fields import seed_of
from owl_cl.config_fields import text
from owl_cl.data import orders

# Why these fields leave every cache key: they choose the downstream sequence's order, its
# data and the retrieval's draws, i.e. continual fine-tuning, which no cache entry holds.
_FINE_TUNING_ONLY = "continual fine-tuning only, which no cache entry holds"


@dataclasses.dataclass(frozen=True)
class SeedsSpec:
  """`config.seeds`: each part's own seed (docs/experiments.md, "Seeds"); None takes `seed`."""

  model: int | None = config_spec.field(
    None,
    SEED_RULES["model"],
    "Pre-training (initialisation, data order, augmentation) and the buffer's queries; keys "
    "their caches.",
    type_=int,
  )
  data: int | None = config_spec.field(
    None,
    SEED_RULES["data"],
    "Each downstream dataset's image order, augmentation and train-step keys.",
    key=_FINE_TUNING_ONLY,
    type_=int,
  )
  retrieval: int | None = config_spec.field(
    None,
    SEED_RULES["retrieval"],
    "The replay state's PRNG key: every sampling step of the retrieval algorithms.",
    key=_FINE_TUNING_ONLY,
    type_=int,
  )


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """The config's top-level fields (`config.<field>`; the sections are their own specs)."""

  experiment_name: str = config_spec.field(
    "base",
    text(),
    "The run's label in its outputs; a config file sets it.",
    key="a label of the run's outputs, not what they hold",
  )
  # Seeds of each part (`seeds`) default to `seed` (`config_fields.seed_of`).
  seed: int = config_spec.field(
    0, SEED, "The seed of every part whose `seeds.<part>` is None (`seeds`)."
  )
  seeds: SeedsSpec = config_spec.section(SeedsSpec, "Each part's own seed.")
  sequence_seed: int | None = config_spec.field(
    None,
    # NumPy's generators (`np.random.default_rng`) take any int >= 0: JAX's int32 bounds them.
    integer(0, optional=True),
    "Order of the downstream sequence: None keeps the benchmark's, an int shuffles it.",
    key=_FINE_TUNING_ONLY,
    type_=int,
  )
  task_order: str | None = config_spec.field(
    None,
    orders.task_order_problem,
    "A stored task order (`owl_cl/data/orders/<suite>.json`): its name (`random_3`), index "
    "(`2`) or `<suite>/<name>`; set, it replaces `sequence_seed`'s shuffle.",
    key=_FINE_TUNING_ONLY,
    type_=str,
  )
  cache_dir: str = config_spec.field(
    "~/.cache/owl_cl",
    text(),
    "Where cached artefacts live: the built-in benchmark, pre-trained models, buffers.",
    key="where cache entries live, not what they hold",
  )
  compilation_cache_dir: str | None = config_spec.field(
    None,
    text(optional=True, empty=True),
    "XLA's persistent compilation cache, so later runs skip recompiling. None: "
    "`<cache_dir>/xla`; `''` disables it.",
    key="where compiled programs are kept; they compute the same",
    type_=str,
  )
  init_checkpoint: str | None = config_spec.field(
    None,
    text(optional=True),
    "The model to start from: an owl_cl parameter checkpoint, an HF folder or a scenic "
    "msgpack. None: pre-train on the pre-training set and cache the model.",
    type_=str,
  )
  max_train_steps_per_dataset: int | None = config_spec.field(
    None,
    OPTIONAL_STEPS,
    "A debugging budget: at most this many steps per downstream dataset. None: no cap.",
    key=_FINE_TUNING_ONLY,
    type_=int,
  )
  max_eval_images: int | None = config_spec.field(
    None,
    integer(1, optional=True),
    "A debugging budget: at most this many images per evaluation. None: all.",
    key="how many images an evaluation scores, anew by every run",
    type_=int,
  )

  def seed_of(self, part: str) -> int:
    """The seed of one part of the run (`config_fields.seed_of`'s rule on the typed fields):
    `seeds.<part>` when set, else `seed`.

    Raises:
      ValueError: an unknown part (not 'model', 'data' or 'retrieval').
    """
    return seed_of(ml_collections.ConfigDict(dataclasses.asdict(self)), part)


def run_settings(config: ml_collections.ConfigDict) -> RunSpec:
  """The config's top-level fields as a `RunSpec`, each checked once.

  Args:
    config: the run's config (its sections are not read).

  Raises:
    ConfigError: one line per bad field (`config_spec.from_config`).
  """
  top: dict[str, Any] = {
    f.name: config[f.name] for f in dataclasses.fields(RunSpec) if f.name in config
  }
  return config_spec.from_config(RunSpec, top, "")

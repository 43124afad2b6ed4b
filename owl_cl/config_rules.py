"""The rule of every config field: its type and its range or options, as data.

`FIELD_RULES` maps each leaf of `configs/base.py` ('' and 'paper') to a `config_fields.Rule`
(a section written as a spec, `SECTION_SPECS`, gives its own: `config_spec.rules`);
`TRAIN_FIELD_RULES` the per-dataset fields shared by `train.*`; `MODEL_OVERRIDE_RULES` every
field of `model.overrides`. `validation.range_problems` applies them before any work (and
`tests/test_bad_inputs.py` fails for a config leaf without a rule). The options of the choice
fields come from the modules that define them, so a new algorithm, schedule or variant is a
valid value the moment it exists.
"""

from __future__ import annotations

from owl_cl import config_spec
from owl_cl.config_fields import PER_DATASET_FIELDS
from owl_cl.config_fields import Rule
from owl_cl.data.data_spec import DataSpec
from owl_cl.eval_spec import EvalSpec
from owl_cl.model import variants
from owl_cl.model.spec import ModelSpec
from owl_cl.replay import spec as replay_spec
from owl_cl.run_spec import RunSpec
from owl_cl.train.checkpoint_spec import CheckpointSpec
from owl_cl.train.pretrain_spec import PretrainSpec
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import TrainSpec

# The rules of the per-dataset fields (`PER_DATASET_FIELDS`), those of the `train.*` fields of
# the same name (`TrainSpec`).
_TRAIN_RULES = config_spec.rules(TrainSpec, "train")
TRAIN_FIELD_RULES: dict[str, Rule] = {
  name: _TRAIN_RULES[f"train.{name}"] for name in PER_DATASET_FIELDS
}

# Every field of configs/base.py ('' and 'paper') and what it must be: its type and its range
# or options (`tests/test_bad_inputs.py` walks every leaf of both configs and fails for a field
# without a rule). A dict-valued field (`model.overrides`, `train.per_dataset`, a declared
# dataset entry) is one leaf; its contents are checked by `model_problems`, `range_problems`
# and `check_datasets`. Fields a config lacks are skipped (e.g. the 'paper' config's
# `data.odinw_datasets` and Visual Genome settings).
FIELD_RULES: dict[str, Rule] = {
  **config_spec.rules(RunSpec, ""),
  **config_spec.rules(ModelSpec, "model"),
  # --- data (with data.augment, data.builtin and the paper's data fields)
  **config_spec.rules(DataSpec, "data"),
  # --- pre-training, continual fine-tuning, loss
  **config_spec.rules(PretrainSpec, "pretrain"),
  **config_spec.rules(TrainSpec, "train"),
  **config_spec.rules(LossSpec, "loss"),
  # --- replay: its spec (owl_cl.replay.spec)
  **config_spec.rules(replay_spec.ReplaySpec, "replay"),
  **config_spec.rules(EvalSpec, "eval"),
  **config_spec.rules(CheckpointSpec, "checkpoint"),
}

# Every field of the model (`ModelConfig`, `config.model.overrides.<field>`) and what it must
# be, from `ModelConfig`'s fields; the cross-field rules (image size a multiple of the patch
# size, widths of the heads) are in `validation.model_problems`.
MODEL_OVERRIDE_RULES: dict[str, Rule] = variants.OVERRIDE_RULES

# The config sections written as a spec (`config_spec`), by their path ('' the top-level
# fields): the cache-key test and the docs tables iterate them.
SECTION_SPECS: dict[str, type] = {
  "": RunSpec,
  "model": ModelSpec,
  "pretrain": PretrainSpec,
  "eval": EvalSpec,
  "checkpoint": CheckpointSpec,
  "train": TrainSpec,
  "loss": LossSpec,
  "replay": replay_spec.ReplaySpec,
  "data": DataSpec,
}


def fields_markdown() -> str:
  """The field tables of docs/configs.md ("Fields written as specs"): per section of
  `SECTION_SPECS`, one row per field with its default, its doc and whether it enters cache
  keys (else why not), from the specs alone (`config_spec.doc_rows`, `key_roles`).

  Returns:
    Markdown, one `### <section>` heading and table per section.
  """
  out = []
  for prefix, spec in SECTION_SPECS.items():
    roles = config_spec.key_roles(spec, prefix)
    out += [
      f"### {'`' + prefix + '`' if prefix else 'Top-level fields'}",
      "",
      "| field | default | what it does | cache keys |",
      "|---|---|---|---|",
    ]
    for path, default, doc in config_spec.doc_rows(spec, prefix):
      key = _key_cell(roles[path])
      out.append(f"| `{path}` | `{default}` | {doc.replace('|', '&#124;')} | {key} |")
    out.append("")
  return "\n".join(out)


def _key_cell(role) -> str:
  """The 'cache keys' cell of a field of `config_spec.key_roles` role."""
  if role is True:
    return "yes"
  if isinstance(role, str):
    return f"no: {role}"
  return "yes, but " + "; ".join(f"not the {cache}'s: {why}" for cache, why in role.items())

"""The `train` and `loss` config sections as specs (`owl_cl.config_spec`): each field written
once with its default, rule, doc and cache-key role.

`TrainSpec` (continual fine-tuning: optimiser, budget, schedule, carry; its `lwf` and `lora`
sections) and `LossSpec` (the detection loss, docs/reference.md §3) are read by the trainer
(`owl_cl.trainer`, `owl_cl.phases`), which converts `config.train` / `config.loss` once with
`config_spec.from_config` and passes the frozen settings on. `owl_cl/configs/base.py` builds
the sections from them (`config_spec.defaults`), `config_rules.FIELD_RULES` takes their rules
(`config_spec.rules`) and docs/configs.md their rows.

A field's `key` is True when it changes what is trained or computed (it enters the cache keys
and the step cache's key of what it feeds); otherwise it says why not.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from flax.core import FrozenDict

from owl_cl import config_spec
from owl_cl.config_fields import BETA
from owl_cl.config_fields import CARRY_MODES
from owl_cl.config_fields import FRACTION
from owl_cl.config_fields import NON_NEGATIVE
from owl_cl.config_fields import OPTIONAL_STEPS
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import SCHEDULES
from owl_cl.config_fields import STEPS
from owl_cl.config_fields import WARMUP_STEPS
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.config_fields import mapping
from owl_cl.config_fields import real
from owl_cl.config_fields import step_table
from owl_cl.train import optim
from owl_cl.train.detection import NORMALIZATIONS
from owl_cl.train.matcher import MATCHERS
from owl_cl.train.wise_ft import WiseFtSpec

field, section = config_spec.field, config_spec.section

# Fine-tuning settings enter no stored cache: the pre-trained model and the replay buffer are
# built from `pretrain`, `model`, `loss` and `data` (the in-memory step cache keys by the
# `StepSpec` they make, `owl_cl.train.step`).
_FINE_TUNING_ONLY = "fine-tuning only: no stored cache (pre-trained model, buffer) is built from it"
_fine_tuning_field = functools.partial(field, key=_FINE_TUNING_ONLY)

# The adapted layers by default: attention query / key / value / out and the MLP's two Dense
# layers of every block of both towers (Hu et al. adapt the attention projections; the MLP
# Dense layers are the other matrices of a block, as QLoRA, Dettmers et al. 2023, adapts).
# Regexes matched in full against a module's '/'-joined path (qwix `module_path`).
DEFAULT_TARGETS = (
  r"backbone/clip/(visual|text)/transformer/resblocks_\d+/attn/(query|key|value|out)",
  r"backbone/clip/(visual|text)/transformer/resblocks_\d+/mlp/(c_fc|c_proj)",
)


def targets_problem(targets, module_paths) -> str:
  """What makes `train.lora.targets` unusable ('' when fine): not a non-empty tuple of str, a
  regex that does not compile, or one that matches none of `module_paths` (the '/'-joined
  paths of the model's Dense layers; None: not checked)."""
  if not isinstance(targets, (tuple, list)) or not targets:
    return "must be a non-empty tuple of regexes"
  problems = []
  for pattern in targets:
    if not isinstance(pattern, str):
      problems.append(f"{pattern!r} is not a str")
      continue
    try:
      compiled = re.compile(pattern)
    except re.error as e:
      problems.append(f"{pattern!r} is not a valid regex ({e})")
      continue
    if module_paths is not None and not any(compiled.fullmatch(p) for p in module_paths):
      problems.append(f"{pattern!r} matches no Dense layer of the model")
  return "; ".join(problems)


@dataclasses.dataclass(frozen=True)
class LwfSpec:
  """`train.lwf`: Learning without Forgetting (docs/baselines.md; Li & Hoiem 2017, Feng et al.
  CVPR'22), off while both weights are 0 (`owl_cl.train.lwf`)."""

  weight: float = _fine_tuning_field(
    0.0,
    NON_NEGATIVE,
    "Weight of the distillation to the pre-trained model on the new images: weight x T^2 x "
    "the binary KL of the tempered sigmoids; 0 with box_weight 0: LwF off.",
  )
  temperature: float = _fine_tuning_field(
    2.0, POSITIVE, "The distillation temperature T (Li & Hoiem's T)."
  )
  box_weight: float = _fine_tuning_field(
    0.0, NON_NEGATIVE, "Weight of the L1 distance to the pre-trained model's boxes."
  )
  box_threshold: float = _fine_tuning_field(
    0.5,
    real(0.0, 1.0),
    "The box term covers the tokens whose pre-trained score is at least this.",
  )

  @property
  def on(self) -> bool:
    """Whether LwF adds its terms (a weight is non-zero)."""
    return bool(self.weight or self.box_weight)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """`train.lora`: low-rank adapters instead of full fine-tuning (docs/lora.md; Hu et al.,
  ICLR 2022), off at rank 0 (`owl_cl.model.lora`)."""

  rank: int = _fine_tuning_field(
    0,
    integer(0),
    "Rank r of the adapters (qwix) on the Dense layers `targets` matches; the base model is "
    "frozen and checkpoints hold the adapters. 0: off.",
  )
  alpha: float = _fine_tuning_field(16.0, POSITIVE, "The adapters' update is (alpha / rank) x A B.")
  dropout: float = _fine_tuning_field(
    0.0, real(0.0, 1.0, high_open=True), "Dropout on the adapters' input in training."
  )
  targets: tuple = _fine_tuning_field(
    DEFAULT_TARGETS,
    lambda value: targets_problem(value, None),
    "Regexes matched in full against the '/'-joined module paths; by default attention "
    "query / key / value / out and the MLP's Dense layers of every block of both towers.",
  )


_HOW_LOGGED = "how often metrics are fetched and logged, not what is trained"


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """`train`: continual fine-tuning on the downstream datasets (`owl_cl.trainer`,
  `owl_cl.phases`). The per-dataset fields (`config_fields.PER_DATASET_FIELDS`) can be
  overridden per dataset in `per_dataset`."""

  batch_size: int = _fine_tuning_field(16, integer(1), "New images per step.")
  num_epochs: int = _fine_tuning_field(8, STEPS, "Epochs per dataset.")
  num_steps: int | None = _fine_tuning_field(
    None,
    OPTIONAL_STEPS,
    "A budget per dataset in optimizer steps replacing num_epochs (the IVLOD protocol's "
    "iterations per task, docs/ivlod.md); None: num_epochs epochs.",
    type_=int,
  )
  num_steps_by_dataset: tuple | None = _fine_tuning_field(
    None,
    step_table,
    "The same per dataset, ((dataset name, steps), ...), for names a ConfigDict key cannot "
    "hold (dots); a per_dataset.<name>.num_steps wins over it, it over num_steps.",
    type_=tuple,
  )
  learning_rate: float = _fine_tuning_field(
    3e-4,
    POSITIVE,
    "Peak learning rate (below pre-training's 1e-3, which wrecked the features the next "
    "dataset needs in the built-in benchmark's sequence probe).",
  )
  warmup_steps: int = _fine_tuning_field(10, WARMUP_STEPS, "Linear warmup in optimizer steps.")
  text_lr_multiplier: float = _fine_tuning_field(
    1.0,
    NON_NEGATIVE,
    "The text tower's learning rate relative to the image tower's (the paper: 0.1; the tiny "
    "model's text tower has never seen the built-in downstream words: 1).",
  )
  layerwise_decay: float = _fine_tuning_field(
    1.0, FRACTION, "Layer-wise learning-rate decay m (the paper's LW-LRD coefficient)."
  )
  layerwise_granularity: str = _fine_tuning_field(
    "layer",
    choice(optim.GRANULARITIES),
    "'layer' (the paper: m**depth per transformer block) or 'tensor' (the released code: one "
    "decay step per parameter tensor in HF order).",
  )
  frozen: tuple = _fine_tuning_field(
    (),
    optim.frozen_rule,
    "Frozen parts (docs/baselines.md): presets 'heads_only', 'text_tower', 'image_tower' or "
    "regexes matched in full against parameter paths; no update, no optimizer state.",
  )
  lwf: LwfSpec = section(LwfSpec, "Learning without Forgetting (docs/baselines.md).")
  lora: LoraSpec = section(LoraSpec, "LoRA adapters (docs/lora.md).")
  wise_ft: WiseFtSpec = section(WiseFtSpec, "WiSE-FT weight-space ensembling (docs/baselines.md).")
  warmup_epochs: int | None = _fine_tuning_field(
    None,
    integer(0, maximum=STEPS.maximum, why=STEPS.why, optional=True),
    "Linear warmup in epochs of the dataset (the paper's table); None: warmup_steps.",
    type_=int,
  )
  per_dataset: FrozenDict = _fine_tuning_field(
    FrozenDict({}),
    mapping,
    "Per-dataset overrides {dataset name: {field: value}} of the fields in "
    "owl_cl.config_fields.PER_DATASET_FIELDS (the paper's per-dataset table in 'paper').",
  )
  carry: str = _fine_tuning_field(
    "last",
    choice(CARRY_MODES),
    "Parameters carried to the next dataset: 'last' (end of training) or 'best_validation' "
    "(the released code: the epoch of best AP on the dataset's valid split).",
  )
  schedule: str = _fine_tuning_field(
    "sequence",
    choice(SCHEDULES),
    "'sequence' (continual learning), 'joint' (all datasets at once, the upper bound) or "
    "'per_task' (each alone from the pre-trained model; docs/baselines.md).",
  )
  # The optimiser's Adam settings and clipping are pre-training's too: they enter the
  # pre-trained model's key (`pretrained.cache_key`).
  b1: float = field(0.9, BETA, "Adam's b1.")
  b2: float = field(0.999, BETA, "Adam's b2.")
  eps: float = field(1e-8, POSITIVE, "Adam's eps.")
  weight_decay: float = _fine_tuning_field(0.0, NON_NEGATIVE, "AdamW's decoupled weight decay.")
  grad_clip_norm: float | None = field(
    1.0,
    real(0.0, low_open=True, optional=True),
    "Gradients clipped to this global norm; None: no clipping.",
    type_=float,
  )
  log_every_steps: int = _fine_tuning_field(
    20,
    STEPS,
    "Metrics are logged (and checked finite) every this many steps and at a phase's last.",
    key=_HOW_LOGGED,
  )
  max_unique_queries: int = _fine_tuning_field(
    64,
    integer(0),
    "The text tower embeds each distinct query row of a batch once, up to this many "
    "(`owl_cl.train.step`); 0 disables it. Stochastic depth is then drawn per distinct query.",
  )


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """`loss`: the detection loss (docs/reference.md §3; `owl_cl.train.detection`): its terms'
  weights and options."""

  focal_alpha: float = field(0.3, real(0.0, 1.0), "Focal loss and matching cost alpha.")
  focal_gamma: float = field(2.0, NON_NEGATIVE, "Focal loss and matching cost gamma.")
  class_weight: float = field(
    1.0, NON_NEGATIVE, "Weight of the focal class term, in the matching cost and the loss."
  )
  bbox_weight: float = field(
    1.0, NON_NEGATIVE, "Weight of the L1 box term, in the matching cost and the loss."
  )
  giou_weight: float = field(
    1.0, NON_NEGATIVE, "Weight of the GIoU term, in the matching cost and the loss."
  )
  objectness_weight: float = field(
    0.0,
    NON_NEGATIVE,
    "OWLv2's objectness term (docs/owlv2.md): weight of the focal loss of the objectness "
    "logit against 'matched to a real box'; only an OWLv2 model has the term.",
  )
  normalization: str = field(
    "per_image",
    choice(NORMALIZATIONS),
    "Continual fine-tuning's normalisation: 'per_image' (scenic, the paper) or 'per_batch' "
    "(the released code). Pre-training and buffer losses stay per image.",
    key="applies to continual fine-tuning only (it enters the train step's key there); "
    "pre-training and the buffer's losses stay per image",
  )
  matcher: str = field(
    "auto",
    choice(MATCHERS),
    "Hungarian solver: 'scipy' (host callback), 'jax' (on the device) or 'auto' (per "
    "platform, owl_cl.train.matcher.AUTO_MATCHER).",
    key="each solver finds an exact minimum-cost matching: how it is computed, not what",
  )

  def per_image_options(self, version: str) -> dict:
    """The `detection.detection_loss` keyword options of a per-image loss outside the train
    step (the buffer selection's pass 1, loss adaptivity's pre-forward), derived from the
    fields: every field but `normalization` (those losses stay per image); `objectness_weight`
    only for an OWLv2 model (`version` 'owlv2': only it has the term; v1's options, and the
    build manifests that digest them, stay as they were). Source: docs/reference.md §3, §6,
    §9; docs/owlv2.md.

    Args:
      version: the model's version ('v1' or 'owlv2', `OwlVitConfig.version`).

    Returns:
      {field name: value}: floats, and `matcher` a str.
    """
    skipped = {"normalization"} | ({"objectness_weight"} if version != "owlv2" else set())
    return {
      f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skipped
    }

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
from owl_cl.config_fields import FINITE
from owl_cl.config_fields import FRACTION
from owl_cl.config_fields import LOSS_ADAPTIVITY_MODES
from owl_cl.config_fields import NON_NEGATIVE
from owl_cl.config_fields import PER_DATASET_FIELDS
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import Rule
from owl_cl.config_fields import boolean
from owl_cl.config_fields import budget
from owl_cl.config_fields import choice
from owl_cl.config_fields import declared
from owl_cl.config_fields import integer
from owl_cl.config_fields import integers
from owl_cl.config_fields import interval
from owl_cl.config_fields import names
from owl_cl.config_fields import probabilities
from owl_cl.config_fields import real
from owl_cl.config_fields import text
from owl_cl.data import builtin
from owl_cl.data import coco
from owl_cl.data import prompts
from owl_cl.data import suites
from owl_cl.eval_spec import EvalSpec
from owl_cl.model import variants
from owl_cl.model.spec import ModelSpec
from owl_cl.replay import buffer_selection
from owl_cl.replay import store_cache
from owl_cl.replay.retrieval import adaptive as retrieval_adaptive
from owl_cl.replay.retrieval import asv as retrieval_asv
from owl_cl.replay.retrieval import class_selection
from owl_cl.replay.retrieval import compose as retrieval_compose
from owl_cl.replay.retrieval import dedup
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import registry as retrieval_registry
from owl_cl.replay.retrieval import sample_selection
from owl_cl.replay.retrieval import steps as retrieval_steps
from owl_cl.run_spec import RunSpec
from owl_cl.train.checkpointing import CheckpointSpec
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
  # --- data
  "data.root": text(optional=True),
  "data.sequence": declared(list),
  "data.pretrain": declared(dict),
  "data.held_out": declared(dict),
  "data.zero_shot": declared(list),
  "data.odinw13_variant": choice(list(suites.ODINW13_VARIANTS), optional=True),
  "data.odinw_datasets": names(what="ODinW dataset"),
  "data.subset_seed": integer(0),
  "data.num_queries": integer(1),
  "data.num_negatives": integer(0),
  "data.max_instances": integer(1),
  "data.num_workers": integer(0),
  "data.prefetch_batches": integer(0),
  "data.validate_images": boolean,
  "data.exif_orientation": choice(coco.EXIF_ORIENTATIONS),
  "data.squash_resize": boolean,
  "data.merge_iou": real(0.0, 1.0, low_open=True, optional=True),
  "data.negatives_by_frequency": boolean,
  "data.host_sharding": boolean,
  "data.eval_batch_size": integer(1),
  "data.train_prompt_templates": choice(sorted(prompts.TRAIN_TEMPLATE_SETS)),
  "data.builtin.version": choice(builtin.BENCHMARK_VERSIONS),
  "data.builtin.seed": integer(0),
  "data.builtin.num_pretrain_train": integer(1),
  "data.builtin.num_pretrain_val": integer(1),
  "data.builtin.num_held_out_val": integer(1),
  "data.builtin.num_downstream_train": integer(1),
  "data.builtin.num_downstream_test": integer(1),
  "data.builtin.num_tail_val": integer(1),
  "data.builtin.downstream": names(lambda: builtin.DOWNSTREAM_NAMES, what="built-in dataset"),
  # --- augmentation
  "data.augment.hflip": boolean,
  "data.augment.random_crop": boolean,
  "data.augment.crop_area_range": interval(0.0, 1.0),
  "data.augment.crop_aspect_ratio_range": interval(0.0),
  "data.augment.crop_min_area_fraction": real(0.0, 1.0),
  "data.augment.mosaic_sizes": integers(1, optional=True),
  "data.augment.mosaic_probs": probabilities,
  # --- pre-training, continual fine-tuning, loss
  **config_spec.rules(PretrainSpec, "pretrain"),
  **config_spec.rules(TrainSpec, "train"),
  **config_spec.rules(LossSpec, "loss"),
  # --- replay (retrieval)
  "replay.algorithm": choice(sorted(retrieval_registry.ALGORITHMS) + ["none"]),
  "replay.ratio": POSITIVE,
  "replay.budget": budget,
  "replay.dedup": choice(dedup.SCHEDULE_NAMES),
  "replay.dedup_fraction": FRACTION,
  "replay.dedup_without_replacement": boolean,
  "replay.dedup_fraction_reset": choice(dedup.FRACTION_RESETS),
  "replay.der_alpha": NON_NEGATIVE,
  "replay.der_beta": NON_NEGATIVE,
  "replay.der_objectness_weight": NON_NEGATIVE,
  "replay.swil_weight": FINITE,
  "replay.swil_reduction": choice(class_selection.SWIL_REDUCTIONS),
  "replay.grasp_weight": FINITE,
  "replay.balanced_order": choice(retrieval_steps.BALANCED_ORDERS),
  "replay.adaptive_entropy_threshold": FINITE,
  "replay.adaptive_entropy_classes": choice(retrieval_adaptive.ADAPTIVE_ENTROPY_CLASSES),
  "replay.exhausted_class": choice(retrieval_compose.EXHAUSTED_CLASS),
  "replay.within_class_weighting": choice(retrieval_steps.WITHIN_CLASS_WEIGHTINGS),
  "replay.aser.num_candidates": integer(1, optional=True),
  "replay.aser.knn_k": integer(1),
  "replay.aser.asv_c": FINITE,
  "replay.aser.asv_token_matching": choice(knn_shapley.TOKEN_MATCHING),
  "replay.aser.asv_distance": choice(knn_shapley.DISTANCES),
  "replay.aser.asv_weight_reduction": choice(sample_selection.WEIGHT_REDUCTIONS),
  "replay.aser.asv_chunk_size": integer(1),
  "replay.aser.asv_left_term": choice((True, False)),
  "replay.aser.asv_shapley": choice(knn_shapley.SHAPLEY),
  "replay.aser.asv_distance_threshold": real(0.0, low_open=True, optional=True),
  "replay.aser.tknn_num_classes": POSITIVE,
  "replay.aser.candidate_subsets": choice(retrieval_asv.CANDIDATE_SUBSETS),
  "replay.aser.asv_features": choice(retrieval_asv.ASV_FEATURES),
  "replay.records": boolean,
  "replay.lookahead": boolean,
  "replay.stale_retrieval": boolean,
  "replay.top_k": integer(1),
  "replay.image_cache": text(optional=True),
  "replay.store_verification": choice(store_cache.STORE_VERIFICATIONS),
  "replay.loss_adaptivity.mode": choice(LOSS_ADAPTIVITY_MODES),
  "replay.loss_adaptivity.threshold": FINITE,
  "replay.loss_adaptivity.gate_per_device": boolean,
  "replay.loss_adaptivity.gate_feature_based_only": boolean,
  "replay.selection.loss_threshold": FINITE,
  "replay.selection.min_per_class": integer(0),
  "replay.selection.fill_all_for_rare_classes": boolean,
  "replay.selection.max_instances_per_prototype": integer(1),
  "replay.selection.distance_max_instances": integer(1, optional=True),
  "replay.selection.drop_images_without_class": boolean,
  "replay.selection.top_up_order": choice(buffer_selection.TOP_UP_ORDERS),
  "replay.selection.prototype_images": choice(buffer_selection.PROTOTYPE_IMAGES),
  "replay.selection.objectness_in_loss": boolean,
  "replay.selection.visual_genome_loss_threshold": FINITE,
  "replay.selection.visual_genome_min_per_class": integer(0),
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
}


def fields_markdown() -> str:
  """The field tables of docs/configs.md ("Fields written as specs"): per section of
  `SECTION_SPECS`, one row per field with its default, its doc and whether it enters cache
  keys (else why not), from the specs alone (`config_spec.doc_rows`, `not_in_keys`).

  Returns:
    Markdown, one `### <section>` heading and table per section.
  """
  out = []
  for prefix, spec in SECTION_SPECS.items():
    left_out = config_spec.not_in_keys(spec, prefix)
    out += [
      f"### {'`' + prefix + '`' if prefix else 'Top-level fields'}",
      "",
      "| field | default | what it does | cache keys |",
      "|---|---|---|---|",
    ]
    for path, default, doc in config_spec.doc_rows(spec, prefix):
      key = f"no: {left_out[path]}" if path in left_out else "yes"
      out.append(f"| `{path}` | `{default}` | {doc.replace('|', '&#124;')} | {key} |")
    out.append("")
  return "\n".join(out)

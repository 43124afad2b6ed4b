"""The rule of every config field: its type and its range or options, as data.

`FIELD_RULES` maps each leaf of `configs/base.py` ('' and 'paper') to a `config_fields.Rule`;
`TRAIN_FIELD_RULES` the per-dataset fields shared by `train.*`; `MODEL_OVERRIDE_RULES` every
field of `model.overrides`. `validation.range_problems` applies them before any work (and
`tests/test_bad_inputs.py` fails for a config leaf without a rule). The options of the choice
fields come from the modules that define them, so a new algorithm, schedule or variant is a
valid value the moment it exists.
"""

from __future__ import annotations

from owl_cl import model as model_lib
from owl_cl.config_fields import BETA
from owl_cl.config_fields import CARRY_MODES
from owl_cl.config_fields import DOWNSTREAM_EVAL_MODES
from owl_cl.config_fields import FINITE
from owl_cl.config_fields import FRACTION
from owl_cl.config_fields import LOSS_ADAPTIVITY_MODES
from owl_cl.config_fields import NON_NEGATIVE
from owl_cl.config_fields import OPTIONAL_STEPS
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import SCHEDULES
from owl_cl.config_fields import SEED
from owl_cl.config_fields import SEED_PARTS
from owl_cl.config_fields import SEED_RULES
from owl_cl.config_fields import STEPS
from owl_cl.config_fields import WARMUP_STEPS
from owl_cl.config_fields import Rule
from owl_cl.config_fields import boolean
from owl_cl.config_fields import budget
from owl_cl.config_fields import choice
from owl_cl.config_fields import declared
from owl_cl.config_fields import integer
from owl_cl.config_fields import integers
from owl_cl.config_fields import interval
from owl_cl.config_fields import mapping
from owl_cl.config_fields import names
from owl_cl.config_fields import probabilities
from owl_cl.config_fields import real
from owl_cl.config_fields import step_table
from owl_cl.config_fields import text
from owl_cl.data import builtin
from owl_cl.data import coco
from owl_cl.data import orders
from owl_cl.data import prompts
from owl_cl.data import suites
from owl_cl.model import clip as clip_lib
from owl_cl.model import lora as lora_lib
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
from owl_cl.train import losses
from owl_cl.train import optim
from owl_cl.train import step as step_lib

# The rules of the per-dataset fields (`PER_DATASET_FIELDS`), shared by `train.*`.
TRAIN_FIELD_RULES: dict[str, Rule] = {
  # Epochs too are bounded by the steps they make (an epoch is one step or more).
  "num_epochs": STEPS,
  # A budget in optimizer steps replacing num_epochs (the IVLOD protocol); None: epochs.
  "num_steps": OPTIONAL_STEPS,
  "warmup_epochs": integer(0, maximum=STEPS.maximum, why=STEPS.why, optional=True),
  "warmup_steps": WARMUP_STEPS,
  "learning_rate": POSITIVE,
  "text_lr_multiplier": NON_NEGATIVE,
  "layerwise_decay": FRACTION,
}


_DTYPES = ("float32", "bfloat16", "float16")

# Every field of configs/base.py ('' and 'paper') and what it must be: its type and its range
# or options (`tests/test_bad_inputs.py` walks every leaf of both configs and fails for a field
# without a rule). A dict-valued field (`model.overrides`, `train.per_dataset`, a declared
# dataset entry) is one leaf; its contents are checked by `model_problems`, `range_problems`
# and `check_datasets`. Fields a config lacks are skipped (e.g. the 'paper' config's
# `data.odinw_datasets` and Visual Genome settings).
FIELD_RULES: dict[str, Rule] = {
  "experiment_name": text(),
  "seed": SEED,
  # NumPy's generators (`np.random.default_rng`) take any int >= 0: JAX's int32 bounds them.
  "sequence_seed": integer(0, optional=True),
  "task_order": orders.task_order_problem,
  **{f"seeds.{part}": SEED_RULES[part] for part in SEED_PARTS},
  "cache_dir": text(),
  "compilation_cache_dir": text(optional=True, empty=True),  # '' disables the cache
  "init_checkpoint": text(optional=True),
  # --- model
  "model.variant": choice(sorted(model_lib.VARIANTS)),
  "model.tokenizer": choice(model_lib.known_tokenizers),
  "model.tokenizer_vocab_path": text(optional=True),
  "model.overrides": mapping,
  "model.dtype": choice(_DTYPES, optional=True),
  "model.attention": choice(clip_lib.ATTENTION_IMPLEMENTATIONS),
  "model.remat": choice(clip_lib.REMAT_POLICIES),
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
  "pretrain.batch_size": integer(1),
  "pretrain.num_steps": STEPS,
  "pretrain.learning_rate": POSITIVE,
  "pretrain.warmup_steps": WARMUP_STEPS,
  "pretrain.text_lr_multiplier": NON_NEGATIVE,
  "pretrain.layerwise_decay": FRACTION,
  "pretrain.weight_decay": NON_NEGATIVE,
  "pretrain.max_unique_queries": integer(0),
  "pretrain.eval_every_steps": integer(0, maximum=STEPS.maximum, why=STEPS.why, optional=True),
  "train.batch_size": integer(1),
  **{f"train.{name}": rule for name, rule in TRAIN_FIELD_RULES.items()},
  "train.num_steps_by_dataset": step_table,
  "train.layerwise_granularity": choice(optim.GRANULARITIES),
  "train.frozen": optim.frozen_rule,
  "train.lwf.weight": NON_NEGATIVE,
  "train.lwf.temperature": POSITIVE,
  "train.lwf.box_weight": NON_NEGATIVE,
  "train.lwf.box_threshold": real(0.0, 1.0),
  "train.lora.rank": integer(0),  # 0: off
  "train.lora.alpha": POSITIVE,
  "train.lora.dropout": real(0.0, 1.0, high_open=True),
  "train.lora.targets": lambda value: lora_lib.targets_problem(value, None),
  "train.per_dataset": mapping,
  "train.carry": choice(CARRY_MODES),
  "train.schedule": choice(SCHEDULES),
  "train.b1": BETA,
  "train.b2": BETA,
  "train.eps": POSITIVE,
  "train.weight_decay": NON_NEGATIVE,
  "train.grad_clip_norm": real(0.0, low_open=True, optional=True),
  "train.log_every_steps": STEPS,
  "train.max_unique_queries": integer(0),
  "loss.focal_alpha": real(0.0, 1.0),
  "loss.focal_gamma": NON_NEGATIVE,
  "loss.class_weight": NON_NEGATIVE,
  "loss.bbox_weight": NON_NEGATIVE,
  "loss.giou_weight": NON_NEGATIVE,
  "loss.objectness_weight": NON_NEGATIVE,
  "loss.normalization": choice(losses.NORMALIZATIONS),
  "loss.matcher": choice(losses.MATCHERS),
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
  # --- evaluation, checkpoints, budgets
  "eval.top_k": integer(1),
  "eval.max_dets": integer(1),
  "eval.multi_label": boolean,
  "eval.downstream_after_each_dataset": choice(DOWNSTREAM_EVAL_MODES),
  "eval.pretraining_sets_after_each_dataset": boolean,
  "eval.prompt_templates": choice(sorted(prompts.EVAL_TEMPLATE_SETS)),
  "eval.ensemble": choice(step_lib.ENSEMBLE_MODES),
  "eval.lvis_top_k": integer(1),
  "eval.lvis_max_dets": integer(1),
  "eval.report_ivlod": boolean,
  "eval.save_detections": boolean,
  "checkpoint.max_to_keep": integer(1, optional=True),
  "checkpoint.every_steps": OPTIONAL_STEPS,
  "checkpoint.every_minutes": real(0.0, low_open=True, optional=True),
  "max_train_steps_per_dataset": OPTIONAL_STEPS,
  "max_eval_images": integer(1, optional=True),
}

# Every field of the model (`ModelConfig`, `config.model.overrides.<field>`) and what it must
# be; the cross-field rules (image size a multiple of the patch size, widths of the heads) are
# in `model_problems`.
MODEL_OVERRIDE_RULES: dict[str, Rule] = {
  "tokenizer": choice(model_lib.known_tokenizers),
  **{
    name: integer(1)
    for name in (
      "vocab_size",
      "context_length",
      "embed_dim",
      "image_size",
      "patch_size",
      "vision_width",
      "vision_layers",
      "vision_heads",
      "vision_mlp_dim",
      "text_width",
      "text_layers",
      "text_heads",
      "text_mlp_dim",
    )
  },
  "text_stochastic_depth": real(0.0, 1.0),
  "vision_stochastic_depth": real(0.0, 1.0),
  "hf_compat": boolean,
  # The compute dtype is config.model.dtype (a name, turned into the jnp type by
  # `detector.model_fields`); an override would pass the name through unconverted.
  "dtype": lambda value: "is set by config.model.dtype (e.g. 'bfloat16'), not an override",
  "attention": choice(clip_lib.ATTENTION_IMPLEMENTATIONS),
  "remat": choice(clip_lib.REMAT_POLICIES),
  "version": choice(model_lib.MODEL_VERSIONS),
  "objectness_top_k": integer(0),
}

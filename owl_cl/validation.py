"""Every check of a run's config, written once and run once, before any work.

`validate(config)` runs the checks that need only the config (called first thing by
`experiment.run`); `data.real_inputs.check_inputs(config)` (called by `validate`) the file
checks of the paper's protocol (one error listing every missing input);
`check_datasets(config)` the checks of the declared datasets
(`data.sequence`, `data.pretrain`, `data.held_out`: every problem of every entry);
`check_sequence_config(config, benchmark)` the checks that need the run's downstream
sequence. Each raises `ConfigError` naming the field and its value.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from owl_cl import benchmark as benchmark_lib
from owl_cl import model as model_lib
from owl_cl import pretrained
from owl_cl.benchmark import Benchmark
from owl_cl.config_fields import BETA
from owl_cl.config_fields import FINITE
from owl_cl.config_fields import FRACTION
from owl_cl.config_fields import NON_NEGATIVE
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import MissingInputsError
from owl_cl.config_fields import Rule
from owl_cl.config_fields import check_carry_mode
from owl_cl.config_fields import check_downstream_eval_mode
from owl_cl.config_fields import check_per_dataset_fields
from owl_cl.config_fields import clip_vocabulary_problem
from owl_cl.config_fields import integer
from owl_cl.config_fields import loss_adaptivity_mode
from owl_cl.config_fields import real
from owl_cl.config_fields import uses_real_data
from owl_cl.data import entries
from owl_cl.data import odinw
from owl_cl.data import real_inputs
from owl_cl.data import scan
from owl_cl.data import suites
from owl_cl.data.coco import DataError
from owl_cl.detector import model_fields
from owl_cl.model import convert
from owl_cl.replay import buffer_selection
from owl_cl.replay.retrieval import asv as retrieval_asv
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import steps as retrieval_steps
from owl_cl.train import losses
from owl_cl.utils import expand_path


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  """The checks that need only the config; `experiment.run` calls it before any work.

  The range checks (`range_problems`), the workdir check (`workdir_problem`) and the mode
  checks are collected into one error, so a user fixes every field in one go.

  Args:
    config: the run's config.
    workdir: the run's output folder (absolute), checked writable; None skips that check.

  Raises:
    ConfigError: one message listing every out-of-range field with its value, an unwritable
      workdir, a workdir holding another run's results (`foreign_results_problem`), an
      unknown loss-adaptivity mode, `eval.downstream_after_each_dataset` or `train.carry`, a
      CLIP tokenizer without its vocabulary, an `init_checkpoint` folder that holds no
      checkpoint or a checkpoint of another model (`init_checkpoint_model_problem`).
    MissingInputsError: the paper's protocol with missing inputs
      (`data.real_inputs.check_inputs`), checked once the fields are valid; then every
      problem of the declared datasets (`check_datasets`).
  """
  problems = range_problems(config)
  if workdir is not None:
    problems += [p for p in [workdir_problem(workdir)] if p]
  for check in (loss_adaptivity_mode, check_downstream_eval_mode, check_carry_mode):
    try:
      check(config)
    except ConfigError as e:
      problems.append(str(e))
  problems += [p for p in [init_checkpoint_problem(config)] if p]
  problems += option_problems(config)
  # With real data, `real_inputs.check_inputs` lists it with the files.
  if not uses_real_data(config):
    problems += [p for p in [clip_vocabulary_problem(config)] if p]
  if problems:
    raise ConfigError(
      f"invalid config ({len(problems)} problem{'s' * (len(problems) > 1)}):\n"
      + "\n".join(f"  - {p}" for p in problems)
    )
  real_inputs.check_inputs(config)
  check_datasets(config)


# ----------------------------------------------------------------------------- ranges

# The rules of the per-dataset fields (`PER_DATASET_FIELDS`), shared by `train.*`.
TRAIN_FIELD_RULES: dict[str, Rule] = {
  "num_epochs": integer(1),
  "warmup_epochs": integer(0, optional=True),
  "warmup_steps": integer(0),
  "learning_rate": POSITIVE,
  "text_lr_multiplier": NON_NEGATIVE,
  "layerwise_decay": FRACTION,
}

# Every numeric field of configs/base.py and its range. Fields a config lacks are skipped
# (the Visual Genome settings exist in the 'paper' config only).
FIELD_RULES: dict[str, Rule] = {
  "sequence_seed": integer(0, optional=True),
  "data.num_queries": integer(1),
  "data.num_negatives": integer(0),
  "data.max_instances": integer(1),
  "data.num_workers": integer(0),
  "data.prefetch_batches": integer(0),
  "data.eval_batch_size": integer(1),
  "data.merge_iou": real(0.0, 1.0, low_open=True, optional=True),
  "data.augment.crop_min_area_fraction": real(0.0, 1.0),
  "data.builtin.num_pretrain_train": integer(1),
  "data.builtin.num_pretrain_val": integer(1),
  "data.builtin.num_held_out_val": integer(1),
  "data.builtin.num_downstream_train": integer(1),
  "data.builtin.num_downstream_test": integer(1),
  "pretrain.batch_size": integer(1),
  "pretrain.num_steps": integer(1),
  "pretrain.learning_rate": POSITIVE,
  "pretrain.warmup_steps": integer(0),
  "pretrain.text_lr_multiplier": NON_NEGATIVE,
  "pretrain.layerwise_decay": FRACTION,
  "pretrain.weight_decay": NON_NEGATIVE,
  "pretrain.max_unique_queries": integer(0),
  "pretrain.eval_every_steps": integer(0, optional=True),
  "train.batch_size": integer(1),
  **{f"train.{name}": rule for name, rule in TRAIN_FIELD_RULES.items()},
  "train.b1": BETA,
  "train.b2": BETA,
  "train.eps": POSITIVE,
  "train.weight_decay": NON_NEGATIVE,
  "train.grad_clip_norm": real(0.0, low_open=True, optional=True),
  "train.log_every_steps": integer(1),
  "train.max_unique_queries": integer(0),
  "loss.focal_alpha": real(0.0, 1.0),
  "loss.focal_gamma": NON_NEGATIVE,
  "loss.class_weight": NON_NEGATIVE,
  "loss.bbox_weight": NON_NEGATIVE,
  "loss.giou_weight": NON_NEGATIVE,
  "replay.ratio": POSITIVE,
  "replay.dedup_fraction": FRACTION,
  "replay.der_alpha": NON_NEGATIVE,
  "replay.der_beta": NON_NEGATIVE,
  "replay.swil_weight": FINITE,
  "replay.grasp_weight": FINITE,
  "replay.adaptive_entropy_threshold": FINITE,
  "replay.aser.num_candidates": integer(1, optional=True),
  "replay.aser.knn_k": integer(1),
  "replay.aser.asv_c": FINITE,
  "replay.aser.asv_chunk_size": integer(1),
  "replay.aser.asv_distance_threshold": real(0.0, low_open=True, optional=True),
  "replay.aser.tknn_num_classes": POSITIVE,
  "replay.top_k": integer(1),
  "replay.loss_adaptivity.threshold": FINITE,
  "replay.selection.loss_threshold": FINITE,
  "replay.selection.min_per_class": integer(0),
  "replay.selection.max_instances_per_prototype": integer(1),
  "replay.selection.visual_genome_loss_threshold": FINITE,
  "replay.selection.visual_genome_min_per_class": integer(0),
  "eval.top_k": integer(1),
  "eval.max_dets": integer(1),
  "eval.lvis_top_k": integer(1),
  "eval.lvis_max_dets": integer(1),
  "checkpoint.max_to_keep": integer(1, optional=True),
  "checkpoint.every_steps": integer(1, optional=True),
  "checkpoint.every_minutes": real(0.0, low_open=True, optional=True),
  "max_train_steps_per_dataset": integer(1, optional=True),
  "max_eval_images": integer(1, optional=True),
}

# Batch sizes split over the devices of the mesh ('data' axis: every device).
DEVICE_SPLIT_FIELDS = ("pretrain.batch_size", "train.batch_size")

_MISSING = object()


def _field(config: ml_collections.ConfigDict, path: str) -> Any:
  """The value at dotted `path`, or `_MISSING` when the config lacks it."""
  node = config
  for part in path.split("."):
    if not hasattr(node, "keys") or part not in node:
      return _MISSING
    node = node[part]
  return node


def range_problems(config: ml_collections.ConfigDict, num_devices: int | None = None) -> list[str]:
  """Every numeric field outside its range, as 'config.<field>=<value> <what it must be>'.

  Args:
    config: the run's config.
    num_devices: devices the batches are split over; None = `jax.device_count()`.

  Returns:
    One line per bad field (FIELD_RULES, `train.per_dataset.*`, the batch sizes'
    divisibility by the devices); empty when every field is valid.
  """
  problems = []
  for path, rule in FIELD_RULES.items():
    value = _field(config, path)
    if value is not _MISSING and (problem := rule(value)):
      problems.append(f"config.{path}={value!r} {problem}")
  for name, overrides in config.train.get("per_dataset", {}).items():
    for field, value in (overrides or {}).items():
      rule = TRAIN_FIELD_RULES.get(field)
      if rule is not None and (problem := rule(value)):
        problems.append(f"config.train.per_dataset.{name}.{field}={value!r} {problem}")
  if num_devices is None:
    import jax  # pylint: disable=g-import-not-at-top

    num_devices = jax.device_count()
  for path in DEVICE_SPLIT_FIELDS:
    value = _field(config, path)
    if value is not _MISSING and not integer(1)(value) and value % num_devices:
      problems.append(
        f"config.{path}={value} is not divisible by the {num_devices} devices; "
        f"use a multiple of {num_devices}"
      )
  return problems


def workdir_problem(workdir: str) -> str:
  """What keeps the run from writing `workdir` ('' when it can).

  The nearest existing folder on the path must be a writable folder (the run creates the
  rest); an existing `workdir` that is a file is refused.
  """
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    return f"workdir {path} exists and is not a folder"
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"workdir {path} cannot be created: {existing} is a file, not a folder"
  if not os.access(existing, os.W_OK | os.X_OK):
    what = "workdir" if existing == path else f"workdir {path} cannot be created: its parent"
    return f"{what} {existing} is not writable by this user"
  return foreign_results_problem(path)


def foreign_results_problem(workdir: str) -> str:
  """'' unless `workdir` holds results.json of a run other than its run.json's (or results
  without any run.json): the run would fail when it first writes its results, after hours of
  work and with its run.json, checkpoints and TensorBoard files written beside them."""
  results_path = os.path.join(workdir, "results.json")
  if not os.path.isfile(results_path):
    return ""
  try:
    with open(results_path) as f:
      owner = json.load(f).get("run_id")
  except (OSError, ValueError, AttributeError) as e:
    return (
      f"workdir {workdir} holds {results_path}, which cannot be read ({e}); use another workdir"
    )
  run_id = None
  try:
    with open(os.path.join(workdir, "run.json")) as f:
      run_id = json.load(f).get("run_id")
  except (OSError, ValueError, AttributeError):
    pass
  if owner is not None and owner == run_id:
    return ""
  holder = f"run {run_id!r} (run.json)" if run_id else "no run.json"
  return (
    f"workdir {workdir} holds {results_path} of run {owner!r} but {holder}: another run's "
    "results, which this run would overwrite; use another --workdir"
  )


def init_checkpoint_problem(config: ml_collections.ConfigDict) -> str:
  """What makes `config.init_checkpoint` unreadable before it is read ('' when it looks fine).

  A folder must be one of the formats `pretrained.load_init_checkpoint` reads: an owl_cl
  parameter checkpoint (`params/` written by orbax, with its `_METADATA`), an HF folder
  (`config.json`) or a folder of scenic `checkpoint_<step>` files. A missing path is
  reported here (built-in benchmark) or by `real_inputs.check_inputs` (real data). An owl_cl
  or HF checkpoint of another model (size, widths, layers) is named with the model it holds and
  the model the config needs (`init_checkpoint_model_problem`); a scenic one by the loader
  (`CheckpointMismatchError`, with the config's model named).
  """
  if not config.get("init_checkpoint"):
    return ""
  path = expand_path(config.init_checkpoint)
  if not os.path.exists(path):
    # With real data `real_inputs.check_inputs` lists it among every missing input.
    return "" if uses_real_data(config) else f"config.init_checkpoint={path} does not exist"
  if not os.path.isdir(path):
    return ""
  params = os.path.join(path, "params")
  if os.path.isdir(params):
    if os.path.exists(os.path.join(params, "_METADATA")):
      return init_checkpoint_model_problem(config, path)
    return (
      f"config.init_checkpoint={path} is not an owl_cl parameter checkpoint: {params} has no "
      "orbax _METADATA (an interrupted or foreign copy?)"
    )
  names = os.listdir(path)
  if "config.json" in names:
    return init_checkpoint_model_problem(config, path, hf=True)
  if any(n.startswith("checkpoint_") for n in names):
    return ""
  return (
    f"config.init_checkpoint={path} is a folder holding no checkpoint: neither params/ (an "
    "owl_cl parameter checkpoint), config.json (an HF OwlViTForObjectDetection folder) nor "
    f"checkpoint_<step> files (scenic) for model.variant={config.model.variant!r}"
  )


def init_checkpoint_model_problem(
  config: ml_collections.ConfigDict, path: str, hf: bool = False
) -> str:
  """What makes the checkpoint `path` another model than the config's ('' when it is this
  model): an owl_cl parameter checkpoint from its stored shapes and meta.json
  (`pretrained.params_checkpoint_problem`), an HF folder (`hf`) from its config.json
  (`pretrained.hf_checkpoint_problem`); the model's shapes by `jax.eval_shape`, nothing
  allocated. An invalid `config.model` is left to the detector's own error."""
  try:
    model = model_lib.create_model(config.model.variant, **model_fields(config))
  except (ValueError, TypeError, AttributeError):
    return ""
  like = convert.abstract_params(model.config)
  check = pretrained.hf_checkpoint_problem if hf else pretrained.params_checkpoint_problem
  return check(path, like, pretrained.model_description(config))


def option_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Fields that must name one of a fixed set of options, each named with its value."""
  options = (
    ("config.loss.normalization", config.loss.normalization, losses.NORMALIZATIONS),
    ("config.loss.matcher", config.loss.matcher, losses.MATCHERS),
    ("config.model.dtype", config.model.dtype, (None, "float32", "bfloat16", "float16")),
    (
      "config.replay.selection.top_up_order",
      config.replay.selection.top_up_order,
      buffer_selection.TOP_UP_ORDERS,
    ),
    (
      "config.replay.selection.prototype_images",
      config.replay.selection.prototype_images,
      buffer_selection.PROTOTYPE_IMAGES,
    ),
    (
      "config.replay.within_class_weighting",
      config.replay.within_class_weighting,
      retrieval_steps.WITHIN_CLASS_WEIGHTINGS,
    ),
    ("config.replay.aser.asv_shapley", config.replay.aser.asv_shapley, knn_shapley.SHAPLEY),
    ("config.replay.aser.asv_left_term", config.replay.aser.asv_left_term, (True, False)),
    (
      "config.replay.aser.asv_features",
      config.replay.aser.asv_features,
      retrieval_asv.ASV_FEATURES,
    ),
    (
      "config.replay.aser.candidate_subsets",
      config.replay.aser.candidate_subsets,
      retrieval_asv.CANDIDATE_SUBSETS,
    ),
  )
  return [
    f"{field}={value!r} is unknown; known: {list(known)}"
    for field, value, known in options
    if value not in known
  ]


def check_sequence_config(config: ml_collections.ConfigDict, benchmark: Benchmark) -> None:
  """Validates the sequence-dependent settings before anything is trained.

  Raises:
    ConfigError: `train.per_dataset` naming a dataset outside the run's registry or setting
      an unknown field; `train.carry` unknown, or 'best_validation' with a dataset that has
      no valid split; an unknown `eval.downstream_after_each_dataset`; a training set
      smaller than one batch (an empty one included).
  """
  known = {d.name for d in benchmark.sequence}
  if uses_real_data(config):
    known |= set(odinw.ODINW_DATASETS)
  for name in config.train.per_dataset:
    if name not in known:
      raise ConfigError(
        f"config.train.per_dataset.{name}: no dataset named {name!r}; known: {sorted(known)}"
      )
    check_per_dataset_fields(config, name)
  if check_carry_mode(config) == "best_validation":
    without = [d.name for d in benchmark.sequence if d.valid is None]
    if without:
      raise ConfigError(
        f"config.train.carry='best_validation' needs a valid split, which "
        f"{without} lack (the built-in benchmark has none)"
      )
  check_downstream_eval_mode(config)
  batch_size = config.train.batch_size
  small = [f"{d.name} ({len(d.train)})" for d in benchmark.sequence if len(d.train) < batch_size]
  if small:
    raise ConfigError(
      f"config.train.batch_size={batch_size} is larger than the training set of {small} "
      "(images in brackets): not one step could be taken; lower the batch size or fix the data"
    )


def check_data(config: ml_collections.ConfigDict, benchmark: Benchmark) -> dict[str, int]:
  """The data scan (`owl_cl.data.scan`) of every split the run reads, before any training.

  Every split must hold images (an empty training or evaluation set is refused); with
  `data.validate_images` (default True) every image is decoded as the pipeline decodes it,
  once per split and data version (recorded under `<cache_dir>/data_scan`).

  Returns:
    {'scanned': images decoded now, 'cached': images not decoded (see `scan.scan_splits`)}.

  Raises:
    DataError: one error listing every empty split and every image that does not decode,
      each naming the dataset, the split, the file and the reason.
  """
  return scan.scan_benchmark(
    benchmark,
    expand_path(config.cache_dir),
    decode=bool(config.data.get("validate_images", True)),
  )


# ----------------------------------------------------------------------------- datasets

# The splits each role of a declared dataset needs (owl_cl.benchmark: a sequence task trains
# on train and is evaluated on test; the pre-training source gives the buffer's candidates
# from train; the held-out set is evaluated on test or val).
ROLE_SPLITS = {"sequence": ("train", "test"), "pretrain": ("train",), "held_out": ()}


def dataset_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Every problem of the declared datasets (`data.sequence` / `pretrain` / `held_out`).

  Reads the annotation jsons and TFDS metadata, not the images (`entries.check_entry`):
  structural errors of an entry or suite item, missing files, folders or splits, unreadable
  TFDS folders, empty splits, category-name clashes, and two datasets of the run with the
  same name (their eval results would overwrite each other). The built-in suite's items are
  generated by the run and not checked here. Empty when nothing is declared.
  """
  decl = benchmark_lib.declaration(config)
  if all(decl[f] is None for f in benchmark_lib.DECLARED_FIELDS):
    return []
  # Item by item: a structural error in one item does not hide the file problems of others.
  problems, declared = [], {}
  for field in benchmark_lib.DECLARED_FIELDS:
    value = decl[field]
    if value is None:
      declared[field] = None
      continue
    if field != "sequence":
      if not isinstance(value, dict) or "suite" in value:
        problems.append(
          f"config.data.{field}: must be one dataset entry (a dict with name and kind), "
          f"got {value!r}"
        )
        declared[field] = None
        continue
      value = [value]
    elif not isinstance(value, (list, tuple)):
      problems.append(f"config.data.sequence: must be a list of entries / suites, got {value!r}")
      declared[field] = []
      continue
    found = []
    for i, item in enumerate(value):
      if benchmark_lib.is_builtin_suite(item):
        continue  # generated by the run
      where = f"config.data.{field}" + (f"[{i}]" if field == "sequence" else "")
      try:
        if isinstance(item, dict) and "suite" in item:
          found += suites.entries_from_config([item])
        else:
          found.append(entries.entry_from_config(item))
      except DataError as e:
        problems += [
          f"{where}: {line.removeprefix('datasets[0]: ')}" for line in str(e).split("\n")
        ]
    declared[field] = found if field == "sequence" else (found[0] if found else None)
  # Names the run's eval sets take from the built-in benchmark when a role is undeclared.
  names = {
    "pretrain": benchmark_lib.PRETRAIN_EVAL,
    "held_out": benchmark_lib.HELD_OUT_EVAL,
  }
  seen: dict[str, str] = {}
  for field in benchmark_lib.DECLARED_FIELDS:
    value = declared[field]
    if value is None:
      if field in names:
        seen[names[field]] = f"the built-in {field} set"
      continue
    for e in value if isinstance(value, list) else [value]:
      where = f"config.data.{field}"
      if e.name in seen:
        problems.append(f"{where}: dataset {e.name!r}: field 'name' is also used by {seen[e.name]}")
      seen.setdefault(e.name, f"config.data.{field}")
      problems += [f"{where}: {p}" for p in entries.check_entry(e, ROLE_SPLITS[field])]
      if field == "held_out" and not set(e.split_names) & {"test", "val"}:
        problems.append(f"{where}: dataset {e.name!r} needs a 'test' or 'val' split to evaluate")
  if isinstance(decl["sequence"], (list, tuple)) and not decl["sequence"]:
    problems.append("config.data.sequence: is empty; declare at least one dataset")
  return problems


def check_datasets(config: ml_collections.ConfigDict) -> None:
  """Raises one MissingInputsError listing every problem of the declared datasets.

  Raises:
    MissingInputsError: `dataset_problems`, each naming the config field, the entry, its
      split field and the value.
  """
  problems = dataset_problems(config)
  if problems:
    raise MissingInputsError(
      f"the declared datasets cannot be used ({len(problems)} problem"
      f"{'s' * (len(problems) > 1)}):\n" + "\n".join(f"  - {p}" for p in problems)
    )

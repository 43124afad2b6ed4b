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

from collections.abc import Sequence
import importlib.util
import json
import os
import tempfile
from typing import Any

import ml_collections

from owl_cl import benchmark as benchmark_lib
from owl_cl import config_spec
from owl_cl import model as model_lib
from owl_cl import pretrained
from owl_cl.benchmark import Benchmark
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import MissingInputsError
from owl_cl.config_fields import check_carry_mode
from owl_cl.config_fields import check_per_dataset_fields
from owl_cl.config_fields import clip_vocabulary_problem
from owl_cl.config_fields import integer
from owl_cl.config_fields import uses_real_data
from owl_cl.config_rules import FIELD_RULES
from owl_cl.config_rules import MODEL_OVERRIDE_RULES
from owl_cl.config_rules import SECTION_SPECS
from owl_cl.config_rules import TRAIN_FIELD_RULES
from owl_cl.data import entries
from owl_cl.data import odinw
from owl_cl.data import real_inputs
from owl_cl.data import scan
from owl_cl.data import suites
from owl_cl.data.coco import DataError
from owl_cl.detector import frozen_problem
from owl_cl.detector import lora_problem
from owl_cl.detector import model_fields
from owl_cl.model import convert
from owl_cl.utils import expand_path


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  """The checks that need only the config; `experiment.run` calls it before any work.

  Every field's type and range or options (`range_problems`, `FIELD_RULES`) and the workdir
  (`workdir_problem`) are checked first, then, with every field of the right type, the rules
  across fields (`model_problems`, `augment_problems`), the init checkpoint and the CLIP
  vocabulary: all collected into one error, so a user fixes every field in one go. Nothing is
  written and nothing is compiled.

  Args:
    config: the run's config.
    workdir: the run's output folder (absolute), checked writable; None skips that check.

  Raises:
    ConfigError: one message listing every field of the wrong type, out of range or with an
      unknown option with its value, an impossible model (`model_problems`) or augmentation
      (`augment_problems`), an unwritable workdir, a workdir holding another run's results
      (`foreign_results_problem`), a cache folder that is a file (`cache_dir_problem`), a
      CLIP tokenizer without its vocabulary or with an
      incomplete one (`clip_vocabulary_files_problem`), an `init_checkpoint` that is no
      checkpoint, a checkpoint of another model (`init_checkpoint_model_problem`) or one
      whose format needs a missing optional extra (`missing_extra_problem`), a schedule
      that cannot work with the other fields (`schedule_problem`).
    MissingInputsError: the paper's protocol with missing inputs
      (`data.real_inputs.check_inputs`), checked once the fields are valid; then every
      problem of the declared datasets (`check_datasets`).
  """
  problems = range_problems(config)
  fields_valid = not problems
  if workdir is not None:
    problems += [p for p in [workdir_problem(workdir)] if p]
  if fields_valid:
    problems += cache_dir_problem(config)
  if fields_valid:  # The checks across fields read fields of the right type.
    problems += model_problems(config)
    problems += augment_problems(config)
    checks = (
      init_checkpoint_problem,
      frozen_problem,
      lora_problem,
      schedule_problem,
      coco_backend_problem,
    )
    problems += [p for p in (check(config) for check in checks) if p]
    # With real data, `real_inputs.check_inputs` lists it with the files.
    if not uses_real_data(config):
      problems += [p for p in [clip_vocabulary_problem(config)] if p]
    problems += [p for p in [clip_vocabulary_files_problem(config)] if p]
  if len(problems) == 1:
    raise ConfigError(f"invalid config: {problems[0]}")
  if problems:
    raise ConfigError(
      f"invalid config ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems)
    )
  real_inputs.check_inputs(config)
  check_datasets(config)


# ----------------------------------------------------------------------------- ranges

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
  """Every field of the wrong type, outside its range or not one of its options, as
  'config.<field>=<value> <what it must be>'.

  Args:
    config: the run's config.
    num_devices: devices the batches are split over; None = `jax.device_count()`.

  Returns:
    One line per bad field (FIELD_RULES, `train.per_dataset.*`, a field a `SECTION_SPECS`
    section does not define, the batch sizes' divisibility by the devices); empty when every
    field is valid.
  """
  problems = []
  for path, rule in FIELD_RULES.items():
    value = _field(config, path)
    if value is not _MISSING and (problem := rule(value)):
      problems.append(f"config.{path}={value!r} {problem}")
  # A section written as a spec also refuses a field it does not define (a typo in a config
  # file); its rule lines are those above.
  for prefix, spec in SECTION_SPECS.items():
    section = _field(config, prefix)
    try:
      if section is not _MISSING:
        config_spec.from_config(spec, section, prefix)
    except ConfigError as e:
      problems += [p for p in str(e).splitlines() if p not in problems]
  per_dataset = config.train.get("per_dataset", {})
  for name, overrides in per_dataset.items() if hasattr(per_dataset, "items") else ():
    if not hasattr(overrides or {}, "items"):
      problems.append(f"config.train.per_dataset.{name}={overrides!r} must be a dict of fields")
      continue
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


def schedule_problem(config: ml_collections.ConfigDict) -> str:
  """What keeps `train.schedule` from working with the other fields ('' when fine): the joint
  set has no one valid split, so `train.carry='best_validation'` cannot pick its epoch."""
  if config.train.get("schedule") == "joint" and config.train.carry == "best_validation":
    return (
      "config.train.schedule='joint' with config.train.carry='best_validation': the joint set "
      "is one epoch of every dataset, with no valid split to pick an epoch by; use "
      "train.carry='last'"
    )
  return ""


def workdir_problem(workdir: str) -> str:
  """What keeps the run from writing `workdir` ('' when it can).

  The nearest existing folder on the path must be a writable folder (the run creates the
  rest; when it must, a folder is made there and removed at once, the one test a pseudo file
  system such as /proc answers truly for root); an existing `workdir` that is a file is
  refused.
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
  if existing != path:
    # os.access passes root anywhere, and a pseudo file system (/proc, /sys) refuses folders
    # whatever its modes say: a folder made and removed at once is the only sure test.
    try:
      os.rmdir(tempfile.mkdtemp(prefix=".owl_cl-probe-", dir=existing))
    except OSError as e:
      return f"workdir {path} cannot be created in {existing}: {e.strerror or e}"
  return foreign_results_problem(path)


def cache_dir_problem(config: ml_collections.ConfigDict) -> list[str]:
  """`config.cache_dir` / `config.compilation_cache_dir` that exists and is not a folder, or
  whose nearest existing folder on its path is a file: each one line (empty: fine). Whether
  it can be written is left to its first use (a read-only cache can still be read)."""
  problems = []
  for field in ("cache_dir", "compilation_cache_dir"):
    value = config.get(field)
    if not value:
      continue
    path = expand_path(value)
    existing = path
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
      where = "" if existing == path else f" cannot be created: {existing}"
      problems.append(f"config.{field}={path}{where} is a file, not a folder")
  return problems


def foreign_results_problem(workdir: str) -> str:
  """'' unless `workdir` holds results.json of a run other than its run.json's (or results
  without any run.json), or a run.json that cannot be read: the run would fail when it first
  writes its results, after hours of work and with its run.json, checkpoints and TensorBoard
  files written beside them. An unreadable results.json beside a readable run.json is this
  run's: set aside and rebuilt from the checkpoints (`results.set_aside_unreadable`)."""
  results_path = os.path.join(workdir, "results.json")
  run_path = os.path.join(workdir, "run.json")
  run_id = None
  if os.path.exists(run_path):
    try:
      with open(run_path) as f:
        run_id = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError) as e:
      return (
        f"workdir {workdir}: {run_path} cannot be read ({e}); it records the config of the "
        "run this workdir holds: restore it to resume, or use another --workdir"
      )
  if not os.path.isfile(results_path):
    return ""
  try:
    with open(results_path) as f:
      owner = json.load(f).get("run_id")
  except (OSError, ValueError, AttributeError) as e:
    if run_id is not None:
      return ""  # this run's, unreadable: rebuilt
    return (
      f"workdir {workdir} holds {results_path}, which cannot be read ({e}); use another workdir"
    )
  if owner is not None and owner == run_id:
    return ""
  if run_id is None:
    # The results may be this very run's, its run.json deleted: nothing tells, so nothing is
    # overwritten.
    return (
      f"workdir {workdir} holds {results_path} of run {owner!r} but no run.json, which "
      "records the config those results were run with (deleted?): they cannot be resumed or "
      "told apart from another config's; restore run.json to resume that run, or use another "
      "--workdir"
    )
  return (
    f"workdir {workdir} holds {results_path} of run {owner!r} but run {run_id!r} (run.json): "
    "another run's results, which this run would overwrite; use another --workdir"
  )


def init_checkpoint_problem(config: ml_collections.ConfigDict) -> str:
  """What makes `config.init_checkpoint` unreadable before it is read ('' when it looks fine).

  A folder must be one of the formats `pretrained.load_init_checkpoint` reads: an owl_cl
  parameter checkpoint (`params/` written by orbax, with its `_METADATA`), an HF folder
  (`config.json`) or a folder of scenic `checkpoint_<step>` files. A missing path is
  reported here (built-in benchmark) or by `real_inputs.check_inputs` (real data). An owl_cl
  or HF checkpoint of another model (size, widths, layers) is named with the model it holds and
  the model the config needs (`init_checkpoint_model_problem`); a scenic one by the loader
  (`CheckpointMismatchError`, with the config's model named). A file must start like a
  msgpack map (scenic: a `.npy` or any other file is refused); an HF folder needs the `hf`
  extra installed (`missing_extra_problem`).
  """
  if not config.get("init_checkpoint"):
    return ""
  path = expand_path(config.init_checkpoint)
  if not os.path.exists(path):
    # With real data `real_inputs.check_inputs` lists it among every missing input.
    return "" if uses_real_data(config) else f"config.init_checkpoint={path} does not exist"
  if not os.path.isdir(path):
    if _is_msgpack_map(path):
      return ""
    with open(path, "rb") as f:
      npy = f.read(6) == b"\x93NUMPY"
    return (
      f"config.init_checkpoint={path} is a file but not a scenic msgpack checkpoint"
      + (" (it is a NumPy .npy array)" if npy else "")
      + ": give a scenic checkpoint file, an HF OwlViTForObjectDetection folder or an owl_cl "
      "parameter checkpoint folder"
    )
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
    field = f"config.init_checkpoint={path}"
    feature = "reading an HF checkpoint folder"
    missing = missing_extra_problem(field, feature, "hf", HF_EXTRA_MODULES)
    if not missing and all(importlib.util.find_spec(m) is None for m in HF_WEIGHT_MODULES):
      missing = missing_extra_problem(field, feature, "hf", HF_WEIGHT_MODULES[:1])
    return missing or init_checkpoint_model_problem(config, path, hf=True)
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
  """The `range_problems` of the fields that name one of a fixed set of options (`choice`)."""
  return [
    f"config.{path}={value!r} {problem}"
    for path, rule in FIELD_RULES.items()
    if getattr(rule, "is_option", False)
    and (value := _field(config, path)) is not _MISSING
    and (problem := rule(value))
  ]


def model_problems(config: ml_collections.ConfigDict) -> list[str]:
  """What makes `config.model` no model, read from the config alone (nothing is built).

  Checks each `model.overrides` field (a `ModelConfig` field, `MODEL_OVERRIDE_RULES`), then
  the rules across fields: the image size a multiple of the patch size, each tower's width a
  multiple of its heads, `replay.top_k` at most the image tokens (the k class embeddings
  per image are k of its (image_size / patch_size)**2 tokens), and
  OWLv2's rules (`data.squash_resize` off, `replay.selection.objectness_in_loss` only with
  an OWLv2 model and its objectness term). Any
  other refusal of `owl_cl.model.create_model` is named with the model. Run with every field
  of the right type.

  Returns:
    One line per problem naming the field and its value; empty when the model can be built.
  """
  overrides = dict(config.model.overrides)
  problems = []
  for name, value in overrides.items():
    rule = MODEL_OVERRIDE_RULES.get(name)
    if rule is None:
      problems.append(
        f"config.model.overrides.{name}={value!r}: no such model field; known: "
        f"{sorted(MODEL_OVERRIDE_RULES)}"
      )
    elif problem := rule(value):
      problems.append(f"config.model.overrides.{name}={value!r} {problem}")
  if problems:
    return problems
  variant = config.model.variant
  model = {**model_lib.get_variant_config(variant).as_dict(), **overrides}

  def named(field: str) -> str:
    if field in overrides:
      return f"config.model.overrides.{field}={model[field]}"
    return f"{field}={model[field]} (of variant {variant!r})"

  if model["image_size"] % model["patch_size"]:
    problems.append(
      f"{named('image_size')} is not a multiple of the patch size {named('patch_size')}"
    )
  for tower in ("vision", "text"):
    if model[f"{tower}_width"] % model[f"{tower}_heads"]:
      problems.append(
        f"{named(f'{tower}_width')} is not divisible by the heads {named(f'{tower}_heads')}"
      )
  if problems:
    return problems
  try:
    model_lib.create_model(variant, **model_fields(config))
  except (ValueError, TypeError) as e:
    return [f"config.model (variant {variant!r}, overrides {overrides}): {e}"]
  tokens = (model["image_size"] // model["patch_size"]) ** 2
  if config.replay.top_k > tokens:
    problems.append(
      f"config.replay.top_k={config.replay.top_k} is more than the {tokens} image tokens of "
      f"the model ((image_size {model['image_size']} / patch_size {model['patch_size']})**2, "
      f"variant {variant!r}): an image has no {config.replay.top_k} class embeddings"
    )
  return problems + _owlv2_problems(config, model["version"], variant)


def _owlv2_problems(config, version: str, variant: str) -> list[str]:
  """OWLv2's rules across fields (docs/owlv2.md): its preprocessing pads to a square, so
  `data.squash_resize` has no OWLv2 form; `replay.selection.objectness_in_loss` needs an OWLv2
  model whose loss has the objectness term (`loss.objectness_weight` > 0): otherwise it would
  select by the same loss as False while keying another buffer."""
  if version == "owlv2" and config.data.squash_resize:
    return [
      f"config.data.squash_resize=True resizes without padding, but the OWLv2 model of "
      f"config.model.variant={variant!r} pads to a square, then resizes (docs/owlv2.md)"
    ]
  if not config.replay.selection.get("objectness_in_loss", False):
    return []
  if version != "owlv2":
    return [
      f"config.replay.selection.objectness_in_loss=True needs an OWLv2 model, but "
      f"config.model.variant={variant!r} is version {version!r} (no objectness head)"
    ]
  if not config.loss.objectness_weight:
    return [
      f"config.replay.selection.objectness_in_loss=True adds nothing with "
      f"config.loss.objectness_weight={config.loss.objectness_weight!r}: set it > 0"
    ]
  return []


def augment_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The augmentation settings across fields: a mosaic size per probability. Returns one
  line per problem (empty: fine); run with every field of the right type."""
  augment = config.data.augment
  sizes, probs = augment.get("mosaic_sizes"), augment.get("mosaic_probs")
  if sizes is not None and probs is not None and len(sizes) != len(probs):
    return [
      f"config.data.augment.mosaic_sizes={tuple(sizes)} and mosaic_probs={tuple(probs)} "
      f"differ in length ({len(sizes)} vs {len(probs)}): one probability per mosaic size"
    ]
  return []


def clip_vocabulary_files_problem(config: ml_collections.ConfigDict) -> str:
  """What `owl_cl.model.clip_tokenizer.load_vocabulary` would not find at the CLIP
  tokenizer's `model.tokenizer_vocab_path` ('' when fine, or not the 'clip' tokenizer, or
  unset: `clip_vocabulary_problem`). A missing path is reported here for the built-in
  benchmark, by `check_inputs` (with every missing input) for real data. Files are listed,
  not read."""
  vocab = config.model.get("tokenizer_vocab_path")
  if config.model.tokenizer != "clip" or not vocab:
    return ""
  path = expand_path(vocab)
  field = f"config.model.tokenizer_vocab_path={path}"
  if not os.path.exists(path):
    return "" if uses_real_data(config) else f"{field} does not exist"
  if os.path.isdir(path):
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    if has("vocab.json"):
      return "" if has("merges.txt") else f"{field} holds vocab.json but no merges.txt"
    if has("bpe_simple_vocab_16e6.txt.gz") or has("bpe_simple_vocab_16e6.txt"):
      return ""
    return (
      f"{field} is a folder without a CLIP vocabulary: expected vocab.json + merges.txt (an "
      "HF checkpoint folder) or bpe_simple_vocab_16e6.txt.gz (OpenAI)"
    )
  merges = os.path.join(os.path.dirname(path), "merges.txt")
  if path.endswith(".json") and not os.path.isfile(merges):
    return f"{field} is a vocab.json without {merges} beside it"
  return ""


# The modules of setup.py's optional 'hf' extra an HF checkpoint folder needs: transformers
# (its config.json), and one of safetensors / torch (its weights, `convert.load_hf_state_dict`).
HF_EXTRA_MODULES = ("transformers",)
HF_WEIGHT_MODULES = ("safetensors", "torch")


def missing_extra_problem(field: str, feature: str, extra: str, modules: Sequence[str]) -> str:
  """'' when every module of `modules` can be imported, else one line naming `field`, the
  `feature` that needs the optional `extra` of setup.py and the missing modules (found with
  `importlib.util.find_spec`: nothing is imported)."""
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if not missing:
    return ""
  return (
    f"{field}: {feature} needs the optional extra '{extra}', which is not installed "
    f"(missing: {', '.join(missing)}); pip install -e '.[{extra}]'"
  )


def coco_backend_problem(config: ml_collections.ConfigDict) -> str:
  """'' unless `config.eval.coco_backend` names faster-coco-eval and it is not installed (the
  `fast_coco` extra): one line, before any work, instead of an ImportError at the first
  evaluation."""
  value = config.eval.coco_backend
  if value == "pycocotools":
    return ""
  return missing_extra_problem(
    f"config.eval.coco_backend={value!r}", "COCO scoring with it", "fast_coco", (value,)
  )


def _is_msgpack_map(path: str) -> bool:
  """Whether the file starts like a msgpack map (a flax / scenic checkpoint's top level:
  fixmap 0x80-0x8f, map16 0xde, map32 0xdf; msgpack spec, "map format family")."""
  with open(path, "rb") as f:
    head = f.read(1)
  return bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def check_sequence_config(config: ml_collections.ConfigDict, benchmark: Benchmark) -> None:
  """Validates the sequence-dependent settings before anything is trained.

  Raises:
    ConfigError: `train.per_dataset` or `train.num_steps_by_dataset` naming a dataset
      outside the run's registry, or `train.per_dataset` setting an unknown field;
      `train.carry` unknown, or 'best_validation' with a dataset that has no valid split;
      an unknown `eval.downstream_after_each_dataset`; a split smaller than its phase needs
      (`split_size_problems`, every one listed).
  """
  known = {d.name for d in benchmark.sequence}
  if uses_real_data(config):
    known |= set(odinw.ODINW_DATASETS)
  for name in config.train.per_dataset:
    if name not in known:
      raise ConfigError(
        f"config.train.per_dataset.{name}: no dataset named {name!r}; known: {sorted(known)}"
      )
    check_per_dataset_fields(config.train.per_dataset, name)
  for name, _ in config.train.get("num_steps_by_dataset") or ():
    if name not in known:
      raise ConfigError(
        f"config.train.num_steps_by_dataset: no dataset named {name!r}; known: {sorted(known)}"
      )
  if check_carry_mode(config) == "best_validation":
    without = [d.name for d in benchmark.sequence if d.valid is None]
    if without:
      raise ConfigError(
        f"config.train.carry='best_validation' needs a valid split, which "
        f"{without} lack (the built-in benchmark has none)"
      )
  problems = split_size_problems(config, benchmark)
  if len(problems) == 1:
    raise ConfigError(problems[0])
  if problems:
    raise ConfigError(
      f"{len(problems)} problems of the data's sizes:\n" + "\n".join(f"  - {p}" for p in problems)
    )


def split_size_problems(config: ml_collections.ConfigDict, benchmark: Benchmark) -> list[str]:
  """Every split smaller than what its phase needs, one line each (empty: fine).

  The rule: a phase trains on whole batches (the last partial one is dropped), so a training
  split must hold at least one batch: each sequence dataset's `train.batch_size`, and the
  pre-training set's `pretrain.batch_size` unless `init_checkpoint` replaces pre-training
  (with fewer images no step is taken: pre-training waited for its first batch forever). The
  replay buffer is drawn from the pre-training set's training split (`replay.setup.build_store`),
  so an image count `replay.budget` must not exceed it (a fraction always fits); a larger one
  is refused rather than silently cut to the pool's size. A training split with images but no
  box (`annotations: []`) is refused too: every query would be a negative, and a run would
  end with no class learned (the pre-training set's split is checked when it is trained on or
  is the replay pool).
  """
  problems = []
  batch_size = config.train.batch_size
  small = [f"{d.name} ({len(d.train)})" for d in benchmark.sequence if len(d.train) < batch_size]
  if small:
    problems.append(
      f"config.train.batch_size={batch_size} is larger than the training set of {small} "
      "(images in brackets): not one step could be taken; lower the batch size or fix the data"
    )
  pool = len(benchmark.pretrain.train)
  if not config.get("init_checkpoint") and pool < config.pretrain.batch_size:
    problems.append(
      f"config.pretrain.batch_size={config.pretrain.batch_size} is larger than the "
      f"pre-training set's training split ({benchmark.pretrain.name}, {pool} images): not one "
      "pre-training step could be taken; lower the batch size, give the set more images "
      "(built-in: config.data.builtin.num_pretrain_train) or set config.init_checkpoint"
    )
  pretrain_used = not config.get("init_checkpoint") or config.replay.algorithm != "none"
  boxless = [(d.name, d.train) for d in benchmark.sequence] + (
    [(benchmark.pretrain.name, benchmark.pretrain.train)] if pretrain_used else []
  )
  for name, source in boxless:
    if len(source) and getattr(source, "num_boxes", None) == 0:
      problems.append(
        f"dataset {name!r}: its training split {getattr(source, 'annotation_file', '')} holds "
        f"{len(source)} images but no boxes (no annotations): training on it would teach no "
        "class; annotate it or declare it for evaluation only"
      )
  budget = config.replay.get("budget")
  if config.replay.algorithm != "none" and isinstance(budget, int) and budget > pool:
    problems.append(
      f"config.replay.budget={budget} images is more than the {pool} images of the "
      f"pre-training set's training split ({benchmark.pretrain.name}), the pool the replay "
      f"buffer is drawn from: give at most {pool}, or a fraction such as 1.0"
    )
  return problems


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
ROLE_SPLITS = {
  "sequence": ("train", "test"),
  "pretrain": ("train",),
  "held_out": (),
  "zero_shot": (),
}


def dataset_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Every problem of the declared datasets (`data.sequence` / `pretrain` / `held_out` /
  `zero_shot`).

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
    if field not in benchmark_lib.LIST_FIELDS:
      if not isinstance(value, dict) or "suite" in value:
        problems.append(
          f"config.data.{field}: must be one dataset entry (a dict with name and kind), "
          f"got {value!r}"
        )
        declared[field] = None
        continue
      value = [value]
    elif not isinstance(value, (list, tuple)):
      problems.append(f"config.data.{field}: must be a list of entries / suites, got {value!r}")
      declared[field] = []
      continue
    found = []
    for i, item in enumerate(value):
      if benchmark_lib.is_builtin_suite(item):
        continue  # generated by the run
      where = f"config.data.{field}" + (f"[{i}]" if field in benchmark_lib.LIST_FIELDS else "")
      try:
        if isinstance(item, dict) and "suite" in item:
          found += suites.entries_from_config([item])
        else:
          found.append(entries.entry_from_config(item))
      except DataError as e:
        problems += [
          f"{where}: {line.removeprefix('datasets[0]: ')}" for line in str(e).split("\n")
        ]
    declared[field] = found if field in benchmark_lib.LIST_FIELDS else (found[0] if found else None)
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
      found = entries.check_entry(e, ROLE_SPLITS[field])
      problems += [f"{where}: {p}" for p in found]
      if found and e.suite in suites.ODINW13_VARIANT_SUITES.values():
        problems += [f"{where}: {p}" for p in suites.variant_hint(e)]
      if field in ("held_out", "zero_shot") and not set(e.split_names) & {"test", "val"}:
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

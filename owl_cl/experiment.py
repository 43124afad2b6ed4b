"""One continual-learning run: the story of DESIGN.md, and the only place that knows it.

  1 model      OwlViT + parameters: `init_checkpoint`, or pre-trained here on the built-in
               benchmark's pre-training set (cached under `cache_dir` and reused by later runs)
  2 data       COCO-format sources -> input pipeline -> sharded batches
  3 buffer     selection over the pre-training set -> ReplayStore + prototypes (cached)
  4 sequence   for each downstream dataset: retrieval + DER++ training, evaluation, checkpoint
  5 results    results.json / results.md in the workdir, TensorBoard scalars

Resuming: every finished stage is checkpointed (orbax) together with the metrics so far; the
same command on the same workdir restores the last finished stage and goes on from there. A
workdir that holds a run of a different config is refused (nothing is overwritten).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging as py_logging
import os
import time
from typing import Any
import uuid

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tensorboardX import SummaryWriter
import tqdm

from owl_cl import model as model_lib
from owl_cl.data import builtin
from owl_cl.data import coco
from owl_cl.data import pipeline
from owl_cl.data import prompts
from owl_cl.eval import detection
from owl_cl.eval import lvis_eval
from owl_cl.eval import results as results_lib
from owl_cl.model import tokenizer as tokenizer_lib
from owl_cl.replay import algorithms
from owl_cl.replay import build as buffer_build
from owl_cl.replay import dedup
from owl_cl.replay import records as records_lib
from owl_cl.replay import state as replay_state_lib
from owl_cl.train import checkpointing
from owl_cl.train import losses
from owl_cl.train import optim
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib

PRETRAIN_EVAL = "pretrain_val"
HELD_OUT_EVAL = "held_out"
# Fields a `train.per_dataset.<dataset name>` entry may set; each replaces the `train.*` field
# of the same name while training on that dataset (`dataset_train_settings`).
PER_DATASET_FIELDS = (
  "num_epochs",
  "warmup_epochs",
  "warmup_steps",
  "learning_rate",
  "text_lr_multiplier",
  "layerwise_decay",
)


class ConfigError(ValueError):
  """A config value the run cannot use; the message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One detection dataset of the run: its training and evaluation sources.

  `valid` is the validation split (used by `train.carry='best_validation'`), None when the
  dataset has none; `evaluation` is 'coco' (COCO AP, exclusive classes) or 'lvis' (LVIS AP
  and APr, federated; SPEC §4); `max_detections` overrides the detections kept per image
  (`eval.top_k` and COCOeval's maxDets; SPEC §4: 100 for EgoHands and BrackishUnderwater),
  None = the config's.
  """

  name: str
  train: coco.CocoSource | None
  test: coco.CocoSource
  valid: coco.CocoSource | None = None
  evaluation: str = "coco"
  max_detections: int | None = None


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """The data of a run: the pre-training set, the held-out classes and the sequence.

  `pretrain.test` and `held_out.test` are evaluated under the names `pretrain_eval` and
  `held_out_eval`; `roles` says which eval set fills which Table 3 column (results.json
  `roles`; None: the built-in benchmark's default roles).
  """

  pretrain: Dataset
  held_out: Dataset
  sequence: tuple[Dataset, ...]
  fingerprint: str
  pretrain_eval: str = PRETRAIN_EVAL
  held_out_eval: str = HELD_OUT_EVAL
  roles: dict | None = None


def _digest(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def _expand(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path))


# ----------------------------------------------------------------------------- data


def load_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The run's data: the built-in benchmark (config.data.root is None) or real data.

  With `data.root` set the paper's protocol's real data is loaded (`load_real_benchmark`);
  otherwise the built-in benchmark, sequence ordered by sequence_seed.

  Raises:
    MissingInputsError: real data with missing files (one error listing all of them).
  """
  if uses_real_data(config):
    return load_real_benchmark(config)
  bc = config.data.builtin
  bench = builtin.ensure_benchmark(
    os.path.join(_expand(config.cache_dir), "builtin"),
    seed=bc.seed,
    num_pretrain_train=bc.num_pretrain_train,
    num_pretrain_val=bc.num_pretrain_val,
    num_held_out_val=bc.num_held_out_val,
    num_downstream_train=bc.num_downstream_train,
    num_downstream_test=bc.num_downstream_test,
    downstream=tuple(bc.downstream),
  )
  pretrain = Dataset("pretrain", bench.pretrain_train.source(), bench.pretrain_val.source())
  held_out = Dataset(HELD_OUT_EVAL, None, bench.held_out_val.source())
  sequence = [Dataset(d.name, d.train.source(), d.test.source()) for d in bench.downstream]
  if config.sequence_seed is not None:
    order = np.random.default_rng(config.sequence_seed).permutation(len(sequence))
    sequence = [sequence[i] for i in order]
  return Benchmark(pretrain, held_out, tuple(sequence), fingerprint=bench.fingerprint)


# ----------------------------------------------------------------------------- real data

OBJECTS365_EVAL = "o365"
LVIS_EVAL = "lvis"


class MissingInputsError(ConfigError):
  """Files or folders the run needs are missing; the message lists all of them and the layout."""


def uses_real_data(config: ml_collections.ConfigDict) -> bool:
  """True for the paper's protocol (a `:paper` config, or any config with data.root set)."""
  return config.data.root is not None or "odinw_datasets" in config.data


def _real_data_module():
  """owl_cl.data.odinw (the ODinW registry and sources)."""
  from owl_cl.data import odinw  # pylint: disable=g-import-not-at-top

  return odinw


def pretraining_input_paths(root: str) -> list[str]:
  """Files / folders of Objects365 (train: buffer candidates, val: evaluation) and LVIS val
  (json + the COCO 2017 image folders its images live in) below `root`.

  Source: owl_cl.data.pretraining (layout); SPEC §4, §6.
  """
  from owl_cl.data import pretraining  # pylint: disable=g-import-not-at-top

  paths = [p for split in ("train", "val") for p in pretraining.objects365_paths(root, split)]
  lvis_json, coco_dir = pretraining.lvis_paths(root, "val")
  paths += [lvis_json] + [os.path.join(coco_dir, f) for f in ("train2017", "val2017")]
  return paths


def real_data_layout(names: tuple[str, ...]) -> str:
  """The folder tree the paper's protocol expects below `data.root` (for error messages)."""
  odinw = _real_data_module()
  root = "<root>"
  pretraining = "\n".join(f"  {p}" for p in pretraining_input_paths(root))
  return (
    odinw.layout_description(names) + "\n<root>/  Objects365 v2 and LVIS v1 val "
    "(owl_cl.data.pretraining):\n" + pretraining
  )


def odinw_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The ODinW datasets of the run (`data.odinw_datasets`), validated, in the table's order.

  Raises:
    ConfigError: an empty list, a duplicate, or a name outside the ODinW registry.
  """
  names = tuple(config.data.odinw_datasets)
  if not names:
    raise ConfigError("config.data.odinw_datasets is empty; name at least one ODinW dataset")
  if len(set(names)) != len(names):
    raise ConfigError(f"config.data.odinw_datasets={names} lists a dataset twice")
  known = tuple(_real_data_module().ODINW_DATASETS)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ConfigError(
      f"config.data.odinw_datasets names unknown datasets {unknown}; known: {list(known)}"
    )
  return names


def _visual_genome_needed(config: ml_collections.ConfigDict) -> bool:
  """Whether the buffer takes images from Visual Genome (SPEC §6).

  A loss threshold <= 0 keeps no image (losses are >= 0), and with no per-class minimum
  nothing tops it up: the paper's setting (t = 0.0) takes nothing from Visual Genome, so
  Visual Genome is neither loaded nor required.

  Raises:
    ConfigError: a setting that would take Visual Genome images: a buffer over two
      pre-training sets (two class vocabularies) is not implemented.
  """
  bc = config.replay.buffer
  threshold = bc.get("visual_genome_loss_threshold", 0.0)
  minimum = bc.get("visual_genome_min_per_class", 0)
  if threshold > 0.0 or minimum > 0:
    raise ConfigError(
      f"config.replay.buffer.visual_genome_loss_threshold={threshold} / "
      f"visual_genome_min_per_class={minimum} would add Visual Genome images to the "
      "Objects365 buffer; a buffer over two pre-training sets is not implemented (the "
      "paper's protocol uses 0.0 / 0, which selects no Visual Genome image)"
    )
  return False


def input_problems(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
  """Everything the paper's protocol lacks before it can start (nothing is read but stats).

  Returns:
    (missing, problems): paths of missing files / folders, and config fields that must be
    set (e.g. `config.data.root is not set`). Both empty = ready.
  """
  missing, problems = [], []
  if config.init_checkpoint is None:
    problems.append(
      "config.init_checkpoint is not set (a scenic msgpack, an HF folder or an "
      "owl_cl parameter checkpoint of the pre-trained OWL-ViT)"
    )
  elif not os.path.exists(_expand(config.init_checkpoint)):
    missing.append(f"{_expand(config.init_checkpoint)} (config.init_checkpoint)")
  vocabulary = config.model.get("tokenizer_vocab_path")
  if config.model.tokenizer == "clip" and not vocabulary:
    problems.append(
      "config.model.tokenizer_vocab_path is not set (the CLIP BPE vocabulary: "
      "an HF folder with vocab.json + merges.txt, or OpenAI's "
      "bpe_simple_vocab_16e6.txt.gz)"
    )
  elif vocabulary and not os.path.exists(_expand(vocabulary)):
    missing.append(f"{_expand(vocabulary)} (config.model.tokenizer_vocab_path)")
  if config.data.root is None:
    problems.append("config.data.root is not set (the folder holding odinw/, objects365/, lvis/)")
    return missing, problems
  root = _expand(config.data.root)
  if not os.path.isdir(root):
    missing.append(f"{root} (config.data.root)")
    return missing, problems
  odinw = _real_data_module()
  names = odinw_names(config)
  missing += [str(m) for m in odinw.missing_files(root, names)]
  missing += [p for p in pretraining_input_paths(root) if not os.path.exists(p)]
  return missing, problems


def check_inputs(config: ml_collections.ConfigDict) -> None:
  """Raises one MissingInputsError listing every missing input of the paper's protocol.

  No-op for the built-in benchmark. Called by `run` before anything is trained or written.

  Raises:
    MissingInputsError: with every missing file / folder, every unset field and the
      expected data layout.
    ConfigError: an invalid `data.odinw_datasets` or buffer setting.
  """
  if not uses_real_data(config):
    return
  _visual_genome_needed(config)
  missing, problems = input_problems(config)
  if not missing and not problems:
    return
  lines = ["the paper's protocol cannot start:"]
  lines += [f"  - {p}" for p in problems]
  if missing:
    lines.append(f"  missing ({len(missing)}):")
    lines += [f"    {m}" for m in missing]
  lines += ["expected layout below config.data.root:", real_data_layout(odinw_names(config))]
  raise MissingInputsError("\n".join(lines))


def load_real_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The paper's data (SPEC §10): Objects365, LVIS val and the ODinW sequence.

  pre-training set = Objects365 (train: the buffer's images; val: evaluated as 'o365'),
  held-out = LVIS val (evaluated as 'lvis': AP, and APr as the rare column), sequence = the
  `data.odinw_datasets` (train / valid / test splits) shuffled by `sequence_seed`.

  Raises:
    MissingInputsError: see `check_inputs`.
  """
  from owl_cl.data import pretraining  # pylint: disable=g-import-not-at-top

  check_inputs(config)
  odinw = _real_data_module()
  root = _expand(config.data.root)
  names = odinw_names(config)
  subset_seed = config.data.get("subset_seed", 0)
  sequence = []
  for name in names:
    split = lambda s, name=name: odinw.odinw_source(root, name, s, subset_seed=subset_seed)
    sequence.append(
      Dataset(
        name,
        split("train"),
        split("test"),
        valid=split("val"),
        max_detections=odinw.ODINW_DATASETS[name].max_detections,
      )
    )
  if config.sequence_seed is not None:
    order = np.random.default_rng(config.sequence_seed).permutation(len(sequence))
    sequence = [sequence[i] for i in order]
  pretrain = Dataset(
    OBJECTS365_EVAL,
    pretraining.objects365_source(root, "train"),
    pretraining.objects365_source(root, "val"),
  )
  held_out = Dataset(LVIS_EVAL, None, pretraining.lvis_source(root, "val"), evaluation="lvis")
  roles = {
    "pretrain": {"eval_set": OBJECTS365_EVAL, "label": "O365"},
    "open_vocab": {"eval_set": LVIS_EVAL, "label": "LVIS"},
    "held_out": {"eval_set": LVIS_EVAL, "AP": "APr", "AP50": None, "label": "LVIS rare"},
    "downstream": [d.name for d in sequence],
    "downstream_label": "ODinW mean",
  }
  fingerprint = _digest({"root": root, "datasets": names, "subset_seed": subset_seed})
  return Benchmark(
    pretrain,
    held_out,
    tuple(sequence),
    fingerprint=fingerprint,
    pretrain_eval=OBJECTS365_EVAL,
    held_out_eval=LVIS_EVAL,
    roles=roles,
  )


def load_init_checkpoint(path: str, like) -> tuple[Any, dict]:
  """Parameters of `config.init_checkpoint` (SPEC §2). Returns (params, meta).

  Formats, recognised by what `path` holds: an owl_cl parameter checkpoint (a folder with
  `params/`, `owl_cl.train.checkpointing.save_params`); an HF `OwlViTForObjectDetection`
  folder (`config.json` + weights); otherwise a scenic msgpack file (or a folder of
  `checkpoint_<step>` files). Scenic and HF go through owl_cl.model.checkpoints.

  Args:
    path: the checkpoint (expanded).
    like: ShapeDtypeStruct tree of the model's parameters.

  Raises:
    owl_cl.model.checkpoints.CheckpointMismatchError: listing every missing, unexpected or
      wrongly shaped parameter against the configured model (e.g. a B/32 checkpoint for the
      L/14 config).
    FileNotFoundError: nothing readable at `path`.
  """
  if os.path.isdir(os.path.join(path, "params")):
    return checkpointing.load_params(path, like)
  from owl_cl.model import checkpoints  # pylint: disable=g-import-not-at-top

  if os.path.isfile(os.path.join(path, "config.json")):
    params, hf_config = checkpoints.load_hf_checkpoint(path)
    params = checkpoints.check_params(params, like, path)
    return params, {"source": path, "format": "hf", "hf_model_config": str(hf_config)}
  params = checkpoints.load_scenic_checkpoint(path, like)
  return params, {"source": path, "format": "scenic"}


# ----------------------------------------------------------------------------- helpers

# Fields of config.model / config.loss that choose how a step executes, not what it
# computes (the same values up to rounding): left out of cache keys.
_EXECUTION_ONLY = {"model": ("attention", "remat"), "loss": ("matcher",)}


def model_fields(config: ml_collections.ConfigDict) -> dict:
  """`create_model` keyword arguments: config.model.{dtype, attention, remat}, then
  config.model.overrides (which win). dtype None keeps the variant's.

  Raises:
    ConfigError: config.model.dtype is not 'float32', 'bfloat16' or 'float16'.
  """
  fields = {}
  dtype = config.model.get("dtype")
  if dtype is not None:
    if dtype not in ("float32", "bfloat16", "float16"):
      raise ConfigError(
        f"config.model.dtype={dtype!r} is unknown; known: float32, bfloat16, float16"
      )
    fields["dtype"] = getattr(jnp, dtype)
  for name in ("attention", "remat"):
    if config.model.get(name) is not None:
      fields[name] = config.model[name]
  fields.update(dict(config.model.overrides))
  return fields


def _cache_block(config: ml_collections.ConfigDict, name: str) -> dict:
  """config.<name> as a dict for a cache key, without execution-only fields and unset
  (None) new fields, so that keys written before they existed stay valid."""
  out = config[name].to_dict()
  for field in _EXECUTION_ONLY.get(name, ()):
    out.pop(field, None)
  if name == "model" and out.get("dtype") is None:
    out.pop("dtype", None)
  return out


class Runner:
  """Holds the static pieces of a run (model, tokenizer, mesh, jitted steps)."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.model = model_lib.create_model(config.model.variant, **model_fields(config))
    model_config = self.model.config
    # The self-contained tokenizer is sized by the model (vocabulary and context length); the
    # CLIP BPE reads its vocabulary from config.model.tokenizer_vocab_path (SPEC §2).
    tokenizer_kwargs = {}
    if config.model.tokenizer == "word_hash":
      tokenizer_kwargs = {
        "vocab_size": model_config.vocab_size,
        "context_length": model_config.context_length,
      }
    elif config.model.tokenizer == "clip":
      if not config.model.tokenizer_vocab_path:
        raise ConfigError(
          "config.model.tokenizer='clip' needs config.model.tokenizer_vocab_path: an HF "
          "checkpoint folder with vocab.json + merges.txt, or OpenAI's "
          "bpe_simple_vocab_16e6.txt.gz"
        )
      tokenizer_kwargs = {
        "vocab_path": _expand(config.model.tokenizer_vocab_path),
        "context_length": model_config.context_length,
      }
    self.tokenizer = tokenizer_lib.get_tokenizer(config.model.tokenizer, **tokenizer_kwargs)
    if self.tokenizer.vocab_size > model_config.vocab_size:
      raise ConfigError(
        f"config.model.tokenizer={config.model.tokenizer!r} has {self.tokenizer.vocab_size} "
        f"ids but the model's vocab_size is {model_config.vocab_size}"
      )
    try:
      self.train_templates = prompts.train_templates(config.data.train_prompt_templates)
      self.eval_templates = prompts.eval_templates(config.eval.prompt_templates)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    if config.eval.ensemble not in step_lib.ENSEMBLE_MODES:
      raise ConfigError(
        f"config.eval.ensemble={config.eval.ensemble!r} is unknown; known: "
        f"{list(step_lib.ENSEMBLE_MODES)}"
      )
    self.image_size = self.model.config.image_size
    self.mesh = sharding_lib.create_mesh()
    self.loss_config = dict(
      focal_alpha=config.loss.focal_alpha,
      focal_gamma=config.loss.focal_gamma,
      class_weight=config.loss.class_weight,
      bbox_weight=config.loss.bbox_weight,
      giou_weight=config.loss.giou_weight,
      matcher=config.loss.get("matcher", "auto"),
    )
    if self.loss_config["matcher"] not in losses.MATCHERS:
      raise ConfigError(
        f"config.loss.matcher={self.loss_config['matcher']!r} is unknown; known: "
        f"{list(losses.MATCHERS)}"
      )
    self.empty_tokens = self.tokenizer.encode([""])[0]
    self._text_embed = step_lib.make_text_embed_step(self.model)
    self._predict_steps = {}  # (templates?, top_k, multi_label) -> jitted prediction
    self._class_frequencies = {}  # source -> float64 [C] images per class (negatives)

  def init_params(self, seed: int):
    size = self.image_size
    images = jnp.zeros((1, size, size, 3), jnp.float32)
    queries = jnp.zeros((1, self.config.data.num_queries, self.tokenizer.context_length), jnp.int32)
    return jax.jit(self.model.init)(jax.random.PRNGKey(seed), images, queries)["params"]

  def class_tokens(self, source: coco.CocoSource) -> np.ndarray:
    names = [tokenizer_lib.canonicalize_label(n) for n in source.class_names]
    return self.tokenizer.encode(names)

  def train_class_tokens(self, source: coco.CocoSource) -> np.ndarray:
    """Training query tokens: [C, L] class names (data.train_prompt_templates='none'), or
    [C, P, L] prompts, one drawn per label and image by the pipeline (SPEC §2)."""
    if self.config.data.train_prompt_templates == "none":
      return self.class_tokens(source)
    return prompts.prompt_tokens(self.tokenizer, source.class_names, self.train_templates)

  def eval_query_embeddings(self, params, source: coco.CocoSource) -> jax.Array:
    """Query embeddings of the source's classes: [C, E] (eval.prompt_templates='none') or
    [P, C, E], one slice per evaluation template (SPEC §2)."""
    if self.config.eval.prompt_templates == "none":
      return self._text_embed(params, jnp.asarray(self.class_tokens(source)))
    tokens = prompts.prompt_tokens(self.tokenizer, source.class_names, self.eval_templates)
    num_classes, num_templates, length = tokens.shape
    embeddings = self._text_embed(params, jnp.asarray(tokens.reshape(-1, length)))
    return jnp.transpose(embeddings.reshape(num_classes, num_templates, -1), (1, 0, 2))

  def _predict_step(self, *, templates: bool, top_k: int, multi_label: bool):
    key = (templates, top_k, multi_label)
    if key not in self._predict_steps:
      if templates:
        self._predict_steps[key] = step_lib.make_template_predict_step(
          self.model,
          self.mesh,
          top_k=top_k,
          multi_label=multi_label,
          ensemble=self.config.eval.ensemble,
        )
      else:
        self._predict_steps[key] = step_lib.make_predict_step(
          self.model, self.mesh, top_k=top_k, multi_label=multi_label
        )
    return self._predict_steps[key]

  def example_options(self, source) -> dict[str, Any]:
    """Preprocessing options of a training example of `source` from `config.data`:
    `squash` (data.squash_resize), `merge_iou`, and `negative_weights` (float64 [C] images
    per class, when data.negatives_by_frequency; computed once per source). The same options
    preprocess the replay buffer's images. Source: SPEC §3, §5; pipeline.preprocess_train_example.
    """
    d = self.config.data
    options = {
      "squash": bool(d.squash_resize),
      "merge_iou": None if d.merge_iou is None else float(d.merge_iou),
    }
    if d.negatives_by_frequency:
      key = getattr(source, "annotation_file", None) or id(source)
      if key not in self._class_frequencies:
        self._class_frequencies[key] = pipeline.class_frequencies(source)
      options["negative_weights"] = self._class_frequencies[key]
    return options

  def augment_options(self) -> dict[str, Any]:
    """scenic's training augmentations from `config.data.augment` (SPEC §5): hflip,
    random_crop (+ area / aspect ranges, minimum kept box area), mosaics (sizes and their
    probabilities; off when `mosaic_sizes` is None).

    Raises:
      ConfigError: mosaic_sizes and mosaic_probs of different lengths.
    """
    a = self.config.data.augment
    options = {
      "hflip": bool(a.hflip),
      "random_crop": bool(a.random_crop),
      "crop_area_range": tuple(a.crop_area_range),
      "crop_aspect_ratio_range": tuple(a.crop_aspect_ratio_range),
      "crop_min_area_fraction": float(a.crop_min_area_fraction),
    }
    if a.mosaic_sizes:
      if len(a.mosaic_sizes) != len(a.mosaic_probs):
        raise ConfigError(
          f"config.data.augment.mosaic_sizes={tuple(a.mosaic_sizes)} and "
          f"mosaic_probs={tuple(a.mosaic_probs)} differ in length"
        )
      options.update(
        mosaic_sizes=tuple(int(k) for k in a.mosaic_sizes),
        mosaic_probs=tuple(float(p) for p in a.mosaic_probs),
      )
    return options

  def train_batches(self, source, *, batch_size: int, seed: int, epoch: int):
    """Training batches of one epoch of `source` (pipeline.train_dataset) with the config's
    preprocessing options, augmentations and host sharding (data.host_sharding)."""
    return pipeline.train_dataset(
      source,
      class_tokens=self.train_class_tokens(source),
      empty_tokens=self.empty_tokens,
      image_size=self.image_size,
      num_queries=self.config.data.num_queries,
      max_instances=self.config.data.max_instances,
      num_negatives=self.config.data.num_negatives,
      batch_size=batch_size,
      seed=seed,
      epoch=epoch,
      num_workers=self.config.data.num_workers,
      shard="jax" if self.config.data.host_sharding else None,
      **self.example_options(source),
      **self.augment_options(),
    )

  def evaluate(
    self,
    params,
    source: coco.CocoSource,
    desc: str,
    *,
    protocol: str = "coco",
    max_detections: int | None = None,
  ) -> dict[str, float]:
    """AP of `params` on `source`, queries = the source's class names (SPEC §4).

    protocol 'coco': pycocotools AP, eval.top_k detections (argmax class per token unless
    eval.multi_label). 'lvis': the lvis API's federated AP/APr/APc/APf of the top
    eval.lvis_top_k (token, class) pairs, eval.lvis_max_dets per image, ground truth read
    from `source.annotation_file` (LVIS v1 json). With eval.prompt_templates != 'none' the
    class scores are ensembled over the templates (eval.ensemble). `max_detections`, when
    given, replaces both the detections kept per image and maxDets of that protocol (SPEC §4:
    100 for EgoHands and BrackishUnderwater).
    """
    if protocol not in ("coco", "lvis"):
      raise ValueError(f"protocol must be 'coco' or 'lvis', got {protocol!r}")
    ec = self.config.eval
    lvis = protocol == "lvis"
    templates = ec.prompt_templates != "none"
    top_k = ec.lvis_top_k if lvis else ec.top_k
    max_dets = ec.lvis_max_dets if lvis else ec.max_dets
    if max_detections is not None:
      top_k = max_dets = int(max_detections)
    predict_step = self._predict_step(
      templates=templates, top_k=top_k, multi_label=True if lvis else ec.multi_label
    )
    query_embeddings = self.eval_query_embeddings(params, source)
    batch_size = self.config.data.eval_batch_size
    sharding_lib.check_batch_divisible(batch_size, self.mesh, "config.data.eval_batch_size")

    def predict_fn(batch):
      images = sharding_lib.shard_batch({"images": batch["images"]}, self.mesh)["images"]
      return jax.device_get(predict_step(params, images, query_embeddings))

    batches = pipeline.eval_dataset(
      source,
      image_size=self.image_size,
      batch_size=batch_size,
      squash=bool(self.config.data.squash_resize),
      max_images=self.config.max_eval_images,
    )
    if lvis:
      return lvis_eval.evaluate_lvis_source(
        predict_fn,
        source,
        batches,
        category_ids=source.category_ids,
        image_size=self.image_size,
        max_dets=max_dets,
        desc=desc,
      )
    return detection.evaluate_source(
      predict_fn,
      source,
      batches,
      category_ids=source.category_ids,
      image_size=self.image_size,
      max_dets=max_dets,
      desc=desc,
    )


def evaluate_dataset(
  runner: Runner, params, name: str, dataset: Dataset, desc: str
) -> dict[str, float]:
  """Metrics of `params` on `dataset.test`: COCO AP (`dataset.evaluation` 'coco') or LVIS AP /
  APr ('lvis'), with `dataset.max_detections` detections per image when set (SPEC §4).

  Raises:
    ConfigError: an unknown evaluation.
  """
  if dataset.evaluation not in ("coco", "lvis"):
    raise ConfigError(f"eval set {name!r}: unknown evaluation {dataset.evaluation!r} (coco | lvis)")
  return runner.evaluate(
    params, dataset.test, desc, protocol=dataset.evaluation, max_detections=dataset.max_detections
  )


def _progress(total: int, desc: str):
  return tqdm.tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0)


def _log_scalars(writer: SummaryWriter | None, prefix: str, metrics: dict, step: int):
  if writer is None:
    return
  for name, value in metrics.items():
    if np.ndim(value) == 0 and np.isfinite(float(value)):
      writer.add_scalar(f"{prefix}/{name}", float(value), step)


# ----------------------------------------------------------------------------- pre-training


def pretrain(runner: Runner, bench: Benchmark, workdir_writer: SummaryWriter | None):
  """Pre-trains the model from scratch on the pre-training set. Returns (params, curve)."""
  config = runner.config
  pc = config.pretrain
  sharding_lib.check_batch_divisible(pc.batch_size, runner.mesh, "config.pretrain.batch_size")
  params = runner.init_params(config.seed)
  tx, schedule = optim.create_optimizer(
    params,
    learning_rate=pc.learning_rate,
    total_steps=pc.num_steps,
    warmup_steps=pc.warmup_steps,
    text_lr_multiplier=pc.text_lr_multiplier,
    layerwise_decay=pc.layerwise_decay,
    weight_decay=pc.weight_decay,
    b1=config.train.b1,
    b2=config.train.b2,
    eps=config.train.eps,
    grad_clip_norm=config.train.grad_clip_norm,
  )
  train_step = step_lib.make_train_step(
    runner.model,
    tx,
    runner.mesh,
    loss_config=runner.loss_config,
    with_replay=False,
    max_unique_queries=pc.max_unique_queries,
  )
  state = sharding_lib.replicate(step_lib.create_train_state(params, tx), runner.mesh)
  key = jax.random.PRNGKey(config.seed + 1)
  curve = []
  step = 0
  epoch = 0
  start = time.time()
  bar = _progress(pc.num_steps, "pre-training")
  while step < pc.num_steps:
    for batch in runner.train_batches(
      bench.pretrain.train, batch_size=pc.batch_size, seed=config.seed, epoch=epoch
    ):
      if step >= pc.num_steps:
        break
      key, step_key = jax.random.split(key)
      batch = sharding_lib.shard_batch(_model_inputs(batch), runner.mesh)
      state, metrics = train_step(state, batch, None, step_key)
      step += 1
      bar.update(1)
      if step % config.train.log_every_steps == 0 or step == pc.num_steps:
        metrics = jax.device_get(metrics)
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
        _log_scalars(workdir_writer, "pretrain", dict(metrics, lr=schedule(step)), step)
        curve.append(
          {"step": step, "seconds": round(time.time() - start, 1), "loss": float(metrics["loss"])}
        )
      if pc.eval_every_steps and step % pc.eval_every_steps == 0 and step < pc.num_steps:
        params_now = jax.device_get(state.params)
        val = runner.evaluate(params_now, bench.pretrain.test, f"pre-training val @ {step}")
        if not curve or curve[-1]["step"] != step:
          curve.append({"step": step})
        curve[-1].update(
          seconds=round(time.time() - start, 1), val_AP=val["AP"], val_AP50=val["AP50"]
        )
        _log_scalars(workdir_writer, "pretrain_val", val, step)
        logging.info(
          "pre-training step %d: validation AP50 %.3f AP %.3f", step, val["AP50"], val["AP"]
        )
    epoch += 1
  bar.close()
  return jax.device_get(state.params), curve


def _model_inputs(batch: dict) -> dict:
  """The arrays a train step consumes (drops host-side bookkeeping such as image ids)."""
  return {k: batch[k] for k in ("images", "queries", "labels", "boxes")}


def pretrained_params(runner: Runner, bench: Benchmark, writer) -> tuple[Any, dict]:
  """Loads `init_checkpoint`, or the cached pre-trained model, or pre-trains and caches it.

  The cache key covers everything pre-training depends on (model, data, pre-training
  config, seed), so a changed setting never reuses a stale model.
  """
  config = runner.config
  like = jax.eval_shape(lambda: runner.init_params(config.seed))
  if config.init_checkpoint:
    return load_init_checkpoint(_expand(config.init_checkpoint), like)
  if uses_real_data(config):
    raise ConfigError("config.init_checkpoint is required with real data (config.data.root)")
  key = _digest(
    {
      "model": _cache_block(config, "model"),
      "pretrain": config.pretrain.to_dict(),
      "data": {
        k: v
        for k, v in config.data.to_dict().items()
        if k in ("num_queries", "num_negatives", "max_instances", "train_prompt_templates")
      },
      **non_default_data_options(config),
      "loss": _cache_block(config, "loss"),
      "seed": config.seed,
      "pretrain_data": _file_digest(bench.pretrain.train.annotation_file),
      "train_opt": [
        config.train.b1,
        config.train.b2,
        config.train.eps,
        config.train.grad_clip_norm,
      ],
    }
  )
  path = os.path.join(_expand(config.cache_dir), "pretrained", key)
  if os.path.isdir(path):
    logging.info("re-using the cached pre-trained model %s", path)
    return checkpointing.load_params(path, like)
  logging.info("no cached pre-trained model: pre-training (cache %s)", path)
  start = time.time()
  params, curve = pretrain(runner, bench, writer)
  meta = {"seconds": round(time.time() - start, 1), "curve": curve, "cache_key": key}
  meta["validation"] = runner.evaluate(params, bench.pretrain.test, "pre-training val")
  checkpointing.save_params(path, params, meta)
  return params, meta


# ----------------------------------------------------------------------------- replay


def make_algorithm(config: ml_collections.ConfigDict):
  """The retrieval algorithm named by config.replay.algorithm with its hyperparameters.

  Every hyperparameter the algorithm accepts (`algorithms.ALGORITHMS[name]
  .hyperparameter_names`) is taken from `config.replay` (table below); the dedup schedule
  from `replay.dedup` (+ `replay.dedup_fraction` for 'fraction').

  Raises:
    ConfigError: unknown algorithm, dedup schedule or option value (naming the field).
  """
  rc = config.replay
  name = rc.algorithm
  if name not in algorithms.ALGORITHMS:
    raise ConfigError(
      f"config.replay.algorithm={name!r} is unknown; known: "
      f"{sorted(algorithms.ALGORITHMS) + ['none']}"
    )
  fields = {
    "swil_weight": ("replay.swil_w", rc.swil_w),
    "grasp_weight": ("replay.grasp_w", rc.grasp_w),
    "balanced_order": ("replay.balanced_order", rc.balanced_order),
    "adaptive_entropy_threshold": (
      "replay.adaptive_entropy_threshold",
      rc.adaptive_entropy_threshold,
    ),
    "num_candidates": ("replay.aser.num_candidates", rc.aser.num_candidates),
    "knn_k": ("replay.aser.knn_k", rc.aser.knn_k),
    "asv_c": ("replay.aser.c", rc.aser.c),
    "asv_token_matching": ("replay.aser.token_matching", rc.aser.token_matching),
    "asv_distance": ("replay.aser.distance", rc.aser.distance),
    "asv_weight_reduction": ("replay.aser.weight_reduction", rc.aser.weight_reduction),
    "asv_chunk_size": ("replay.aser.chunk_size", rc.aser.chunk_size),
  }
  hyperparameters = {}
  for hp in algorithms.ALGORITHMS[name].hyperparameter_names:
    field, value = fields[hp]
    if value is not None:
      hyperparameters[hp] = value
  try:
    schedule = (
      dedup.DedupSchedule("fraction", rc.dedup_fraction)
      if rc.dedup == "fraction"
      else dedup.as_schedule(rc.dedup)
    )
    return algorithms.get_algorithm(name, dedup=schedule, **hyperparameters)
  except ValueError as e:
    raise ConfigError(f"config.replay ({name}): {e}") from e


# The input-pipeline options' defaults (configs/base.py). Cache keys list only the options
# that differ from them, so caches made before an option existed stay valid.
DEFAULT_DATA_OPTIONS = {
  "squash_resize": False,
  "merge_iou": 0.9,
  "negatives_by_frequency": False,
  "augment": {
    "hflip": False,
    "random_crop": False,
    "crop_area_range": (0.3, 1.0),
    "crop_aspect_ratio_range": (0.75, 1.33),
    "crop_min_area_fraction": 0.6,
    "mosaic_sizes": None,
    "mosaic_probs": (0.4, 0.3, 0.3),
  },
}


def non_default_data_options(
  config: ml_collections.ConfigDict, buffer: bool = False
) -> dict[str, Any]:
  """{'data_options': {...}} with the `config.data` pipeline options that differ from
  `DEFAULT_DATA_OPTIONS` ({} when none do), for the cache keys of the pre-trained model and
  (buffer=True: augmentations excluded, the buffer's images are not augmented) the buffer."""
  d = config.data
  differing = {}
  for name, default in DEFAULT_DATA_OPTIONS.items():
    if name == "augment":
      if buffer:
        continue
      value = {
        k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in d.augment.to_dict().items()
      }
      default = {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in default.items()}
    else:
      value = d.get(name, default)
    if value != default:
      differing[name] = value
  return {"data_options": differing} if differing else {}


def replay_buffer(runner: Runner, bench: Benchmark, params, pretrain_meta: dict):
  """The replay store over the pre-training set (cached; SPEC §6). Returns (store, stats)."""
  config = runner.config
  bc = config.replay.buffer
  source = bench.pretrain.train
  data = config.data
  key_material = {
    "model": pretrain_meta.get("cache_key") or config.init_checkpoint,
    "pretrain_data": _file_digest(source.annotation_file),
    "buffer": bc.to_dict(),
    "top_k": config.replay.top_k,
    "data": [data.num_queries, data.num_negatives, data.max_instances],
    "loss": _cache_block(config, "loss"),
    "seed": config.seed,
    "format": 1,
    **non_default_data_options(config, buffer=True),
  }
  build = lambda: buffer_build.build_store(
    runner.model,
    params,
    source,
    class_tokens=runner.class_tokens(source),
    empty_tokens=runner.empty_tokens,
    image_size=runner.image_size,
    num_queries=data.num_queries,
    max_instances=data.max_instances,
    num_negatives=data.num_negatives,
    seed=config.seed,
    loss_threshold=bc.loss_threshold,
    min_per_class=bc.min_per_class,
    fill_all_for_rare_classes=bc.fill_all_for_rare_classes,
    top_k=config.replay.top_k,
    max_per_class=bc.max_instances_per_prototype,
    loss_config=runner.loss_config,
    batch_size=data.eval_batch_size,
    example_options=runner.example_options(source),
  )
  return buffer_build.cached_store(
    os.path.join(_expand(config.cache_dir), "buffers"), key_material, build
  )


# ----------------------------------------------------------------------------- the run


def _check_workdir(workdir: str, config: ml_collections.ConfigDict) -> str:
  """Creates or validates `workdir/run.json`; returns the run id.

  Raises:
    ConfigError: the workdir holds a run of another config (it would be overwritten).
  """
  os.makedirs(workdir, exist_ok=True)
  run_file = os.path.join(workdir, "run.json")
  config_json = json.loads(config.to_json_best_effort())
  if os.path.exists(run_file):
    with open(run_file) as f:
      existing = json.load(f)
    if existing.get("config") != config_json:
      changed = sorted(
        k
        for k in set(existing.get("config", {})) | set(config_json)
        if existing.get("config", {}).get(k) != config_json.get(k)
      )
      raise ConfigError(
        f"workdir {workdir} holds a run of a different config (differing fields: "
        f"{changed}); use another --workdir or the same config to resume it"
      )
    return existing["run_id"]
  run_id = uuid.uuid4().hex
  tmp = run_file + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"run_id": run_id, "config": config_json}, f, indent=2, sort_keys=True)
  os.replace(tmp, run_file)
  return run_id


def benchmark_eval_sets(bench: Benchmark) -> list[tuple[str, Dataset]]:
  """(eval-set name, dataset) of every eval set: pre-training, held-out, each dataset."""
  return [(bench.pretrain_eval, bench.pretrain), (bench.held_out_eval, bench.held_out)] + [
    (d.name, d) for d in bench.sequence
  ]


def stage_eval_names(config: ml_collections.ConfigDict, bench: Benchmark, index: int) -> list[str]:
  """The eval sets evaluated after dataset `index` (1-based) of the sequence.

  The final stage evaluates every set; earlier stages the downstream sets per
  `eval.downstream_after_each_dataset` ('all' | 'seen': datasets 1..index) plus the
  pre-training and held-out sets if `eval.pretraining_sets_after_each_dataset`.
  Stage 0 (after pre-training) always evaluates everything (the "No fine-tuning" row).

  Raises:
    ConfigError: an unknown `eval.downstream_after_each_dataset`.
  """
  names = [d.name for d in bench.sequence]
  everything = [bench.pretrain_eval, bench.held_out_eval] + names
  if index >= len(bench.sequence):
    return everything
  mode = config.eval.downstream_after_each_dataset
  if mode not in ("all", "seen"):
    raise ConfigError(f"config.eval.downstream_after_each_dataset={mode!r}; use 'all' or 'seen'")
  out = []
  if config.eval.pretraining_sets_after_each_dataset:
    out += [bench.pretrain_eval, bench.held_out_eval]
  return out + (names if mode == "all" else names[:index])


def check_sequence_config(config: ml_collections.ConfigDict, bench: Benchmark) -> None:
  """Validates the sequence-dependent settings before anything is trained.

  Raises:
    ConfigError: `train.per_dataset` naming a dataset outside the run's registry or setting
      an unknown field; `train.carry` unknown, or 'best_validation' with a dataset that has
      no valid split; an unknown `eval.downstream_after_each_dataset`.
  """
  known = {d.name for d in bench.sequence}
  if uses_real_data(config):
    known |= set(_real_data_module().ODINW_DATASETS)
  for name, overrides in config.train.per_dataset.items():
    if name not in known:
      raise ConfigError(
        f"config.train.per_dataset.{name}: no dataset named {name!r}; known: {sorted(known)}"
      )
    for field in overrides:
      if field not in PER_DATASET_FIELDS:
        raise ConfigError(
          f"config.train.per_dataset.{name}.{field}: unknown field; "
          f"allowed: {list(PER_DATASET_FIELDS)}"
        )
  carry = config.train.carry
  if carry not in ("last", "best_validation"):
    raise ConfigError(f"config.train.carry={carry!r}; use 'last' or 'best_validation'")
  if carry == "best_validation":
    without = [d.name for d in bench.sequence if d.valid is None]
    if without:
      raise ConfigError(
        f"config.train.carry='best_validation' needs a valid split, which "
        f"{without} lack (the built-in benchmark has none)"
      )
  if config.eval.downstream_after_each_dataset not in ("all", "seen"):
    raise ConfigError(
      "config.eval.downstream_after_each_dataset="
      f"{config.eval.downstream_after_each_dataset!r}; use 'all' or 'seen'"
    )


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs (or resumes) the experiment of `config` in `workdir`. Returns the results dict.

  Raises:
    ConfigError: a config value that cannot be used, or a workdir holding another run.
  """
  py_logging.getLogger("absl").setLevel(py_logging.INFO)
  workdir = _expand(workdir)
  if config.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", _expand(config.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  check_inputs(config)  # real data: one error listing every missing input, up front
  loss_adaptivity_mode(config)  # a bad mode fails before any work
  run_id = _check_workdir(workdir, config)
  wall_start = time.time()
  bench = load_benchmark(config)
  check_sequence_config(config, bench)
  runner = Runner(config)
  writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
  checkpointer = checkpointing.StageCheckpointer(
    os.path.join(workdir, "checkpoints"), max_to_keep=config.checkpoint.max_to_keep
  )
  algorithm_name = config.replay.algorithm
  with_replay = algorithm_name != "none"

  params, pretrain_meta = pretrained_params(runner, bench, writer)
  store, buffer_stats = None, None
  if with_replay:
    store, buffer_stats = replay_buffer(runner, bench, params, pretrain_meta)
  eval_sets = benchmark_eval_sets(bench)

  def evaluate_all(params, stage_name, names=None):
    return {
      name: evaluate_dataset(runner, params, name, dataset, f"eval {name} @ {stage_name}")
      for name, dataset in eval_sets
      if names is None or name in names
    }

  rstate = replay_state_lib.init_replay_state(
    store.num_images if store else 1,
    jax.random.PRNGKey(config.seed + 2),
    num_classes=store.num_classes if store else 1,
  )  # orbax saves no empty arrays
  latest = checkpointer.latest_stage()
  if latest is None:
    stages = [{"name": "pretrained", "metrics": evaluate_all(params, "pretrained")}]
    checkpointer.save(0, params, rstate, {"stages": stages})
    latest = 0
  else:
    logging.info("resuming %s after stage %d", workdir, latest)
    params, rstate, meta = checkpointer.restore(latest, params, rstate)
    stages = meta["stages"]
  timings = {"pretrain_seconds": pretrain_meta.get("seconds")}

  def write(status: str):
    results = {
      "run_id": run_id,
      "status": status,
      "algorithm": config.experiment_name,
      "retrieval": algorithm_name,
      "seed": config.seed,
      "sequence": [d.name for d in bench.sequence],
      "eval_sets": {
        "pretrain": bench.pretrain_eval,
        "held_out": bench.held_out_eval,
        "downstream": [d.name for d in bench.sequence],
      },
      "stages": stages,
      "config": json.loads(config.to_json_best_effort()),
      "pretraining": {k: pretrain_meta.get(k) for k in ("seconds", "curve", "validation")},
      "timings": dict(timings, wall_seconds=round(time.time() - wall_start, 1)),
      "buffer": buffer_stats,
    }
    if bench.roles is not None:
      results["roles"] = bench.roles
    results_lib.write_results(workdir, results)
    return results

  write("running")
  for index in range(latest + 1, len(bench.sequence) + 1):
    dataset = bench.sequence[index - 1]
    start = time.time()
    params, rstate, train_metrics = train_on_dataset(
      runner,
      dataset,
      params,
      store,
      rstate,
      writer,
      index,
      records_path=os.path.join(workdir, "records", f"{dataset.name}.npz"),
    )
    metrics = evaluate_all(params, dataset.name, stage_eval_names(config, bench, index))
    for name, values in metrics.items():
      _log_scalars(writer, f"eval/{name}", values, index)
    stages.append(
      {
        "name": dataset.name,
        "metrics": metrics,
        "train": train_metrics,
        "seconds": round(time.time() - start, 1),
      }
    )
    checkpointer.save(index, params, rstate, {"stages": stages})
    write("running")
  results = write("complete")
  writer.close()
  checkpointer.close()
  logging.info("results: %s", os.path.join(workdir, "results.md"))
  return results


def train_on_dataset(
  runner: Runner,
  dataset: Dataset,
  params,
  store,
  rstate,
  writer,
  index: int,
  records_path: str | None = None,
):
  """Fine-tunes on one downstream dataset with retrieval + DER++ (fresh optimizer).

  With `config.replay.records` and a `records_path`, the retrieval analysis records
  (`owl_cl.replay.records`) of the dataset are written there.
  Returns (params, replay state, training summary dict).
  """
  config = runner.config
  tc = config.train
  batch_size = tc.batch_size
  sharding_lib.check_batch_divisible(batch_size, runner.mesh, "config.train.batch_size")
  steps_per_epoch = len(dataset.train) // batch_size
  if steps_per_epoch < 1:
    raise ConfigError(
      f"dataset {dataset.name} has {len(dataset.train)} training images, "
      f"fewer than config.train.batch_size={batch_size}"
    )
  settings = dataset_train_settings(config, dataset.name, steps_per_epoch)
  num_epochs = settings["num_epochs"]
  total = steps_per_epoch * num_epochs
  if config.max_train_steps_per_dataset:
    total = min(total, config.max_train_steps_per_dataset)
  tx, schedule = optim.create_optimizer(
    params,
    learning_rate=settings["learning_rate"],
    total_steps=total,
    warmup_steps=settings["warmup_steps"],
    text_lr_multiplier=settings["text_lr_multiplier"],
    layerwise_decay=settings["layerwise_decay"],
    layerwise_granularity=tc.get("layerwise_granularity", "layer"),
    b1=tc.b1,
    b2=tc.b2,
    eps=tc.eps,
    weight_decay=tc.weight_decay,
    grad_clip_norm=tc.grad_clip_norm,
  )
  with_replay = store is not None
  adaptivity = loss_adaptivity_mode(config) if with_replay else "none"
  threshold = float(config.replay.loss_adaptivity.threshold)
  train_step = step_lib.make_train_step(
    runner.model,
    tx,
    runner.mesh,
    loss_config=runner.loss_config,
    alpha=config.replay.der_alpha,
    beta=config.replay.der_beta,
    with_replay=with_replay,
    max_unique_queries=tc.max_unique_queries,
    loss_adaptivity=adaptivity,
    loss_threshold=threshold,
  )
  state = sharding_lib.replicate(step_lib.create_train_state(params, tx), runner.mesh)
  if with_replay:
    num_replay = max(1, int(round(config.replay.ratio * batch_size)))
    sharding_lib.check_batch_divisible(num_replay, runner.mesh, "replay batch (ratio * batch)")
    if adaptivity == "paper" and num_replay != batch_size:
      raise ConfigError(
        f"config.replay.loss_adaptivity.mode='paper' replays one image per new image above "
        f"the threshold and needs config.replay.ratio=1.0, got {config.replay.ratio}"
      )
    algorithm = make_algorithm(config)
    recorder = None
    if config.replay.records and records_path:
      recorder = records_lib.RetrievalRecords(
        store.num_classes, getattr(algorithm, "num_candidates", 0)
      )
      retrieve = jax.jit(algorithm.retrieve_with_records, static_argnums=3)
    else:
      retrieve = jax.jit(algorithm, static_argnums=3)
    dedup_schedule = algorithm.dedup
    buffer = sharding_lib.replicate(store.replay_buffer(), runner.mesh)
    rstate = algorithm.prepare(rstate, buffer)
    top_k = config.replay.top_k if algorithm.needs_features else None
    # 'paper': one eval-mode forward gives the new images' losses (and the features).
    new_losses = (
      step_lib.make_new_loss_step(
        runner.model, runner.mesh, loss_config=runner.loss_config, k=top_k
      )
      if adaptivity == "paper"
      else None
    )
    embed = (
      step_lib.make_embed_step(runner.model, runner.mesh, k=top_k)
      if top_k and new_losses is None
      else None
    )
    # Device-side counters (no host sync per step): replays that entered the loss, steps
    # with at least one.
    replays_in_loss = jnp.zeros((), jnp.int32)
    replay_steps = jnp.zeros((), jnp.int32)
  key = jax.random.PRNGKey(config.seed * 1000 + index)
  step = 0
  replayed = 0
  bar = _progress(total, f"dataset {index}: {dataset.name}")
  carry_best = tc.get("carry", "last") == "best_validation"
  best = {"AP": -np.inf, "epoch": None, "params": None}
  validation = []
  for epoch in range(num_epochs):
    if step >= total:
      break
    for batch in runner.train_batches(
      dataset.train, batch_size=batch_size, seed=config.seed + index, epoch=epoch
    ):
      if step >= total:
        break
      key, step_key = jax.random.split(key)
      inputs = sharding_lib.shard_batch(_model_inputs(batch), runner.mesh)
      replay = None
      if with_replay:
        active = None
        if new_losses is not None:
          features = new_losses(
            state.params, inputs["images"], inputs["queries"], inputs["labels"], inputs["boxes"]
          )
          # Slot j serves new image j: active iff its loss exceeds l (eq. 5).
          active = features.pop("per_example") > threshold
        elif embed is not None:
          features = embed(state.params, inputs["images"], inputs["queries"])
        else:
          features = {}
        retrieved = retrieve(rstate, buffer, features, num_replay, active)
        indices, valid, rstate = retrieved[:3]
        indices, valid = jax.device_get((indices, valid))
        if recorder is not None:
          recorder.add(jax.device_get(retrieved[3]), valid)
        dedup.check_auto_reset(rstate)
        replay_batch = store.gather(indices, valid)
        replay_batch["replay_mask"] = valid
        replayed += int(valid.sum())
        names = ["images", "queries", "labels", "boxes", "stored_logits", "replay_mask"]
        if active is not None:
          replay_batch["replay_active"] = active
          names.append("replay_active")
        replay = sharding_lib.shard_batch({k: replay_batch[k] for k in names}, runner.mesh)
      state, metrics = train_step(state, inputs, replay, step_key)
      step += 1
      bar.update(1)
      if with_replay:
        replays_in_loss = replays_in_loss + metrics["replays_in_loss"]
        replay_steps = replay_steps + (metrics["replays_in_loss"] > 0).astype(jnp.int32)
      if step % tc.log_every_steps == 0 or step == total:
        metrics = jax.device_get(metrics)
        postfix = {"loss": f"{float(metrics['loss']):.3f}"}
        scalars = dict(metrics, lr=schedule(step))
        if with_replay:
          fractions = _replay_fractions(int(replays_in_loss), int(replay_steps), step, num_replay)
          postfix["replay"] = f"{fractions['replay_samples_fraction']:.0%}"
          scalars.update(fractions)
        bar.set_postfix(**postfix)
        _log_scalars(writer, f"train/{dataset.name}", scalars, step)
    if with_replay:
      rstate = dedup.reset_if(rstate, "epoch", dedup_schedule)
    if carry_best:
      best = _track_best_epoch(
        runner, dataset, state.params, epoch, best, validation, writer, index
      )
  bar.close()
  if with_replay:
    rstate = dedup.reset_if(rstate, "dataset", dedup_schedule)
    if recorder is not None:
      recorder.save(records_path)
  summary = {
    "steps": step,
    "replayed_images": replayed,
    "final_loss": float(jax.device_get(metrics["loss"])) if step else None,
    "settings": settings,
  }
  if with_replay:
    summary.update(
      loss_adaptivity=adaptivity,
      loss_threshold=threshold if adaptivity != "none" else None,
      replay_slots=step * num_replay,
      replays_in_loss=int(replays_in_loss),
      replay_steps=int(replay_steps),
      **_replay_fractions(int(replays_in_loss), int(replay_steps), step, num_replay),
    )
  if carry_best and best["params"] is not None:
    summary.update(carried="best_validation", best_epoch=best["epoch"], validation=validation)
    return best["params"], rstate, summary
  summary["carried"] = "last"
  return jax.device_get(state.params), rstate, summary


def _track_best_epoch(
  runner: Runner,
  dataset: Dataset,
  params,
  epoch: int,
  best: dict,
  validation: list,
  writer,
  index: int,
) -> dict:
  """Evaluates `params` on the dataset's valid split; returns the better of it and `best`.

  The released code's best-validation-epoch carry (SPEC §10): AP on the valid split after
  each epoch; ties keep the earlier epoch; a NaN AP (no annotations) never wins.
  """
  params = jax.device_get(params)
  metrics = runner.evaluate(params, dataset.valid, f"valid {dataset.name} @ epoch {epoch + 1}")
  ap = float(metrics["AP"])
  validation.append({"epoch": epoch + 1, "AP": ap, "AP50": float(metrics["AP50"])})
  _log_scalars(writer, f"valid/{dataset.name}", metrics, epoch + 1)
  logging.info("dataset %d (%s) epoch %d: valid AP %.4f", index, dataset.name, epoch + 1, ap)
  if np.isfinite(ap) and ap > best["AP"]:
    return {"AP": ap, "epoch": epoch + 1, "params": params}
  if best["params"] is None and not np.isfinite(ap):
    return {"AP": best["AP"], "epoch": epoch + 1, "params": params}
  return best


def dataset_train_settings(
  config: ml_collections.ConfigDict, name: str, steps_per_epoch: int
) -> dict:
  """The optimiser settings of one dataset: `train.*` with `train.per_dataset.<name>` applied.

  Args:
    config: the run's config.
    name: the dataset's name (a key of `train.per_dataset`, e.g. 'Pothole').
    steps_per_epoch: optimiser steps per epoch of this dataset (images // batch size).

  Returns:
    {'num_epochs', 'learning_rate', 'text_lr_multiplier', 'layerwise_decay',
     'warmup_steps'}; warmup_steps = warmup_epochs * steps_per_epoch when `warmup_epochs` is
    set (globally or for the dataset; the paper's table gives warmup in epochs), else
    `warmup_steps`. A dataset's `warmup_steps` override wins over a global `warmup_epochs`.

  Raises:
    ConfigError: an unknown field in `train.per_dataset.<name>`.

  Source: the paper's per-dataset hyperparameter table (configs/base.py
  PAPER_HYPERPARAMETERS).
  """
  tc = config.train
  overrides = dict(tc.per_dataset.get(name, {}) or {})
  unknown = sorted(set(overrides) - set(PER_DATASET_FIELDS))
  if unknown:
    raise ConfigError(
      f"config.train.per_dataset.{name}: unknown fields {unknown}; "
      f"allowed: {list(PER_DATASET_FIELDS)}"
    )
  value = lambda field, default=None: overrides.get(field, tc.get(field, default))
  warmup_epochs = value("warmup_epochs")
  if "warmup_steps" in overrides or warmup_epochs is None:
    warmup_steps = int(value("warmup_steps"))
  else:
    warmup_steps = int(warmup_epochs) * steps_per_epoch
  return {
    "num_epochs": int(value("num_epochs")),
    "learning_rate": float(value("learning_rate")),
    "text_lr_multiplier": float(value("text_lr_multiplier")),
    "layerwise_decay": float(value("layerwise_decay")),
    "warmup_steps": warmup_steps,
  }


def loss_adaptivity_mode(config: ml_collections.ConfigDict) -> str:
  """config.replay.loss_adaptivity.mode, checked (SPEC §9). Raises ConfigError if unknown."""
  mode = config.replay.loss_adaptivity.mode
  if mode not in losses.LOSS_ADAPTIVITY_MODES:
    raise ConfigError(
      f"config.replay.loss_adaptivity.mode={mode!r} is unknown; known: "
      f"{list(losses.LOSS_ADAPTIVITY_MODES)}"
    )
  return mode


def _replay_fractions(
  replays_in_loss: int, replay_steps: int, steps: int, num_replay: int
) -> dict[str, float]:
  """The paper's Table 4 figures: fraction of steps with replay, of replay slots used.

  replay_steps_fraction = steps whose loss included at least one replay / steps;
  replay_samples_fraction = replays in the loss / (steps * replays per step) (at 1:1 the
  fraction of new samples that were given a replay, the paper's "Replay %").
  """
  return {
    "replay_steps_fraction": replay_steps / steps if steps else 0.0,
    "replay_samples_fraction": (replays_in_loss / (steps * num_replay) if steps else 0.0),
  }

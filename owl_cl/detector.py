"""The detector of a run: OWL-ViT, its tokenizer and prompts, the mesh and the jitted steps.

`Detector` turns a COCO-format source into model inputs (training batches with the config's
preprocessing and augmentations, query tokens, prompt-ensembled query embeddings) and
evaluates parameters on a source under the COCO or the LVIS protocol.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from owl_cl import config_fields
from owl_cl import config_spec
from owl_cl import distributed
from owl_cl import model as model_lib
from owl_cl import run_spec
from owl_cl.benchmark import EVALUATION_PROTOCOLS
from owl_cl.benchmark import Dataset
from owl_cl.config_fields import ConfigError
from owl_cl.data import coco
from owl_cl.data import input_pipeline
from owl_cl.data import label_ops
from owl_cl.data import mixture
from owl_cl.data import prompts
from owl_cl.data import spec as data_spec
from owl_cl.data.data_spec import DataSpec
from owl_cl.eval import detection
from owl_cl.eval import peers as peers_lib
from owl_cl.eval_spec import EvalSpec
from owl_cl.model import convert
from owl_cl.model import lora as lora_lib
from owl_cl.model import tokenizer as tokenizer_lib
from owl_cl.model.spec import ModelSpec
from owl_cl.replay import spec as replay_spec
from owl_cl.train import optim
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib
from owl_cl.train import step_cache
from owl_cl.train.pretrain_spec import PretrainSpec
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import TrainSpec
from owl_cl.utils import atomic_write_json
from owl_cl.utils import expand_path

# Test-only hook: when this environment variable names a folder, `Detector.evaluate` also
# writes each evaluation's detections there (process 0, `<desc>.json`), so a test can compare
# per-image outputs of two runs (e.g. 1 process vs 2) where the tiny model's AP is 0. Unset
# (always, outside the tests) it costs one environment lookup per evaluation.
DETECTIONS_HOOK_ENV = "OWL_CL_TEST_DETECTIONS_DIR"


def model_fields(config: ml_collections.ConfigDict) -> dict:
  """`create_model` keyword arguments of `config.model` (`ModelSpec.model_fields`: dtype,
  attention, remat, then the overrides, which win; dtype None keeps the variant's).

  Raises:
    ConfigError: a field of `config.model` that breaks its rule (`config_spec.from_config`).
  """
  return config_spec.from_config(ModelSpec, config.model, "model").model_fields()


def frozen_problem(config: ml_collections.ConfigDict) -> str:
  """What is wrong with `config.train.frozen` ('' when fine) that its field rule
  (`optim.frozen_rule`) cannot see: a pattern matching no parameter of the config's model (its
  tree by `jax.eval_shape`, nothing allocated; `optim.frozen_labels`). Call it once the fields
  are valid; an invalid `config.model` is left to its own checks."""
  frozen = tuple(config.train.get("frozen", ()) or ())
  if not frozen:
    return ""
  try:
    model = model_lib.create_model(config.model.variant, **model_fields(config))
  except (ValueError, TypeError, AttributeError):
    return ""
  try:
    optim.frozen_labels(convert.abstract_params(model.config), frozen)
  except ValueError as e:
    return f"config.{e} of model.variant={config.model.variant!r}"
  return ""


def _names(key_path) -> tuple[str, ...]:
  """The names of a `jax.tree_util` key path into a nested dict."""
  return tuple(str(getattr(k, "key", k)) for k in key_path)


def lora_problem(config: ml_collections.ConfigDict) -> str:
  """What is wrong with `config.train.lora` ('' when fine or off) that its field rules cannot
  see: a target regex matching no Dense layer of the config's model (its tree by
  `jax.eval_shape`), or LoRA together with LwF (the teacher's forward would need the adapters'
  dropout rng; not supported). Call it once the fields are valid."""
  options = lora_lib.options_from_config(config.train.get("lora"))
  if options is None:
    return ""
  lwf = config.train.get("lwf")
  if lwf is not None and (lwf.weight or lwf.box_weight):
    return (
      f"config.train.lora.rank={options.rank} with config.train.lwf.weight={lwf.weight} / "
      f"box_weight={lwf.box_weight}: LoRA and LwF do not combine (set one of them off)"
    )
  try:
    model = model_lib.create_model(config.model.variant, **model_fields(config))
  except (ValueError, TypeError, AttributeError):
    return ""
  paths = lora_lib.dense_module_paths(convert.abstract_params(model.config))
  if problem := lora_lib.targets_problem(options.targets, paths):
    return f"config.train.lora.targets: {problem} (model.variant={config.model.variant!r})"
  return ""


class Detector:
  """The detector of a run and everything that turns data into its inputs and outputs.

  Holds the OWL-ViT model, its tokenizer, the prompt templates, the device mesh, the loss
  settings and the jitted prediction steps (cached per protocol); builds training batches
  (`train_batches`) and evaluates parameters (`evaluate`, `evaluate_dataset`). Holds no
  parameters: they are passed to every call.

  Hands out the typed settings of the sections it converts once, at construction
  (`config_spec.from_config`), and reads only those: `run` (`run_spec.RunSpec`, the top-level
  fields), `model_spec` (`model.spec.ModelSpec`), `eval_spec` (`eval_spec.EvalSpec`),
  `data_spec` (`data.data_spec.DataSpec`), `train_spec` (`train.spec.TrainSpec`),
  `loss_spec` (`train.spec.LossSpec`), `pretrain_spec` (`train.pretrain_spec.PretrainSpec`)
  and `replay_spec` (`replay.spec.ReplaySpec`); `loss_options` (the per-image loss's options,
  `LossSpec.per_image_options`) and `real_data` (`config_fields.uses_real_data`) are derived
  from them. The replay setup, the trainer, the pre-trained model's cache entry and the
  experiment read these; `config`, the run's ConfigDict, is kept for the tests that compare it
  and read by no module of the package (tests/test_detector_settings.py checks the source).

  Raises (construction):
    ConfigError: a field of those sections that breaks its rule, a CLIP tokenizer without its
      vocabulary, a tokenizer larger than the model's vocabulary, unknown prompt templates.
  """

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.run = run_spec.run_settings(config)
    self.model_spec = config_spec.from_config(ModelSpec, config.model, "model")
    self.eval_spec = config_spec.from_config(EvalSpec, config.eval, "eval")
    self.data_spec = config_spec.from_config(DataSpec, config.data, "data")
    self.train_spec = config_spec.from_config(TrainSpec, config.train, "train")
    self.loss_spec = config_spec.from_config(LossSpec, config.loss, "loss")
    self.pretrain_spec = config_spec.from_config(PretrainSpec, config.pretrain, "pretrain")
    self.replay_spec = replay_spec.settings(config)
    # The paper's protocol (data.root or a `:paper` config's ODinW list): whether the section
    # holds `odinw_datasets` is the config's, not a typed field's (`uses_real_data`).
    self.real_data = config_fields.uses_real_data(config)
    model_spec = self.model_spec
    self.model = model_lib.create_model(model_spec.variant, **model_spec.model_fields())
    model_config = self.model.config
    # The self-contained tokenizer is sized by the model (vocabulary and context length); the
    # CLIP BPE reads its vocabulary from config.model.tokenizer_vocab_path (docs/reference.md §2).
    tokenizer_kwargs = {}
    if model_spec.tokenizer == "word_hash":
      tokenizer_kwargs = {
        "vocab_size": model_config.vocab_size,
        "context_length": model_config.context_length,
      }
    elif model_spec.tokenizer == "clip":
      problem = config_fields.clip_vocabulary_problem(config)
      if problem:
        raise ConfigError(problem)
      tokenizer_kwargs = {
        "vocab_path": expand_path(model_spec.tokenizer_vocab_path),
        "context_length": model_config.context_length,
      }
    self.tokenizer = tokenizer_lib.get_tokenizer(model_spec.tokenizer, **tokenizer_kwargs)
    if self.tokenizer.vocab_size > model_config.vocab_size:
      raise ConfigError(
        f"config.model.tokenizer={model_spec.tokenizer!r} has {self.tokenizer.vocab_size} "
        f"ids but the model's vocab_size is {model_config.vocab_size}"
      )
    try:
      self.train_templates = prompts.train_templates(self.data_spec.train_prompt_templates)
      self.eval_templates = prompts.eval_templates(self.eval_spec.prompt_templates)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    self.image_size = self.model.config.image_size
    self.mesh = sharding_lib.create_mesh()
    # The per-image loss options of the buffer selection and the loss adaptivity, derived
    # from the loss section's fields (`LossSpec.per_image_options`).
    self.loss_options = self.loss_spec.per_image_options(self.model.config.version)
    self.empty_tokens = self.tokenizer.encode([""])[0]
    # How images become the S x S input: OWLv2 pads to a square, then resizes (HF's and
    # scenic's OWLv2 preprocessing); v1 resizes, then pads (docs/owlv2.md).
    self.resize_method = (
      "pad_then_resize" if self.model.config.version == "owlv2" else "resize_with_pad"
    )
    # The jitted steps are the process's (`step_cache`): a later run with the same model
    # reuses their traces and executables.
    self._text_embed = step_cache.shared(
      ("text_embed", self.model), lambda: step_lib.make_text_embed_step(self.model)
    )
    # LoRA (`train.lora`, docs/lora.md; None: off): fine-tuning trains adapters on the frozen
    # model. `tuned_model` is the model the fine-tuning's eval-mode forwards apply to its
    # parameters (retrieval features, loss adaptivity's pre-forward), `tuned_train_model` the
    # one its train step applies (the adapters' dropout on); both are `model` without LoRA.
    self.lora = lora_lib.options_from_config(dataclasses.asdict(self.train_spec.lora))
    self.tuned_model = self.model
    self.tuned_train_model = self.model
    if self.lora is not None:
      self.tuned_model = lora_lib.lora_model(self.model, self.lora, train=False)
      self.tuned_train_model = lora_lib.lora_model(self.model, self.lora, train=True)
    self._class_frequencies = {}  # source -> float64 [C] images per class (negatives)

  def init_params(self, seed: int):
    size = self.image_size
    images = jnp.zeros((1, size, size, 3), jnp.float32)
    num_queries = self.data_spec.num_queries
    queries = jnp.zeros((1, num_queries, self.tokenizer.context_length), jnp.int32)
    return jax.jit(self.model.init)(jax.random.PRNGKey(seed), images, queries)["params"]

  def add_adapters(self, params, seed: int):
    """`params` with fresh LoRA adapters (`lora.init_adapters`, A drawn from `seed`); `params`
    unchanged when LoRA is off.

    Raises:
      ValueError: `params` already holds adapters, or the targets match no layer.
    """
    if self.lora is None:
      return params
    adapters = lora_lib.init_adapters(self.model, self.lora, jax.random.PRNGKey(seed))
    return lora_lib.combine(params, adapters)

  def model_params(self, params):
    """The parameters of `model` for fine-tuned `params`: LoRA adapters merged into their
    kernels (`lora.merge`; bit-identical to the base while B = 0), else `params` itself."""
    if self.lora is None:
      return params
    flat_keys = jax.tree_util.tree_flatten_with_path(params)[0]
    if not any(lora_lib.is_adapter(_names(p)) for p, _ in flat_keys):
      return params
    return lora_lib.merge(params, self.lora)

  def class_tokens(self, source: coco.CocoSource) -> np.ndarray:
    names = [tokenizer_lib.canonicalize_label(n) for n in source.class_names]
    return self.tokenizer.encode(names)

  def train_class_tokens(self, source: coco.CocoSource) -> np.ndarray:
    """Training query tokens: [C, L] class names (data.train_prompt_templates='none'), or
    [C, P, L] prompts, one drawn per label and image by the pipeline (docs/reference.md §2)."""
    if self.data_spec.train_prompt_templates == "none":
      return self.class_tokens(source)
    return prompts.prompt_tokens(self.tokenizer, source.class_names, self.train_templates)

  def eval_query_embeddings(self, params, source: coco.CocoSource) -> jax.Array:
    """Query embeddings of the source's classes: [C, E] (eval.prompt_templates='none') or
    [P, C, E], one slice per evaluation template (docs/reference.md §2)."""
    if self.eval_spec.prompt_templates == "none":
      return self._text_embed(params, jnp.asarray(self.class_tokens(source)))
    tokens = prompts.prompt_tokens(self.tokenizer, source.class_names, self.eval_templates)
    num_classes, num_templates, length = tokens.shape
    embeddings = self._text_embed(params, jnp.asarray(tokens.reshape(-1, length)))
    return jnp.transpose(embeddings.reshape(num_classes, num_templates, -1), (1, 0, 2))

  def _predict_step(self, *, templates: bool, top_k: int, multi_label: bool):
    """The jitted prediction step (`step.make_predict_step`, or its template-ensemble form),
    shared by every detector of the process with this model and mesh (`step_cache`)."""
    ensemble = self.eval_spec.ensemble if templates else None

    def build():
      if templates:
        return step_lib.make_template_predict_step(
          self.model, self.mesh, top_k=top_k, multi_label=multi_label, ensemble=ensemble
        )
      return step_lib.make_predict_step(self.model, self.mesh, top_k=top_k, multi_label=multi_label)

    key = ("predict", self.model, self.mesh, templates, top_k, multi_label, ensemble)
    return step_cache.shared(key, build)

  def example_spec(self, class_tokens: np.ndarray) -> data_spec.ExampleSpec:
    """The training example of this run with `class_tokens` (int32 [C, L] or [C, P, L]):
    the detector's '' tokens and image size, config.data's num_queries, max_instances and
    num_negatives (`ExampleSpec`; raises its ValueError on token shapes that disagree)."""
    data = self.data_spec
    return data_spec.ExampleSpec(
      class_tokens=class_tokens,
      empty_tokens=self.empty_tokens,
      image_size=self.image_size,
      num_queries=data.num_queries,
      max_instances=data.max_instances,
      num_negatives=data.num_negatives,
    )

  def example_options(self, source) -> dict[str, Any]:
    """Preprocessing options of a training example of `source` from `config.data`:
    `squash` (data.squash_resize), `merge_iou`, and `negative_weights` (float64 [C] images
    per class, when data.negatives_by_frequency; computed once per source); an OWLv2 model
    adds `resize='pad_then_resize'` (its preprocessing, docs/owlv2.md; v1's options are
    unchanged). The same options preprocess the replay buffer's images.

    Source: docs/reference.md §3, §5; input_pipeline.preprocess_train_example.
    """
    data = self.data_spec
    options = {
      "squash": bool(data.squash_resize),
      "merge_iou": None if data.merge_iou is None else float(data.merge_iou),
    }
    if self.resize_method != "resize_with_pad":
      options["resize"] = self.resize_method
    if data.negatives_by_frequency:
      key = getattr(source, "annotation_file", None) or id(source)
      if key not in self._class_frequencies:
        self._class_frequencies[key] = label_ops.class_frequencies(source)
      options["negative_weights"] = self._class_frequencies[key]
    return options

  def augment_options(self) -> dict[str, Any]:
    """scenic's training augmentations from `config.data.augment` (docs/reference.md §5): hflip,
    random_crop (+ area / aspect ranges, minimum kept box area), mosaics (sizes and their
    probabilities; off when `mosaic_sizes` is None).

    Raises:
      ConfigError: mosaic_sizes and mosaic_probs of different lengths.
    """
    augment = self.data_spec.augment
    options = {
      "hflip": bool(augment.hflip),
      "random_crop": bool(augment.random_crop),
      "crop_area_range": tuple(augment.crop_area_range),
      "crop_aspect_ratio_range": tuple(augment.crop_aspect_ratio_range),
      "crop_min_area_fraction": float(augment.crop_min_area_fraction),
    }
    if augment.mosaic_sizes:
      if len(augment.mosaic_sizes) != len(augment.mosaic_probs):
        raise ConfigError(
          f"config.data.augment.mosaic_sizes={tuple(augment.mosaic_sizes)} and "
          f"mosaic_probs={tuple(augment.mosaic_probs)} differ in length"
        )
      options.update(
        mosaic_sizes=tuple(int(k) for k in augment.mosaic_sizes),
        mosaic_probs=tuple(float(p) for p in augment.mosaic_probs),
      )
    return options

  def train_batches(self, source, *, batch_size: int, seed: int, epoch: int, start_batch: int = 0):
    """Training batches of one epoch of `source` (input_pipeline.train_dataset) with the config's
    preprocessing options, augmentations and host sharding (data.host_sharding), from batch
    `start_batch` of the epoch on (a resumed loop).

    In a multi-process run each process reads only its rows of every global batch
    (`sharding_lib.process_rows`), so the processes together see the batches of one process;
    `sharding_lib.shard_batch` assembles them.

    `source` may be a `mixture.JointSource` (the joint schedule): one epoch (0) of its plan,
    each example with its own dataset's queries and preprocessing options (`seed` unused: the
    plan holds each dataset's).

    Raises:
      ValueError: a JointSource with epoch != 0 or another batch size than its plan's."""
    shard: Any = "jax" if self.data_spec.host_sharding else None
    batch_rows = None
    if jax.process_count() > 1:
      rows = sharding_lib.process_rows(batch_size, self.mesh)
      shard, batch_rows = None, (rows.start, rows.stop)
    if isinstance(source, mixture.JointSource):
      if epoch != 0 or batch_size != source.batch_size:
        raise ValueError(
          f"the joint set is one epoch of batches of {source.batch_size}; got epoch {epoch}, "
          f"batch size {batch_size}"
        )
      sources = [part.source for part in source.parts]
      return mixture.joint_train_dataset(
        source,
        [self.example_spec(self.train_class_tokens(s)) for s in sources],
        [dict(self.example_options(s), **self.augment_options()) for s in sources],
        num_workers=self.data_spec.num_workers,
        shard=shard,
        batch_rows=batch_rows,
        start_batch=start_batch,
      )
    return input_pipeline.train_dataset(
      source,
      self.example_spec(self.train_class_tokens(source)),
      batch_size=batch_size,
      seed=seed,
      epoch=epoch,
      num_workers=self.data_spec.num_workers,
      shard=shard,
      batch_rows=batch_rows,
      start_batch=start_batch,
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
    per_class: bool = False,
    return_detections: bool = False,
  ) -> dict[str, float]:
    """AP of `params` on `source`, queries = the source's class names (with `per_class`, also
    'per_class': each class's AP, `detection.per_class_table`; with `return_detections`,
    'detections': the COCO result dicts, `detection.to_coco_detections`).

    protocol 'coco': pycocotools AP, eval.top_k detections (argmax class per token unless
    eval.multi_label). 'lvis': the lvis API's federated AP/APr/APc/APf of the top
    eval.lvis_top_k (token, class) pairs, eval.lvis_max_dets per image, ground truth read
    from `source.annotation_file` (LVIS v1 json). With eval.prompt_templates != 'none' the
    class scores are ensembled over the templates (eval.ensemble). `max_detections`, when
    given, replaces both the detections kept per image and maxDets of that protocol
    (docs/reference.md §4: 100 for EgoHands and BrackishUnderwater). With the test-only
    `DETECTIONS_HOOK_ENV` set to a folder, process 0 also writes the detections (COCO result
    dicts, `detection.to_coco_detections`) to `<folder>/<desc>.json`.
    """
    if protocol not in ("coco", "lvis"):
      raise ValueError(f"protocol must be 'coco' or 'lvis', got {protocol!r}")
    # Evaluation runs the merged model (LoRA: adapters folded into the kernels).
    params = self.model_params(params)
    eval_config = self.eval_spec
    lvis = protocol == "lvis"
    templates = eval_config.prompt_templates != "none"
    top_k = eval_config.lvis_top_k if lvis else eval_config.top_k
    max_dets = eval_config.lvis_max_dets if lvis else eval_config.max_dets
    if max_detections is not None:
      top_k = max_dets = int(max_detections)
    predict_step = self._predict_step(
      templates=templates, top_k=top_k, multi_label=True if lvis else eval_config.multi_label
    )
    query_embeddings = self.eval_query_embeddings(params, source)
    batch_size = self.data_spec.eval_batch_size
    sharding_lib.check_batch_divisible(batch_size, self.mesh, "config.data.eval_batch_size")

    def predict_fn(batch):
      images = sharding_lib.shard_batch({"images": batch["images"]}, self.mesh)["images"]
      return jax.device_get(predict_step(params, images, query_embeddings))

    multi_process = jax.process_count() > 1
    rows = sharding_lib.process_rows(batch_size, self.mesh) if multi_process else None
    batches = input_pipeline.eval_dataset(
      source,
      image_size=self.image_size,
      batch_size=batch_size,
      squash=bool(self.data_spec.squash_resize),
      resize=self.resize_method,
      max_images=self.run.max_eval_images,
      batch_rows=None if rows is None else (rows.start, rows.stop),
    )
    if multi_process:
      batches, predict_fn = self._gathered_predictions(
        batches, lambda images: predict_step(params, images, query_embeddings)
      )
    dump_dir = os.environ.get(DETECTIONS_HOOK_ENV)
    scoring = detection.Scoring(
      protocol=protocol,
      max_dets=max_dets,
      per_class=per_class,
      return_detections=bool(dump_dir) or return_detections,
      coco_backend=self.eval_spec.coco_backend,
      processes=self.eval_spec.scoring_processes,
      # Every process holds the gathered detections: each scores its share of the category
      # shards (the same floats on every process as one pass, `category_shards`).
      peers=peers_lib.jax_peers(),
    )
    result = detection.evaluate_source(
      predict_fn,
      source,
      batches,
      scoring,
      category_ids=source.category_ids,
      image_size=self.image_size,
      desc=desc,
    )
    if dump_dir:
      detections = result["detections"] if return_detections else result.pop("detections")
      if distributed.is_writer():
        name = re.sub(r"[^A-Za-z0-9@._-]+", "_", desc).strip("_")
        atomic_write_json(os.path.join(dump_dir, f"{name}.json"), detections)
    return result

  def _gathered_predictions(self, local_batches, predict):
    """Multi-process evaluation: every process predicts its rows of each global batch, and
    the rows are gathered so AP is computed over the whole eval set (on every process).

    Args:
      local_batches: this process's rows of the eval batches (`input_pipeline.eval_dataset` with
        `batch_rows`): images, image_id, orig_size, example_mask.
      predict: `predict(global images [B, S, S, 3]) -> (scores [B, K], labels [B, K],
        boxes [B, K, 4])`, split along the batch.
    Returns:
      (global batches: image_id, orig_size, example_mask [B] in the order of one process;
      predict_fn(batch) returning that batch's gathered predictions).
    """
    keys = data_spec.EVAL_META_KEYS
    batches, outputs = [], []
    for batch in local_batches:
      images = sharding_lib.shard_batch({"images": batch["images"]}, self.mesh)["images"]
      local = tuple(sharding_lib.host_local_rows(x) for x in predict(images))
      # One gather per batch keeps the rows in the global batch's order (process order is
      # row order: `process_rows`), so the detections reach the scorer as with one process.
      gathered = distributed.gather_rows(({k: batch[k] for k in keys}, local))
      # Padding rows (image_id -1, example_mask False) stay: the scorer drops them, as it
      # does with one process.
      meta, preds = gathered
      batches.append(meta)
      outputs.append(preds)
    by_batch = {id(b): o for b, o in zip(batches, outputs)}
    return batches, lambda batch: by_batch[id(batch)]

  def evaluate_dataset(self, params, dataset: Dataset, desc: str, **options) -> dict[str, float]:
    """Metrics of `params` on `dataset.test`: COCO AP (`dataset.evaluation` 'coco') or LVIS AP /
    APr ('lvis'), with `dataset.max_detections` detections per image when set; `options`:
    `evaluate`'s per_class and return_detections.

    Raises:
      ConfigError: an unknown evaluation protocol.
    """
    if dataset.evaluation not in EVALUATION_PROTOCOLS:
      raise ConfigError(
        f"eval set {dataset.name!r}: unknown evaluation {dataset.evaluation!r} (coco | lvis)"
      )
    return self.evaluate(
      params,
      dataset.test,
      desc,
      protocol=dataset.evaluation,
      max_detections=dataset.max_detections,
      **options,
    )

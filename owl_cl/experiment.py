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
import uuid
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from absl import logging
from tensorboardX import SummaryWriter

from owl_cl import model as model_lib
from owl_cl.data import builtin
from owl_cl.data import coco
from owl_cl.data import pipeline
from owl_cl.eval import detection
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


class ConfigError(ValueError):
  """A config value the run cannot use; the message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One detection dataset of the run: its training and evaluation sources."""
  name: str
  train: coco.CocoSource | None
  test: coco.CocoSource


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """The data of a run: the pre-training set, the held-out classes and the sequence."""
  pretrain: Dataset
  held_out: Dataset
  sequence: tuple[Dataset, ...]
  fingerprint: str


def _digest(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def _expand(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path))


# ----------------------------------------------------------------------------- data


def load_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The built-in benchmark (config.data.root is None), sequence ordered by sequence_seed.

  Raises:
    ConfigError: config.data.root names user data (the paper protocol's real-data sources
      are configured by the `:paper` configs).
  """
  if config.data.root is not None:
    raise ConfigError(
        f"config.data.root={config.data.root!r}: this config runs the built-in benchmark; "
        "leave data.root unset")
  bc = config.data.builtin
  bench = builtin.ensure_benchmark(
      os.path.join(_expand(config.cache_dir), "builtin"), seed=bc.seed,
      num_pretrain_train=bc.num_pretrain_train, num_pretrain_val=bc.num_pretrain_val,
      num_held_out_val=bc.num_held_out_val, num_downstream_train=bc.num_downstream_train,
      num_downstream_test=bc.num_downstream_test, downstream=tuple(bc.downstream))
  pretrain = Dataset("pretrain", bench.pretrain_train.source(), bench.pretrain_val.source())
  held_out = Dataset(HELD_OUT_EVAL, None, bench.held_out_val.source())
  sequence = [Dataset(d.name, d.train.source(), d.test.source()) for d in bench.downstream]
  if config.sequence_seed is not None:
    order = np.random.default_rng(config.sequence_seed).permutation(len(sequence))
    sequence = [sequence[i] for i in order]
  return Benchmark(pretrain, held_out, tuple(sequence), fingerprint=bench.fingerprint)


# ----------------------------------------------------------------------------- helpers


class Runner:
  """Holds the static pieces of a run (model, tokenizer, mesh, jitted steps)."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.model = model_lib.create_model(config.model.variant, **dict(config.model.overrides))
    model_config = self.model.config
    # The self-contained tokenizer is sized by the model (vocabulary and context length).
    tokenizer_kwargs = ({"vocab_size": model_config.vocab_size,
                         "context_length": model_config.context_length}
                        if config.model.tokenizer == "word_hash" else {})
    self.tokenizer = tokenizer_lib.get_tokenizer(config.model.tokenizer, **tokenizer_kwargs)
    self.image_size = self.model.config.image_size
    self.mesh = sharding_lib.create_mesh()
    self.loss_config = dict(
        focal_alpha=config.loss.focal_alpha, focal_gamma=config.loss.focal_gamma,
        class_weight=config.loss.class_weight, bbox_weight=config.loss.bbox_weight,
        giou_weight=config.loss.giou_weight)
    self.empty_tokens = self.tokenizer.encode([""])[0]
    self._predict = step_lib.make_predict_step(
        self.model, self.mesh, top_k=config.eval.top_k, multi_label=config.eval.multi_label)
    self._text_embed = step_lib.make_text_embed_step(self.model)

  def init_params(self, seed: int):
    size = self.image_size
    images = jnp.zeros((1, size, size, 3), jnp.float32)
    queries = jnp.zeros((1, self.config.data.num_queries, self.tokenizer.context_length),
                        jnp.int32)
    return jax.jit(self.model.init)(jax.random.PRNGKey(seed), images, queries)["params"]

  def class_tokens(self, source: coco.CocoSource) -> np.ndarray:
    names = [tokenizer_lib.canonicalize_label(n) for n in source.class_names]
    return self.tokenizer.encode(names)

  def train_batches(self, source, *, batch_size: int, seed: int, epoch: int):
    return pipeline.train_dataset(
        source, class_tokens=self.class_tokens(source), empty_tokens=self.empty_tokens,
        image_size=self.image_size, num_queries=self.config.data.num_queries,
        max_instances=self.config.data.max_instances,
        num_negatives=self.config.data.num_negatives, batch_size=batch_size, seed=seed,
        epoch=epoch, num_workers=self.config.data.num_workers)

  def evaluate(self, params, source: coco.CocoSource, desc: str) -> dict[str, float]:
    """COCO AP of `params` on `source`, queries = the source's class names (SPEC §4)."""
    query_embeddings = self._text_embed(params, jnp.asarray(self.class_tokens(source)))
    batch_size = self.config.data.eval_batch_size
    sharding_lib.check_batch_divisible(batch_size, self.mesh, "config.data.eval_batch_size")

    def predict_fn(batch):
      images = sharding_lib.shard_batch({"images": batch["images"]}, self.mesh)["images"]
      return jax.device_get(self._predict(params, images, query_embeddings))

    batches = pipeline.eval_dataset(source, image_size=self.image_size,
                                    batch_size=batch_size,
                                    max_images=self.config.max_eval_images)
    return detection.evaluate_source(
        predict_fn, source, batches, category_ids=source.category_ids,
        image_size=self.image_size, max_dets=self.config.eval.max_dets, desc=desc)


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
      params, learning_rate=pc.learning_rate, total_steps=pc.num_steps,
      warmup_steps=pc.warmup_steps, text_lr_multiplier=pc.text_lr_multiplier,
      layerwise_decay=pc.layerwise_decay, weight_decay=pc.weight_decay,
      b1=config.train.b1, b2=config.train.b2, eps=config.train.eps,
      grad_clip_norm=config.train.grad_clip_norm)
  train_step = step_lib.make_train_step(runner.model, tx, runner.mesh,
                                        loss_config=runner.loss_config, with_replay=False,
                                        max_unique_queries=pc.max_unique_queries)
  state = sharding_lib.replicate(step_lib.create_train_state(params, tx), runner.mesh)
  key = jax.random.PRNGKey(config.seed + 1)
  curve = []
  step = 0
  epoch = 0
  start = time.time()
  bar = _progress(pc.num_steps, "pre-training")
  while step < pc.num_steps:
    for batch in runner.train_batches(bench.pretrain.train, batch_size=pc.batch_size,
                                      seed=config.seed, epoch=epoch):
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
        curve.append({"step": step, "seconds": round(time.time() - start, 1),
                      "loss": float(metrics["loss"])})
      if pc.eval_every_steps and step % pc.eval_every_steps == 0 and step < pc.num_steps:
        params_now = jax.device_get(state.params)
        val = runner.evaluate(params_now, bench.pretrain.test, f"pre-training val @ {step}")
        if not curve or curve[-1]["step"] != step:
          curve.append({"step": step})
        curve[-1].update(seconds=round(time.time() - start, 1), val_AP=val["AP"],
                         val_AP50=val["AP50"])
        _log_scalars(workdir_writer, "pretrain_val", val, step)
        logging.info("pre-training step %d: validation AP50 %.3f AP %.3f", step,
                     val["AP50"], val["AP"])
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
    params, meta = checkpointing.load_params(_expand(config.init_checkpoint), like)
    return params, meta
  key = _digest({"model": config.model.to_dict(), "pretrain": config.pretrain.to_dict(),
                 "data": {k: v for k, v in config.data.to_dict().items()
                          if k in ("num_queries", "num_negatives", "max_instances")},
                 "loss": config.loss.to_dict(), "seed": config.seed,
                 "pretrain_data": _file_digest(bench.pretrain.train.annotation_file),
                 "train_opt": [config.train.b1,
                 config.train.b2, config.train.eps, config.train.grad_clip_norm]})
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
    raise ConfigError(f"config.replay.algorithm={name!r} is unknown; known: "
                      f"{sorted(algorithms.ALGORITHMS) + ['none']}")
  fields = {
      "swil_weight": ("replay.swil_w", rc.swil_w),
      "grasp_weight": ("replay.grasp_w", rc.grasp_w),
      "balanced_order": ("replay.balanced_order", rc.balanced_order),
      "adaptive_entropy_threshold": ("replay.adaptive_entropy_threshold",
                                     rc.adaptive_entropy_threshold),
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
    schedule = (dedup.DedupSchedule("fraction", rc.dedup_fraction) if rc.dedup == "fraction"
                else dedup.as_schedule(rc.dedup))
    return algorithms.get_algorithm(name, dedup=schedule, **hyperparameters)
  except ValueError as e:
    raise ConfigError(f"config.replay ({name}): {e}") from e


def replay_buffer(runner: Runner, bench: Benchmark, params, pretrain_meta: dict):
  """The replay store over the pre-training set (cached; SPEC §6). Returns (store, stats)."""
  config = runner.config
  bc = config.replay.buffer
  source = bench.pretrain.train
  data = config.data
  key_material = {
      "model": pretrain_meta.get("cache_key") or config.init_checkpoint,
      "pretrain_data": _file_digest(source.annotation_file), "buffer": bc.to_dict(),
      "top_k": config.replay.top_k,
      "data": [data.num_queries, data.num_negatives, data.max_instances],
      "loss": config.loss.to_dict(), "seed": config.seed, "format": 1}
  build = lambda: buffer_build.build_store(
      runner.model, params, source, class_tokens=runner.class_tokens(source),
      empty_tokens=runner.empty_tokens, image_size=runner.image_size,
      num_queries=data.num_queries, max_instances=data.max_instances,
      num_negatives=data.num_negatives, seed=config.seed,
      loss_threshold=bc.loss_threshold, min_per_class=bc.min_per_class,
      fill_all_for_rare_classes=bc.fill_all_for_rare_classes, top_k=config.replay.top_k,
      max_per_class=bc.max_instances_per_prototype, loss_config=runner.loss_config,
      batch_size=data.eval_batch_size)
  return buffer_build.cached_store(
      os.path.join(_expand(config.cache_dir), "buffers"), key_material, build)


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
      changed = sorted(k for k in set(existing.get("config", {})) | set(config_json)
                       if existing.get("config", {}).get(k) != config_json.get(k))
      raise ConfigError(
          f"workdir {workdir} holds a run of a different config (differing fields: "
          f"{changed}); use another --workdir or the same config to resume it")
    return existing["run_id"]
  run_id = uuid.uuid4().hex
  tmp = run_file + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"run_id": run_id, "config": config_json}, f, indent=2, sort_keys=True)
  os.replace(tmp, run_file)
  return run_id


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
  loss_adaptivity_mode(config)   # a bad mode fails before any work
  run_id = _check_workdir(workdir, config)
  wall_start = time.time()
  bench = load_benchmark(config)
  runner = Runner(config)
  writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
  checkpointer = checkpointing.StageCheckpointer(os.path.join(workdir, "checkpoints"),
                                                 max_to_keep=config.checkpoint.max_to_keep)
  algorithm_name = config.replay.algorithm
  with_replay = algorithm_name != "none"

  params, pretrain_meta = pretrained_params(runner, bench, writer)
  store, buffer_stats = None, None
  if with_replay:
    store, buffer_stats = replay_buffer(runner, bench, params, pretrain_meta)
  eval_sets = [(PRETRAIN_EVAL, bench.pretrain.test), (HELD_OUT_EVAL, bench.held_out.test)]
  eval_sets += [(d.name, d.test) for d in bench.sequence]

  def evaluate_all(params, stage_name):
    return {name: runner.evaluate(params, source, f"eval {name} @ {stage_name}")
            for name, source in eval_sets}

  rstate = replay_state_lib.init_replay_state(
      store.num_images if store else 1, jax.random.PRNGKey(config.seed + 2),
      num_classes=store.num_classes if store else 0)
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
        "run_id": run_id, "status": status, "algorithm": config.experiment_name,
        "retrieval": algorithm_name, "seed": config.seed,
        "sequence": [d.name for d in bench.sequence],
        "eval_sets": {"pretrain": PRETRAIN_EVAL, "held_out": HELD_OUT_EVAL,
                      "downstream": [d.name for d in bench.sequence]},
        "stages": stages, "config": json.loads(config.to_json_best_effort()),
        "pretraining": {k: pretrain_meta.get(k) for k in ("seconds", "curve", "validation")},
        "timings": dict(timings, wall_seconds=round(time.time() - wall_start, 1)),
        "buffer": buffer_stats,
    }
    results_lib.write_results(workdir, results)
    return results

  write("running")
  for index in range(latest + 1, len(bench.sequence) + 1):
    dataset = bench.sequence[index - 1]
    start = time.time()
    params, rstate, train_metrics = train_on_dataset(
        runner, dataset, params, store, rstate, writer, index,
        records_path=os.path.join(workdir, "records", f"{dataset.name}.npz"))
    metrics = evaluate_all(params, dataset.name)
    for name, values in metrics.items():
      _log_scalars(writer, f"eval/{name}", values, index)
    stages.append({"name": dataset.name, "metrics": metrics, "train": train_metrics,
                   "seconds": round(time.time() - start, 1)})
    checkpointer.save(index, params, rstate, {"stages": stages})
    write("running")
  results = write("complete")
  writer.close()
  checkpointer.close()
  logging.info("results: %s", os.path.join(workdir, "results.md"))
  return results


def train_on_dataset(runner: Runner, dataset: Dataset, params, store, rstate, writer,
                     index: int, records_path: Optional[str] = None):
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
    raise ConfigError(f"dataset {dataset.name} has {len(dataset.train)} training images, "
                      f"fewer than config.train.batch_size={batch_size}")
  total = steps_per_epoch * tc.num_epochs
  if config.max_train_steps_per_dataset:
    total = min(total, config.max_train_steps_per_dataset)
  tx, schedule = optim.create_optimizer(
      params, learning_rate=tc.learning_rate, total_steps=total, warmup_steps=tc.warmup_steps,
      text_lr_multiplier=tc.text_lr_multiplier, layerwise_decay=tc.layerwise_decay,
      b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay,
      grad_clip_norm=tc.grad_clip_norm)
  with_replay = store is not None
  adaptivity = loss_adaptivity_mode(config) if with_replay else "none"
  threshold = float(config.replay.loss_adaptivity.threshold)
  train_step = step_lib.make_train_step(
      runner.model, tx, runner.mesh, loss_config=runner.loss_config,
      alpha=config.replay.der_alpha, beta=config.replay.der_beta, with_replay=with_replay,
      max_unique_queries=tc.max_unique_queries, loss_adaptivity=adaptivity,
      loss_threshold=threshold)
  state = sharding_lib.replicate(step_lib.create_train_state(params, tx), runner.mesh)
  if with_replay:
    num_replay = max(1, int(round(config.replay.ratio * batch_size)))
    sharding_lib.check_batch_divisible(num_replay, runner.mesh, "replay batch (ratio * batch)")
    if adaptivity == "paper" and num_replay != batch_size:
      raise ConfigError(
          f"config.replay.loss_adaptivity.mode='paper' replays one image per new image above "
          f"the threshold and needs config.replay.ratio=1.0, got {config.replay.ratio}")
    algorithm = make_algorithm(config)
    recorder = None
    if config.replay.records and records_path:
      recorder = records_lib.RetrievalRecords(store.num_classes,
                                              getattr(algorithm, "num_candidates", 0))
      retrieve = jax.jit(algorithm.retrieve_with_records, static_argnums=3)
    else:
      retrieve = jax.jit(algorithm, static_argnums=3)
    dedup_schedule = algorithm.dedup
    buffer = sharding_lib.replicate(store.replay_buffer(), runner.mesh)
    rstate = algorithm.prepare(rstate, buffer)
    top_k = config.replay.top_k if algorithm.needs_features else None
    # 'paper': one eval-mode forward gives the new images' losses (and the features).
    new_losses = (step_lib.make_new_loss_step(runner.model, runner.mesh,
                                              loss_config=runner.loss_config, k=top_k)
                  if adaptivity == "paper" else None)
    embed = (step_lib.make_embed_step(runner.model, runner.mesh, k=top_k)
             if top_k and new_losses is None else None)
    # Device-side counters (no host sync per step): replays that entered the loss, steps
    # with at least one.
    replays_in_loss = jnp.zeros((), jnp.int32)
    replay_steps = jnp.zeros((), jnp.int32)
  key = jax.random.PRNGKey(config.seed * 1000 + index)
  step = 0
  replayed = 0
  bar = _progress(total, f"dataset {index}: {dataset.name}")
  for epoch in range(tc.num_epochs):
    if step >= total:
      break
    for batch in runner.train_batches(dataset.train, batch_size=batch_size,
                                      seed=config.seed + index, epoch=epoch):
      if step >= total:
        break
      key, step_key = jax.random.split(key)
      inputs = sharding_lib.shard_batch(_model_inputs(batch), runner.mesh)
      replay = None
      if with_replay:
        active = None
        if new_losses is not None:
          features = new_losses(state.params, inputs["images"], inputs["queries"],
                                inputs["labels"], inputs["boxes"])
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
          replay_batch["replay_active"] = np.asarray(jax.device_get(active), bool)
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
          fractions = _replay_fractions(int(replays_in_loss), int(replay_steps), step,
                                        num_replay)
          postfix["replay"] = f"{fractions['replay_samples_fraction']:.0%}"
          scalars.update(fractions)
        bar.set_postfix(**postfix)
        _log_scalars(writer, f"train/{dataset.name}", scalars, step)
    if with_replay:
      rstate = dedup.reset_if(rstate, "epoch", dedup_schedule)
  bar.close()
  if with_replay:
    rstate = dedup.reset_if(rstate, "dataset", dedup_schedule)
    if recorder is not None:
      recorder.save(records_path)
  summary = {"steps": step, "replayed_images": replayed,
             "final_loss": float(jax.device_get(metrics["loss"])) if step else None}
  if with_replay:
    summary.update(loss_adaptivity=adaptivity,
                   loss_threshold=threshold if adaptivity != "none" else None,
                   replay_slots=step * num_replay, replays_in_loss=int(replays_in_loss),
                   replay_steps=int(replay_steps),
                   **_replay_fractions(int(replays_in_loss), int(replay_steps), step,
                                       num_replay))
  return jax.device_get(state.params), rstate, summary


def loss_adaptivity_mode(config: ml_collections.ConfigDict) -> str:
  """config.replay.loss_adaptivity.mode, checked (SPEC §9). Raises ConfigError if unknown."""
  mode = config.replay.loss_adaptivity.mode
  if mode not in losses.LOSS_ADAPTIVITY_MODES:
    raise ConfigError(f"config.replay.loss_adaptivity.mode={mode!r} is unknown; known: "
                      f"{list(losses.LOSS_ADAPTIVITY_MODES)}")
  return mode


def _replay_fractions(replays_in_loss: int, replay_steps: int, steps: int,
                      num_replay: int) -> dict[str, float]:
  """The paper's Table 4 figures: fraction of steps with replay, of replay slots used.

  replay_steps_fraction = steps whose loss included at least one replay / steps;
  replay_samples_fraction = replays in the loss / (steps * replays per step) (at 1:1 the
  fraction of new samples that were given a replay, the paper's "Replay %").
  """
  return {"replay_steps_fraction": replay_steps / steps if steps else 0.0,
          "replay_samples_fraction": (replays_in_loss / (steps * num_replay)
                                      if steps else 0.0)}

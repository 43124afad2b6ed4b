"""The training loop: one step loop for pre-training and for every downstream dataset.

`train_loop` runs the steps of one training phase over an explicit `LoopState` (train state,
replay state, step, epoch, PRNG key, replay counters). Replay sits behind one object
(`owl_cl.replay.setup.Replay`, or `NoReplay` without it), so the loop has no replay
branches; what differs between the phases (logging, validation during pre-training, the
best-epoch carry of a dataset) is passed in as callbacks.

- `pretrain`: the model from scratch on the pre-training set (built-in benchmark only).
- `train_on_dataset`: fine-tuning on one downstream dataset with retrieval + DER++.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import itertools
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tensorboardX import SummaryWriter
import tqdm

from owl_cl.benchmark import Benchmark
from owl_cl.benchmark import Dataset
from owl_cl.detector import Detector
from owl_cl.replay import setup as replay_setup
from owl_cl.train import optim
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib
from owl_cl.validation import ConfigError
from owl_cl.validation import check_per_dataset_fields

# The arrays a train step consumes (a batch also holds host-side bookkeeping such as image ids).
MODEL_INPUTS = ("images", "queries", "labels", "boxes")


class TrainingDivergedError(RuntimeError):
  """A non-finite loss or gradient norm; the message names the phase, step and value."""


# Host metrics checked for finiteness at every logged step (`check_finite`).
GUARDED_METRICS = ("loss", "grad_norm")


def check_finite(metrics: dict, desc: str, step: int, learning_rate: float | None) -> None:
  """Raises TrainingDivergedError if a GUARDED_METRICS entry of `metrics` is NaN or inf.

  Checked on the metrics the loop already fetches to the host (every
  `train.log_every_steps` steps and the last one), so the guard adds no device sync: a
  divergence is caught at most `log_every_steps - 1` steps late (a NaN stays NaN: the
  parameters it reached are NaN too).

  Args:
    metrics: host metrics of one step.
    desc: the phase, e.g. 'dataset 2: negative' or 'pre-training'.
    step: the step within the phase (1-based).
    learning_rate: the phase's peak learning rate (for the hint), None when unknown.
  """
  for name in GUARDED_METRICS:
    if name not in metrics:
      continue
    value = float(np.asarray(metrics[name]))
    if not np.isfinite(value):
      lr = f" (now {learning_rate:g})" if learning_rate is not None else ""
      raise TrainingDivergedError(
        f"training diverged in {desc} at step {step}: {name} = {value}; the run stops "
        f"here (results.json stays 'running', the last finished dataset's checkpoint is "
        f"kept). Try a lower learning rate{lr}, a longer warmup, or gradient clipping "
        "(config.train.grad_clip_norm), in a new --workdir (this one holds this config's run)"
      )


@dataclasses.dataclass
class LoopState:
  """Everything the step loop carries from one step to the next.

  train_state: `step_lib.TrainState` (params, optimizer state), replicated on the mesh.
  replay_state: `ReplayState` (retrieval counters and PRNG key; a 1-image placeholder
    without replay).
  key: PRNG key of the train steps (split once per step: dropout / query sampling).
  step, epoch: steps taken in this phase, and the current epoch (0-based).
  replays_in_loss, replay_steps: int32 [] device counters (no host sync per step) of the
    replays that entered the loss and of the steps with at least one.
  replayed: valid replay slots retrieved (host int).
  """

  train_state: Any
  replay_state: Any
  key: jax.Array
  step: int = 0
  epoch: int = 0
  replays_in_loss: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
  replay_steps: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
  replayed: int = 0


def progress(total: int, desc: str):
  """A tqdm progress bar over `total` steps, refreshed at most every 2 s."""
  return tqdm.tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0)


def log_scalars(writer: SummaryWriter | None, prefix: str, metrics: dict, step: int) -> None:
  """Writes the finite scalar entries of `metrics` as `<prefix>/<name>` TensorBoard scalars."""
  if writer is None:
    return
  for name, value in metrics.items():
    if np.ndim(value) == 0 and np.isfinite(float(value)):
      writer.add_scalar(f"{prefix}/{name}", float(value), step)


def make_optimizer(params, optimizer: dict, total_steps: int, config: ml_collections.ConfigDict):
  """AdamW of one phase (`optim.create_optimizer`). Returns (tx, learning-rate schedule).

  `optimizer` holds the phase's learning_rate, warmup_steps, text_lr_multiplier,
  layerwise_decay, weight_decay and layerwise_granularity; Adam's b1 / b2 / eps and the
  gradient clipping come from `config.train` for every phase.
  """
  train = config.train
  return optim.create_optimizer(
    params,
    total_steps=total_steps,
    b1=train.b1,
    b2=train.b2,
    eps=train.eps,
    grad_clip_norm=train.grad_clip_norm,
    **optimizer,
  )


def train_loop(
  detector: Detector,
  loop: LoopState,
  *,
  train_step: Callable,
  replay,
  source,
  batch_size: int,
  data_seed: int,
  total_steps: int,
  num_epochs: int | None,
  desc: str,
  on_log: Callable[[LoopState, dict], dict],
  after_step: Callable[[LoopState], None] = lambda loop: None,
  after_epoch: Callable[[LoopState], LoopState] = lambda loop: loop,
  learning_rate: float | None = None,
) -> tuple[LoopState, dict | None]:
  """Runs train steps until `total_steps` (or `num_epochs` epochs; None = as many as needed).

  Per step: split the key, shard the batch, the replayed inputs (`replay.step_inputs`), the
  train step, the replay counters; every `train.log_every_steps` steps and at the last one
  `on_log(loop, host metrics)` returns the progress bar's fields. `after_step(loop)` runs
  after every step, `after_epoch(loop)` after every epoch that ran at least one step.
  `learning_rate` (the phase's peak) only enters the divergence message.

  Returns:
    (the loop state after the last step, the last step's metrics; None when no step ran).

  Raises:
    TrainingDivergedError: a non-finite loss or gradient norm at a logged step
      (`check_finite`).
  """
  log_every = detector.config.train.log_every_steps
  bar = progress(total_steps, desc)
  metrics = None
  epochs = itertools.count() if num_epochs is None else range(num_epochs)
  for epoch in epochs:
    if loop.step >= total_steps:
      break
    loop.epoch = epoch
    for batch in detector.train_batches(source, batch_size=batch_size, seed=data_seed, epoch=epoch):
      if loop.step >= total_steps:
        break
      loop.key, step_key = jax.random.split(loop.key)
      inputs = sharding_lib.shard_batch({k: batch[k] for k in MODEL_INPUTS}, detector.mesh)
      loop, replay_inputs = replay.step_inputs(loop, inputs)
      loop.train_state, metrics = train_step(loop.train_state, inputs, replay_inputs, step_key)
      loop.step += 1
      bar.update(1)
      loop = replay.count(loop, metrics)
      if loop.step % log_every == 0 or loop.step == total_steps:
        host_metrics = sharding_lib.fetch_replicated(metrics)
        check_finite(host_metrics, desc, loop.step, learning_rate)
        bar.set_postfix(**on_log(loop, host_metrics))
      after_step(loop)
    loop = after_epoch(loop)
  bar.close()
  return loop, metrics


# ----------------------------------------------------------------------------- pre-training


def pretrain(detector: Detector, bench: Benchmark, writer: SummaryWriter | None):
  """Pre-trains the model from scratch on the pre-training set. Returns (params, curve).

  curve: [{'step', 'seconds', 'loss'} every `train.log_every_steps` steps, with 'val_AP' /
  'val_AP50' every `pretrain.eval_every_steps` steps].
  """
  config = detector.config
  settings = config.pretrain
  sharding_lib.check_batch_divisible(
    settings.batch_size, detector.mesh, "config.pretrain.batch_size"
  )
  params = detector.init_params(config.seed)
  optimizer = {
    name: settings[name]
    for name in (
      "learning_rate",
      "warmup_steps",
      "text_lr_multiplier",
      "layerwise_decay",
      "weight_decay",
    )
  }
  tx, schedule = make_optimizer(params, optimizer, settings.num_steps, config)
  train_step = step_lib.make_train_step(
    detector.model,
    tx,
    detector.mesh,
    loss_config=detector.loss_config,
    with_replay=False,
    max_unique_queries=settings.max_unique_queries,
  )
  loop = LoopState(
    train_state=sharding_lib.replicate(step_lib.create_train_state(params, tx), detector.mesh),
    replay_state=None,
    key=jax.random.PRNGKey(config.seed + 1),
  )
  curve = []
  start = time.time()

  def on_log(loop, metrics):
    log_scalars(writer, "pretrain", dict(metrics, lr=schedule(loop.step)), loop.step)
    seconds = round(time.time() - start, 1)
    curve.append({"step": loop.step, "seconds": seconds, "loss": float(metrics["loss"])})
    return {"loss": f"{float(metrics['loss']):.3f}"}

  def after_step(loop):
    every = settings.eval_every_steps
    if not every or loop.step % every or loop.step >= settings.num_steps:
      return
    params_now = sharding_lib.fetch_replicated(loop.train_state.params)
    val = detector.evaluate(params_now, bench.pretrain.test, f"pre-training val @ {loop.step}")
    if not curve or curve[-1]["step"] != loop.step:
      curve.append({"step": loop.step})
    curve[-1].update(seconds=round(time.time() - start, 1), val_AP=val["AP"], val_AP50=val["AP50"])
    log_scalars(writer, "pretrain_val", val, loop.step)
    logging.info(
      "pre-training step %d: validation AP50 %.3f AP %.3f", loop.step, val["AP50"], val["AP"]
    )

  loop, _ = train_loop(
    detector,
    loop,
    train_step=train_step,
    replay=replay_setup.NoReplay(),
    source=bench.pretrain.train,
    batch_size=settings.batch_size,
    data_seed=config.seed,
    total_steps=settings.num_steps,
    num_epochs=None,
    desc="pre-training",
    on_log=on_log,
    after_step=after_step,
    learning_rate=settings.learning_rate,
  )
  return sharding_lib.fetch_replicated(loop.train_state.params), curve


# ----------------------------------------------------------------------------- one dataset


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
  train = config.train
  overrides = check_per_dataset_fields(config, name)
  value = lambda field, default=None: overrides.get(field, train.get(field, default))
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


def track_best_epoch(
  detector: Detector,
  dataset: Dataset,
  params,
  epoch: int,
  best: dict,
  validation: list,
  writer,
  index: int,
) -> dict:
  """Evaluates `params` on the dataset's valid split; returns the better of it and `best`.

  The released code's best-validation-epoch carry: AP on the valid split after each epoch;
  ties keep the earlier epoch; a NaN AP (no annotations) never wins.
  """
  params = sharding_lib.fetch_replicated(params)
  metrics = detector.evaluate(params, dataset.valid, f"valid {dataset.name} @ epoch {epoch + 1}")
  ap = float(metrics["AP"])
  validation.append({"epoch": epoch + 1, "AP": ap, "AP50": float(metrics["AP50"])})
  log_scalars(writer, f"valid/{dataset.name}", metrics, epoch + 1)
  logging.info("dataset %d (%s) epoch %d: valid AP %.4f", index, dataset.name, epoch + 1, ap)
  if np.isfinite(ap) and ap > best["AP"]:
    return {"AP": ap, "epoch": epoch + 1, "params": params}
  if best["params"] is None and not np.isfinite(ap):
    return {"AP": best["AP"], "epoch": epoch + 1, "params": params}
  return best


def train_on_dataset(
  detector: Detector,
  dataset: Dataset,
  params,
  store,
  replay_state,
  writer,
  index: int,
  records_path: str | None = None,
):
  """Fine-tunes on one downstream dataset with retrieval + DER++ (fresh optimizer).

  `store` is the replay store (None: retrieval 'none'). With `config.replay.records` and a
  `records_path`, the retrieval analysis records (`owl_cl.replay.records`) of the dataset
  are written there.

  Returns:
    (params, replay state, training summary dict for results.json).

  Raises:
    ConfigError: a dataset with fewer training images than one batch.
  """
  config = detector.config
  batch_size = config.train.batch_size
  sharding_lib.check_batch_divisible(batch_size, detector.mesh, "config.train.batch_size")
  steps_per_epoch = len(dataset.train) // batch_size
  if steps_per_epoch < 1:
    raise ConfigError(
      f"dataset {dataset.name} has {len(dataset.train)} training images, "
      f"fewer than config.train.batch_size={batch_size}"
    )
  settings = dataset_train_settings(config, dataset.name, steps_per_epoch)
  total = steps_per_epoch * settings["num_epochs"]
  if config.max_train_steps_per_dataset:
    total = min(total, config.max_train_steps_per_dataset)
  optimizer = {k: v for k, v in settings.items() if k != "num_epochs"}
  optimizer.update(
    layerwise_granularity=config.train.get("layerwise_granularity", "layer"),
    weight_decay=config.train.weight_decay,
  )
  tx, schedule = make_optimizer(params, optimizer, total, config)
  replay = replay_setup.make_replay(detector, store, records_path)
  train_step = step_lib.make_train_step(
    detector.model,
    tx,
    detector.mesh,
    # The normalisation applies to fine-tuning only (pre-training and the buffer's per-image
    # losses stay per image).
    loss_config=dict(detector.loss_config, normalization=config.loss.normalization),
    max_unique_queries=config.train.max_unique_queries,
    **replay.train_step_options,
  )
  loop = LoopState(
    train_state=sharding_lib.replicate(step_lib.create_train_state(params, tx), detector.mesh),
    replay_state=replay_state,
    key=jax.random.PRNGKey(config.seed * 1000 + index),
  )
  loop = replay.prepare(loop)
  carry_best = config.train.get("carry", "last") == "best_validation"
  best = {"AP": -np.inf, "epoch": None, "params": None}
  validation = []

  def on_log(loop, metrics):
    postfix, replay_scalars = replay.log(loop)
    scalars = dict(metrics, lr=schedule(loop.step), **replay_scalars)
    log_scalars(writer, f"train/{dataset.name}", scalars, loop.step)
    return {"loss": f"{float(metrics['loss']):.3f}", **postfix}

  def after_epoch(loop):
    nonlocal best
    loop = replay.end_epoch(loop)
    if carry_best:
      best = track_best_epoch(
        detector, dataset, loop.train_state.params, loop.epoch, best, validation, writer, index
      )
    return loop

  loop, metrics = train_loop(
    detector,
    loop,
    train_step=train_step,
    replay=replay,
    source=dataset.train,
    batch_size=batch_size,
    data_seed=config.seed + index,
    total_steps=total,
    num_epochs=settings["num_epochs"],
    desc=f"dataset {index}: {dataset.name}",
    on_log=on_log,
    after_epoch=after_epoch,
    learning_rate=settings["learning_rate"],
  )
  loop = replay.end_dataset(loop)
  summary = {
    "steps": loop.step,
    "replayed_images": loop.replayed,
    "final_loss": float(sharding_lib.fetch_replicated(metrics["loss"])) if loop.step else None,
    "settings": settings,
    **replay.summary(loop),
  }
  if carry_best and best["params"] is not None:
    summary.update(carried="best_validation", best_epoch=best["epoch"], validation=validation)
    return best["params"], loop.replay_state, summary
  summary["carried"] = "last"
  return sharding_lib.fetch_replicated(loop.train_state.params), loop.replay_state, summary

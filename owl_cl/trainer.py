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
import functools
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

from owl_cl import preemption
from owl_cl.benchmark import Benchmark
from owl_cl.benchmark import Dataset
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import check_per_dataset_fields
from owl_cl.config_fields import seed_of
from owl_cl.data.spec import MODEL_INPUT_KEYS
from owl_cl.detector import Detector
from owl_cl.model import lora as lora_lib
from owl_cl.replay import setup as replay_setup
from owl_cl.train import optim
from owl_cl.train import prefetch
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib
from owl_cl.train import timing

# The arrays a train step consumes (a batch also holds host-side bookkeeping such as image ids).
MODEL_INPUTS = MODEL_INPUT_KEYS


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
  """Everything the step loop carries from one step to the next (and a step checkpoint holds).

  train_state: `step_lib.TrainState` (params, optimizer state and its step, which drives the
    learning-rate schedule), replicated on the mesh.
  replay_state: `ReplayState` (retrieval counters and PRNG key; a 1-image placeholder
    without replay; None in pre-training).
  key: PRNG key of the train steps (split once per step: dropout / query sampling).
  step, epoch: steps taken in this phase, and the current epoch (0-based).
  batch_in_epoch: batches of `epoch` consumed so far: the input pipeline's position (a
    resumed loop reads the epoch from this batch on, `Detector.train_batches(start_batch=)`).
  replays_in_loss, replay_steps: int32 [] device counters (no host sync per step) of the
    replays that entered the loss and of the steps with at least one.
  replayed: valid replay slots retrieved (host int).
  loss: float32 [] the last step's loss (device; None before the first step).
  history: JSON-able host records of the phase (pre-training: 'curve'; a dataset with
    train.carry='best_validation': 'validation', 'best_AP', 'best_epoch').
  best_params: host parameter tree of the best validation epoch so far (None: none yet).
  """

  train_state: Any
  replay_state: Any
  key: jax.Array
  step: int = 0
  epoch: int = 0
  batch_in_epoch: int = 0
  replays_in_loss: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
  replay_steps: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
  replayed: int = 0
  loss: Any = None
  history: dict = dataclasses.field(default_factory=dict)
  best_params: Any = None


def _host_arrays(tree):
  """NumPy arrays of a replicated tree (orbax saves no NumPy scalars: 0-d arrays instead)."""
  return jax.tree.map(np.asarray, sharding_lib.fetch_replicated(tree))


def _stored_params(params, adapters_only: bool):
  """The part of a parameter tree a checkpoint holds: all of it, or (LoRA) its adapters."""
  return lora_lib.adapters_of(params) if adapters_only else params


def loop_checkpoint(loop: LoopState, replay, adapters_only: bool = False) -> tuple[dict, dict]:
  """What a step checkpoint holds of `loop`: (array items, JSON-able meta).

  Items: 'train_state' (replicated arrays), 'key' uint32 [2], 'replay_state' and
  'best_params' (host copies, when present), plus `replay.checkpoint_items()` (the retrieval
  records). With `adapters_only` (LoRA: the base model is frozen, so the phase's starting
  parameters hold it), the parameters of 'train_state' and 'best_params' are the adapters
  alone (`lora.adapters_of`). Meta: the host ints, the counters and the last loss (fetched: one
  host sync per checkpoint), and `history`. Inverse: `restore_loop`.
  """
  train_state = loop.train_state
  if adapters_only:
    train_state = train_state.replace(params=lora_lib.adapters_of(train_state.params))
  items = {"train_state": train_state, "key": np.asarray(jax.device_get(loop.key))}
  if loop.replay_state is not None:
    # Host copy: after `initial_replay_state` it lives on one device, which a multi-process
    # save cannot take; the values are what matter.
    items["replay_state"] = _host_arrays(loop.replay_state)
  if loop.best_params is not None:
    items["best_params"] = _host_arrays(_stored_params(loop.best_params, adapters_only))
  items.update(replay.checkpoint_items())
  replays_in_loss, replay_steps, loss = (
    sharding_lib.fetch_replicated(x) for x in (loop.replays_in_loss, loop.replay_steps, loop.loss)
  )
  meta = {
    "step": loop.step,
    "epoch": loop.epoch,
    "batch_in_epoch": loop.batch_in_epoch,
    "replayed": loop.replayed,
    "replays_in_loss": int(replays_in_loss),
    "replay_steps": int(replay_steps),
    # float(float32) -> JSON -> float32 is exact.
    "loss": None if loss is None else float(loss),
    "history": loop.history,
  }
  return items, meta


def restore_loop(
  checkpoints, phase: int, loop: LoopState, replay, params_like=None, adapters_only: bool = False
) -> LoopState:
  """`loop` (freshly set up for `phase`) with the state of the phase's newest step checkpoint.

  Returns `loop` unchanged when there is none (or `checkpoints` is None). `params_like`: the
  host parameter tree's shapes (for 'best_params'). `adapters_only` as `loop_checkpoint`: the
  stored adapters are combined with the base parameters of `loop`'s fresh train state (the
  frozen base is the phase's starting one, bit for bit).
  """
  step = None if checkpoints is None else checkpoints.latest(phase)
  if step is None:
    return loop
  train_state = loop.train_state
  base = None
  if adapters_only:
    base = lora_lib.base_of(train_state.params)
    train_state = train_state.replace(params=lora_lib.adapters_of(train_state.params))
  like = {"train_state": train_state, "key": np.asarray(jax.device_get(loop.key))}
  if loop.replay_state is not None:
    like["replay_state"] = _host_arrays(loop.replay_state)
  if params_like is not None:
    like["best_params"] = _stored_params(params_like, adapters_only)
  like.update(replay.checkpoint_items())
  items, meta = checkpoints.restore(phase, step, like)
  logging.info(
    "resuming phase %d at step %d (epoch %d, batch %d) from %s",
    phase,
    step,
    meta["epoch"],
    meta["batch_in_epoch"],
    checkpoints.directory,
  )
  replay.restore_items(items)
  loop.train_state = items["train_state"]
  loop.best_params = items.get("best_params")
  if adapters_only:
    restored = loop.train_state.params
    loop.train_state = loop.train_state.replace(params=lora_lib.combine(base, restored))
    if loop.best_params is not None:
      host_base = _host_arrays(base)
      loop.best_params = lora_lib.combine(host_base, loop.best_params)
  loop.key = jnp.asarray(items["key"])
  if "replay_state" in items:
    loop.replay_state = items["replay_state"]
  loop.step, loop.epoch, loop.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
  loop.replayed = meta["replayed"]
  loop.replays_in_loss = jnp.asarray(meta["replays_in_loss"], jnp.int32)
  loop.replay_steps = jnp.asarray(meta["replay_steps"], jnp.int32)
  loop.loss = None if meta["loss"] is None else np.float32(meta["loss"])
  loop.history = meta["history"]
  return loop


def checkpoint_hook(
  checkpoints, phase: int, total_steps: int, replay, desc: str, adapters_only: bool = False
):
  """The loop's per-step checkpoint call: `hook(loop)` saves a step checkpoint when one is due
  (`StepCheckpointer.step_due` / `time_due`) or SIGTERM was received, and after SIGTERM
  raises `preemption.Preempted` once the checkpoint is on disk. None: no step checkpoints
  (and SIGTERM is not handled here). `adapters_only`: see `loop_checkpoint`.

  The time and SIGTERM decisions are agreed by all processes (`preemption.any_process`), so
  every process saves (a collective write) and stops at the same step. A finished write is
  committed (`StepCheckpointer.poll`) at the next step.
  """
  if checkpoints is None:
    return lambda loop: None
  checkpoints.start_phase()

  def hook(loop: LoopState) -> None:
    # The previous write, once orbax has finished it, is committed (its manifest) at once.
    checkpoints.poll()
    time_due, stop = preemption.any_process(checkpoints.time_due(), preemption.requested_here())
    if stop or time_due or checkpoints.step_due(loop.step, total_steps):
      items, meta = loop_checkpoint(loop, replay, adapters_only)
      checkpoints.save(phase, loop.step, items, meta)
    if stop:
      checkpoints.wait()
      raise preemption.Preempted(
        f"stopped by SIGTERM in {desc} after step {loop.step}; checkpoint saved in "
        f"{checkpoints.directory}; run the same command to resume"
      )

  return hook


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
  layerwise_decay, weight_decay, layerwise_granularity and (fine-tuning) frozen; Adam's b1 /
  b2 / eps and the gradient clipping come from `config.train` for every phase.
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


def _phase_items(detector, source, epochs, first, start_batch, left, batch_size, data_seed):
  """(epoch, None) as an epoch begins, then (epoch, host batch) for each of its batches: every
  epoch of `epochs` in order, read by one reader; at most the `left` batches the phase's
  remaining steps take (none wasted at its end), and no epoch begun without steps left (but a
  restored loop's epoch `first`, read from batch `start_batch` > 0 on, which its after_epoch
  still ends)."""
  remaining = left
  for epoch in epochs:
    resumed = epoch == first and start_batch > 0
    if remaining <= 0 and not resumed:
      return
    yield epoch, None
    batches = detector.train_batches(
      source,
      batch_size=batch_size,
      seed=data_seed,
      epoch=epoch,
      start_batch=start_batch if resumed else 0,
    )
    for batch in itertools.islice(batches, remaining):
      remaining -= 1
      yield epoch, batch


def _shard_inputs(mesh, item):
  """(epoch, host batch) -> (epoch, the model inputs sharded over `mesh`); an epoch marker
  (epoch, None) passes unchanged."""
  epoch, batch = item
  if batch is None:
    return item
  return epoch, sharding_lib.shard_batch({k: batch[k] for k in MODEL_INPUTS}, mesh)


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
  checkpoint: Callable[[LoopState], None] = lambda loop: None,
  learning_rate: float | None = None,
  prefetch_batches: int = 0,
  timer: timing.StepTimer | None = None,
) -> LoopState:
  """Runs train steps until `total_steps` (or `num_epochs` epochs; None = as many as needed).

  Per step: the next batch, sharded, the key split, the replayed inputs
  (`replay.step_inputs`), the train step, the replay counters; every
  `train.log_every_steps` steps and at the last one `on_log(loop, host metrics)` returns the
  progress bar's fields. `after_step(loop)` runs after every step, then `checkpoint(loop)`
  (`checkpoint_hook`: a step checkpoint when due; raises `preemption.Preempted` after
  SIGTERM); `after_epoch(loop)` after every epoch begun with steps left. `learning_rate`
  (the phase's peak) only enters the divergence message.

  Overlap. (1) `prefetch_batches` > 0 (config `data.prefetch_batches`): a background thread reads
  and shards the next new batches (`owl_cl.train.prefetch`), one reader for all the phase's
  epochs, so the next epoch's first batch is read during this epoch's last step and its
  `after_epoch` (the batches of an epoch depend only on the data seed and the epoch). (2) The
  replay lookahead (`Replay.look_ahead`, config `replay.lookahead`): before dispatching train step
  t the loop dispatches step t+1's retrieval, ahead of train step t on the devices, and a second
  background thread fetches its indices, gathers the replay batch from the store and transfers it
  while train step t runs; step t+1 takes it ready and dispatches its train step at once, so the
  device no longer waits for the gather. Exact, hence on by default, where the retrieval reads no
  parameters (uniform, uniform_balanced, grasp and their dedup variants): its next call depends
  only on the replay state after this one. Not across a change of that state between the steps (a
  dedup reset in `after_epoch`): the retrieval prepared ahead is dropped and redone in line. What
  cannot overlap exactly: a retrieval that reads the parameters (features of the new images: SWIL,
  ASER...; the new-image losses of the paper's loss adaptivity) needs those after step t - 1, so
  its features, retrieval, gather and transfer run after that train step and before step t's, with
  the device idle while the host fetches and gathers (`owl_cl.train.timing` measures it);
  `replay.stale_retrieval` computes them one step stale instead (from the parameters step t trains
  from, while step t trains; an approximation: other results), from the next new batch read early
  (kept for its step; a read error is raised when that step takes it). With (1), exact (2), or
  both, the results are the serial loop's bit for bit. `timer` (`timing.StepTimer`; None: none)
  records every step's time breakdown.

  A `loop` restored from a step checkpoint (`restore_loop`) goes on exactly where it
  stopped: from batch `loop.batch_in_epoch` of epoch `loop.epoch` (that epoch's
  `after_epoch` still runs), with its keys, counters and optimizer state. A batch prefetched
  and not consumed does not count: the position moves when a step takes its batch.

  Returns:
    the loop state after the last step (`loop.loss`: the last step's loss).

  Raises:
    TrainingDivergedError: a non-finite loss or gradient norm at a logged step
      (`check_finite`).
    owl_cl.preemption.Preempted: SIGTERM was received (from `checkpoint`).
  """
  log_every = detector.config.train.log_every_steps
  timer = timing.NULL_TIMER if timer is None else timer
  bar = progress(total_steps, desc)
  bar.update(loop.step)
  first, start_batch = loop.epoch, loop.batch_in_epoch
  # A restored loop part-way into its epoch finishes it (and its after_epoch) first.
  continuing = start_batch > 0
  epochs = itertools.count(first) if num_epochs is None else range(first, num_epochs)
  left = max(0, total_steps - loop.step)

  begun = False  # an epoch was begun (its after_epoch is due when it ends)
  try:
    phase = _phase_items(detector, source, epochs, first, start_batch, left, batch_size, data_seed)
    to_device = functools.partial(_shard_inputs, detector.mesh)
    with prefetch.Prefetcher(phase, to_device, prefetch_batches, None) as reader:
      items = prefetch.ReadAhead(reader)
      while True:
        waited = time.perf_counter()
        item = items.take()
        if item is None:
          break  # the phase's last batch was taken
        epoch, inputs = item
        if inputs is None:  # an epoch begins: the previous one has ended
          if begun:
            loop = after_epoch(loop)
          begun = True
          if not (epoch == first and continuing):
            loop.epoch, loop.batch_in_epoch = epoch, 0
          continue
        timer.host("input", time.perf_counter() - waited)
        loop.key, step_key = jax.random.split(loop.key)
        loop, replay_inputs = replay.step_inputs(loop, inputs, timer)
        if loop.step + 1 < total_steps:
          # The next step's retrieval, dispatched before this train step, its gather in the
          # background meanwhile (`Replay.look_ahead`; a no-op where it would be inexact).
          next_inputs = None
          if replay.reads_next_batch:
            waited = time.perf_counter()
            next_inputs = items.peek_batch()
            timer.host("input", time.perf_counter() - waited)
          replay.look_ahead(loop, next_inputs)
        dispatched = time.perf_counter()
        loop.train_state, metrics = train_step(loop.train_state, inputs, replay_inputs, step_key)
        timer.device("train_step", dispatched, metrics["loss"])
        timer.end_step()
        loop.step += 1
        loop.batch_in_epoch += 1
        loop.loss = metrics["loss"]
        bar.update(1)
        loop = replay.count(loop, metrics)
        if loop.step % log_every == 0 or loop.step == total_steps:
          host_metrics = sharding_lib.fetch_replicated(metrics)
          check_finite(host_metrics, desc, loop.step, learning_rate)
          bar.set_postfix(**on_log(loop, host_metrics))
        after_step(loop)
        checkpoint(loop)
        preemption.checkpoint_event("train_step")
    if begun:
      loop = after_epoch(loop)
  finally:
    # A retrieval prepared ahead that no step took (the phase's end, a stop, an error)
    # is dropped: the serial loop would not have computed it.
    replay.close_lookahead()
  bar.close()
  return loop


# ----------------------------------------------------------------------------- pre-training


def pretrain(
  detector: Detector, bench: Benchmark, writer: SummaryWriter | None, step_checkpoints=None
):
  """Pre-trains the model from scratch on the pre-training set. Returns (params, curve).

  curve: [{'step', 'seconds', 'loss'} every `train.log_every_steps` steps, with 'val_AP' /
  'val_AP50' every `pretrain.eval_every_steps` steps]; 'seconds' counts from the start of
  the (possibly resumed) process's pre-training. `step_checkpoints`
  (`checkpointing.StepCheckpointer`, phase 0; None: none) saves the loop as configured and
  on SIGTERM, and a killed pre-training resumes from its newest one.

  Raises:
    owl_cl.preemption.Preempted: SIGTERM (after the checkpoint is saved).
  """
  config = detector.config
  settings = config.pretrain
  sharding_lib.check_batch_divisible(
    settings.batch_size, detector.mesh, "config.pretrain.batch_size"
  )
  params = detector.init_params(seed_of(config, "model"))
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
  no_replay = replay_setup.NoReplay()
  loop = LoopState(
    train_state=sharding_lib.replicate(step_lib.create_train_state(params, tx), detector.mesh),
    replay_state=None,
    key=jax.random.PRNGKey(seed_of(config, "model") + 1),
    history={"curve": []},
  )
  loop = restore_loop(step_checkpoints, 0, loop, no_replay)
  start = time.time()
  timer = timing.StepTimer()

  def on_log(loop, metrics):
    log_scalars(writer, "pretrain", dict(metrics, lr=schedule(loop.step)), loop.step)
    log_scalars(writer, "timing/pretrain", timing.means(timer.collect()), loop.step)
    seconds = round(time.time() - start, 1)
    curve = loop.history["curve"]
    curve.append({"step": loop.step, "seconds": seconds, "loss": float(metrics["loss"])})
    return {"loss": f"{float(metrics['loss']):.3f}"}

  def after_step(loop):
    every = settings.eval_every_steps
    if not every or loop.step % every or loop.step >= settings.num_steps:
      return
    curve = loop.history["curve"]
    params_now = sharding_lib.fetch_replicated(loop.train_state.params)
    val = detector.evaluate(params_now, bench.pretrain.test, f"pre-training val @ {loop.step}")
    if not curve or curve[-1]["step"] != loop.step:
      curve.append({"step": loop.step})
    curve[-1].update(seconds=round(time.time() - start, 1), val_AP=val["AP"], val_AP50=val["AP50"])
    log_scalars(writer, "pretrain_val", val, loop.step)
    logging.info(
      "pre-training step %d: validation AP50 %.3f AP %.3f", loop.step, val["AP50"], val["AP"]
    )

  try:
    loop = train_loop(
      detector,
      loop,
      train_step=train_step,
      replay=no_replay,
      source=bench.pretrain.train,
      batch_size=settings.batch_size,
      data_seed=seed_of(config, "model"),
      total_steps=settings.num_steps,
      num_epochs=None,
      desc="pre-training",
      on_log=on_log,
      after_step=after_step,
      checkpoint=checkpoint_hook(
        step_checkpoints, 0, settings.num_steps, no_replay, "pre-training"
      ),
      learning_rate=settings.learning_rate,
      prefetch_batches=config.data.prefetch_batches,
      timer=timer,
    )
  finally:
    timer.close()
  return sharding_lib.fetch_replicated(loop.train_state.params), loop.history["curve"]


# ----------------------------------------------------------------------------- one dataset


def lwf_options(config: ml_collections.ConfigDict) -> dict | None:
  """`train.lwf` as the train step's `lwf` option; None when off (weight and box_weight 0)."""
  lwf = config.train.get("lwf")
  if lwf is None or not (lwf.weight or lwf.box_weight):
    return None
  return {k: float(lwf[k]) for k in ("weight", "temperature", "box_weight", "box_threshold")}


def _with_teacher(train_step, teacher, mesh):
  """`train_step` with the replicated `teacher` parameters as its last argument (an argument
  of the jitted step, never a constant of its trace)."""
  if teacher is None:
    raise ValueError("train.lwf is on but no teacher (pre-trained parameters) was given")
  teacher = sharding_lib.replicate(teacher, mesh)
  return lambda state, batch, replay, key: train_step(state, batch, replay, key, teacher)


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
    With a budget in steps (`train.per_dataset.<name>.num_steps`, else
    `train.num_steps_by_dataset`'s entry for `name`, else `train.num_steps`) also
    'num_steps': the dataset's optimizer steps, which replace num_epochs (the IVLOD
    protocol, docs/ivlod.md).

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
  table = dict(train.get("num_steps_by_dataset") or ())
  num_steps = overrides.get("num_steps", table.get(name, train.get("num_steps")))
  return {
    "num_epochs": int(value("num_epochs")),
    "learning_rate": float(value("learning_rate")),
    "text_lr_multiplier": float(value("text_lr_multiplier")),
    "layerwise_decay": float(value("layerwise_decay")),
    "warmup_steps": warmup_steps,
    **({"num_steps": int(num_steps)} if num_steps is not None else {}),
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
  metrics = detector.evaluate(
    params,
    dataset.valid,
    f"valid {dataset.name} @ epoch {epoch + 1}",
    max_detections=dataset.max_detections,  # as the dataset's test evaluation
  )
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
  step_checkpoints=None,
  teacher=None,
):
  """Fine-tunes on one downstream dataset with retrieval + DER++ (fresh optimizer).

  With `train.lwf` on (`lwf_options`), `teacher` (the pre-trained parameters) is passed to
  every train step for the LwF terms (docs/baselines.md); a missing teacher is a ValueError.

  With `train.lora` on (`detector.lora`), `params` is a LoRA tree (`Detector.add_adapters`):
  only its adapters train (the base has no optimizer state), the train step applies
  `detector.tuned_train_model`, step checkpoints hold the adapters, and the returned
  parameters are the LoRA tree (evaluation merges it, `Detector.model_params`).

  `store` is the replay store (None: retrieval 'none'). With `config.replay.records` and a
  `records_path`, the retrieval analysis records (`owl_cl.replay.records`) of the dataset
  are written there. `step_checkpoints` (`checkpointing.StepCheckpointer`; None: none) saves
  the loop (phase `index`) as configured and on SIGTERM; when it holds a checkpoint of this
  dataset, training resumes from it and ends as the uninterrupted run would.

  Returns:
    (params, replay state, training summary dict for results.json; its 'step_timings' is
    the steps' time breakdown, `timing.StepTimer.summary`, which `experiment` moves to
    results.json `timings`).

  Raises:
    ConfigError: a dataset with fewer training images than one batch.
    owl_cl.preemption.Preempted: SIGTERM (after the checkpoint is saved).
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
  # A budget in steps (train.num_steps) runs as many epochs as it takes, the last one cut.
  num_epochs = None if "num_steps" in settings else settings["num_epochs"]
  total = settings.get("num_steps") or steps_per_epoch * settings["num_epochs"]
  if config.max_train_steps_per_dataset:
    total = min(total, config.max_train_steps_per_dataset)
  optimizer = {k: v for k, v in settings.items() if k not in ("num_epochs", "num_steps")}
  lora = detector.lora is not None
  # LoRA: the base model is frozen (no update, no optimizer state), only the adapters train.
  frozen = tuple(config.train.get("frozen", ())) + ((lora_lib.FROZEN_BASE,) if lora else ())
  optimizer.update(
    layerwise_granularity=config.train.get("layerwise_granularity", "layer"),
    weight_decay=config.train.weight_decay,
    frozen=frozen,
  )
  tx, schedule = make_optimizer(params, optimizer, total, config)
  replay = replay_setup.make_replay(detector, store, records_path)
  train_step = step_lib.make_train_step(
    detector.tuned_train_model,
    tx,
    detector.mesh,
    # The normalisation applies to fine-tuning only (pre-training and the buffer's per-image
    # losses stay per image).
    loss_config=dict(detector.loss_config, normalization=config.loss.normalization),
    max_unique_queries=config.train.max_unique_queries,
    lwf=lwf_options(config),
    **replay.train_step_options,
  )
  if lwf_options(config):
    train_step = _with_teacher(train_step, teacher, detector.mesh)
  loop = LoopState(
    train_state=sharding_lib.replicate(step_lib.create_train_state(params, tx), detector.mesh),
    replay_state=replay_state,
    key=jax.random.PRNGKey(seed_of(config, "data") * 1000 + index),
  )
  loop = replay.prepare(loop)
  carry_best = config.train.get("carry", "last") == "best_validation"
  if carry_best:
    loop.history = {"best_AP": -np.inf, "best_epoch": None, "validation": []}
  # After `prepare`: the restored replay state already holds what it prepared.
  # `params` gives best_params' tree structure, shapes and dtypes.
  loop = restore_loop(
    step_checkpoints, index, loop, replay, params if carry_best else None, adapters_only=lora
  )

  timer = timing.StepTimer()

  def on_log(loop, metrics):
    postfix, replay_scalars = replay.log(loop)
    scalars = dict(metrics, lr=schedule(loop.step), **replay_scalars)
    log_scalars(writer, f"train/{dataset.name}", scalars, loop.step)
    log_scalars(writer, f"timing/{dataset.name}", timing.means(timer.collect()), loop.step)
    return {"loss": f"{float(metrics['loss']):.3f}", **postfix}

  def after_epoch(loop):
    loop = replay.end_epoch(loop)
    if carry_best:
      history = loop.history
      best = {"AP": history["best_AP"], "epoch": history["best_epoch"], "params": loop.best_params}
      best = track_best_epoch(
        detector,
        dataset,
        loop.train_state.params,
        loop.epoch,
        best,
        history["validation"],
        writer,
        index,
      )
      history.update(best_AP=best["AP"], best_epoch=best["epoch"])
      loop.best_params = best["params"]
    return loop

  try:
    loop = train_loop(
      detector,
      loop,
      train_step=train_step,
      replay=replay,
      source=dataset.train,
      batch_size=batch_size,
      data_seed=seed_of(config, "data") + index,
      total_steps=total,
      num_epochs=num_epochs,
      desc=f"dataset {index}: {dataset.name}",
      on_log=on_log,
      after_epoch=after_epoch,
      checkpoint=checkpoint_hook(
        step_checkpoints, index, total, replay, f"dataset {index}", adapters_only=lora
      ),
      learning_rate=settings["learning_rate"],
      prefetch_batches=config.data.prefetch_batches,
      timer=timer,
    )
  finally:
    timer.close()
  loop = replay.end_dataset(loop)
  summary = {
    "steps": loop.step,
    # Wall-clock: moved out of the stage's training summary into results.json `timings`.
    "step_timings": timer.summary(),
    "replayed_images": loop.replayed,
    "final_loss": float(sharding_lib.fetch_replicated(loop.loss)) if loop.step else None,
    "settings": settings,
    **replay.summary(loop),
  }
  if carry_best and loop.best_params is not None:
    summary.update(
      carried="best_validation",
      best_epoch=loop.history["best_epoch"],
      validation=loop.history["validation"],
    )
    return loop.best_params, loop.replay_state, summary
  summary["carried"] = "last"
  return sharding_lib.fetch_replicated(loop.train_state.params), loop.replay_state, summary

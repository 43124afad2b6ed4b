"""The training loop: one step loop for pre-training and for every downstream dataset.

`train_loop` runs the steps of one training phase over an explicit `LoopState` (train state,
replay state, step, epoch, PRNG key, replay counters). Replay sits behind one object
(`owl_cl.replay.setup.Replay`, or `NoReplay` without it), so the loop has no replay
branches; what differs between the phases (logging, validation during pre-training, the
best-epoch carry of a dataset) is passed in as callbacks.

- `pretrain`: the model from scratch on the pre-training set (built-in benchmark only).
- `train_on_dataset`: fine-tuning on one downstream dataset with retrieval + DER++.
- `train_joint`: fine-tuning on every downstream dataset at once (the `joint` schedule,
  `owl_cl.data.mixture`), with the same replay.

Overlap in `train_loop`. (1) `prefetch_batches` > 0 (config `data.prefetch_batches`): a background
thread reads and shards the next new batches (`owl_cl.train.prefetch`), one reader for all the
phase's epochs, so the next epoch's first batch is read during this epoch's last step and its
`after_epoch` (the batches of an epoch depend only on the data seed and the epoch). (2) The replay
lookahead (`Replay.look_ahead`, config `replay.lookahead`): before dispatching train step t the
loop dispatches step t+1's retrieval, ahead of train step t on the devices, and a second
background thread fetches its indices, gathers the replay batch from the store and transfers it
while train step t runs; step t+1 takes it ready and dispatches its train step at once, so the
device no longer waits for the gather. Exact, hence on by default, where the retrieval reads no
parameters (uniform, uniform_balanced, grasp and their dedup variants): its next call depends only
on the replay state after this one. Not across a change of that state between the steps (a dedup
reset in `after_epoch`): the retrieval prepared ahead is dropped and redone in line. What cannot
overlap exactly: a retrieval that reads the parameters (features of the new images: SWIL, ASER...;
the new-image losses of the paper's loss adaptivity) needs those after step t - 1, so its
features, retrieval, gather and transfer run after that train step and before step t's, with the
device idle while the host fetches and gathers (`owl_cl.train.timing` measures it);
`replay.stale_retrieval` computes them one step stale instead (from the parameters step t trains
from, while step t trains; an approximation: other results), from the next new batch read early
(kept for its step; a read error is raised when that step takes it). With (1), exact (2), or both,
the results are the serial loop's bit for bit.
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
import numpy as np
import tqdm

from owl_cl import preemption
from owl_cl.benchmark import Benchmark
from owl_cl.benchmark import Dataset
from owl_cl.config_fields import DATA_KEY_STRIDE
from owl_cl.data.spec import MODEL_INPUT_KEYS
from owl_cl.detector import Detector
from owl_cl.model import lora as lora_lib
from owl_cl.phases import Phase
from owl_cl.phases import dataset_phase
from owl_cl.phases import joint_phase
from owl_cl.replay import setup as replay_setup
from owl_cl.summary_writer import SummaryWriter
from owl_cl.train import optim
from owl_cl.train import prefetch
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib
from owl_cl.train import step_cache
from owl_cl.train import timing
from owl_cl.train.loop_state import GUARDED_METRICS  # noqa: F401 (re-exported)
from owl_cl.train.loop_state import LoopState
from owl_cl.train.loop_state import ParamsPart
from owl_cl.train.loop_state import TrainingDivergedError  # noqa: F401 (re-exported)
from owl_cl.train.loop_state import check_finite
from owl_cl.train.loop_state import checkpoint_hook
from owl_cl.train.loop_state import loop_checkpoint  # noqa: F401 (re-exported)
from owl_cl.train.loop_state import restore_loop
from owl_cl.train.pretrain_spec import PretrainSpec
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import TrainSpec

# The arrays a train step consumes (a batch also holds host-side bookkeeping such as image ids).
MODEL_INPUTS = MODEL_INPUT_KEYS

# What LoRA's checkpoints (step and stage) hold of a LoRA parameter tree: the adapters; the
# frozen base is joined back from the phase's (the run's) starting parameters.
LORA_ADAPTERS = ParamsPart(
  part=lora_lib.adapters_of,
  join=lambda params, adapters: lora_lib.combine(lora_lib.base_of(params), adapters),
)


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


def make_optimizer(params, optimizer: dict, total_steps: int, train: TrainSpec):
  """AdamW of one phase (`optim.create_optimizer`). Returns (tx, learning-rate schedule).

  `optimizer` holds the phase's learning_rate, warmup_steps, text_lr_multiplier,
  layerwise_decay, weight_decay, layerwise_granularity and (fine-tuning) frozen; Adam's b1 /
  b2 / eps and the gradient clipping come from `train` (`config.train`) for every phase.
  """
  return optim.create_optimizer(
    params,
    total_steps=total_steps,
    b1=train.b1,
    b2=train.b2,
    eps=train.eps,
    grad_clip_norm=train.grad_clip_norm,
    **optimizer,
  )


def _phase_items(detector, plan, epochs, first, start_batch, left):
  """(epoch, None) as an epoch begins, then (epoch, host batch) for each of its batches: every
  epoch of `epochs` in order, read by one reader; at most the `left` batches the phase's
  remaining steps take (none wasted at its end), and no epoch begun without steps left (but a
  restored loop's epoch `first`, read from batch `start_batch` > 0 on, which its after_epoch
  still ends). The batches: `plan`'s source, batch size and data seed."""
  remaining = left
  for epoch in epochs:
    resumed = epoch == first and start_batch > 0
    if remaining <= 0 and not resumed:
      return
    yield epoch, None
    batches = detector.train_batches(
      plan.source,
      batch_size=plan.batch_size,
      seed=plan.data_seed,
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


@dataclasses.dataclass(frozen=True)
class LoopPlan:
  """What one phase's `train_loop` reads and how long it runs.

  Attributes:
    source: what `Detector.train_batches` reads (`CocoSource`, `mixture.JointSource`).
    batch_size: new images per step.
    data_seed: the input pipeline's seed.
    total_steps: the phase's optimizer steps.
    num_epochs: epochs read at most (None: as many as `total_steps` take).
    desc: the progress bar's and the divergence message's name of the phase.
    log_every: host metrics are fetched, checked and logged every this many steps and at the
      last (`train.log_every_steps`).
    learning_rate: the phase's peak, named in the divergence message (None: not named).
    prefetch_batches: batches read ahead by a background thread (`data.prefetch_batches`).
  """

  source: Any
  batch_size: int
  data_seed: int
  total_steps: int
  num_epochs: int | None
  desc: str
  log_every: int
  learning_rate: float | None = None
  prefetch_batches: int = 0


@dataclasses.dataclass(frozen=True)
class LoopHooks:
  """The callbacks of one phase's `train_loop`: what differs between the phases.

  Attributes:
    on_log: `on_log(loop, host metrics)` at each logged step; returns the progress bar's fields.
    after_step: runs after every step.
    after_epoch: runs after every epoch begun with steps left; returns the loop state.
    checkpoint: runs after `after_step` (`checkpoint_hook`: a step checkpoint when due;
      raises `preemption.Preempted` after SIGTERM).
    timer: records every step's time breakdown (`timing.StepTimer`; None: none).
  """

  on_log: Callable[[LoopState, dict], dict]
  after_step: Callable[[LoopState], None] = lambda loop: None
  after_epoch: Callable[[LoopState], LoopState] = lambda loop: loop
  checkpoint: Callable[[LoopState], None] = lambda loop: None
  timer: timing.StepTimer | None = None


@dataclasses.dataclass(frozen=True)
class ReplayContext:
  """What a fine-tuning stage rehearses with besides its parameters (`train_on_dataset`).

  Attributes:
    replay_state: the retrieval's state the stage starts from (`replay.state.ReplayState`).
    store: the replay store (`replay.store.ReplayStore`; None: retrieval 'none').
    teacher: LwF's teacher, the pre-trained parameters (a pytree; None without
      `train.lwf`), passed to every train step (docs/baselines.md).
  """

  replay_state: Any
  store: Any = None
  teacher: Any = None


@dataclasses.dataclass(frozen=True)
class StageOutputs:
  """Where a fine-tuning stage writes besides what it returns (`train_on_dataset`).

  Attributes:
    writer: TensorBoard's (`SummaryWriter`; None: none, as on every process but the writer).
    records_path: the retrieval analysis records' .npz file (`owl_cl.replay.records`), written
      with `config.replay.records` (None: none).
    step_checkpoints: the run's `checkpointing.StepCheckpointer` (None: none): saves the loop
      as configured and on SIGTERM; a checkpoint of this stage there is resumed from.
  """

  writer: SummaryWriter | None = None
  records_path: str | None = None
  step_checkpoints: Any = None


_PLAN_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopPlan))


def train_loop(
  detector: Detector,
  loop: LoopState,
  plan: LoopPlan | None = None,
  hooks: LoopHooks | None = None,
  *,
  train_step: Callable,
  replay,
  **fields,
) -> LoopState:
  """Runs train steps until `plan.total_steps` (or `plan.num_epochs` epochs).

  Per step: the next batch, sharded, the key split, the replayed inputs
  (`replay.step_inputs`), the train step, the replay counters; every `plan.log_every` steps
  and at the last one `hooks.on_log(loop, host metrics)` returns the progress bar's fields.
  `hooks.after_step(loop)` runs after every step, then `hooks.checkpoint(loop)`;
  `hooks.after_epoch(loop)` after every epoch begun with steps left.

  Without `plan` and `hooks`, `fields` gives their fields by keyword (`log_every` defaults to
  the detector's `train_spec.log_every_steps`), as a test's fake detector calls it.

  Overlap of input, retrieval and train step: the module docstring ("Overlap"); with it the
  results are the serial loop's bit for bit.

  A `loop` restored from a step checkpoint (`restore_loop`) goes on exactly where it
  stopped: from batch `loop.batch_in_epoch` of epoch `loop.epoch` (that epoch's
  `after_epoch` still runs), with its keys, counters and optimizer state. A batch prefetched
  and not consumed does not count: the position moves when a step takes its batch.

  Returns:
    the loop state after the last step (`loop.loss`: the last step's loss).

  Raises:
    TypeError: `fields` together with `plan` / `hooks`, a name of neither's fields, or
      neither `plan` and `hooks` nor `fields`.
    TrainingDivergedError: a non-finite loss or gradient norm at a logged step
      (`check_finite`).
    owl_cl.preemption.Preempted: SIGTERM was received (from `checkpoint`).
  """
  if fields:
    if plan is not None or hooks is not None:
      raise TypeError("train_loop takes a LoopPlan and LoopHooks, or their fields, not both")
    plan_fields = {k: v for k, v in fields.items() if k in _PLAN_FIELDS}
    if "log_every" not in plan_fields:
      plan_fields["log_every"] = detector.train_spec.log_every_steps
    plan = LoopPlan(**plan_fields)
    hooks = LoopHooks(**{k: v for k, v in fields.items() if k not in _PLAN_FIELDS})
  if plan is None or hooks is None:
    raise TypeError("train_loop needs a LoopPlan and LoopHooks, or their fields")
  return _run_loop(detector, loop, plan, hooks, train_step, replay)


def _run_loop(detector, loop, plan: LoopPlan, hooks: LoopHooks, train_step, replay) -> LoopState:
  """`train_loop` with its plan and hooks."""
  timer = timing.NULL_TIMER if hooks.timer is None else hooks.timer
  bar = progress(plan.total_steps, plan.desc)
  bar.update(loop.step)
  first, start_batch = loop.epoch, loop.batch_in_epoch
  # A restored loop part-way into its epoch finishes it (and its after_epoch) first.
  continuing = start_batch > 0
  num_epochs = plan.num_epochs
  epochs = itertools.count(first) if num_epochs is None else range(first, num_epochs)
  left = max(0, plan.total_steps - loop.step)
  step = _Stepper(
    train_step=train_step,
    replay=replay,
    total_steps=plan.total_steps,
    log_every=plan.log_every,
    desc=plan.desc,
    learning_rate=plan.learning_rate,
    on_log=hooks.on_log,
    timer=timer,
    bar=bar,
  )
  begun = False  # an epoch was begun (its after_epoch is due when it ends)
  try:
    phase = _phase_items(detector, plan, epochs, first, start_batch, left)
    to_device = functools.partial(_shard_inputs, detector.mesh)
    with prefetch.Prefetcher(phase, to_device, plan.prefetch_batches, None) as reader:
      items = prefetch.ReadAhead(reader)
      while True:
        waited = time.perf_counter()
        item = items.take()
        if item is None:
          break  # the phase's last batch was taken
        epoch, inputs = item
        if inputs is None:  # an epoch begins: the previous one has ended
          if begun:
            loop = hooks.after_epoch(loop)
          begun = True
          if not (epoch == first and continuing):
            loop.epoch, loop.batch_in_epoch = epoch, 0
          continue
        timer.host("input", time.perf_counter() - waited)
        loop = step(loop, inputs, items)
        hooks.after_step(loop)
        hooks.checkpoint(loop)
        preemption.checkpoint_event("train_step")
    if begun:
      loop = hooks.after_epoch(loop)
  finally:
    # A retrieval prepared ahead that no step took (the phase's end, a stop, an error)
    # is dropped: the serial loop would not have computed it.
    replay.close_lookahead()
  bar.close()
  return loop


@dataclasses.dataclass(frozen=True)
class _Stepper:
  """One step of `train_loop` (`__call__`), with what its every step shares: the jitted
  `train_step`, the `replay`, the phase's `total_steps`, the logging every `log_every` steps
  and at the last (`desc` and the peak `learning_rate` name a divergence; `on_log` returns
  the progress bar's fields), the `timer` and the progress `bar`."""

  train_step: Callable
  replay: Any
  total_steps: int
  log_every: int
  desc: str
  learning_rate: float | None
  on_log: Callable[[LoopState, dict], dict]
  timer: timing.StepTimer
  bar: Any

  def __call__(self, loop: LoopState, inputs, items) -> LoopState:
    """The key split, the replayed inputs, the next step's retrieval dispatched ahead, the
    train step, the counters, and (when due) the host metrics checked and logged. Returns
    `loop`, advanced by the step."""
    replay, timer = self.replay, self.timer
    loop.key, step_key = jax.random.split(loop.key)
    loop, replay_inputs = replay.step_inputs(loop, inputs, timer)
    if loop.step + 1 < self.total_steps:
      # The next step's retrieval, dispatched before this train step, its gather in the
      # background meanwhile (`Replay.look_ahead`; a no-op where it would be inexact).
      next_inputs = None
      if replay.reads_next_batch:
        waited = time.perf_counter()
        next_inputs = items.peek_batch()
        timer.host("input", time.perf_counter() - waited)
      replay.look_ahead(loop, next_inputs)
    dispatched = time.perf_counter()
    loop.train_state, metrics = self.train_step(loop.train_state, inputs, replay_inputs, step_key)
    timer.device("train_step", dispatched, metrics["loss"])
    timer.end_step()
    loop.step += 1
    loop.batch_in_epoch += 1
    loop.loss = metrics["loss"]
    self.bar.update(1)
    loop = replay.count(loop, metrics)
    if loop.step % self.log_every == 0 or loop.step == self.total_steps:
      host_metrics = sharding_lib.fetch_replicated(metrics)
      check_finite(host_metrics, self.desc, loop.step, self.learning_rate)
      self.bar.set_postfix(**self.on_log(loop, host_metrics))
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
  settings: PretrainSpec = detector.pretrain_spec
  sharding_lib.check_batch_divisible(
    settings.batch_size, detector.mesh, "config.pretrain.batch_size"
  )
  seed = detector.run.seed_of("model")
  params = detector.init_params(seed)
  optimizer = {
    name: getattr(settings, name)
    for name in (
      "learning_rate",
      "warmup_steps",
      "text_lr_multiplier",
      "layerwise_decay",
      "weight_decay",
    )
  }
  train, loss = detector.train_spec, detector.loss_spec
  tx, schedule = make_optimizer(params, optimizer, settings.num_steps, train)
  # Pre-training's loss is normalised per image (loss.normalization is fine-tuning's).
  spec = step_lib.StepSpec(
    loss=dataclasses.replace(loss, normalization="per_image"),
    max_unique_queries=settings.max_unique_queries,
  )
  train_step = step_lib.make_train_step(detector.model, tx, detector.mesh, spec)
  no_replay = replay_setup.NoReplay()
  loop = LoopState(
    train_state=sharding_lib.replicate(step_lib.create_train_state(params, tx), detector.mesh),
    replay_state=None,
    key=jax.random.PRNGKey(seed + 1),
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
    plan = LoopPlan(
      source=bench.pretrain.train,
      batch_size=settings.batch_size,
      data_seed=seed,
      total_steps=settings.num_steps,
      num_epochs=None,
      desc="pre-training",
      log_every=train.log_every_steps,
      learning_rate=settings.learning_rate,
      prefetch_batches=detector.data_spec.prefetch_batches,
    )
    checkpoint = checkpoint_hook(step_checkpoints, 0, settings.num_steps, no_replay, "pre-training")
    hooks = LoopHooks(on_log, after_step, checkpoint=checkpoint, timer=timer)
    loop = train_loop(detector, loop, plan, hooks, train_step=train_step, replay=no_replay)
  finally:
    timer.close()
  return sharding_lib.fetch_replicated(loop.train_state.params), loop.history["curve"]


# ----------------------------------------------------------------------------- one dataset


def _with_teacher(train_step, teacher, mesh):
  """`train_step` with the replicated `teacher` parameters as its last argument (an argument
  of the jitted step, never a constant of its trace)."""
  if teacher is None:
    raise ValueError("train.lwf is on but no teacher (pre-trained parameters) was given")
  teacher = sharding_lib.replicate(teacher, mesh)
  return lambda state, batch, replay, key: train_step(state, batch, replay, key, teacher)


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
  context: ReplayContext,
  index: int,
  outputs: StageOutputs = StageOutputs(),
):
  """Fine-tunes on one downstream dataset (stage `index`) with retrieval + DER++ (fresh
  optimizer), from `params` and `context`'s replay state.

  With `train.lwf` on (`TrainSpec.lwf.on`), `context.teacher` (the pre-trained parameters) is
  passed to every train step for the LwF terms (docs/baselines.md); a missing teacher is a
  ValueError.

  With `train.lora` on (`detector.lora`), `params` is a LoRA tree (`Detector.add_adapters`):
  only its adapters train (the base has no optimizer state), the train step applies
  `detector.tuned_train_model`, step checkpoints hold the adapters, and the returned
  parameters are the LoRA tree (evaluation merges it, `Detector.model_params`).

  `context.store` is the replay store (None: retrieval 'none'). With `config.replay.records`
  and `outputs.records_path`, the retrieval analysis records (`owl_cl.replay.records`) of the
  dataset are written there. `outputs.step_checkpoints` (None: none) saves the loop (phase
  `index`) as configured and on SIGTERM; when it holds a checkpoint of this dataset, training
  resumes from it and ends as the uninterrupted run would. `outputs.writer` takes the
  TensorBoard scalars.

  Returns:
    (params, replay state, training summary dict for results.json; its 'step_timings' is
    the steps' time breakdown, `timing.StepTimer.summary`, which `experiment` moves to
    results.json `timings`).

  Raises:
    ConfigError: a dataset with fewer training images than one batch.
    owl_cl.preemption.Preempted: SIGTERM (after the checkpoint is saved).
  """
  phase = dataset_phase(detector.train_spec, detector.run, dataset, index)
  return train_phase(detector, phase, params, context, outputs)


def train_joint(
  detector: Detector,
  datasets,
  params,
  context: ReplayContext,
  index: int = 1,
  outputs: StageOutputs = StageOutputs(),
):
  """Fine-tunes on every dataset of `datasets` at once (`joint_phase`: the sequence's
  examples and total steps, shuffled together), with retrieval + DER++ as configured.

  Arguments, returns and errors as `train_on_dataset` (the phase is stage `index`); the
  summary also holds 'joint': {dataset name: its steps in the sequence}.
  """
  phase = joint_phase(detector.train_spec, detector.run, datasets, index)
  params, replay_state, summary = train_phase(detector, phase, params, context, outputs)
  summary["joint"] = {part.name: part.steps for part in phase.source.parts}
  return params, replay_state, summary


def train_phase(
  detector: Detector,
  phase: Phase,
  params,
  context: ReplayContext,
  outputs: StageOutputs = StageOutputs(),
):
  """Fine-tunes on one `Phase` (fresh optimizer): `train_on_dataset` / `train_joint`.

  Returns and raises as `train_on_dataset`.
  """
  sharding_lib.check_batch_divisible(phase.batch_size, detector.mesh, "config.train.batch_size")
  replay = replay_setup.make_replay(detector, context.store, outputs.records_path)
  tx, schedule, train_step = _phase_train_step(detector, phase, params, replay, context.teacher)
  loop = LoopState(
    train_state=sharding_lib.replicate(step_lib.create_train_state(params, tx), detector.mesh),
    replay_state=context.replay_state,
    key=jax.random.PRNGKey(detector.run.seed_of("data") * DATA_KEY_STRIDE + phase.index),
  )
  loop = replay.prepare(loop)
  carry_best = detector.train_spec.carry == "best_validation" and phase.dataset is not None
  if carry_best:
    loop.history = {"best_AP": -np.inf, "best_epoch": None, "validation": []}
  # After `prepare`: the restored replay state already holds what it prepared.
  # `params` gives best_params' tree structure, shapes and dtypes.
  # LoRA: the step checkpoints hold the adapters alone (the base is `params`', frozen).
  held = LORA_ADAPTERS if detector.lora is not None else None
  like = params if carry_best else None
  step_checkpoints = outputs.step_checkpoints
  loop = restore_loop(step_checkpoints, phase.index, loop, replay, like, params_part=held)
  timer = timing.StepTimer()
  hooks = _phase_hooks(detector, phase, replay, outputs.writer, schedule, timer, carry_best)
  checkpoint = checkpoint_hook(
    step_checkpoints,
    phase.index,
    phase.total,
    replay,
    phase.name if phase.dataset is None else f"dataset {phase.index}",
    params_part=held,
  )
  hooks = dataclasses.replace(hooks, checkpoint=checkpoint)
  try:
    plan = _phase_plan(detector, phase)
    loop = train_loop(detector, loop, plan, hooks, train_step=train_step, replay=replay)
  finally:
    timer.close()
  return _phase_result(replay.end_dataset(loop), phase, replay, timer, carry_best)


def _phase_plan(detector: Detector, phase: Phase) -> LoopPlan:
  """The `LoopPlan` of a fine-tuning phase: its source, batches, steps and epochs, logged
  every `train.log_every_steps`, read ahead by `data.prefetch_batches`."""
  if phase.dataset is None:
    desc = f"{phase.name} ({len(phase.source.parts)} datasets)"
  else:
    desc = f"dataset {phase.index}: {phase.name}"
  return LoopPlan(
    source=phase.source,
    batch_size=phase.batch_size,
    data_seed=phase.data_seed,
    total_steps=phase.total,
    num_epochs=phase.num_epochs,
    desc=desc,
    log_every=detector.train_spec.log_every_steps,
    learning_rate=phase.settings["learning_rate"],
    prefetch_batches=detector.data_spec.prefetch_batches,
  )


def _step_spec(train: TrainSpec, loss: LossSpec, replay_options: dict) -> step_lib.StepSpec:
  """The fine-tuning train step's `StepSpec`: `loss` (its normalisation applies here),
  the replay's DER++ and loss-adaptivity options (`Replay.train_step_options`; without
  'with_replay': no replay half), the distinct-query embedding of `train` and every step
  term's settings that `train` gives (`StepTerm.of_train`: LwF's)."""
  replay = None
  if replay_options.get("with_replay"):
    replay = step_lib.ReplayLoss(
      alpha=replay_options["alpha"],
      beta=replay_options["beta"],
      objectness_distill_weight=float(replay_options["objectness_distill_weight"]),
      loss_adaptivity=replay_options["loss_adaptivity"],
      loss_threshold=float(replay_options["loss_threshold"]),
      loss_gate_groups=int(replay_options["loss_gate_groups"]),
      observe_losses=bool(replay_options.get("observe_losses", False)),
    )
  terms = {t.setting: t.of_train(train) for t in step_lib.STEP_TERMS if t.of_train is not None}
  return step_lib.StepSpec(
    loss=loss, replay=replay, max_unique_queries=train.max_unique_queries, **terms
  )


def _phase_train_step(detector: Detector, phase: Phase, params, replay, teacher):
  """(optimizer, learning-rate schedule, jitted train step) of the phase. LwF's teacher is
  bound as the step's last argument (`_with_teacher`)."""
  train, loss = detector.train_spec, detector.loss_spec
  optimizer = {k: v for k, v in phase.settings.items() if k not in ("num_epochs", "num_steps")}
  # LoRA: the base model is frozen (no update, no optimizer state), only the adapters train.
  lora = (lora_lib.FROZEN_BASE,) if detector.lora is not None else ()
  optimizer.update(
    layerwise_granularity=train.layerwise_granularity,
    weight_decay=train.weight_decay,
    frozen=train.frozen + lora,
  )
  spec = _step_spec(train, loss, replay.train_step_options)

  def build():
    tx, schedule = make_optimizer(params, optimizer, phase.total, train)
    return (
      tx,
      schedule,
      step_lib.make_train_step(detector.tuned_train_model, tx, detector.mesh, spec),
    )

  # Everything `build` reads. The optimizer reads the parameters' tree paths only (LR groups,
  # frozen labels): a later phase or run with the same settings and schedule length reuses
  # this step's trace (`step_cache`).
  key = (
    "train_step",
    detector.tuned_train_model,
    detector.mesh,
    jax.tree.structure(params),
    tuple(sorted(optimizer.items())),
    phase.total,
    (train.b1, train.b2, train.eps, train.grad_clip_norm),
    spec,
  )
  tx, schedule, train_step = step_cache.shared(key, build)
  if spec.lwf is not None:
    train_step = _with_teacher(train_step, teacher, detector.mesh)
  return tx, schedule, train_step


def _phase_hooks(
  detector: Detector, phase: Phase, replay, writer, schedule, timer, carry_best: bool
) -> LoopHooks:
  """The `LoopHooks` of a phase (no checkpoint hook): on_log, the TensorBoard scalars and the
  progress bar's fields; after_epoch, the replay's end of epoch, and with `carry_best` the
  best-validation-epoch carry; `timer`."""
  dataset = phase.dataset

  def on_log(loop, metrics):
    postfix, replay_scalars = replay.log(loop)
    scalars = dict(metrics, lr=schedule(loop.step), **replay_scalars)
    log_scalars(writer, f"train/{phase.name}", scalars, loop.step)
    log_scalars(writer, f"timing/{phase.name}", timing.means(timer.collect()), loop.step)
    return {"loss": f"{float(metrics['loss']):.3f}", **postfix}

  def after_epoch(loop):
    loop = replay.end_epoch(loop)
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
      phase.index,
    )
    history.update(best_AP=best["AP"], best_epoch=best["epoch"])
    loop.best_params = best["params"]
    return loop

  return LoopHooks(on_log, after_epoch=after_epoch if carry_best else replay.end_epoch, timer=timer)


def _phase_result(loop: LoopState, phase: Phase, replay, timer, carry_best: bool):
  """(params, replay state, summary) at the end of a phase (`train_on_dataset`'s returns)."""
  summary = {
    "steps": loop.step,
    # Wall-clock: moved out of the stage's training summary into results.json `timings`.
    "step_timings": timer.summary(),
    "replayed_images": loop.replayed,
    "final_loss": float(sharding_lib.fetch_replicated(loop.loss)) if loop.step else None,
    "settings": phase.settings,
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

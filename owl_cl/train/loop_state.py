"""The state of a training loop between steps, and its step checkpoints.

`LoopState` is everything `owl_cl.trainer.train_loop` carries from one step to the next;
`loop_checkpoint` / `restore_loop` turn it into a step checkpoint's items and meta and back
(`owl_cl.train.checkpointing.StepCheckpointer`), `checkpoint_hook` is the loop's per-step
checkpoint call (on schedule and on SIGTERM), and `check_finite` the divergence guard on the
metrics the loop fetches. Split from `owl_cl.trainer` (which re-exports these names) so the
loop's module stays within the project's 800 lines.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from owl_cl import preemption
from owl_cl.train import sharding as sharding_lib


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


@dataclasses.dataclass(frozen=True)
class ParamsPart:
  """The part of the parameters a step checkpoint holds when not all of them change (LoRA's
  adapters: the frozen base is the phase's starting parameters, bit for bit).

  `part(params)` is the held subtree; `join(params, part)` the whole tree from a fresh
  phase's parameters `params` and a restored `part` (`owl_cl.trainer.LORA_ADAPTERS`).
  Passed in because this layer does not know the model's trees.
  """

  part: Callable[[Any], Any]
  join: Callable[[Any, Any], Any]


def _held(params, params_part: ParamsPart | None):
  """The part of a parameter tree a checkpoint holds: all of it, or `params_part.part`."""
  return params if params_part is None else params_part.part(params)


def loop_checkpoint(
  loop: LoopState, replay, params_part: ParamsPart | None = None
) -> tuple[dict, dict]:
  """What a step checkpoint holds of `loop`: (array items, JSON-able meta).

  Items: 'train_state' (replicated arrays), 'key' uint32 [2], 'replay_state' and
  'best_params' (host copies, when present), plus `replay.checkpoint_items()` (the retrieval
  records). With `params_part` (LoRA), the parameters of 'train_state' and 'best_params' are
  `params_part.part` of them (the adapters alone). Meta: the host ints, the counters and the
  last loss (fetched: one host sync per checkpoint), and `history`. Inverse: `restore_loop`.
  """
  train_state = loop.train_state
  if params_part is not None:
    train_state = train_state.replace(params=params_part.part(train_state.params))
  items = {"train_state": train_state, "key": np.asarray(jax.device_get(loop.key))}
  if loop.replay_state is not None:
    # Host copy: after `initial_replay_state` it lives on one device, which a multi-process
    # save cannot take; the values are what matter.
    items["replay_state"] = _host_arrays(loop.replay_state)
  if loop.best_params is not None:
    items["best_params"] = _host_arrays(_held(loop.best_params, params_part))
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
  checkpoints,
  phase: int,
  loop: LoopState,
  replay,
  params_like=None,
  params_part: ParamsPart | None = None,
) -> LoopState:
  """`loop` (freshly set up for `phase`) with the state of the phase's newest step checkpoint.

  Returns `loop` unchanged when there is none (or `checkpoints` is None). `params_like`: the
  host parameter tree's shapes (for 'best_params'). `params_part` as `loop_checkpoint`: the
  restored part is joined with the parameters of `loop`'s fresh train state
  (`ParamsPart.join`).
  """
  step = None if checkpoints is None else checkpoints.latest(phase)
  if step is None:
    return loop
  train_state = loop.train_state
  if params_part is not None:
    fresh = train_state.params
    train_state = train_state.replace(params=params_part.part(fresh))
  like = {"train_state": train_state, "key": np.asarray(jax.device_get(loop.key))}
  if loop.replay_state is not None:
    like["replay_state"] = _host_arrays(loop.replay_state)
  if params_like is not None:
    like["best_params"] = _held(params_like, params_part)
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
  if params_part is not None:
    restored = loop.train_state.params
    loop.train_state = loop.train_state.replace(params=params_part.join(fresh, restored))
    if loop.best_params is not None:
      loop.best_params = params_part.join(_host_arrays(fresh), loop.best_params)
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
  checkpoints,
  phase: int,
  total_steps: int,
  replay,
  desc: str,
  params_part: ParamsPart | None = None,
):
  """The loop's per-step checkpoint call: `hook(loop)` saves a step checkpoint when one is due
  (`StepCheckpointer.step_due` / `time_due`) or SIGTERM was received, and after SIGTERM
  raises `preemption.Preempted` once the checkpoint is on disk. None: no step checkpoints
  (and SIGTERM is not handled here). `params_part`: see `loop_checkpoint`.

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
      items, meta = loop_checkpoint(loop, replay, params_part)
      checkpoints.save(phase, loop.step, items, meta)
    if stop:
      checkpoints.wait()
      raise preemption.Preempted(
        f"stopped by SIGTERM in {desc} after step {loop.step}; checkpoint saved in "
        f"{checkpoints.directory}; run the same command to resume"
      )

  return hook

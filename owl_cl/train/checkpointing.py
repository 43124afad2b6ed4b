"""Checkpoints with orbax: one per finished stage, step checkpoints within a training phase,
and the cached pre-trained model.

Layout of a workdir:
  checkpoints/<stage index>/{params, replay_state, meta}   (StageCheckpointer)
  step_checkpoints/<phase * PHASE_STRIDE + step>/{train_state, key, replay_state,
      best_params, records, meta}                          (StepCheckpointer)
Stage 0 is the model after pre-training (or the loaded initial checkpoint); stage i the model
after downstream dataset i. Phase 0 is pre-training, phase i the training on dataset i. Orbax
writes each checkpoint into a temporary folder and renames it when complete, so an
interrupted run never leaves a half checkpoint that is later trusted.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from owl_cl import preemption
from owl_cl import utils

PyTree = Any


class StageCheckpointer:
  """Saves and restores the state after each finished stage of a run.

  Args:
    directory: `<workdir>/checkpoints`; created if missing.
    max_to_keep: keep the newest this many stage checkpoints (None = all).
  """

  def __init__(self, directory: str, max_to_keep: int | None = None):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    )

  def latest_stage(self) -> int | None:
    """Index of the newest complete stage checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, stage: int, params: PyTree, replay_state: PyTree | None, meta: dict) -> None:
    """Writes stage `stage` (blocking until it is on disk).

    Raises:
      ValueError: if a checkpoint of this stage already exists (nothing is overwritten).
    """
    if stage in self._manager.all_steps():
      raise ValueError(f"checkpoint of stage {stage} already exists in {self.directory}")
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
    if replay_state is not None:
      items["replay_state"] = ocp.args.StandardSave(replay_state)
    self._manager.save(stage, args=ocp.args.Composite(**items))
    self._manager.wait_until_finished()

  def restore(
    self, stage: int, params_like: PyTree, replay_state_like: PyTree | None
  ) -> tuple[PyTree, PyTree | None, dict]:
    """Reads stage `stage` into trees shaped like the given ones (arrays or abstract)."""
    items = {"params": ocp.args.StandardRestore(params_like), "meta": ocp.args.JsonRestore()}
    if replay_state_like is not None:
      items["replay_state"] = ocp.args.StandardRestore(replay_state_like)
    restored = self._manager.restore(stage, args=ocp.args.Composite(**items))
    replay_state = restored["replay_state"] if replay_state_like is not None else None
    return restored["params"], replay_state, restored["meta"]

  def close(self) -> None:
    self._manager.close()


# Step checkpoint ids: phase * PHASE_STRIDE + step (orbax numbers checkpoints with one int);
# ids grow over a run, so orbax's "keep the newest" pruning keeps the newest steps.
PHASE_STRIDE = 10**9


class StepCheckpointer:
  """Checkpoints within a training phase (pre-training = phase 0, dataset i = phase i).

  A checkpoint is due every `every_steps` steps, when `every_minutes` have passed since the
  last one (or since the phase began), and at a phase's last step when either is set; SIGTERM
  makes one due at once (`owl_cl.trainer.checkpoint_hook`). Writes are asynchronous (orbax
  copies the arrays to the host, then writes in a background thread while training goes on)
  and atomic (a temporary folder renamed once complete; a killed write leaves no checkpoint
  that is ever restored). Only the newest `keep` step checkpoints are kept; the stage
  checkpoints (`StageCheckpointer`) are separate and stay.

  Args:
    directory: `<workdir>/step_checkpoints`; created if missing.
    every_steps: steps between checkpoints (None: not by steps). every_minutes: minutes between
      checkpoints (None: not by time). Both None: only SIGTERM writes one.
    keep: step checkpoints kept (the newest).
  """

  def __init__(
    self,
    directory: str,
    every_steps: int | None = None,
    every_minutes: float | None = None,
    keep: int = 2,
  ):
    self.directory = os.path.abspath(directory)
    self.every_steps = every_steps
    self.every_minutes = every_minutes
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        enable_async_checkpointing=True,
        # The temporary folder of a write that was killed is removed when the folder is
        # opened (the workdir is locked: no other run writes there).
        cleanup_tmp_directories=True,
      ),
    )
    self._last_save = time.monotonic()

  def start_phase(self) -> None:
    """Restarts the clock of `every_minutes` (a phase begins)."""
    self._last_save = time.monotonic()

  def time_due(self) -> bool:
    """Whether `every_minutes` have passed since the last checkpoint (this process's clock)."""
    return bool(self.every_minutes) and (
      time.monotonic() - self._last_save >= 60.0 * self.every_minutes
    )

  def step_due(self, step: int, total_steps: int) -> bool:
    """Whether step `step` (1-based, of `total_steps`) is due by `every_steps` or is the last
    step of a phase with step checkpoints on."""
    if not (self.every_steps or self.every_minutes):
      return False
    return step == total_steps or bool(self.every_steps and step % self.every_steps == 0)

  def _ids(self, phase: int) -> list[int]:
    return sorted(
      s for s in self._manager.all_steps() if phase * PHASE_STRIDE <= s < (phase + 1) * PHASE_STRIDE
    )

  def latest(self, phase: int) -> int | None:
    """The newest complete step checkpoint of `phase` (its step within the phase), or None."""
    ids = self._ids(phase)
    return ids[-1] - phase * PHASE_STRIDE if ids else None

  def save(self, phase: int, step: int, items: dict[str, PyTree], meta: dict) -> None:
    """Starts writing step `step` of `phase` (returns once the arrays are copied to the host).

    Every process calls it (orbax's multi-process save; host NumPy leaves are written by
    the primary process). A checkpoint already on disk for this step is left as it is (the
    same state: a resumed run recomputes it exactly).

    Args:
      items: name -> pytree of arrays (jax or NumPy). meta: JSON-able dict (the loop's host
        state); the item names are added to it.
    """
    checkpoint_id = phase * PHASE_STRIDE + step
    if checkpoint_id in self._manager.all_steps():
      return
    args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
    args["meta"] = ocp.args.JsonSave(dict(meta, phase=phase, step=step, items=sorted(items)))
    self._manager.save(checkpoint_id, args=ocp.args.Composite(**args))
    self._last_save = time.monotonic()
    preemption.checkpoint_event("save")

  def restore(self, phase: int, step: int, like: dict[str, PyTree]) -> tuple[dict, dict]:
    """Reads step `step` of `phase`: (items shaped like `like`'s, meta).

    Only the items both saved and in `like` are read; `like` gives the shapes, dtypes and
    shardings (arrays or ShapeDtypeStructs).
    """
    checkpoint_id = phase * PHASE_STRIDE + step
    meta = self._manager.restore(
      checkpoint_id, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    )["meta"]
    names = [n for n in meta["items"] if n in like]
    args = {n: ocp.args.StandardRestore(like[n]) for n in names}
    items = self._manager.restore(checkpoint_id, args=ocp.args.Composite(**args)) if args else {}
    return {n: items[n] for n in names}, meta

  def discard(self, up_to_phase: int) -> None:
    """Deletes the step checkpoints of phases <= `up_to_phase` (superseded by a stage
    checkpoint or by the cached pre-trained model)."""
    self.wait()
    for checkpoint_id in self._manager.all_steps():
      if checkpoint_id < (up_to_phase + 1) * PHASE_STRIDE:
        self._manager.delete(checkpoint_id)

  def wait(self) -> None:
    """Blocks until the write in progress (if any) is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _this_process_only() -> ocp.options.MultiprocessingOptions:
  """Orbax options for a save done by one process alone (no barrier with the others)."""
  if jax.process_count() == 1:
    return ocp.options.MultiprocessingOptions()
  index = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=index, active_processes={index})


def save_params(
  path: str, params: PyTree, meta: dict | None = None, *, overwrite: bool = False
) -> None:
  """Writes a parameter tree (and a `meta.json`) to the folder `path` atomically.

  The tree goes to a temporary sibling folder first, renamed to `path` once complete
  (`utils.atomic_directory`). In a multi-process run only one process (the writer) calls it,
  with host (NumPy) params.

  Raises:
    FileExistsError: `path` already exists and not `overwrite` (checked before any work).
  """
  with utils.atomic_directory(path, if_exists="replace" if overwrite else "error") as tmp:
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
    checkpointer.save(os.path.join(tmp, "params"), params)
    checkpointer.wait_until_finished()
    with open(os.path.join(tmp, "meta.json"), "w") as f:
      json.dump(meta or {}, f, indent=2, sort_keys=True)


def load_params(path: str, params_like: PyTree | None = None) -> tuple[PyTree, dict]:
  """Reads a tree written by `save_params`. Returns (params, meta).

  Raises:
    FileNotFoundError: naming the missing folder.
  """
  path = os.path.abspath(path)
  if not os.path.isdir(os.path.join(path, "params")):
    raise FileNotFoundError(f"no parameter checkpoint at {path} (expected {path}/params)")
  checkpointer = ocp.StandardCheckpointer()
  if params_like is not None:
    params_like = jax.tree.map(ocp.utils.to_shape_dtype_struct, params_like)
  params = checkpointer.restore(os.path.join(path, "params"), params_like)
  meta_path = os.path.join(path, "meta.json")
  meta = {}
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      meta = json.load(f)
  return params, meta

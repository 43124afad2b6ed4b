"""Checkpoints with orbax: one per finished stage of the sequence, and the cached pre-trained model.

Layout of a workdir:
  checkpoints/<stage index>/{params, replay_state, meta}   (orbax CheckpointManager)
Stage 0 is the model after pre-training (or the loaded initial checkpoint); stage i the model
after downstream dataset i. Orbax writes each checkpoint into a temporary folder and renames
it when complete, so an interrupted run never leaves a half checkpoint that is later trusted.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

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

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

Integrity (docs/architecture.md "Stored state"): once orbax has finalized a checkpoint,
process 0 records every file's size and SHA-256 in the folder's manifest
(`owl_cl.integrity`); a checkpoint without one (killed between orbax's rename and the
manifest, or written before manifests existed) is not committed. On resume the newest
checkpoint is verified first; one that fails (a flipped bit, a cut or emptied file, garbage
in its metadata, no manifest) is set aside (`<id>.corrupt-<time>`, never deleted) with a
warning and the previous one is tried. No intact stage checkpoint left: `IntegrityError`
naming the file (nothing moved). A full disk: `DiskFullError` naming the folder and the
space needed, before the write where it can be foreseen; the previous checkpoint stays.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import os
import time
from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

from owl_cl import config_fields
from owl_cl import integrity
from owl_cl import preemption
from owl_cl import utils

PyTree = Any


# Full disks are named in `utils` (their path and device), where the cache entries' writers
# reach them too; re-exported here for the checkpoints' callers.
DiskFullError = utils.DiskFullError
is_disk_full = utils.is_disk_full
free_bytes = utils.free_bytes


def tree_bytes(tree: PyTree) -> int:
  """Bytes of the array leaves of `tree` (jax or NumPy; the global size of a sharded array)."""
  return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# Headroom on top of the arrays' bytes for a checkpoint's metadata files (orbax's
# _METADATA, zarr and OCDBT manifests: kilobytes for the trees here) and the manifest.
_METADATA_BYTES = 1 << 20


def check_free_space(directory: str, needed: int, what: str) -> None:
  """Raises `DiskFullError` if the device of `directory` has fewer than `needed` bytes free.

  Checked before a write so a full disk stops the run with one line, nothing half-written;
  the arrays are stored uncompressed, so `needed` is close to the size on disk. Every
  process calls it (process 0 measures, all decide alike).
  """
  # Process 0's figure on every process: all of them stop, or none (a collective write).
  free = free_bytes(directory) if jax.process_index() == 0 else None
  free = _agreed(-1 if free is None else free)
  if 0 <= free < needed:
    raise DiskFullError(directory, needed, free, what)


def _agreed(value: int) -> int:
  """Process 0's `value` on every process (one broadcast; the value itself with 1 process)."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  return int(np.asarray(multihost_utils.broadcast_one_to_all(np.int64(value))))


def _commit(step_dir: str) -> None:
  """Writes the manifest of a checkpoint orbax has finalized (process 0 only: the folder is
  shared, and orbax's finalize has waited for every process's files).

  Raises:
    DiskFullError: no space for the manifest (the checkpoint then stays uncommitted).
  """
  if jax.process_index() != 0:
    return
  try:
    integrity.write_manifest(step_dir)
  except OSError as e:
    if is_disk_full(e):
      raise DiskFullError(step_dir, _METADATA_BYTES, free_bytes(step_dir), "a manifest") from e
    raise


def newest_intact(
  directory: str, ids: list[int], what: Callable[[int], str], set_aside_all: bool
) -> int | None:
  """The newest of the checkpoints `ids` in `directory` whose files match their manifest.

  The newer ones that fail are set aside (`integrity.set_aside`: renamed to
  `<id>.corrupt-<time>`, never deleted) with a warning naming the file and the fallback.
  Process 0 checks and renames; every process gets its choice (one broadcast).

  Args:
    directory: the orbax folder holding `<id>/` folders.
    ids: the checkpoint ids to consider (any order).
    what: id -> a name for the messages ('stage 2', 'step 5 of phase 1').
    set_aside_all: when none is intact, set them all aside (step checkpoints: the phase
      restarts from its stage) instead of raising (stage checkpoints).

  Returns:
    The intact id, or None when `ids` is empty or (`set_aside_all`) none is intact.

  Raises:
    owl_cl.integrity.IntegrityError: none is intact and not `set_aside_all`; it names the
      newest one's bad file, and nothing is moved.
  """
  chosen, failures = -1, []
  if jax.process_index() == 0:
    for checkpoint_id in sorted(ids, reverse=True):
      step_dir = os.path.join(directory, str(checkpoint_id))
      try:
        integrity.verify_directory(step_dir)
      except integrity.IntegrityError as e:
        failures.append((checkpoint_id, step_dir, e))
        continue
      chosen = checkpoint_id
      break
    if failures and (chosen >= 0 or set_aside_all):
      fallback = what(chosen) if chosen >= 0 else "none: the phase starts over"
      for checkpoint_id, step_dir, e in failures:
        logging.warning(
          "the checkpoint of %s failed its integrity check (%s); falling back to %s",
          what(checkpoint_id),
          e,
          fallback,
        )
        integrity.set_aside(step_dir, str(e))
    elif failures:
      chosen = -2
  chosen = _agreed(chosen)
  if chosen == -2:
    if failures:
      _, step_dir, e = failures[0]
      raise integrity.IntegrityError(
        e.path,
        f"{e.reason}; no intact checkpoint is left in {directory} (the newest, "
        f"{step_dir}, is not trusted and nothing was moved): restore it, or move it away to "
        "redo its work",
      )
    raise integrity.IntegrityError(directory, "no intact checkpoint left (see process 0)")
  return None if chosen < 0 else chosen


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
    """Index of the newest intact stage checkpoint, or None when there is none.

    Newer ones that fail their manifest check (or have none: not committed) are set aside
    with a warning (`newest_intact`).

    Raises:
      owl_cl.integrity.IntegrityError: stage checkpoints exist but none is intact (names the
        newest one's bad file; nothing is moved).
    """
    self._manager.reload()
    ids = list(self._manager.all_steps())
    stage = newest_intact(self.directory, ids, lambda i: f"stage {i}", set_aside_all=False)
    if stage is not None and stage != max(ids):
      self._manager.reload()  # the newer ones were renamed
    return stage

  def save(self, stage: int, params: PyTree, replay_state: PyTree | None, meta: dict) -> None:
    """Writes stage `stage` and its manifest (blocking until both are on disk).

    Raises:
      ValueError: if a checkpoint of this stage already exists (nothing is overwritten).
      DiskFullError: fewer bytes free than the arrays take (checked first: nothing is
        written), or the device filled during the write (the stage is not committed).
    """
    if stage in self._manager.all_steps():
      raise ValueError(f"checkpoint of stage {stage} already exists in {self.directory}")
    what = f"the checkpoint of stage {stage}"
    needed = tree_bytes(params) + tree_bytes(replay_state) + _METADATA_BYTES
    check_free_space(self.directory, needed, what)
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
    if replay_state is not None:
      items["replay_state"] = ocp.args.StandardSave(replay_state)
    try:
      self._manager.save(stage, args=ocp.args.Composite(**items))
      self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      if is_disk_full(e):
        raise DiskFullError(self.directory, needed, free_bytes(self.directory), what) from None
      raise
    _commit(os.path.join(self.directory, str(stage)))

  def restore(
    self, stage: int, params_like: PyTree, replay_state_like: PyTree | None
  ) -> tuple[PyTree, PyTree | None, dict]:
    """Reads stage `stage` into trees shaped like the given ones (arrays or abstract).

    Call `latest_stage` first: it verified the files against the manifest.
    """
    items = {"params": ocp.args.StandardRestore(params_like), "meta": ocp.args.JsonRestore()}
    if replay_state_like is not None:
      items["replay_state"] = ocp.args.StandardRestore(replay_state_like)
    restored = self._manager.restore(stage, args=ocp.args.Composite(**items))
    replay_state = restored["replay_state"] if replay_state_like is not None else None
    return restored["params"], replay_state, restored["meta"]

  def close(self) -> None:
    self._manager.close()


# Step checkpoint ids: phase * PHASE_STRIDE + step (orbax numbers checkpoints with one int);
# ids grow over a run, so orbax's "keep the newest" pruning keeps the newest steps. The step
# fields' rule (`config_fields.STEPS`) keeps a step below it.
PHASE_STRIDE = config_fields.PHASE_STRIDE


class StepCheckpointer:
  """Checkpoints within a training phase (pre-training = phase 0, dataset i = phase i).

  A checkpoint is due every `every_steps` steps, when `every_minutes` have passed since the
  last one (or since the phase began), and at a phase's last step when either is set; SIGTERM
  makes one due at once (`owl_cl.trainer.checkpoint_hook`). Writes are asynchronous (orbax
  copies the arrays to the host, then writes in a background thread while training goes on)
  and atomic (a temporary folder renamed once complete; a killed write leaves no checkpoint
  that is ever restored).

  Commit: a checkpoint counts once its manifest is written (`poll`, at the first step after
  orbax finished it; at the latest before the next one starts). Orbax keeps the newest
  `keep` (>= 2) folders, so the previous committed checkpoint stays until the next is
  committed, and a kill at any moment loses at most the work since the previous due one.
  The stage checkpoints (`StageCheckpointer`) are separate and stay.

  Args:
    directory: `<workdir>/step_checkpoints`; created if missing.
    every_steps: steps between checkpoints (None: not by steps). every_minutes: minutes between
      checkpoints (None: not by time). Both None: only SIGTERM writes one.
    keep: step checkpoints kept (the newest; at least 2).

  Raises:
    ValueError: keep < 2.
  """

  def __init__(
    self,
    directory: str,
    every_steps: int | None = None,
    every_minutes: float | None = None,
    keep: int = 2,
  ):
    if keep < 2:
      raise ValueError(f"keep={keep}: at least 2 (the committed one stays during a write)")
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
    # (checkpoint id, bytes) of the write started and not yet committed (no manifest yet).
    self._pending: tuple[int, int] | None = None

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
    """The newest intact step checkpoint of `phase` (its step within the phase), or None.

    Checked against its manifest (`newest_intact`): a newer one that fails, or that was never
    committed, is set aside with a warning; when none is intact the phase starts over.
    """
    self._manager.reload()
    ids = self._ids(phase)
    what = lambda i: f"step {i - phase * PHASE_STRIDE} of phase {phase}"
    found = newest_intact(self.directory, ids, what, set_aside_all=True)
    if ids and found != ids[-1]:
      self._manager.reload()  # the newer ones were renamed
    return None if found is None else found - phase * PHASE_STRIDE

  def save(self, phase: int, step: int, items: dict[str, PyTree], meta: dict) -> None:
    """Starts writing step `step` of `phase` (returns once the arrays are copied to the host).

    The previous write is committed first (waited for, its manifest written). Every process
    calls it (orbax's multi-process save; host NumPy leaves are written by the primary
    process). A checkpoint already on disk for this step is left as it is (the same state: a
    resumed run recomputes it exactly).

    Args:
      items: name -> pytree of arrays (jax or NumPy). meta: JSON-able dict (the loop's host
        state); the item names are added to it.

    Raises:
      DiskFullError: fewer bytes free than the arrays take (checked before the write: nothing
        is started), or the device filled during the previous write.
    """
    checkpoint_id = phase * PHASE_STRIDE + step
    self.wait()
    if checkpoint_id in self._manager.all_steps():
      return
    needed = tree_bytes(items) + _METADATA_BYTES
    check_free_space(self.directory, needed, f"the checkpoint of step {step} (phase {phase})")
    args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
    args["meta"] = ocp.args.JsonSave(dict(meta, phase=phase, step=step, items=sorted(items)))
    self._pending = (checkpoint_id, needed)
    self._manager.save(checkpoint_id, args=ocp.args.Composite(**args))
    self._last_save = time.monotonic()
    preemption.checkpoint_event("save")

  def poll(self) -> None:
    """Commits the write in progress if orbax has finished it (called after every step;
    free while a write runs or none is pending).

    Raises:
      DiskFullError: the write failed for lack of space.
    """
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self.wait()

  def restore(self, phase: int, step: int, like: dict[str, PyTree]) -> tuple[dict, dict]:
    """Reads step `step` of `phase`: (items shaped like `like`'s, meta).

    Only the items both saved and in `like` are read; `like` gives the shapes, dtypes and
    shardings (arrays or ShapeDtypeStructs). Call `latest` first: it verified the files.
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
    """Blocks until the write in progress (if any) is on disk, then commits it (manifest).

    Raises:
      DiskFullError: the write (or its manifest) failed for lack of space; that checkpoint
        is not committed, the previous one stays.
    """
    pending, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
    except (OSError, ValueError) as e:
      if pending is not None and is_disk_full(e):
        free = free_bytes(self.directory)
        raise DiskFullError(self.directory, pending[1], free, "a step checkpoint") from None
      raise
    if pending is not None:
      step_dir = os.path.join(self.directory, str(pending[0]))
      # Orbax logs and skips the finalization of a write that failed in its thread on the
      # primary process (no exception here): no folder, nothing to commit.
      if os.path.isdir(step_dir):
        _commit(step_dir)

  def close(self) -> None:
    self.wait()
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

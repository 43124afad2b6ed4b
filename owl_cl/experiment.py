"""One continual-learning run, told as a story: `run(config, workdir)`.

  1 checks     every config check and, for the paper's protocol, every input file
               (`validation`), before any work
  2 data       the benchmark: pre-training set, held-out classes, downstream sequence
               (`benchmark`)
  3 model      the detector (`detector.Detector`) and its parameters: `init_checkpoint`, or
               pre-trained here on the built-in benchmark and cached (`pretrained`)
  4 buffer     selection over the pre-training set -> host ReplayStore (cached;
               `replay.setup.build_store`)
  5 stages     for each downstream dataset (or, `train.schedule='joint'`, once for all of
               them; 'per_task': each from the pre-trained model): retrieval + DER++
               training (`trainer`), evaluation, stage checkpoint
  6 results    results.json / results.md in the workdir, TensorBoard scalars

Resuming: every finished stage is checkpointed (orbax) together with the metrics so far, and
within pre-training and each dataset the training loop writes step checkpoints
(`checkpoint.every_minutes`, 10 by default, / `every_steps`, and on SIGTERM); the same
command on the same workdir restores the newest of them and goes on from there, ending with
the results an uninterrupted run would have had. Every checkpoint is verified against its
manifest first; a bad one is set aside and the previous one used (`checkpointing`), an
unreadable results.json is rebuilt from them, and a full disk stops the run with one line
(docs/architecture.md "Stored state"). SIGTERM saves a step checkpoint at the next step boundary
(or stops after the stage checkpoint in progress) and raises `preemption.Preempted`
(`owl_cl.main` exits with status `preemption.EXIT_PREEMPTED`); results.json then says
'preempted'. A workdir that holds a run of a different config is refused (nothing is
overwritten).

One run per workdir: the run holds `<workdir>/.owl_cl.lock` (`utils.workdir_lock`); a second
one is refused at once with the holder's pid and host, and the lock of a killed run is taken
over. A bad config is refused before anything is written; data problems before `run.json`
claims the workdir (so the corrected command is not "a different config").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging as py_logging
import os
import time
from typing import Any
import uuid

from absl import logging
import jax
import ml_collections

from owl_cl import benchmark as benchmark_lib
from owl_cl import cache_keys
from owl_cl import config_spec
from owl_cl import distributed
from owl_cl import phases
from owl_cl import preemption
from owl_cl import pretrained
from owl_cl import run_log
from owl_cl import trainer
from owl_cl import utils
from owl_cl import validation
from owl_cl.config_fields import DATA_KEY_STRIDE
from owl_cl.config_fields import SEED_PARTS
from owl_cl.config_fields import ConfigError
from owl_cl.configs import base
from owl_cl.detector import Detector
from owl_cl.eval import detection_files
from owl_cl.eval import provenance as provenance_lib
from owl_cl.eval import results as results_lib
from owl_cl.eval_spec import EvalSpec
from owl_cl.model.convert import CheckpointMismatchError
from owl_cl.replay import setup as replay_setup
from owl_cl.replay import spec as replay_spec
from owl_cl.summary_writer import SummaryWriter
from owl_cl.train import checkpointing
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import wise_ft
from owl_cl.train.checkpoint_spec import CheckpointSpec
from owl_cl.utils import atomic_write_json
from owl_cl.utils import expand_path

# Longest wait of a process for the others at the end of a dataset: a stage's training and
# evaluation run in lockstep (collectives), so the processes arrive within seconds; a peer
# that is gone or hung turns into an error naming it instead of a hang.
BARRIER_TIMEOUT_S = 1800.0

# Why a run resumed from stage checkpoints of a version that recorded no commit has none.
UNRECORDED = "the run's first stage was computed by a version of owl_cl that recorded none"

# The LoRA adapters' seed is seed_of(config, 'data') * 1000 + this: the dataset step keys use
# seed * 1000 + index with index <= the sequence's length, so the two never coincide.
LORA_SEED_OFFSET = DATA_KEY_STRIDE - 1


def check_workdir(workdir: str, config: ml_collections.ConfigDict) -> str:
  """Creates or validates `workdir/run.json`; returns the run id.

  Raises:
    ConfigError: the workdir holds a run of another config (it would be overwritten).
  """
  existing = existing_run(workdir, config)
  if existing is not None:
    return existing["run_id"]
  os.makedirs(workdir, exist_ok=True)
  run_id = uuid.uuid4().hex
  config_json = json.loads(config.to_json_best_effort())
  atomic_write_json(
    os.path.join(workdir, "run.json"),
    {"run_id": run_id, "config": config_json},
    indent=2,
    sort_keys=True,
  )
  return run_id


def _flat(tree: dict, prefix: str = "") -> dict:
  """{'a.b': v} of a nested dict (config JSON); an empty dict stays one leaf."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _default_config_json() -> dict:
  """configs/base.py's config as JSON: the defaults every config field starts from (its own,
  'builtin1': without the default benchmark's settings, `base.apply_builtin_v2`)."""
  return json.loads(base.get_config("builtin1").to_json_best_effort())


# Config fields a resumed run may change: the checkpoint section's (`CheckpointSpec`), which
# decide when checkpoints are written, never what is computed (a resumed run's results equal
# the uninterrupted run's), so a run begun before `checkpoint.every_minutes` had a default, or
# with another interval, is resumed as it is.
RESUMABLE_FIELDS = frozenset(config_spec.rules(CheckpointSpec, "checkpoint"))


def read_run_json(run_file: str) -> dict:
  """The record `check_workdir` wrote: {'run_id': str, 'config': dict}.

  Raises:
    ConfigError: the file cannot be read or is not such a record (named, with the cause: it
      is what ties the workdir's checkpoints and results to one config, so the run cannot
      go on without it).
  """
  try:
    with open(run_file, encoding="utf-8") as f:
      existing = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(
      f"{run_file} cannot be read ({e}): it records the config of the run this workdir holds; "
      "restore it (e.g. from a backup) to resume, or use another --workdir"
    ) from None
  if not (
    isinstance(existing, dict)
    and isinstance(existing.get("run_id"), str)
    and isinstance(existing.get("config"), dict)
  ):
    raise ConfigError(
      f"{run_file} is not a run record (expected 'run_id' and 'config'); restore it to "
      "resume, or use another --workdir"
    )
  return existing


def existing_run(workdir: str, config: ml_collections.ConfigDict) -> dict | None:
  """The `workdir/run.json` record of a run of `config` (None: no run yet). Writes nothing.

  A field that did not exist when the run began (absent from its `run.json`) is accepted at
  its default (configs/base.py): fields are added with defaults that keep earlier results
  (docs/architecture.md "Principles"), so the run goes on as it began; the checkpoint
  intervals (`RESUMABLE_FIELDS`) may differ; any other difference is refused.

  Raises:
    ConfigError: the workdir holds a run of another config (it would be overwritten), or its
      run.json cannot be read (`read_run_json`).
  """
  run_file = os.path.join(workdir, "run.json")
  if not os.path.exists(run_file):
    return None
  config_json = json.loads(config.to_json_best_effort())
  existing = read_run_json(run_file)
  if existing.get("config") != config_json:
    old, new = _flat(existing.get("config") or {}), _flat(config_json)
    defaults = _flat(_default_config_json())
    missing = object()
    changed = sorted(
      k
      for k in set(old) | set(new)
      if old.get(k, missing) != new.get(k, missing)
      and not (k not in old and k in defaults and new.get(k) == defaults[k])
      and k not in RESUMABLE_FIELDS
    )
    if changed:
      raise ConfigError(
        f"workdir {workdir} holds a run of a different config (differing fields: "
        f"{changed}); use another --workdir or the same config to resume it"
      )
    logging.info("run.json predates config fields now at their defaults; resuming the run")
  return existing


def remove_stale_temporaries(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Clears the leftovers of killed writes: the workdir's (it is locked: all of them are
  stale) and the caches' (only old ones: a cache is shared with concurrent runs)."""
  for folder in (workdir, os.path.join(workdir, "records")):
    utils.remove_stale_temporaries(folder, min_age_seconds=0.0)
  cache = expand_path(config.cache_dir)
  caches = ("builtin", "pretrained", "buffers", "data_scan")
  for folder in (cache, *(os.path.join(cache, f) for f in caches)):
    utils.remove_stale_temporaries(folder)
  # The replay image cache's folders are created the same way (replay/images.py).
  image_cache = replay_setup.image_cache_dir(config)
  if image_cache:
    utils.remove_stale_temporaries(image_cache)


def compilation_cache_dir(config: ml_collections.ConfigDict) -> str:
  """The XLA compilation cache folder: `compilation_cache_dir`, None = `<cache_dir>/xla`,
  '' = none (returned as '')."""
  folder = config.compilation_cache_dir
  if folder is None:
    return os.path.join(expand_path(config.cache_dir), "xla")
  return expand_path(folder) if folder else ""


# Free space below which the compilation cache is read but not written: an XLA executable of
# the runs here is kilobytes to a few MiB, so a write into less would likely fail mid-run
# with JAX's warning, which does not name the folder.
COMPILATION_CACHE_MIN_FREE = 64 << 20


def enable_compilation_cache(folder: str) -> bool:
  """Points JAX's persistent compilation cache at `folder`; returns whether it is written.

  Programs compiled in over 1 s are written there, except where the folder cannot be written
  (a read-only cache: `os.access` on it, or its nearest existing parent) or its device has
  under `COMPILATION_CACHE_MIN_FREE` bytes free: then the programs it holds are read and
  none is written, with one log line naming the folder and its device. JAX's cache reports
  a failed write as a Python warning and goes on, so a disk that fills later costs no run.
  """
  write = True
  if not os.access(utils.nearest_existing(folder), os.W_OK):
    logging.warning(
      "the compilation cache %s cannot be written (read-only): its programs are read, no new "
      "one is written",
      folder,
    )
    write = False
  else:
    free = utils.free_bytes(folder)
    if free is not None and free < COMPILATION_CACHE_MIN_FREE:
      logging.warning(
        "the compilation cache %s has %.1f MiB free on the device mounted at %s (under %d "
        "MiB): its programs are read, no new one is written; free space there to cache them",
        folder,
        free / 2**20,
        utils.mount_point(folder),
        COMPILATION_CACHE_MIN_FREE >> 20,
      )
      write = False
  if write or os.path.isdir(folder):
    jax.config.update("jax_compilation_cache_dir", folder)
    # An infinite minimum compile time: JAX then never writes an entry, and still reads.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0 if write else float("inf"))
  return write


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs (or resumes) the experiment of `config` in `workdir`. Returns the results dict.

  Raises:
    ConfigError: a config value that cannot be used, or a workdir holding another run.
    MissingInputsError: the paper's protocol with missing inputs (all of them listed).
    WorkdirLockedError: another process runs in `workdir` (its pid and host named).
    TrainingDivergedError: a non-finite loss or gradient norm (the last stage checkpoint
      stays; results.json is not marked complete).
    owl_cl.integrity.IntegrityError: stage checkpoints exist and none matches its manifest
      (a bad newer one falls back to an older one with a warning instead).
    owl_cl.utils.DiskFullError: no space left on a device (the workdir's, the cache's: named
      by the path written and its mount point, with the space needed when known); the
      committed checkpoints stay: the same call resumes once space is freed.
    owl_cl.utils.ReadOnlyCacheError: the cache cannot be written and lacks an entry the run
      needs, or holds it damaged (the built-in benchmark and the pre-trained model are
      checked before anything is written; the replay buffer when it is reached).
    owl_cl.preemption.Preempted: SIGTERM; a step (or stage) checkpoint was saved and
      results.json says 'preempted'. The same call resumes.
  """
  py_logging.getLogger("absl").setLevel(py_logging.INFO)
  workdir = expand_path(workdir)
  # Init / resume order, the same on every start:
  #   1. validate the config (and the real data's files) and build the detector before
  #      anything is written;
  #   2. load the benchmark and check the sequence and every image and annotation (cached),
  #      read the init checkpoint, then lock the workdir (a second run is refused) and claim
  #      it (run.json; a workdir of another config is refused): a run refused for its config,
  #      data or init checkpoint writes nothing;
  #   3. benchmark, detector, starting parameters (init_checkpoint > cached pre-trained
  #      model > pre-train now) and the replay store: all deterministic in the config, so
  #      rebuilt (or read from the caches) identically on a resume;
  #   4. the last finished stage's checkpoint, if any, replaces the starting parameters and
  #      replay state (stage 0 = evaluated after pre-training); training goes on after it.
  validation.validate(config, workdir)
  replay_setup.check_replay_config(config)
  # Built before anything is written: its checks (the tokenizer's vocabulary files and size,
  # prompt templates) then refuse a run with the workdir left free, not after run.json.
  detector = Detector(config)
  existing_run(workdir, config)
  if distributed.is_writer():
    utils.check_workdir_free(workdir)  # at once, before the data checks (they can take long)
  bench = benchmark_lib.load_benchmark(config)
  validation.check_sequence_config(config, bench)
  validation.check_data(config, bench)  # every image decoded once (cached by content)
  # An init checkpoint is read before the workdir is locked or claimed too: one of another
  # model (a scenic file's parameters are known only once read) is refused with it free.
  init = read_init_checkpoint(detector, bench)
  if init is None:  # a read-only cache without the pre-trained model: refused with nothing written
    pretrained.check_read_only_cache(detector, bench)
  # After the checks: nothing (not even the compilation cache's folder or the lock file) is
  # written to the workdir for a bad config or bad data. One run per workdir: a second one is
  # refused before it writes anything; on several hosts (one workdir on a shared file
  # system), process 0 holds the lock.
  writer_process = distributed.is_writer()
  lock = utils.workdir_lock(workdir) if writer_process else contextlib.nullcontext()
  with lock:
    if writer_process:
      remove_stale_temporaries(config, workdir)
    distributed.barrier("workdir-ready")
    compilation_cache = compilation_cache_dir(config)
    if compilation_cache:
      enable_compilation_cache(compilation_cache)
    # Repeated warnings of one kind: the first of each period shown, the rest counted and
    # summarised at the period's end (`run_log`); each stage's metrics logged as one line.
    with preemption.handle_sigterm(), run_log.summarised_warnings() as repeats:
      try:
        return _run(config, workdir, bench, detector, init, repeats)
      except (OSError, ValueError) as e:
        # A full disk anywhere in the workdir (results, TensorBoard, records): one line naming
        # the file; the checkpoints' own writes name their space needed (DiskFullError).
        if isinstance(e, checkpointing.DiskFullError) or not checkpointing.is_disk_full(e):
          raise
        path = getattr(e, "filename", None) or workdir
        free = checkpointing.free_bytes(path)
        raise checkpointing.DiskFullError(path, None, free, "a file of the run") from None


def read_init_checkpoint(detector: Detector, bench: benchmark_lib.Benchmark):
  """(params, meta) of `config.init_checkpoint` (`pretrained.pretrained_params`); None when
  it is not set.

  Raises:
    CheckpointMismatchError: a checkpoint of another model (its parameters named).
    ConfigError: a file or folder that cannot be read as a checkpoint (names the field, the
      path and the reader's reason).
  """
  init_checkpoint = detector.run.init_checkpoint
  if not init_checkpoint:
    return None
  try:
    return pretrained.pretrained_params(detector, bench, None)
  except CheckpointMismatchError:
    raise
  except (ValueError, OSError) as e:
    raise ConfigError(
      f"config.init_checkpoint={expand_path(init_checkpoint)} cannot be read: {e}"
    ) from e


def _run(
  config: ml_collections.ConfigDict,
  workdir: str,
  bench: benchmark_lib.Benchmark,
  detector: Detector,
  init: tuple[Any, dict] | None = None,
  repeats: run_log.RepeatedWarnings | None = None,
) -> dict:
  """`run` after the checks of the config and the data, with the workdir locked; `init` the
  (params, meta) of `config.init_checkpoint`, read by `run` (None: none is set); `repeats`
  the run's warning filter, summarised after each stage (None: nothing summarised)."""
  session = _open_session(config, workdir, bench, detector, init)
  params, replay_state, latest = session.restore_or_start()
  schedule = detector.train_spec.schedule
  names = stage_names(schedule, bench)
  # The stages finished so far (on a resume, those of the checkpoint): one line each.
  for index, stage in enumerate(session.stages):
    _log_stage(repeats, names, index, stage)
  if schedule != "per_task" and not detector.train_spec.lwf.on and not session.blend_base:
    # Only a per-task run (every task starts from them), LwF (the teacher) and WiSE-FT of full
    # fine-tuning read the pre-trained parameters after stage 0: not a second copy otherwise.
    session.pretrained = None
  session.write("running")
  try:
    for index in range(latest + 1, len(names) + 1):
      # A SIGTERM during an evaluation or a stage checkpoint stops here, after it.
      stop_if_preempted(f"after stage {index - 1}")
      params, replay_state = session.run_stage(index, params, replay_state)
      _log_stage(repeats, names, index, session.stages[-1])
  except preemption.Preempted:
    session.write("preempted")
    session.close()
    raise
  results = session.write("complete")
  session.close()
  logging.info("results: %s", os.path.join(workdir, "results.md"))
  return results


def _log_stage(repeats: run_log.RepeatedWarnings | None, names: list[str], index: int, stage):
  """Summarises the warnings repeated during stage `index` (0: pre-training, the buffer and the
  evaluation after them), then logs the stage's metrics line (`run_log.metrics_line`)."""
  when = "pre-training" if index == 0 else f"{stage['name']} (stage {index} of {len(names)})"
  if repeats is not None:
    repeats.summarise(when)
  logging.info("%s", run_log.metrics_line(when, stage["metrics"]))


def stage_names(schedule: str, bench: benchmark_lib.Benchmark) -> list[str]:
  """The stages after pre-training, by `schedule` (`train.schedule`): each dataset of the
  sequence ('sequence', 'per_task'), or the one joint stage ('joint')."""
  if schedule == "joint":
    return [phases.JOINT]
  return [d.name for d in bench.sequence]


def stage_eval_sets(
  schedule: str, settings: EvalSpec, bench: benchmark_lib.Benchmark, index: int
) -> list[str]:
  """The eval sets evaluated after stage `index` (1-based) by `schedule` (`train.schedule`).
  'sequence': as `benchmark.eval_names_after` with `settings` (`config.eval`); 'joint': every
  set (its one stage is the last); 'per_task': the task's own dataset and the pre-training
  and held-out sets (what one task's model keeps; the other datasets are not its task)."""
  if schedule == "joint":
    return benchmark_lib.eval_names_after(settings, bench, len(bench.sequence))
  if schedule == "per_task":
    return [bench.pretrain_eval, bench.held_out_eval, bench.sequence[index - 1].name]
  return benchmark_lib.eval_names_after(settings, bench, index)


def _open_session(config, workdir, bench, detector, init) -> _Session:
  """The run's writers and checkpointers, its starting parameters (`init`, else the cached or
  freshly pre-trained model), LwF's teacher and the replay store (built or read from cache)."""
  wall_start = time.time()
  # One writer (process 0): run.json, results, records and TensorBoard; every process takes
  # part in the computation and in the orbax stage checkpoints (multi-process saves).
  is_writer = distributed.is_writer()
  run_id = check_workdir(workdir, config) if is_writer else None
  if is_writer:
    # This run's results.json / results.md, unreadable (cut, garbage): set aside, and
    # rebuilt from the stage checkpoints by the first `write`.
    results_lib.set_aside_unreadable(workdir)
  writer = SummaryWriter(os.path.join(workdir, "tensorboard")) if is_writer else None
  checkpoint = config_spec.from_config(CheckpointSpec, config.checkpoint, "checkpoint")
  step_checkpoints = checkpointing.StepCheckpointer(
    os.path.join(workdir, "step_checkpoints"),
    every_steps=checkpoint.every_steps,
    every_minutes=checkpoint.every_minutes,
  )
  params, pretrain_meta = init or pretrained.pretrained_params(
    detector, bench, writer, step_checkpoints
  )
  store, buffer_stats = None, None
  if detector.replay_spec.algorithm != replay_spec.NO_REPLAY:
    # The buffer's key converts the config's sections itself (`cache_keys`).
    key = cache_keys.buffer_key_material(config, bench.pretrain.train, pretrain_meta)
    store, buffer_stats = replay_setup.build_store(detector, bench, params, key_material=key)
  seeds = detector.run
  replay_state = replay_setup.initial_replay_state(
    store, seeds.seed_of("retrieval"), detector.replay_spec
  )
  # LoRA (docs/lora.md): the pre-trained parameters are the frozen base of the whole run (the
  # buffer above was built from them alone); fresh adapters (B = 0: the same model) train from
  # stage 1 on: carried from stage to stage ('sequence'), or fresh for each task ('per_task':
  # every stage starts from `_Session.pretrained`). The stage checkpoints hold the adapters:
  # the base is rebuilt from init_checkpoint or the pre-trained cache on a resume.
  # The adapters' A draw: the data seed (as the step keys) offset from the step keys' seeds.
  params = detector.add_adapters(params, seeds.seed_of("data") * DATA_KEY_STRIDE + LORA_SEED_OFFSET)
  if jax.process_count() > 1:
    # Made on one local device; orbax's multi-process save takes host (NumPy) or global arrays.
    replay_state = sharding_lib.fetch_replicated(replay_state)
  return _Session(
    # What results.json records of the config (its "config"); the session reads the detector's
    # typed settings.
    config_json=json.loads(config.to_json_best_effort()),
    workdir=workdir,
    bench=bench,
    detector=detector,
    run_id=run_id,
    writer=writer,
    checkpointer=checkpointing.StageCheckpointer(
      os.path.join(workdir, "checkpoints"), max_to_keep=checkpoint.max_to_keep
    ),
    step_checkpoints=step_checkpoints,
    pretrained=params,
    initial_replay=replay_state,
    pretrain_meta=pretrain_meta,
    store=store,
    buffer_stats=buffer_stats,
    wall_start=wall_start,
    provenance=provenance_lib.code_provenance(),
  )


@dataclasses.dataclass
class _Session:
  """One run's fixed parts (the config as results.json records it, data, detector, writers,
  checkpointers, the pre-trained parameters and the initial replay state, the store) and what
  it accumulates: the stages' results and the step timings ({dataset name: `timing.summarize`
  of its steps}: wall-clock figures, kept apart from the stages' training summaries, which two
  runs reproduce exactly, and carried in the stage checkpoints' meta; a stage resumed from a
  step checkpoint summarises the steps run after the resume). It reads the run's settings
  from the detector's typed specs (`Detector.run`, `.train_spec`, ...), never the config.
  """

  config_json: dict
  workdir: str
  bench: benchmark_lib.Benchmark
  detector: Detector
  run_id: str | None
  writer: SummaryWriter | None
  checkpointer: checkpointing.StageCheckpointer
  step_checkpoints: checkpointing.StepCheckpointer
  pretrained: Any
  initial_replay: Any
  pretrain_meta: dict
  store: Any
  buffer_stats: dict | None
  wall_start: float
  # This process's code (`provenance_lib.code_provenance`): recorded in each stage it computes.
  provenance: dict = dataclasses.field(default_factory=dict)
  stages: list = dataclasses.field(default_factory=list)
  step_timings: dict = dataclasses.field(default_factory=dict)

  def evaluate(self, params, stage_name: str, names=None) -> dict:
    """A stage's evaluation of `params` on the eval sets `names` (None: every one):
    {'metrics': {eval set: metrics}, 'per_class': {eval set: {class name: AP values}}}."""
    metrics, per_class = {}, {}
    save = self.detector.eval_spec.save_detections
    for name, dataset in self.bench.eval_sets():
      if names is None or name in names:
        desc = f"eval {name} @ {stage_name}"
        metrics[name] = self.detector.evaluate_dataset(
          params, dataset, desc, per_class=True, return_detections=save
        )
        per_class[name] = metrics[name].pop("per_class")
        if save and self.run_id is not None:  # the writer process (eval.save_detections)
          path = detection_files.detections_path(self.workdir, stage_name, name)
          detection_files.write_detections(path, metrics[name].pop("detections"))
        metrics[name].pop("detections", None)
    return {"metrics": metrics, "per_class": per_class}

  @property
  def wise_ft_spec(self) -> wise_ft.WiseFtSpec:
    """`train.wise_ft`, the WiSE-FT blend after the stages (off at alpha 1)."""
    return self.detector.train_spec.wise_ft

  @property
  def blend_base(self) -> bool:
    """Whether WiSE-FT reads the pre-trained parameters after stage 0 (a LoRA run's blend
    scales its adapters and needs none)."""
    return self.wise_ft_spec.on and self.detector.lora is None

  def stored(self, params):
    """The part of `params` a stage checkpoint holds: all of it, or (LoRA) the adapters."""
    return params if self.detector.lora is None else trainer.LORA_ADAPTERS.part(params)

  def from_stored(self, restored):
    """The parameters of a restored stage checkpoint (`stored`'s inverse): LoRA's adapters
    joined with the frozen base (the pre-trained parameters', bit for bit)."""
    if self.detector.lora is None:
      return restored
    return trainer.LORA_ADAPTERS.join(self.pretrained, restored)

  def restore_or_start(self):
    """(params, replay state, last finished stage): the newest stage checkpoint's, or the
    pre-trained model evaluated and saved as stage 0."""
    latest = self.checkpointer.latest_stage()
    if latest is None:
      self.stages = [
        {
          "name": "pretrained",
          **self.evaluate(self.pretrained, "pretrained"),
          "provenance": self.provenance,
        }
      ]
      meta = {"stages": self.stages, **replay_setup.CHECKPOINT_FORMAT}
      self.checkpointer.save(0, self.stored(self.pretrained), self.initial_replay, meta)
      return self.pretrained, self.initial_replay, 0
    logging.info("resuming %s after stage %d", self.workdir, latest)
    restored, replay_state, meta = self.checkpointer.restore(
      latest, self.stored(self.pretrained), self.initial_replay
    )
    params = self.from_stored(restored)
    replay_state = replay_setup.upgrade_restored_state(replay_state, meta, self.workdir)
    self.stages = meta["stages"]
    self.step_timings = meta.get("step_timings", {})
    return params, replay_state, latest

  def results(self, status: str) -> dict:
    """The results dict (`results_lib.write_results`' input) with `status`."""
    bench, meta, run = self.bench, self.pretrain_meta, self.detector.run
    results = {
      "run_id": self.run_id,
      "status": status,
      "algorithm": run.experiment_name,
      "retrieval": self.detector.replay_spec.algorithm,
      "schedule": self.detector.train_spec.schedule,
      "seed": run.seed,
      # The seed of each part (config_fields.seed_of): model, data, retrieval.
      "seeds": {part: run.seed_of(part) for part in SEED_PARTS},
      "sequence": [d.name for d in bench.sequence],
      # The stored order (suite, name, index, datasets) or None: sequence_seed's shuffle.
      "task_order": bench.task_order,
      "sequence_seed": run.sequence_seed,
      # The built-in benchmark's version (1 or 2) when the run reads any of its datasets,
      # else None; the report refuses to mix versions.
      "builtin_version": bench.builtin_version,
      "eval_sets": {
        "pretrain": bench.pretrain_eval,
        "held_out": bench.held_out_eval,
        "zero_shot": [d.name for d in bench.zero_shot],
        "downstream": [d.name for d in bench.sequence],
        **({"extra": [d.name for d in bench.extra_evals]} if bench.extra_evals else {}),
      },
      "stages": self.stages,
      "config": self.config_json,
      "pretraining": {k: meta.get(k) for k in ("seconds", "curve", "validation")},
      "timings": {
        "pretrain_seconds": meta.get("seconds"),
        "wall_seconds": round(time.time() - self.wall_start, 1),
        # Per dataset: steps, mean / median seconds of step_seconds, embed, retrieval,
        # train_step, host_idle, gather, input, and host_idle_fraction (owl_cl.train.timing).
        "step_timings": self.step_timings,
      },
      "buffer": self.buffer_stats,
      # The code that started the run (stage 0's): a resume keeps it, and each stage records
      # the code that computed it (docs/runs.md "Outputs").
      **(self.stages[0].get("provenance") or provenance_lib.unknown(UNRECORDED)),
    }
    if bench.roles is not None:
      results["roles"] = bench.roles
    if self.detector.eval_spec.report_ivlod:
      # The IVLOD block's sets (owl_cl.eval.ivlod; results.finalize_results computes it).
      lvis = bench.held_out.evaluation == "lvis"
      results["ivlod"] = {
        "zero_shot_set": bench.zero_shot[0].name if bench.zero_shot else None,
        "lvis_set": bench.held_out_eval if lvis else None,
        "datasets": [d.name for d in bench.sequence],
      }
    return results

  def write(self, status: str) -> dict:
    """`results(status)`, written to results.json / results.md (by the writer process)."""
    results = self.results(status)
    if self.run_id is not None:
      results_lib.write_results(self.workdir, results)
    return results

  def train(self, index: int, params, replay_state):
    """Trains stage `index` by `train.schedule` (`trainer.train_on_dataset` /
    `train_joint`): 'sequence' from `params` and `replay_state`, 'per_task' from the
    pre-trained parameters and the initial replay state. Returns (name, params, replay
    state, training summary)."""
    schedule = self.detector.train_spec.schedule
    name = stage_names(schedule, self.bench)[index - 1]
    if schedule == "per_task":
      params, replay_state = self.pretrained, self.initial_replay
    context = trainer.ReplayContext(
      replay_state,
      store=self.store,
      # LwF's teacher: the pre-trained parameters (not a resumed run's restored ones).
      teacher=self.pretrained if self.detector.train_spec.lwf.on else None,
    )
    outputs = trainer.StageOutputs(
      writer=self.writer,
      records_path=os.path.join(self.workdir, "records", f"{name}.npz"),
      step_checkpoints=self.step_checkpoints,
    )
    if schedule == "joint":
      trained = trainer.train_joint(
        self.detector, self.bench.sequence, params, context, index, outputs
      )
    else:
      dataset = self.bench.sequence[index - 1]
      trained = trainer.train_on_dataset(self.detector, dataset, params, context, index, outputs)
    return (name, *trained)

  def run_stage(self, index: int, params, replay_state):
    """Trains stage `index` (resuming its step checkpoint, if any), evaluates, and saves the
    stage checkpoint (which supersedes the stage's step checkpoints)."""
    start = time.time()
    name, params, replay_state, train_summary = self.train(index, params, replay_state)
    schedule = self.detector.train_spec.schedule
    # WiSE-FT (`train.wise_ft`): the stage evaluates, checkpoints and carries the blend.
    params = wise_ft.after_stage(
      self.wise_ft_spec,
      self.pretrained,
      params,
      stage=index,
      num_stages=len(stage_names(schedule, self.bench)),
      schedule=schedule,
      lora=self.detector.lora is not None,
    )
    self.step_timings[name] = train_summary.pop("step_timings")
    eval_sets = stage_eval_sets(schedule, self.detector.eval_spec, self.bench, index)
    evaluation = self.evaluate(params, name, eval_sets)
    for eval_set, values in evaluation["metrics"].items():
      trainer.log_scalars(self.writer, f"eval/{eval_set}", values, index)
    stage = {"name": name, **evaluation, "train": train_summary, "provenance": self.provenance}
    self.stages.append(dict(stage, seconds=round(time.time() - start, 1)))
    if jax.process_count() > 1:
      # A stage resumed at its last step never ran a replicated retrieval: its replay state
      # is on one local device, which a multi-process save refuses (host copies it takes).
      replay_state = sharding_lib.fetch_replicated(replay_state)
    meta = {"stages": self.stages, "step_timings": self.step_timings}
    self.checkpointer.save(
      index, self.stored(params), replay_state, {**meta, **replay_setup.CHECKPOINT_FORMAT}
    )
    # Every process has finished the stage before the writer reports it.
    distributed.barrier(f"stage-{index}", timeout_s=BARRIER_TIMEOUT_S)
    self.step_checkpoints.discard(index)
    self.write("running")
    return params, replay_state

  def close(self) -> None:
    """Closes TensorBoard and the checkpointers (waits for their writes)."""
    if self.writer is not None:
      self.writer.close()
    self.step_checkpoints.close()
    self.checkpointer.close()


def stop_if_preempted(where: str) -> None:
  """Raises `preemption.Preempted` if any process received SIGTERM (a stage boundary: the
  newest checkpoint holds everything done so far)."""
  if preemption.any_process(preemption.requested_here())[0]:
    raise preemption.Preempted(
      f"stopped by SIGTERM {where} (its checkpoint is saved); run the same command to resume"
    )

"""Replay as the training loop sees it, built from the detector's typed settings.

- `make_algorithm(config)`: the retrieval algorithm of `config.replay.algorithm` (the config's
  checks: `check_replay_config`); `build_options`, `build_store` and `Replay` read the
  detector's `replay_spec`, `train_spec`, `data_spec`, `run` and `loss_options`, never its
  ConfigDict.
- `build_store(detector, benchmark, params, key_material=...)`: the host `ReplayStore` over
  the pre-training set (selected once, cached under `cache_dir/buffers` by
  `cache_keys.buffer_key_material`).
- `make_replay(...)`: the object the step loop calls. `Replay` prepares the device buffer
  before a dataset and, per step, computes the new images' features, retrieves, gathers the
  replayed examples (or takes them prepared during the previous step: `Replay.look_ahead`),
  writes the retrieval records and counts the replays that entered the loss; `NoReplay`
  (retrieval 'none') does nothing, so the loop has no replay branches.

Names: the *store* is the host copy of the selected images (`ReplayStore`), the *buffer* its
device arrays (`ReplayBuffer`), the *replay state* the retrieval's counters and PRNG key
(`ReplayState`).
"""

from __future__ import annotations

from concurrent import futures
import dataclasses
import os
import time
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections

from owl_cl import distributed
from owl_cl import preemption
from owl_cl.config_fields import ConfigError
from owl_cl.data.spec import MODEL_INPUT_KEYS
from owl_cl.model import get_variant_config
from owl_cl.replay import build as buffer_build
from owl_cl.replay import records as records_lib
from owl_cl.replay import spec as replay_spec
from owl_cl.replay import state as replay_state_lib
from owl_cl.replay import store_cache
from owl_cl.replay.retrieval import dedup
from owl_cl.replay.retrieval import registry
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib
from owl_cl.train import step_cache
from owl_cl.train import timing
from owl_cl.utils import expand_path

# The arrays of a replayed example the train step consumes (`replay_active` is added when the
# loss adaptivity decides per slot).
REPLAY_INPUTS = MODEL_INPUT_KEYS + ("stored_logits", "replay_mask")
# What the store of an OWLv2 model adds to them: its objectness logits (DER++, docs/owlv2.md).
OWLV2_REPLAY_INPUTS = ("stored_objectness",)


def make_algorithm(config: ml_collections.ConfigDict):
  """The retrieval algorithm of `config.replay` (`algorithm_of` its typed settings).

  Raises:
    ConfigError: a bad `config.replay` field (`replay.spec.settings`), an unknown algorithm or
      a hyperparameter the algorithm refuses (naming the field).
  """
  return algorithm_of(replay_spec.settings(config))


def algorithm_of(settings: replay_spec.ReplaySpec):
  """The retrieval algorithm named by `settings.algorithm` with its hyperparameters.

  Every hyperparameter the algorithm accepts (`registry.ALGORITHMS[name]
  .hyperparameter_names`) is the `replay` (or `replay.aser`) field of the same name
  (`retrieval.spec.RetrievalSpec`), None = the algorithm's default; the dedup schedule from
  `replay.dedup` (+ `replay.dedup_fraction` for 'fraction').

  Raises:
    ConfigError: an unknown algorithm ('none' included: it has no algorithm) or a value the
      algorithm refuses (naming the field).
  """
  name = settings.algorithm
  if name not in registry.ALGORITHMS:
    raise ConfigError(
      f"config.replay.algorithm={name!r} is unknown; known: {replay_spec.algorithm_names()}"
    )
  # Fields are named like the algorithm's arguments: passed straight through.
  values = {**dataclasses.asdict(settings), **dataclasses.asdict(settings.aser)}
  hyperparameters = {
    argument: values[argument]
    for argument in registry.ALGORITHMS[name].hyperparameter_names
    if values.get(argument) is not None
  }
  try:
    schedule = dedup.DedupSchedule(
      settings.dedup,
      settings.dedup_fraction if settings.dedup == "fraction" else None,
      without_replacement=settings.dedup_without_replacement,
      fraction_reset=settings.dedup_fraction_reset,
    )
    return registry.get_algorithm(name, dedup=schedule, **hyperparameters)
  except ValueError as e:
    raise ConfigError(f"config.replay ({name}): {e}") from e


def replay_slots(ratio: float, batch_size: int) -> int:
  """Replay slots per step: round(replay.ratio * train.batch_size), at least 1."""
  return max(1, int(round(ratio * batch_size)))


def check_replay_config(config: ml_collections.ConfigDict) -> None:
  """The replay settings, checked before any work (no-op for retrieval 'none').

  Raises:
    ConfigError: a bad `config.replay` field, an unknown algorithm / dedup schedule /
      hyperparameter, mode 'paper' (one replay per new image, paper eq. 5) with
      `replay.ratio` != 1, or `replay.stale_retrieval` without `replay.lookahead`.
  """
  settings = replay_spec.settings(config)
  if settings.algorithm == replay_spec.NO_REPLAY:
    return
  algorithm_of(settings)
  if settings.stale_retrieval and not settings.lookahead:
    raise ConfigError(
      "config.replay.stale_retrieval=True computes the next step's retrieval ahead and needs "
      "config.replay.lookahead=True, got False"
    )
  num_replay = replay_slots(settings.ratio, config.train.batch_size)
  if settings.loss_adaptivity.mode == "paper" and num_replay != config.train.batch_size:
    raise ConfigError(
      f"config.replay.loss_adaptivity.mode='paper' replays one image per new image above "
      f"the threshold and needs config.replay.ratio=1.0, got {settings.ratio}"
    )


def stores_image_features(config: ml_collections.ConfigDict) -> bool:
  """`uses_image_features` of `config.replay` (raises its ConfigError on a bad field)."""
  return uses_image_features(replay_spec.settings(config))


def uses_image_features(settings: replay_spec.ReplaySpec) -> bool:
  """Whether the buffer and the retrieval features carry the ViT image features (ASER on
  image features: `replay.aser.asv_features='image_features'` with an ASV algorithm)."""
  algorithm = registry.ALGORITHMS.get(settings.algorithm)
  uses = algorithm is not None and "asv_features" in algorithm.hyperparameter_names
  return uses and settings.aser.asv_features == "image_features"


def model_version(config: ml_collections.ConfigDict) -> str:
  """'v1' or 'owlv2': the version of `config.model` (its variant's, or the override's)."""
  overrides = dict(config.model.overrides)
  return overrides.get("version", get_variant_config(config.model.variant).version)


def build_options(detector, source) -> dict:
  """`buffer_build.build_store`'s keywords for the pre-training set `source` from the
  detector's typed settings (`replay_spec`, `data_spec`, `run`, `loss_options`):
  `buffer_spec` (the `buffer_build.BufferSpec`: the images' preprocessing, the selection
  settings, the loss), the batch size, the mesh and the grain workers.

  Raises:
    ValueError: a selection setting `buffer_build.BufferSpec` refuses (names the field).
  """
  replay = detector.replay_spec
  selection = replay.selection
  data = detector.data_spec
  buffer_spec = buffer_build.BufferSpec(
    example=detector.example_spec(detector.class_tokens(source)),
    seed=detector.run.seed_of("model"),
    loss_threshold=selection.loss_threshold,
    min_per_class=selection.min_per_class,
    fill_all_for_rare_classes=selection.fill_all_for_rare_classes,
    top_k=replay.top_k,
    max_per_class=selection.max_instances_per_prototype,
    loss_config=detector.loss_options,
    example_options=detector.example_options(source),
    distance_max_instances=selection.distance_max_instances,
    drop_images_without_class=selection.drop_images_without_class,
    top_up_order=selection.top_up_order,
    budget=replay.budget,
    prototype_images=selection.prototype_images,
    image_features=uses_image_features(replay),
    selection_objectness=selection.objectness_in_loss,
  )
  return dict(
    buffer_spec=buffer_spec,
    batch_size=data.eval_batch_size,
    mesh=detector.mesh,
    num_workers=data.num_workers,
  )


def build_store(detector, benchmark, params, *, key_material: dict):
  """The replay store over the pre-training set (cached). Returns (store, stats).

  `key_material` names the store in the cache: everything the selection depends on (the model,
  the pre-training annotations, the selection settings, the input options, the loss and the
  seed; `cache_keys.buffer_key_material`). The store
  keeps its images by reference and decodes them from `benchmark.pretrain.train` when
  gathered, cached as uint8 under `config.replay.image_cache` when set (docs/reference.md §6);
  a store cached by an earlier version with its pixels keeps working from them.
  """
  source = benchmark.pretrain.train
  replay, cache_dir = detector.replay_spec, detector.run.cache_dir

  def build(path, build_dir, build_key):
    preemption.checkpoint_event("buffer")  # test-only kill hook (a no-op otherwise)
    return build_uncached(path, build_dir, build_key)

  build_uncached = lambda path, build_dir, build_key: buffer_build.build_store(
    detector.model,
    params,
    source,
    path,
    **build_options(detector, source),
    build_dir=build_dir,
    build_key=build_key,
  )
  # The store keeps its images by reference: gather decodes them from the pre-training set
  # (an optional uint8 cache on local disk keeps them once decoded). Not in the key: a store
  # is the same whether or where its images are cached.
  return store_cache.cached_store(
    os.path.join(expand_path(cache_dir), "buffers"),
    key_material,
    build,
    source=source,
    image_cache=image_cache_folder(replay.image_cache, cache_dir),
    verification=replay.store_verification,
  )


def image_cache_dir(config: ml_collections.ConfigDict) -> str | None:
  """`image_cache_folder` of `config` (raises ConfigError on a bad `replay` field)."""
  return image_cache_folder(replay_spec.settings(config).image_cache, config.cache_dir)


def image_cache_folder(folder: str | None, cache_dir: str) -> str | None:
  """The replay image cache's folder: `folder` (`replay.image_cache`; '~' and $VARS
  expanded; a relative path inside `cache_dir`), or None when it is unset or '' (decode at
  every replay)."""
  if not folder:
    return None
  folder = os.path.expandvars(os.path.expanduser(folder))
  return os.path.join(expand_path(cache_dir), folder)  # an absolute folder wins


# Written into every stage checkpoint's meta: the form of the class embeddings its replay state
# (ASER-PC's precomputed left term) was computed from ('normalised' as scenic; absent: raw).
CHECKPOINT_FORMAT = {"class_embeddings": "normalised"}


def upgrade_restored_state(
  replay_state: replay_state_lib.ReplayState, meta: dict, workdir: str
) -> replay_state_lib.ReplayState:
  """`replay_state` restored from a stage checkpoint with `meta`, made current.

  Checkpoints written before the class embeddings were normalised hold an ASER-PC left term
  computed from raw embeddings: it is marked not ready, so the next retrieval recomputes it
  over the current buffer (logged).
  """
  stale = meta.get("class_embeddings") != CHECKPOINT_FORMAT["class_embeddings"]
  if stale and bool(sharding_lib.fetch_replicated(replay_state.asv_left_ready)):
    logging.warning(
      "the checkpoint in %s holds an ASER-PC left term of unnormalised class embeddings; "
      "recomputing it",
      workdir,
    )
    return replay_state.replace(asv_left_ready=jnp.zeros((), bool))
  return replay_state


def _loss_writeback(algorithm, step_options: dict):
  """(whether `algorithm` reads the replays' training losses, its jitted write-back or None).

  Forgetting-aware retrieval (`retrieval.forgetting`): sets the train step's option that
  exports the losses (`observe_losses`); `Replay.count` writes them back after each step.
  """
  if not getattr(algorithm, "observes_losses", False):
    return False, None
  step_options["observe_losses"] = True
  return True, step_cache.shared(("observe", algorithm), lambda: jax.jit(algorithm.observe))


def initial_replay_state(
  store, seed: int, settings: replay_spec.ReplaySpec | None = None
) -> replay_state_lib.ReplayState:
  """The replay state before the first dataset (key from `seed + 2`).

  Without a store it is sized for one image and one class: orbax saves no empty arrays, and
  the run's checkpoints hold a replay state either way. With `settings` naming an algorithm
  that observes losses (forgetting-aware), the state holds its fields from the start, so the
  stage checkpoints restore them (`forgetting.initial_state`); other algorithms' states are
  unchanged.
  """
  state = replay_state_lib.init_replay_state(
    store.num_images if store else 1,
    jax.random.PRNGKey(seed + 2),
    num_classes=store.num_classes if store else 1,
  )
  if store is not None and settings is not None:
    algorithm = algorithm_of(settings)
    if getattr(algorithm, "observes_losses", False):
      state = algorithm.prepare(state, None)
  return state


def replay_fractions(
  replays_in_loss: int, replay_steps: int, steps: int, num_replay: int
) -> dict[str, float]:
  """The paper's Table 4 figures: fraction of steps with replay, of replay slots used.

  replay_steps_fraction = steps whose loss included at least one replay / steps;
  replay_samples_fraction = replays in the loss / (steps * replays per step) (at 1:1 the
  fraction of new samples that were given a replay, the paper's "Replay %").
  """
  return {
    "replay_steps_fraction": replay_steps / steps if steps else 0.0,
    "replay_samples_fraction": (replays_in_loss / (steps * num_replay) if steps else 0.0),
  }


class Retrieved(NamedTuple):
  """One step's retrieval: buffer indices int32 [R], valid bool [R], the updated replay
  state, and the analysis records (None unless `config.replay.records`)."""

  indices: Any
  valid: Any
  replay_state: Any
  records: Any = None


class _Dispatched(NamedTuple):
  """One step's features and retrieval, dispatched to the devices (not yet computed).

  features: the retrieval features ({} when the retrieval reads no parameters); active: bool
  [B] of the paper's loss adaptivity or None; retrieved: `Retrieved` of device arrays;
  embed_at / retrieve_at: perf_counter seconds of the two dispatches (`StepTimer.device`).
  """

  features: dict
  active: Any
  retrieved: Retrieved
  embed_at: float
  retrieve_at: float


class _Gathered(NamedTuple):
  """The host half of one step's replay: replay_inputs (sharded), valid bool [R] and the
  host records (None without records), the moment the indices reached the host
  (perf_counter s) and the seconds spent gathering + transferring."""

  replay_inputs: dict
  valid: Any
  records: Any
  fetched_at: float
  gather_seconds: float


class _Ahead(NamedTuple):
  """The next step's replay, retrieved and gathered ahead (`Replay.look_ahead`).

  based_on: the replay state object the retrieval read; next_inputs: the new batch its
  features read (None when the retrieval reads no features); dispatched: `_Dispatched`;
  gathered: future of `_Gathered` (computed in the lookahead thread).
  """

  based_on: Any
  next_inputs: Any
  dispatched: _Dispatched
  gathered: futures.Future


class NoReplay:
  """Retrieval 'none': fine-tuning on the new data alone. Every call is a no-op."""

  train_step_options = {"with_replay": False}
  reads_next_batch = False

  def prepare(self, loop):
    return loop

  def step_inputs(self, loop, inputs, timer=timing.NULL_TIMER):
    del inputs, timer
    return loop, None

  def look_ahead(self, loop, next_inputs=None) -> None:
    del loop, next_inputs

  def close_lookahead(self) -> None:
    pass

  def count(self, loop, metrics):
    del metrics
    return loop

  def log(self, loop) -> tuple[dict, dict]:
    del loop
    return {}, {}

  def end_epoch(self, loop):
    return loop

  def end_dataset(self, loop):
    return loop

  def summary(self, loop) -> dict:
    del loop
    return {}

  def checkpoint_items(self) -> dict:
    return {}

  def restore_items(self, items: dict) -> None:
    del items


class Replay:
  """Retrieval from the buffer plus DER++ (paper eq. 1-5) for one downstream dataset.

  The loop calls `prepare` once before the dataset's first step, then per step
  `step_inputs` (the replayed examples: features -> retrieval -> gather), `look_ahead` (the
  next step's, prepared while this one trains, where `lookahead` allows) and `count`
  (replays that entered the loss), `end_epoch` / `end_dataset` (dedup resets), `log` and
  `summary`, and `close_lookahead` at the loop's end. The counters live in the loop state
  (device scalars: no host sync per step).

  `lookahead`: 'exact' (the retrieval reads no parameters), 'stale'
  (`replay.stale_retrieval` with one that does) or None (serial: `replay.lookahead` False,
  or a retrieval that reads the parameters without the stale option).
  """

  def __init__(self, detector, store, records_path: str | None):
    settings = detector.replay_spec
    self.detector = detector
    self.store = store
    self.num_replay = replay_slots(settings.ratio, detector.train_spec.batch_size)
    sharding_lib.check_batch_divisible(
      self.num_replay, detector.mesh, "replay batch (ratio * batch)"
    )
    self.algorithm = algorithm_of(settings)
    gate = settings.loss_adaptivity
    self.adaptivity = gate.mode
    if (
      self.adaptivity == "released_gate"
      and gate.gate_feature_based_only
      and not self.algorithm.needs_features
    ):
      # Released code: only its feature-based forward pass (SWIL, A-SW-GRASP, ASER variants)
      # has the gate; uniform, balanced and GRASP retrieval always add the replay loss.
      self.adaptivity = "none"
    self.threshold = float(gate.threshold)
    self.train_step_options = {
      "alpha": settings.der_alpha,
      "beta": settings.der_beta,
      "objectness_distill_weight": settings.der_objectness_weight,
      "with_replay": True,
      "loss_adaptivity": self.adaptivity,
      "loss_threshold": self.threshold,
      # Released code: the gate reads each device's own new loss (DDP).
      "loss_gate_groups": (
        detector.mesh.shape[sharding_lib.DATA_AXIS] if gate.gate_per_device else 1
      ),
    }
    self._observes, self._observe = _loss_writeback(self.algorithm, self.train_step_options)
    self._consumed = None  # the retrieval the last train step consumed (`_apply`)
    self.records_path = records_path
    self.recorder = None
    records = bool(settings.records and records_path)
    if records:
      self.recorder = records_lib.RetrievalRecords(
        store.num_classes, getattr(self.algorithm, "num_candidates", 0)
      )
    # The jitted steps are the process's, shared by every dataset and run that builds them
    # with equal settings (`step_cache`): the algorithm is a frozen dataclass, equal to an
    # earlier one when its hyperparameters are.
    retrieve = self.algorithm.retrieve_with_records if records else self.algorithm
    self._retrieve = step_cache.shared(
      ("retrieve", self.algorithm, records), lambda: jax.jit(retrieve, static_argnums=3)
    )
    self.buffer = None
    top_k = settings.top_k if self.algorithm.needs_features else None
    # 'paper': one eval-mode forward gives the new images' losses (and the features).
    image_features = uses_image_features(settings)
    self._new_losses = (
      step_cache.shared(
        (
          "new_losses",
          detector.tuned_model,
          detector.mesh,
          tuple(sorted(detector.loss_options.items())),
          top_k,
          image_features,
        ),
        lambda: step_lib.make_new_loss_step(
          detector.tuned_model,
          detector.mesh,
          loss_config=detector.loss_options,
          k=top_k,
          image_features=image_features,
        ),
      )
      if self.adaptivity == "paper"
      else None
    )
    self._embed = (
      step_cache.shared(
        ("embed", detector.tuned_model, detector.mesh, top_k, image_features),
        lambda: step_lib.make_embed_step(
          detector.tuned_model, detector.mesh, k=top_k, image_features=image_features
        ),
      )
      if top_k and self._new_losses is None
      else None
    )
    # The lookahead (`look_ahead`): 'exact' when the retrieval reads no parameters (its next
    # call depends only on the replay state after this one), 'stale' when it does and
    # replay.stale_retrieval allows its features one step old, None: serial.
    reads_params = self._new_losses is not None or self._embed is not None
    self.lookahead = None
    # A write-back changes the state after every step: a look-ahead would always be redone.
    if settings.lookahead and not self._observes:
      if not reads_params:
        self.lookahead = "exact"
      elif settings.stale_retrieval:
        self.lookahead = "stale"
    self._ahead: _Ahead | None = None
    self._thread: futures.ThreadPoolExecutor | None = None

  def prepare(self, loop):
    """Puts the buffer and the replay state on the devices (replicated) and lets the algorithm
    prepare its state (ASER-PC's left term: sharded over the mesh, cached next to a cached
    store, `asv_left`)."""
    self.buffer = sharding_lib.replicate(self.store.replay_buffer(), self.detector.mesh)
    state = self.algorithm.prepare(
      loop.replay_state,
      self.buffer,
      mesh=self.detector.mesh,
      cache_prefix=getattr(self.store, "path", None),
    )
    # Placed as the retrieval returns it (replicated on the mesh), as the trainer places the
    # train state: a host or uncommitted first state would make the second step's retrieval
    # trace, lower and compile again for the committed state the first one returned.
    loop.replay_state = sharding_lib.replicate(state, self.detector.mesh)
    return loop

  def _features(self, params, inputs) -> tuple[dict, Any]:
    """(features of the new images for the retrieval, active bool [B] or None)."""
    if self._new_losses is not None:
      features = self._new_losses(
        params, inputs["images"], inputs["queries"], inputs["labels"], inputs["boxes"]
      )
      # Slot j serves new image j: active iff its loss exceeds the threshold (eq. 5).
      return features, features.pop("per_example") > self.threshold
    if self._embed is not None:
      return self._embed(params, inputs["images"], inputs["queries"]), None
    return {}, None

  def _dispatch(self, replay_state, params, inputs, features=None) -> _Dispatched:
    """Dispatches one step's features (from `params` and the new batch `inputs`; `features`:
    (features, active) already computed) and its retrieval from `replay_state`."""
    embed_at = time.perf_counter()
    features, active = self._features(params, inputs) if features is None else features
    retrieve_at = time.perf_counter()
    retrieved = Retrieved(
      *self._retrieve(replay_state, self.buffer, features, self.num_replay, active)
    )
    return _Dispatched(features, active, retrieved, embed_at, retrieve_at)

  def _gather(self, dispatched: _Dispatched) -> _Gathered:
    """The host half of one step's replay: waits for the retrieved indices, gathers this
    process's rows of them from the store and transfers them (thread-safe: `store.gather`)."""
    retrieved = dispatched.retrieved
    # Retrieval is replicated: every process holds the same indices [R] and mask [R], and
    # gathers from its store only the slots that land on its own devices. The host waits
    # here: the gather needs them.
    indices, valid = sharding_lib.fetch_replicated((retrieved.indices, retrieved.valid))
    fetched_at = time.perf_counter()
    records = None
    if self.recorder is not None:
      records = sharding_lib.fetch_replicated(retrieved.records)
    local_indices, local_valid = sharding_lib.local_rows((indices, valid), self.detector.mesh)
    replay_batch = self.store.gather(local_indices, local_valid)
    replay_batch["replay_mask"] = local_valid
    names = list(REPLAY_INPUTS) + [k for k in OWLV2_REPLAY_INPUTS if k in replay_batch]
    if dispatched.active is not None:
      replay_batch["replay_active"] = dispatched.active
      names.append("replay_active")
    replay_inputs = sharding_lib.shard_batch(
      {k: replay_batch[k] for k in names}, self.detector.mesh
    )
    return _Gathered(replay_inputs, valid, records, fetched_at, time.perf_counter() - fetched_at)

  def _apply(self, loop, dispatched: _Dispatched, gathered: _Gathered, timer):
    """Moves `loop` on by one step's retrieval (in the loop's thread, in step order: the
    replay state, the records, the auto-reset warning, the counters, the timer)."""
    if dispatched.features:
      timer.device("embed", dispatched.embed_at, dispatched.features)
    timer.device("retrieval", dispatched.retrieve_at, gathered.fetched_at)
    timer.host("gather", gathered.gather_seconds)
    loop.replay_state = dispatched.retrieved.replay_state
    self._consumed = dispatched.retrieved
    if self.recorder is not None:
      self.recorder.add(gathered.records, gathered.valid)
    dedup.check_auto_reset(loop.replay_state)
    loop.replayed += int(gathered.valid.sum())
    return loop, gathered.replay_inputs

  def step_inputs(self, loop, inputs, timer=timing.NULL_TIMER):
    """The replayed examples of one step, sharded, and the loop with its replay state moved on.

    Serially: the features of `inputs` from the current parameters, the retrieval, the
    gather. When `look_ahead` prepared this step during the previous one and the loop still
    holds the replay state it read (no dedup reset, no restore since), its result is taken
    instead, the same bit for bit (exact lookahead) or computed from the parameters one step
    older (`replay.stale_retrieval`; a reset in between redoes only the retrieval, from the
    same features). Anything else prepared ahead is dropped unused.

    `timer` (`owl_cl.train.timing.StepTimer`) records the features' and the retrieval's
    dispatch and completion and the host seconds of the gather (+ transfer).

    Returns:
      (loop, replay inputs): images, queries, labels, boxes, stored_logits, replay_mask bool
      [R] (+ replay_active bool [R] with the paper's loss adaptivity).

    Raises:
      Exception: whatever the retrieval or the gather raised, also when it ran ahead in the
        lookahead thread (raised here, at the step it belongs to).
    """
    ahead, self._ahead = self._ahead, None
    features = None
    if ahead is not None:
      same_batch = ahead.next_inputs is inputs or ahead.next_inputs is None
      if same_batch and ahead.based_on is loop.replay_state:
        return self._apply(loop, ahead.dispatched, ahead.gathered.result(), timer)
      _drop(ahead)
      if same_batch and self.lookahead == "stale":
        # The stale features stay valid; only the retrieval read a state reset since.
        features = (ahead.dispatched.features, ahead.dispatched.active)
    dispatched = self._dispatch(loop.replay_state, loop.train_state.params, inputs, features)
    return self._apply(loop, dispatched, self._gather(dispatched), timer)

  @property
  def reads_next_batch(self) -> bool:
    """Whether `look_ahead` needs the next step's new batch (stale retrieval features)."""
    return self.lookahead == "stale"

  def look_ahead(self, loop, next_inputs=None) -> None:
    """Prepares the next step's replay while this step trains (call before its train step).

    Dispatches the next step's retrieval from `loop.replay_state` (the state after this
    step's retrieval) now, ahead of this step's train step on the devices, and gathers +
    transfers its replay batch in the lookahead thread meanwhile; `step_inputs` of the next
    step takes it. Exact lookahead (`self.lookahead == 'exact'`: the retrieval reads no
    parameters: uniform, balanced, GRASP and their dedup variants): the same indices, state
    and records as the serial loop. Stale (`'stale'`, `replay.stale_retrieval`): the features
    of `next_inputs` (the next step's new batch) are computed from `loop.train_state.params`,
    the parameters before this step's update. No-op when `self.lookahead` is None.
    """
    if self.lookahead is None or (self.lookahead == "stale" and next_inputs is None):
      return
    _drop(self._ahead)
    self._ahead = None
    params = loop.train_state.params if self.lookahead == "stale" else None
    dispatched = self._dispatch(loop.replay_state, params, next_inputs)
    if self._thread is None:
      self._thread = futures.ThreadPoolExecutor(1, thread_name_prefix="replay-lookahead")
    gathered = self._thread.submit(self._gather, dispatched)
    self._ahead = _Ahead(loop.replay_state, next_inputs, dispatched, gathered)

  def close_lookahead(self) -> None:
    """Drops what was prepared ahead and stops the lookahead thread (the loop's end)."""
    _drop(self._ahead)
    self._ahead = None
    if self._thread is not None:
      self._thread.shutdown(wait=True)
      self._thread = None

  def count(self, loop, metrics):
    """Adds the step's replays in the loss, and whether there was any, to the counters."""
    if self._observes:
      # Out of the metrics before the loop logs them (scalars only): the step's replay
      # losses, into the state at the indices that step consumed (`forgetting.observe_losses`).
      losses = metrics.pop("per_example_replay")
      consumed = self._consumed
      loop.replay_state = self._observe(loop.replay_state, consumed.indices, consumed.valid, losses)
    used = metrics["replays_in_loss"]
    loop.replays_in_loss = loop.replays_in_loss + used
    loop.replay_steps = loop.replay_steps + (used > 0).astype(jnp.int32)
    return loop

  def _fractions(self, loop) -> dict[str, float]:
    return replay_fractions(
      *(int(c) for c in sharding_lib.fetch_replicated((loop.replays_in_loss, loop.replay_steps))),
      loop.step,
      self.num_replay,
    )

  def log(self, loop) -> tuple[dict, dict]:
    """(progress-bar fields, scalars) of the replay so far."""
    fractions = self._fractions(loop)
    return {"replay": f"{fractions['replay_samples_fraction']:.0%}"}, fractions

  def end_epoch(self, loop):
    loop.replay_state = dedup.reset_if(loop.replay_state, "epoch", self.algorithm.dedup)
    return loop

  def end_dataset(self, loop):
    loop.replay_state = dedup.reset_if(loop.replay_state, "dataset", self.algorithm.dedup)
    if self.recorder is not None and distributed.is_writer():
      self.recorder.save(self.records_path)
    return loop

  def checkpoint_items(self) -> dict:
    """The host state a step checkpoint needs besides the loop state: the retrieval records
    so far ({'records': {...}}; {} without records)."""
    return {} if self.recorder is None else {"records": self.recorder.state()}

  def restore_items(self, items: dict) -> None:
    """Restores what `checkpoint_items` saved (missing items are left as they are)."""
    if self.recorder is not None and "records" in items:
      self.recorder.load_state(items["records"])

  def summary(self, loop) -> dict:
    """The dataset's replay figures for results.json (Table 4's fractions among them)."""
    return dict(
      loss_adaptivity=self.adaptivity,
      loss_threshold=self.threshold if self.adaptivity != "none" else None,
      replay_slots=loop.step * self.num_replay,
      replays_in_loss=int(sharding_lib.fetch_replicated(loop.replays_in_loss)),
      replay_steps=int(sharding_lib.fetch_replicated(loop.replay_steps)),
      **self._fractions(loop),
    )


def _drop(ahead: _Ahead | None) -> None:
  """Waits for a lookahead that will not be used (its gather may still be reading the store)
  and discards its result or error: the serial loop would never have computed it."""
  if ahead is not None:
    futures.wait([ahead.gathered])


def make_replay(detector, store, records_path: str | None = None) -> Replay | NoReplay:
  """`Replay` over `store`, or `NoReplay` when there is none (retrieval 'none')."""
  if store is None:
    return NoReplay()
  return Replay(detector, store, records_path)

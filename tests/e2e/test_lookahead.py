"""The replay lookahead (`Replay.look_ahead`, issue 10 item 4): step t+1's retrieval and
gather prepared while step t trains.

Exact lookahead (retrievals that read no parameters) must give the serial loop's results bit
for bit, across epoch boundaries and dedup resets, through a step checkpoint and resume, and
raise a background gather's error at the step it belongs to. The stale option
(`replay.stale_retrieval`) must compute step t+1's features from the parameters step t
trained from. Each run is `trainer.train_on_dataset` on the tiny config's first dataset (16
images, batches of 8: 2 steps per epoch).
"""

import threading

import jax
from jax._src import compilation_cache  # reset_cache: no public equivalent
import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl import cache_keys
from owl_cl import preemption
from owl_cl import pretrained
from owl_cl import trainer
from owl_cl.config_fields import ConfigError
from owl_cl.detector import Detector
from owl_cl.replay import setup as replay_setup
from owl_cl.testing.configs import tiny_config
from owl_cl.train import checkpointing
from owl_cl.train import step as step_lib


@pytest.fixture(scope="module")
def shared(pretrained_cache_dir, tmp_path_factory):
  """(benchmark, pre-trained params, replay store, cache folder) of the tiny config.

  The store does not depend on the retrieval algorithm (none of those tested here stores
  image features), so every test replays from the same one. The runs share their compiled
  programs through the persistent compilation cache, set as `experiment.run` sets it.
  """
  config = tiny_config("uniform", pretrained_cache_dir)
  detector = Detector(config)
  bench = benchmark.load_benchmark(config)
  params, meta = pretrained.pretrained_params(detector, bench, None)
  key = cache_keys.buffer_key_material(config, bench.pretrain.train, meta)
  store, _ = replay_setup.build_store(detector, bench, params, key_material=key)
  # Set for this module only: later tests in the same worker process see the settings they had.
  saved = {
    name: getattr(jax.config, name)
    for name in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  }
  # JAX decides once per process whether the cache is used (`reset_cache` makes it decide again).
  if not saved["jax_compilation_cache_dir"]:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    compilation_cache.reset_cache()
  yield bench, params, store, pretrained_cache_dir
  for name, value in saved.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


def _config(algorithm, shared, **replay):
  """The tiny config of `algorithm`: 3 epochs of 2 steps on the first dataset."""
  config = tiny_config(algorithm, shared[3])
  config.max_train_steps_per_dataset = None
  config.train.num_epochs = 3
  for name, value in replay.items():
    config.replay[name] = value
  return config


def _run(config, shared, tmp_path, name, step_checkpoints=None, threads=None):
  """`train_on_dataset` on the first dataset. Returns (params, replay state, summary, the
  retrieval records' arrays, the names of the threads that gathered, in order: also
  appended to `threads` when given, as they happen)."""
  bench, params, store, _ = shared
  detector = Detector(config)
  state = replay_setup.initial_replay_state(store, config.seed)
  threads = [] if threads is None else threads
  gather = replay_setup.Replay._gather

  def spy(self, dispatched):
    threads.append(threading.current_thread().name)
    return gather(self, dispatched)

  records = tmp_path / f"{name}.npz"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(replay_setup.Replay, "_gather", spy)
    params, state, summary = trainer.train_on_dataset(
      detector,
      bench.sequence[0],
      params,
      trainer.ReplayContext(state, store=store),
      1,
      trainer.StageOutputs(records_path=str(records), step_checkpoints=step_checkpoints),
    )
  summary.pop("step_timings")
  recorded = dict(np.load(records)) if records.exists() else None
  return jax.device_get(params), jax.device_get(state), summary, recorded, threads


def _assert_same(a, b):
  """Bit-equal params, replay state, training summary and records of two `_run`s."""
  for x, y in zip(a[:2], b[:2]):
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
      np.testing.assert_array_equal(u, v)
  assert a[2] == b[2]
  assert a[3].keys() == b[3].keys()
  for k in a[3]:
    np.testing.assert_array_equal(a[3][k], b[3][k])


MAIN = threading.main_thread().name
AHEAD = "replay-lookahead_0"


@pytest.mark.slow
def test_exact_lookahead_across_dedup_resets_equals_the_serial_loop(shared, tmp_path):
  # The dedup reset at the first epoch's end (after step 2) replaces the replay state the
  # retrieval prepared ahead of step 3 read: dropped, and redone in the loop's thread.
  configs = [_config("grasp", shared, dedup="epoch", lookahead=on) for on in (False, True)]
  for config in configs:
    config.train.num_epochs = 2  # 4 steps: one reset between them
  serial = _run(configs[0], shared, tmp_path, "s")
  ahead = _run(configs[1], shared, tmp_path, "a")
  assert serial[4] == [MAIN] * 4
  assert ahead[4] == [MAIN, AHEAD, AHEAD, MAIN, AHEAD]
  assert ahead[2]["steps"] == 4 and ahead[2]["replayed_images"] > 0
  _assert_same(ahead, serial)


@pytest.mark.slow
def test_exact_lookahead_through_a_step_checkpoint_and_resume(shared, tmp_path, monkeypatch):
  """Uniform retrieval, no reset at an epoch's end: every step but a loop's first is prepared
  ahead, across epochs too. SIGTERM seen after step 3 (mid-epoch 2, with step 4's retrieval
  prepared ahead): the checkpoint must hold the serial loop's replay state and records, and
  the resumed run end as the serial, uninterrupted one, bit for bit."""
  serial = _run(_config("uniform", shared, lookahead=False), shared, tmp_path, "s")
  config = _config("uniform", shared)
  calls = []
  monkeypatch.setattr(preemption, "requested_here", lambda: (calls.append(1), len(calls) == 3)[1])
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"))
  gathered = []
  with pytest.raises(preemption.Preempted):
    _run(config, shared, tmp_path, "r", steps, gathered)
  steps.close()
  assert len(calls) == 3
  # Steps 1-3 and the retrieval prepared ahead of step 4 (dropped at the stop).
  assert gathered == [MAIN, AHEAD, AHEAD, AHEAD]
  monkeypatch.setattr(preemption, "requested_here", lambda: False)
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"))
  resumed = _run(config, shared, tmp_path, "r", steps)
  steps.close()
  # Step 4 serially (nothing was prepared ahead in this loop), 5 (a new epoch) and 6 ahead.
  assert resumed[4] == [MAIN, AHEAD, AHEAD]
  _assert_same(resumed, serial)


@pytest.mark.slow
def test_error_in_the_lookahead_thread_is_raised_at_its_step(shared, tmp_path, monkeypatch):
  # The 3rd gather fails. The serial loop meets it at step 3, before its train step: 2 train
  # steps ran. Ahead, that gather runs in the background during step 2, and its error must
  # surface at step 3 all the same, in the loop's thread.
  _, _, store, _ = shared
  gather, make = type(store).gather, step_lib.make_train_step
  gathers, trained = [], []

  def failing(self, *args, **kwargs):
    gathers.append(threading.current_thread().name)
    if len(gathers) == 3:
      raise OSError("replay image unreadable")
    return gather(self, *args, **kwargs)

  def counting(*args, **kwargs):
    step = make(*args, **kwargs)
    return lambda *a: (trained.append(1), step(*a))[1]

  monkeypatch.setattr(type(store), "gather", failing)
  monkeypatch.setattr(step_lib, "make_train_step", counting)
  with pytest.raises(OSError, match="unreadable"):
    _run(_config("uniform", shared), shared, tmp_path, "e")
  assert gathers == [MAIN, AHEAD, AHEAD] and len(trained) == 2


@pytest.mark.slow
def test_stale_retrieval_reads_the_parameters_of_the_previous_step(shared, tmp_path):
  """SWIL with `replay.stale_retrieval`: the features of a step prepared ahead come from the
  parameters the previous train step started from, those of the loop's first step from its
  own (compared bit for bit with the parameters each train step was given). With a dedup
  reset at the epoch's end, step 3's retrieval is redone from the same stale features."""
  config = _config("swil", shared, stale_retrieval=True, dedup="epoch")
  config.train.num_epochs = 2  # 4 steps
  embedded, trained = [], []  # (host params, new batch) given to each features / train step
  features, make = replay_setup.Replay._features, step_lib.make_train_step

  def spy_features(self, params, inputs):
    embedded.append((jax.device_get(params), inputs))
    return features(self, params, inputs)

  def counting(*args, **kwargs):
    step = make(*args, **kwargs)

    def spy_step(state, inputs, replay_inputs, key):
      # A host copy before the call: the train state is donated.
      trained.append((jax.device_get(state.params), inputs))
      return step(state, inputs, replay_inputs, key)

    return spy_step

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(replay_setup.Replay, "_features", spy_features)
    patch.setattr(step_lib, "make_train_step", counting)
    _, _, summary, _, threads = _run(config, shared, tmp_path, "f")
  assert summary["steps"] == 4 and len(trained) == len(embedded) == 4
  # Step 1 serially; steps 2-4 prepared ahead (step 3's batch is the next epoch's first: one
  # reader reads every epoch); step 3's retrieval read the state before the epoch's reset:
  # its gather is dropped and the retrieval redone in the loop's thread, from its features.
  assert threads == [MAIN, AHEAD, AHEAD, MAIN, AHEAD]
  same = lambda a, b: all(
    np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  for t in range(4):
    params, inputs = embedded[t]
    assert inputs is trained[t][1], t  # the features of step t's own new batch
    assert same(params, trained[max(t - 1, 0)][0]), t
  # Steps 2 and 3 changed the parameters (the learning rate is 0 at step 1, the warmup's
  # start): the checks of steps 3 and 4 above tell stale from current features.
  assert not same(trained[1][0], trained[2][0]) and not same(trained[2][0], trained[3][0])


def test_stale_retrieval_without_lookahead_is_a_config_error(tmp_path):
  config = tiny_config("swil", str(tmp_path))
  config.replay.stale_retrieval = True
  replay_setup.check_replay_config(config)  # with the lookahead (the default): accepted
  config.replay.lookahead = False
  with pytest.raises(ConfigError, match="stale_retrieval=True .* needs config.replay.lookahead"):
    replay_setup.check_replay_config(config)

"""Preemption-safe runs: step checkpoints, identical results after SIGKILL, SIGTERM, pruning.

The end-to-end test runs `python -m owl_cl.main` in subprocesses on the tiny config: one
uninterrupted reference run, and one workdir that is killed (SIGKILL, or SIGTERM once) at
seeded random moments through the test-only hook `OWL_CL_TEST_KILL_AT` and resumed by the
same command each time; the resumed run's results.json must equal the reference's exactly.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import owl_cl
from owl_cl import preemption
from owl_cl import trainer
from owl_cl.replay import setup as replay_setup
from owl_cl.testing.results import comparable
from owl_cl.train import checkpointing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(owl_cl.__file__)))


def _write_config(path, cache_dir, image_cache=None):
  # No compilation cache of the run's own (tiny_config's ''): JAX reads the session's from
  # the environment (tests/conftest.py), so the later runs compile nothing and programs that
  # other tests of the session compiled are read back.
  with open(path, "w") as f:
    f.write(
      "from owl_cl.testing.configs import tiny_config\n\n\n"
      "def get_config():\n"
      f"  c = tiny_config('swil', {cache_dir!r})\n"
      "  c.checkpoint.every_steps = 1\n"
      # Fewer evaluations between datasets (the last stage still evaluates every set).
      "  c.eval.pretraining_sets_after_each_dataset = False\n"
      "  c.eval.downstream_after_each_dataset = 'seen'\n"
      f"  c.replay.image_cache = {image_cache!r}\n"
      "  return c\n"
    )


def _run_main(config_file, workdir, kill_at=None):
  # The test process's platform: the killed run's pre-training must equal the session's
  # (pre-trained in this process).
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop(preemption.KILL_HOOK_ENV, None)
  if kill_at:
    env[preemption.KILL_HOOK_ENV] = kill_at
  return subprocess.run(
    [sys.executable, "-m", "owl_cl.main", f"--config={config_file}", f"--workdir={workdir}"],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


@pytest.mark.slow
def test_killed_and_resumed_run_equals_uninterrupted_run(pretrained_cache_dir, tmp_path):
  configs = {}
  for name, folders in (("reference", ("builtin", "pretrained")), ("killed", ("builtin",))):
    # Own caches with the session's built-in benchmark. The reference also gets the session's
    # pre-trained model (pre-trained in the test process, uninterrupted); the killed run
    # pre-trains itself, so the kills land in pre-training too and its resumed pre-training
    # must give that model bit for bit. Both build their buffer.
    cache = tmp_path / f"cache_{name}"
    for folder in folders:
      shutil.copytree(os.path.join(pretrained_cache_dir, folder), cache / folder)
    configs[name] = str(tmp_path / f"{name}.py")
    # The killed run replays through the uint8 image cache (killed while filling it, too),
    # the reference decodes every replayed image: the results must not differ.
    image_cache = str(tmp_path / "image_cache") if name == "killed" else None
    _write_config(configs[name], str(cache), image_cache)

  reference = _run_main(configs["reference"], tmp_path / "ref")
  assert reference.returncode == 0, reference.stderr[-3000:]
  # The main job's log: each stage's metrics line, and not JAX's TPU probe (an INFO line that
  # reads like an error on a machine without a TPU; owl_cl.main.QuietLibraryInfo).
  assert "] after pre-training: pretrain_val AP " in reference.stderr
  assert "Unable to initialize backend" not in reference.stderr

  # Seeded random kill points, in the order the resumed runs reach them (every process counts
  # its own events from 1): 4 pre-training steps, then the buffer, the evaluation of the
  # pre-trained model (4 eval sets of one batch), 2 steps per dataset (each followed by a
  # step checkpoint: every_steps=1), the evaluation after dataset 1 (1 set).
  rng = np.random.default_rng(12)
  kills = [
    f"train_step:{rng.integers(1, 4)}",  # mid pre-training
    "buffer:1",  # when the buffer's selection starts (pre-training resumed and finished)
    f"eval_batch:{rng.integers(1, 5)}",  # evaluating the pre-trained model
    f"save:{rng.integers(1, 3)}",  # during a step checkpoint's write in dataset 1
    f"train_step:{rng.integers(1, 3)}",  # the rest of dataset 1, or its evaluation
  ]
  workdir = tmp_path / "killed_run"
  for kill_at in kills:
    killed = _run_main(configs["killed"], workdir, kill_at)
    assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr[-3000:])

  # SIGTERM after the first step this process takes (in dataset 1 or 2): the next step
  # boundary saves and stops.
  stopped = _run_main(configs["killed"], workdir, "train_step:1:TERM")
  assert stopped.returncode == preemption.EXIT_PREEMPTED, stopped.stderr[-3000:]
  assert "preempted: stopped by SIGTERM in dataset " in stopped.stderr
  with open(workdir / "results.json") as f:
    assert json.load(f)["status"] == "preempted"
  assert os.listdir(workdir / "step_checkpoints")  # the checkpoint it stopped with

  resumed = _run_main(configs["killed"], workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  with open(tmp_path / "ref" / "results.json") as f:
    expected = json.load(f)
  with open(workdir / "results.json") as f:
    got = json.load(f)
  assert got["status"] == "complete"
  for results in (expected, got):
    results["config"].pop("cache_dir")
    results["config"]["replay"].pop("image_cache")
  # Every metric, training summary, pre-training curve and buffer figure, exactly.
  assert comparable(got) == comparable(expected)
  # The retrieval records too (written at the end of each dataset from the counts so far).
  for name in ("thermal", "digits"):
    a = np.load(tmp_path / "ref" / "records" / f"{name}.npz")
    b = np.load(workdir / "records" / f"{name}.npz")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
  # The killed run's replays went through its image cache (one folder: the buffer's key).
  folders = [n for n in os.listdir(tmp_path / "image_cache") if not n.startswith(".")]
  assert len([n for n in folders if not n.endswith(".lock")]) == 1
  # The stage checkpoints superseded every step checkpoint.
  assert os.listdir(workdir / "step_checkpoints") == []


def test_step_checkpoints_keep_the_newest_two_and_restore_exactly(tmp_path):
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=3)
  key = jax.random.PRNGKey(7)
  trees = {}
  for step in range(1, 6):
    key, sub = jax.random.split(key)
    trees[step] = {"w": jax.random.normal(sub, (3, 2)), "n": np.arange(step, dtype=np.int64)}
    steps.save(2, step, {"tree": trees[step]}, {"history": {"at": step}})
  steps.wait()
  names = sorted(os.listdir(tmp_path / "steps"))
  assert names == [str(2 * checkpointing.PHASE_STRIDE + s) for s in (4, 5)]
  assert steps.latest(2) == 5 and steps.latest(1) is None and steps.latest(3) is None
  like = {"tree": {"w": jnp.zeros((3, 2)), "n": np.zeros(4, np.int64)}}
  items, meta = steps.restore(2, 4, like)
  np.testing.assert_array_equal(items["tree"]["w"], trees[4]["w"])  # bit-exact
  np.testing.assert_array_equal(items["tree"]["n"], [0, 1, 2, 3])
  assert meta["history"] == {"at": 4} and meta["step"] == 4 and meta["phase"] == 2
  # Due by steps at multiples of 3 and at a phase's last step.
  assert [s for s in range(1, 8) if steps.step_due(s, 7)] == [3, 6, 7]
  steps.discard(2)
  assert steps.latest(2) is None and os.listdir(tmp_path / "steps") == []
  steps.close()
  # Neither every_steps nor every_minutes: nothing is due (only SIGTERM saves).
  off = checkpointing.StepCheckpointer(str(tmp_path / "off"))
  assert not any(off.step_due(s, 4) for s in range(1, 5)) and not off.time_due()
  off.close()


def _fake_loop_run(
  loop,
  total_steps,
  num_epochs,
  batches_per_epoch,
  stop_after=None,
  prefetch=0,
  reads=None,
  on_epoch_end=lambda loop: None,
):
  """`trainer.train_loop` over fake batches: returns (loop, log of what it consumed).

  A batch is `{'images': [epoch, position]}`; the train step adds it to a running sum and
  the key it was given to a list, so the order of batches and keys is observable.
  `stop_after`: raise `preemption.Preempted` from the checkpoint hook after that step (the
  moment a checkpoint would have been taken), leaving `loop` as the checkpoint holds it.
  `prefetch`: the loop's `prefetch_batches`; `reads` (a list): gets (epoch, position) of
  every batch the input pipeline produced, consumed or not. `on_epoch_end(loop)` runs in
  `after_epoch`.
  """
  log = []

  def train_batches(source, *, batch_size, seed, epoch, start_batch):
    del source, batch_size, seed
    for position in range(start_batch, batches_per_epoch):
      if reads is not None:
        reads.append((epoch, position))
      batch = {k: np.zeros((1,)) for k in trainer.MODEL_INPUTS}
      batch["images"] = np.array([epoch, position])
      yield batch

  class Detector:
    train_spec = type("T", (), {"log_every_steps": 100})
    mesh = None

  Detector.train_batches = staticmethod(train_batches)

  def train_step(state, inputs, replay_inputs, key):
    del replay_inputs
    log.append(("step", tuple(int(v) for v in inputs["images"]), tuple(np.asarray(key))))
    return state + 1, {"loss": jnp.float32(state)}

  def after_epoch(loop):
    log.append(("epoch end", loop.epoch, loop.step))
    on_epoch_end(loop)
    return loop

  def checkpoint(loop):
    if loop.step == stop_after:
      raise preemption.Preempted("stop")

  try:
    loop = trainer.train_loop(
      Detector(),
      loop,
      train_step=train_step,
      replay=replay_setup.NoReplay(),
      source=None,
      batch_size=1,
      data_seed=0,
      total_steps=total_steps,
      num_epochs=num_epochs,
      desc="test",
      on_log=lambda loop, metrics: {},
      after_epoch=after_epoch,
      checkpoint=checkpoint,
      prefetch_batches=prefetch,
    )
  except preemption.Preempted:
    pass
  return loop, log


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
  "stop_after, total_steps, num_epochs",
  [(1, 7, 3), (3, 7, 3), (5, 7, 3), (7, 7, 3), (2, 5, None)],
)
def test_resumed_loop_sees_the_same_batches_and_keys(
  monkeypatch, stop_after, total_steps, num_epochs, prefetch
):
  # 3 batches per epoch: stops at the first step, at an epoch's last step (before its
  # after_epoch), mid-epoch, at the very last step (only after_epoch is left), and in an
  # open-ended loop (pre-training: num_epochs None). With prefetch 2 the stopped run has read
  # batches ahead that no step took: the resumed run must still start at the next unconsumed
  # one.
  monkeypatch.setattr(trainer.sharding_lib, "shard_batch", lambda batch, mesh: batch)
  fresh = lambda: trainer.LoopState(train_state=0, replay_state=None, key=jax.random.PRNGKey(3))
  _, uninterrupted = _fake_loop_run(fresh(), total_steps, num_epochs, 3)
  reads = []
  _, ahead = _fake_loop_run(fresh(), total_steps, num_epochs, 3, prefetch=prefetch, reads=reads)
  assert ahead == uninterrupted
  # The pipeline reads exactly the batches the steps take, none past the last step.
  assert reads == [e[1] for e in uninterrupted if e[0] == "step"]
  stopped, first = _fake_loop_run(
    fresh(), total_steps, num_epochs, 3, stop_after=stop_after, prefetch=prefetch
  )
  assert stopped.step == stop_after
  # What a step checkpoint holds (`trainer.loop_checkpoint`), into a freshly set-up loop.
  restored = fresh()
  restored.train_state, restored.key = stopped.train_state, jnp.asarray(np.asarray(stopped.key))
  restored.step, restored.epoch = stopped.step, stopped.epoch
  restored.batch_in_epoch = stopped.batch_in_epoch
  _, second = _fake_loop_run(restored, total_steps, num_epochs, 3, prefetch=prefetch)
  assert first + second == uninterrupted
  assert [e for e in uninterrupted if e[0] == "step"][-1][1] == (
    (total_steps - 1) // 3,
    (total_steps - 1) % 3,
  )


def test_one_reader_reads_the_next_epoch_during_after_epoch(monkeypatch):
  # One reader for all the epochs: while epoch e's after_epoch runs (e.g. a validation), the
  # next epoch's first batch is read in the background. Waited for up to 10 s: a reader
  # begun only after after_epoch would never deliver it there.
  monkeypatch.setattr(trainer.sharding_lib, "shard_batch", lambda batch, mesh: batch)
  reads, seen = [], []

  def on_epoch_end(loop):
    deadline = time.monotonic() + (10.0 if loop.epoch < 2 else 0.2)  # epoch 2 is the last
    while (loop.epoch + 1, 0) not in reads and time.monotonic() < deadline:
      time.sleep(0.01)
    seen.append((loop.epoch + 1, 0) in reads)

  fresh = trainer.LoopState(train_state=0, replay_state=None, key=jax.random.PRNGKey(3))
  _fake_loop_run(fresh, 6, 3, 2, prefetch=1, reads=reads, on_epoch_end=on_epoch_end)
  # Epochs 0 and 1 had a next epoch to read; epoch 2 was the last.
  assert seen == [True, True, False]
  assert reads == [(e, p) for e in range(3) for p in range(2)]


def test_detector_batches_from_a_start_batch_are_the_epoch_s_tail(pretrained_cache_dir):
  from owl_cl import benchmark  # pylint: disable=g-import-not-at-top
  from owl_cl.detector import Detector  # pylint: disable=g-import-not-at-top
  from owl_cl.testing.configs import tiny_config  # pylint: disable=g-import-not-at-top

  config = tiny_config("swil", pretrained_cache_dir)
  bench = benchmark.load_benchmark(config)
  detector = Detector(config)
  source = bench.sequence[0].train  # 16 images: 4 batches of 4
  args = dict(batch_size=4, seed=5, epoch=1)
  whole = list(detector.train_batches(source, **args))
  tail = list(detector.train_batches(source, **args, start_batch=2))
  assert len(whole) == 4 and len(tail) == 2
  for a, b in zip(whole[2:], tail):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  with pytest.raises(ValueError, match="start_batch"):
    detector.train_batches(source, **args, start_batch=-1)


def test_loop_checkpoint_round_trip_restores_every_field(tmp_path):
  # A loop part-way into epoch 1 of a dataset with the best-validation carry: host records
  # with -inf / NaN (JSON), best parameters, device counters, the last loss, the key.
  key = jax.random.PRNGKey(11)
  params = {"dense": {"kernel": jax.random.normal(key, (4, 3)), "bias": jnp.arange(3.0)}}
  loop = trainer.LoopState(
    train_state={"params": params, "count": jnp.int32(9)},
    replay_state={"mask": np.array([True, False, True]), "pointer": np.int32(2)},
    key=jax.random.fold_in(key, 1),
    step=9,
    epoch=1,
    batch_in_epoch=4,
    replays_in_loss=jnp.int32(17),
    replay_steps=jnp.int32(6),
    replayed=30,
    loss=jnp.float32(2.7182817),
    history={"best_AP": float("-inf"), "best_epoch": 1, "validation": [{"AP": float("nan")}]},
    best_params=jax.tree.map(lambda x: np.asarray(x) + 1, params),
  )
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  items, meta = trainer.loop_checkpoint(loop, replay_setup.NoReplay())
  steps.save(3, loop.step, items, meta)
  steps.wait()
  fresh = trainer.LoopState(
    train_state=jax.tree.map(jnp.zeros_like, loop.train_state),
    replay_state={"mask": np.zeros(3, bool), "pointer": np.int32(0)},
    key=jax.random.PRNGKey(0),
  )
  like_params = jax.tree.map(np.zeros_like, loop.best_params)
  got = trainer.restore_loop(steps, 3, fresh, replay_setup.NoReplay(), like_params)
  steps.close()
  for name in ("train_state", "replay_state", "key", "best_params"):
    a, b = getattr(got, name), getattr(loop, name)
    assert jax.tree.structure(a) == jax.tree.structure(b), name
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)  # bit-exact
  assert (got.step, got.epoch, got.batch_in_epoch, got.replayed) == (9, 1, 4, 30)
  assert (int(got.replays_in_loss), int(got.replay_steps)) == (17, 6)
  assert np.float32(got.loss) == np.float32(loop.loss)  # float32 -> JSON -> float32 exact
  assert got.history["best_AP"] == float("-inf") and got.history["best_epoch"] == 1
  assert np.isnan(got.history["validation"][0]["AP"])


def test_checkpoint_intervals_are_validated():
  from owl_cl import validation  # pylint: disable=g-import-not-at-top
  from owl_cl.testing.configs import load_config  # pylint: disable=g-import-not-at-top

  config = load_config("swil")
  assert config.checkpoint.every_steps is None and config.checkpoint.every_minutes == 10.0
  config.checkpoint.every_steps, config.checkpoint.every_minutes = 0, -1.0
  assert validation.range_problems(config) == [
    "config.checkpoint.every_steps=0 must be >= 1 or None",
    "config.checkpoint.every_minutes=-1.0 must be > 0",
  ]
  config.checkpoint.every_steps, config.checkpoint.every_minutes = 500, 0.5
  assert validation.range_problems(config) == []

"""`trainer.train_loop`'s two forms: one `LoopPlan` and one `LoopHooks` (what the trainer's
phases pass), or their fields by keyword (what the tests' fake detectors pass)."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from owl_cl import trainer
from owl_cl.replay import setup as replay_setup


def _batches(source, *, batch_size, seed, epoch, start_batch):
  """3 batches per epoch; batch k of epoch e holds images [e, k]."""
  del source, batch_size, seed
  for position in range(start_batch, 3):
    batch = {k: np.zeros((1,)) for k in trainer.MODEL_INPUTS}
    batch["images"] = np.array([epoch, position])
    yield batch


def _run(detector, log, **form):
  """Runs 5 steps (3 batches per epoch) in `form`; `log` gets every step's batch and key, the
  logged steps and the epochs' ends. Returns the final loop state."""

  def train_step(state, inputs, replay_inputs, key):
    log.append(("step", tuple(int(v) for v in inputs["images"]), tuple(np.asarray(key))))
    return state + 1, {"loss": np.float32(state)}

  loop = trainer.LoopState(train_state=0, replay_state=None, key=jax.random.PRNGKey(3))
  on_log = lambda loop, metrics: log.append(("logged", loop.step)) or {}
  after_epoch = lambda loop: log.append(("epoch end", loop.epoch, loop.step)) or loop
  fields = dict(source=None, batch_size=1, data_seed=0, total_steps=5, num_epochs=None, desc="t")
  if form.get("typed"):
    plan = trainer.LoopPlan(**fields, log_every=2)
    hooks = trainer.LoopHooks(on_log, after_epoch=after_epoch)
    return trainer.train_loop(
      detector, loop, plan, hooks, train_step=train_step, replay=replay_setup.NoReplay()
    )
  return trainer.train_loop(
    detector,
    loop,
    train_step=train_step,
    replay=replay_setup.NoReplay(),
    on_log=on_log,
    after_epoch=after_epoch,
    **fields,
  )


def test_the_plan_and_the_keyword_form_run_the_same_steps(monkeypatch):
  monkeypatch.setattr(trainer.sharding_lib, "shard_batch", lambda batch, mesh: batch)
  # The plan's form reads no config: this detector has none.
  typed_log, keyword_log = [], []
  bare = types.SimpleNamespace(mesh=None, train_batches=_batches)
  loop = _run(bare, typed_log, typed=True)
  # The keyword form takes log_every from the detector's train_spec.log_every_steps.
  configured = types.SimpleNamespace(
    mesh=None, train_batches=_batches, train_spec=types.SimpleNamespace(log_every_steps=2)
  )
  _run(configured, keyword_log)
  assert typed_log == keyword_log
  # Worked by hand: 5 steps over epochs of 3 batches, logged every 2 steps and at the last,
  # an epoch's end after its last step (and the open-ended loop's after step 5).
  steps = [e[1] for e in typed_log if e[0] == "step"]
  assert steps == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
  assert [e[1] for e in typed_log if e[0] == "logged"] == [2, 4, 5]
  assert [e[1:] for e in typed_log if e[0] == "epoch end"] == [(0, 3), (1, 5)]
  # Every step drew its own key (none reused), and the state counted the 5 steps.
  assert len({e[2] for e in typed_log if e[0] == "step"}) == 5
  assert loop.step == 5 and loop.train_state == 5 and loop.epoch == 1


def test_train_loop_takes_a_plan_or_its_fields_not_both():
  plan = trainer.LoopPlan(None, 1, 0, 1, None, "t", log_every=1)
  hooks = trainer.LoopHooks(on_log=lambda loop, metrics: {})
  with pytest.raises(TypeError, match="LoopPlan and LoopHooks, or their fields, not both"):
    trainer.train_loop(None, None, plan, hooks, train_step=None, replay=None, desc="t")
  with pytest.raises(TypeError, match="needs a LoopPlan and LoopHooks, or their fields"):
    trainer.train_loop(None, None, plan, train_step=None, replay=None)
  with pytest.raises(TypeError, match="unexpected keyword argument 'log_evry'"):
    trainer.train_loop(
      None,
      None,
      train_step=None,
      replay=None,
      source=None,
      batch_size=1,
      data_seed=0,
      total_steps=1,
      num_epochs=1,
      desc="t",
      on_log=lambda loop, metrics: {},
      log_every=2,
      log_evry=2,
    )

"""Forgetting-aware retrieval in the training loop (`owl_cl.replay.retrieval.forgetting`): each
train step's per-replay losses reach the replay state at the indices that step replayed, and a
run interrupted mid-dataset and resumed ends bit for bit as the uninterrupted one. Each run is
`trainer.train_on_dataset` on the tiny config's first dataset (test_lookahead.py's helpers:
16 images, batches of 8, 3 epochs of 2 steps); dedup 'none', so the observed losses steer the
draws within the dataset."""

import jax
import numpy as np
import pytest
from test_lookahead import MAIN
from test_lookahead import _assert_same
from test_lookahead import _config
from test_lookahead import _run
from test_lookahead import shared  # noqa: F401 (the module's fixture)

from owl_cl import preemption
from owl_cl.replay import setup as replay_setup
from owl_cl.replay.retrieval import forgetting
from owl_cl.train import checkpointing


@pytest.mark.slow  # three tiny train_on_dataset runs (one interrupted)
def test_replay_losses_are_written_back_and_a_resume_is_exact(shared, tmp_path, monkeypatch):  # noqa: F811
  config = _config("forgetting_aware", shared, dedup="none")
  seen = []
  count = replay_setup.Replay.count

  def spy(self, loop, metrics):
    consumed = self._consumed
    seen.append(jax.device_get((consumed.indices, consumed.valid, metrics["per_example_replay"])))
    return count(self, loop, metrics)

  with monkeypatch.context() as patch:
    patch.setattr(replay_setup.Replay, "count", spy)
    serial = _run(config, shared, tmp_path, "s")
  state = serial[1]
  assert isinstance(state, forgetting.ForgettingReplayState)
  assert serial[4] == [MAIN] * 6  # no look-ahead: each retrieval reads the last write-back
  # The write-back replayed on the host: latest = each image's last valid loss, reference =
  # its first.
  n = state.num_images
  latest, reference = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
  assert len(seen) == 6
  for indices, valid, losses in seen:
    assert valid.all() and np.isfinite(losses).all() and (losses > 0).all()
    for i, loss in zip(indices, losses):
      latest[i] = loss
      if np.isnan(reference[i]):
        reference[i] = loss
  np.testing.assert_array_equal(state.forget_latest, latest)
  np.testing.assert_array_equal(state.forget_reference, reference)
  assert np.isfinite(latest).sum() > 1
  # Interrupted after step 3 (SIGTERM seen), resumed from its step checkpoint.
  calls = []
  monkeypatch.setattr(preemption, "requested_here", lambda: (calls.append(1), len(calls) == 3)[1])
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"))
  with pytest.raises(preemption.Preempted):
    _run(config, shared, tmp_path, "r", steps)
  steps.close()
  monkeypatch.setattr(preemption, "requested_here", lambda: False)
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"))
  resumed = _run(config, shared, tmp_path, "r", steps)
  steps.close()
  assert resumed[2]["steps"] == 6 and resumed[4] == [MAIN] * 3
  _assert_same(resumed, serial)

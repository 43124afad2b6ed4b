"""The train step's export of each replay's loss (`ReplayLoss.observe_losses`), what
forgetting-aware retrieval writes back (`owl_cl.replay.retrieval.forgetting`): the values are
the replays' per-example detection losses, and exporting them changes nothing else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_loss_adaptivity import LOSS_CONFIG
from test_loss_adaptivity import _run_step
from test_loss_adaptivity import _setup

from owl_cl.train import losses


@pytest.mark.slow  # two tiny train steps compiled: 5-10 s on the loaded 2-core machine
def test_observed_replay_losses_are_the_per_example_detection_losses():
  model, params, new, replay = _setup()
  valid = np.array([True, True, True, False])
  replay = dict(replay, replay_mask=valid)
  grads, metrics = _run_step(model, params, new, replay, observe_losses=True)
  plain_grads, plain = _run_step(model, params, new, replay)
  assert "per_example_replay" not in plain
  exported = metrics.pop("per_example_replay")
  # Nothing else changes: the same loss and metrics bit for bit; the gradient to float32
  # rounding (the extra output changes XLA's fusion of the backward pass: 27 of 512 entries
  # of one kernel differed by <= 8e-7 relative when checked; rtol 1e-5 bounds reassociated
  # float32 sums of O(10) terms).
  assert metrics.keys() == plain.keys()
  for name in plain:
    np.testing.assert_array_equal(metrics[name], plain[name], err_msg=name)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Independently: the replay half's per-example detection loss of one forward over [new ;
  # replay] (eval mode; the tiny model has no dropout, so the step's train-mode forward is the
  # same function). rtol 1e-5: float32 sums of O(1) terms in another order.
  images = jnp.concatenate([new["images"], replay["images"]])
  queries = jnp.concatenate([new["queries"], replay["queries"]])
  out = model.apply({"params": params}, images, queries, train=False)
  b = new["images"].shape[0]
  reference = losses.detection_loss(
    out["pred_logits"][b:], out["pred_boxes"][b:], replay["labels"], replay["boxes"], **LOSS_CONFIG
  )["per_example"]
  assert exported.shape == (4,)
  np.testing.assert_allclose(exported[valid], np.asarray(reference)[valid], rtol=1e-5)

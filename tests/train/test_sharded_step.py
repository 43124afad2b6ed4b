"""The sharded train step on 8 devices equals the 1-device step (docs/architecture.md "Sharding").

Runs in a subprocess because the number of host devices is fixed when JAX starts.
"""

import subprocess
import sys
import textwrap

import pytest

from owl_cl.testing import devices

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from owl_cl import model as model_lib
    from owl_cl.testing.batches import detection_batch
    from owl_cl.train import optim, sharding, step as step_lib
    from owl_cl.train.spec import LossSpec

    model = model_lib.create_model("tiny", vision_layers=1, text_layers=1, vocab_size=64,
                                   image_size=32)
    rng = np.random.default_rng(0)
    B, Q, M, L = 8, 4, 3, 16
    T = (32 // 8) ** 2

    batch = lambda: detection_batch(rng, B, num_queries=Q, max_boxes=M, query_length=L)

    new, replay = batch(), batch()
    replay["stored_logits"] = rng.normal(size=(B, T, Q)).astype(np.float32)
    replay["replay_mask"] = np.array([True] * 7 + [False])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.asarray(new["images"]),
                        jnp.asarray(new["queries"]))["params"]
    params = jax.device_get(params)   # host copy: the step donates its device state
    loss_config = dict(focal_alpha=0.3, focal_gamma=2.0)
    results = []
    for devices in (jax.devices()[:1], jax.devices()):
      mesh = sharding.create_mesh(devices)
      tx, _ = optim.create_optimizer(params, learning_rate=1e-3, total_steps=10,
                                     warmup_steps=0)
      train_step = step_lib.make_train_step(
        model, tx, mesh, step_lib.StepSpec(LossSpec(**loss_config), step_lib.ReplayLoss())
      )
      state = sharding.replicate(step_lib.create_train_state(params, tx), mesh)
      for i in range(2):
        state, metrics = train_step(state, sharding.shard_batch(new, mesh),
                                    sharding.shard_batch(replay, mesh), jax.random.PRNGKey(i))
      results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (p1, m1), (p8, m8) = results
    for k in m1:
      np.testing.assert_allclose(m1[k], m8[k], rtol=2e-4, atol=1e-5, err_msg=k)
    # Adam normalises each update to ~LR (1e-3) whatever the gradient's size, so leaves with
    # tiny gradients (the class head starts at std 1e-6) amplify reduction-order noise: the
    # parameters agree to 5% of one LR-sized update.
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=5e-5)
    assert float(m1["loss"]) > 0 and np.isfinite(float(m1["loss"]))
    print("OK", float(m1["loss"]), float(m8["loss"]))
""")


@pytest.mark.slow
def test_sharded_train_step_matches_single_device():
  env = devices.cpu_devices_env(8)
  proc = subprocess.run(
    [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  assert "OK" in proc.stdout

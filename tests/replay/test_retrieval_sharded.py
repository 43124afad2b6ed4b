"""Every retrieval algorithm picks the same replays on 8 devices (features sharded over the
batch, buffer and state replicated) as on 1 device (docs/architecture.md "Sharding").

One subprocess for all algorithms: the number of host devices is fixed when JAX starts.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from owl_cl.testing import devices

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    sys.path.insert(0, 'tests/replay')
    from conftest import random_buffer
    from owl_cl.replay import state as state_lib
    from owl_cl.replay.retrieval import registry
    from owl_cl.train import sharding

    B, N, C, K, E = 8, 32, 6, 3, 8
    buffer = random_buffer(seed=3, n=N, c=C, k=K, e=E)
    rng = np.random.default_rng(0)
    feats = {'class_embeddings': rng.normal(size=(B, K, E)).astype(np.float32),
             'query_embeddings': rng.normal(size=(B, K, E)).astype(np.float32)}
    mesh = sharding.create_mesh()
    one = jax.devices()[0]
    small = dict(num_candidates=12, knn_k=3)
    for name in sorted(registry.ALGORITHMS):
      hp = small if 'aser' in name else {}
      algo = registry.get_algorithm(name, **hp)
      s = algo.prepare(state_lib.init_replay_state(N, jax.random.PRNGKey(1), num_classes=C),
                       buffer)
      active = jnp.array([True, True, False, True, True, True, False, True])
      results = []
      for place in ('one', 'eight'):
        if place == 'one':
          args = jax.device_put((s, buffer, feats, active), one)
        else:
          args = (sharding.replicate(s, mesh), sharding.replicate(buffer, mesh),
                  jax.device_put(feats, sharding.batch_sharding(mesh)),
                  sharding.replicate(active, mesh))
        st, buf, ft, act = args
        f = jax.jit(algo, static_argnums=3)
        out = []
        for _ in range(2):
          idx, valid, st = f(st, buf, ft, B, act)
          out += [np.asarray(idx), np.asarray(valid), np.asarray(st.dedup_mask),
                  np.asarray(st.class_pointer)]
        results.append(out)
      for a, b in zip(*results):
        np.testing.assert_array_equal(a, b, err_msg=name)
      assert results[0][1].sum() == 6, name
      print('same', name)
    print('OK')
""")


@pytest.mark.slow
def test_every_algorithm_same_indices_on_8_devices():
  env = devices.cpu_devices_env(8)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run(
    [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900, cwd=root
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  assert "OK" in proc.stdout

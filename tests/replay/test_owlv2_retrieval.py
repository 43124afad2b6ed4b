"""Every retrieval algorithm runs on the features of an OWLv2 model (docs/owlv2.md).

The retrieval reads the model only through the features of the new images (the top-k class
and query embeddings of `train.step.make_embed_step`, or the loss-adaptivity pre-forward
`make_new_loss_step`, which with OWLv2 also has the objectness term). Computed here from a tiny
OWLv2 model, they have exactly the structure (keys, shapes, dtypes) of a v1 model's of the same
towers, which every algorithm's jitted retrieval is run on in test_retrieval_sharded.py; two
algorithms that between them use every feature-reading step (SWIL's similarity weighting,
SW-ASER-PC's ASV scores) run here on the OWLv2 features themselves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.model import owl_vit as owl_lib
from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import step as step_lib

B, N, C, K, SIZE, Q = 4, 24, 6, 3, 32, 3


@pytest.mark.slow
def test_retrieval_reads_owlv2_features_as_v1s(make_buffer):
  model = owl_lib.create_model("owlv2_tiny", image_size=SIZE, vision_layers=1, text_layers=1)
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.uniform(size=(B, SIZE, SIZE, 3)), jnp.float32)
  queries = jnp.asarray(rng.integers(1, 50, (B, Q, 16)), jnp.int32)  # within the tiny vocab
  params = jax.jit(model.init)(jax.random.key(0), images, queries)["params"]
  mesh = sharding_lib.create_mesh()
  labels = np.zeros((B, 1, Q), np.float32)
  labels[:, 0, 1] = 1.0
  boxes = np.tile(np.array([0.5, 0.5, 0.2, 0.2], np.float32), (B, 1, 1))
  embedded = step_lib.make_embed_step(model, mesh, k=K)(params, images, queries)
  # The structures by abstract evaluation (nothing compiled): the loss-adaptivity pre-forward
  # of OWLv2 (objectness term on) and a v1 model of the same towers give the same features.
  structure = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
  pre = jax.eval_shape(
    step_lib.make_new_loss_step(model, mesh, loss_config=dict(objectness_weight=0.5), k=K),
    params,
    images,
    queries,
    labels,
    boxes,
  )
  assert structure(pre) == dict(structure(embedded), per_example=((B,), jnp.float32))
  v1 = model.clone(version="v1")
  v1_params = jax.eval_shape(v1.init, jax.random.key(0), images, queries)["params"]
  v1_embedded = jax.eval_shape(step_lib.make_embed_step(v1, mesh, k=K), v1_params, images, queries)
  assert structure(embedded) == structure(v1_embedded)
  e = embedded["class_embeddings"].shape[-1]
  buffer = make_buffer(seed=1, n=N, c=C, k=K, e=e)
  active = jnp.array([True, False, True, True])
  for name in ("swil", "sw_aser_pc"):
    assert name in registry.ALGORITHMS
    hp = dict(num_candidates=8, knn_k=3) if "aser" in name else {}
    algo = registry.get_algorithm(name, **hp)
    state = algo.prepare(
      state_lib.init_replay_state(N, jax.random.PRNGKey(2), num_classes=C), buffer
    )
    idx, valid, _ = jax.jit(algo, static_argnums=3)(state, buffer, embedded, B, active)
    idx, valid = np.asarray(idx), np.asarray(valid)
    assert idx.shape == (B,) and valid.sum() == 3, name  # one per active new image
    assert ((idx[valid] >= 0) & (idx[valid] < N)).all(), name
    assert len(set(idx[valid].tolist())) == 3, name  # dedup: no image twice in a call

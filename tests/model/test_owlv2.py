"""OWLv2 in owl_cl.model: the objectness head's tree, stop_gradient, top-k token sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.model import objectness
from owl_cl.model import owl_vit as owl_lib

SIZE, B, Q = 32, 2, 3


@pytest.fixture(scope="module")
def tiny():
  model = owl_lib.create_model(
    "owlv2_tiny",
    image_size=SIZE,
    vision_layers=1,
    text_layers=1,
    vision_stochastic_depth=0.0,
    text_stochastic_depth=0.0,
  )
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.uniform(size=(B, SIZE, SIZE, 3)), jnp.float32)
  queries = jnp.asarray(rng.integers(1, 50, (B, Q, 16)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), images, queries)["params"]
  # Random last layers (zero-initialised as scenic's) so that objectness varies per token.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: (
      rng.normal(0.0, 0.1, x.shape).astype(np.float32)
      if "Dense_2" in jax.tree_util.keystr(p)
      else x
    ),
    params,
  )
  return model, params, images, queries


def test_variants_and_tree():
  assert owl_lib.get_variant_config("owlv2_b16").image_size == 960
  assert owl_lib.get_variant_config("owlv2_l14").num_tokens == 72 * 72  # 5,184 (+1 class)
  assert owl_lib.get_variant_config("vit_b16").version == "v1"
  with pytest.raises(ValueError, match="objectness_top_k"):
    owl_lib.create_model("tiny", objectness_top_k=4)
  with pytest.raises(ValueError, match="version"):
    owl_lib.create_model("tiny", version="v3")


@pytest.mark.slow
def test_top_k_is_the_full_output_at_the_top_tokens(tiny):
  """Invariant: the train-time top-k outputs equal the full outputs gathered at the k tokens of
  highest objectness (stochastic depth off, so train and eval compute the same)."""
  model, params, images, queries = tiny
  full = model.apply({"params": params}, images, queries)
  t = full["objectness_logits"].shape[1]
  assert t == (SIZE // 8) ** 2 and "keep_tokens" not in full
  k = 5
  top = model.clone(objectness_top_k=k).apply(
    {"params": params}, images, queries, train=True, rngs={"dropout": jax.random.key(1)}
  )
  order = np.argsort(-np.asarray(full["objectness_logits"]), axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(top["keep_tokens"], order)
  for name in ("pred_logits", "pred_boxes", "class_embeddings"):
    want = np.take_along_axis(np.asarray(full[name]), order[..., None], axis=1)
    np.testing.assert_allclose(top[name], want, atol=1e-6, rtol=1e-6, err_msg=name)
  np.testing.assert_allclose(
    top["objectness_logits"],
    np.sort(np.asarray(full["objectness_logits"]), axis=1)[:, ::-1][:, :k],
    atol=1e-6,
  )
  # Evaluation keeps every token whatever objectness_top_k is.
  ev = model.clone(objectness_top_k=k).apply({"params": params}, images, queries)
  assert ev["pred_logits"].shape[1] == t


@pytest.mark.slow
def test_objectness_gradient_reaches_only_its_head(tiny):
  """stop_gradient (scenic's OWLv2 config): d(objectness)/d(backbone) = 0, head's != 0."""
  model, params, images, queries = tiny

  def f(p):
    return model.apply({"params": p}, images, queries)["objectness_logits"].sum()

  grads = jax.jit(jax.grad(f))(params)
  backbone = jax.tree.leaves(grads["backbone"]) + jax.tree.leaves(grads["class_head"])
  assert all(float(jnp.abs(g).max()) == 0.0 for g in backbone)
  assert float(jnp.abs(grads["objectness_head"]["Dense_0"]["kernel"]).max()) > 0.0


def test_query_token_index_and_gather():
  logits = jnp.array([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 1.0, 2.0]])
  np.testing.assert_array_equal(objectness.query_token_index(logits), [1, 0])  # ties: lower
  vals, idx = objectness.top_k_tokens(logits, 2)
  np.testing.assert_array_equal(idx, [[1, 2], [0, 3]])
  np.testing.assert_array_equal(vals, [[3.0, 3.0], [5.0, 2.0]])
  table = jnp.arange(8.0).reshape(4, 2)  # shared by both images
  np.testing.assert_array_equal(
    objectness.gather_tokens(table[None], idx), [[[2, 3], [4, 5]], [[0, 1], [6, 7]]]
  )
  with pytest.raises(ValueError, match="objectness_top_k"):
    objectness.top_k_tokens(logits, 5)


def test_scenic_owlv2_msgpack_loads_and_cli_reads_it(tmp_path):
  """A scenic OWLv2 checkpoint (msgpack, {'params': tree} with scenic's names, including
  ``objectness_head``) loads into owlv2 params; a v1 target names the extra head."""
  import flax

  from owl_cl.model import convert as ck
  from owl_cl.train import checkpointing

  config = owl_lib.get_variant_config("owlv2_tiny").replace(
    image_size=SIZE, vision_layers=1, text_layers=1
  )
  rng = np.random.default_rng(5)
  flat = ck.tree.flatten(ck.abstract_params(config))
  params = ck.tree.unflatten(
    {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in flat.items()}
  )
  assert "objectness_head/Dense_2/kernel" in flat
  scenic = flax.core.unfreeze(params)
  # scenic's released naming: resblocks.N (fix_scenic_names maps them back).
  vis = scenic["backbone"]["clip"]["visual"]["transformer"]
  vis["resblocks.0"] = vis.pop("resblocks_0")
  path = tmp_path / "owl2-b16-960-st-ngrams"
  path.write_bytes(flax.serialization.msgpack_serialize({"params": scenic}))
  loaded = ck.load_scenic_checkpoint(str(path), config)
  for k, v in ck.tree.flatten(params).items():
    np.testing.assert_array_equal(ck.tree.flatten(loaded)[k], v, err_msg=k)
  with pytest.raises(ck.CheckpointMismatchError, match="objectness_head"):
    ck.load_scenic_checkpoint(str(path), config.replace(version="v1"))
  out = str(tmp_path / "ours")
  ck.main(
    [
      "scenic-to-owl_cl",
      str(path),
      out,
      "--variant",
      "owlv2_tiny",
      "--override",
      f"image_size={SIZE}",
      "--override",
      "vision_layers=1",
      "--override",
      "text_layers=1",
    ]
  )
  restored, meta = checkpointing.load_params(out)
  assert meta["model_config"]["version"] == "owlv2"
  assert ck.tree.flatten(restored).keys() == ck.tree.flatten(params).keys()


def test_cache_keys_hold_the_objectness_weight():
  """The loss's cache-key fields hold the objectness weight: 0 for v1, OWLv2's 0.5."""
  from owl_cl import config_spec
  from owl_cl.configs import base
  from owl_cl.train.spec import LossSpec

  key = lambda c: config_spec.key_material(config_spec.from_config(LossSpec, c.loss, "loss"))
  v1 = key(base.get_config(""))
  assert v1["objectness_weight"] == 0.0
  v2 = base.get_config("owlv2")
  assert v2.model.variant == "owlv2_tiny"
  assert key(v2) == dict(v1, objectness_weight=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 5])
def test_train_step_distils_stored_objectness_at_the_kept_tokens(tiny, top_k):
  """The train step's DER++ term with an OWLv2 store: the stored class logits are the model's
  own (class MSE 0) and the stored objectness is the model's plus d_t = (t + 1) / T at token
  t, so the objectness MSE is the mean of d_t^2 over the tokens the heads saw (all, or the
  top-k by objectness: `_split_outputs` gathers the stored arrays at `keep_tokens`)."""
  from owl_cl.train import step as step_lib
  from owl_cl.train.spec import LossSpec

  model, params, images, queries = tiny
  model = model.clone(objectness_top_k=top_k)
  full = model.apply({"params": params}, images, queries)
  t = full["objectness_logits"].shape[1]
  offset = (np.arange(t) + 1.0) / t
  labels = np.zeros((B, 1, Q), np.float32)
  labels[:, 0, 1] = 1.0
  boxes = np.tile(np.array([0.5, 0.5, 0.3, 0.3], np.float32), (B, 1, 1))
  example = dict(images=images, queries=queries, labels=labels, boxes=boxes)
  replay = dict(
    example,
    stored_logits=np.asarray(full["pred_logits"]),
    stored_objectness=np.asarray(full["objectness_logits"]) + offset,
    replay_mask=np.ones(B, bool),
  )
  key = jax.random.key(2)
  _, metrics = step_lib._loss_fn(  # pylint: disable=protected-access
    params,
    example,
    replay,
    key,
    model=model,
    spec=step_lib.StepSpec(
      loss=LossSpec(objectness_weight=0.5),
      replay=step_lib.ReplayLoss(alpha=2.0, beta=1.0, objectness_distill_weight=0.25),
    ),
  )
  if top_k:
    kept = model.apply({"params": params}, images, queries, train=True, rngs={"dropout": key})[
      "keep_tokens"
    ]
    expected = np.mean(offset[np.asarray(kept)] ** 2)
  else:
    expected = np.mean(offset**2)
  # Logits O(1-10) recomputed by the same float32 forward: class MSE ~1e-12.
  np.testing.assert_allclose(metrics["distill_objectness"], expected, rtol=1e-4)
  np.testing.assert_allclose(metrics["distill_loss"], 0.25 * expected, rtol=1e-4, atol=1e-8)


def test_buffer_key_and_selection_objectness_rules(tmp_path):
  """An OWLv2 store (it keeps the objectness logits) has 'objectness' in its key, v1's key
  has no such entry; `replay.selection.objectness_in_loss` enters the key (from the replay
  spec) and is refused up front for a v1 model or a zero objectness weight."""
  import types

  from owl_cl import cache_keys
  from owl_cl import validation
  from owl_cl.configs import base

  annotations = tmp_path / "instances.json"
  annotations.write_text('{"images": []}')
  source = types.SimpleNamespace(annotation_file=str(annotations))

  def key(config):
    return cache_keys.buffer_key_material(config, source, {"cache_key": "m"})

  v1, v2 = base.get_config(""), base.get_config("owlv2")
  assert key(v1)["objectness"] is False and not key(v1)["replay"]["selection"]["objectness_in_loss"]
  assert key(v2)["objectness"] is True and not key(v2)["replay"]["selection"]["objectness_in_loss"]
  v2.replay.selection.objectness_in_loss = True
  assert key(v2)["replay"]["selection"]["objectness_in_loss"] is True
  assert validation.model_problems(v2) == []
  v2.loss.objectness_weight = 0.0
  (problem,) = validation.model_problems(v2)
  assert "objectness_in_loss=True adds nothing with config.loss.objectness_weight=0.0" in problem
  v1.replay.selection.objectness_in_loss = True
  (problem,) = validation.model_problems(v1)
  assert "objectness_in_loss=True needs an OWLv2 model" in problem and "'v1'" in problem
  v1.replay.selection.objectness_in_loss = False
  v1.replay.der_objectness_weight = -1.0
  assert any("der_objectness_weight=-1.0" in p for p in validation.range_problems(v1))

"""LR groups, layer-wise decay, the schedule (docs/reference.md §3) and frozen parts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from owl_cl import model as model_lib
from owl_cl.testing.batches import detection_batch
from owl_cl.train import optim
from owl_cl.train import sharding
from owl_cl.train import step as step_lib
from owl_cl.train.spec import LossSpec


def _params(num_vision=3, num_text=2):
  leaf = jnp.ones((2,))
  block = {"ln_0": {"scale": leaf}, "mlp": {"c_fc": {"kernel": leaf}}}
  return {
    "backbone": {
      "clip": {
        "logit_scale": jnp.ones(()),
        "text": {
          "token_embedding": {"embedding": leaf},
          "positional_embedding": leaf,
          "transformer": {f"resblocks_{i}": block for i in range(num_text)},
          "ln_final": {"scale": leaf},
          "text_projection": {"kernel": leaf},
        },
        "visual": {
          "conv1": {"kernel": leaf},
          "class_embedding": leaf,
          "positional_embedding": leaf,
          "ln_pre": {"scale": leaf},
          "transformer": {f"resblocks_{i}": block for i in range(num_vision)},
          "ln_post": {"scale": leaf},
        },
      },
      "merged_class_token": {"scale": leaf},
    },
    "class_head": {"Dense_0": {"kernel": leaf}},
    "obj_box_head": {"Dense_2": {"kernel": leaf}},
  }


def test_multipliers_follow_groups_and_depth():
  m = 0.5
  flat = optim.multipliers_summary(_params(), text_lr_multiplier=0.1, layerwise_decay=m)
  # Heads, merged LN and the final vision LN: depth 0, vision group.
  assert flat["class_head/Dense_0/kernel"] == 1.0
  assert flat["obj_box_head/Dense_2/kernel"] == 1.0
  assert flat["backbone/merged_class_token/scale"] == 1.0
  assert flat["backbone/clip/visual/ln_post/scale"] == 1.0
  # Vision blocks: last block depth 1, first block depth 3, embeddings depth 4.
  assert flat["backbone/clip/visual/transformer/resblocks_2/mlp/c_fc/kernel"] == m
  assert flat["backbone/clip/visual/transformer/resblocks_0/ln_0/scale"] == m**3
  assert flat["backbone/clip/visual/conv1/kernel"] == m**4
  assert flat["backbone/clip/visual/ln_pre/scale"] == m**4
  # Text tower counted independently, times 0.1.
  assert flat["backbone/clip/text/ln_final/scale"] == pytest.approx(0.1)
  assert flat["backbone/clip/text/text_projection/kernel"] == pytest.approx(0.1)
  assert flat["backbone/clip/text/transformer/resblocks_1/ln_0/scale"] == pytest.approx(0.1 * m)
  assert flat["backbone/clip/text/transformer/resblocks_0/ln_0/scale"] == pytest.approx(0.1 * m**2)
  assert flat["backbone/clip/text/token_embedding/embedding"] == pytest.approx(0.1 * m**3)


def test_invalid_decay_raises():
  with pytest.raises(ValueError, match="layerwise_decay"):
    optim.lr_multipliers(_params(), text_lr_multiplier=0.1, layerwise_decay=1.5)


def test_schedule_warmup_then_cosine_to_zero():
  s = optim.warmup_cosine_schedule(1.0, total_steps=110, warmup_steps=10)
  assert float(s(0)) == 0.0
  assert float(s(5)) == pytest.approx(0.5)
  assert float(s(10)) == pytest.approx(1.0)
  # Cosine: halfway through the decay the LR is half the peak.
  assert float(s(60)) == pytest.approx(0.5, abs=1e-6)
  assert float(s(110)) == pytest.approx(0.0, abs=1e-7)


def test_update_equals_adam_times_multiplier():
  """One step equals plain Adam scaled by LR * group multiplier (checked per leaf)."""
  params = _params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
  tx, _ = optim.create_optimizer(
    params,
    learning_rate=1.0,
    total_steps=10,
    warmup_steps=0,
    text_lr_multiplier=0.1,
    layerwise_decay=0.5,
    grad_clip_norm=None,
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  ref_tx = optax.adam(1.0, b1=0.9, b2=0.999, eps=1e-8)
  ref, _ = ref_tx.update(grads, ref_tx.init(params), params)
  mult = optim.lr_multipliers(params, text_lr_multiplier=0.1, layerwise_decay=0.5)
  for u, r, m in zip(jax.tree.leaves(updates), jax.tree.leaves(ref), jax.tree.leaves(mult)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(r) * m, rtol=1e-6)


def test_global_norm_clip():
  params = {"class_head": {"w": jnp.zeros((4,))}}
  grads = {"class_head": {"w": jnp.array([30.0, 40.0, 0.0, 0.0])}}  # norm 50
  clip = optax.clip_by_global_norm(1.0)
  clipped, _ = clip.update(grads, clip.init(params))
  np.testing.assert_allclose(np.asarray(clipped["class_head"]["w"]), [0.6, 0.8, 0, 0], rtol=1e-6)
  # The optimizer chain uses the same clipping first: with SGD-like comparison via state.
  tx, _ = optim.create_optimizer(params, learning_rate=1.0, total_steps=10, warmup_steps=0)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert np.all(np.isfinite(np.asarray(updates["class_head"]["w"])))


# ----------------------------------------------------------------------------- per tensor


def _hf_name_to_path(name: str):
  """Scenic path of an HF OwlViTForObjectDetection parameter name, or None.

  Source: docs/reference.md §1.2.
  """
  parts = name.split(".")
  leaf = {"weight": "kernel", "bias": "bias"}
  if name == "owlvit.logit_scale":
    return ("backbone", "clip", "logit_scale")
  if name == "owlvit.visual_projection.weight":
    return None
  if name == "owlvit.text_projection.weight":
    return ("backbone", "clip", "text", "text_projection", "kernel")
  if parts[0] in ("class_head", "box_head"):
    head = "class_head" if parts[0] == "class_head" else "obj_box_head"
    sub = {
      "dense0": "Dense_0",
      "dense1": "Dense_1",
      "dense2": "Dense_2",
      "logit_shift": "logit_shift",
      "logit_scale": "logit_scale",
    }[parts[1]]
    return (head, sub, leaf[parts[2]])
  ln = {"weight": "scale", "bias": "bias"}
  if parts[0] == "layer_norm":
    return ("backbone", "merged_class_token", ln[parts[1]])
  tower = "text" if parts[1] == "text_model" else "visual"
  base = ("backbone", "clip", tower)
  if parts[2] == "embeddings":
    return (
      base
      + {
        "token_embedding": ("token_embedding", "embedding"),
        "position_embedding": ("positional_embedding",),
        "patch_embedding": ("conv1", "kernel"),
        "class_embedding": ("class_embedding",),
      }[parts[3]]
    )
  if parts[2] in ("final_layer_norm", "pre_layernorm", "post_layernorm"):
    top = {"final_layer_norm": "ln_final", "pre_layernorm": "ln_pre", "post_layernorm": "ln_post"}[
      parts[2]
    ]
    return base + (top, ln[parts[3]])
  assert parts[2] == "encoder" and parts[3] == "layers"
  block = base + ("transformer", f"resblocks_{parts[4]}")
  sub = parts[5:]
  if sub[0] == "self_attn":
    proj = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}[sub[1]]
    return block + ("attn", proj, leaf[sub[2]])
  if sub[0] == "mlp":
    return block + ("mlp", {"fc1": "c_fc", "fc2": "c_proj"}[sub[1]], leaf[sub[2]])
  return block + ({"layer_norm1": "ln_0", "layer_norm2": "ln_1"}[sub[0]], ln[sub[1]])


def test_per_tensor_decay_matches_released_code_walk_over_hf_parameters():
  """Reference: the released code's apply_lw_lr_decay walk over a real HF model's tensors."""
  transformers = pytest.importorskip("transformers")
  from flax import traverse_util

  from owl_cl import model as model_lib

  layers_text, layers_vision = 2, 3
  hf = transformers.OwlViTForObjectDetection(
    transformers.OwlViTConfig(
      text_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers_text, num_attention_heads=2
      ),
      vision_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers_vision,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
      ),
      projection_dim=16,
    )
  )
  names = [n for n, _ in hf.named_parameters()]
  tower_index = names.index("owlvit.vision_model.embeddings.class_embedding")
  lrs, mult = [1.0, 0.1], 0.9  # [vision (walked first), text], as lrs in the released code
  expected = {}
  current_tower, current_lr = 0, lrs[0]
  for idx in reversed(range(len(names))):
    if current_tower == 0 and idx == tower_index:
      current_tower, current_lr = 1, lrs[1]
    expected[names[idx]] = current_lr
    current_lr *= mult

  model = model_lib.create_model("tiny", vision_layers=layers_vision, text_layers=layers_text)
  cfg = model.config
  params = jax.eval_shape(
    lambda: model.init(
      jax.random.PRNGKey(0),
      jnp.zeros((1, cfg.image_size, cfg.image_size, 3)),
      jnp.zeros((1, 2, cfg.context_length), jnp.int32),
    )
  )["params"]
  got = traverse_util.flatten_dict(
    optim.lr_multipliers(
      params, text_lr_multiplier=0.1, layerwise_decay=mult, layerwise_granularity="tensor"
    )
  )
  mapped = {_hf_name_to_path(n): v for n, v in expected.items() if _hf_name_to_path(n)}
  assert set(mapped) == set(got)
  for path, value in mapped.items():
    assert got[path] == pytest.approx(value, rel=1e-12), path
  # Spot values: the last tensor (merged LN bias) is undecayed; the vision class embedding
  # falls in the text walk at its start (the released code's tower boundary).
  assert got[("backbone", "merged_class_token", "bias")] == 1.0
  assert got[("backbone", "clip", "visual", "class_embedding")] == pytest.approx(0.1)
  assert got[("backbone", "clip", "text", "ln_final", "bias")] == pytest.approx(0.1 * mult)
  # For L/14 the boundary is HF index 197, as the released code's tower_indices.
  assert optim.hf_tensor_order(12, 24)[1] == 197


def test_per_tensor_decay_rejects_foreign_tree_and_unknown_granularity():
  with pytest.raises(ValueError, match="outside the HF OWL-ViT tensor order"):
    optim.lr_multipliers(
      {"foo": {"kernel": jnp.ones(2)}},
      text_lr_multiplier=0.1,
      layerwise_decay=0.9,
      layerwise_granularity="tensor",
    )
  with pytest.raises(ValueError, match="layerwise_granularity"):
    optim.lr_multipliers(
      _params(), text_lr_multiplier=0.1, layerwise_decay=0.9, layerwise_granularity="block"
    )


# ----------------------------------------------------------------------------- frozen parts


def _names(tree, keep):
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, str))[0]
  return {"/".join(k.key for k in path) for path, label in flat if label == keep}


def test_presets_expand_to_the_towers_and_heads():
  params = _params()
  frozen = _names(optim.frozen_labels(params, ("text_tower",)), "frozen")
  assert frozen == {
    n
    for n in optim.multipliers_summary(params, text_lr_multiplier=1.0, layerwise_decay=1.0)
    if n.startswith("backbone/clip/text/")
  }
  trained = _names(optim.frozen_labels(params, ("heads_only",)), "train")
  assert trained == {"class_head/Dense_0/kernel", "obj_box_head/Dense_2/kernel"}
  image = _names(optim.frozen_labels(params, ("image_tower",)), "frozen")
  assert "backbone/merged_class_token/scale" in image
  assert "backbone/clip/visual/transformer/resblocks_0/ln_0/scale" in image
  assert not any(n.startswith(("backbone/clip/text", "class_head")) for n in image)
  # A regex matches the full path: 'class_head/.*' does not freeze 'obj_box_head'.
  assert _names(optim.frozen_labels(params, ("class_head/.*",)), "frozen") == {
    "class_head/Dense_0/kernel"
  }


@pytest.mark.parametrize(
  "frozen, message",
  [(("text/.*",), "match no parameter"), (("(",), "valid regex"), ((3,), "not a str")],
)
def test_bad_patterns_raise_naming_the_entry(frozen, message):
  with pytest.raises(ValueError, match=message):
    optim.frozen_labels(_params(), frozen)


def test_frozen_leaves_have_no_adam_state_and_zero_update():
  """mu / nu of frozen leaves are MaskedNode; trained leaves update as unfrozen Adam does."""
  params = _params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
  kwargs = dict(
    learning_rate=1.0,
    total_steps=10,
    warmup_steps=0,
    text_lr_multiplier=0.1,
    layerwise_decay=0.5,
    grad_clip_norm=None,
  )
  tx, _ = optim.create_optimizer(params, frozen=("text_tower",), **kwargs)
  state = tx.init(params)
  adam = [
    s
    for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState)
  ]
  assert len(adam) == 1
  for moments in (adam[0].mu, adam[0].nu):
    text = moments["backbone"]["clip"]["text"]
    assert all(
      isinstance(x, optax.MaskedNode)
      for x in jax.tree.leaves(text, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    )
    assert not jax.tree.leaves(text)  # no array stored for the text tower
    assert isinstance(moments["class_head"]["Dense_0"]["kernel"], jax.Array)
  updates, _ = tx.update(grads, state, params)
  ref_tx, _ = optim.create_optimizer(params, **kwargs)
  ref, _ = ref_tx.update(grads, ref_tx.init(params), params)
  labels = optim.frozen_labels(params, ("text_tower",))
  for u, r, label in zip(jax.tree.leaves(updates), jax.tree.leaves(ref), jax.tree.leaves(labels)):
    if label == "frozen":
      assert np.all(np.asarray(u) == 0.0)
    else:  # the same ops on the same values: bit-identical
      np.testing.assert_array_equal(np.asarray(u), np.asarray(r))


@pytest.mark.slow
def test_frozen_parameters_bit_identical_after_train_steps():
  """Two steps of the real train step (tiny model): the text tower is unchanged, the heads move."""
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32
  )
  rng = np.random.default_rng(0)
  batch = detection_batch(rng, 2, num_queries=4, max_boxes=3, query_length=16)
  params = jax.jit(model.init)(
    jax.random.PRNGKey(0), jnp.asarray(batch["images"]), jnp.asarray(batch["queries"])
  )["params"]
  params = jax.device_get(params)
  mesh = sharding.create_mesh(jax.devices()[:1])
  tx, _ = optim.create_optimizer(
    params, learning_rate=1e-2, total_steps=10, warmup_steps=0, frozen=("text_tower",)
  )
  train_step = step_lib.make_train_step(
    model, tx, mesh, step_lib.StepSpec(LossSpec(focal_alpha=0.3, focal_gamma=2.0))
  )
  state = sharding.replicate(step_lib.create_train_state(params, tx), mesh)
  for i in range(2):
    state, _ = train_step(state, sharding.shard_batch(batch, mesh), None, jax.random.PRNGKey(i))
  after = jax.device_get(state.params)
  text_before = jax.tree.leaves(params["backbone"]["clip"]["text"])
  text_after = jax.tree.leaves(after["backbone"]["clip"]["text"])
  for a, b in zip(text_before, text_after):
    np.testing.assert_array_equal(a, b)
  moved = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(params["obj_box_head"]), jax.tree.leaves(after["obj_box_head"]))
  ]
  assert all(moved)

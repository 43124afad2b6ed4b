"""How the towers execute: attention kernel, rematerialisation, mixed precision.

None of these may change the parameter tree; attention and remat must not change the
values (beyond float32 rounding); bfloat16 compute stays within a bound derived from its
8-bit mantissa.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.model import clip as clip_lib
from owl_cl.model import owl_vit
from owl_cl.testing.gradients import grad_agreement


def _text_mask(tokens):
  """The text tower's mask (causal AND token > 0), built as TextEncoder builds it."""
  valid = tokens > 0
  return nn.combine_masks(nn.make_attention_mask(valid, valid), nn.make_causal_mask(tokens))


def _padded_tokens():
  # Four queries of 8 tokens, right-padded with 0, one of them all padding (an empty query
  # slot); lengths 8, 5, 2, 0.
  tokens = np.zeros((4, 8), np.int32)
  tokens[0] = np.arange(1, 9)
  tokens[1, :5] = [7, 3, 9, 4, 11]
  tokens[2, :2] = [5, 12]
  return jnp.asarray(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("with_mask", [True, False])
def test_self_attention_equals_flax_multihead_attention(with_mask):
  tokens = _padded_tokens()
  mask = _text_mask(tokens) if with_mask else None
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 32), jnp.float32)
  ref = nn.MultiHeadDotProductAttention(
    num_heads=4, use_bias=True, force_fp32_for_softmax=True, deterministic=True
  )
  ours = clip_lib.SelfAttention(num_heads=4, attention="xla")
  params = ref.init(jax.random.PRNGKey(1), x, x, mask=mask)
  params_ours = ours.init(jax.random.PRNGKey(1), x, mask)
  # Same tree, same shapes, same initial values (same names and initialisers).
  assert jax.tree.structure(params) == jax.tree.structure(params_ours)
  jax.tree.map(np.testing.assert_array_equal, params, params_ours)
  # Non-trivial biases so that every parameter matters.
  params = jax.tree.map(
    lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params
  )
  want = ref.apply(params, x, x, mask=mask)
  got = ours.apply(params, x, mask)
  # Outputs are O(1) (unit-normal inputs, lecun-normal kernels); the two compute the same
  # float32 sums in a different order (scale before vs after the q.k product), a few ulps
  # of 1.2e-7 each: 1e-5 absolute.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_text_tower_with_padded_queries_equals_flax_attention(monkeypatch):
  """The whole text tower (padded queries, their mask) with flax's module swapped in."""
  tower = clip_lib.TextEncoder(
    vocab_size=64, features=32, num_layers=2, num_heads=4, out_features=16, context_length=8
  )
  tokens = _padded_tokens()
  params = tower.init(jax.random.PRNGKey(0), tokens)
  got = tower.apply(params, tokens)

  class FlaxAttention(nn.Module):
    num_heads: int
    dtype: object = jnp.float32
    attention: str = "auto"

    @nn.compact
    def __call__(self, x, mask=None):
      return nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads,
        use_bias=True,
        force_fp32_for_softmax=True,
        deterministic=True,
        name="inner",
      )(x, x, mask=mask)

  # Re-nest the parameters so the swapped-in module (one scope deeper) reads them.
  def nest(tree):
    if isinstance(tree, dict):
      return {k: ({"inner": v} if k == "attn" else nest(v)) for k, v in tree.items()}
    return tree

  monkeypatch.setattr(clip_lib, "SelfAttention", FlaxAttention)
  want = tower.apply(nest(jax.tree_util.tree_map(lambda a: a, dict(params))), tokens)
  # Two blocks of O(1) activations, then a projection: rounding differences of ~1e-7
  # relative per operation stay far below 1e-5.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_resolve_attention():
  assert clip_lib.resolve_attention("auto", jnp.bfloat16, 64, "gpu") == "cudnn"
  assert clip_lib.resolve_attention("auto", jnp.float16, 64, "gpu") == "cudnn"
  assert clip_lib.resolve_attention("auto", jnp.float32, 64, "gpu") == "xla"
  assert clip_lib.resolve_attention("auto", jnp.bfloat16, 64, "cpu") == "xla"
  assert clip_lib.resolve_attention("auto", jnp.bfloat16, 64, "tpu") == "xla"
  assert clip_lib.resolve_attention("auto", jnp.bfloat16, 12, "gpu") == "xla"
  assert clip_lib.resolve_attention("xla", jnp.bfloat16, 64, "gpu") == "xla"
  with pytest.raises(ValueError, match="attention='flash'"):
    clip_lib.resolve_attention("flash", jnp.float32, 64)


def test_model_rejects_unknown_attention_and_remat():
  with pytest.raises(ValueError, match="attention='flash'"):
    owl_vit.create_model("tiny", attention="flash")
  with pytest.raises(ValueError, match="remat='sometimes'"):
    owl_vit.create_model("tiny", remat="sometimes")


def _tiny_inputs():
  images = jax.random.uniform(jax.random.PRNGKey(3), (2, 64, 64, 3), jnp.float32)
  queries = np.zeros((2, 3, 16), np.int32)
  queries[:, 0, :2] = [1, 2]  # '' -> SOT, EOT
  queries[:, 1, :3] = [1, 5, 2]
  queries[0, 2, :4] = [1, 7, 9, 2]  # image 1's third slot stays padding
  return images, jnp.asarray(queries)


def _loss_and_grads(model, params, images, queries):
  def loss(p):
    out = model.apply(
      {"params": p}, images, queries, train=True, rngs={"dropout": jax.random.PRNGKey(4)}
    )
    logits = jnp.where(out["pred_logits"] > -1e5, out["pred_logits"], 0.0)
    return jnp.sum(logits**2) + jnp.sum(out["pred_boxes"]) + jnp.sum(out["query_embeddings"])

  return jax.jit(jax.value_and_grad(loss))(params)


# Two vision blocks (the tiny variant has 4): enough for remat to recompute a block whose input
# is another remat block's output; each block more only adds compilation time.
_REMAT_LAYERS = dict(vision_layers=2, text_layers=1)


@functools.cache
def _no_remat_reference():
  """(params, loss, gradients) of the tiny model without remat: every policy's reference,
  computed once per process (a pure function of fixed seeds)."""
  images, queries = _tiny_inputs()
  base = owl_vit.create_model("tiny", remat="none", **_REMAT_LAYERS)
  params = jax.jit(base.init)(jax.random.PRNGKey(0), images, queries)["params"]
  return (params, *_loss_and_grads(base, params, images, queries))


def _distinct_remats() -> list[str]:
  """The `remat` values but 'none', one name per distinct policy: jax's checkpoint_dots and
  checkpoint_dots_with_no_batch_dims are other names of dots_saveable and
  dots_with_no_batch_dims_saveable (the same functions: `test_remat_policy_aliases`)."""
  seen, names = set(), []
  for name in clip_lib.REMAT_POLICIES[1:]:
    policy = clip_lib.remat_policy(name)[1]
    if id(policy) not in seen:
      seen.add(id(policy))
      names.append(name)
  return names


def test_remat_policy_aliases():
  assert _distinct_remats() == [
    "block",
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
  ]
  policies = jax.checkpoint_policies
  assert policies.checkpoint_dots is policies.dots_saveable
  assert policies.checkpoint_dots_with_no_batch_dims is policies.dots_with_no_batch_dims_saveable


# The policies the benchmarks time (block, and the selective ones that keep the matmul
# outputs); everything_saveable (no recomputation: `none`'s program) and nothing_saveable
# (block's) are left out for the suite's time: each case compiles the tiny model twice.
_TIMED_REMATS = ("block", "dots_saveable", "dots_with_no_batch_dims_saveable")


@pytest.mark.slow
@pytest.mark.parametrize("remat", _TIMED_REMATS)
def test_remat_keeps_tree_loss_and_gradients(remat):
  # The `remat` policies the benchmarks time against no remat: the same parameters, loss and
  # gradients.
  assert remat in _distinct_remats()
  images, queries = _tiny_inputs()
  params, want_loss, want = _no_remat_reference()
  remat_model = owl_vit.create_model("tiny", remat=remat, **_REMAT_LAYERS)
  params_remat = jax.jit(remat_model.init)(jax.random.PRNGKey(0), images, queries)["params"]
  assert jax.tree.structure(params) == jax.tree.structure(params_remat)
  jax.tree.map(np.testing.assert_array_equal, params, params_remat)
  # Stochastic depth on (train=True): the recomputed blocks must redraw the same masks.
  got_loss, got = _loss_and_grads(remat_model, params, images, queries)
  # Remat changes only the backward pass: the forward (the loss) is the same computation.
  # XLA may still fuse it differently around the checkpoints: a few float32 ulps (1.2e-7
  # relative each) over the ~40 rounding steps of the tiny model's longest path, so 1e-5.
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  # The same float32 operations recomputed; XLA may fuse them differently, so allow a few
  # ulps (1.2e-7 relative) accumulated over the few layers, relative to the largest
  # gradient entry of each tensor. The attention key bias's gradient is zero in exact
  # arithmetic: what is computed is rounding noise of terms as large as the key kernel's
  # gradient, so it is compared against that (`grad_agreement`; measured with the test
  # session's compile options: 1e-7 of it, against 0.97 of its own largest entry).
  assert jax.tree.structure(got) == jax.tree.structure(want)
  diffs = grad_agreement(want, got)
  worst = max(diffs, key=diffs.get)
  assert diffs[worst] <= 1e-5, (worst, diffs[worst])


def test_remat_policy_values():
  assert clip_lib.remat_policy("none") == (False, None)
  assert clip_lib.remat_policy("block") == (True, None)
  use, policy = clip_lib.remat_policy("dots_with_no_batch_dims_saveable")
  assert use and policy is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  with pytest.raises(ValueError, match="remat='save_only_these_names'"):
    clip_lib.remat_policy("save_only_these_names")


@pytest.mark.slow
def test_bfloat16_compute_stays_close_to_float32():
  """bfloat16 compute with float32 parameters: outputs float32, within the rounding bound."""
  images, queries = _tiny_inputs()
  f32 = owl_vit.create_model("tiny", dtype=jnp.float32)
  bf16 = owl_vit.create_model("tiny", dtype=jnp.bfloat16)
  params = jax.jit(f32.init)(jax.random.PRNGKey(0), images, queries)["params"]
  # Non-trivial heads (their last kernels are initialised at or near 0).
  params = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      x + 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(path))), x.shape)
      if "head" in str(path)
      else x
    ),
    params,
  )
  want = f32.apply({"params": params}, images, queries)
  got = bf16.apply({"params": params}, images, queries)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
  # bfloat16 keeps 8 significant bits: one round-to-nearest costs at most 2^-9 relative.
  # The longest path through the tiny model rounds about 40 times (patch embedding and
  # ln_pre, then per each of the 4 vision blocks: LayerNorm, q/k/v, attention output, out
  # projection, residual, MLP hidden, MLP output, residual; ln_post). Adding those errors
  # linearly (worst case; random signs would give ~sqrt(40)) bounds the error of an output
  # by 40 * 2^-9 = 0.078 of its largest magnitude. Measured: about 0.01.
  bound = 40 * 2.0**-9
  for key in ("pred_logits", "pred_boxes", "feature_map", "class_embeddings", "query_embeddings"):
    w, g = np.asarray(want[key]), np.asarray(got[key])
    assert g.dtype == np.float32, key
    real = w > -1e5  # padded query slots hold -1e6 in both
    scale = np.max(np.abs(w[real]))
    err = np.max(np.abs(g[real] - w[real]))
    assert err <= bound * scale, (key, err, scale)
    assert err > 0, key  # the bfloat16 path really ran in bfloat16
  np.testing.assert_array_equal(np.asarray(got["pred_logits"])[1, :, 2], -1e6)


def test_config_fields_reach_the_model():
  from owl_cl import detector
  from owl_cl import validation
  from owl_cl.configs import base

  builtin = base.get_config()
  assert detector.model_fields(builtin) == {
    "attention": "auto",
    "remat": "none",
    "context_length": 8,
  }  # dtype None: the tiny variant's float32
  paper = base.get_config("paper")
  fields = detector.model_fields(paper)
  assert fields == {"dtype": jnp.bfloat16, "attention": "auto", "remat": "block"}
  model = owl_vit.create_model(paper.model.variant, **fields)
  assert (model.dtype, model.remat, model.attention) == (jnp.bfloat16, "block", "auto")
  builtin.model.dtype = "float64"
  assert any("config.model.dtype='float64'" in p for p in validation.option_problems(builtin))


def test_execution_only_fields_leave_cache_keys_unchanged():
  from owl_cl import config_spec
  from owl_cl.configs import base
  from owl_cl.model.spec import ModelSpec
  from owl_cl.train.spec import LossSpec

  c = base.get_config()
  key = lambda spec, section: config_spec.key_material(config_spec.from_config(spec, section, ""))
  before = {k: v for k, v in c.model.to_dict().items() if k not in ("attention", "remat")}
  assert key(ModelSpec, c.model) == before
  assert "matcher" not in key(LossSpec, c.loss)
  c.model.dtype = "bfloat16"  # changes what is computed: part of the key
  assert key(ModelSpec, c.model)["dtype"] == "bfloat16"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("length", [16, 17])  # even; odd as the vision tower's 3601 (padded)
@pytest.mark.parametrize("with_mask", [False, True])
def test_cudnn_attention_gradients_match_xla_on_gpu(length, with_mask):
  # cuDNN's backward pass with a bias needs an even length and has given NaN gradients at odd
  # lengths upstream: the padded fallback must give finite gradients equal to XLA's.
  x = jax.random.normal(jax.random.PRNGKey(0), (2, length, 128), jnp.float32)
  mask = None
  if with_mask:  # causal mask, as the text tower's
    mask = jnp.tril(jnp.ones((length, length), bool))[None, None].repeat(2, 0)
  modules = {
    impl: clip_lib.SelfAttention(num_heads=2, dtype=jnp.bfloat16, attention=impl)
    for impl in ("xla", "cudnn")
  }
  params = modules["xla"].init(jax.random.PRNGKey(1), x, mask)

  def grads(impl):
    def loss(p, x):
      y = modules[impl].apply(p, x, mask).astype(jnp.float32)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

    return jax.grad(loss, argnums=(0, 1))(params, x)

  want, got = grads("xla"), grads("cudnn")
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g in jax.tree.leaves(got):
    assert np.isfinite(np.asarray(g, np.float32)).all()
  # Both compute in bfloat16 (8-bit mantissa, relative rounding 2^-8 = 3.9e-3) with float32
  # accumulation in different orders: a few bf16 roundings of the largest gradient entry, so
  # 3e-2 of the leaf's largest magnitude (of the scaling leaf's for a gradient zero in exact
  # arithmetic: `grad_agreement`).
  diffs = grad_agreement(want, got)
  worst = max(diffs, key=diffs.get)
  assert diffs[worst] <= 3e-2, (worst, diffs[worst])


@pytest.mark.slow
def test_key_bias_gradient_is_zero_in_exact_arithmetic():
  # The premise of `clip_lib.gradient_scale_path`: softmax cancels q . b_k, so the key bias's
  # gradient is float32 rounding noise (8e-8 of the key kernel's here, under one eps = 1.2e-7;
  # the bound leaves 100 eps for sums of 2 x 9 tokens), while the query bias's gradient is of
  # the order of the query kernel's (2x here).
  module = clip_lib.SelfAttention(num_heads=2, dtype=jnp.float32, attention="xla")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 16), jnp.float32)
  params = module.init(jax.random.PRNGKey(1), x)
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(module.apply(p, x))))(params)
  flat = {jax.tree_util.keystr(p): np.abs(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
  bias = "['params']['key']['bias']"
  assert clip_lib.gradient_scale_path(bias) == "['params']['key']['kernel']"
  assert clip_lib.gradient_scale_path("['params']['query']['bias']") == (
    "['params']['query']['bias']"
  )
  assert flat[bias].max() < 1e-5 * flat["['params']['key']['kernel']"].max()
  assert (
    flat["['params']['query']['bias']"].max() > 1e-2 * flat["['params']['query']['kernel']"].max()
  )

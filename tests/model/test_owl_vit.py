"""Tests of owl_cl.model (OWL-ViT v1, docs/reference.md §1 / §1.1)."""

import dataclasses
import functools
import time

import flax
from flax.traverse_util import flatten_dict
from flax.traverse_util import unflatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl.model import OwlViT
from owl_cl.model import clip as clip_lib
from owl_cl.model import compute_box_bias
from owl_cl.model import create_model
from owl_cl.model import get_tokenizer
from owl_cl.model import get_variant_config
from owl_cl.model import owl_vit as owl_lib
from owl_cl.model import quick_gelu

# ------------------------------------------------------------------------------------------
# Helpers / fixtures
# ------------------------------------------------------------------------------------------


def _np_layer_norm(x, scale, bias, eps):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _flat(params):
  return flatten_dict(flax.core.unfreeze(params), sep="/")


def _unflat(flat):
  return unflatten_dict(flat, sep="/")


def _japply(module, variables, *args, method=None, rngs=None, **kwargs):
  """``module.apply`` under jit (eager dispatch of a whole model is slow on CPU).

  Non-array keyword arguments (``train``, ``capture_intermediates``) are static.
  """
  fn = jax.jit(lambda v, a, r: module.apply(v, *a, method=method, rngs=r, **kwargs))
  return fn(variables, args, rngs)


def _randomise(params, prefix, seed, scale=0.5):
  """Returns params where every leaf under `prefix` is replaced by N(0, scale^2) noise."""
  rng = np.random.default_rng(seed)
  flat = _flat(params)
  for k in sorted(flat):
    if k.startswith(prefix):
      flat[k] = jnp.asarray(scale * rng.standard_normal(flat[k].shape), jnp.float32)
  return _unflat(flat)


@pytest.fixture(scope="module")
def tiny():
  model = create_model("tiny")
  tok = get_tokenizer("word_hash")
  queries = np.stack(
    [
      tok.encode(["", "red triangle", "blue circle"]),
      tok.encode(["", "digit seven", ""]),
    ]
  )
  queries[1, 2] = 0  # padding query
  queries = jnp.asarray(queries)
  images = jax.random.uniform(jax.random.key(1), (2, 64, 64, 3), jnp.float32)
  variables = jax.jit(model.init)(jax.random.key(0), images, queries)
  fwd = jax.jit(lambda v, im, q: model.apply(v, im, q))
  out = fwd(variables, images, queries)
  return dict(
    model=model, tok=tok, queries=queries, images=images, variables=variables, fwd=fwd, out=out
  )


# ------------------------------------------------------------------------------------------
# Shapes of the real variants (eval_shape only: never materialised)
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_vit_l14_parameter_count_and_outputs():
  model = create_model("vit_l14")
  images = jax.ShapeDtypeStruct((1, 840, 840, 3), jnp.float32)
  queries = jax.ShapeDtypeStruct((1, 2, 16), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), images, queries)
  assert set(variables) == {"params"}
  flat = _flat(variables["params"])
  assert len(flat) == 603
  assert sum(int(np.prod(v.shape)) for v in flat.values()) == 433_102_087
  assert all(v.dtype == jnp.float32 for v in flat.values())
  expected = {
    "backbone/clip/logit_scale": (),
    "backbone/clip/visual/transformer/resblocks_23/attn/query/kernel": (1024, 16, 64),
    "backbone/clip/visual/transformer/resblocks_23/attn/query/bias": (16, 64),
    "backbone/clip/visual/transformer/resblocks_23/attn/out/kernel": (16, 64, 1024),
    "backbone/clip/visual/transformer/resblocks_23/attn/out/bias": (1024,),
    "backbone/clip/visual/transformer/resblocks_0/mlp/c_fc/kernel": (1024, 4096),
    "backbone/clip/visual/transformer/resblocks_0/ln_0/scale": (1024,),
    "backbone/clip/visual/transformer/resblocks_0/ln_1/bias": (1024,),
    "backbone/clip/visual/conv1/kernel": (14, 14, 3, 1024),
    "backbone/clip/visual/class_embedding": (1024,),
    "backbone/clip/visual/positional_embedding": (3601, 1024),
    "backbone/clip/visual/ln_pre/scale": (1024,),
    "backbone/clip/visual/ln_post/bias": (1024,),
    "backbone/clip/text/token_embedding/embedding": (49408, 768),
    "backbone/clip/text/positional_embedding": (16, 768),
    "backbone/clip/text/transformer/resblocks_11/attn/key/kernel": (768, 12, 64),
    "backbone/clip/text/transformer/resblocks_11/mlp/c_proj/kernel": (3072, 768),
    "backbone/clip/text/ln_final/scale": (768,),
    "backbone/clip/text/text_projection/kernel": (768, 768),
    "backbone/merged_class_token/scale": (1024,),
    "backbone/merged_class_token/bias": (1024,),
    "class_head/Dense_0/kernel": (1024, 768),
    "class_head/logit_shift/kernel": (1024, 1),
    "class_head/logit_scale/kernel": (1024, 1),
    "obj_box_head/Dense_0/kernel": (1024, 1024),
    "obj_box_head/Dense_1/kernel": (1024, 1024),
    "obj_box_head/Dense_2/kernel": (1024, 4),
    "obj_box_head/Dense_2/bias": (4,),
  }
  for path, shape in expected.items():
    assert flat[path].shape == shape, path
  assert "backbone/clip/visual/transformer/resblocks_24/ln_0/scale" not in flat
  assert "backbone/clip/text/transformer/resblocks_12/ln_0/scale" not in flat
  for absent in (
    "backbone/clip/text/text_projection/bias",
    "backbone/clip/visual/conv1/bias",
    "backbone/clip/visual/proj/kernel",
    "backbone/clip/visual/proj",
  ):
    assert absent not in flat

  out = jax.eval_shape(model.apply, variables, images, queries)
  assert {k: v.shape for k, v in out.items()} == {
    "feature_map": (1, 60, 60, 1024),
    "pred_boxes": (1, 3600, 4),
    "pred_logits": (1, 3600, 2),
    "class_embeddings": (1, 3600, 768),
    "query_embeddings": (1, 2, 768),
  }
  assert all(v.dtype == jnp.float32 for v in out.values())


@pytest.mark.parametrize("variant,patch,grid", [("vit_b32", 32, 24), ("vit_b16", 16, 48)])
def test_vit_b_parameter_shapes(variant, patch, grid):
  model = create_model(variant)
  cfg = get_variant_config(variant)
  assert cfg["image_size"] == 768 and cfg["patch_size"] == patch
  images = jax.ShapeDtypeStruct((1, 768, 768, 3), jnp.float32)
  queries = jax.ShapeDtypeStruct((1, 3, 16), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), images, queries)
  flat = _flat(variables["params"])
  assert len(flat) == (12 + 12) * 16 + 27
  assert flat["backbone/clip/visual/conv1/kernel"].shape == (patch, patch, 3, 768)
  assert flat["backbone/clip/visual/positional_embedding"].shape == (grid * grid + 1, 768)
  assert flat["backbone/clip/visual/transformer/resblocks_11/attn/value/kernel"].shape == (
    768,
    12,
    64,
  )
  assert flat["backbone/clip/visual/transformer/resblocks_11/mlp/c_fc/kernel"].shape == (768, 3072)
  assert flat["backbone/clip/text/transformer/resblocks_11/attn/query/kernel"].shape == (512, 8, 64)
  assert flat["backbone/clip/text/transformer/resblocks_11/attn/out/kernel"].shape == (8, 64, 512)
  assert flat["backbone/clip/text/transformer/resblocks_0/mlp/c_fc/kernel"].shape == (512, 2048)
  assert flat["backbone/clip/text/token_embedding/embedding"].shape == (49408, 512)
  assert flat["backbone/clip/text/text_projection/kernel"].shape == (512, 512)
  assert flat["class_head/Dense_0/kernel"].shape == (768, 512)
  assert flat["obj_box_head/Dense_2/kernel"].shape == (768, 4)


# ------------------------------------------------------------------------------------------
# Box bias
# ------------------------------------------------------------------------------------------


def test_box_bias_constants():
  # docs/reference.md §1 quotes 9.21044 (60x60, float64) and 9.210265 (3x3); scenic computes in
  # float32
  # (9.210275): allow 2e-4 in logit space (< 3e-8 after the sigmoid).
  b = compute_box_bias(60, 60)
  assert b.shape == (3600, 4) and b.dtype == np.float32
  np.testing.assert_allclose(b[:, 2:], -4.07166, atol=1e-5)
  grid = b.reshape(60, 60, 4)
  np.testing.assert_allclose(grid[:, -1, 0], 9.21044, atol=2e-4)  # last column: cx
  np.testing.assert_allclose(grid[-1, :, 1], 9.21044, atol=2e-4)  # last row: cy
  np.testing.assert_allclose(grid[0, 0, :2], -4.07166, atol=1e-5)  # corner (1/60, 1/60)
  # cx depends on the column only, cy on the row only (row-major tokens).
  np.testing.assert_array_equal(grid[:, :, 0], np.broadcast_to(grid[:1, :, 0], (60, 60)))
  np.testing.assert_array_equal(grid[:, :, 1], np.broadcast_to(grid[:, :1, 1], (60, 60)))

  b3 = compute_box_bias(3, 3).reshape(3, 3, 4)
  np.testing.assert_allclose(b3[0, :, 0], [-0.692997, 0.692996, 9.210265], atol=2e-4)
  np.testing.assert_allclose(b3[:, 0, 1], [-0.692997, 0.692996, 9.210265], atol=2e-4)
  np.testing.assert_allclose(b3[..., 2:], -0.692997, atol=1e-5)
  # scenic computes in float32 (exact float32 values of the formula)
  np.testing.assert_allclose(b3[0, :, 0], [-0.6929972, 0.69299734, 9.210275], rtol=1e-6)

  # non-square grid: size bias is logit(1/w) for both w and h.
  b24 = compute_box_bias(2, 4).reshape(2, 4, 4)
  lg = lambda x: np.log(x + 1e-4) - np.log1p(-x + 1e-4)
  np.testing.assert_allclose(b24[..., 2:], lg(0.25), rtol=1e-5)
  np.testing.assert_allclose(b24[0, :, 0], lg(np.array([0.25, 0.5, 0.75, 1.0])), atol=2e-4)
  np.testing.assert_allclose(b24[:, 0, 1], lg(np.array([0.5, 1.0])), atol=2e-4)
  with pytest.raises(ValueError):
    compute_box_bias(0, 3)


def test_init_values(tiny):
  flat = _flat(tiny["variables"]["params"])
  assert all(v.dtype == jnp.float32 for v in flat.values())
  np.testing.assert_allclose(flat["class_head/logit_shift/bias"], [-4.59512], atol=1e-5)
  np.testing.assert_allclose(flat["backbone/clip/logit_scale"], np.log(1 / 0.07), rtol=1e-6)
  assert np.all(np.asarray(flat["obj_box_head/Dense_2/kernel"]) == 0)
  assert float(jnp.std(flat["class_head/Dense_0/kernel"])) < 1e-5
  # at init the box head outputs 0, so the boxes are sigmoid(box bias)
  expected = _np_sigmoid(compute_box_bias(8, 8).astype(np.float64))
  np.testing.assert_allclose(tiny["out"]["pred_boxes"][0], expected, atol=1e-6)
  np.testing.assert_allclose(tiny["out"]["pred_boxes"][1], expected, atol=1e-6)


# ------------------------------------------------------------------------------------------
# The tiny model: outputs, masking, query-embedding path
# ------------------------------------------------------------------------------------------


def test_tiny_outputs(tiny):
  out = tiny["out"]
  assert {k: v.shape for k, v in out.items()} == {
    "feature_map": (2, 8, 8, 128),
    "pred_boxes": (2, 64, 4),
    "pred_logits": (2, 64, 3),
    "class_embeddings": (2, 64, 128),
    "query_embeddings": (2, 3, 128),
  }
  assert all(v.dtype == jnp.float32 for v in out.values())
  assert all(np.isfinite(np.asarray(v)).all() for v in out.values())
  boxes = np.asarray(out["pred_boxes"])
  assert np.all((boxes > 0) & (boxes < 1))


def test_masked_queries(tiny):
  out, queries = tiny["out"], tiny["queries"]
  logits = np.asarray(out["pred_logits"])
  np.testing.assert_array_equal(logits[1, :, 2], -1e6)
  assert np.all(logits[0] > -1e5) and np.all(logits[1, :, :2] > -1e5)
  # the '' query (index 0, tokens [SOT, EOT, 0...]) is a real query, not masked
  assert int(queries[0, 0, 0]) == tiny["tok"].sot_token
  # removing the padding query does not change the other logits
  feats = out["feature_map"].reshape(2, 64, 128)
  out2 = _japply(
    tiny["model"],
    tiny["variables"],
    feats,
    out["query_embeddings"][:, :2],
    queries[:, :2, 0] > 0,
    method=OwlViT.class_predictor,
  )
  np.testing.assert_allclose(out2["pred_logits"], logits[:, :, :2], rtol=1e-5, atol=1e-5)
  # only tokens[..., 0] decides: a row [0, x, ...] is padding
  q3 = queries.at[1, 2, 1].set(5)
  out3 = tiny["fwd"](tiny["variables"], tiny["images"], q3)
  np.testing.assert_array_equal(out3["pred_logits"][1, :, 2], -1e6)
  np.testing.assert_allclose(out3["pred_logits"][:, :, :2], logits[:, :, :2], atol=1e-6)


@pytest.mark.slow
def test_query_embedding_path_and_methods(tiny):
  model, v, images, queries, out = (
    tiny[k] for k in ("model", "variables", "images", "queries", "out")
  )

  @jax.jit
  def run(v, images, queries):
    q_emb = model.apply(v, queries, method=OwlViT.text_embedder)
    fmap = model.apply(v, images, method=OwlViT.image_embedder)
    feats = fmap.reshape(2, 64, 128)
    mask = queries[..., 0] > 0
    return dict(
      q_emb=q_emb,
      fmap=fmap,
      cls=model.apply(v, feats, q_emb, mask, method=OwlViT.class_predictor),
      only_emb=model.apply(v, feats, method=OwlViT.class_predictor),
      boxes=model.apply(v, feats, fmap, method=OwlViT.box_predictor),
      # skip the text tower with precomputed embeddings (no query_mask: all real)
      out3=model.apply(v, images, query_embeddings=q_emb),
    )

  r = run(v, images, queries)
  np.testing.assert_allclose(r["q_emb"], out["query_embeddings"], atol=2e-5)
  np.testing.assert_allclose(r["fmap"], out["feature_map"], atol=2e-5)
  np.testing.assert_allclose(r["cls"]["pred_logits"], out["pred_logits"], atol=2e-5)
  np.testing.assert_allclose(r["cls"]["class_embeddings"], out["class_embeddings"], atol=2e-5)
  assert set(r["only_emb"]) == {"class_embeddings"}
  np.testing.assert_allclose(r["boxes"]["pred_boxes"], out["pred_boxes"], atol=2e-5)
  for k in ("feature_map", "pred_boxes", "class_embeddings", "query_embeddings"):
    np.testing.assert_allclose(r["out3"][k], out[k], atol=2e-5, err_msg=k)
  np.testing.assert_allclose(
    r["out3"]["pred_logits"][:, :, :2], out["pred_logits"][:, :, :2], atol=2e-5
  )
  assert float(r["out3"]["pred_logits"][1, :, 2].min()) > -1e5  # not masked any more
  # with the mask, the class head reproduces the masked logits
  np.testing.assert_array_equal(r["cls"]["pred_logits"][1, :, 2], -1e6)


def test_call_errors(tiny):
  model, v, images, queries = (tiny[k] for k in ("model", "variables", "images", "queries"))
  with pytest.raises(ValueError, match="exactly one"):
    model.apply(v, images)
  with pytest.raises(ValueError, match="exactly one"):
    model.apply(v, images, queries, query_embeddings=jnp.zeros((2, 3, 128)))
  with pytest.raises(ValueError, match="query_mask"):
    model.apply(v, images, queries, query_mask=jnp.ones((2, 3), bool))
  with pytest.raises(ValueError, match="64"):
    model.apply(v, jnp.zeros((2, 72, 72, 3)), queries)
  with pytest.raises(ValueError, match="16"):
    model.apply(v, images, queries[..., :8])


# ------------------------------------------------------------------------------------------
# Text tower
# ------------------------------------------------------------------------------------------


def test_text_tower_takes_eot_row(tiny):
  model, v, tok = tiny["model"], tiny["variables"], tiny["tok"]
  base = tok.encode(["red triangle"])[0]  # [SOT, a, b, EOT, 0, ...]
  eot_pos = 3
  assert base[eot_pos] == tok.eot_token and base.max() == tok.eot_token
  after = base.copy()
  after[eot_pos + 2] = 7  # a token after the EOT (still < EOT)
  before = base.copy()
  before[1] = 7  # a token before the EOT
  rows = jnp.asarray(np.stack([base, after, before]))[None]  # [1, 3, 16]
  emb, state = _japply(model, v, rows, method=OwlViT.text_embedder, capture_intermediates=True)
  emb = np.asarray(emb[0])
  # causal attention: what follows the EOT cannot reach the pooled EOT row
  np.testing.assert_allclose(emb[1], emb[0], atol=1e-6)
  assert np.abs(emb[2] - emb[0]).max() > 1e-3
  # the embedding is text_projection(ln_final output at the argmax = EOT position)
  ln_final = state["intermediates"]["backbone"]["clip"]["text"]["ln_final"]["__call__"][0]
  w = v["params"]["backbone"]["clip"]["text"]["text_projection"]["kernel"]
  np.testing.assert_allclose(np.asarray(ln_final[:, eot_pos]) @ np.asarray(w), emb, atol=1e-5)
  # a query's embedding does not depend on the other queries of the batch
  alone = _japply(model, v, rows[:, :1], method=OwlViT.text_embedder)
  np.testing.assert_allclose(alone[0, 0], emb[0], atol=1e-5)


def test_quick_gelu_value():
  x = jnp.array([-2.0, 0.0, 1.0, 3.0])
  np.testing.assert_allclose(
    quick_gelu(x), np.asarray(x) * _np_sigmoid(1.702 * np.asarray(x)), rtol=1e-6
  )
  np.testing.assert_allclose(quick_gelu(jnp.float32(1.0)), 0.8457958, rtol=1e-6)
  np.testing.assert_allclose(quick_gelu(jnp.float32(-2.0)), -0.0643414, rtol=1e-5)


def test_residual_block_matches_numpy():
  """One pre-LN block (LN eps 1e-5, MHA with biases, quick_gelu MLP) against NumPy."""
  n, s, d, h, mlp = 2, 5, 16, 2, 32
  block = clip_lib.ResidualAttentionBlock(num_heads=h, mlp_dim=mlp)
  x = jax.random.normal(jax.random.key(0), (n, s, d))
  mask = jnp.asarray(np.tril(np.ones((s, s), bool)))[None, None].repeat(n, 0)
  mask = mask.at[1, :, :, 3:].set(False)  # padded keys in example 1
  params = jax.eval_shape(block.init, jax.random.key(1), x, mask)["params"]  # shapes only
  params = _randomise(params, "", 2, scale=0.3)
  y = np.asarray(_japply(block, {"params": params}, x, mask))

  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x64 = np.asarray(x, np.float64)
  xn = _np_layer_norm(x64, p["ln_0"]["scale"], p["ln_0"]["bias"], 1e-5)
  att = p["attn"]
  q = np.einsum("nsd,dhk->nshk", xn, att["query"]["kernel"]) + att["query"]["bias"]
  k = np.einsum("nsd,dhk->nshk", xn, att["key"]["kernel"]) + att["key"]["bias"]
  val = np.einsum("nsd,dhk->nshk", xn, att["value"]["kernel"]) + att["value"]["bias"]
  logits = np.einsum("nqhk,nthk->nhqt", q, k) / np.sqrt(d // h)
  logits = np.where(np.asarray(mask), logits, -1e30)
  wts = np.exp(logits - logits.max(-1, keepdims=True))
  wts /= wts.sum(-1, keepdims=True)
  o = np.einsum("nhqt,nthk->nqhk", wts, val)
  x1 = x64 + np.einsum("nqhk,hkd->nqd", o, att["out"]["kernel"]) + att["out"]["bias"]
  xn1 = _np_layer_norm(x1, p["ln_1"]["scale"], p["ln_1"]["bias"], 1e-5)
  hid = xn1 @ p["mlp"]["c_fc"]["kernel"] + p["mlp"]["c_fc"]["bias"]
  hid = hid * _np_sigmoid(1.702 * hid)
  ref = x1 + hid @ p["mlp"]["c_proj"]["kernel"] + p["mlp"]["c_proj"]["bias"]
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# Vision tower normalisation and the 'mul-ln' merge
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hf_compat,eps", [(False, 1e-6), (True, 1e-5)])
def test_image_embedder_matches_numpy(tiny, hf_compat, eps):
  model = create_model("tiny", hf_compat=hf_compat)
  v, images = tiny["variables"], tiny["images"]
  fmap, state = _japply(model, v, images, method=OwlViT.image_embedder, capture_intermediates=True)
  inter = state["intermediates"]["backbone"]["clip"]["visual"]
  p = v["params"]["backbone"]
  # conv1 sees CLIP-normalised pixels; patches flattened row-major
  conv = np.asarray(inter["conv1"]["__call__"][0])  # [B, 8, 8, D]
  img = (np.asarray(images, np.float64) - np.array(clip_lib.CLIP_IMAGE_MEAN)) / np.array(
    clip_lib.CLIP_IMAGE_STD
  )
  patches = img.reshape(2, 8, 8, 8, 8, 3).transpose(0, 1, 3, 2, 4, 5)  # [B,gy,gx,py,px,c]
  kern = np.asarray(p["clip"]["visual"]["conv1"]["kernel"], np.float64)  # [py, px, c, D]
  np.testing.assert_allclose(
    conv, np.einsum("byxijc,ijcd->byxd", patches, kern), rtol=1e-4, atol=1e-4
  )
  # class-token merge: patches * CLS -> LayerNorm(eps)
  tokens = np.asarray(inter["__call__"][0], np.float64)  # [B, 65, D] after ln_post
  merged = tokens[:, 1:] * tokens[:, :1]
  ln = p["merged_class_token"]
  ref = _np_layer_norm(merged, np.asarray(ln["scale"]), np.asarray(ln["bias"]), eps)
  np.testing.assert_allclose(np.asarray(fmap).reshape(2, 64, -1), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# Heads against NumPy
# ------------------------------------------------------------------------------------------


def test_class_head_matches_numpy(tiny):
  model = tiny["model"]
  params = _randomise(tiny["variables"]["params"], "class_head", 3)
  feats = jax.random.normal(jax.random.key(4), (2, 5, 128))
  q_emb = jax.random.normal(jax.random.key(5), (2, 3, 128))
  mask = jnp.array([[1, 1, 1], [1, 0, 1]])
  out = _japply(model, {"params": params}, feats, q_emb, mask, method=OwlViT.class_predictor)

  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["class_head"])
  x = np.asarray(feats, np.float64)
  e = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
  en = e / (np.linalg.norm(e, axis=-1, keepdims=True) + 1e-6)
  # As scenic's ClassPredictor: normalised class embeddings with queries, raw ones without.
  np.testing.assert_allclose(out["class_embeddings"], en, rtol=1e-4, atol=1e-4)
  raw = _japply(model, {"params": params}, feats, method=OwlViT.class_predictor)
  np.testing.assert_allclose(raw["class_embeddings"], e, rtol=1e-4, atol=1e-4)
  q = np.asarray(q_emb, np.float64)
  qn = q / (np.linalg.norm(q, axis=-1, keepdims=True) + 1e-6)
  sim = np.einsum("bpd,bqd->bpq", en, qn)
  shift = x @ p["logit_shift"]["kernel"] + p["logit_shift"]["bias"]
  z = x @ p["logit_scale"]["kernel"] + p["logit_scale"]["bias"]
  scale = np.where(z > 0, z, np.expm1(z)) + 1.0
  ref = (sim + shift) * scale
  ref[1, :, 1] = -1e6
  np.testing.assert_allclose(out["pred_logits"], ref, rtol=1e-4, atol=1e-4)

  hf = create_model("tiny", hf_compat=True)
  out_hf = _japply(hf, {"params": params}, feats, q_emb, mask, method=OwlViT.class_predictor)
  np.testing.assert_array_equal(out_hf["pred_logits"][1, :, 1], np.finfo(np.float32).min)
  np.testing.assert_allclose(out_hf["pred_logits"][0], out["pred_logits"][0], atol=1e-6)


@pytest.mark.parametrize("hf_compat", [False, True])
def test_box_head_matches_numpy(tiny, hf_compat):
  from scipy.special import erf

  model = create_model("tiny", hf_compat=hf_compat)
  params = _randomise(tiny["variables"]["params"], "obj_box_head", 6, scale=0.2)
  feats = jax.random.normal(jax.random.key(7), (2, 64, 128))
  fmap = feats.reshape(2, 8, 8, 128)
  out = _japply(model, {"params": params}, feats, fmap, method=OwlViT.box_predictor)

  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["obj_box_head"])
  if hf_compat:
    gelu = lambda t: 0.5 * t * (1 + erf(t / np.sqrt(2)))
  else:
    gelu = lambda t: 0.5 * t * (1 + np.tanh(np.sqrt(2 / np.pi) * (t + 0.044715 * t**3)))
  x = np.asarray(feats, np.float64)
  x = gelu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
  x = gelu(x @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])
  x = x @ p["Dense_2"]["kernel"] + p["Dense_2"]["bias"]
  ref = _np_sigmoid(x + compute_box_bias(8, 8))
  np.testing.assert_allclose(out["pred_boxes"], ref, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Stochastic depth
# ------------------------------------------------------------------------------------------


def test_droplayer_rates():
  np.testing.assert_allclose(clip_lib.droplayer_rates(4, 0.2), [0, 0.2 / 3, 0.4 / 3, 0.2])
  assert clip_lib.droplayer_rates(1, 0.5) == [0.0]


@pytest.mark.slow
def test_stochastic_depth_train_eval(tiny):
  model, v, images, queries, out = (
    tiny[k] for k in ("model", "variables", "images", "queries", "out")
  )
  # train=True with rate 0 equals eval, and needs no rng
  m0 = create_model("tiny", text_stochastic_depth=0.0, vision_stochastic_depth=0.0)
  tr0 = _japply(m0, v, images, queries, train=True)
  for k in out:
    np.testing.assert_allclose(tr0[k], out[k], atol=2e-5, err_msg=k)
  # train=True with rate > 0 needs the 'dropout' rng
  with pytest.raises(flax.errors.InvalidRngError):
    jax.eval_shape(lambda: model.apply(v, images, True, method=OwlViT.image_embedder))

  @functools.partial(jax.jit, static_argnames="train")
  def embed(key, train):
    return model.apply(v, images, train, method=OwlViT.image_embedder, rngs={"dropout": key})

  # train=False is deterministic: the dropout rng changes nothing
  np.testing.assert_allclose(embed(jax.random.key(9), False), out["feature_map"], atol=2e-5)
  np.testing.assert_array_equal(embed(jax.random.key(9), False), embed(jax.random.key(8), False))
  # train=True depends on the rng
  a, b = embed(jax.random.key(1), True), embed(jax.random.key(2), True)
  assert float(jnp.abs(a - b).max()) > 1e-4
  np.testing.assert_array_equal(a, embed(jax.random.key(1), True))


def test_stochastic_depth_per_example_no_rescaling(tiny):
  """Vision tower with 2 blocks, rate 0.5: block 1 drops each branch with p = 0.5.

  Every example must equal one of the 4 deterministic outputs where block 1's attention
  and/or MLP branch is removed (zeroed output projection): per-example masks, no 1/(1-p).
  """
  model = create_model(
    "tiny", vision_layers=2, vision_stochastic_depth=0.5, text_stochastic_depth=0.0
  )
  flat = {
    k: val
    for k, val in _flat(tiny["variables"]["params"]).items()
    if "visual/transformer/resblocks_2" not in k and "visual/transformer/resblocks_3" not in k
  }
  images = jnp.repeat(tiny["images"][:1], 16, axis=0)
  blk = "backbone/clip/visual/transformer/resblocks_1/"

  embed_eval = jax.jit(lambda v: model.apply(v, images, method=OwlViT.image_embedder))
  embed_train = jax.jit(
    lambda v, key: model.apply(v, images, True, method=OwlViT.image_embedder, rngs={"dropout": key})
  )

  def embed(flat_params, train):
    v = {"params": _unflat(flat_params)}
    if train:
      return np.asarray(embed_train(v, jax.random.key(0)))
    return np.asarray(embed_eval(v))

  refs = []
  for drop_attn in (False, True):
    for drop_mlp in (False, True):
      f = dict(flat)
      for on, prefix in ((drop_attn, "attn/out/"), (drop_mlp, "mlp/c_proj/")):
        if on:
          for leaf in ("kernel", "bias"):
            f[blk + prefix + leaf] = jnp.zeros_like(f[blk + prefix + leaf])
      refs.append(embed(f, False)[0])
  trained = embed(flat, True)
  pattern = []
  for ex in trained:
    err = [np.abs(ex - r).max() for r in refs]
    assert min(err) < 1e-4, err
    pattern.append(int(np.argmin(err)))
  assert len(set(pattern)) >= 2, pattern  # examples are dropped independently


# ------------------------------------------------------------------------------------------
# create_model / config / precision / speed
# ------------------------------------------------------------------------------------------


def test_create_model_overrides_and_errors():
  cfg = get_variant_config("tiny")
  assert (
    cfg["image_size"],
    cfg["patch_size"],
    cfg["embed_dim"],
    cfg["vision_width"],
    cfg["context_length"],
    cfg["vocab_size"],
  ) == (64, 8, 128, 128, 16, 8192)
  assert cfg["vocab_size"] == get_tokenizer(cfg["tokenizer"]).vocab_size
  assert cfg.image_size == 64 and dict(cfg)["patch_size"] == 8 and cfg.num_tokens == 64
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.image_size = 1  # frozen
  d = cfg.as_dict()
  d["image_size"] = 1
  assert get_variant_config("tiny")["image_size"] == 64  # a copy
  assert create_model("tiny", **cfg.replace(vision_layers=3)).vision_layers == 3
  assert get_variant_config("vit_l14")["image_size"] == 840
  model = create_model("tiny", vision_layers=2, image_size=96)
  assert model.vision_layers == 2 and model.image_size == 96 and model.num_tokens == 144
  assert model.config["vision_layers"] == 2 and model.config.image_size == 96
  assert model.config.grid_size == 12
  shapes = jax.eval_shape(
    model.init,
    jax.random.key(0),
    jax.ShapeDtypeStruct((1, 96, 96, 3), jnp.float32),
    jax.ShapeDtypeStruct((1, 2, 16), jnp.int32),
  )
  flat = _flat(shapes["params"])
  assert flat["backbone/clip/visual/positional_embedding"].shape == (145, 128)
  assert "backbone/clip/visual/transformer/resblocks_1/ln_0/scale" in flat
  assert "backbone/clip/visual/transformer/resblocks_2/ln_0/scale" not in flat
  with pytest.raises(ValueError, match="vit_h14"):
    create_model("vit_h14")
  with pytest.raises(ValueError, match="vision_depth.*width"):
    create_model("tiny", vision_depth=2, width=3)
  with pytest.raises(ValueError, match="divisible"):
    create_model("tiny", vision_heads=3)
  with pytest.raises(ValueError, match="multiple"):
    create_model("tiny", image_size=60)


def test_bfloat16_compute_keeps_float32_params(tiny):
  model = create_model("tiny", dtype=jnp.bfloat16)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tiny["images"], tiny["queries"])
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(shapes))
  out = jax.eval_shape(model.apply, shapes, tiny["images"], tiny["queries"])
  assert all(v.dtype == jnp.float32 for v in out.values())
  assert get_variant_config("vit_l14")["dtype"] == jnp.bfloat16
  assert get_variant_config("tiny")["dtype"] == jnp.float32


def test_tiny_jit_is_fast(tiny):
  fwd, v, images, queries = (tiny[k] for k in ("fwd", "variables", "images", "queries"))
  jax.block_until_ready(fwd(v, images, queries))  # compiled in the fixture
  t0 = time.perf_counter()
  for _ in range(3):
    jax.block_until_ready(fwd(v, images, queries))
  assert (time.perf_counter() - t0) / 3 < 1.0


def test_module_constants():
  assert owl_lib.MERGED_CLASS_TOKEN_EPS == 1e-6
  assert owl_lib.MASKED_LOGIT == -1e6
  np.testing.assert_allclose(owl_lib.LOGIT_SHIFT_BIAS_INIT, -4.59512, atol=1e-5)
  assert clip_lib.LAYER_NORM_EPS == 1e-5


def test_create_model_checks_every_field_by_its_rule():
  # `_validate_config` applies each ModelConfig field's own rule (no hand list): every
  # architecture field refuses 0 with its name. main's hand list missed the widths and the
  # image size (0 % patch == 0 and 0 % heads == 0 passed), and a drop-path rate of 2.
  architecture = [
    f.name for f in dataclasses.fields(owl_lib.ModelConfig) if f.metadata["architecture"]
  ]
  assert len(architecture) == 13
  for name in architecture:
    with pytest.raises(ValueError, match=f"^{name}=0 must be >= 1"):
      create_model("tiny", **{name: 0})
  with pytest.raises(ValueError, match="vision_stochastic_depth=2.0 must be"):
    create_model("tiny", vision_stochastic_depth=2.0)
  with pytest.raises(ValueError, match="vision_width=30 is not divisible by vision_heads=4"):
    create_model("tiny", vision_width=30, vision_heads=4)
  assert create_model("tiny", vision_layers=1).vision_layers == 1

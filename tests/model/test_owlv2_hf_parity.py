"""HF transformers Owlv2ForObjectDetection <-> owl_cl (docs/owlv2.md, owl_cl.model.convert).

Random HF OWLv2 models of two sizes of our own are the independent reference: converted in,
our model (``version='owlv2'``, ``hf_compat=True``) must give HF's class logits, boxes and
objectness logits; the round trip HF -> owl_cl -> HF must be bit-identical.
"""

import flax
from flax.traverse_util import flatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from owl_cl.model import convert as ck  # noqa: E402
from owl_cl.model import owl_vit as owl_lib  # noqa: E402
from owl_cl.model.convert import hf as convert_hf  # noqa: E402
from owl_cl.testing.hf import hf_warnings_as_errors  # noqa: E402

VOCAB, CONTEXT = 100, 16
SOT, EOT = VOCAB - 2, VOCAB - 1
B, Q = 2, 3

# Two sizes of our own: (image px, patch px, vision width, heads, layers, text width, heads).
SIZES = {
  "small": dict(image=32, patch=8, vision=48, vheads=3, vlayers=2, text=32, theads=2),
  "wide": dict(image=48, patch=16, vision=64, vheads=4, vlayers=1, text=48, theads=3),
}


def _flat(tree):
  return flatten_dict(flax.core.unfreeze(tree), sep="/")


def _hf_config(size):
  s = SIZES[size]
  text = dict(
    vocab_size=VOCAB,
    hidden_size=s["text"],
    intermediate_size=2 * s["text"],
    num_hidden_layers=1,
    num_attention_heads=s["theads"],
    max_position_embeddings=CONTEXT,
  )
  vision = dict(
    hidden_size=s["vision"],
    intermediate_size=2 * s["vision"],
    num_hidden_layers=s["vlayers"],
    num_attention_heads=s["vheads"],
    image_size=s["image"],
    patch_size=s["patch"],
  )
  return transformers.Owlv2Config(text_config=text, vision_config=vision, projection_dim=s["text"])


def _randomise_torch(module, seed):
  """Every parameter random (LayerNorm weights around 1), so that no init value (unit LN,
  zero biases, the zero-initialised last layers of the heads) hides a wrong mapping."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      is_ln_weight = ("norm" in name or name.startswith("layer_norm")) and name.endswith("weight")
      scale = 0.3 if name.startswith(("box_head", "objectness_head")) else 0.1
      p.copy_(1.0 + 0.1 * noise if is_ln_weight else scale * noise)


def _inputs(seed, size):
  rng = np.random.default_rng(seed)
  image = SIZES[size]["image"]
  images = rng.uniform(size=(B, image, image, 3)).astype(np.float32)
  queries = np.zeros((B, Q, CONTEXT), np.int32)
  for b in range(B):
    for j in range(Q):
      n = int(rng.integers(1, CONTEXT - 2))
      queries[b, j, 0] = SOT
      queries[b, j, 1 : 1 + n] = rng.integers(1, SOT, n)
      queries[b, j, 1 + n] = EOT
  queries[1, 2] = 0  # a padding query
  return images, queries


def _hf_forward(model, images, queries):
  """HF normalises outside the model (CLIP mean/std, NCHW); ours inside."""
  from transformers.image_utils import OPENAI_CLIP_MEAN
  from transformers.image_utils import OPENAI_CLIP_STD

  pixels = (images - np.asarray(OPENAI_CLIP_MEAN)) / np.asarray(OPENAI_CLIP_STD)
  pixels = torch.from_numpy(pixels.transpose(0, 3, 1, 2).astype(np.float32))
  ids = torch.from_numpy(queries.reshape(-1, CONTEXT).astype(np.int64))
  with torch.no_grad():
    out = model(input_ids=ids, pixel_values=pixels, attention_mask=(ids > 0).long())
  return {k: getattr(out, k).numpy() for k in ("logits", "pred_boxes", "objectness_logits")}


def _ours_forward(params, config, images, queries):
  model = owl_lib.OwlViT(**config)
  out = jax.jit(lambda p, i, q: model.apply({"params": p}, i, q))(
    params, jnp.asarray(images), jnp.asarray(queries)
  )
  return jax.tree.map(np.asarray, out)


def _assert_matches_hf(ours, hf):
  # Magnitudes: boxes in [0, 1], logits and objectness logits O(1-10) after random heads;
  # float32 sums over <= 128 terms in a different order round to ~1e-6 relative, so 1e-4
  # absolute leaves margin and still catches a wrong leaf (which moves outputs by >= 1e-2)
  # or the scenic GELU (tanh vs erf; > 2e-4 in the v1 test).
  np.testing.assert_allclose(ours["pred_boxes"], hf["pred_boxes"], atol=1e-4, rtol=0)
  np.testing.assert_allclose(ours["pred_logits"], hf["logits"], atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(
    ours["objectness_logits"], hf["objectness_logits"], atol=1e-4, rtol=1e-5
  )
  fmin = np.finfo(np.float32).min
  np.testing.assert_array_equal(ours["pred_logits"][1, :, 2], fmin)


@pytest.fixture(scope="module", params=sorted(SIZES))
def hf_model(request, tmp_path_factory):
  size = request.param
  model = transformers.Owlv2ForObjectDetection(_hf_config(size)).eval()
  _randomise_torch(model, seed=len(size))
  folder = str(tmp_path_factory.mktemp("hf") / f"owlv2_{size}")
  model.save_pretrained(folder)
  return model, folder, size


@pytest.mark.slow
def test_hf_owlv2_outputs_match_and_round_trip_bit_identical(hf_model, tmp_path):
  model, folder, size = hf_model
  params, config = ck.load_hf_checkpoint(folder)
  s = SIZES[size]
  assert (config.version, config.hf_compat, config.image_size, config.vision_width) == (
    "owlv2",
    True,
    s["image"],
    s["vision"],
  )
  assert "objectness_head" in params and params["objectness_head"]["Dense_2"]["kernel"].shape == (
    s["vision"],
    1,
  )
  images, queries = _inputs(1, size)
  ours = _ours_forward(params, config, images, queries)
  hf = _hf_forward(model, images, queries)
  assert ours["objectness_logits"].shape == (B, (s["image"] // s["patch"]) ** 2)
  # The heads are not degenerate: objectness varies by more than the tolerance.
  assert np.ptp(hf["objectness_logits"]) > 0.1
  _assert_matches_hf(ours, hf)

  # HF -> owl_cl -> HF: every persistent HF entry back, bit for bit.
  hf_sd = {k: v.numpy() for k, v in model.state_dict().items()}
  back = ck.params_to_hf_state_dict(
    params, config, visual_projection=hf_sd["owlv2.visual_projection.weight"]
  )
  assert set(back) == set(hf_sd)
  for k, v in hf_sd.items():
    assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k

  # Saved as an HF folder: HF's own class loads it and gives the same outputs.
  out_dir = str(tmp_path / "exported")
  # With our tokenizer's start, end and pad ids: no HF warning (its defaults, 49406 and
  # 49407, lie outside this 100-id vocabulary).
  with hf_warnings_as_errors():
    ck.save_hf_checkpoint(params, out_dir, config)
    again = transformers.Owlv2ForObjectDetection.from_pretrained(out_dir).eval()
  text = again.config.text_config
  assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (SOT, EOT, 0)
  _assert_matches_hf(ours, _hf_forward(again, images, queries))
  reloaded, reloaded_config = ck.load_hf_checkpoint(out_dir)
  assert reloaded_config == config
  for k, v in _flat(params).items():
    assert np.array_equal(_flat(reloaded)[k], v), k


@pytest.mark.slow
def test_owlv2_cli_round_trip_and_inferred_version(hf_model, tmp_path):
  from owl_cl.train import checkpointing

  _, folder, _ = hf_model
  params, config = ck.load_hf_checkpoint(folder)
  ours_dir, hf_dir = str(tmp_path / "ours"), str(tmp_path / "hf")
  ck.main(["hf-to-owl_cl", folder, ours_dir])
  restored, meta = checkpointing.load_params(ours_dir)
  assert meta["model_config"]["version"] == "owlv2"
  ck.main(["owl_cl-to-hf", ours_dir, hf_dir])
  again, again_config = ck.load_hf_checkpoint(hf_dir)
  assert again_config == config
  for k, v in _flat(params).items():
    assert np.array_equal(np.asarray(_flat(restored)[k]), v), k
    assert np.array_equal(_flat(again)[k], v), k
  # A tree with the objectness head reads back as OWLv2, one without as v1.
  assert ck.infer_model_config(params).version == "owlv2"
  v1 = {k: v for k, v in params.items() if k != "objectness_head"}
  assert ck.infer_model_config(v1).version == "v1"


def test_owlv2_l14_mapping_covers_the_real_hf_model():
  """Every leaf of owlv2_l14 (1008 px) maps onto an HF Owlv2 parameter of the right shape, and
  every HF entry but visual_projection is mapped (HF model on the meta device: no memory)."""
  config = owl_lib.get_variant_config("owlv2_l14")
  hf_config = ck.model_config_to_hf_config(config)
  assert hf_config.model_type == "owlv2" and hf_config.vision_config.image_size == 1008
  with torch.device("meta"):
    hf = transformers.Owlv2ForObjectDetection(hf_config)
  hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
  like = _flat(ck.abstract_params(config))
  rows = convert_hf._hf_rows(config)
  assert len(rows) == len(like) == 603 + 6  # v1's L/14 leaves + 3 Dense of objectness_head
  assert {r[0] for r in rows} == set(like)
  assert set(hf_shapes) - {r[1] for r in rows} == {"owlv2.visual_projection.weight"}
  for ours, key, layout in rows:
    assert layout.torch_shape(tuple(like[ours].shape)) == hf_shapes[key], (ours, key)
  back = ck.hf_config_to_model_config(hf_config.to_dict(), dtype=config.dtype)
  assert back == config.replace(hf_compat=True)


@pytest.mark.slow
def test_image_guided_detection_matches_hf(hf_model):
  """Image-conditioned detection: the query is the class embedding of the query image's token
  of highest objectness (HF's ``embed_image_query``); the target logits and boxes match HF's
  ``image_guided_detection`` within the tolerance of ``_assert_matches_hf``."""
  from transformers.image_utils import OPENAI_CLIP_MEAN
  from transformers.image_utils import OPENAI_CLIP_STD

  model, folder, size = hf_model
  params, config = ck.load_hf_checkpoint(folder)
  images, _ = _inputs(3, size)
  query_images, _ = _inputs(4, size)

  def pixels(x):
    x = (x - np.asarray(OPENAI_CLIP_MEAN)) / np.asarray(OPENAI_CLIP_STD)
    return torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float32))

  with torch.no_grad():
    hf = model.image_guided_detection(
      pixel_values=pixels(images), query_pixel_values=pixels(query_images)
    )
    hf_objectness = model.objectness_predictor(
      model.image_embedder(pixel_values=pixels(query_images))[0].flatten(1, 2)
    ).numpy()
  ours_model = owl_lib.OwlViT(**config)
  query = ours_model.apply(
    {"params": params}, jnp.asarray(query_images), method="embed_image_query"
  )
  np.testing.assert_array_equal(query["query_token"], hf_objectness.argmax(-1))
  out = ours_model.apply(
    {"params": params}, jnp.asarray(images), query_embeddings=query["query_embeddings"]
  )
  np.testing.assert_allclose(out["pred_logits"], hf.logits.numpy(), atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(out["pred_boxes"], hf.target_pred_boxes.numpy(), atol=1e-4, rtol=0)

"""HF transformers OwlViTForObjectDetection <-> owl_cl (docs/reference.md §1.2,
owl_cl.model.convert).

A tiny random HF OWL-ViT is the independent reference: converted to our parameters, our model
with ``hf_compat=True`` must give HF's outputs; our parameters exported to HF and back must be
bit-identical.
"""

import json
import os

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

VOCAB, CONTEXT, SIZE, PATCH = 100, 16, 32, 8
SOT, EOT = VOCAB - 2, VOCAB - 1
B, Q = 2, 4


def _flat(tree):
  return flatten_dict(flax.core.unfreeze(tree), sep="/")


def _hf_config(**changes):
  text = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=CONTEXT,
  )
  vision = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=3,
    image_size=SIZE,
    patch_size=PATCH,
  )
  text.update(changes.pop("text", {}))
  vision.update(changes.pop("vision", {}))
  changes.setdefault("projection_dim", 32)
  return transformers.OwlViTConfig(text_config=text, vision_config=vision, **changes)


def _randomise_torch(module, seed):
  """Every parameter random (LayerNorm weights around 1), so that no init value (unit LN,
  zero biases) hides a wrong mapping."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      is_ln_weight = ("norm" in name or name.startswith("layer_norm")) and name.endswith("weight")
      # Box head weights larger: the GELU flavour (tanh vs erf) then moves the boxes by
      # more than the test tolerance, so the test sees whether hf_compat is honoured.
      scale = 0.3 if name.startswith("box_head") else 0.1
      p.copy_(1.0 + 0.1 * noise if is_ln_weight else scale * noise)


def _inputs(seed):
  rng = np.random.default_rng(seed)
  images = rng.uniform(size=(B, SIZE, SIZE, 3)).astype(np.float32)
  queries = np.zeros((B, Q, CONTEXT), np.int32)
  for b in range(B):
    for j in range(Q):
      n = int(rng.integers(0, CONTEXT - 2))
      queries[b, j, 0] = SOT
      queries[b, j, 1 : 1 + n] = rng.integers(1, SOT, n)
      queries[b, j, 1 + n] = EOT
  queries[0, 1, 2:] = 0
  queries[0, 1, 1] = EOT  # '' = [SOT, EOT, 0...]: a real query, not masked
  queries[1, 3] = 0  # padding query
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
  return {
    k: getattr(out, k).numpy() for k in ("logits", "pred_boxes", "class_embeds", "text_embeds")
  }


_FORWARD = {}


def _ours_forward(params, config, images, queries):
  if config not in _FORWARD:  # one compilation per config (compiling dominates run time)
    model = owl_lib.OwlViT(**config)
    _FORWARD[config] = jax.jit(lambda p, i, q: model.apply({"params": p}, i, q))
  out = _FORWARD[config](params, jnp.asarray(images), jnp.asarray(queries))
  return jax.tree.map(np.asarray, out)


def _normalise(x, eps):
  return x / (np.linalg.norm(x, axis=-1, keepdims=True) + eps)


def _assert_matches_hf(ours, hf, queries):
  valid = queries[..., 0] > 0
  # HF's pred_boxes are cxcywh in [0, 1], as ours; its box bias uses grid corners as ours.
  np.testing.assert_allclose(ours["pred_boxes"], hf["pred_boxes"], atol=1e-4, rtol=0)
  np.testing.assert_allclose(ours["pred_logits"], hf["logits"], atol=1e-4, rtol=1e-5)
  fmin = np.finfo(np.float32).min
  np.testing.assert_array_equal(hf["logits"][1, :, 3], fmin)
  np.testing.assert_array_equal(ours["pred_logits"][1, :, 3], fmin)
  # HF and ours (as scenic) return the class embeddings normalised (x / (|x| + 1e-6)).
  np.testing.assert_allclose(ours["class_embeddings"], hf["class_embeds"], atol=1e-4, rtol=0)
  # HF returns query embeddings L2-normalised, ours raw; padding rows are meaningless.
  np.testing.assert_allclose(
    _normalise(ours["query_embeddings"], 0.0)[valid], hf["text_embeds"][valid], atol=1e-4, rtol=0
  )


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  model = transformers.OwlViTForObjectDetection(_hf_config()).eval()
  _randomise_torch(model, seed=0)
  folder = str(tmp_path_factory.mktemp("hf") / "owlvit")
  model.save_pretrained(folder)
  return model, folder


@pytest.fixture(scope="module")
def converted(hf_model):
  _, folder = hf_model
  return ck.load_hf_checkpoint(folder)


def test_config_derived_from_hf(converted):
  _, config = converted
  assert config == owl_lib.ModelConfig(
    tokenizer="clip",
    vocab_size=VOCAB,
    context_length=CONTEXT,
    embed_dim=32,
    image_size=SIZE,
    patch_size=PATCH,
    vision_width=48,
    vision_layers=2,
    vision_heads=3,
    vision_mlp_dim=96,
    text_width=32,
    text_layers=2,
    text_heads=2,
    text_mlp_dim=64,
    text_stochastic_depth=0.1,
    vision_stochastic_depth=0.2,
    hf_compat=True,
    dtype=jnp.float32,
  )


@pytest.mark.slow
def test_hf_to_ours_outputs_match(hf_model, converted):
  model, _ = hf_model
  params, config = converted
  images, queries = _inputs(1)
  hf = _hf_forward(model, images, queries)
  ours = _ours_forward(params, config, images, queries)
  _assert_matches_hf(ours, hf, queries)

  # The hf_compat switch is what makes them agree: scenic's box head (tanh GELU) and
  # padded-query logit (-1e6) differ from HF's.
  scenic = owl_lib.OwlViT(**config.replace(hf_compat=False))
  fmap = ours["feature_map"]
  boxes = scenic.apply(
    {"params": params}, fmap.reshape(B, -1, fmap.shape[-1]), fmap, method="box_predictor"
  )["pred_boxes"]
  assert np.max(np.abs(boxes - hf["pred_boxes"])) > 2e-4  # > the 1e-4 tolerance
  logits = scenic.apply(
    {"params": params},
    fmap.reshape(B, -1, fmap.shape[-1]),
    ours["query_embeddings"],
    queries[..., 0] > 0,
    method="class_predictor",
  )["pred_logits"]
  np.testing.assert_array_equal(logits[1, :, 3], -1e6)


def test_hf_mapping_values(hf_model, converted):
  """Hand-checked leaves of docs/reference.md §1.2 (transposes, head reshapes, conv layout)."""
  model, _ = hf_model
  params, _ = converted
  flat = _flat(params)
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  blk = "backbone/clip/visual/transformer/resblocks_1"
  hblk = "owlvit.vision_model.encoder.layers.1"
  q = flat[f"{blk}/attn/query/kernel"]  # [D=48, H=3, dh=16]
  assert q.shape == (48, 3, 16)
  # kernel[d, h, k] multiplies input d into output h*16+k: torch weight[h*16+k, d].
  assert q[5, 2, 7] == sd[f"{hblk}.self_attn.q_proj.weight"][2 * 16 + 7, 5]
  np.testing.assert_array_equal(
    flat[f"{blk}/attn/key/bias"][1], sd[f"{hblk}.self_attn.k_proj.bias"][16:32]
  )
  out = flat[f"{blk}/attn/out/kernel"]  # [H, dh, D]
  assert out[1, 3, 9] == sd[f"{hblk}.self_attn.out_proj.weight"][9, 1 * 16 + 3]
  conv = flat["backbone/clip/visual/conv1/kernel"]  # HWIO
  assert (
    conv[1, 6, 2, 40] == sd["owlvit.vision_model.embeddings.patch_embedding.weight"][40, 2, 1, 6]
  )
  np.testing.assert_array_equal(flat[f"{blk}/ln_1/scale"], sd[f"{hblk}.layer_norm2.weight"])
  np.testing.assert_array_equal(flat["class_head/Dense_0/kernel"], sd["class_head.dense0.weight"].T)
  np.testing.assert_array_equal(flat["backbone/merged_class_token/bias"], sd["layer_norm.bias"])
  assert flat["backbone/clip/logit_scale"].shape == ()
  assert flat["backbone/clip/logit_scale"] == sd["owlvit.logit_scale"]


def test_state_dict_inputs_torch_numpy_sharded_bin(hf_model, converted, tmp_path):
  model, _ = hf_model
  params, config = converted
  reference = _flat(params)
  torch_sd = model.state_dict()
  numpy_sd = {k: v.numpy() for k, v in torch_sd.items()}
  # A sharded safetensors folder and a pytorch_model.bin folder.
  sharded = str(tmp_path / "sharded")
  model.save_pretrained(sharded, max_shard_size="20KB")
  assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  torch.save(torch_sd, str(bin_dir / "pytorch_model.bin"))
  (bin_dir / "config.json").write_text(model.config.to_json_string())
  candidates = [
    ck.hf_state_dict_to_params(torch_sd, config),
    ck.hf_state_dict_to_params(numpy_sd, config),
    ck.load_hf_checkpoint(sharded)[0],
    ck.load_hf_checkpoint(str(bin_dir))[0],
  ]
  for got in candidates:
    got = _flat(got)
    assert set(got) == set(reference)
    for k in reference:
      assert got[k].dtype == np.float32
      np.testing.assert_array_equal(got[k], reference[k], err_msg=k)


def _random_ours(config, seed):
  """Random parameters of the module's shapes (LayerNorm scales around 1)."""
  rng = np.random.default_rng(seed)
  flat = _flat(ck.abstract_params(config))
  return flax.traverse_util.unflatten_dict(
    {
      k: (k.endswith("/scale") + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
      for k, v in flat.items()
    },
    sep="/",
  )


def test_export_round_trip_bit_identical_and_runs_in_hf(converted, tmp_path):
  _, config = converted
  params = _random_ours(config, seed=3)
  flat = _flat(params)

  def assert_identical(got):
    got = _flat(got)
    assert set(got) == set(flat)
    for k in flat:
      assert np.array_equal(np.asarray(got[k]), np.asarray(flat[k])), k

  numpy_sd = ck.params_to_hf_state_dict(params, config)
  assert all(isinstance(v, np.ndarray) for v in numpy_sd.values())
  assert_identical(ck.hf_state_dict_to_params(numpy_sd, config))
  torch_sd = ck.params_to_hf_state_dict(params, framework="torch")  # config inferred
  assert_identical(ck.hf_state_dict_to_params(torch_sd, config))

  folder = str(tmp_path / "exported")
  # config.json carries our tokenizer's start, end and pad ids: HF's defaults (49406, 49407)
  # lie outside this 100-id vocabulary, and HF warned on export and on load.
  with hf_warnings_as_errors():
    ck.save_hf_checkpoint(params, folder, config)
    hf = transformers.OwlViTForObjectDetection.from_pretrained(folder).eval()
  text = hf.config.text_config
  assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (SOT, EOT, 0)
  loaded, loaded_config = ck.load_hf_checkpoint(folder)
  assert_identical(loaded)
  assert loaded_config == config
  with pytest.raises(FileExistsError, match="exported"):
    ck.save_hf_checkpoint(params, folder, config)

  # The exported folder is a working HF model giving our outputs.
  assert set(hf.state_dict()) - set(torch_sd) == set()
  images, queries = _inputs(2)
  _assert_matches_hf(
    _ours_forward(params, config, images, queries), _hf_forward(hf, images, queries), queries
  )


def test_hf_import_mismatch_lists_paths(hf_model, converted):
  model, folder = hf_model
  _, config = converted
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  del sd["box_head.dense1.bias"]
  sd["class_head.extra.weight"] = np.zeros(3, np.float32)
  sd["owlvit.text_model.final_layer_norm.weight"] = np.zeros(7, np.float32)
  with pytest.raises(ck.CheckpointMismatchError) as info:
    ck.hf_state_dict_to_params(sd, config, source="some/file.safetensors")
  message = str(info.value)
  assert "some/file.safetensors" in message
  assert "box_head.dense1.bias [obj_box_head/Dense_1/bias]" in message
  assert "class_head.extra.weight" in message
  assert (
    "owlvit.text_model.final_layer_norm.weight [backbone/clip/text/ln_final/scale]: "
    "checkpoint (7,) vs expected (32,)"
  ) in message
  assert info.value.missing == ["box_head.dense1.bias [obj_box_head/Dense_1/bias]"]
  assert info.value.unexpected == ["class_head.extra.weight"]

  # A model of another size: every differing leaf is listed.
  with pytest.raises(ck.CheckpointMismatchError, match="resblocks_2"):
    ck.hf_state_dict_to_params(model.state_dict(), config.replace(vision_layers=3))


def test_hf_config_errors_name_field(tmp_path):
  for changes, field in [
    (dict(text=dict(hidden_act="gelu")), "text_config.hidden_act"),
    (dict(vision=dict(layer_norm_eps=1e-6)), "vision_config.layer_norm_eps"),
    (dict(projection_dim=16), "projection_dim=16"),
  ]:
    config = _hf_config(**changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    with pytest.raises(ValueError, match=field) as info:
      ck.hf_config_to_model_config(str(tmp_path))
    assert str(path) in str(info.value)
  with pytest.raises(ValueError, match="embed_dim == text_width"):
    ck.model_config_to_hf_config(owl_lib.get_variant_config("tiny").replace(embed_dim=64))


@pytest.mark.slow
def test_cli_hf_round_trip(hf_model, converted, tmp_path):
  from owl_cl.train import checkpointing

  _, folder = hf_model
  params, config = converted
  ours_dir, hf_dir = str(tmp_path / "ours"), str(tmp_path / "hf")
  ck.main(["hf-to-owl_cl", folder, ours_dir])
  restored, meta = checkpointing.load_params(ours_dir)
  assert ck.model_config_from_dict(meta["model_config"]) == config
  assert meta["source_format"] == "hf"
  for k, v in _flat(params).items():
    np.testing.assert_array_equal(np.asarray(_flat(restored)[k]), v)
  ck.main(["owl_cl-to-hf", ours_dir, hf_dir])
  again, again_config = ck.load_hf_checkpoint(hf_dir)
  assert again_config == config
  for k, v in _flat(params).items():
    np.testing.assert_array_equal(_flat(again)[k], v)
  with pytest.raises(SystemExit):
    ck.main(["hf-to-owl_cl", folder, ours_dir])


@pytest.mark.parametrize("variant", ["vit_b32", "vit_b16", "vit_l14"])
def test_real_variant_configs_round_trip(variant):
  config = owl_lib.get_variant_config(variant)
  hf = ck.model_config_to_hf_config(config)
  back = ck.hf_config_to_model_config(hf.to_dict(), dtype=config.dtype)
  assert back == config.replace(hf_compat=True)
  # The released CLIP vocabulary's start/end ids (docs/reference.md §2), pad 0.
  text = hf.text_config
  assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (49406, 49407, 0)
  if variant == "vit_l14":  # google/owlvit-large-patch14
    assert (
      hf.vision_config.image_size,
      hf.vision_config.patch_size,
      hf.vision_config.hidden_size,
      hf.vision_config.num_hidden_layers,
      hf.vision_config.num_attention_heads,
      hf.vision_config.intermediate_size,
    ) == (840, 14, 1024, 24, 16, 4096)
    assert (
      hf.text_config.hidden_size,
      hf.text_config.num_hidden_layers,
      hf.text_config.num_attention_heads,
      hf.text_config.intermediate_size,
      hf.text_config.max_position_embeddings,
      hf.projection_dim,
    ) == (768, 12, 12, 3072, 16, 768)


def test_l14_mapping_covers_the_real_hf_model():
  """Every one of the 603 L/14 leaves maps onto an HF parameter of the right shape, and
  every HF entry but visual_projection is mapped (HF model built on the meta device: no
  memory)."""
  config = owl_lib.get_variant_config("vit_l14")
  with torch.device("meta"):
    hf = transformers.OwlViTForObjectDetection(ck.model_config_to_hf_config(config))
  hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
  like = _flat(ck.abstract_params(config))
  rows = convert_hf._hf_rows(config)
  assert len(rows) == len(like) == 603
  assert {r[0] for r in rows} == set(like)
  assert set(hf_shapes) - {r[1] for r in rows} == {"owlvit.visual_projection.weight"}
  for ours, key, layout in rows:
    assert layout.torch_shape(tuple(like[ours].shape)) == hf_shapes[key], (ours, key)

"""Tests of owl_cl.model.convert: scenic msgpack files, OpenAI CLIP init, the CLI.

HF conversion and parity: tests/model/test_hf_parity.py.
"""
# torch.jit.load of OpenAI's TorchScript files is deprecated in torch 2.13 (still supported).
# pylint: disable=protected-access

import collections
import os
import warnings

import flax
from flax.traverse_util import flatten_dict
from flax.traverse_util import unflatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage

from owl_cl.model import convert as ck
from owl_cl.model import create_model
from owl_cl.train import checkpointing

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

# A small model: 32 px images, 8 px patches (4 x 4 grid), 2 + 2 layers.
OVERRIDES = dict(
  vocab_size=100,
  context_length=16,
  embed_dim=24,
  image_size=32,
  patch_size=8,
  vision_width=48,
  vision_layers=2,
  vision_heads=3,
  vision_mlp_dim=192,
  text_width=32,
  text_layers=2,
  text_heads=2,
  text_mlp_dim=128,
)


def _flat(tree):
  return flatten_dict(flax.core.unfreeze(tree), sep="/")


def _unflat(flat):
  return unflatten_dict(dict(flat), sep="/")


def _random_params(config, seed):
  """Random values for every leaf of the module's tree (LayerNorm scales around 1)."""
  rng = np.random.default_rng(seed)
  return _unflat(
    {
      k: (k.endswith("/scale") + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
      for k, v in _flat(ck.abstract_params(config)).items()
    }
  )


def _assert_trees_equal(got, expected):
  got, expected = _flat(got), _flat(expected)
  assert set(got) == set(expected)
  for k in expected:
    assert np.asarray(got[k]).dtype == np.float32, k
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(expected[k]), err_msg=k)


@pytest.fixture(scope="module")
def small():
  model = create_model("tiny", **OVERRIDES)
  config = model.config
  params = _random_params(config, seed=0)
  rng = np.random.default_rng(1)
  images = rng.uniform(size=(2, 32, 32, 3)).astype(np.float32)
  queries = np.zeros((2, 3, 16), np.int32)
  queries[:, :, 0] = 98
  queries[:, :, 1] = rng.integers(1, 98, (2, 3))
  queries[:, :, 2] = 99
  queries[1, 2] = 0
  fwd = jax.jit(lambda p: model.apply({"params": p}, images, queries))
  return dict(model=model, config=config, params=params, fwd=fwd)


# ------------------------------------------------------------------------------------------
# scenic msgpack checkpoints
# ------------------------------------------------------------------------------------------


def _old_scenic_names(params):
  """Our tree in scenic's OLD naming: resblocks.N, ln_1/ln_2 (= our ln_0/ln_1), plus the
  class-head padding leaves old files carry."""

  def rename(node):
    if not isinstance(node, dict):
      return node
    out = {}
    for key, value in node.items():
      value = rename(value)
      if key.startswith("resblocks_"):
        value = {{"ln_0": "ln_1", "ln_1": "ln_2"}.get(k, k): v for k, v in value.items()}
        key = key.replace("_", ".")
      out[key] = value
    return out

  old = rename(flax.core.unfreeze(params))
  old["class_head"]["padding"] = np.zeros((1, 24), np.float32)
  old["class_head"]["padding_bias"] = np.zeros((1,), np.float32)
  return old


def _write_msgpack(path, tree):
  with open(path, "wb") as f:
    f.write(flax.serialization.msgpack_serialize(tree))
  return str(path)


def test_scenic_old_naming_optimizer_target_loads_and_runs(small, tmp_path):
  old = _old_scenic_names(small["params"])
  block = old["backbone"]["clip"]["visual"]["transformer"]["resblocks.1"]
  assert set(block) == {"ln_1", "ln_2", "attn", "mlp"}
  np.testing.assert_array_equal(
    block["ln_2"]["scale"],
    small["params"]["backbone"]["clip"]["visual"]["transformer"]["resblocks_1"]["ln_1"]["scale"],
  )
  path = _write_msgpack(
    tmp_path / "clip_vit_tiny", {"optimizer": {"target": old, "state": {"step": 7}}}
  )
  loaded = ck.load_scenic_checkpoint(path, small["config"])
  _assert_trees_equal(loaded, small["params"])
  out, expected = small["fwd"](loaded), small["fwd"](small["params"])
  for k in expected:
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(expected[k]), err_msg=k)


def test_scenic_params_nesting_and_checkpoint_folder(small, tmp_path):
  new = flax.core.unfreeze(small["params"])
  new["class_head"]["padding"] = np.zeros((1, 24), np.float32)
  folder = tmp_path / "run"
  folder.mkdir()
  _write_msgpack(folder / "checkpoint_2", {"params": {"bogus": np.zeros(1)}})
  _write_msgpack(folder / "checkpoint_10", {"params": new, "step": 10})  # newest
  _assert_trees_equal(ck.load_scenic_checkpoint(str(folder), small["config"]), small["params"])
  # The abstract tree (instead of the config) works as the target too.
  _assert_trees_equal(
    ck.load_scenic_checkpoint(str(folder / "checkpoint_10"), ck.abstract_params(small["config"])),
    small["params"],
  )


def test_fix_scenic_names_is_idempotent(small):
  old = _old_scenic_names(small["params"])
  fixed = ck.fix_scenic_names(old)
  _assert_trees_equal(fixed, small["params"])
  _assert_trees_equal(ck.fix_scenic_names(fixed), small["params"])  # already fixed
  # Half-fixed (LayerNorms renumbered, dots kept) also ends up current.
  half = flax.core.unfreeze(small["params"])
  tr = half["backbone"]["clip"]["text"]["transformer"]
  half["backbone"]["clip"]["text"]["transformer"] = {k.replace("_", "."): v for k, v in tr.items()}
  _assert_trees_equal(ck.fix_scenic_names(half), small["params"])
  bad = {"transformer": {"resblocks.0": {"ln_0": {}, "ln_1": {}, "ln_2": {}}}}
  with pytest.raises(ValueError, match="resblocks.0 has both ln_0 and ln_2"):
    ck.fix_scenic_names(bad, where="f.msgpack")


def test_scenic_mismatch_lists_every_path_and_the_file(small, tmp_path):
  old = _old_scenic_names(small["params"])
  del old["obj_box_head"]["Dense_1"]["bias"]
  old["class_head"]["extra"] = {"kernel": np.zeros((2, 2), np.float32)}
  old["backbone"]["clip"]["text"]["positional_embedding"] = np.zeros((77, 32), np.float32)
  path = _write_msgpack(tmp_path / "broken", {"optimizer": {"target": old}})
  with pytest.raises(ck.CheckpointMismatchError) as info:
    ck.load_scenic_checkpoint(path, small["config"])
  err = info.value
  assert err.missing == ["obj_box_head/Dense_1/bias"]
  assert err.unexpected == ["class_head/extra/kernel"]
  assert err.wrong_shape == [("backbone/clip/text/positional_embedding", (77, 32), (16, 32))]
  message = str(err)
  assert path in message
  for text in (
    "obj_box_head/Dense_1/bias",
    "class_head/extra/kernel",
    "backbone/clip/text/positional_embedding: checkpoint (77, 32) vs expected (16, 32)",
  ):
    assert text in message


def test_scenic_bad_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing_here"):
    ck.read_scenic_checkpoint(str(tmp_path / "nothing_here"))
  path = _write_msgpack(tmp_path / "other", {"model": {"w": np.zeros(2)}})
  with pytest.raises(ValueError, match=r"other: no parameters .*\['model'\]"):
    ck.read_scenic_checkpoint(path)
  (tmp_path / "text").write_text("not msgpack at all")
  with pytest.raises(ValueError, match="text"):
    ck.read_scenic_checkpoint(str(tmp_path / "text"))


def test_infer_model_config(small):
  assert ck.infer_model_config(small["params"], tokenizer="word_hash") == small["config"].replace(
    hf_compat=False
  )
  assert ck.model_config_from_dict(ck.model_config_to_dict(small["config"])) == small["config"]


# ------------------------------------------------------------------------------------------
# OpenAI CLIP TorchScript
# ------------------------------------------------------------------------------------------

CLIP_RESOLUTION, CLIP_CONTEXT = 32, 77


def _torch_clip_module():
  """A small OpenAI-CLIP-like model: the state dict names and shapes of openai/CLIP
  clip/model.py (ViT), with a forward that returns all image tokens after ln_post and the
  text features (x[argmax] @ text_projection)."""
  torch = pytest.importorskip("torch")
  nn = torch.nn

  class QuickGELU(nn.Module):
    def forward(self, x):
      return x * torch.sigmoid(1.702 * x)

  class Block(nn.Module):
    def __init__(self, width, heads, causal):
      super().__init__()
      self.attn = nn.MultiheadAttention(width, heads)
      self.ln_1 = nn.LayerNorm(width)
      self.mlp = nn.Sequential(
        collections.OrderedDict(
          [
            ("c_fc", nn.Linear(width, 4 * width)),
            ("gelu", QuickGELU()),
            ("c_proj", nn.Linear(4 * width, width)),
          ]
        )
      )
      self.ln_2 = nn.LayerNorm(width)
      self.causal = causal

    def forward(self, x):  # x [L, N, D] (sequence first, as OpenAI)
      mask = None
      if self.causal:
        mask = torch.full((x.shape[0], x.shape[0]), float("-inf")).triu(1)
      y = self.ln_1(x)
      x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
      return x + self.mlp(self.ln_2(x))

  class Transformer(nn.Module):
    def __init__(self, width, layers, heads, causal):
      super().__init__()
      self.resblocks = nn.Sequential(*[Block(width, heads, causal) for _ in range(layers)])

    def forward(self, x):
      return self.resblocks(x)

  class Visual(nn.Module):
    def __init__(self, width=48, layers=2, heads=3, patch=8, out=24):
      super().__init__()
      self.conv1 = nn.Conv2d(3, width, patch, stride=patch, bias=False)
      self.class_embedding = nn.Parameter(torch.randn(width))
      self.positional_embedding = nn.Parameter(
        torch.randn((CLIP_RESOLUTION // patch) ** 2 + 1, width)
      )
      self.ln_pre = nn.LayerNorm(width)
      self.transformer = Transformer(width, layers, heads, causal=False)
      self.ln_post = nn.LayerNorm(width)
      self.proj = nn.Parameter(torch.randn(width, out))

    def forward(self, x):
      x = self.conv1(x)
      x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
      cls = self.class_embedding + torch.zeros(x.shape[0], 1, x.shape[-1])
      x = torch.cat([cls, x], dim=1) + self.positional_embedding
      x = self.ln_pre(x).permute(1, 0, 2)
      x = self.transformer(x).permute(1, 0, 2)
      return self.ln_post(x)  # all tokens (OWL-ViT uses them, no projection)

  class Clip(nn.Module):
    def __init__(self, width=32, layers=2, heads=2, vocab=100, out=24):
      super().__init__()
      self.visual = Visual()
      self.transformer = Transformer(width, layers, heads, causal=True)
      self.token_embedding = nn.Embedding(vocab, width)
      self.positional_embedding = nn.Parameter(torch.randn(CLIP_CONTEXT, width))
      self.ln_final = nn.LayerNorm(width)
      self.text_projection = nn.Parameter(torch.randn(width, out))
      self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def forward(self, image, text):
      x = self.token_embedding(text) + self.positional_embedding
      x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
      x = self.ln_final(x)
      x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection
      return self.visual(image), x

  gen = torch.Generator().manual_seed(0)
  module = Clip().eval()
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.1 * noise if ("ln_" in name and name.endswith("weight")) else 0.2 * noise)
  return torch, module


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
  torch, module = _torch_clip_module()
  image = torch.zeros(1, 3, CLIP_RESOLUTION, CLIP_RESOLUTION)
  text = torch.zeros(1, CLIP_CONTEXT, dtype=torch.long)
  path = str(tmp_path_factory.mktemp("clip") / "ViT-tiny.pt")
  with warnings.catch_warnings():  # tracer notes on MultiheadAttention; jit deprecation
    warnings.simplefilter("ignore")
    torch.jit.save(torch.jit.trace(module, (image, text), check_trace=False), path)
  return torch, module, path


def _init_params(config, seed=5):
  model = create_model("tiny", **config)
  return model, _random_params(model.config, seed)


def test_clip_torchscript_state_dict_names(clip_file):
  torch, _, path = clip_file
  names = set(torch.jit.load(path, map_location="cpu").state_dict())
  for name in (
    "visual.conv1.weight",
    "visual.class_embedding",
    "visual.positional_embedding",
    "visual.ln_pre.weight",
    "visual.transformer.resblocks.1.attn.in_proj_weight",
    "visual.transformer.resblocks.0.attn.out_proj.bias",
    "visual.transformer.resblocks.0.mlp.c_fc.weight",
    "visual.transformer.resblocks.0.ln_2.bias",
    "visual.ln_post.bias",
    "visual.proj",
    "token_embedding.weight",
    "positional_embedding",
    "transformer.resblocks.1.mlp.c_proj.weight",
    "ln_final.weight",
    "text_projection",
    "logit_scale",
  ):
    assert name in names


def test_clip_init_matches_torch_towers(clip_file):
  """Same grid and context: our towers with the converted weights = the torch CLIP's."""
  torch, module, path = clip_file
  model, init = _init_params(OVERRIDES)
  params = ck.load_clip_torchscript(path, init)
  flat, flat_init = _flat(params), _flat(init)
  for k in flat:  # heads and merged LN stay fresh; the CLIP towers are replaced
    same = np.array_equal(flat[k], flat_init[k])
    assert same == (not k.startswith("backbone/clip/")), k
  sd = module.state_dict()
  np.testing.assert_array_equal(
    flat["backbone/clip/text/text_projection/kernel"], sd["text_projection"].numpy()
  )  # x @ W: no transpose
  np.testing.assert_array_equal(
    flat["backbone/clip/text/positional_embedding"], sd["positional_embedding"].numpy()[:16]
  )

  rng = np.random.default_rng(0)
  pixels = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)  # already normalised
  tokens = np.zeros((3, CLIP_CONTEXT), np.int64)
  for i, n in enumerate((0, 5, 13)):
    tokens[i, 0] = 98
    tokens[i, 1 : 1 + n] = rng.integers(1, 98, n)
    tokens[i, 1 + n] = 99
  with torch.no_grad():
    ref_image, ref_text = module(
      torch.from_numpy(pixels.transpose(0, 3, 1, 2)), torch.from_numpy(tokens)
    )
  towers = jax.jit(
    lambda p, x, t: model.apply({"params": p}, x, t, method=lambda m, x, t: m._embedder.clip(x, t))
  )
  image_tokens, text = towers(params, jnp.asarray(pixels), jnp.asarray(tokens[:, :16], jnp.int32))
  np.testing.assert_allclose(np.asarray(image_tokens), ref_image.numpy(), atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(text), ref_text.numpy(), atol=1e-4, rtol=0)


def test_clip_init_resizes_vision_grid(clip_file):
  torch, module, path = clip_file
  _, init = _init_params(dict(OVERRIDES, image_size=48))  # 6 x 6 grid
  params = ck.load_clip_torchscript(path, init)
  posemb = _flat(params)["backbone/clip/visual/positional_embedding"]
  old = module.state_dict()["visual.positional_embedding"].numpy()  # [1 + 16, 48]
  assert posemb.shape == (37, 48)
  np.testing.assert_array_equal(posemb[0], old[0])  # CLS row kept
  grid, old_grid = posemb[1:].reshape(6, 6, 48), old[1:].reshape(4, 4, 48)
  for i, j in ((0, 0), (0, -1), (-1, 0), (-1, -1)):  # order-1 zoom: corners kept
    np.testing.assert_allclose(grid[i, j], old_grid[i, j], rtol=1e-6, atol=1e-6)
  # Linear in between: row 0 of the 6-grid samples the 4-grid's row 0 at x = j * 3/5.
  # column 2 -> 2 * 3/5 = 1.2: 0.8 * column 1 + 0.2 * column 2
  np.testing.assert_allclose(
    grid[0, 2], 0.8 * old_grid[0, 1] + 0.2 * old_grid[0, 2], rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    grid, scipy.ndimage.zoom(old_grid, (1.5, 1.5, 1), order=1), rtol=1e-6, atol=1e-7
  )


def test_clip_fp16_and_mismatch_errors(clip_file):
  torch, module, _ = clip_file
  _, init = _init_params(OVERRIDES)
  half = {k: v.half() for k, v in module.state_dict().items()}
  params = ck.load_clip_torchscript(half, init)
  w = _flat(params)["backbone/clip/visual/transformer/resblocks_0/mlp/c_fc/kernel"]
  assert w.dtype == np.float32
  np.testing.assert_array_equal(
    w, half["visual.transformer.resblocks.0.mlp.c_fc.weight"].float().numpy().T
  )

  sd = dict(module.state_dict())
  del sd["ln_final.bias"]
  sd["visual.extra"] = torch.zeros(2)
  sd["input_resolution"] = torch.tensor(32)  # ignored, as OpenAI files
  sd["transformer.resblocks.0.attn.in_proj_weight"] = torch.zeros(96, 31)
  with pytest.raises(ck.CheckpointMismatchError) as info:
    ck.load_clip_torchscript(sd, init, source="ViT-X.pt")
  message = str(info.value)
  assert "ViT-X.pt" in message
  assert "ln_final.bias [backbone/clip/text/ln_final/bias]" in message
  assert "visual.extra" in message and "input_resolution" not in message
  assert (
    "transformer.resblocks.0.attn.in_proj_weight "
    "[backbone/clip/text/transformer/resblocks_0/attn/{query,key,value}]: "
    "checkpoint (96, 31) vs expected (96, 32)"
  ) in message
  # A model of another width: every differing leaf is named.
  _, wide = _init_params(dict(OVERRIDES, vision_width=64, vision_heads=4))
  with pytest.raises(ck.CheckpointMismatchError, match="visual.class_embedding"):
    ck.load_clip_torchscript(dict(module.state_dict()), wide)


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def _override_args():
  return [arg for k, v in OVERRIDES.items() for arg in ("--override", f"{k}={v}")]


def test_cli_scenic_to_owl_cl_never_overwrites(small, tmp_path, capsys):
  path = _write_msgpack(
    tmp_path / "ckpt", {"optimizer": {"target": _old_scenic_names(small["params"])}}
  )
  out = str(tmp_path / "converted")
  ck.main(["scenic-to-owl_cl", path, out, "--variant", "tiny"] + _override_args())
  params, meta = checkpointing.load_params(out)
  _assert_trees_equal(params, small["params"])
  assert meta["source_format"] == "scenic" and meta["converted_from"] == path
  assert ck.model_config_from_dict(meta["model_config"]) == small["config"]

  # A second run refuses to touch the output; --overwrite replaces it once complete.
  other = _random_params(small["config"], seed=9)
  path2 = _write_msgpack(tmp_path / "ckpt2", {"params": other})
  with pytest.raises(SystemExit):
    ck.main(["scenic-to-owl_cl", path2, out, "--variant", "tiny"] + _override_args())
  assert "refusing to overwrite" in capsys.readouterr().err
  _assert_trees_equal(checkpointing.load_params(out)[0], small["params"])
  # A failing conversion (wrong model) leaves the existing output intact, even with
  # --overwrite.
  with pytest.raises(SystemExit):
    ck.main(["scenic-to-owl_cl", path2, out, "--variant", "tiny", "--overwrite"])
  assert "do not match the model" in capsys.readouterr().err
  _assert_trees_equal(checkpointing.load_params(out)[0], small["params"])
  ck.main(["scenic-to-owl_cl", path2, out, "--variant", "tiny", "--overwrite"] + _override_args())
  _assert_trees_equal(checkpointing.load_params(out)[0], other)
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt2", "converted"]  # no leftovers


def test_cli_clip_to_owl_cl(clip_file, tmp_path):
  _, module, path = clip_file
  out = str(tmp_path / "from_clip")
  ck.main(["clip-to-owl_cl", path, out, "--variant", "tiny", "--seed", "3"] + _override_args())
  params, meta = checkpointing.load_params(out)
  flat = _flat(params)
  np.testing.assert_array_equal(
    flat["backbone/clip/visual/conv1/kernel"],
    module.state_dict()["visual.conv1.weight"].numpy().transpose(2, 3, 1, 0),
  )
  assert meta["source_format"] == "openai_clip" and meta["init_seed"] == 3
  # Fresh heads: the scenic initialisers (zero box-head output kernel, logit-shift prior).
  np.testing.assert_array_equal(flat["obj_box_head/Dense_2/kernel"], 0.0)
  np.testing.assert_allclose(flat["class_head/logit_shift/bias"], np.log(0.01 / 0.99), rtol=1e-6)
  np.testing.assert_array_equal(flat["backbone/merged_class_token/scale"], 1.0)
  dense = flat["class_head/Dense_0/kernel"]  # normal(1e-6) init
  assert dense.shape == (48, 24) and 5e-7 < dense.std() < 2e-6

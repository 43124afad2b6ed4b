"""OWL-ViT checkpoints from elsewhere: scenic msgpack, HF transformers, OpenAI CLIP.

Every loader returns a parameter tree (the ``params`` collection, a nested ``dict`` of float32
``np.ndarray``) that equals our module's tree (``jax.eval_shape`` of ``OwlViT.init``) in names
and shapes; anything else raises :class:`CheckpointMismatchError` listing every missing,
unexpected and wrongly shaped path, naming the file.

* **scenic** (SPEC §2): :func:`load_scenic_checkpoint` reads legacy Flax msgpack files
  (``flax.training.checkpoints``), nested under ``optimizer/target`` (v1 releases) or
  ``params``; old names (``resblocks.N``, ``ln_1``/``ln_2``) are fixed idempotently
  (:func:`fix_scenic_names`) and ``class_head/padding*`` leaves dropped.
* **HF transformers** (SPEC §1.2): :func:`load_hf_checkpoint` (a saved
  ``OwlViTForObjectDetection`` folder), :func:`hf_state_dict_to_params`,
  :func:`hf_config_to_model_config`; back: :func:`params_to_hf_state_dict`,
  :func:`save_hf_checkpoint`, :func:`model_config_to_hf_config`.
* **OpenAI CLIP** (SPEC §2, "CLIP init"): :func:`load_clip_torchscript` initialises both
  towers from a CLIP TorchScript file (``ViT-L-14.pt``); heads and the merged-class-token
  LayerNorm come from a freshly initialised tree.

Command line: ``python -m owl_cl.model.checkpoints {scenic-to-owl_cl, hf-to-owl_cl,
owl_cl-to-hf, clip-to-owl_cl} ...`` writes our format (``owl_cl.train.checkpointing``); see
the README section "Checkpoints".

torch, transformers and safetensors (the ``hf`` extra) are imported only by the functions that
need them.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Callable, Mapping, Sequence
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
from typing import Any

import flax
from flax.traverse_util import flatten_dict
from flax.traverse_util import unflatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import scipy.ndimage

from owl_cl.model import clip as clip_lib
from owl_cl.model import owl_vit as owl_lib

__all__ = [
  "CheckpointMismatchError",
  "abstract_params",
  "check_params",
  "fix_scenic_names",
  "fresh_head_params",
  "hf_config_to_model_config",
  "hf_state_dict_to_params",
  "infer_model_config",
  "load_clip_torchscript",
  "load_hf_checkpoint",
  "load_hf_state_dict",
  "load_scenic_checkpoint",
  "main",
  "model_config_from_dict",
  "model_config_to_dict",
  "model_config_to_hf_config",
  "params_to_hf_state_dict",
  "read_scenic_checkpoint",
  "save_hf_checkpoint",
]

PyTree = Any
Target = owl_lib.ModelConfig | PyTree

#: HF state-dict entries without a counterpart in our tree, ignored on import: CLIP's image
#: projection (unused by the detector, SPEC §1.2) and buffers older transformers saved.
HF_IGNORED_KEYS = (
  "owlvit.visual_projection.weight",
  "owlvit.text_model.embeddings.position_ids",
  "owlvit.vision_model.embeddings.position_ids",
  "box_bias",
)
#: OpenAI CLIP state-dict entries without a counterpart: the image projection and the
#: integer attributes TorchScript files carry.
CLIP_IGNORED_KEYS = ("visual.proj", "input_resolution", "context_length", "vocab_size")
_MAX_LISTED = 60
_HF_INSTALL = "pip install 'owl_cl[hf]'"


# ============================================================================================
# Tree matching.
# ============================================================================================


class CheckpointMismatchError(ValueError):
  """A checkpoint's parameter names/shapes differ from the module's.

  Attributes:
    source: the file (or description) the parameters came from.
    missing: paths the module needs that the checkpoint lacks.
    unexpected: paths the checkpoint has that the module does not.
    wrong_shape: ``(path, checkpoint shape, expected shape)`` triples.
  """

  def __init__(
    self,
    source: str,
    missing: Sequence[str] = (),
    unexpected: Sequence[str] = (),
    wrong_shape: Sequence[tuple[str, tuple, tuple]] = (),
    what: str = "",
  ):
    self.source = source
    self.missing = list(missing)
    self.unexpected = list(unexpected)
    self.wrong_shape = list(wrong_shape)
    lines = [f"parameters of {source} do not match the model{what}:"]
    for title, items in (
      ("missing", self.missing),
      ("unexpected", self.unexpected),
      (
        "wrong shape",
        [f"{p}: checkpoint {tuple(a)} vs expected {tuple(b)}" for p, a, b in self.wrong_shape],
      ),
    ):
      if items:
        lines.append(f"  {title} ({len(items)}):")
        lines += [f"    {x}" for x in items[:_MAX_LISTED]]
        if len(items) > _MAX_LISTED:
          lines.append(f"    ... and {len(items) - _MAX_LISTED} more")
    super().__init__("\n".join(lines))


def _flat(tree: PyTree) -> dict[str, Any]:
  return flatten_dict(flax.core.unfreeze(tree), sep="/")


def _unflat(flat: Mapping[str, Any]) -> dict[str, Any]:
  return unflatten_dict(dict(flat), sep="/")


def abstract_params(config: owl_lib.ModelConfig) -> PyTree:
  """The module's parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated).

  Args:
    config: a :class:`owl_cl.model.owl_vit.ModelConfig` (or any mapping of its fields).

  Returns:
    Nested ``dict`` = ``jax.eval_shape(OwlViT(**config).init, ...)['params']``.

  Source: SPEC §1.1.
  """
  cfg = dict(config)
  model = owl_lib.OwlViT(**cfg)
  images = jax.ShapeDtypeStruct((1, cfg["image_size"], cfg["image_size"], 3), jnp.float32)
  queries = jax.ShapeDtypeStruct((1, 1, cfg["context_length"]), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), images, queries)
  return flax.core.unfreeze(variables)["params"]


def _resolve_target(target: Target) -> PyTree:
  if isinstance(target, owl_lib.ModelConfig):
    return abstract_params(target)
  return target


def check_params(params: PyTree, target: Target, source: str) -> dict[str, np.ndarray]:
  """Checks a parameter tree against the module's and returns it as float32 numpy.

  Args:
    params: nested mapping of arrays (numpy, jax, anything ``np.asarray`` takes).
    target: a ``ModelConfig`` (its :func:`abstract_params`) or a tree with ``.shape``
      leaves (arrays or ``jax.ShapeDtypeStruct``).
    source: file name (or description) quoted in errors.

  Returns:
    Nested ``dict`` of ``np.ndarray`` in the target's dtypes (float32), same paths as the
    target.

  Raises:
    CheckpointMismatchError: listing every missing, unexpected and wrongly shaped path
      (with both shapes).

  Source: SPEC §1.1, §2.
  """
  like = _flat(_resolve_target(target))
  got = _flat(params)
  missing = sorted(set(like) - set(got))
  unexpected = sorted(set(got) - set(like))
  wrong = [
    (k, tuple(np.shape(got[k])), tuple(like[k].shape))
    for k in sorted(set(got) & set(like))
    if tuple(np.shape(got[k])) != tuple(like[k].shape)
  ]
  if missing or unexpected or wrong:
    raise CheckpointMismatchError(source, missing, unexpected, wrong)
  return _unflat({k: np.asarray(got[k]).astype(like[k].dtype, copy=False) for k in like})


# ============================================================================================
# Model configurations.
# ============================================================================================


def model_config_to_dict(config: owl_lib.ModelConfig) -> dict[str, Any]:
  """JSON-friendly ``dict`` of a ``ModelConfig`` (``dtype`` as its name, e.g. 'float32')."""
  out = dict(config)
  out["dtype"] = jnp.dtype(out["dtype"]).name
  return out


def model_config_from_dict(fields: Mapping[str, Any]) -> owl_lib.ModelConfig:
  """Inverse of :func:`model_config_to_dict`.

  Raises:
    ValueError: missing or unknown fields (named).
  """
  names = {f.name for f in dataclasses.fields(owl_lib.ModelConfig)}
  # Fields with a default (attention, remat) may be absent from older files.
  optional = {
    f.name for f in dataclasses.fields(owl_lib.ModelConfig) if f.default is not dataclasses.MISSING
  }
  if not names - optional <= set(fields) <= names:
    raise ValueError(
      f"model config fields differ: missing {sorted(names - optional - set(fields))}, "
      f"unknown {sorted(set(fields) - names)}"
    )
  values = dict(fields)
  values["dtype"] = _dtype(values["dtype"])
  return owl_lib.ModelConfig(**values)


def _dtype(name: Any) -> Any:
  """'float32' / 'bfloat16' (or a dtype) -> the ``jnp`` scalar type the variants use."""
  return getattr(jnp, jnp.dtype(name).name)


def infer_model_config(
  params: PyTree,
  *,
  tokenizer: str = "clip",
  hf_compat: bool = False,
  dtype: Any = jnp.float32,
  text_stochastic_depth: float = 0.1,
  vision_stochastic_depth: float = 0.2,
) -> owl_lib.ModelConfig:
  """Reads the architecture (widths, layers, heads, patch, image size, ...) off a tree.

  Args:
    params: our parameter tree (arrays or ``ShapeDtypeStruct``).
    tokenizer, hf_compat, dtype, text_stochastic_depth, vision_stochastic_depth: the
      fields a tree does not determine.

  Returns:
    ``ModelConfig``; ``image_size = sqrt(P) * patch`` from the vision positional
    embedding ``[P + 1, D]``.

  Raises:
    ValueError: a needed leaf is absent (named) or the positional grid is not square.

  Source: SPEC §1.1.
  """
  flat = _flat(params)

  def shape(path):
    if path not in flat:
      raise ValueError(f"cannot infer the model config: parameter {path} is missing")
    return tuple(flat[path].shape)

  def layers(tower):
    prefix = f"backbone/clip/{tower}/transformer/"
    idx = {
      int(m.group(1))
      for k in flat
      for m in [re.match(re.escape(prefix) + r"resblocks_(\d+)/", k)]
      if m
    }
    if not idx:
      raise ValueError(f"cannot infer the model config: no {prefix}resblocks_* blocks")
    return max(idx) + 1

  vis, txt = "backbone/clip/visual", "backbone/clip/text"
  patch = shape(f"{vis}/conv1/kernel")[0]
  tokens = shape(f"{vis}/positional_embedding")[0] - 1
  grid = math.isqrt(tokens)
  if grid * grid != tokens:
    raise ValueError(f"vision positional embedding has {tokens} patch rows: not a square grid")
  vocab, text_width = shape(f"{txt}/token_embedding/embedding")
  return owl_lib.ModelConfig(
    tokenizer=tokenizer,
    vocab_size=vocab,
    context_length=shape(f"{txt}/positional_embedding")[0],
    embed_dim=shape(f"{txt}/text_projection/kernel")[1],
    image_size=grid * patch,
    patch_size=patch,
    vision_width=shape(f"{vis}/class_embedding")[0],
    vision_layers=layers("visual"),
    vision_heads=shape(f"{vis}/transformer/resblocks_0/attn/query/kernel")[1],
    vision_mlp_dim=shape(f"{vis}/transformer/resblocks_0/mlp/c_fc/kernel")[1],
    text_width=text_width,
    text_layers=layers("text"),
    text_heads=shape(f"{txt}/transformer/resblocks_0/attn/query/kernel")[1],
    text_mlp_dim=shape(f"{txt}/transformer/resblocks_0/mlp/c_fc/kernel")[1],
    text_stochastic_depth=text_stochastic_depth,
    vision_stochastic_depth=vision_stochastic_depth,
    hf_compat=hf_compat,
    dtype=dtype,
  )


# ============================================================================================
# scenic msgpack checkpoints (SPEC §2).
# ============================================================================================


def _fix_block(block: Mapping[str, Any], where: str) -> dict[str, Any]:
  block = dict(block)
  if "ln_2" in block:
    if "ln_0" in block:
      raise ValueError(f"{where} has both ln_0 and ln_2: neither the old nor the new naming")
    block["ln_0"] = block.pop("ln_1")
    block["ln_1"] = block.pop("ln_2")
  return block


def fix_scenic_names(params: PyTree, where: str = "checkpoint") -> dict[str, Any]:
  """Makes old scenic parameter names current; an already-current tree is unchanged.

  In every mapping, each key ``resblocks.N`` / ``resblocks_N`` (a transformer block) whose
  block holds ``ln_2`` is renamed per block ``ln_1 -> ln_0``, ``ln_2 -> ln_1``; then ``.``
  becomes ``_`` in block names (``resblocks.N -> resblocks_N``). ``class_head/padding*``
  leaves are dropped. Idempotent (scenic's own ``_fix_old_layernorm`` is not on a
  half-fixed tree).

  Args:
    params: nested mapping (leaves untouched, not copied). where: name for errors.

  Returns:
    A new nested ``dict``.

  Raises:
    ValueError: a block with both ``ln_0`` and ``ln_2``, or ``resblocks.N`` and
      ``resblocks_N`` side by side.

  Source: SPEC §2; scenic `scenic/projects/owl_vit/models.py` (``_fix_old_checkpoints``,
  ``TextZeroShotDetectionModule.load``).
  """

  def walk(node, path):
    if not isinstance(node, Mapping):
      return node
    out = {}
    for key, value in node.items():
      sub = f"{path}/{key}" if path else str(key)
      if (
        isinstance(key, str)
        and re.fullmatch(r"resblocks[._]\d+", key)
        and isinstance(value, Mapping)
      ):
        value = _fix_block(value, f"{where}: {sub}")
        key = key.replace(".", "_")
        if key in out:
          raise ValueError(f"{where}: {path}/{key} occurs in both old and new naming")
      if path == "class_head" and isinstance(key, str) and key.startswith("padding"):
        continue
      out[key] = walk(value, sub)
    return out

  return walk(flax.core.unfreeze(params), "")


def _resolve_flax_checkpoint_file(path: str) -> str:
  if os.path.isdir(path):
    steps = []
    for name in os.listdir(path):
      m = re.fullmatch(r"checkpoint_(\d+)", name)
      if m and os.path.isfile(os.path.join(path, name)):
        steps.append((int(m.group(1)), name))
    if not steps:
      raise FileNotFoundError(f"no msgpack checkpoint (checkpoint_<step> file) in folder {path}")
    return os.path.join(path, max(steps)[1])
  if not os.path.isfile(path):
    raise FileNotFoundError(f"scenic checkpoint {path} does not exist")
  return path


def read_scenic_checkpoint(path: str) -> dict[str, Any]:
  """Reads a scenic (legacy Flax msgpack) checkpoint's parameters, names fixed, unchecked.

  Args:
    path: a msgpack file (e.g. ``clip_vit_l14_d83d374``) or a folder of
      ``checkpoint_<step>`` files (the newest is read).

  Returns:
    Nested ``dict`` of ``np.ndarray`` (as stored, usually float32): the tree under
    ``optimizer/target`` (v1 releases, pre-optax) or ``params``, or the whole file when
    it is a bare parameter tree (top level holds ``backbone``); then
    :func:`fix_scenic_names`.

  Raises:
    FileNotFoundError: no such file. ValueError: not msgpack, or none of the known
    nestings (the message names the file and its top-level keys).

  Source: SPEC §2; scenic `scenic/projects/owl_vit/models.py` (``load_variables``).
  """
  path = _resolve_flax_checkpoint_file(os.path.abspath(path))
  with open(path, "rb") as f:
    data = f.read()
  try:
    restored = flax.serialization.msgpack_restore(data)
  except Exception as e:  # msgpack raises several unrelated types
    raise ValueError(f"{path} is not a Flax msgpack checkpoint: {e}") from e
  if not isinstance(restored, Mapping):
    raise ValueError(f"{path}: top level is a {type(restored).__name__}, not a mapping")
  if isinstance(restored.get("optimizer"), Mapping) and "target" in restored["optimizer"]:
    params = restored["optimizer"]["target"]
  elif "params" in restored:
    params = restored["params"]
  elif "backbone" in restored:
    params = restored
  else:
    raise ValueError(
      f"{path}: no parameters under 'optimizer/target' or 'params' "
      f"(top-level keys: {sorted(map(str, restored))})"
    )
  return fix_scenic_names(params, where=path)


def load_scenic_checkpoint(path: str, target: Target) -> dict[str, np.ndarray]:
  """Loads a scenic OWL-ViT checkpoint into our parameter tree.

  Args:
    path: see :func:`read_scenic_checkpoint`.
    target: ``ModelConfig`` of the module, or its (abstract) parameter tree.

  Returns:
    Nested ``dict`` of float32 ``np.ndarray``, paths and shapes = the target's.

  Raises:
    FileNotFoundError, ValueError: see :func:`read_scenic_checkpoint`.
    CheckpointMismatchError: names/shapes differ (all offending paths listed, file named).

  Source: SPEC §2; scenic `scenic/projects/owl_vit/models.py`.
  """
  params = read_scenic_checkpoint(path)
  return check_params(params, target, os.path.abspath(path))


# ============================================================================================
# Leaf layouts shared by the HF and CLIP mappings (SPEC §1.2).
# ============================================================================================


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one of our leaves is stored in torch: to_torch(ours), from_torch(w, our shape),
  torch_shape(our shape)."""

  name: str
  to_torch: Callable[[np.ndarray], np.ndarray]
  from_torch: Callable[[np.ndarray, tuple], np.ndarray]
  torch_shape: Callable[[tuple], tuple]


_SAME = _Layout("same", lambda x: x, lambda w, s: w, lambda s: tuple(s))
# torch Linear weight [out, in] = flax kernel [in, out].T
_LINEAR = _Layout("linear", lambda x: x.T, lambda w, s: w.T, lambda s: tuple(s[::-1]))
# q/k/v: kernel [D, H, dh] <-> weight [H*dh, D]; bias [H, dh] <-> [H*dh]
_QKV = _Layout(
  "qkv",
  lambda x: x.reshape(x.shape[0], -1).T,
  lambda w, s: w.T.reshape(s),
  lambda s: (int(np.prod(s[1:])), s[0]),
)
_HEAD_BIAS = _Layout(
  "head_bias", lambda x: x.reshape(-1), lambda w, s: w.reshape(s), lambda s: (int(np.prod(s)),)
)
# out: kernel [H, dh, D] <-> weight [D, H*dh]
_OUT = _Layout(
  "out",
  lambda x: x.reshape(-1, x.shape[-1]).T,
  lambda w, s: w.T.reshape(s),
  lambda s: (s[2], s[0] * s[1]),
)
# conv: HWIO <-> OIHW
_CONV = _Layout(
  "conv",
  lambda x: x.transpose(3, 2, 0, 1),
  lambda w, s: w.transpose(2, 3, 1, 0),
  lambda s: (s[3], s[2], s[0], s[1]),
)


def _contiguous(x: np.ndarray) -> np.ndarray:
  """C-contiguous copy if needed, keeping 0-d arrays 0-d (unlike np.ascontiguousarray)."""
  return np.asarray(x, order="C")


def _to_numpy(value: Any) -> np.ndarray:
  """torch tensor / array -> numpy; floating values as float32 (bf16/fp16 upcast)."""
  if hasattr(value, "detach"):  # torch.Tensor
    import torch

    value = value.detach().cpu()
    if value.is_floating_point() and value.dtype != torch.float32:
      value = value.float()
    value = value.numpy()
  value = np.asarray(value)
  if np.issubdtype(value.dtype, np.floating) and value.dtype != np.float32:
    value = value.astype(np.float32)
  return value


# ============================================================================================
# HF transformers OwlViTForObjectDetection (SPEC §1.2).
# ============================================================================================


def _hf_rows(cfg: owl_lib.ModelConfig) -> list[tuple[str, str, _Layout]]:
  """(our path, HF state-dict key, layout) for every parameter of ``cfg``'s module."""
  rows: list[tuple[str, str, _Layout]] = []

  def ln(ours, hf):
    rows.extend([(f"{ours}/scale", f"{hf}.weight", _SAME), (f"{ours}/bias", f"{hf}.bias", _SAME)])

  def dense(ours, hf, bias=True):
    rows.append((f"{ours}/kernel", f"{hf}.weight", _LINEAR))
    if bias:
      rows.append((f"{ours}/bias", f"{hf}.bias", _SAME))

  def blocks(ours, hf, n):
    for i in range(n):
      o, h = f"{ours}/resblocks_{i}", f"{hf}.layers.{i}"
      ln(f"{o}/ln_0", f"{h}.layer_norm1")
      ln(f"{o}/ln_1", f"{h}.layer_norm2")
      for ours_name, hf_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        rows.append((f"{o}/attn/{ours_name}/kernel", f"{h}.self_attn.{hf_name}.weight", _QKV))
        rows.append((f"{o}/attn/{ours_name}/bias", f"{h}.self_attn.{hf_name}.bias", _HEAD_BIAS))
      rows.append((f"{o}/attn/out/kernel", f"{h}.self_attn.out_proj.weight", _OUT))
      rows.append((f"{o}/attn/out/bias", f"{h}.self_attn.out_proj.bias", _SAME))
      dense(f"{o}/mlp/c_fc", f"{h}.mlp.fc1")
      dense(f"{o}/mlp/c_proj", f"{h}.mlp.fc2")

  rows.append(("backbone/clip/logit_scale", "owlvit.logit_scale", _SAME))
  t, ht = "backbone/clip/text", "owlvit.text_model"
  rows.append((f"{t}/token_embedding/embedding", f"{ht}.embeddings.token_embedding.weight", _SAME))
  rows.append((f"{t}/positional_embedding", f"{ht}.embeddings.position_embedding.weight", _SAME))
  blocks(f"{t}/transformer", f"{ht}.encoder", cfg.text_layers)
  ln(f"{t}/ln_final", f"{ht}.final_layer_norm")
  dense(f"{t}/text_projection", "owlvit.text_projection", bias=False)
  v, hv = "backbone/clip/visual", "owlvit.vision_model"
  rows.append((f"{v}/conv1/kernel", f"{hv}.embeddings.patch_embedding.weight", _CONV))
  rows.append((f"{v}/class_embedding", f"{hv}.embeddings.class_embedding", _SAME))
  rows.append((f"{v}/positional_embedding", f"{hv}.embeddings.position_embedding.weight", _SAME))
  ln(f"{v}/ln_pre", f"{hv}.pre_layernorm")
  blocks(f"{v}/transformer", f"{hv}.encoder", cfg.vision_layers)
  ln(f"{v}/ln_post", f"{hv}.post_layernorm")
  ln("backbone/merged_class_token", "layer_norm")
  dense("class_head/Dense_0", "class_head.dense0")
  dense("class_head/logit_shift", "class_head.logit_shift")
  dense("class_head/logit_scale", "class_head.logit_scale")
  for i in range(3):
    dense(f"obj_box_head/Dense_{i}", f"box_head.dense{i}")
  return rows


def _import_hf():
  try:
    import transformers
  except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"HF conversion needs transformers: {_HF_INSTALL}") from e
  return transformers


def _read_hf_config(config: Any, source: str) -> tuple[Any, str]:
  transformers = _import_hf()
  if isinstance(config, transformers.OwlViTConfig):
    return config, source
  if isinstance(config, (str, os.PathLike)):
    path = os.fspath(config)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no HF config at {path}")
    with open(path) as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    source = path
  if not isinstance(config, Mapping):
    raise TypeError(
      f"HF config must be an OwlViTConfig, a dict or a path, got {type(config).__name__}"
    )
  model_type = config.get("model_type", "owlvit")
  if model_type != "owlvit":
    raise ValueError(f"{source}: model_type={model_type!r}, expected 'owlvit' (OWL-ViT v1)")
  return transformers.OwlViTConfig.from_dict(dict(config)), source


def hf_config_to_model_config(
  config: Any,
  *,
  dtype: Any = jnp.float32,
  tokenizer: str = "clip",
  text_stochastic_depth: float = 0.1,
  vision_stochastic_depth: float = 0.2,
) -> owl_lib.ModelConfig:
  """Our ``ModelConfig`` (``hf_compat=True``) of an HF ``OwlViTConfig``.

  Maps: ``projection_dim -> embed_dim``; text ``vocab_size``, ``max_position_embeddings ->
  context_length``, ``hidden_size -> text_width``, ``num_hidden_layers``,
  ``num_attention_heads``, ``intermediate_size -> text_mlp_dim``; vision ``image_size``,
  ``patch_size``, ``hidden_size -> vision_width``, layers, heads, MLP width.

  Args:
    config: ``transformers.OwlViTConfig``, its ``dict`` (config.json) or a path (folder or
      config.json). dtype: compute dtype of the towers. tokenizer: tokenizer name stored in
      the config. text/vision_stochastic_depth: training-only rates (HF has none).

  Returns:
    ``ModelConfig`` with ``hf_compat=True`` (merged-LN eps 1e-5, exact-GELU box head,
    float32-min padded logits).

  Raises:
    ValueError: what our module cannot represent, naming the file, field and value:
      ``model_type`` not 'owlvit', ``hidden_act`` not 'quick_gelu', ``layer_norm_eps``
      not 1e-5, ``num_channels`` not 3, ``projection_dim`` != text ``hidden_size`` (HF's
      class head maps to the text width), image size not a multiple of the patch.
    ImportError: transformers missing.

  Source: SPEC §1.2; transformers ``OwlViTConfig``.
  """
  source = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "HF config"
  hf, source = _read_hf_config(config, source)
  text, vision = hf.text_config, hf.vision_config
  problems = []
  for tower, sub in (("text_config", text), ("vision_config", vision)):
    if sub.hidden_act != "quick_gelu":
      problems.append(f"{tower}.hidden_act={sub.hidden_act!r} (ours: 'quick_gelu')")
    if not math.isclose(sub.layer_norm_eps, clip_lib.LAYER_NORM_EPS, rel_tol=1e-6):
      problems.append(
        f"{tower}.layer_norm_eps={sub.layer_norm_eps} (ours: {clip_lib.LAYER_NORM_EPS})"
      )
  if getattr(vision, "num_channels", 3) != 3:
    problems.append(f"vision_config.num_channels={vision.num_channels} (ours: 3)")
  if hf.projection_dim != text.hidden_size:
    problems.append(
      f"projection_dim={hf.projection_dim} differs from text_config."
      f"hidden_size={text.hidden_size} (the class head maps to the text width)"
    )
  if vision.image_size % vision.patch_size:
    problems.append(
      f"vision_config.image_size={vision.image_size} is not a multiple of "
      f"patch_size={vision.patch_size}"
    )
  if problems:
    raise ValueError(f"{source}: unsupported OWL-ViT config: " + "; ".join(problems))
  return owl_lib.ModelConfig(
    tokenizer=tokenizer,
    vocab_size=text.vocab_size,
    context_length=text.max_position_embeddings,
    embed_dim=hf.projection_dim,
    image_size=vision.image_size,
    patch_size=vision.patch_size,
    vision_width=vision.hidden_size,
    vision_layers=vision.num_hidden_layers,
    vision_heads=vision.num_attention_heads,
    vision_mlp_dim=vision.intermediate_size,
    text_width=text.hidden_size,
    text_layers=text.num_hidden_layers,
    text_heads=text.num_attention_heads,
    text_mlp_dim=text.intermediate_size,
    text_stochastic_depth=text_stochastic_depth,
    vision_stochastic_depth=vision_stochastic_depth,
    hf_compat=True,
    dtype=dtype,
  )


def model_config_to_hf_config(config: owl_lib.ModelConfig) -> Any:
  """HF ``OwlViTConfig`` of our ``ModelConfig`` (inverse of
  :func:`hf_config_to_model_config` on the architecture fields).

  The HF model always computes as ``hf_compat=True`` (SPEC §0).

  Raises:
    ValueError: ``embed_dim != text_width`` (HF's class head maps to the text width).
    ImportError: transformers missing.

  Source: SPEC §1.2; transformers ``OwlViTConfig``.
  """
  transformers = _import_hf()
  if config.embed_dim != config.text_width:
    raise ValueError(
      f"HF OWL-ViT needs embed_dim == text_width, got embed_dim="
      f"{config.embed_dim}, text_width={config.text_width}"
    )
  text = dict(
    vocab_size=config.vocab_size,
    hidden_size=config.text_width,
    intermediate_size=config.text_mlp_dim,
    num_hidden_layers=config.text_layers,
    num_attention_heads=config.text_heads,
    max_position_embeddings=config.context_length,
    hidden_act="quick_gelu",
    layer_norm_eps=clip_lib.LAYER_NORM_EPS,
  )
  vision = dict(
    hidden_size=config.vision_width,
    intermediate_size=config.vision_mlp_dim,
    num_hidden_layers=config.vision_layers,
    num_attention_heads=config.vision_heads,
    num_channels=3,
    image_size=config.image_size,
    patch_size=config.patch_size,
    hidden_act="quick_gelu",
    layer_norm_eps=clip_lib.LAYER_NORM_EPS,
  )
  return transformers.OwlViTConfig(
    text_config=text, vision_config=vision, projection_dim=config.embed_dim
  )


def hf_state_dict_to_params(
  state_dict: Mapping[str, Any], config: owl_lib.ModelConfig, source: str = "HF state dict"
) -> dict[str, np.ndarray]:
  """Converts an ``OwlViTForObjectDetection`` state dict into our parameter tree.

  Per SPEC §1.2: Linear weight -> kernel = weight.T; q/k/v weight [H*dh, D] -> kernel
  [D, H, dh], bias [H*dh] -> [H, dh]; out_proj weight [D, H*dh] -> kernel [H, dh, D];
  patch conv OIHW -> HWIO; LayerNorm weight -> scale. ``owlvit.visual_projection`` and
  buffers (:data:`HF_IGNORED_KEYS`) are ignored.

  Args:
    state_dict: ``{name: torch.Tensor or np.ndarray}`` (float16/bfloat16 upcast to
      float32).
    config: our ``ModelConfig`` (e.g. :func:`hf_config_to_model_config`); gives the layer
      counts, heads and expected shapes.
    source: file or description quoted in errors.

  Returns:
    Nested ``dict`` of float32 ``np.ndarray`` matching ``abstract_params(config)``.

  Raises:
    CheckpointMismatchError: missing HF keys, unexpected keys, wrong shapes (HF names, our
      path in brackets, both shapes), all listed.

  Source: SPEC §1.2; transformers ``modeling_owlvit``.
  """
  like = _flat(abstract_params(config))
  rows = _hf_rows(config)
  assert {r[0] for r in rows} == set(like), "HF mapping table out of date"
  known = {r[1] for r in rows}
  missing, wrong, flat = [], [], {}
  for ours, key, layout in rows:
    if key not in state_dict:
      missing.append(f"{key} [{ours}]")
      continue
    value = _to_numpy(state_dict[key])
    expected = layout.torch_shape(tuple(like[ours].shape))
    if tuple(value.shape) != expected:
      wrong.append((f"{key} [{ours}]", tuple(value.shape), expected))
      continue
    flat[ours] = _contiguous(layout.from_torch(value, tuple(like[ours].shape)))
  unexpected = sorted(k for k in state_dict if k not in known and k not in HF_IGNORED_KEYS)
  if missing or unexpected or wrong:
    raise CheckpointMismatchError(
      source, missing, unexpected, wrong, what=" (HF OwlViTForObjectDetection names)"
    )
  return check_params(_unflat(flat), _unflat(like), source)


def load_hf_state_dict(path: str) -> dict[str, np.ndarray]:
  """Reads the weights of a saved HF model folder as numpy.

  Looks for, in order: ``model.safetensors``, ``model.safetensors.index.json`` (shards),
  ``pytorch_model.bin``, ``pytorch_model.bin.index.json``. ``.bin`` files need torch
  (loaded with ``weights_only=True``).

  Args:
    path: folder (or one weights file).

  Returns:
    ``{name: np.ndarray}``, floating values float32.

  Raises:
    FileNotFoundError: no weights file (the folder and the names tried are given).
    ValueError: an index json without ``weight_map``.

  Source: transformers ``save_pretrained`` layout.
  """
  path = os.path.abspath(path)

  def read(file):
    if file.endswith(".safetensors"):
      from safetensors.numpy import load_file

      return {k: _to_numpy(v) for k, v in load_file(file).items()}
    import torch

    return {
      k: _to_numpy(v) for k, v in torch.load(file, map_location="cpu", weights_only=True).items()
    }

  if os.path.isfile(path):
    return read(path)
  names = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
  )
  for name in names:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      continue
    if not name.endswith(".index.json"):
      return read(file)
    with open(file) as f:
      index = json.load(f)
    if "weight_map" not in index:
      raise ValueError(f"{file}: no 'weight_map' in the shard index")
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
      out.update(read(os.path.join(path, shard)))
    return out
  raise FileNotFoundError(f"no HF weights in {path} (looked for {', '.join(names)})")


def load_hf_checkpoint(
  path: str, *, dtype: Any = jnp.float32
) -> tuple[dict[str, np.ndarray], owl_lib.ModelConfig]:
  """Loads a saved HF ``OwlViTForObjectDetection`` folder (``save_pretrained`` output).

  Args:
    path: folder with ``config.json`` and weights (see :func:`load_hf_state_dict`).
    dtype: compute dtype put into the returned config.

  Returns:
    ``(params, config)``: our parameter tree (float32 numpy) and the ``ModelConfig``
    (``hf_compat=True``) to build the matching module with ``OwlViT(**config)``.

  Raises:
    FileNotFoundError, ValueError (see :func:`hf_config_to_model_config`),
    CheckpointMismatchError (listing paths, naming the folder).

  Source: SPEC §1.2.
  """
  path = os.path.abspath(path)
  config = hf_config_to_model_config(path, dtype=dtype)
  params = hf_state_dict_to_params(load_hf_state_dict(path), config, source=path)
  return params, config


def params_to_hf_state_dict(
  params: PyTree,
  config: owl_lib.ModelConfig | None = None,
  *,
  framework: str = "numpy",
  visual_projection: np.ndarray | None = None,
) -> dict[str, Any]:
  """Our parameters -> an ``OwlViTForObjectDetection`` state dict (inverse of
  :func:`hf_state_dict_to_params`; the round trip is bit-identical).

  Args:
    params: our tree. config: its ``ModelConfig`` (default :func:`infer_model_config`).
    framework: ``'numpy'`` (``np.ndarray``) or ``'torch'`` (``torch.Tensor``); float32,
      contiguous.
    visual_projection: ``owlvit.visual_projection.weight`` ``[E, D]`` (CLIP's image
      projection, which our tree lacks and the detector never uses); default zeros.

  Returns:
    ``{HF name: array}`` with every persistent entry of the HF model.

  Raises:
    CheckpointMismatchError: ``params`` do not match ``config``'s module.
    ValueError: unknown framework, wrong ``visual_projection`` shape.

  Source: SPEC §1.2.
  """
  if framework not in ("numpy", "torch"):
    raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
  config = infer_model_config(params) if config is None else config
  params = check_params(params, config, "the parameters to export")
  flat = _flat(params)
  out = {key: _contiguous(layout.to_torch(flat[ours])) for ours, key, layout in _hf_rows(config)}
  shape = (config.embed_dim, config.vision_width)
  if visual_projection is None:
    visual_projection = np.zeros(shape, np.float32)
  visual_projection = _to_numpy(visual_projection)
  if visual_projection.shape != shape:
    raise ValueError(f"visual_projection must be {shape}, got {visual_projection.shape}")
  out["owlvit.visual_projection.weight"] = _contiguous(visual_projection)
  if framework == "torch":
    import torch

    out = {k: torch.from_numpy(np.array(v)) for k, v in out.items()}
  return out


def _replace_dir(tmp: str, path: str, overwrite: bool) -> None:
  """Moves the finished folder ``tmp`` to ``path``. An existing ``path`` is replaced only
  with ``overwrite``: it is moved aside, the new folder moved in, then the old one deleted
  (moved back if the move in fails)."""
  if not os.path.exists(path):
    os.replace(tmp, path)
    return
  if not overwrite:
    raise FileExistsError(f"refusing to overwrite existing {path} (pass overwrite)")
  backup = tempfile.mkdtemp(
    prefix=".old-" + os.path.basename(path) + "-", dir=os.path.dirname(path)
  )
  os.rmdir(backup)
  os.replace(path, backup)
  try:
    os.replace(tmp, path)
  except BaseException:
    os.replace(backup, path)
    raise
  if os.path.isdir(backup):
    shutil.rmtree(backup)
  else:
    os.remove(backup)


def save_hf_checkpoint(
  params: PyTree,
  path: str,
  config: owl_lib.ModelConfig | None = None,
  *,
  overwrite: bool = False,
  visual_projection: np.ndarray | None = None,
) -> None:
  """Writes our parameters as a saved HF ``OwlViTForObjectDetection`` folder.

  ``config.json`` via ``OwlViTConfig.save_pretrained`` (:func:`model_config_to_hf_config`),
  weights as ``model.safetensors`` (float32). Loadable with
  ``OwlViTForObjectDetection.from_pretrained(path)``. Written to a temporary sibling folder
  and renamed when complete.

  Args:
    params: our tree. path: output folder. config: default :func:`infer_model_config`.
    overwrite: replace an existing ``path`` (only once the new folder is complete).
    visual_projection: see :func:`params_to_hf_state_dict`.

  Raises:
    FileExistsError: ``path`` exists and not ``overwrite``.
    CheckpointMismatchError, ValueError: see :func:`params_to_hf_state_dict`,
    :func:`model_config_to_hf_config`.

  Source: SPEC §1.2; transformers ``save_pretrained`` layout.
  """
  from safetensors.numpy import save_file

  path = os.path.abspath(path)
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"refusing to overwrite existing {path} (pass overwrite)")
  config = infer_model_config(params) if config is None else config
  hf_config = model_config_to_hf_config(config)
  state = params_to_hf_state_dict(params, config, visual_projection=visual_projection)
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=parent)
  try:
    hf_config.save_pretrained(tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _replace_dir(tmp, path, overwrite)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


# ============================================================================================
# OpenAI CLIP TorchScript files (SPEC §2, CLIP init).
# ============================================================================================


def _resize_vision_posemb(posemb: np.ndarray, rows: int, source: str) -> np.ndarray:
  """``[1 + g0^2, D]`` -> ``[rows, D]``: the CLS row kept, the g0 x g0 grid zoomed to
  g1 x g1 with ``scipy.ndimage.zoom(order=1)`` (scenic ``utils.resize_posemb``)."""
  if posemb.shape[0] == rows:
    return posemb
  g0, g1 = math.isqrt(posemb.shape[0] - 1), math.isqrt(rows - 1)
  if g0 * g0 != posemb.shape[0] - 1 or g1 * g1 != rows - 1:
    raise ValueError(
      f"{source}: cannot resize a vision positional embedding of "
      f"{posemb.shape[0]} rows to {rows} rows (grids must be square)"
    )
  grid = posemb[1:].reshape(g0, g0, -1)
  grid = scipy.ndimage.zoom(grid, (g1 / g0, g1 / g0, 1), order=1)
  return np.concatenate([posemb[:1], grid.reshape(g1 * g1, -1)], axis=0).astype(posemb.dtype)


def _clip_rows(prefix_torch: str, prefix_ours: str, layers: int) -> list[tuple[str, str, _Layout]]:
  rows = []
  for i in range(layers):
    t, o = f"{prefix_torch}.resblocks.{i}", f"{prefix_ours}/resblocks_{i}"
    for torch_ln, our_ln in (("ln_1", "ln_0"), ("ln_2", "ln_1")):
      rows += [
        (f"{o}/{our_ln}/scale", f"{t}.{torch_ln}.weight", _SAME),
        (f"{o}/{our_ln}/bias", f"{t}.{torch_ln}.bias", _SAME),
      ]
    rows += [
      (f"{o}/attn/out/kernel", f"{t}.attn.out_proj.weight", _OUT),
      (f"{o}/attn/out/bias", f"{t}.attn.out_proj.bias", _SAME),
    ]
    for name in ("c_fc", "c_proj"):
      rows += [
        (f"{o}/mlp/{name}/kernel", f"{t}.mlp.{name}.weight", _LINEAR),
        (f"{o}/mlp/{name}/bias", f"{t}.mlp.{name}.bias", _SAME),
      ]
  return rows


def load_clip_torchscript(
  path_or_state_dict: str | Mapping[str, Any], init_params: PyTree, source: str | None = None
) -> dict[str, np.ndarray]:
  """Initialises both CLIP towers from an OpenAI CLIP (ViT) checkpoint.

  OpenAI names -> ours: ``visual.conv1.weight`` (OIHW -> HWIO), ``visual.class_embedding``,
  ``visual.positional_embedding`` (grid resized to the model's with scipy zoom order 1, CLS
  row kept), ``visual.ln_pre``/``ln_post``, ``[visual.]transformer.resblocks.N.{ln_1 -> ln_0,
  ln_2 -> ln_1, attn.in_proj_weight/bias -> attn/{query,key,value} (split in three, kernel
  [D, H, dh] with H from ``init_params``), attn.out_proj -> attn/out, mlp.c_fc, mlp.c_proj}``,
  ``token_embedding.weight``, ``positional_embedding`` (truncated 77 -> the model's context
  length), ``ln_final``, ``text_projection`` ([Dt, E], used as ``x @ W``: the kernel as is),
  ``logit_scale``. ``visual.proj`` and the integer attributes are ignored
  (:data:`CLIP_IGNORED_KEYS`). ``backbone/merged_class_token``, ``class_head`` and
  ``obj_box_head`` are taken from ``init_params`` (fresh). fp16 weights become float32.

  Args:
    path_or_state_dict: a TorchScript file (``torch.jit.load(path, map_location='cpu')
      .state_dict()``; a plain ``torch.save`` state dict also works) or a state dict
      (torch tensors or numpy).
    init_params: a freshly initialised parameter tree of the target module: the leaves
      outside ``backbone/clip`` (heads, merged LN) are copied from it; those inside only
      give shapes (arrays or ``jax.ShapeDtypeStruct``, see :func:`fresh_head_params`).
    source: name for errors (default: the path).

  Returns:
    Nested ``dict`` of float32 ``np.ndarray`` with ``init_params``' paths and shapes.

  Raises:
    CheckpointMismatchError: missing/unexpected CLIP entries, or shapes that differ from the
      module's (all listed, file named). ValueError: a non-square vision grid.
    ImportError: torch missing (for a path).

  Source: SPEC §2; scenic `scenic/projects/owl_vit/clip/model.py` (``_convert_vars``),
  `scenic/projects/owl_vit/layers.py` (``ClipImageTextEmbedder.load_backbone``),
  openai/CLIP `clip/model.py`.
  """
  if isinstance(path_or_state_dict, (str, os.PathLike)):
    path = os.path.abspath(os.fspath(path_or_state_dict))
    source = source or path
    if not os.path.isfile(path):
      raise FileNotFoundError(f"CLIP checkpoint {path} does not exist")
    import torch

    try:
      state = torch.jit.load(path, map_location="cpu").state_dict()
    except RuntimeError:
      state = torch.load(path, map_location="cpu", weights_only=True)
      if hasattr(state, "state_dict"):
        state = state.state_dict()
  else:
    state = path_or_state_dict
    source = source or "CLIP state dict"
  state = {k: v for k, v in state.items()}
  init = _flat(init_params)
  like = {k: tuple(v.shape) for k, v in init.items()}
  cv, ct = "backbone/clip/visual", "backbone/clip/text"

  def layers(prefix):
    return len(
      {
        int(m.group(1))
        for k in like
        for m in [re.match(re.escape(prefix) + r"/transformer/resblocks_(\d+)/", k)]
        if m
      }
    )

  rows = [
    ("backbone/clip/logit_scale", "logit_scale", _SAME),
    (f"{cv}/conv1/kernel", "visual.conv1.weight", _CONV),
    (f"{cv}/class_embedding", "visual.class_embedding", _SAME),
    (f"{ct}/token_embedding/embedding", "token_embedding.weight", _SAME),
    (f"{ct}/text_projection/kernel", "text_projection", _SAME),
  ]
  for ours, torch_name in (
    (f"{cv}/ln_pre", "visual.ln_pre"),
    (f"{cv}/ln_post", "visual.ln_post"),
    (f"{ct}/ln_final", "ln_final"),
  ):
    rows += [
      (f"{ours}/scale", f"{torch_name}.weight", _SAME),
      (f"{ours}/bias", f"{torch_name}.bias", _SAME),
    ]
  rows += _clip_rows("visual.transformer", f"{cv}/transformer", layers(cv))
  rows += _clip_rows("transformer", f"{ct}/transformer", layers(ct))

  missing, wrong, out = [], [], {}
  for ours, key, layout in rows:
    if key not in state:
      missing.append(f"{key} [{ours}]")
      continue
    value = _to_numpy(state[key])
    expected = layout.torch_shape(like[ours])
    if tuple(value.shape) != expected:
      wrong.append((f"{key} [{ours}]", tuple(value.shape), expected))
      continue
    out[ours] = layout.from_torch(value, like[ours])

  # Fused q/k/v projections.
  known = {r[1] for r in rows}
  for prefix_torch, prefix_ours in (("visual.transformer", cv), ("transformer", ct)):
    for i in range(layers(prefix_ours)):
      t, o = f"{prefix_torch}.resblocks.{i}.attn", f"{prefix_ours}/transformer/resblocks_{i}/attn"
      known |= {f"{t}.in_proj_weight", f"{t}.in_proj_bias"}
      q_shape = like[f"{o}/query/kernel"]
      width = q_shape[0]
      for name, shape in (
        (f"{t}.in_proj_weight", (3 * width, width)),
        (f"{t}.in_proj_bias", (3 * width,)),
      ):
        if name not in state:
          missing.append(f"{name} [{o}/{{query,key,value}}]")
        elif tuple(np.shape(state[name])) != shape:
          wrong.append((f"{name} [{o}/{{query,key,value}}]", tuple(np.shape(state[name])), shape))
      if f"{t}.in_proj_weight" not in state or f"{t}.in_proj_bias" not in state:
        continue
      weight = _to_numpy(state[f"{t}.in_proj_weight"])
      bias = _to_numpy(state[f"{t}.in_proj_bias"])
      if weight.shape != (3 * width, width) or bias.shape != (3 * width,):
        continue
      for j, name in enumerate(("query", "key", "value")):
        out[f"{o}/{name}/kernel"] = _QKV.from_torch(
          weight[j * width : (j + 1) * width], like[f"{o}/{name}/kernel"]
        )
        out[f"{o}/{name}/bias"] = _HEAD_BIAS.from_torch(
          bias[j * width : (j + 1) * width], like[f"{o}/{name}/bias"]
        )

  # Positional embeddings: vision grid resized, text truncated.
  for ours, key in (
    (f"{cv}/positional_embedding", "visual.positional_embedding"),
    (f"{ct}/positional_embedding", "positional_embedding"),
  ):
    known.add(key)
    if key not in state:
      missing.append(f"{key} [{ours}]")
      continue
    value = _to_numpy(state[key])
    rows_needed, width = like[ours]
    if value.ndim != 2 or value.shape[1] != width:
      wrong.append((f"{key} [{ours}]", tuple(value.shape), (value.shape[0], width)))
      continue
    if key == "positional_embedding":
      if value.shape[0] < rows_needed:
        wrong.append((f"{key} [{ours}]", tuple(value.shape), like[ours]))
        continue
      out[ours] = value[:rows_needed]
    else:
      out[ours] = _resize_vision_posemb(value, rows_needed, source)

  unexpected = sorted(k for k in state if k not in known and k not in CLIP_IGNORED_KEYS)
  if missing or unexpected or wrong:
    raise CheckpointMismatchError(source, missing, unexpected, wrong, what=" (OpenAI CLIP names)")
  for k in init:
    if not k.startswith("backbone/clip/"):
      out[k] = np.asarray(init[k])
  return check_params(_unflat(out), _unflat(init), source)


def fresh_head_params(config: owl_lib.ModelConfig, key: jax.Array) -> dict[str, np.ndarray]:
  """Freshly initialised parameters of everything outside the CLIP towers.

  Initialises only ``backbone/merged_class_token``, ``class_head`` and ``obj_box_head``
  (scenic's initialisers: zero box-head output kernel, logit-shift prior bias -4.59512,
  unit LayerNorm), without the cost of initialising the towers.

  Args:
    config: the module's ``ModelConfig``. key: PRNG key.

  Returns:
    Nested ``dict`` of float32 ``np.ndarray`` with exactly those subtrees (the other
    paths of :func:`abstract_params` absent).

  Source: SPEC §2 (CLIP init: heads and merged LN stay fresh).
  """
  model = owl_lib.OwlViT(**dict(config))
  feats = jnp.zeros((1, config.num_tokens, config.vision_width), jnp.float32)
  query = jnp.zeros((1, 1, config.embed_dim), jnp.float32)

  def heads(module, feats, query):
    # Setup-defined submodules create their parameters when first called.
    module._embedder.merged_class_token(feats)
    module.class_predictor(feats, query)
    return module._box_head(feats)

  variables = jax.jit(lambda k: model.init(k, feats, query, method=heads))(key)
  return jax.tree.map(np.asarray, flax.core.unfreeze(variables)["params"])


# ============================================================================================
# Command line.
# ============================================================================================


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  out = {}
  for item in items or ():
    if "=" not in item:
      raise SystemExit(f"--override expects name=value, got {item!r}")
    name, value = item.split("=", 1)
    try:
      out[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[name] = value
  if "dtype" in out:
    out["dtype"] = _dtype(out["dtype"])
  return out


def _config_from_args(args) -> owl_lib.ModelConfig:
  overrides = _parse_overrides(args.override)
  return owl_lib.create_model(args.variant, **overrides).config


def _write_ours(path: str, params: PyTree, meta: dict, overwrite: bool) -> None:
  """``checkpointing.save_params`` (atomic); an existing output is replaced only with
  ``overwrite`` and only after the new one is complete."""
  from owl_cl.train import checkpointing

  path = os.path.abspath(path)
  if not os.path.exists(path):
    checkpointing.save_params(path, params, meta)
    return
  if not overwrite:
    raise FileExistsError(f"refusing to overwrite existing {path} (pass --overwrite)")
  parent = os.path.dirname(path)
  staging = tempfile.mkdtemp(prefix=".new-" + os.path.basename(path) + "-", dir=parent)
  try:
    checkpointing.save_params(os.path.join(staging, "out"), params, meta)
    _replace_dir(os.path.join(staging, "out"), path, overwrite=True)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def _meta(source: str, fmt: str, config: owl_lib.ModelConfig) -> dict:
  return {
    "converted_from": os.path.abspath(source),
    "source_format": fmt,
    "model_config": model_config_to_dict(config),
    "converter": "owl_cl.model.checkpoints",
  }


def _cmd_scenic(args) -> None:
  config = _config_from_args(args)
  params = load_scenic_checkpoint(args.input, config)
  _write_ours(args.output, params, _meta(args.input, "scenic", config), args.overwrite)


def _cmd_hf_to_ours(args) -> None:
  params, config = load_hf_checkpoint(args.input)
  _write_ours(args.output, params, _meta(args.input, "hf", config), args.overwrite)


def _cmd_ours_to_hf(args) -> None:
  from owl_cl.train import checkpointing

  params, meta = checkpointing.load_params(args.input)
  if args.variant:
    config = _config_from_args(args)
  elif "model_config" in meta:
    config = model_config_from_dict(meta["model_config"])
  else:
    config = infer_model_config(params)
  save_hf_checkpoint(params, args.output, config, overwrite=args.overwrite)


def _cmd_clip(args) -> None:
  config = _config_from_args(args)
  like = _flat(abstract_params(config))
  fresh = _flat(fresh_head_params(config, jax.random.key(args.seed)))
  init = {k: fresh.get(k, v) for k, v in like.items()}
  params = load_clip_torchscript(args.input, _unflat(init))
  meta = _meta(args.input, "openai_clip", config)
  meta["init_seed"] = args.seed
  _write_ours(args.output, params, meta, args.overwrite)


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line converter; see the README section "Checkpoints" and ``--help``."""
  parser = argparse.ArgumentParser(
    prog="python -m owl_cl.model.checkpoints",
    description="Convert OWL-ViT checkpoints to and from owl_cl's parameter format.",
  )
  sub = parser.add_subparsers(dest="command", required=True)

  def model_args(p, required):
    p.add_argument(
      "--variant", required=required, help=f"model variant, one of {sorted(owl_lib.VARIANTS)}"
    )
    p.add_argument(
      "--override",
      action="append",
      default=[],
      metavar="NAME=VALUE",
      help="ModelConfig field override, e.g. image_size=768 (repeatable)",
    )

  p = sub.add_parser("scenic-to-owl_cl", help="scenic msgpack checkpoint -> owl_cl")
  p.add_argument("input", help="msgpack file or folder of checkpoint_<step> files")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  model_args(p, required=True)
  p.set_defaults(fn=_cmd_scenic)

  p = sub.add_parser("hf-to-owl_cl", help="saved HF OwlViTForObjectDetection folder -> owl_cl")
  p.add_argument("input", help="folder with config.json and weights")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  p.set_defaults(fn=_cmd_hf_to_ours)

  p = sub.add_parser("owl_cl-to-hf", help="owl_cl checkpoint -> saved HF folder")
  p.add_argument("input", help="owl_cl checkpoint folder (save_params layout)")
  p.add_argument("output", help="HF folder to write")
  model_args(p, required=False)
  p.set_defaults(fn=_cmd_ours_to_hf)

  p = sub.add_parser("clip-to-owl_cl", help="OpenAI CLIP TorchScript file -> owl_cl init")
  p.add_argument("input", help="e.g. ViT-L-14.pt")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  model_args(p, required=True)
  p.add_argument("--seed", type=int, default=0, help="PRNG seed of the fresh heads")
  p.set_defaults(fn=_cmd_clip)

  for p in sub.choices.values():
    p.add_argument(
      "--overwrite",
      action="store_true",
      help="replace an existing output (after the new one is complete)",
    )
  args = parser.parse_args(argv)
  try:
    args.fn(args)
  except (FileExistsError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from e
  print(f"wrote {os.path.abspath(args.output)}")


if __name__ == "__main__":
  main()

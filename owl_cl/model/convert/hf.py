"""HF transformers ``OwlViTForObjectDetection`` and ``Owlv2ForObjectDetection``, in both
directions (docs/reference.md §1.2, docs/owlv2.md).

OWLv2's state dict is v1's with the prefix ``owlv2.`` for ``owlvit.`` and the extra
``objectness_head.dense{0,1,2}``; its config has ``model_type='owlv2'``. A config's
``version`` ('v1' | 'owlv2') picks the HF class.

In: :func:`load_hf_checkpoint` (a ``save_pretrained`` folder), :func:`hf_state_dict_to_params`,
:func:`hf_config_to_model_config`. Out: :func:`params_to_hf_state_dict`,
:func:`save_hf_checkpoint`, :func:`model_config_to_hf_config`. The round trip is bit-identical.

torch, transformers and safetensors (the ``hf`` extra) are imported only by the functions that
need them, so the rest of owl_cl runs without them.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from owl_cl import utils
from owl_cl.model import clip as clip_lib
from owl_cl.model import owl_vit as owl_lib
from owl_cl.model.convert import layouts
from owl_cl.model.convert import tree

# HF state-dict entries without a counterpart in our tree, ignored on import: CLIP's image
# projection (the detector never uses it, docs/reference.md §1.2) and buffers that older
# transformers versions saved.
HF_IGNORED_KEYS = tuple(
  f"{prefix}.{key}"
  for prefix in ("owlvit", "owlv2")
  for key in (
    "visual_projection.weight",
    "text_model.embeddings.position_ids",
    "vision_model.embeddings.position_ids",
  )
) + ("box_bias",)
# HF's model_type (config.json) and state-dict prefix of each of our versions.
_HF_MODEL_TYPE = {"v1": "owlvit", "owlv2": "owlv2"}
_HF_INSTALL = "pip install 'owl_cl[hf]'"


def _hf_rows(cfg: owl_lib.ModelConfig) -> list[tuple[str, str, layouts.Layout]]:
  """(our path, HF state-dict key, layout) for every parameter of ``cfg``'s module."""
  rows: list[tuple[str, str, layouts.Layout]] = []
  top = _HF_MODEL_TYPE[cfg.version]  # 'owlvit' or 'owlv2'

  def ln(ours, hf):
    rows.extend(
      [
        (f"{ours}/scale", f"{hf}.weight", layouts.SAME),
        (f"{ours}/bias", f"{hf}.bias", layouts.SAME),
      ]
    )

  def dense(ours, hf, bias=True):
    rows.append((f"{ours}/kernel", f"{hf}.weight", layouts.LINEAR))
    if bias:
      rows.append((f"{ours}/bias", f"{hf}.bias", layouts.SAME))

  def blocks(ours, hf, n):
    for i in range(n):
      o, h = f"{ours}/resblocks_{i}", f"{hf}.layers.{i}"
      ln(f"{o}/ln_0", f"{h}.layer_norm1")
      ln(f"{o}/ln_1", f"{h}.layer_norm2")
      for ours_name, hf_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        rows.append(
          (f"{o}/attn/{ours_name}/kernel", f"{h}.self_attn.{hf_name}.weight", layouts.QKV)
        )
        rows.append(
          (f"{o}/attn/{ours_name}/bias", f"{h}.self_attn.{hf_name}.bias", layouts.HEAD_BIAS)
        )
      rows.append((f"{o}/attn/out/kernel", f"{h}.self_attn.out_proj.weight", layouts.OUT))
      rows.append((f"{o}/attn/out/bias", f"{h}.self_attn.out_proj.bias", layouts.SAME))
      dense(f"{o}/mlp/c_fc", f"{h}.mlp.fc1")
      dense(f"{o}/mlp/c_proj", f"{h}.mlp.fc2")

  rows.append(("backbone/clip/logit_scale", f"{top}.logit_scale", layouts.SAME))
  t, ht = "backbone/clip/text", f"{top}.text_model"
  rows.append(
    (f"{t}/token_embedding/embedding", f"{ht}.embeddings.token_embedding.weight", layouts.SAME)
  )
  rows.append(
    (f"{t}/positional_embedding", f"{ht}.embeddings.position_embedding.weight", layouts.SAME)
  )
  blocks(f"{t}/transformer", f"{ht}.encoder", cfg.text_layers)
  ln(f"{t}/ln_final", f"{ht}.final_layer_norm")
  dense(f"{t}/text_projection", f"{top}.text_projection", bias=False)
  v, hv = "backbone/clip/visual", f"{top}.vision_model"
  rows.append((f"{v}/conv1/kernel", f"{hv}.embeddings.patch_embedding.weight", layouts.CONV))
  rows.append((f"{v}/class_embedding", f"{hv}.embeddings.class_embedding", layouts.SAME))
  rows.append(
    (f"{v}/positional_embedding", f"{hv}.embeddings.position_embedding.weight", layouts.SAME)
  )
  ln(f"{v}/ln_pre", f"{hv}.pre_layernorm")
  blocks(f"{v}/transformer", f"{hv}.encoder", cfg.vision_layers)
  ln(f"{v}/ln_post", f"{hv}.post_layernorm")
  ln("backbone/merged_class_token", "layer_norm")
  dense("class_head/Dense_0", "class_head.dense0")
  dense("class_head/logit_shift", "class_head.logit_shift")
  dense("class_head/logit_scale", "class_head.logit_scale")
  for i in range(3):
    dense(f"obj_box_head/Dense_{i}", f"box_head.dense{i}")
  if cfg.version == "owlv2":
    for i in range(3):
      dense(f"objectness_head/Dense_{i}", f"objectness_head.dense{i}")
  return rows


def _import_hf():
  try:
    import transformers
  except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"HF conversion needs transformers: {_HF_INSTALL}") from e
  return transformers


def _read_hf_config(config: Any, source: str) -> tuple[Any, str]:
  transformers = _import_hf()
  if isinstance(config, (transformers.OwlViTConfig, transformers.Owlv2Config)):
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
      "HF config must be an OwlViTConfig, an Owlv2Config, a dict or a path, got "
      f"{type(config).__name__}"
    )
  model_type = config.get("model_type", "owlvit")
  if model_type == "owlv2":
    return transformers.Owlv2Config.from_dict(dict(config)), source
  if model_type != "owlvit":
    raise ValueError(
      f"{source}: model_type={model_type!r}, expected 'owlvit' (OWL-ViT v1) or 'owlv2' (OWLv2)"
    )
  return transformers.OwlViTConfig.from_dict(dict(config)), source


def hf_config_to_model_config(
  config: Any,
  *,
  dtype: Any = jnp.float32,
  tokenizer: str = "clip",
  text_stochastic_depth: float = 0.1,
  vision_stochastic_depth: float = 0.2,
) -> owl_lib.ModelConfig:
  """Our ``ModelConfig`` (``hf_compat=True``) of an HF ``OwlViTConfig`` or ``Owlv2Config``
  (then ``version='owlv2'``).

  Maps: ``projection_dim -> embed_dim``; text ``vocab_size``, ``max_position_embeddings ->
  context_length``, ``hidden_size -> text_width``, ``num_hidden_layers``,
  ``num_attention_heads``, ``intermediate_size -> text_mlp_dim``; vision ``image_size``,
  ``patch_size``, ``hidden_size -> vision_width``, layers, heads, MLP width.

  Args:
    config: ``transformers.OwlViTConfig`` / ``Owlv2Config``, its ``dict`` (config.json) or a
      path (folder or config.json). dtype: compute dtype of the towers. tokenizer: tokenizer
      name stored in the config. text/vision_stochastic_depth: training-only rates (HF has none).

  Returns:
    ``ModelConfig`` with ``hf_compat=True`` (merged-LN eps 1e-5, exact-GELU box head,
    float32-min padded logits).

  Raises:
    ValueError: what our module cannot represent, naming the file, field and value:
      ``model_type`` not 'owlvit' or 'owlv2', ``hidden_act`` not 'quick_gelu', ``layer_norm_eps``
      not 1e-5, ``num_channels`` not 3, ``projection_dim`` != text ``hidden_size``, image
      size not a multiple of the patch.
    ImportError: transformers missing.

  Source: docs/reference.md §1.2; transformers ``OwlViTConfig``.
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
  # HF's class head projects the image tokens to the text width, not to projection_dim; our
  # class head projects to embed_dim, so the two must agree for the weights to mean the same.
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
    version="owlv2" if hf.model_type == "owlv2" else "v1",
  )


def special_token_ids(config: owl_lib.ModelConfig) -> dict[str, int]:
  """The text config's special token ids of our tokenizers for ``config``'s vocabulary.

  Both tokenizers put the start of text at ``vocab_size - 2``, the end of text at
  ``vocab_size - 1`` (the largest id: the text tower pools at ``argmax(token id)``) and pad
  with 0: ``WordHashTokenizer`` by construction, the CLIP BPE's released vocabulary as 49406,
  49407 of 49,408 (HF's ``OwlViTTextConfig`` defaults, right for that vocabulary only).

  Returns:
    ``{'bos_token_id', 'eos_token_id', 'pad_token_id'}``, each an ``int`` in
    ``[0, vocab_size)``.

  Source: docs/reference.md §2 (tokenizer layout); ``owl_cl.model.tokenizer``.
  """
  return {
    "bos_token_id": config.vocab_size - 2,
    "eos_token_id": config.vocab_size - 1,
    "pad_token_id": 0,
  }


def model_config_to_hf_config(config: owl_lib.ModelConfig) -> Any:
  """HF ``OwlViTConfig`` (``Owlv2Config`` for ``version='owlv2'``) of our ``ModelConfig``
  (inverse of :func:`hf_config_to_model_config` on the architecture fields), with the
  tokenizer's special token ids (:func:`special_token_ids`): HF's defaults, 49406 and 49407,
  lie outside a smaller vocabulary (the ``tiny`` variants' 8192) and HF warns on load.

  The HF model always computes as ``hf_compat=True`` (docs/reference.md §0).

  Raises:
    ValueError: ``embed_dim != text_width``.
    ImportError: transformers missing.

  Source: docs/reference.md §1.2; transformers ``OwlViTConfig``.
  """
  transformers = _import_hf()
  # HF's class head maps to the text width (see hf_config_to_model_config).
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
    **special_token_ids(config),
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
  cls = transformers.Owlv2Config if config.version == "owlv2" else transformers.OwlViTConfig
  return cls(text_config=text, vision_config=vision, projection_dim=config.embed_dim)


def hf_state_dict_to_params(
  state_dict: Mapping[str, Any], config: owl_lib.ModelConfig, source: str = "HF state dict"
) -> dict[str, np.ndarray]:
  """Converts an ``OwlViTForObjectDetection`` (or, with ``config.version='owlv2'``,
  ``Owlv2ForObjectDetection``) state dict into our parameter tree.

  Per docs/reference.md §1.2: Linear weight -> kernel = weight.T; q/k/v weight [H*dh, D] -> kernel
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
    Nested ``dict`` of float32 ``np.ndarray`` matching ``tree.abstract_params(config)``.

  Raises:
    CheckpointMismatchError: missing HF keys, unexpected keys, wrong shapes (HF names, our
      path in brackets, both shapes), all listed.

  Source: docs/reference.md §1.2; transformers ``modeling_owlvit``.
  """
  like = tree.flatten(tree.abstract_params(config))
  rows = _hf_rows(config)
  assert {r[0] for r in rows} == set(like), "HF mapping table out of date"
  known = {r[1] for r in rows}
  missing, wrong, flat = [], [], {}
  for ours, key, layout in rows:
    if key not in state_dict:
      missing.append(f"{key} [{ours}]")
      continue
    value = layouts.to_numpy(state_dict[key])
    expected = layout.torch_shape(tuple(like[ours].shape))
    if tuple(value.shape) != expected:
      wrong.append((f"{key} [{ours}]", tuple(value.shape), expected))
      continue
    flat[ours] = layouts.contiguous(layout.from_torch(value, tuple(like[ours].shape)))
  unexpected = sorted(k for k in state_dict if k not in known and k not in HF_IGNORED_KEYS)
  if missing or unexpected or wrong:
    raise tree.CheckpointMismatchError(
      source,
      missing,
      unexpected,
      wrong,
      what=f" (HF {_hf_class_name(config)}ForObjectDetection names)",
    )
  return tree.check_params(tree.unflatten(flat), tree.unflatten(like), source)


def _hf_class_name(config: owl_lib.ModelConfig) -> str:
  return "Owlv2" if config.version == "owlv2" else "OwlViT"


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

      return {k: layouts.to_numpy(v) for k, v in load_file(file).items()}
    import torch

    return {
      k: layouts.to_numpy(v)
      for k, v in torch.load(file, map_location="cpu", weights_only=True).items()
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
    FileNotFoundError: see :func:`hf_config_to_model_config`.
    ValueError: see :func:`hf_config_to_model_config`.
    CheckpointMismatchError: parameters missing, unexpected or wrongly shaped (listing their
      paths, naming the folder).

  Source: docs/reference.md §1.2.
  """
  path = os.path.abspath(path)
  config = hf_config_to_model_config(path, dtype=dtype)
  params = hf_state_dict_to_params(load_hf_state_dict(path), config, source=path)
  return params, config


def params_to_hf_state_dict(
  params: tree.PyTree,
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
    visual_projection: ``owlvit.visual_projection.weight`` (``owlv2.`` for OWLv2) ``[E, D]``
      (CLIP's image projection, which our tree lacks and the detector never uses); default zeros.

  Returns:
    ``{HF name: array}`` with every persistent entry of the HF model.

  Raises:
    CheckpointMismatchError: ``params`` do not match ``config``'s module.
    ValueError: unknown framework, wrong ``visual_projection`` shape.

  Source: docs/reference.md §1.2.
  """
  if framework not in ("numpy", "torch"):
    raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
  config = tree.infer_model_config(params) if config is None else config
  params = tree.check_params(params, config, "the parameters to export")
  flat = tree.flatten(params)
  out = {
    key: layouts.contiguous(layout.to_torch(flat[ours])) for ours, key, layout in _hf_rows(config)
  }
  shape = (config.embed_dim, config.vision_width)
  if visual_projection is None:
    visual_projection = np.zeros(shape, np.float32)
  visual_projection = layouts.to_numpy(visual_projection)
  if visual_projection.shape != shape:
    raise ValueError(f"visual_projection must be {shape}, got {visual_projection.shape}")
  out[f"{_HF_MODEL_TYPE[config.version]}.visual_projection.weight"] = layouts.contiguous(
    visual_projection
  )
  if framework == "torch":
    import torch

    out = {k: torch.from_numpy(np.array(v)) for k, v in out.items()}
  return out


def save_hf_checkpoint(
  params: tree.PyTree,
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

  Source: docs/reference.md §1.2; transformers ``save_pretrained`` layout.
  """
  from safetensors.numpy import save_file

  path = os.path.abspath(path)
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"refusing to overwrite existing {path} (pass overwrite)")
  config = tree.infer_model_config(params) if config is None else config
  hf_config = model_config_to_hf_config(config)
  state = params_to_hf_state_dict(params, config, visual_projection=visual_projection)
  with utils.atomic_directory(path, if_exists="replace" if overwrite else "error") as tmp:
    hf_config.save_pretrained(tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

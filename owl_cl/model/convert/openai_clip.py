"""OpenAI CLIP checkpoints (``ViT-L-14.pt``) as the initialisation of both towers.

Training OWL-ViT from CLIP (docs/reference.md §2, "CLIP init"): the image and text towers come
from the CLIP file, the vision positional grid resized to the model's, the text positional
embedding truncated to its 16 tokens; the heads and the merged-class-token LayerNorm come from
a fresh initialisation (:func:`fresh_head_params`).
Source: scenic `scenic/projects/owl_vit/clip/model.py`, openai/CLIP `clip/model.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
import os
import re
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.model import owl_vit as owl_lib
from owl_cl.model.convert import layouts
from owl_cl.model.convert import tree

# OpenAI CLIP state-dict entries without a counterpart: the image projection and the integer
# attributes TorchScript files carry.
CLIP_IGNORED_KEYS = ("visual.proj", "input_resolution", "context_length", "vocab_size")


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
  # Imported here: scipy.ndimage takes about 0.2 s to import, which every process of a run
  # paid at start-up although only converting a CLIP file of another resolution uses it.
  import scipy.ndimage  # noqa: PLC0415

  grid = posemb[1:].reshape(g0, g0, -1)
  grid = scipy.ndimage.zoom(grid, (g1 / g0, g1 / g0, 1), order=1)
  return np.concatenate([posemb[:1], grid.reshape(g1 * g1, -1)], axis=0).astype(posemb.dtype)


def _clip_rows(
  prefix_torch: str, prefix_ours: str, layers: int
) -> list[tuple[str, str, layouts.Layout]]:
  rows = []
  for i in range(layers):
    t, o = f"{prefix_torch}.resblocks.{i}", f"{prefix_ours}/resblocks_{i}"
    for torch_ln, our_ln in (("ln_1", "ln_0"), ("ln_2", "ln_1")):
      rows += [
        (f"{o}/{our_ln}/scale", f"{t}.{torch_ln}.weight", layouts.SAME),
        (f"{o}/{our_ln}/bias", f"{t}.{torch_ln}.bias", layouts.SAME),
      ]
    rows += [
      (f"{o}/attn/out/kernel", f"{t}.attn.out_proj.weight", layouts.OUT),
      (f"{o}/attn/out/bias", f"{t}.attn.out_proj.bias", layouts.SAME),
    ]
    for name in ("c_fc", "c_proj"):
      rows += [
        (f"{o}/mlp/{name}/kernel", f"{t}.mlp.{name}.weight", layouts.LINEAR),
        (f"{o}/mlp/{name}/bias", f"{t}.mlp.{name}.bias", layouts.SAME),
      ]
  return rows


def load_clip_torchscript(
  path_or_state_dict: str | Mapping[str, Any], init_params: tree.PyTree, source: str | None = None
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

  Source: docs/reference.md §2; scenic `scenic/projects/owl_vit/clip/model.py` (``_convert_vars``),
  `scenic/projects/owl_vit/layers.py` (``ClipImageTextEmbedder.load_backbone``),
  openai/CLIP `clip/model.py`.
  """
  state, source = _read_state_dict(path_or_state_dict, source)
  init = tree.flatten(init_params)
  like = {k: tuple(v.shape) for k, v in init.items()}
  cv, ct = "backbone/clip/visual", "backbone/clip/text"
  rows = _tower_rows(cv, ct, _layer_count(like, cv), _layer_count(like, ct))

  missing, wrong, out = [], [], {}
  for ours, key, layout in rows:
    if key not in state:
      missing.append(f"{key} [{ours}]")
      continue
    value = layouts.to_numpy(state[key])
    expected = layout.torch_shape(like[ours])
    if tuple(value.shape) != expected:
      wrong.append((f"{key} [{ours}]", tuple(value.shape), expected))
      continue
    out[ours] = layout.from_torch(value, like[ours])
  known = {r[1] for r in rows}
  for prefix_torch, prefix_ours in (("visual.transformer", cv), ("transformer", ct)):
    for i in range(_layer_count(like, prefix_ours)):
      known |= _convert_qkv(
        state,
        like,
        f"{prefix_torch}.resblocks.{i}.attn",
        f"{prefix_ours}/transformer/resblocks_{i}/attn",
        out,
        missing,
        wrong,
      )
  known |= _convert_posembs(state, like, cv, ct, source, out, missing, wrong)

  unexpected = sorted(k for k in state if k not in known and k not in CLIP_IGNORED_KEYS)
  if missing or unexpected or wrong:
    raise tree.CheckpointMismatchError(
      source, missing, unexpected, wrong, what=" (OpenAI CLIP names)"
    )
  for k in init:
    if not k.startswith("backbone/clip/"):
      out[k] = np.asarray(init[k])
  return tree.check_params(tree.unflatten(out), tree.unflatten(init), source)


def _read_state_dict(path_or_state_dict, source: str | None) -> tuple[dict[str, Any], str]:
  """The state dict of a TorchScript / `torch.save` file or of a mapping, and the name for
  errors. FileNotFoundError: no such file; ImportError: torch missing (for a path)."""
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
  return {k: v for k, v in state.items()}, source


def _layer_count(like: Mapping[str, tuple[int, ...]], prefix: str) -> int:
  """The number of residual blocks under `prefix/transformer` in the flat tree `like`."""
  return len(
    {
      int(m.group(1))
      for k in like
      for m in [re.match(re.escape(prefix) + r"/transformer/resblocks_(\d+)/", k)]
      if m
    }
  )


def _tower_rows(cv: str, ct: str, vision_layers: int, text_layers: int):
  """(our path, OpenAI name, layout) of every one-to-one entry of both towers (all but the
  fused q/k/v projections and the positional embeddings)."""
  rows = [
    ("backbone/clip/logit_scale", "logit_scale", layouts.SAME),
    (f"{cv}/conv1/kernel", "visual.conv1.weight", layouts.CONV),
    (f"{cv}/class_embedding", "visual.class_embedding", layouts.SAME),
    (f"{ct}/token_embedding/embedding", "token_embedding.weight", layouts.SAME),
    (f"{ct}/text_projection/kernel", "text_projection", layouts.SAME),
  ]
  for ours, torch_name in (
    (f"{cv}/ln_pre", "visual.ln_pre"),
    (f"{cv}/ln_post", "visual.ln_post"),
    (f"{ct}/ln_final", "ln_final"),
  ):
    rows += [
      (f"{ours}/scale", f"{torch_name}.weight", layouts.SAME),
      (f"{ours}/bias", f"{torch_name}.bias", layouts.SAME),
    ]
  rows += _clip_rows("visual.transformer", f"{cv}/transformer", vision_layers)
  rows += _clip_rows("transformer", f"{ct}/transformer", text_layers)
  return rows


def _convert_qkv(state, like, t: str, o: str, out, missing, wrong) -> set[str]:
  """One block's fused q/k/v projection `t.in_proj_{weight,bias}` split into `o/{query,key,
  value}` (into `out`; problems appended to `missing` / `wrong`). Returns the names read."""
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
  known = {f"{t}.in_proj_weight", f"{t}.in_proj_bias"}
  if f"{t}.in_proj_weight" not in state or f"{t}.in_proj_bias" not in state:
    return known
  weight = layouts.to_numpy(state[f"{t}.in_proj_weight"])
  bias = layouts.to_numpy(state[f"{t}.in_proj_bias"])
  if weight.shape != (3 * width, width) or bias.shape != (3 * width,):
    return known
  for j, name in enumerate(("query", "key", "value")):
    out[f"{o}/{name}/kernel"] = layouts.QKV.from_torch(
      weight[j * width : (j + 1) * width], like[f"{o}/{name}/kernel"]
    )
    out[f"{o}/{name}/bias"] = layouts.HEAD_BIAS.from_torch(
      bias[j * width : (j + 1) * width], like[f"{o}/{name}/bias"]
    )
  return known


def _convert_posembs(state, like, cv: str, ct: str, source: str, out, missing, wrong) -> set[str]:
  """The positional embeddings: the vision grid resized, the text rows truncated (into
  `out`; problems appended to `missing` / `wrong`). Returns the names read."""
  known = set()
  for ours, key in (
    (f"{cv}/positional_embedding", "visual.positional_embedding"),
    (f"{ct}/positional_embedding", "positional_embedding"),
  ):
    known.add(key)
    if key not in state:
      missing.append(f"{key} [{ours}]")
      continue
    value = layouts.to_numpy(state[key])
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
  return known


def fresh_head_params(config: owl_lib.ModelConfig, key: jax.Array) -> dict[str, np.ndarray]:
  """Freshly initialised parameters of everything outside the CLIP towers.

  Initialises only ``backbone/merged_class_token``, ``class_head`` and ``obj_box_head``
  (scenic's initialisers: zero box-head output kernel, logit-shift prior bias -4.59512,
  unit LayerNorm).

  Args:
    config: the module's ``ModelConfig``. key: PRNG key.

  Returns:
    Nested ``dict`` of float32 ``np.ndarray`` with exactly those subtrees (the other
    paths of :func:`abstract_params` absent).

  Source: docs/reference.md §2 (CLIP init: heads and merged LN stay fresh).
  """
  # The heads are initialised on their own (from dummy token features and a dummy query
  # embedding) so that an L/14 conversion does not pay for initialising both towers, whose
  # values the CLIP file replaces anyway.
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

"""Optimiser: AdamW with LR groups, layer-wise LR decay, warmup + cosine (docs/reference.md §3).

Two LR groups: the text tower (`backbone/clip/text/...`) trains at `text_lr_multiplier` (0.1)
times the vision/head LR. Layer-wise LR decay with coefficient m multiplies each parameter's LR
by m**depth, where depth counts from the heads down each tower independently (the paper's
"per layer" granularity): heads and the final LayerNorm / projection have depth 0, the last
transformer block depth 1, ..., the first block depth L, the embeddings depth L + 1.

The released code (5hadytru/optimal_retrieval, `util_funcs/model_utils.apply_lw_lr_decay`)
decays per parameter *tensor* instead (`layerwise_granularity='tensor'`, see
`hf_tensor_order`): walking HF `OwlViTForObjectDetection.named_parameters()` backwards from
the last tensor, every tensor gets the current LR and the LR is then multiplied by m; the
walk restarts at the text tower's LR when it reaches the last text-tower tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
import re
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import optax

PyTree = Any

_BLOCK = re.compile(r"resblocks_(\d+)$")

GRANULARITIES = ("layer", "tensor")

# The suffixes of a LoRA adapter's two parameters, beside the kernel they adapt (qwix's
# names; owl_cl.model.lora). An adapter takes its kernel's LR multiplier.
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


def _kernel_path(path: tuple[str, ...]) -> tuple[str, ...]:
  """The path of the kernel a LoRA adapter's parameter adapts; any other path unchanged."""
  for suffix in ADAPTER_SUFFIXES:
    if path[-1].endswith(suffix):
      return path[:-1] + (path[-1][: -len(suffix)],)
  return path


# Named sets of frozen parameters (`train.frozen` may name them beside regexes). A pattern is
# matched in full against the '/'-joined path below `params` (docs/reference.md §1.1 layout).
# 'heads_only' trains the class and box heads alone; 'image_tower' freezes the ViT and the
# LayerNorm after it (`merged_class_token`), which belongs to the image side of the detector
# (scenic `owl_vit/layers.py`, `PredictorMixin`); 'text_tower' freezes the text transformer,
# its embeddings and its projection.
FROZEN_PRESETS = {
  "heads_only": ("backbone/.*",),
  "text_tower": ("backbone/clip/text/.*",),
  "image_tower": ("backbone/clip/visual/.*", "backbone/merged_class_token/.*"),
}

# One transformer block's tensors in HF `named_parameters()` order (OwlViTEncoderLayer:
# self_attn.{k,v,q,out}_proj.{weight,bias}, layer_norm1, mlp.fc1, mlp.fc2, layer_norm2), as
# paths below `resblocks_i` of the scenic tree (docs/reference.md §1.2 mapping).
_HF_BLOCK_ORDER = (
  ("attn", "key", "kernel"),
  ("attn", "key", "bias"),
  ("attn", "value", "kernel"),
  ("attn", "value", "bias"),
  ("attn", "query", "kernel"),
  ("attn", "query", "bias"),
  ("attn", "out", "kernel"),
  ("attn", "out", "bias"),
  ("ln_0", "scale"),
  ("ln_0", "bias"),
  ("mlp", "c_fc", "kernel"),
  ("mlp", "c_fc", "bias"),
  ("mlp", "c_proj", "kernel"),
  ("mlp", "c_proj", "bias"),
  ("ln_1", "scale"),
  ("ln_1", "bias"),
)


def _num_blocks(flat_paths, tower: str) -> int:
  blocks = set()
  for path in flat_paths:
    if len(path) > 4 and path[:3] == ("backbone", "clip", tower):
      for name in path:
        match = _BLOCK.match(name)
        if match:
          blocks.add(int(match.group(1)))
  return len(blocks)


def parameter_depth(
  path: tuple[str, ...], num_vision_blocks: int, num_text_blocks: int
) -> tuple[str, int]:
  """Returns (group, depth) of a parameter for layer-wise LR decay.

  Args:
    path: parameter path below `params`, e.g. ('backbone', 'clip', 'text', 'transformer',
      'resblocks_3', 'mlp', 'c_fc', 'kernel').
    num_vision_blocks: transformer depth of the vision tower.
    num_text_blocks: transformer depth of the text tower.

  Returns:
    ('text' | 'vision', depth >= 0). Depth 0 = heads, final LayerNorms, projections; depth i in
    1..L = transformer block L - i; depth L + 1 = patch/token/position/class embeddings and
    `ln_pre`. Parameters outside the towers (class and box heads, `merged_class_token`,
    `backbone/clip/logit_scale`) are 'vision' group at depth 0. Source: docs/reference.md §3; the
    paper's
    per-dataset hyperparameter table ("starting from the classifier and applied to the vision
    and text towers independently").
  """
  if len(path) >= 3 and path[:2] == ("backbone", "clip") and path[2] in ("text", "visual"):
    tower = path[2]
    group = "text" if tower == "text" else "vision"
    num_blocks = num_text_blocks if tower == "text" else num_vision_blocks
    for name in path:
      match = _BLOCK.match(name)
      if match:
        return group, num_blocks - int(match.group(1))
    top = path[3]
    if top in ("ln_final", "text_projection", "ln_post"):
      return group, 0
    # token_embedding, positional_embedding, conv1, class_embedding, ln_pre.
    return group, num_blocks + 1
  return "vision", 0


def hf_tensor_order(
  num_text_blocks: int, num_vision_blocks: int
) -> tuple[list[tuple[str, ...] | None], int]:
  """The parameter tensors of OWL-ViT v1 in HF `named_parameters()` order, as scenic paths.

  Order of transformers' `OwlViTForObjectDetection` (a module's own parameters come before
  its sub-modules'): `owlvit.logit_scale`; text tower (token and position embeddings, blocks
  0..L-1, final LayerNorm); vision tower (class, patch and position embeddings,
  pre-LayerNorm, blocks, post-LayerNorm); `owlvit.visual_projection` (no scenic counterpart:
  listed as None, it still takes one step of the decay walk); `owlvit.text_projection`;
  class head (dense0, logit_shift, logit_scale); box head (dense0..2); `layer_norm`
  (= `merged_class_token`). Weight before bias, LayerNorm weight (= scale) before bias.

  Args:
    num_text_blocks: transformer depth of the text tower (L/14: 12).
    num_vision_blocks: transformer depth of the vision tower (L/14: 24).

  Returns:
    (paths, first_vision_index): paths below `params` (None for visual_projection), and the
    index of the first vision-tower tensor, which splits the two decay walks (the released
    code's `tower_indices`: 197 for L/14 = 1 + 2 + 12 * 16 + 2).

  Source: transformers `modeling_owlvit.py` module order (checked against
  `OwlViTForObjectDetection(config).named_parameters()` of transformers 5.23); the released
  code's `util_funcs/model_utils.py` (`tower_indices = {"OWL_L14": [197]}`).
  """
  clip = ("backbone", "clip")
  text = clip + ("text",)
  visual = clip + ("visual",)
  paths: list[tuple[str, ...] | None] = [clip + ("logit_scale",)]
  paths += [text + ("token_embedding", "embedding"), text + ("positional_embedding",)]
  for i in range(num_text_blocks):
    paths += [text + ("transformer", f"resblocks_{i}") + p for p in _HF_BLOCK_ORDER]
  paths += [text + ("ln_final", "scale"), text + ("ln_final", "bias")]
  first_vision = len(paths)
  paths += [
    visual + ("class_embedding",),
    visual + ("conv1", "kernel"),
    visual + ("positional_embedding",),
    visual + ("ln_pre", "scale"),
    visual + ("ln_pre", "bias"),
  ]
  for i in range(num_vision_blocks):
    paths += [visual + ("transformer", f"resblocks_{i}") + p for p in _HF_BLOCK_ORDER]
  paths += [visual + ("ln_post", "scale"), visual + ("ln_post", "bias")]
  paths += [None, text + ("text_projection", "kernel")]
  for head, names in (
    ("class_head", ("Dense_0", "logit_shift", "logit_scale")),
    ("obj_box_head", ("Dense_0", "Dense_1", "Dense_2")),
  ):
    for name in names:
      paths += [(head, name, "kernel"), (head, name, "bias")]
  paths += [("backbone", "merged_class_token", "scale"), ("backbone", "merged_class_token", "bias")]
  return paths, first_vision


def tensor_decay_exponents(
  flat_paths, num_text_blocks: int, num_vision_blocks: int
) -> dict[tuple[str, ...], tuple[str, int]]:
  """(group, exponent) of every parameter for the released code's per-tensor decay.

  Walking the HF order (`hf_tensor_order`) backwards, the last tensor has exponent 0 and each
  earlier tensor one more. As in the released code, the walk switches to the text tower's LR
  (exponent 0 again) when it reaches HF index `tower_indices` = `first_vision_index` (197 for
  L/14), *before* assigning that tensor: so the vision `class_embedding` (the first vision
  tensor) is the text group's exponent 0, `ln_final` bias its exponent 1, ..., and
  `backbone/clip/logit_scale` (HF index 0) its deepest. `owlvit.text_projection`, which HF
  lists after the vision tower, is in the vision group.

  Args:
    flat_paths: every parameter path of the tree (tuples of str).
    num_text_blocks: text tower depth.
    num_vision_blocks: vision tower depth.

  Returns:
    {path: ('text' | 'vision', exponent >= 0)} for every path of `flat_paths`.

  Raises:
    ValueError: naming the tree's paths that have no place in the HF order (e.g. a tree of
      another architecture).

  Source: released code `util_funcs/model_utils.apply_lw_lr_decay`; docs/reference.md §3
  (`llrd_granularity='tensor'`).
  """
  order, first_vision = hf_tensor_order(num_text_blocks, num_vision_blocks)
  position = {path: i for i, path in enumerate(order) if path is not None}
  unknown = sorted("/".join(p) for p in flat_paths if tuple(p) not in position)
  if unknown:
    raise ValueError(
      "per-tensor layer-wise decay (train.layerwise_granularity='tensor') "
      f"found parameters outside the HF OWL-ViT tensor order: {unknown[:10]}"
      f"{' ...' if len(unknown) > 10 else ''}"
    )
  out = {}
  for path in flat_paths:
    i = position[tuple(path)]
    if i > first_vision:
      out[tuple(path)] = ("vision", len(order) - 1 - i)
    else:
      out[tuple(path)] = ("text", first_vision - i)
  return out


def lr_multipliers(
  params: PyTree,
  *,
  text_lr_multiplier: float,
  layerwise_decay: float,
  layerwise_granularity: str = "layer",
) -> PyTree:
  """Per-parameter LR multipliers: group multiplier * decay**depth.

  Args:
    params: the parameter tree (scenic layout, docs/reference.md §1.1), arrays or ShapeDtypeStructs.
    text_lr_multiplier: LR of the text tower relative to vision/heads (paper: 0.1).
    layerwise_decay: m in (0, 1]; 1.0 disables layer-wise decay.
    layerwise_granularity: 'layer' (the paper: depth of `parameter_depth`) or 'tensor' (as in
      the released code: exponent of `tensor_decay_exponents`, one step per HF tensor).

  Returns:
    A tree of Python floats with the structure of `params`; a LoRA adapter's A and B
    (`ADAPTER_SUFFIXES`) get their kernel's multiplier.

  Raises:
    ValueError: if layerwise_decay is not in (0, 1], text_lr_multiplier < 0, an unknown
      granularity, or (granularity 'tensor') a tree that is not OWL-ViT v1's.
  """
  if not 0.0 < layerwise_decay <= 1.0:
    raise ValueError(f"train.layerwise_decay must be in (0, 1], got {layerwise_decay}")
  if text_lr_multiplier < 0:
    raise ValueError(f"train.text_lr_multiplier must be >= 0, got {text_lr_multiplier}")
  if layerwise_granularity not in GRANULARITIES:
    raise ValueError(
      f"train.layerwise_granularity must be one of {GRANULARITIES}, got {layerwise_granularity!r}"
    )
  flat = traverse_util.flatten_dict(params)
  num_vision = _num_blocks(flat, "visual")
  num_text = _num_blocks(flat, "text")
  # LoRA adapters (owl_cl.model.lora) take the group and depth of the kernel they adapt.
  kernels = {path: _kernel_path(path) for path in flat}
  if layerwise_granularity == "tensor":
    depths = tensor_decay_exponents(sorted(set(kernels.values())), num_text, num_vision)
  else:
    depths = {k: parameter_depth(k, num_vision, num_text) for k in kernels.values()}
  out = {}
  for path in flat:
    group, depth = depths[kernels[path]]
    base = text_lr_multiplier if group == "text" else 1.0
    out[path] = base * layerwise_decay**depth
  return traverse_util.unflatten_dict(out)


def _entry_problem(entry) -> str:
  """What makes one `train.frozen` entry unusable ('' when it is a preset or a regex)."""
  if not isinstance(entry, str):
    return f"entry {entry!r} is not a str (a preset or a regex)"
  if entry in FROZEN_PRESETS:
    return ""
  try:
    re.compile(entry)
  except re.error as e:
    return f"{entry!r} is neither a preset {sorted(FROZEN_PRESETS)} nor a valid regex ({e})"
  return ""


def frozen_rule(value) -> str:
  """The config rule of `train.frozen` (config_fields.Rule): '' or what is wrong with it."""
  if not isinstance(value, (tuple, list)):
    return "must be a tuple of presets and regexes"
  return "; ".join(p for p in map(_entry_problem, value) if p)


def frozen_patterns(frozen) -> tuple[str, ...]:
  """The regexes of `train.frozen`: presets (`FROZEN_PRESETS`) expanded, regexes kept.

  Args:
    frozen: a sequence of preset names and regexes (str); empty or None: nothing frozen.

  Returns:
    The regexes, in order, presets replaced by their patterns.

  Raises:
    ValueError: an entry that is not a str, or a regex that does not compile (the message
      names `train.frozen` and the entry).
  """
  patterns = []
  for entry in frozen or ():
    if problem := _entry_problem(entry):
      raise ValueError(f"train.frozen: {problem}")
    patterns += FROZEN_PRESETS.get(entry, (entry,))
  return tuple(patterns)


def frozen_labels(params: PyTree, frozen) -> PyTree:
  """'frozen' or 'train' for every parameter, by `train.frozen`'s patterns.

  Args:
    params: the parameter tree (arrays or ShapeDtypeStructs).
    frozen: preset names and regexes (`frozen_patterns`); a regex matches a parameter when it
      matches its '/'-joined path (e.g. 'backbone/clip/text/ln_final/scale') in full.

  Returns:
    A tree of str with the structure of `params`.

  Raises:
    ValueError: as `frozen_patterns`; a pattern that matches no parameter (a typo would
      otherwise silently train everything), naming it.

  Source: big_vision `big_vision/optax.py` (`_make_mask_trees`, frozen by pattern).
  """
  patterns = frozen_patterns(frozen)
  flat = traverse_util.flatten_dict(params)
  names = {path: "/".join(path) for path in flat}
  unmatched = [p for p in patterns if not any(re.fullmatch(p, n) for n in names.values())]
  if unmatched:
    raise ValueError(f"train.frozen: patterns {unmatched} match no parameter path")
  labels = {
    path: "frozen" if any(re.fullmatch(p, name) for p in patterns) else "train"
    for path, name in names.items()
  }
  return traverse_util.unflatten_dict(labels)


def warmup_cosine_schedule(
  learning_rate: float, total_steps: int, warmup_steps: int
) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then cosine decay to 0 at `total_steps`.

  Raises:
    ValueError: total_steps < 1 or warmup_steps < 0.
  """
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  warmup_steps = min(warmup_steps, total_steps - 1)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=learning_rate,
    warmup_steps=warmup_steps,
    decay_steps=total_steps,
    end_value=0.0,
  )


def create_optimizer(
  params: PyTree,
  *,
  learning_rate: float,
  total_steps: int,
  warmup_steps: int,
  text_lr_multiplier: float = 0.1,
  layerwise_decay: float = 1.0,
  layerwise_granularity: str = "layer",
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  grad_clip_norm: float | None = 1.0,
  frozen=(),
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with global grad-norm clipping, LR groups and layer-wise decay (docs/reference.md §3).

  The effective LR of a parameter at step s is schedule(s) * multiplier(parameter), with the
  multipliers of `lr_multipliers`. Weight decay is decoupled (AdamW) and scaled by the same LR.

  Args:
    params: parameter tree (to derive the multipliers; not modified).
    learning_rate: peak vision/head LR.
    total_steps: schedule length (steps).
    warmup_steps: linear warmup (steps).
    text_lr_multiplier: see `lr_multipliers`.
    layerwise_decay: see `lr_multipliers`.
    layerwise_granularity: see `lr_multipliers`.
    b1: AdamW beta 1 (paper: 0.9).
    b2: AdamW beta 2 (paper: 0.999).
    eps: AdamW epsilon (paper: 1e-8).
    weight_decay: AdamW weight decay (paper: 0).
    grad_clip_norm: global gradient-norm clip (paper 1.0); None disables it.
    frozen: preset names and regexes of the parameters to freeze (`frozen_labels`); their
      update is exactly zero and they hold no Adam state (`optax.MaskedNode` in its place);
      the clipping norm is taken over the trained parameters only.

  Returns:
    (optax transformation, the base LR schedule for logging).

  Raises:
    ValueError: as `lr_multipliers` and `frozen_labels`.
  """
  schedule = warmup_cosine_schedule(learning_rate, total_steps, warmup_steps)
  multipliers = lr_multipliers(
    params,
    text_lr_multiplier=text_lr_multiplier,
    layerwise_decay=layerwise_decay,
    layerwise_granularity=layerwise_granularity,
  )

  labels = frozen_labels(params, frozen) if frozen else None
  if labels is not None:
    # Inside multi_transform the trained branch sees frozen leaves as MaskedNode (a node with
    # no leaves): the multipliers take the same structure so the two trees map together.
    multipliers = jax.tree.map(
      lambda m, label: optax.MaskedNode() if label == "frozen" else m, multipliers, labels
    )

  def scale_by_multipliers(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, m: u * jnp.asarray(m, u.dtype), updates, multipliers), state

  parts = []
  if grad_clip_norm is not None:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  parts += [
    optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
    optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
    optax.GradientTransformation(lambda p: optax.EmptyState(), scale_by_multipliers),
    optax.scale_by_learning_rate(schedule),
  ]
  tx = optax.chain(*parts)
  if labels is not None:
    # big_vision's "no schedule means frozen": set_to_zero keeps no state.
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule


def multipliers_summary(params: PyTree, **kwargs) -> Mapping[str, float]:
  """Flat {'a/b/c': multiplier} view of `lr_multipliers`, for logging and tests."""
  flat = traverse_util.flatten_dict(lr_multipliers(params, **kwargs))
  return {"/".join(k): v for k, v in flat.items()}

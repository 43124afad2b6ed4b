"""Optimiser: AdamW with LR groups, layer-wise LR decay, warmup + cosine (SPEC §3).

Two LR groups: the text tower (`backbone/clip/text/...`) trains at `text_lr_multiplier` (0.1)
times the vision/head LR. Layer-wise LR decay with coefficient m multiplies each parameter's LR
by m**depth, where depth counts from the heads down each tower independently (the paper's
"per layer" granularity): heads and the final LayerNorm / projection have depth 0, the last
transformer block depth 1, ..., the first block depth L, the embeddings depth L + 1.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

PyTree = Any

_BLOCK = re.compile(r"resblocks_(\d+)$")


def _num_blocks(flat_paths, tower: str) -> int:
  blocks = set()
  for path in flat_paths:
    if len(path) > 4 and path[:3] == ("backbone", "clip", tower):
      for name in path:
        match = _BLOCK.match(name)
        if match:
          blocks.add(int(match.group(1)))
  return len(blocks)


def parameter_depth(path: tuple[str, ...], num_vision_blocks: int,
                    num_text_blocks: int) -> tuple[str, int]:
  """Returns (group, depth) of a parameter for layer-wise LR decay.

  Args:
    path: parameter path below `params`, e.g. ('backbone', 'clip', 'text', 'transformer',
      'resblocks_3', 'mlp', 'c_fc', 'kernel').
    num_vision_blocks / num_text_blocks: transformer depth of each tower.

  Returns:
    ('text' | 'vision', depth >= 0). Depth 0 = heads, final LayerNorms, projections; depth i in
    1..L = transformer block L - i; depth L + 1 = patch/token/position/class embeddings and
    `ln_pre`. Parameters outside the towers (class and box heads, `merged_class_token`,
    `backbone/clip/logit_scale`) are 'vision' group at depth 0. Source: SPEC §3; the paper's
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


def lr_multipliers(params: PyTree, *, text_lr_multiplier: float,
                   layerwise_decay: float) -> PyTree:
  """Per-parameter LR multipliers: group multiplier * decay**depth.

  Args:
    params: the parameter tree (scenic layout, SPEC §1.1), arrays or ShapeDtypeStructs.
    text_lr_multiplier: LR of the text tower relative to vision/heads (paper: 0.1).
    layerwise_decay: m in (0, 1]; 1.0 disables layer-wise decay.

  Returns:
    A tree of Python floats with the structure of `params`.

  Raises:
    ValueError: if layerwise_decay is not in (0, 1] or text_lr_multiplier < 0.
  """
  if not 0.0 < layerwise_decay <= 1.0:
    raise ValueError(f"train.layerwise_decay must be in (0, 1], got {layerwise_decay}")
  if text_lr_multiplier < 0:
    raise ValueError(f"train.text_lr_multiplier must be >= 0, got {text_lr_multiplier}")
  flat = traverse_util.flatten_dict(params)
  num_vision = _num_blocks(flat, "visual")
  num_text = _num_blocks(flat, "text")
  out = {}
  for path in flat:
    group, depth = parameter_depth(path, num_vision, num_text)
    base = text_lr_multiplier if group == "text" else 1.0
    out[path] = base * layerwise_decay ** depth
  return traverse_util.unflatten_dict(out)


def warmup_cosine_schedule(learning_rate: float, total_steps: int,
                           warmup_steps: int) -> optax.Schedule:
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
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=0.0)


def create_optimizer(params: PyTree, *, learning_rate: float, total_steps: int,
                     warmup_steps: int, text_lr_multiplier: float = 0.1,
                     layerwise_decay: float = 1.0, b1: float = 0.9, b2: float = 0.999,
                     eps: float = 1e-8, weight_decay: float = 0.0,
                     grad_clip_norm: float | None = 1.0
                     ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with global grad-norm clipping, LR groups and layer-wise decay (SPEC §3).

  The effective LR of a parameter at step s is schedule(s) * multiplier(parameter), with the
  multipliers of `lr_multipliers`. Weight decay is decoupled (AdamW) and scaled by the same LR.

  Args:
    params: parameter tree (to derive the multipliers; not modified).
    learning_rate: peak vision/head LR.
    total_steps, warmup_steps: schedule length and linear warmup (steps).
    text_lr_multiplier, layerwise_decay: see `lr_multipliers`.
    b1, b2, eps, weight_decay: AdamW constants (paper: 0.9, 0.999, 1e-8, 0).
    grad_clip_norm: global gradient-norm clip (paper 1.0); None disables it.

  Returns:
    (optax transformation, the base LR schedule for logging).
  """
  schedule = warmup_cosine_schedule(learning_rate, total_steps, warmup_steps)
  multipliers = lr_multipliers(params, text_lr_multiplier=text_lr_multiplier,
                               layerwise_decay=layerwise_decay)

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
  return optax.chain(*parts), schedule


def multipliers_summary(params: PyTree, **kwargs) -> Mapping[str, float]:
  """Flat {'a/b/c': multiplier} view of `lr_multipliers`, for logging and tests."""
  flat = traverse_util.flatten_dict(lr_multipliers(params, **kwargs))
  return {"/".join(k): v for k, v in flat.items()}

"""WiSE-FT: weight-space ensembling of the fine-tuned model with the pre-trained one.

Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, eq. (1):
theta = (1 - alpha) * theta_0 + alpha * theta_ft, theta_0 the zero-shot (here: pre-trained)
parameters, theta_ft the fine-tuned ones, alpha in [0, 1] the mixing coefficient (0: the
pre-trained model, 1: the fine-tuned one). Released OWLv2 L/14's canonical checkpoint is such a
blend (scenic `owl_v2_clip_l14.py`, '...-ens-cold-weight-04'; docs/baselines.md "WiSE-FT").

`train.wise_ft` (`WiseFtSpec`) turns it on for continual fine-tuning: after each dataset
('each': the next dataset starts from the blend) or after the last one only ('end'); the
stage's evaluation and checkpoint are the blend's (`owl_cl.experiment`, `after_stage`). The
cost is one pass over the parameters per blend (read two trees, write one) and, for full
fine-tuning, the pre-trained parameters kept for the run (one more copy of the model).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from owl_cl import config_spec
from owl_cl.config_fields import choice
from owl_cl.config_fields import real
from owl_cl.train.optim import ADAPTER_SUFFIXES

PyTree = Any

# When the blend is applied (`train.wise_ft.when`).
WHEN = ("each", "end")

_KEY = "fine-tuning only: no stored cache (pre-trained model, buffer) is built from it"


@dataclasses.dataclass(frozen=True)
class WiseFtSpec:
  """`train.wise_ft`: WiSE-FT (Wortsman et al. CVPR 2022; docs/baselines.md), off at alpha 1."""

  alpha: float = config_spec.field(
    1.0,
    real(0.0, 1.0),
    "Mixing coefficient: the blend is (1 - alpha) x pre-trained + alpha x fine-tuned "
    "parameters (Wortsman et al. eq. 1); 1: off (the fine-tuned model), 0: the pre-trained one.",
    key=_KEY,
  )
  when: str = config_spec.field(
    "each",
    choice(WHEN),
    "'each': after every dataset (the next one starts from the blend); 'end': after the last "
    "dataset only. A per-task run blends every task's model; a joint run its one stage.",
    key=_KEY,
  )

  @property
  def on(self) -> bool:
    """Whether a blend is applied (alpha < 1)."""
    return self.alpha < 1.0


def blend(theta_0: PyTree, theta_ft: PyTree, alpha: float) -> PyTree:
  """(1 - alpha) * theta_0 + alpha * theta_ft, leaf by leaf (Wortsman et al. 2022, eq. 1).

  Args:
    theta_0: the pre-trained parameters (floating leaves).
    theta_ft: the fine-tuned parameters, the same tree structure and leaf shapes.
    alpha: the mixing coefficient in [0, 1].

  Returns:
    A tree like `theta_ft`, each leaf in `theta_ft`'s dtype (computed in float32, or the
    leaves' own dtype if wider). Alpha 0 gives the values of `theta_0` and alpha 1 those of
    `theta_ft` exactly (0 * x = 0 for finite x; a -0.0 may come back as +0.0), alpha 0.5 the
    mean rounded once.

  Raises:
    ValueError: alpha outside [0, 1]; trees of different structure; a leaf whose shapes
      differ or that is not floating (named by its path).
  """
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"WiSE-FT alpha={alpha!r} must be in [0, 1]")
  paths_0, tree_0 = jax.tree_util.tree_flatten_with_path(theta_0)
  paths_ft, tree_ft = jax.tree_util.tree_flatten_with_path(theta_ft)
  if tree_0 != tree_ft:
    raise ValueError(f"WiSE-FT: the two parameter trees differ ({tree_0} vs {tree_ft})")
  for (path, a), (_, b) in zip(paths_0, paths_ft):
    name = jax.tree_util.keystr(path)
    if jnp.shape(a) != jnp.shape(b):
      raise ValueError(f"WiSE-FT: {name} has shape {jnp.shape(a)} and {jnp.shape(b)}")
    if not (jnp.issubdtype(a.dtype, jnp.floating) and jnp.issubdtype(b.dtype, jnp.floating)):
      raise ValueError(f"WiSE-FT: {name} is not floating ({a.dtype}, {b.dtype})")
  return _blend(theta_0, theta_ft, alpha)


@jax.jit
def _blend(theta_0: PyTree, theta_ft: PyTree, alpha) -> PyTree:
  # One fused elementwise pass per leaf; alpha is traced, so one program serves every alpha.
  def mix(a, b):
    dtype = jnp.promote_types(b.dtype, jnp.float32)
    weight = jnp.asarray(alpha, dtype)
    out = (1 - weight) * a.astype(dtype) + weight * b.astype(dtype)
    return out.astype(b.dtype)

  return jax.tree.map(mix, theta_0, theta_ft)


def blend_lora(params: PyTree, alpha: float) -> PyTree:
  """The WiSE-FT blend of a LoRA run's merged weights, as adapters: every B factor times alpha.

  A LoRA tree holds the frozen base W (the pre-trained kernels, theta_0's, bit for bit) and
  adapters A, B; its merged kernel is W + s A B (`owl_cl.model.lora.merge`, s = lora alpha /
  rank). The blend of the merged weights with theta_0 is (1 - alpha) W + alpha (W + s A B) =
  W + s A (alpha B): the same tree with B scaled, so the base stays bit for bit the
  pre-trained one (the checkpoints hold only the adapters) and every other leaf is unchanged.

  Args:
    params: a LoRA parameter tree (nested dicts; adapter leaves named '<kernel>_lora_a' /
      '<kernel>_lora_b', `owl_cl.train.optim.ADAPTER_SUFFIXES`).
    alpha: the mixing coefficient in [0, 1].

  Returns:
    `params` with each '*_lora_b' leaf multiplied by alpha (in its own dtype).

  Raises:
    ValueError: alpha outside [0, 1], or a tree without any B factor (not a LoRA tree).
  """
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"WiSE-FT alpha={alpha!r} must be in [0, 1]")
  suffix_b = ADAPTER_SUFFIXES[1]
  found = []

  def scale(path, leaf):
    last = path[-1]
    name = getattr(last, "key", getattr(last, "name", None))
    if isinstance(name, str) and name.endswith(suffix_b):
      found.append(name)
      return (leaf * jnp.asarray(alpha, leaf.dtype)).astype(leaf.dtype)
    return leaf

  out = jax.tree_util.tree_map_with_path(scale, params)
  if not found:
    raise ValueError(f"WiSE-FT of a LoRA run: no '*{suffix_b}' adapter in the parameters")
  return out


def blends_after(spec: WiseFtSpec, stage: int, num_stages: int, schedule: str) -> bool:
  """Whether stage `stage` (1-based, of `num_stages`) ends with a blend: never when off;
  every stage for 'each', and for a per-task run (each task's model ends its own sequence);
  the last stage only for 'end'."""
  if not spec.on:
    return False
  return spec.when == "each" or schedule == "per_task" or stage == num_stages


def after_stage(
  spec: WiseFtSpec,
  theta_0: PyTree,
  params: PyTree,
  *,
  stage: int,
  num_stages: int,
  schedule: str,
  lora: bool,
) -> PyTree:
  """Stage `stage`'s parameters as evaluated and carried: `params` blended with `theta_0`
  when `blends_after` says so (`blend`; a LoRA tree by `blend_lora`, which needs no
  `theta_0`), else `params` itself.

  Raises:
    ValueError: as `blend` / `blend_lora`.
  """
  if not blends_after(spec, stage, num_stages, schedule):
    return params
  return blend_lora(params, spec.alpha) if lora else blend(theta_0, params, spec.alpha)

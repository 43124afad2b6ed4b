"""The class steps and sample steps retrieval algorithms are composed of (paper Table 2).

Step protocols (hyperparameters are keyword-only arguments with defaults; the registry
discovers them by name, `compose.keyword_hyperparameters`):

  class step:  step(key, rstate, buffer, features, class_eligible [C], active [num], **hp)
               -> (classes int32 [num] (-1 = no class), rstate, records dict)
  sample step: step(key, rstate, buffer, features, classes [num] | None, eligible [N],
               active [num], without_replacement, pool, **hp)
               -> (indices int32 [num], valid bool [num], records dict)

Shapes and the `pool` argument: `owl_cl.replay.retrieval` (package docstring). Source: paper
§4, eqs. 1-2; docs/reference.md §7.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from owl_cl.replay import class_index as class_index_lib
from owl_cl.replay.retrieval import class_selection
from owl_cl.replay.retrieval import sample_selection
from owl_cl.replay.state import ReplayBuffer

Array = jax.Array

BALANCED_ORDERS = ("sequential", "reshuffled")
# Draw within a class where the paper draws uniformly: A-SW-GRASP's SWIL slots and the ASV
# algorithms' candidate sets. 'uniform' (paper) | 'grasp' (prototype-weighted with exponent
# `grasp_weight`: the released option `bal_prob_type='GRASP'`).
WITHIN_CLASS_WEIGHTINGS = ("uniform", "grasp")


# ----------------------------------------------------------------------------- class steps
def balanced_step(
  key, rstate, buffer, features, class_eligible, active, *, balanced_order: str = "sequential"
):
  """Balanced class step: the paper's sequential cycle (`class_selection.balanced_classes`)
  or the released code's order reshuffled every pass ('reshuffled',
  `class_selection.balanced_classes_reshuffled`). Advances the class pointer by the active
  slots only.
  """
  del buffer, features
  num = active.shape[0]
  if balanced_order == "sequential":
    classes, pointer = class_selection.balanced_classes(
      rstate.class_pointer, class_eligible, num, active=active
    )
    rstate = rstate.replace(class_pointer=pointer)
  elif balanced_order == "reshuffled":
    if rstate.class_order.shape != class_eligible.shape:
      raise ValueError(
        'balanced_order="reshuffled" needs ReplayState.class_order of shape '
        f"{class_eligible.shape}, got {rstate.class_order.shape}: make the state "
        "with init_replay_state(N, key, num_classes=C)"
      )
    classes, pointer, order = class_selection.balanced_classes_reshuffled(
      key, rstate.class_pointer, rstate.class_order, class_eligible, active
    )
    rstate = rstate.replace(class_pointer=pointer, class_order=order)
  else:
    raise ValueError(f"balanced_order must be one of {BALANCED_ORDERS}, got {balanced_order!r}")
  return classes, rstate, {"sampled_classes": classes}


def class_index_of(buffer: ReplayBuffer) -> class_index_lib.ClassIndex:
  """The buffer's per-class member index.

  Raises:
    ValueError: the buffer was not made by `state.make_replay_buffer` (no index).
  """
  if buffer.class_index is None:
    raise ValueError(
      "ReplayBuffer.class_index is None: build the buffer with state.make_replay_buffer "
      "(it derives the per-class member index from class_membership)"
    )
  return buffer.class_index


def new_image_rows(num: int, batch: int) -> Array:
  """int32 [num]: the row of the new batch serving each replay slot (slot j -> image j mod B)."""
  return jnp.arange(num, dtype=jnp.int32) % batch


def require_features(features: Mapping[str, Array], names, who: str):
  """Checks that `features` holds every key in `names`.

  Raises:
    ValueError: a missing key, naming `who` needs it and the keys present.
  """
  missing = [n for n in names if n not in features]
  if missing:
    raise ValueError(
      f"{who} needs features {missing} (from train.step.make_embed_step); got {sorted(features)}"
    )


def swil_probs(buffer, features, class_eligible, swil_weight, swil_reduction="min"):
  """float32 [B, C]: p_SWIL of each new image (`class_selection.similarity_weighted_probs`
  of `features['class_embeddings']` [B, k, E] and the buffer's prototypes).

  Raises:
    ValueError: `features` has no 'class_embeddings'.
  """
  require_features(features, ("class_embeddings",), "similarity-weighted class selection")
  return class_selection.similarity_weighted_probs(
    features["class_embeddings"], buffer.prototypes, swil_weight, class_eligible, swil_reduction
  )


def similarity_weighted_step(
  key,
  rstate,
  buffer,
  features,
  class_eligible,
  active,
  *,
  swil_weight: float = 1.0,
  swil_reduction: str = "min",
):
  """Similarity-weighted (SWIL) class step: one class per new image.

  Uses `features['class_embeddings']` [B, k, E] and `buffer.prototypes`; slot j serves new
  image j mod B (slots = new images when num_replay = B). Hyperparameter `swil_weight` is w
  of docs/reference.md §7 (default 1.0); `swil_reduction` reduces the distances over the k
  embeddings
  ('min', paper; 'mean', the released `swil_reduce_type='avg'`). Inactive slots get -1.
  """
  probs = swil_probs(buffer, features, class_eligible, swil_weight, swil_reduction)
  slot_probs = probs[new_image_rows(active.shape[0], probs.shape[0])]
  classes = jnp.where(active, class_selection.sample_classes(key, slot_probs), -1)
  return (
    classes,
    rstate,
    {"sampled_classes": classes, "swil_entropy": sample_selection.normalized_entropy(probs)},
  )


# ---------------------------------------------------------------------------- sample steps
def uniform_step(
  key, rstate, buffer, features, classes, eligible, active, without_replacement, pool=None
):
  """Uniform over all eligible buffer images, no class step (always without replacement)."""
  del rstate, buffer, features, classes, without_replacement, pool
  indices, valid = sample_selection.uniform_active(key, eligible, active)
  return indices, valid, {}


def uniform_in_class_step(
  key, rstate, buffer, features, classes, eligible, active, without_replacement, pool=None
):
  """Uniform among the eligible members of each slot's class (`uniform_in_class_active`)."""
  del rstate, features
  indices, valid = sample_selection.uniform_in_class_active(
    key,
    class_index_of(buffer),
    eligible,
    classes,
    active,
    without_replacement=without_replacement,
    pool=pool,
  )
  return indices, valid, {}


def grasp_entropy(buffer, eligible, classes, weights, pool=None):
  """float32 [num]: normalised entropy (by log of the number of eligible members) of each
  slot's GRASP distribution, at the start of the call; NaN for slots without a class. Reads
  each slot's class members only (`class_index.by_class_size`), not an [N] column per slot.
  `pool`: the call's `class_index.pools` of `eligible` (None: computed here)."""
  index = class_index_of(buffer)
  pool = class_index_lib.pools(index, eligible) if pool is None else pool

  def entropy_of(inputs):
    c, w = inputs

    def within(blocks):
      _, distances, in_class = class_index_lib.class_slice(index, c, blocks)
      members = in_class & class_index_lib.slice_flags(index, pool, c, blocks)
      members = members & jnp.isfinite(distances)
      probs = sample_selection.prototype_weighted_probs(distances, members, w)
      count = jnp.sum(members)
      plogp = jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0)
      entropy = -plogp.sum() / jnp.log(jnp.maximum(count, 2).astype(jnp.float32))
      return jnp.where(count > 1, entropy, 0.0)

    return class_index_lib.by_class_size(index, c, within)

  # lax.map (a scan), not vmap: under vmap the size switch would run every branch.
  entropy = jax.lax.map(entropy_of, (classes, weights))
  return jnp.where(classes >= 0, entropy, jnp.nan)


def prototype_weighted_step(
  key,
  rstate,
  buffer,
  features,
  classes,
  eligible,
  active,
  without_replacement,
  pool=None,
  *,
  grasp_weight: float = 1.0,
):
  """Prototype-weighted (GRASP) sample selection within each slot's class (eqs. 1-2).

  Hyperparameter `grasp_weight` is w of eq. 1 (paper 1.0; released code default 0.7).
  """
  del rstate, features
  num = active.shape[0]
  weights = jnp.full((num,), grasp_weight, jnp.float32)
  indices, valid = sample_selection.prototype_weighted_in_class(
    key,
    class_index_of(buffer),
    eligible,
    classes,
    weights,
    active,
    without_replacement=without_replacement,
    pool=pool,
  )
  return indices, valid, {"grasp_entropy": grasp_entropy(buffer, eligible, classes, weights, pool)}


# Steps that read the new batch's features (`features['class_embeddings']`, ...).
FEATURE_STEPS = (similarity_weighted_step,)

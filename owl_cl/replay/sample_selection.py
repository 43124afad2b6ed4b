"""Sample-selection primitives (paper §4 "Sample Selection Primitives"; SPEC §7).

A sample-selection primitive picks buffer images, usually one per chosen class. Everything is
jittable; `num` and `without_replacement` are static. Invalid slots (nothing eligible) return
index 0 with valid False, so that gathering them is always safe.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

Array = jax.Array


def class_eligibility(class_membership: Array, eligible_images: Array) -> Array:
  """Classes that still have at least one eligible image.

  Args:
    class_membership: bool [N, C].
    eligible_images: bool [N] (e.g. `dedup.eligible_images`).
  Returns:
    bool [C]: class_eligible[c] = any_i(class_membership[i, c] and eligible_images[i]).
  Source: SPEC §7 ("classes with no eligible image get probability 0" / are skipped).
  """
  membership = jnp.asarray(class_membership, bool)
  return jnp.any(membership & jnp.asarray(eligible_images, bool)[:, None], axis=0)


def _pick_uniform(key: Array, candidates: Array) -> Tuple[Array, Array]:
  """Exactly uniform choice of one True entry of bool [N]: (index int32 [], found bool [])."""
  count = jnp.sum(candidates, dtype=jnp.int32)
  r = jax.random.randint(key, (), 0, jnp.maximum(count, 1))
  index = jnp.argmax(jnp.cumsum(candidates, dtype=jnp.int32) > r).astype(jnp.int32)
  found = count > 0
  return jnp.where(found, index, 0), found


def uniform_in_class(key: Array, class_membership: Array, eligible: Array, classes: Array,
                     without_replacement: bool = True) -> Tuple[Array, Array]:
  """Uniform sample selection: one image uniformly among the eligible members of each class.

  Slots are filled sequentially (lax.scan over the B classes). With `without_replacement`
  (deduplication active) each chosen image is removed from the eligible set before the next
  slot, so no image appears twice in one call. If the slot's class has no eligible member
  left (possible mid-scan, or class = -1), the slot falls back to an image drawn uniformly
  among *all* eligible images of any class; if nothing is eligible at all the slot is invalid
  (index 0, valid False).

  Args:
    key: PRNG key.
    class_membership: bool [N, C].
    eligible: bool [N]; eligible images at the start of the call.
    classes: int [B]; class of each slot (-1 = none: fall back to any eligible image).
    without_replacement: static; True = mark as you go (use when dedup is active).
  Returns:
    indices: int32 [B] buffer indices (0 where invalid).
    valid: bool [B].
  Source: paper §4 "Uniform", SPEC §7.
  """
  membership = jnp.asarray(class_membership, bool)
  classes = jnp.asarray(classes, jnp.int32)
  keys = jax.random.split(key, classes.shape[0])

  def step(available, inputs):
    k, c = inputs
    column = jnp.take(membership, jnp.maximum(c, 0), axis=1)
    members = (column & available) & (c >= 0)
    candidates = jnp.where(members.any(), members, available)
    index, found = _pick_uniform(k, candidates)
    if without_replacement:
      available = available.at[index].set(available[index] & ~found)
    return available, (index, found)

  _, (indices, valid) = jax.lax.scan(step, jnp.asarray(eligible, bool), (keys, classes))
  return indices, valid


def uniform(key: Array, eligible: Array, num: int) -> Tuple[Array, Array]:
  """Uniform selection without a class step: `num` distinct images among the eligible ones.

  Draws a uniform random permutation of the buffer and takes its first `num` eligible
  entries (sampling without replacement). If fewer than `num` images are eligible the
  remaining slots are invalid (index 0, valid False).

  Args:
    key: PRNG key.
    eligible: bool [N].
    num: number of images (static, <= N).
  Returns:
    indices: int32 [num]; valid: bool [num].
  Raises:
    ValueError: num > N.
  Source: paper Table 2 "Uniform", SPEC §7.
  """
  eligible = jnp.asarray(eligible, bool)
  n = eligible.shape[0]
  if num > n:
    raise ValueError(f'cannot draw {num} distinct images from a buffer of {n}')
  perm = jax.random.permutation(key, n).astype(jnp.int32)
  first = jnp.argsort(~eligible[perm], stable=True)[:num]      # eligible first, in perm order
  valid = jnp.arange(num) < jnp.sum(eligible, dtype=jnp.int32)
  return jnp.where(valid, perm[first], 0), valid

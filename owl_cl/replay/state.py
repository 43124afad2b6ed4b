"""Replay pytrees: the mutable retrieval state and the read-only buffer arrays.

Both are `flax.struct.dataclass` pytrees of jnp arrays, so they are passed as *arguments* of
jitted retrieval functions (never closed over) and can be checkpointed as plain dicts.

Checkpoint compatibility (docs/architecture.md "Principles"): new fields of `ReplayState`
(e.g. the precomputed ASV left term of ASER-PC, docs/reference.md §7) follow these rules:
  1. give the new field a default in the dataclass (usually `None`, an empty pytree node) and
     fill it in `init_replay_state` or in the algorithm that needs it;
  2. restore checkpoints with `restore_replay_state(template, state_dict)`, which takes every
     field present in the saved dict and keeps the template's value for fields the checkpoint
     lacks (logged). `flax.serialization.from_state_dict` alone would raise on a missing field.
Never rename or change the meaning/dtype of an existing field; add a new one instead.
"""

from __future__ import annotations

from collections.abc import Mapping
import logging
from typing import Any

import flax
import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.replay import class_index as class_index_lib

Array = jax.Array


@flax.struct.dataclass
class ReplayState:
  """Retrieval state carried across training steps (docs/reference.md §7-§8).

  Attributes:
    dedup_mask: bool [N]; True = buffer image already replayed since the last dedup reset
      (ineligible while deduplication is active). Unused (all False) with schedule 'none'.
    class_pointer: int32 []; position, in the balanced class order, of the class drawn last
      (paper §4 "Balanced": the last class was 10 -> next are 11, 12, ...). -1 before any draw,
      so the first draw starts at position 0. With the default identity order the position is
      the class index.
    num_replayed: int32 []; valid replays since the last dedup reset.
    total_replayed: int32 []; valid replays since initialisation.
    num_resets: int32 []; dedup resets so far (scheduled and automatic).
    key: uint32 [2]; raw PRNG key (legacy `jax.random.PRNGKey` layout, checkpoint friendly),
      split by every retrieval call.
    auto_reset: bool []; True iff the most recent retrieval call reset the dedup mask because
      fewer unreplayed images remained than it needed (see `dedup.auto_reset_if_exhausted`;
      the host logs it with `dedup.check_auto_reset`).
    class_order: int32 [C]; the current pass's class permutation of balanced selection with
      the released code's reshuffled order (`class_selection.balanced_classes_reshuffled`);
      [0] when the state was made without `num_classes`. Unused by the paper's sequential
      order.
    asv_left: float32 [N]; ASER-PC's precomputed ASV left term (mean over the whole buffer of
      each image's max-reduced KNN-SV, `knn_shapley.precompute_left_term`); zeros until
      `asv_left_ready`.
    asv_left_min: float32 [N]; min over the buffer's evaluation images of those KNN-SVs (for
      eq. 4's weight over a candidate subset).
    asv_left_ready: bool []; whether asv_left/asv_left_min hold the precomputed values
      (`RetrievalAlgorithm.prepare` fills them once).
  """

  dedup_mask: Array
  class_pointer: Array
  num_replayed: Array
  total_replayed: Array
  num_resets: Array
  key: Array
  auto_reset: Array
  class_order: Array
  asv_left: Array
  asv_left_min: Array
  asv_left_ready: Array

  @property
  def num_images(self) -> int:
    """N, the buffer size (static)."""
    return self.dedup_mask.shape[0]


def _raw_key(key: Any) -> Array:
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.dtype != jnp.uint32 or key.shape != (2,):
    raise ValueError(f"expected a PRNG key (typed, or raw uint32[2]); got {key.dtype}{key.shape}")
  return key


def init_replay_state(num_buffer: int, key: Any, num_classes: int = 0) -> ReplayState:
  """A fresh `ReplayState` for a buffer of `num_buffer` images.

  Args:
    num_buffer: N, the number of buffer images (static, > 0).
    key: PRNG key, typed (`jax.random.key`) or raw uint32 [2] (`jax.random.PRNGKey`); stored
      raw (uint32 [2]).
    num_classes: C, the buffer's classes (needed only by balanced selection with the
      reshuffled order; 0 = unknown). `key` is split in two: the first becomes the state's
      key (split by every retrieval call), the second draws the initial class_order, so the
      order's key is never one a retrieval call draws.
  Returns:
    ReplayState with an all-False dedup mask, class_pointer -1, zero counters, ASV left term
    not ready.
  Raises:
    ValueError: num_buffer < 1 or key is not a PRNG key.
  Source: docs/reference.md §7-§8, docs/architecture.md "Principles".
  """
  if int(num_buffer) < 1:
    raise ValueError(f"num_buffer must be >= 1, got {num_buffer}")
  # Never reuse a key: fold_in(key, 1) would equal split(key, 3)[1], the first retrieval call's
  # class key (the initial order and that call's classes would be correlated).
  state_key, order_key = jax.random.split(_raw_key(key))
  return ReplayState(
    dedup_mask=jnp.zeros((int(num_buffer),), bool),
    class_pointer=jnp.full((), -1, jnp.int32),
    # One array per field: a jit that donates the state (`donate_argnums`) rejects a buffer
    # that two of its leaves share.
    num_replayed=jnp.zeros((), jnp.int32),
    total_replayed=jnp.zeros((), jnp.int32),
    num_resets=jnp.zeros((), jnp.int32),
    key=state_key,
    auto_reset=jnp.zeros((), bool),
    class_order=jax.random.permutation(order_key, int(num_classes)).astype(jnp.int32),
    asv_left=jnp.zeros((int(num_buffer),), jnp.float32),
    asv_left_min=jnp.zeros((int(num_buffer),), jnp.float32),
    asv_left_ready=jnp.zeros((), bool),
  )


def restore_replay_state(template: ReplayState, state_dict: Mapping[str, Any]) -> ReplayState:
  """Rebuilds a `ReplayState` from a saved state dict, tolerating fields added since.

  Args:
    template: a ReplayState of the current code (e.g. `init_replay_state(N, key)`); supplies
      the values of fields that the checkpoint lacks.
    state_dict: mapping field name -> array, as written by
      `flax.serialization.to_state_dict(state)` (or orbax's restore of it). Unknown keys are
      ignored with a warning.
  Returns:
    ReplayState with the saved arrays (as jnp arrays of the saved dtype).
  Raises:
    ValueError: a saved array's shape differs from the template's (e.g. another buffer size).
  Source: this module's docstring (checkpoint compatibility).
  """
  current = flax.serialization.to_state_dict(template)
  restored = {}
  for name, value in current.items():
    if name not in state_dict or state_dict[name] is None and value is not None:
      logging.warning("ReplayState checkpoint lacks field %r; using its initial value.", name)
      restored[name] = value
      continue
    saved = state_dict[name]
    if value is not None and saved is not None and np.shape(saved) != np.shape(value):
      raise ValueError(
        f"ReplayState field {name!r}: checkpoint shape {np.shape(saved)} != "
        f"expected {np.shape(value)}"
      )
    restored[name] = saved if saved is None else jnp.asarray(saved)
  for name in state_dict:
    if name not in current:
      logging.warning("ignoring unknown ReplayState checkpoint field %r", name)
  return flax.serialization.from_state_dict(template, restored)


@flax.struct.dataclass
class ReplayBuffer:
  """Read-only per-buffer arrays used by retrieval (docs/reference.md §6-§7). All jnp arrays.

  Attributes:
    class_membership: bool [N, C]; image i contains at least one instance of class c.
    prototypes: float32 [C, E]; class prototypes (`selection.compute_prototypes`); zero rows
      for classes without members.
    prototype_distances: float32 [N, C]; d_{i,c} (`selection.prototype_distances`), +inf where
      image i is not a member of c.
    class_embeddings: float [N, k, E]; top-k class embeddings of each image (docs/reference.md §6).
    query_embeddings: float [N, k, E]; text embedding of each top token's argmax query.
    class_valid: bool [C]; class has >= 1 member image.
    image_features: float [N, k, D] or None; the ViT output tokens of the same top-k tokens
      (stored only for ASER on image features, `replay.aser.asv_features`).
    class_index: `class_index.ClassIndex`; the per-class member index (class c's members,
      padded, `class_index.counts` int32 [C] the class sizes) with the members' prototype
      distances, derived from class_membership by `make_replay_buffer` (never stored), so
      class-conditional draws read a class's members instead of an [N] column.
  """

  class_membership: Array
  prototypes: Array
  prototype_distances: Array
  class_embeddings: Array
  query_embeddings: Array
  class_valid: Array
  image_features: Array | None = None
  class_index: class_index_lib.ClassIndex | None = None

  @property
  def num_images(self) -> int:
    """N (static)."""
    return self.class_membership.shape[0]

  @property
  def num_classes(self) -> int:
    """C (static)."""
    return self.class_membership.shape[1]


def make_replay_buffer(
  class_membership,
  prototypes,
  prototype_distances,
  class_embeddings,
  query_embeddings,
  image_features=None,
) -> ReplayBuffer:
  """Builds a `ReplayBuffer` (jnp arrays) and checks the shapes agree.

  Args:
    class_membership: bool [N, C].
    prototypes: float [C, E] (cast to float32).
    prototype_distances: float [N, C] (cast to float32; +inf for non-members).
    class_embeddings: float [N, k, E].
    query_embeddings: float [N, k, E].
    image_features: optional float [N, k, D] (ASER on image features).
  Returns:
    ReplayBuffer with `class_valid = class_membership.any(0)` and the member index
    (`class_index.build_class_index`, NumPy on the host, O(N * C) once per buffer).
  Raises:
    ValueError: inconsistent shapes.
  Source: docs/reference.md §6.
  """
  membership_np = np.asarray(class_membership, bool)
  membership = jnp.asarray(membership_np)
  prototypes = jnp.asarray(prototypes, jnp.float32)
  distances = jnp.asarray(prototype_distances, jnp.float32)
  class_embeddings = jnp.asarray(class_embeddings)
  query_embeddings = jnp.asarray(query_embeddings)
  if membership.ndim != 2:
    raise ValueError(f"class_membership must be [N, C], got {membership.shape}")
  n, c = membership.shape
  if prototypes.ndim != 2 or prototypes.shape[0] != c:
    raise ValueError(f"prototypes must be [C={c}, E], got {prototypes.shape}")
  e = prototypes.shape[1]
  if distances.shape != (n, c):
    raise ValueError(f"prototype_distances must be [{n}, {c}], got {distances.shape}")
  for name, x in (("class_embeddings", class_embeddings), ("query_embeddings", query_embeddings)):
    if x.ndim != 3 or x.shape[0] != n or x.shape[2] != e:
      raise ValueError(f"{name} must be [N={n}, k, E={e}], got {x.shape}")
  if class_embeddings.shape != query_embeddings.shape:
    raise ValueError(
      "class_embeddings and query_embeddings shapes differ: "
      f"{class_embeddings.shape} vs {query_embeddings.shape}"
    )
  if image_features is not None:
    image_features = jnp.asarray(image_features)
    if image_features.ndim != 3 or image_features.shape[:2] != class_embeddings.shape[:2]:
      raise ValueError(
        f"image_features must be [N={n}, k={class_embeddings.shape[1]}, D], got "
        f"{image_features.shape}"
      )
  return ReplayBuffer(
    image_features=image_features,
    class_membership=membership,
    prototypes=prototypes,
    prototype_distances=distances,
    class_embeddings=class_embeddings,
    query_embeddings=query_embeddings,
    class_valid=membership.any(axis=0),
    class_index=class_index_lib.build_class_index(membership_np, np.asarray(distances)),
  )

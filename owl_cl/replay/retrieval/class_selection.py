"""Class-selection primitives (paper §4 "Class Selection Primitives", suppl. §B; docs/reference.md
§7).

A class-selection primitive picks one buffer class per replay slot (one slot per new image).
All functions are jittable; `num` arguments are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# Normalisation eps of `normalize`: v / max(||v||, 1e-6). (The OWL-ViT class head divides by
# ||v|| + 1e-6, docs/reference.md §1, which would leave identical vectors at distance ~2e-6 instead
# of 0.)
NORM_EPS = 1e-6
# Added to cosine distances before the inverse power (docs/reference.md §7: (d + 1e-8)^(-w)).
DISTANCE_EPS = 1e-8


def normalize(x: Array, eps: float = NORM_EPS) -> Array:
  """x / max(||x||_2, eps) along the last axis, computed in float32.

  Unit vectors stay exactly unit (so identical directions have cosine distance 0 up to
  float32 rounding); vectors shorter than eps (e.g. zero rows) stay ~0.
  Shapes: [..., E] -> [..., E] float32. Source: docs/reference.md §6-§7 (cosine distance).
  """
  x = jnp.asarray(x, jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def cosine_distance(a: Array, b: Array, eps: float = NORM_EPS) -> Array:
  """Cosine distance 1 - cos(a, b) of every a-vector to every b-vector (suppl. eq. 5).

  Args:
    a: float [..., E].
    b: float [C, E].
    eps: normalisation eps of `normalize` (vectors are divided by max(||v||, eps)).
  Returns:
    float32 [..., C], clipped to [0, 2] (rounding can push 1 - cos slightly below 0).
    Zero vectors have cos 0, i.e. distance 1.
  Source: paper suppl. §B eq. (cosine distance), docs/reference.md §6-§7. Matmul at HIGHEST
  precision.
  """
  cos = jnp.einsum(
    "...e,ce->...c", normalize(a, eps), normalize(b, eps), precision=jax.lax.Precision.HIGHEST
  )
  return jnp.clip(1.0 - cos, 0.0, 2.0)


# Reduction of SWIL's distances over an image's k top embeddings.
SWIL_REDUCTIONS = ("min", "mean")


def similarity_weighted_probs(
  class_embeddings: Array,
  prototypes: Array,
  w: float,
  class_eligible: Array,
  reduction: str = "min",
) -> Array:
  """SWIL class distribution per new image (similarity-weighted class selection).

  d[b, c] = min_j (1 - cos(class_embeddings[b, j], prototypes[c])) (cosine distance of each
  of the image's k top class embeddings to every prototype, min over k); then
  p[b, c] = (d[b, c] + 1e-8)^(-w) / Z_b over eligible classes, 0 for ineligible ones.
  Computed in float32 in log space (softmax of -w * log(d + 1e-8)), so large w cannot
  overflow; mathematically identical to normalising the powers. Vectors are normalised as
  v / max(||v||, 1e-6) (`normalize`), and d is clipped to [0, 2].

  Args:
    class_embeddings: float [B, k, E]; top-k class embeddings of each new image
      (`selection.top_k_embeddings`).
    prototypes: float [C, E]; class prototypes of the buffer.
    w: float >= 0; inverse-distance exponent (docs/reference.md §7: 1.0). w = 0 gives uniform
      over the eligible classes. May be a traced scalar.
    class_eligible: bool [C]; classes with at least one eligible buffer image.
    reduction: how d reduces the k embeddings: 'min' (paper, released default) or 'mean'
      (the released code's `swil_reduce_type='avg'`).
  Returns:
    float32 [B, C]; each row sums to 1 over eligible classes. If no class is eligible every
    row is all zeros (`sample_classes` then returns -1).
  Raises:
    ValueError: unknown `reduction`.
  Source: paper §4 and suppl. §B (with the inverse power of the prose, docs/reference.md §7),
  docs/reference.md §7;
    'mean' as the released code's `get_SWIL_retrieval_indices`.
  """
  if reduction not in SWIL_REDUCTIONS:
    raise ValueError(f"swil_reduction={reduction!r} is unknown; known: {SWIL_REDUCTIONS}")
  distances = cosine_distance(class_embeddings, prototypes)  # [B, k, C]
  d = distances.min(axis=-2) if reduction == "min" else distances.mean(axis=-2)  # [B, C]
  logits = -jnp.asarray(w, jnp.float32) * jnp.log(d + DISTANCE_EPS)
  eligible = jnp.asarray(class_eligible, bool)[None, :]
  logits = jnp.where(eligible, logits, -jnp.inf)
  top = jnp.max(jnp.where(eligible, logits, -jnp.inf), axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  unnorm = jnp.where(eligible, jnp.exp(logits - top), 0.0)
  total = unnorm.sum(axis=-1, keepdims=True)
  return jnp.where(total > 0, unnorm / jnp.where(total > 0, total, 1.0), 0.0)


def balanced_classes(
  class_pointer: Array,
  class_eligible: Array,
  num: int,
  order: Array | None = None,
  active: Array | None = None,
) -> tuple[Array, Array]:
  """Balanced class selection: the next `num` eligible classes in a fixed cyclic order.

  The paper's deterministic order: if the last class drawn was 10, the next draws are
  11, 12, ... (ineligible classes skipped), wrapping around after the last class; the pointer
  persists across calls. If `num` exceeds the number of eligible classes the cycle repeats
  within the call.

  Args:
    class_pointer: int32 []; position in `order` of the class drawn last (-1 = none yet, so
      the first class drawn is `order[0]`). `ReplayState.class_pointer`.
    class_eligible: bool [C]; classes that may be drawn (have an eligible buffer image).
    num: number of classes to draw (static).
    order: optional int32 [C] permutation of the classes (position -> class). Default: the
      identity (the paper's order; pointer = class index). Hook for the released code's
      reshuffled order is `balanced_classes_reshuffled`.
    active: optional bool [num]; inactive slots get class -1 and do not advance the pointer
      (the i-th active slot gets the i-th class of the cycle). None = all active.
  Returns:
    classes: int32 [num] class indices; -1 for inactive slots and if no class is eligible.
    new_pointer: int32 []; position of the last class drawn (unchanged if none eligible).
  Source: paper §4 "Balanced", docs/reference.md §7.
  """
  class_eligible = jnp.asarray(class_eligible, bool)
  c = class_eligible.shape[0]
  if order is None:
    order = jnp.arange(c, dtype=jnp.int32)
  order = jnp.asarray(order, jnp.int32)
  pointer = jnp.asarray(class_pointer, jnp.int32)
  positions = jnp.arange(c, dtype=jnp.int32)
  offset = jnp.mod(positions - pointer - 1, c)  # 0 = the position after pointer
  eligible_at = class_eligible[order]
  ranked = jnp.argsort(jnp.where(eligible_at, offset, offset + c))  # eligible first, cyclic
  num_eligible = jnp.sum(eligible_at, dtype=jnp.int32)
  if active is None:
    active = jnp.ones((num,), bool)
  active = jnp.asarray(active, bool)
  rank = jnp.cumsum(active, dtype=jnp.int32) - 1  # i-th active slot -> i
  slot = jnp.mod(jnp.maximum(rank, 0), jnp.maximum(num_eligible, 1))
  chosen = ranked[slot].astype(jnp.int32)
  any_eligible = num_eligible > 0
  classes = jnp.where(any_eligible & active, order[chosen], -1)
  if num == 0:
    return classes, pointer
  num_active = jnp.sum(active, dtype=jnp.int32)
  last = ranked[jnp.mod(jnp.maximum(num_active - 1, 0), jnp.maximum(num_eligible, 1))]
  new_pointer = jnp.where(any_eligible & (num_active > 0), last.astype(jnp.int32), pointer)
  return classes, new_pointer


def balanced_classes_reshuffled(
  key: Array, class_pointer: Array, class_order: Array, class_eligible: Array, active: Array
) -> tuple[Array, Array, Array]:
  """Balanced class selection in a random order reshuffled after every pass (released code).

  Walks `class_order` from the position after `class_pointer`, skipping ineligible classes;
  when the end of the order is reached a new random permutation is drawn and the walk
  starts again at its position 0 (the released `get_UB_retrieval_indices`: `rng.shuffle`
  at every wrap). Inactive slots get -1 and do not move the walk.

  Args:
    key: PRNG key (split once per slot; used only when a pass ends).
    class_pointer: int32 []; position in `class_order` of the class drawn last (-1 = none).
    class_order: int32 [C]; the current pass's permutation (`ReplayState.class_order`).
    class_eligible: bool [C].
    active: bool [num].
  Returns:
    classes: int32 [num] (-1 for inactive slots or if no class is eligible);
    new_pointer: int32 []; new_order: int32 [C].
  Source: released code (5hadytru/optimal_retrieval `ReplayBuffer.get_UB_retrieval_indices`),
    offered as an option (docs/reference.md §7).
  """
  class_eligible = jnp.asarray(class_eligible, bool)
  c = class_eligible.shape[0]
  positions = jnp.arange(c, dtype=jnp.int32)
  active = jnp.asarray(active, bool)
  keys = jax.random.split(key, active.shape[0])
  any_eligible = class_eligible.any()

  def step(carry, inputs):
    pointer, order = carry
    k, on = inputs
    ahead = class_eligible[order] & (positions > pointer)
    wrap = ~ahead.any()
    order_new = jnp.where(wrap, jax.random.permutation(k, c).astype(jnp.int32), order)
    candidates = jnp.where(wrap, class_eligible[order_new], ahead)
    position = jnp.argmax(candidates).astype(jnp.int32)
    take = on & any_eligible
    cls = jnp.where(take, order_new[position], -1)
    pointer = jnp.where(take, position, pointer)
    order = jnp.where(take, order_new, order)
    return (pointer, order), cls

  (pointer, order), classes = jax.lax.scan(
    step,
    (jnp.asarray(class_pointer, jnp.int32), jnp.asarray(class_order, jnp.int32)),
    (keys, active),
  )
  return classes, pointer, order


def sample_classes(key: Array, probs: Array) -> Array:
  """Draws one class per row of `probs`.

  Args:
    key: PRNG key.
    probs: float [B, C] non-negative rows (need not be normalised).
  Returns:
    int32 [B] class indices ~ probs[b]; -1 for rows without mass (no eligible class).
  Source: paper suppl. §B step 5, docs/reference.md §7.
  """
  probs = jnp.asarray(probs, jnp.float32)
  has_mass = probs.sum(axis=-1) > 0
  logits = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
  drawn = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
  return jnp.where(has_mass, drawn, -1)

"""Replay buffer construction: selection (eq. 7), prototypes (docs/reference.md §6).

Host-side selection (`select_buffer`, NumPy, once) and jittable per-batch feature functions
meant to run inside the jitted forward over D_pt / the buffer images:

  pass 1 (over the buffer images):
    class_emb, query_emb = top_k.top_k_embeddings(...)               # stored per image
    sums, counts = per_image_class_token_embeddings(...)             # accumulate over batches
  prototypes, class_valid = compute_prototypes(total_sums, total_counts)
  pass 2: prototype_distances(..., prototypes, ...)                 # [N, C], stored

The top-k tokens of the model's outputs (`owl_cl.train.top_k`) live beside the train step,
which computes them for retrieval.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.replay.retrieval.class_selection import NORM_EPS
from owl_cl.replay.retrieval.class_selection import normalize

Array = jax.Array


# -------------------------------------------------------------------------------- eq. (7)
TOP_UP_ORDERS = ("class_index", "first_appearance")
# Images the class prototypes average over: 'buffer' (the selected images) | 'all' (every
# image of the pre-training set, as the released code's `prototype_utils.compute_prototypes`).
PROTOTYPE_IMAGES = ("buffer", "all")


def select_buffer(
  per_image_loss,
  class_membership,
  threshold: float,
  min_per_class: int = 50,
  fill_all_for_rare_classes: bool = False,
  drop_images_without_class: bool = False,
  top_up_order: str = "class_index",
) -> np.ndarray:
  """Replay buffer selection over D_pt (paper eq. 7 and §4 "Replay Buffer Selection").

  1. keep = loss < threshold (NaN losses count as +inf: never kept by the threshold).
  2. For each class c in index order, if fewer than `min_per_class` kept images contain c,
     add c's not-yet-kept images in ascending loss order (ties: lower index first) until c
     has `min_per_class` kept images (or all its images). Counts include images added for
     earlier classes, so after the loop every class has >= min(min_per_class, #images of c).
     With `fill_all_for_rare_classes` (as in the released code) such a class gets *all* its
     images instead.
  3. With `drop_images_without_class` (as in the released code), images containing no class
     are removed at the end (by default they stay if their loss is under the threshold).

  `top_up_order` is the order in which step 2 visits the classes (it matters: images added
  for one class count for the others): 'class_index' (0, 1, ..., C-1) or 'first_appearance'
  (the released code's dict order: classes in order of their first kept image (by image
  index; within an image by class index), then the classes with no kept image in order of
  their first image overall, then those with no image).

  Args:
    per_image_loss: float [N_pt], the pre-trained model's detection loss per image.
    class_membership: bool [N_pt, C], image contains class c.
    threshold: t (O365 0.15; VG 0.0 keeps none by threshold).
    min_per_class: the per-class minimum (50).
    fill_all_for_rare_classes: released-code behaviour (see 2.).
    drop_images_without_class: released-code behaviour (see 3.).
    top_up_order: 'class_index' | 'first_appearance' (released code).
  Returns:
    np.ndarray bool [N_pt], True = in the buffer.
  Raises:
    ValueError: shape mismatch, negative min_per_class, or unknown top_up_order.
  Source: paper eq. (7) and §4, docs/reference.md §6.
  """
  loss = np.asarray(per_image_loss, np.float64).reshape(-1)
  membership = np.asarray(class_membership, bool)
  if membership.ndim != 2 or membership.shape[0] != loss.shape[0]:
    raise ValueError(f"class_membership must be [N_pt={loss.shape[0]}, C], got {membership.shape}")
  if min_per_class < 0:
    raise ValueError(f"min_per_class must be >= 0, got {min_per_class}")
  if top_up_order not in TOP_UP_ORDERS:
    raise ValueError(
      f"replay.selection.top_up_order={top_up_order!r} is unknown; known: {list(TOP_UP_ORDERS)}"
    )
  loss = np.where(np.isnan(loss), np.inf, loss)
  keep = loss < threshold
  order = np.argsort(loss, kind="stable")  # ascending loss, ties by index
  sorted_membership = membership[order]
  num_images, num_classes = membership.shape
  classes = np.arange(num_classes)
  if top_up_order == "first_appearance":

    def first_image(rows):
      return np.where(rows.any(axis=0), np.argmax(rows, axis=0), num_images)

    first_kept = first_image(membership & keep[:, None])
    first_any = first_image(membership)
    # Kept classes first (by first kept image), then the others (by first image overall).
    classes = np.lexsort((classes, first_any, first_kept))
  for c in classes:
    members = membership[:, c]
    deficit = min_per_class - int(np.count_nonzero(keep & members))
    if deficit <= 0:
      continue
    candidates = order[sorted_membership[:, c] & ~keep[order]]
    keep[candidates if fill_all_for_rare_classes else candidates[:deficit]] = True
  if drop_images_without_class:
    keep &= membership.any(axis=1)
  return keep


# ------------------------------------------------------------------------------ prototypes
def instance_counts_from_labels(labels: Array, query_class: Array, num_classes: int) -> Array:
  """Instances of each class per image, from the batch targets (CONVENTIONS batch dict).

  count[b, c] = sum over instances m and queries q with query_class[b, q] == c of
  labels[b, m, q]. Padding instances only set column 0 ('' with query_class -1), so they do
  not count; negative queries have all-zero columns.

  Args:
    labels: float [B, M, Q] multi-hot.
    query_class: int [B, Q], -1 for ''.
    num_classes: C (static).
  Returns:
    int32 [B, C]. `counts > 0` is the class membership.
  Source: docs/reference.md §3 (targets), §6.
  """
  per_query = jnp.round(jnp.asarray(labels, jnp.float32).sum(axis=1)).astype(jnp.int32)
  query_class = jnp.asarray(query_class, jnp.int32)
  b = query_class.shape[0]
  target = jnp.where(query_class >= 0, query_class, num_classes)  # -1 -> dropped
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], target.shape)
  return jnp.zeros((b, num_classes), jnp.int32).at[rows, target].add(per_query, mode="drop")


def _class_token_ranking(
  pred_logits: Array, query_class: Array, instance_counts: Array, max_tokens: int
):
  """Top `max_tokens` tokens per (image, class) by the logit of the class's query.

  Returns idx int32 [B, C, K], mask bool [B, C, K] (slot j used iff j < min(K, count) and the
  class has a query in the image).
  """
  counts = jnp.asarray(instance_counts, jnp.int32)
  b, c = counts.shape
  logits = jnp.asarray(pred_logits, jnp.float32)
  query_class = jnp.asarray(query_class, jnp.int32)
  q = query_class.shape[1]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], query_class.shape)
  target = jnp.where(query_class >= 0, query_class, c)
  query_of_class = (
    jnp.full((b, c), -1, jnp.int32)
    .at[rows, target]
    .max(jnp.broadcast_to(jnp.arange(q, dtype=jnp.int32), query_class.shape), mode="drop")
  )
  class_logits = jnp.take_along_axis(
    logits, jnp.maximum(query_of_class, 0)[:, None, :], axis=2
  )  # [B, T, C]
  _, idx = jax.lax.top_k(jnp.swapaxes(class_logits, 1, 2), max_tokens)  # [B, C, K]
  n = jnp.where(query_of_class >= 0, jnp.minimum(counts, max_tokens), 0)
  mask = jnp.arange(max_tokens)[None, None, :] < n[:, :, None]
  return idx.astype(jnp.int32), mask


def per_image_class_token_embeddings(
  pred_logits: Array,
  class_embeddings: Array,
  query_class: Array,
  instance_counts: Array,
  max_per_class: int = 6,
) -> tuple[Array, Array]:
  """Per image and class: sum and number of the class embeddings entering the prototype.

  For image b and class c with a query q_c in the image (query_class[b, q_c] == c; if
  several, the highest query index): the n = min(max_per_class, instance_counts[b, c])
  tokens with the largest logit pred_logits[b, :, q_c] (= largest sigmoid; ties to the lower
  token index). sums[b, c] = sum of their class embeddings as given (the model's normalised
  ones, so every token weighs the same in the prototype; float32);
  counts[b, c] = n (0 if c has no instance or no query in the image).

  Args:
    pred_logits: float [B, T, Q].
    class_embeddings: float [B, T, E].
    query_class: int [B, Q] contiguous class per query, -1 for ''.
    instance_counts: int [B, C] (`instance_counts_from_labels`).
    max_per_class: static cap on n (6), <= T.
  Returns:
    sums: float32 [B, C, E]; counts: int32 [B, C]. Accumulate both over all batches and call
    `compute_prototypes`.
  Source: docs/reference.md §6 ("Prototype"), paper §4.
  """
  idx, mask = _class_token_ranking(pred_logits, query_class, instance_counts, max_per_class)
  b, c, k = idx.shape
  emb = jnp.asarray(class_embeddings, jnp.float32)
  gathered = jnp.take_along_axis(emb, idx.reshape(b, c * k)[:, :, None], axis=1)
  gathered = gathered.reshape(b, c, k, -1)
  sums = jnp.sum(jnp.where(mask[..., None], gathered, 0.0), axis=2)
  return sums, mask.sum(axis=-1, dtype=jnp.int32)


def compute_prototypes(sums: Array, counts: Array) -> tuple[Array, Array]:
  """Class prototypes: the mean of all selected class embeddings of each class.

  p_c = (sum over images b of sums[b, c]) / (sum over b of counts[b, c]): every selected
  token weighs the same (pooled mean over the images containing c). With the model's
  normalised class embeddings this is the plain mean of unit vectors, not re-normalised
  (as in the released code's `prototype_utils.compute_prototypes`).

  Args:
    sums: float [..., C, E] (any leading dims are summed; e.g. [B, C, E] or already [C, E]).
    counts: int [..., C] with the same leading dims.
  Returns:
    prototypes: float32 [C, E] (zero rows where the count is 0);
    class_valid: bool [C] (count > 0).
  Raises:
    ValueError: shapes disagree.
  Source: docs/reference.md §6, paper §4 ("prototype" = average class embedding).
  """
  sums = jnp.asarray(sums, jnp.float32)
  counts = jnp.asarray(counts)
  if sums.shape[:-1] != counts.shape:
    raise ValueError(f"sums {sums.shape} and counts {counts.shape} disagree")
  lead = tuple(range(sums.ndim - 2))
  total = sums.sum(axis=lead)
  n = counts.astype(jnp.float32).sum(axis=lead)
  valid = n > 0
  return jnp.where(valid[:, None], total / jnp.where(valid, n, 1.0)[:, None], 0.0), valid


def buffer_prototypes(
  sums: Array, counts: Array, keep: Array, prototype_images: str = "buffer"
) -> tuple[Array, Array]:
  """The buffer's class prototypes: `compute_prototypes` over the kept images ('buffer') or
  over every analysed image of the pre-training set ('all', the released code).

  Args:
    sums: float [N, C, E]; per image, the sum of its top-n_c class-c embeddings.
    counts: int [N, C]; the number of tokens in `sums`.
    keep: bool [N]; the selected buffer images.
    prototype_images: 'buffer' | 'all' (`PROTOTYPE_IMAGES`).
  Returns:
    (prototypes float32 [C, E], class_valid bool [C]) as `compute_prototypes`.
  Raises:
    ValueError: unknown `prototype_images`.
  Source: docs/reference.md §6; released code `torch_replay_utils/prototype_utils.py`
    `compute_prototypes` (over every image's embeddings, before `add_proto_dists` scores
    the subset).
  """
  if prototype_images not in PROTOTYPE_IMAGES:
    raise ValueError(
      f"replay.selection.prototype_images={prototype_images!r} is unknown; "
      f"known: {list(PROTOTYPE_IMAGES)}"
    )
  keep = np.asarray(keep, bool)
  rows = keep if prototype_images == "buffer" else np.ones_like(keep)
  return compute_prototypes(np.asarray(sums)[rows], np.asarray(counts)[rows])


def prototype_distances(
  pred_logits: Array,
  class_embeddings: Array,
  query_class: Array,
  instance_counts: Array,
  prototypes: Array,
  max_instances: int,
) -> Array:
  """Prototype distance of each image to each class it contains (docs/reference.md §6, paper eq. 1).

  d[b, c] = min over image b's class-c embeddings of 1 - cos(p_c, e), where the class-c
  embeddings are those of the n = min(max_instances, instance_counts[b, c]) tokens with the
  largest logit for c's query (as `per_image_class_token_embeddings`, but n = the number of
  instances, not capped at 6); cos uses v / max(||v||, 1e-6) normalisation, distances clipped to
  [0, 2]. d = +inf where n = 0 (image not a member of c, or c has no query).

  Args:
    pred_logits: float [B, T, Q].
    class_embeddings: float [B, T, E].
    query_class: int [B, Q], -1 for ''.
    instance_counts: int [B, C].
    prototypes: float [C, E] (`compute_prototypes`).
    max_instances: static cap on n; pass M (max instances per image) so nothing is capped.
  Returns:
    float32 [B, C].
  Source: docs/reference.md §6, paper eq. (1) (GRASP prototype distance).
  """
  idx, mask = _class_token_ranking(pred_logits, query_class, instance_counts, max_instances)
  cos = jnp.einsum(
    "bte,ce->bct",
    normalize(class_embeddings, NORM_EPS),
    normalize(prototypes, NORM_EPS),
    precision=jax.lax.Precision.HIGHEST,
  )
  dist = jnp.clip(1.0 - jnp.take_along_axis(cos, idx, axis=2), 0.0, 2.0)  # [B, C, K]
  return jnp.min(jnp.where(mask, dist, jnp.inf), axis=-1)

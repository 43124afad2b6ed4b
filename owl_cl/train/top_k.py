"""The top-k tokens of the model's outputs and their embeddings (docs/reference.md §6).

Jittable per-batch functions over the detector's outputs, used by the train step's retrieval
features (`train.step.make_embed_step`, `make_new_loss_step`) and by the buffer's passes over
the pre-training images (`replay.build`). Beside the step, below replay, so the step imports
nothing of replay (docs/architecture.md, "Layers").

Token ranking note: sigmoid is monotonic, so ranking tokens by sigmoid(logit) is ranking them
by logit; we rank by the float32 logit, which avoids the ties that float32 saturation of the
sigmoid (logit > ~17) would create. Ties go to the lower token index (`lax.top_k`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


# ------------------------------------------------------------------------ top-k embeddings
def _masked_query_logits(pred_logits: Array, query_mask: Array) -> Array:
  logits = jnp.asarray(pred_logits, jnp.float32)
  return jnp.where(jnp.asarray(query_mask, bool)[:, None, :], logits, -jnp.inf)


def top_k_tokens(pred_logits: Array, query_mask: Array, k: int = 8) -> Array:
  """Indices of each image's k most confident tokens (docs/reference.md §6, suppl. §B step 1).

  Tokens are ranked by max over valid queries of sigmoid(logit) (= by the max valid logit;
  see the module docstring).

  Args:
    pred_logits: float [B, T, Q].
    query_mask: bool [B, Q]; valid queries. Use the image's real class queries (e.g.
      `query_class >= 0`); padded/'' queries should be False.
    k: static number of tokens (8), <= T.
  Returns:
    int32 [B, k], most confident first. An image without valid queries gets tokens 0..k-1.
  Source: docs/reference.md §6-§7 (computed with the query mask; docs/reference.md §12: no unmasked
  logits).
  """
  score = _masked_query_logits(pred_logits, query_mask).max(axis=-1)  # [B, T]
  _, idx = jax.lax.top_k(score, k)
  return idx.astype(jnp.int32)


def top_k_embeddings(
  pred_logits: Array,
  class_embeddings: Array,
  query_embeddings: Array,
  query_mask: Array,
  k: int = 8,
) -> tuple[Array, Array]:
  """Top-k class embeddings and their matching query (text) embeddings (docs/reference.md §6).

  Args:
    pred_logits: float [B, T, Q].
    class_embeddings: float [B, T, E] (the model's class embeddings: normalised, as scenic's
      class head returns them with queries).
    query_embeddings: float [B, Q, E] (text projection output, not normalised).
    query_mask: bool [B, Q] valid queries (see `top_k_tokens`).
    k: static (8).
  Returns:
    class_emb: [B, k, E] class embeddings of the `top_k_tokens` (dtype of the input).
    query_emb: [B, k, E] query embedding of each token's argmax valid query.
  Source: docs/reference.md §6, paper Fig. "replay buffer contents".
  """
  logits = _masked_query_logits(pred_logits, query_mask)
  _, idx = jax.lax.top_k(logits.max(axis=-1), k)  # [B, k]
  class_emb = jnp.take_along_axis(class_embeddings, idx[:, :, None], axis=1)
  best_query = jnp.take_along_axis(logits, idx[:, :, None], axis=1).argmax(axis=-1)  # [B, k]
  query_emb = jnp.take_along_axis(query_embeddings, best_query[:, :, None], axis=1)
  return class_emb, query_emb


def top_k_token_features(
  pred_logits: Array, token_features: Array, query_mask: Array, k: int = 8
) -> Array:
  """Any per-token features [B, T, D] of the same top-k tokens as `top_k_embeddings`.

  Used for the ViT's output image tokens (the model's `feature_map` flattened row-major),
  which the released code's ASER can use for its distances instead of the class embeddings
  (`cls_embeds=False`).

  Args:
    pred_logits: float [B, T, Q]. token_features: [B, T, D]. query_mask: bool [B, Q].
    k: static.
  Returns:
    [B, k, D] (dtype of the input), tokens in the order of `top_k_embeddings`.
  Source: docs/reference.md §6-§7; released code `opt_utils.Features` (image_features),
    `C_ASER.retrieve` (top-k gather).
  """
  logits = _masked_query_logits(pred_logits, query_mask)
  _, idx = jax.lax.top_k(logits.max(axis=-1), k)  # [B, k]
  return jnp.take_along_axis(token_features, idx[:, :, None], axis=1)

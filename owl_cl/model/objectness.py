"""OWLv2's objectness: token selection by objectness (training) and the query token of an
image (image-conditioned detection). Pure functions of arrays; the objectness head itself is a
``PredictorMLP`` with one output inside ``owl_cl.model.owl_vit.OwlViT`` (``version='owlv2'``).

Source: docs/owlv2.md; scenic `scenic/projects/owl_vit/models.py`
(``TextZeroShotDetectionModule.objectness_predictor``, ``__call__``'s ``objectness_top_k``);
HF transformers `models/owlv2/modeling_owlv2.py` (``Owlv2ForObjectDetection.embed_image_query``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
  "gather_tokens",
  "query_token_index",
  "top_k_tokens",
]


def top_k_tokens(objectness_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The ``k`` tokens of highest objectness per image (scenic's ``objectness_top_k``).

  Args:
    objectness_logits: float ``[B, T]`` objectness logits.
    k: int, ``1 <= k <= T`` (static).

  Returns:
    ``(logits [B, k], indices [B, k] int32)``, logits in decreasing order; ties go to the lower
    token index (``jax.lax.top_k``).

  Raises:
    ValueError: ``k`` outside ``[1, T]`` or logits not ``[B, T]``.

  Source: scenic `scenic/projects/owl_vit/models.py` (``__call__``: ``jax.lax.top_k`` of
  ``outputs['objectness_logits']``).
  """
  if objectness_logits.ndim != 2:
    raise ValueError(f"objectness_logits must be [B, T], got {objectness_logits.shape}")
  t = objectness_logits.shape[1]
  if not 1 <= int(k) <= t:
    raise ValueError(f"objectness_top_k must be in [1, {t}] (the image tokens), got {k}")
  return jax.lax.top_k(objectness_logits, int(k))


def gather_tokens(x: jax.Array, indices: jax.Array) -> jax.Array:
  """Rows of ``x`` at per-image token indices.

  Args:
    x: ``[B, T, ...]`` (for a table shared by every image, e.g. the box bias ``[T, 4]``,
      pass ``table[None]``: a leading 1 broadcasts over the images).
    indices: int ``[B, k]``.

  Returns:
    ``[B, k, ...]``, same dtype as ``x``.

  Source: scenic `scenic/projects/owl_vit/models.py` (``jnp.take_along_axis`` of the image
  features and of the box bias).
  """
  x = jnp.broadcast_to(x, (indices.shape[0],) + tuple(x.shape[1:]))
  idx = indices.reshape(tuple(indices.shape) + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


def query_token_index(objectness_logits: jax.Array) -> jax.Array:
  """The token of highest objectness per image: OWLv2's query box when an example image is
  given without a box (image-conditioned detection).

  Args:
    objectness_logits: float ``[B, T]``.

  Returns:
    int32 ``[B]``; ties go to the lower index (as ``torch.argmax``).

  Source: HF transformers `models/owlv2/modeling_owlv2.py` (``embed_image_query``:
  ``objectness_logits.argmax(dim=-1)``).
  """
  if objectness_logits.ndim != 2:
    raise ValueError(f"objectness_logits must be [B, T], got {objectness_logits.shape}")
  return jnp.argmax(objectness_logits, axis=-1).astype(jnp.int32)

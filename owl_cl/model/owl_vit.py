"""OWL-ViT v1 and OWLv2 detector (Flax linen), parameter tree identical to scenic's.

Source: docs/reference.md §1 (architecture, heads, box bias), §1.1 (parameter tree), §0 (hf_compat,
precision); scenic `scenic/projects/owl_vit/models.py` (``TextZeroShotDetectionModule``),
`scenic/projects/owl_vit/layers.py` (``ClipImageTextEmbedder``, ``ClassPredictor``,
``PredictorMLP``) and `scenic/projects/owl_vit/utils.py` (``compute_box_bias``).

Parameter tree (under ``params``)::

    backbone/clip/{logit_scale, text/..., visual/...}     (see owl_cl.model.clip)
    backbone/merged_class_token/{scale, bias}             LayerNorm, eps 1e-6 (HF: 1e-5)
    class_head/{Dense_0, logit_shift, logit_scale}
    obj_box_head/{Dense_0, Dense_1, Dense_2}
    objectness_head/{Dense_0, Dense_1, Dense_2}           OWLv2 only (version='owlv2')

Precision: ``dtype`` is the compute dtype of the CLIP towers (float32 or bfloat16); parameters
are float32; the merged-class-token LayerNorm, both heads and every output are float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.model import clip as clip_lib
from owl_cl.model import objectness as objectness_lib
from owl_cl.model.text import DEFAULT_CONTEXT_LENGTH
from owl_cl.model.tokenizer import DEFAULT_VOCAB_SIZE
from owl_cl.model.variants import MODEL_VERSIONS
from owl_cl.model.variants import OVERRIDE_RULES
from owl_cl.model.variants import VARIANTS
from owl_cl.model.variants import ModelConfig
from owl_cl.model.variants import get_variant_config

__all__ = [
  "BOX_BIAS_EPS",
  "ClassPredictor",
  "ClipImageTextEmbedder",
  "LOGIT_SHIFT_BIAS_INIT",
  "MASKED_LOGIT",
  "MERGED_CLASS_TOKEN_EPS",
  "MODEL_VERSIONS",
  "ModelConfig",
  "OwlViT",
  "PredictorMLP",
  "VARIANTS",
  "compute_box_bias",
  "create_model",
  "get_variant_config",
  "logit",
]

Dtype = Any

#: LayerNorm eps of ``backbone/merged_class_token`` (flax default, scenic). HF uses 1e-5.
MERGED_CLASS_TOKEN_EPS = 1e-6
MERGED_CLASS_TOKEN_EPS_HF = 1e-5
#: Logit of padded (masked) queries (scenic). HF uses float32 min.
MASKED_LOGIT = -1e6
MASKED_LOGIT_HF = float(np.finfo(np.float32).min)
#: ``class_head/logit_shift`` bias init: log(p / (1 - p)) with prior p = 0.01.
LOGIT_SHIFT_BIAS_INIT = float(np.log(0.01) - np.log1p(-0.01))  # -4.59512
#: Epsilon of the box-bias logit.
BOX_BIAS_EPS = 1e-4
_NORM_EPS = 1e-6

# --------------------------------------------------------------------------------------------
# Box bias.
# --------------------------------------------------------------------------------------------


def logit(x, eps: float = BOX_BIAS_EPS):
  """Inverse sigmoid with an epsilon: ``log(x + eps) - log1p(-x + eps)``.

  Args:
    x: float array (numpy or jax), values in [0, 1]. eps: float.

  Returns:
    Array of the same shape/dtype/library.

  Source: docs/reference.md §1 (box bias); scenic `scenic/projects/owl_vit/utils.py` (``logit``).
  """
  xp = jnp if isinstance(x, jax.Array) else np
  return xp.log(x + eps) - xp.log1p(-x + eps)


def compute_box_bias(h: int, w: int) -> np.ndarray:
  """Box bias of an ``h x w`` token grid, added to the box head's output before sigmoid.

  For grid cell (i, j) (row-major token order ``i * w + j``): centre bias
  ``logit(((j + 1) / w, (i + 1) / h))`` (bottom-right **corners**, clipped to [0, 1]) and size
  bias ``logit(1 / w)`` for both width and height, with ``logit(x) = log(x + 1e-4) -
  log1p(-x + 1e-4)``. Computed in float32 as scenic does. Values: 60 x 60 grid: size bias
  -4.071657, last row/column 9.210275 (9.21044 in float64); 3 x 3 grid: -0.692997, 0.692997,
  9.210275.

  Args:
    h: grid rows (int >= 1). w: grid columns (int >= 1).

  Returns:
    ``np.ndarray`` float32 ``[h * w, 4]`` ordered (cx, cy, w, h) in logit space.

  Raises:
    ValueError: if ``h`` or ``w`` < 1.

  Source: docs/reference.md §1 (box head, box bias); scenic `scenic/projects/owl_vit/utils.py`
  (``compute_box_bias``, ``normalized_grid_corner_coordinates``, kind='both').
  """
  h, w = int(h), int(w)
  if h < 1 or w < 1:
    raise ValueError(f"grid must be at least 1x1, got {h}x{w}")
  xs, ys = np.meshgrid(np.arange(1, w + 1), np.arange(1, h + 1))
  xy = np.stack([xs, ys], axis=-1).astype(np.float32) / np.array([w, h], np.float32)
  xy = np.clip(xy.reshape(h * w, 2), 0.0, 1.0)
  eps = np.float32(BOX_BIAS_EPS)
  xy_bias = logit(xy, eps)
  wh_bias = logit(np.full_like(xy, np.float32(1.0) / np.float32(w)), eps)
  return np.concatenate([xy_bias, wh_bias], axis=-1).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Modules.
# --------------------------------------------------------------------------------------------


class ClipImageTextEmbedder(nn.Module):
  """The ``backbone``: CLIP towers (``clip``) + the 'mul-ln' class-token merge.

  ``embed_images(images [B,S,S,3] in [0,1], train) -> [B, P, D]`` float32: CLIP normalisation,
  vision tower (all tokens after ``ln_post``), then patches * class token (broadcast) ->
  LayerNorm ``merged_class_token`` (eps 1e-6; 1e-5 with ``hf_compat``).
  ``embed_texts(tokens [..., L] int, train) -> [..., E]`` float32 (not normalised).

  Attributes: see :class:`OwlViT` (same names).

  Source: docs/reference.md §1 (vision tower, class-token merge); scenic
  `scenic/projects/owl_vit/layers.py` (``ClipImageTextEmbedder``, merge_class_token='mul-ln').
  """

  vocab_size: int
  context_length: int
  embed_dim: int
  patch_size: int
  vision_width: int
  vision_layers: int
  vision_heads: int
  vision_mlp_dim: int
  text_width: int
  text_layers: int
  text_heads: int
  text_mlp_dim: int
  text_stochastic_depth: float = 0.1
  vision_stochastic_depth: float = 0.2
  hf_compat: bool = False
  dtype: Dtype = jnp.float32
  attention: str = "auto"
  remat: str = "none"

  def setup(self):
    self.clip = clip_lib.CLIP(
      vocab_size=self.vocab_size,
      embed_dim=self.embed_dim,
      context_length=self.context_length,
      text_width=self.text_width,
      text_layers=self.text_layers,
      text_heads=self.text_heads,
      text_mlp_dim=self.text_mlp_dim,
      vision_width=self.vision_width,
      vision_layers=self.vision_layers,
      vision_heads=self.vision_heads,
      vision_mlp_dim=self.vision_mlp_dim,
      patch_size=self.patch_size,
      text_stochastic_droplayer_rate=self.text_stochastic_depth,
      vision_stochastic_droplayer_rate=self.vision_stochastic_depth,
      dtype=self.dtype,
      attention=self.attention,
      remat=self.remat,
    )
    eps = MERGED_CLASS_TOKEN_EPS_HF if self.hf_compat else MERGED_CLASS_TOKEN_EPS
    self.merged_class_token = nn.LayerNorm(epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32)

  def embed_images(self, images: jax.Array, train: bool = False) -> jax.Array:
    """``[B, S, S, 3]`` in [0, 1] -> merged patch tokens ``[B, P, D]`` float32."""
    x = clip_lib.normalize_image(images)
    tokens = self.clip.encode_image(x, deterministic=not train).astype(jnp.float32)
    merged = tokens[:, 1:, :] * tokens[:, :1, :]
    return self.merged_class_token(merged)

  def embed_texts(self, texts: jax.Array, train: bool = False) -> jax.Array:
    """``[..., L]`` int tokens -> ``[..., E]`` float32 (rows flattened through the tower)."""
    lead = texts.shape[:-1]
    flat = texts.reshape(-1, texts.shape[-1])
    emb = self.clip.encode_text(flat, deterministic=not train).astype(jnp.float32)
    return emb.reshape(lead + (emb.shape[-1],))

  def __call__(self, images=None, texts=None, *, train: bool = False):
    """Returns ``(image_tokens [B,P,D] or None, text_embeddings [..., E] or None)``."""
    img = None if images is None else self.embed_images(images, train)
    txt = None if texts is None else self.embed_texts(texts, train)
    return img, txt


class ClassPredictor(nn.Module):
  """Open-vocabulary class head (``class_head``), computed in float32.

  ``e = Dense_0(x)`` (D -> E, kernel init normal(1e-6)) are the class embeddings;
  ``sim = <e / (||e|| + 1e-6), q / (||q|| + 1e-6)>``; ``shift = logit_shift(x)`` (Dense(1),
  bias init -4.59512), ``scale = elu(logit_scale(x)) + 1``; ``logits = (sim + shift) * scale``;
  logits of masked queries (``query_mask == 0``) = -1e6 (float32 min with ``hf_compat``).

  Attributes:
    out_dim: E. hf_compat: HF's masked-logit value.

  Call: ``x [B, T, D]``, ``query_embeddings [B, Q, E]`` or None, ``query_mask [B, Q]``
  (bool/0-1) or None. Returns ``{'class_embeddings': [B, T, E]}`` plus
  ``'pred_logits': [B, T, Q]`` when query embeddings are given; float32. As scenic's, the
  returned class embeddings are ``e`` (raw) without queries and ``e / (||e|| + 1e-6)`` (the
  normalised ones the logits use) with queries.

  Source: docs/reference.md §1 (class head); scenic `scenic/projects/owl_vit/layers.py`
  (``ClassPredictor``, normalize=True).
  """

  out_dim: int
  hf_compat: bool = False

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    query_embeddings: jax.Array | None = None,
    query_mask: jax.Array | None = None,
  ) -> dict[str, jax.Array]:
    x = x.astype(jnp.float32)
    class_emb = nn.Dense(
      self.out_dim, kernel_init=nn.initializers.normal(1e-6), dtype=jnp.float32, name="Dense_0"
    )(x)
    if query_embeddings is None:
      return {"class_embeddings": class_emb}
    if query_embeddings.ndim != 3 or query_embeddings.shape[-1] != self.out_dim:
      raise ValueError(
        f"query_embeddings must be [B, Q, {self.out_dim}], got {query_embeddings.shape}"
      )
    q = query_embeddings.astype(jnp.float32)
    e = class_emb / (jnp.linalg.norm(class_emb, axis=-1, keepdims=True) + _NORM_EPS)
    q = q / (jnp.linalg.norm(q, axis=-1, keepdims=True) + _NORM_EPS)
    logits = jnp.einsum("...pd,...qd->...pq", e, q)
    shift = nn.Dense(
      1,
      bias_init=nn.initializers.constant(LOGIT_SHIFT_BIAS_INIT),
      dtype=jnp.float32,
      name="logit_shift",
    )(x)
    scale = nn.elu(nn.Dense(1, dtype=jnp.float32, name="logit_scale")(x)) + 1.0
    logits = (logits + shift) * scale
    if query_mask is not None:
      fill = MASKED_LOGIT_HF if self.hf_compat else MASKED_LOGIT
      valid = jnp.asarray(query_mask) != 0
      logits = jnp.where(valid[..., None, :], logits, jnp.float32(fill))
    # As scenic (and HF): with queries, the returned class embeddings are the normalised ones
    # the logits are scored with; retrieval (buffer, prototypes, SWIL, GRASP, ASER) uses them.
    return {"pred_logits": logits, "class_embeddings": e}


class PredictorMLP(nn.Module):
  """Box head MLP (``obj_box_head``): Dense(D)-gelu-Dense(D)-gelu-Dense(4, zero init), float32.

  GELU is flax's default tanh approximation (scenic); exact erf GELU with ``hf_compat``.

  Attributes:
    out_dim: 4. num_layers: 3. hf_compat: exact GELU.

  Call: ``x [B, T, D]`` -> ``[B, T, out_dim]`` float32 (before box bias and sigmoid).

  Source: docs/reference.md §1 (box head); scenic `scenic/projects/owl_vit/layers.py`
  (``PredictorMLP``).
  """

  out_dim: int = 4
  num_layers: int = 3
  hf_compat: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    width = x.shape[-1]
    for i in range(self.num_layers - 1):
      x = nn.Dense(width, dtype=jnp.float32, name=f"Dense_{i}")(x)
      x = nn.gelu(x, approximate=not self.hf_compat)
    return nn.Dense(
      self.out_dim,
      kernel_init=nn.initializers.zeros,
      dtype=jnp.float32,
      name=f"Dense_{self.num_layers - 1}",
    )(x)


class OwlViT(nn.Module):
  """OWL-ViT v1 / OWLv2 text-conditioned detector (scenic ``TextZeroShotDetectionModule``).

  Build with :func:`create_model`. Fields (defaults = the ``tiny`` variant):
  ``tokenizer`` (name, informational), ``vocab_size``, ``context_length`` (L), ``embed_dim``
  (E), ``image_size`` (S px), ``patch_size`` (px), ``vision_width`` (D), ``vision_layers``,
  ``vision_heads``, ``vision_mlp_dim``, ``text_width``, ``text_layers``, ``text_heads``,
  ``text_mlp_dim``, ``text_stochastic_depth`` (0.1), ``vision_stochastic_depth`` (0.2),
  ``hf_compat`` (False: scenic; True: HF's merged-LN eps 1e-5, exact-erf GELU in the box
  head, float32-min masked logits), ``dtype`` (compute dtype of the towers; params float32),
  ``version`` ('v1' | 'owlv2': adds ``objectness_head`` and ``objectness_logits``),
  ``objectness_top_k`` (OWLv2, training: keep the k tokens of highest objectness; 0 = all).

  ``model.init(rng, images, queries)`` / ``model.apply(variables, images, queries,
  train=False)`` -> dict (all float32):
    ``pred_logits [B, T, Q]`` (padded queries = -1e6), ``pred_boxes [B, T, 4]`` cxcywh in
    [0, 1] of the padded square, ``class_embeddings [B, T, E]`` (normalised, e / (||e|| +
    1e-6), as scenic's class head returns them with queries),
    ``query_embeddings [B, Q, E]`` (not normalised), ``feature_map [B, h, w, D]``,
    with ``h = w = S / patch`` and ``T = h * w``.
  ``train=True`` enables stochastic depth and needs ``rngs={'dropout': key}``.

  Source: docs/reference.md §1, §1.1; scenic `scenic/projects/owl_vit/models.py`.
  """

  tokenizer: str = "word_hash"
  vocab_size: int = DEFAULT_VOCAB_SIZE
  context_length: int = DEFAULT_CONTEXT_LENGTH
  embed_dim: int = 128
  image_size: int = 64
  patch_size: int = 8
  vision_width: int = 128
  vision_layers: int = 4
  vision_heads: int = 2
  vision_mlp_dim: int = 512
  text_width: int = 128
  text_layers: int = 2
  text_heads: int = 2
  text_mlp_dim: int = 512
  text_stochastic_depth: float = 0.1
  vision_stochastic_depth: float = 0.2
  hf_compat: bool = False
  dtype: Dtype = jnp.float32
  attention: str = "auto"
  remat: str = "none"
  version: str = "v1"
  objectness_top_k: int = 0

  # ---- static helpers ------------------------------------------------------------------

  @property
  def grid_size(self) -> int:
    """Tokens per image side, ``image_size // patch_size``."""
    return self.image_size // self.patch_size

  @property
  def num_tokens(self) -> int:
    """Image tokens T = grid_size ** 2."""
    return self.grid_size**2

  @property
  def config(self) -> ModelConfig:
    """This module's configuration (``model.config.image_size``, ``dict(model.config)``)."""
    return ModelConfig(**{f: getattr(self, f) for f in _CONFIG_FIELDS})

  # ---- modules -------------------------------------------------------------------------

  def setup(self):
    _validate_config(self.config)
    self._embedder = ClipImageTextEmbedder(
      vocab_size=self.vocab_size,
      context_length=self.context_length,
      embed_dim=self.embed_dim,
      patch_size=self.patch_size,
      vision_width=self.vision_width,
      vision_layers=self.vision_layers,
      vision_heads=self.vision_heads,
      vision_mlp_dim=self.vision_mlp_dim,
      text_width=self.text_width,
      text_layers=self.text_layers,
      text_heads=self.text_heads,
      text_mlp_dim=self.text_mlp_dim,
      text_stochastic_depth=self.text_stochastic_depth,
      vision_stochastic_depth=self.vision_stochastic_depth,
      hf_compat=self.hf_compat,
      dtype=self.dtype,
      attention=self.attention,
      remat=self.remat,
      name="backbone",
    )
    self._class_head = ClassPredictor(
      out_dim=self.embed_dim, hf_compat=self.hf_compat, name="class_head"
    )
    self._box_head = PredictorMLP(
      out_dim=4, num_layers=3, hf_compat=self.hf_compat, name="obj_box_head"
    )
    if self.version == "owlv2":
      # scenic: ``layers.PredictorMLP(out_dim=1, num_layers=3)`` named 'objectness_head'.
      self._objectness_head = PredictorMLP(
        out_dim=1, num_layers=3, hf_compat=self.hf_compat, name="objectness_head"
      )

  # ---- scenic-style methods ------------------------------------------------------------

  def image_embedder(self, images: jax.Array, train: bool = False) -> jax.Array:
    """Embeds images into a feature map.

    Args:
      images: float ``[B, S, S, 3]`` RGB in [0, 1] with ``S = image_size`` (padding
        bottom/right). train: stochastic depth on (needs the 'dropout' rng).

    Returns:
      ``feature_map`` float32 ``[B, h, w, D]`` (merged-class-token LayerNorm output).

    Raises:
      ValueError: if images are not ``[B, image_size, image_size, 3]``.

    Source: scenic `scenic/projects/owl_vit/models.py` (``image_embedder``).
    """
    if images.ndim != 4 or tuple(images.shape[1:]) != (self.image_size,) * 2 + (3,):
      raise ValueError(
        f"images must be [B, {self.image_size}, {self.image_size}, 3], got {images.shape}"
      )
    tokens, _ = self._embedder(images=images, train=train)
    g = self.grid_size
    return tokens.reshape(tokens.shape[0], g, g, tokens.shape[-1])

  def text_embedder(self, queries: jax.Array, train: bool = False) -> jax.Array:
    """Embeds tokenised queries.

    Args:
      queries: int ``[..., L]`` token ids (e.g. ``[B, Q, L]``), L = ``context_length``.
      train: stochastic depth on (needs the 'dropout' rng).

    Returns:
      float32 ``[..., E]`` text-projection outputs (not normalised).

    Raises:
      ValueError: if the last dimension is not ``context_length`` or the dtype is not
        integer.

    Source: scenic `scenic/projects/owl_vit/models.py` (``text_embedder``).
    """
    if queries.ndim < 2 or queries.shape[-1] != self.context_length:
      raise ValueError(f"queries must be [..., {self.context_length}], got {queries.shape}")
    if not jnp.issubdtype(queries.dtype, jnp.integer):
      raise ValueError(f"queries must be integer token ids, got {queries.dtype}")
    _, emb = self._embedder(texts=queries, train=train)
    return emb

  def class_predictor(
    self,
    image_features: jax.Array,
    query_embeddings: jax.Array | None = None,
    query_mask: jax.Array | None = None,
  ) -> dict[str, jax.Array]:
    """Applies the class head (:class:`ClassPredictor`).

    Args:
      image_features: ``[B, T, D]`` (feature map flattened row-major).
      query_embeddings: ``[B, Q, E]`` or None (then only class embeddings are returned).
      query_mask: ``[B, Q]`` (True/1 = real query) or None (all real).

    Returns:
      dict with ``class_embeddings [B, T, E]`` (raw without queries, normalised with them, as
      scenic) and, with queries, ``pred_logits [B, T, Q]``; float32.

    Raises:
      ValueError: if query embeddings are not ``[B, Q, E]``.

    Source: scenic `scenic/projects/owl_vit/models.py` (``class_predictor``).
    """
    return self._class_head(image_features, query_embeddings, query_mask)

  def objectness_predictor(self, image_features: jax.Array) -> dict[str, jax.Array]:
    """OWLv2's objectness logit of every token (``version='owlv2'`` only).

    The head's input is under ``stop_gradient`` (scenic's OWLv2 configs,
    ``objectness_head.stop_gradient=True``; HF detaches it too): the objectness loss trains
    the head only, never the backbone.

    Args:
      image_features: ``[B, T, D]``.

    Returns:
      ``{'objectness_logits': [B, T]}`` float32.

    Raises:
      ValueError: a v1 model (no objectness head).

    Source: scenic `scenic/projects/owl_vit/models.py` (``objectness_predictor``).
    """
    if self.version != "owlv2":
      raise ValueError(f"objectness needs version='owlv2', this model is {self.version!r}")
    logits = self._objectness_head(jax.lax.stop_gradient(image_features))
    return {"objectness_logits": logits[..., 0]}

  def embed_image_query(self, query_images: jax.Array) -> dict[str, jax.Array]:
    """OWLv2's image-conditioned query: the class embedding of each query image's token of
    highest objectness (HF picks the query box this way when none is given).

    Args:
      query_images: float ``[B, S, S, 3]`` in [0, 1] (one example image per target image).

    Returns:
      dict: ``query_embeddings [B, 1, E]`` float32 (the raw class embedding, pass as
      ``query_embeddings`` to ``__call__``), ``query_token [B]`` int32 (its token),
      ``query_boxes [B, 4]`` float32 cxcywh (that token's predicted box).

    Raises:
      ValueError: a v1 model (no objectness head), or images of the wrong shape.

    Source: HF transformers `models/owlv2/modeling_owlv2.py`
    (``Owlv2ForObjectDetection.embed_image_query``, ``image_guided_detection``).
    """
    feature_map = self.image_embedder(query_images, train=False)
    b, h, w, d = feature_map.shape
    features = feature_map.reshape(b, h * w, d)
    index = objectness_lib.query_token_index(
      self.objectness_predictor(features)["objectness_logits"]
    )
    class_emb = self.class_predictor(features)["class_embeddings"]
    boxes = self.box_predictor(features, feature_map)["pred_boxes"]
    pick = index[:, None]
    return {
      "query_embeddings": objectness_lib.gather_tokens(class_emb, pick),
      "query_token": index,
      "query_boxes": objectness_lib.gather_tokens(boxes, pick)[:, 0],
    }

  def box_predictor(
    self,
    image_features: jax.Array,
    feature_map: jax.Array,
    keep_tokens: jax.Array | None = None,
  ) -> dict[str, jax.Array]:
    """Predicts one box per image token.

    ``sigmoid(obj_box_head(image_features) + compute_box_bias(h, w))``.

    Args:
      image_features: ``[B, T, D]``. feature_map: ``[B, h, w, D]`` (only its grid shape is
        used), ``T = h * w``; with ``keep_tokens`` (int ``[B, k]``, OWLv2's top-k tokens)
        ``image_features`` is ``[B, k, D]``, those tokens' features.

    Returns:
      ``{'pred_boxes': [B, T, 4]}`` float32, cxcywh in [0, 1] of the padded square.

    Raises:
      ValueError: if ``T != h * w``.

    Source: scenic `scenic/projects/owl_vit/models.py` (``box_predictor``); docs/reference.md §1.
    """
    h, w = feature_map.shape[1:3]
    expected = h * w if keep_tokens is None else keep_tokens.shape[1]
    if image_features.shape[1] != expected:
      raise ValueError(
        f"image_features has {image_features.shape[1]} tokens, expected {expected} "
        f"(feature_map grid {h}x{w})"
      )
    bias = jnp.asarray(compute_box_bias(h, w))
    if keep_tokens is not None:
      bias = objectness_lib.gather_tokens(bias[None], keep_tokens)
    boxes = self._box_head(image_features) + bias
    return {"pred_boxes": jax.nn.sigmoid(boxes)}

  def __call__(
    self,
    images: jax.Array,
    queries: jax.Array | None = None,
    *,
    query_embeddings: jax.Array | None = None,
    query_mask: jax.Array | None = None,
    train: bool = False,
  ) -> dict[str, jax.Array]:
    """Detects the queries in the images.

    Args:
      images: float ``[B, S, S, 3]`` in [0, 1], ``S = image_size``.
      queries: int32 ``[B, Q, L]`` tokens; a row whose first token is 0 is a padding
        query (masked to -1e6). Either ``queries`` or ``query_embeddings``.
      query_embeddings: float ``[B, Q, E]`` precomputed text embeddings (skips the text
        tower, e.g. embedded once per dataset).
      query_mask: ``[B, Q]`` bool/0-1 for ``query_embeddings`` (default: all real). With
        ``queries`` it is derived as ``queries[..., 0] > 0`` and must not be given.
      train: stochastic depth on (needs ``rngs={'dropout': key}``).

    Returns:
      dict of float32 arrays: ``pred_logits [B, T, Q]``, ``pred_boxes [B, T, 4]``,
      ``class_embeddings [B, T, E]`` (normalised, as scenic), ``query_embeddings [B, Q, E]``,
      ``feature_map [B, h, w, D]``; OWLv2 adds ``objectness_logits [B, T]``. OWLv2 with
      ``objectness_top_k = k`` (0 < k < T) and ``train``: the per-token outputs are those of
      the k tokens of highest objectness (T -> k) and ``keep_tokens [B, k]`` int32 gives
      their indices (scenic).

    Raises:
      ValueError: neither or both of queries / query_embeddings; query_mask with queries;
        shape mismatches.

    Source: scenic `scenic/projects/owl_vit/models.py` (``__call__``); docs/reference.md §1.
    """
    # Validate everything before computing anything.
    if (queries is None) == (query_embeddings is None):
      raise ValueError("pass exactly one of `queries` and `query_embeddings`")
    b = images.shape[0]
    if queries is not None:
      if query_mask is not None:
        raise ValueError("query_mask is derived from `queries`; do not pass both")
      if queries.ndim != 3 or queries.shape[0] != b or (queries.shape[-1] != self.context_length):
        raise ValueError(f"queries must be [B={b}, Q, {self.context_length}], got {queries.shape}")
    else:
      if (
        query_embeddings.ndim != 3
        or query_embeddings.shape[0] != b
        or (query_embeddings.shape[-1] != self.embed_dim)
      ):
        raise ValueError(
          f"query_embeddings must be [B={b}, Q, {self.embed_dim}], got {query_embeddings.shape}"
        )
      if query_mask is not None and (tuple(query_mask.shape) != tuple(query_embeddings.shape[:2])):
        raise ValueError(f"query_mask must be {query_embeddings.shape[:2]}, got {query_mask.shape}")

    feature_map = self.image_embedder(images, train)
    _, h, w, d = feature_map.shape
    image_features = feature_map.reshape(b, h * w, d)
    if queries is not None:
      query_embeddings = self.text_embedder(queries, train)
      query_mask = queries[..., 0] > 0
    else:
      query_embeddings = jnp.asarray(query_embeddings, jnp.float32)
      if query_mask is None:
        query_mask = jnp.ones(query_embeddings.shape[:2], bool)
    out = {"feature_map": feature_map, "query_embeddings": query_embeddings}
    keep = None
    if self.version == "owlv2":
      out.update(self.objectness_predictor(image_features))
      if train and 0 < self.objectness_top_k < h * w:
        out["objectness_logits"], keep = objectness_lib.top_k_tokens(
          out["objectness_logits"], self.objectness_top_k
        )
        image_features = objectness_lib.gather_tokens(image_features, keep)
        out["keep_tokens"] = keep
    out.update(self.class_predictor(image_features, query_embeddings, query_mask))
    out.update(self.box_predictor(image_features, feature_map, keep))
    return out


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
assert set(_CONFIG_FIELDS) == {
  f.name for f in dataclasses.fields(OwlViT) if f.name not in ("parent", "name")
}
assert all(set(v) == set(_CONFIG_FIELDS) for v in VARIANTS.values())


def _validate_config(cfg: dict[str, Any]) -> None:
  # Each field against its own rule (`variants.OVERRIDE_RULES`, from `ModelConfig`'s fields:
  # no hand list of fields here). dtype's rule refuses it as an override; here it is the jnp
  # type `detector.model_fields` made of config.model.dtype.
  for name, rule in OVERRIDE_RULES.items():
    if name != "dtype" and (problem := rule(cfg[name])):
      raise ValueError(f"{name}={cfg[name]!r} {problem}")
  for tower in ("vision", "text"):
    width, heads = cfg[f"{tower}_width"], cfg[f"{tower}_heads"]
    if width % heads:
      raise ValueError(f"{tower}_width={width} is not divisible by {tower}_heads={heads}")
  if cfg["image_size"] % cfg["patch_size"]:
    raise ValueError(
      f"image_size={cfg['image_size']} is not a multiple of patch_size={cfg['patch_size']}"
    )
  if cfg["objectness_top_k"] and cfg["version"] != "owlv2":
    raise ValueError(f"objectness_top_k={cfg['objectness_top_k']!r} must be 0 unless 'owlv2'")


def create_model(variant: str, **overrides) -> OwlViT:
  """Builds an :class:`OwlViT` of a named variant, with optional field overrides.

  Args:
    variant: ``'tiny'``, ``'vit_b32'``, ``'vit_b16'``, ``'vit_l14'`` (docs/reference.md §1
      table), ``'owlv2_tiny'``, ``'owlv2_b16'`` or ``'owlv2_l14'`` (docs/owlv2.md).
    **overrides: replacement values for any config field (see :func:`get_variant_config`),
      e.g. ``vision_layers=2``, ``image_size=96``, ``dtype=jnp.bfloat16``,
      ``hf_compat=True``.

  Returns:
    An unbound ``OwlViT`` module.

  Raises:
    ValueError: unknown variant; unknown override names (all are named); inconsistent
      values (width not divisible by heads, image size not a multiple of the patch, ...).

  Source: docs/reference.md §1; CONVENTIONS.md (Model).
  """
  cfg = get_variant_config(variant).as_dict()
  unknown = sorted(set(overrides) - set(_CONFIG_FIELDS))
  if unknown:
    raise ValueError(
      f"unknown config override(s) {unknown} for variant {variant!r}; "
      f"known fields: {list(_CONFIG_FIELDS)}"
    )
  cfg.update(overrides)
  _validate_config(cfg)
  return OwlViT(**cfg)

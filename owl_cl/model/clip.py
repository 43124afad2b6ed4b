"""CLIP text and vision towers (Flax linen) as used by OWL-ViT v1.

Source: SPEC §1 (transformer block, vision tower, text tower) and §1.1 (parameter tree);
scenic `scenic/projects/owl_vit/clip/layers.py` (the ViT+stochastic-depth fork of
`scenic/projects/baselines/clip/layers.py`). Parameter names and shapes match scenic so that
scenic checkpoints load unchanged:

* block ``resblocks_{i}/{ln_0, attn/{query,key,value,out}, ln_1, mlp/{c_fc, c_proj}}``;
* vision ``visual/{conv1, class_embedding, positional_embedding, ln_pre, transformer, ln_post}``;
* text ``text/{token_embedding, positional_embedding, transformer, ln_final, text_projection}``;
* ``clip/logit_scale`` (scalar, unused by the detector).

Precision: every module takes ``dtype`` (the compute dtype, e.g. ``jnp.float32`` or
``jnp.bfloat16``); parameters are always float32 (``param_dtype``).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "CLIP",
  "CLIP_IMAGE_MEAN",
  "CLIP_IMAGE_STD",
  "LAYER_NORM_EPS",
  "MLP",
  "ResidualAttentionBlock",
  "TextEncoder",
  "Transformer",
  "VisionTransformer",
  "droplayer_rates",
  "normalize_image",
  "quick_gelu",
]

Dtype = Any

#: LayerNorm epsilon of the CLIP towers (PyTorch default; flax's default is 1e-6). SPEC §1.
LAYER_NORM_EPS = 1e-5
#: CLIP pixel normalisation constants (RGB). SPEC §1, vision tower.
CLIP_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def quick_gelu(x: jax.Array) -> jax.Array:
  """CLIP's GELU approximation ``x * sigmoid(1.702 x)``.

  Args:
    x: array of any shape and float dtype.

  Returns:
    Array of the same shape and dtype.

  Source: SPEC §1 (MLP); scenic `scenic/projects/owl_vit/clip/layers.py` (``quick_gelu``).
  """
  return x * jax.nn.sigmoid(1.702 * x)


def normalize_image(images: jax.Array) -> jax.Array:
  """CLIP pixel normalisation ``(x - mean) / std`` per RGB channel.

  Args:
    images: float ``[..., 3]`` RGB in [0, 1] (NHWC).

  Returns:
    float32 array of the same shape.

  Source: SPEC §1 (vision tower); scenic `scenic/projects/owl_vit/clip/model.py`
  (``normalize_image``).
  """
  mean = jnp.asarray(CLIP_IMAGE_MEAN, jnp.float32)
  std = jnp.asarray(CLIP_IMAGE_STD, jnp.float32)
  return (jnp.asarray(images, jnp.float32) - mean) / std


def droplayer_rates(num_layers: int, rate: float) -> list:
  """Per-layer stochastic-depth drop probabilities ``p_i = i / max(L - 1, 1) * rate``.

  Args:
    num_layers: number of blocks L (int >= 0).
    rate: maximal drop probability (float in [0, 1]), reached by the last block.

  Returns:
    ``list[float]`` of length L; the first block is never dropped.

  Source: SPEC §1 (stochastic depth); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``Transformer``).
  """
  return [i / max(num_layers - 1, 1) * rate for i in range(num_layers)]


LayerNorm = functools.partial(nn.LayerNorm, epsilon=LAYER_NORM_EPS)


class MLP(nn.Module):
  """Transformer MLP: ``c_proj(quick_gelu(c_fc(x)))``.

  Attributes:
    mlp_dim: hidden width (4 D in CLIP); ``None`` means ``4 * x.shape[-1]``.
    dtype: compute dtype; params float32.

  Input ``[..., D]`` -> output ``[..., D]`` (dtype ``dtype``).

  Source: SPEC §1; scenic `scenic/projects/owl_vit/clip/layers.py` (``MLP``).
  """

  mlp_dim: int | None = None
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    width = x.shape[-1]
    hidden = self.mlp_dim or 4 * width
    x = nn.Dense(hidden, dtype=self.dtype, param_dtype=jnp.float32, name="c_fc")(x)
    x = quick_gelu(x)
    return nn.Dense(width, dtype=self.dtype, param_dtype=jnp.float32, name="c_proj")(x)


class ResidualAttentionBlock(nn.Module):
  """Pre-LN transformer block with stochastic depth (no 1/(1-p) rescaling).

  ``x += drop(Attn(ln_0(x)))``; ``x += drop(MLP(ln_1(x)))`` where ``drop`` zeroes the branch
  of a whole example with probability ``droplayer_p`` (independent draws for the two branches
  and for every example), only when ``deterministic=False``; then it needs the ``'dropout'``
  rng.

  Attributes:
    num_heads: attention heads (head dim = D / num_heads).
    mlp_dim: MLP hidden width (``None``: 4 D).
    droplayer_p: drop probability of this block (float in [0, 1]).
    dtype: compute dtype; params float32.

  Call: ``x [N, S, D]``, optional ``attn_mask [N, 1|H, S, S]`` (bool/0-1, True = attend),
  keyword ``deterministic``; returns ``[N, S, D]`` in ``dtype``.

  Source: SPEC §1 (transformer block); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``ResidualAttentionBlock``).
  """

  num_heads: int
  mlp_dim: int | None = None
  droplayer_p: float = 0.0
  dtype: Dtype = jnp.float32

  def _drop_pattern(self, x: jax.Array, deterministic: bool):
    if deterministic or not self.droplayer_p:
      return None
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return jax.random.bernoulli(self.make_rng("dropout"), self.droplayer_p, shape)

  def _residual(self, x, y, deterministic):
    drop = self._drop_pattern(y, deterministic)
    if drop is not None:
      y = jnp.where(drop, jnp.zeros_like(y), y)
    return x + y

  @nn.compact
  def __call__(
    self, x: jax.Array, attn_mask: jax.Array | None = None, *, deterministic: bool = True
  ) -> jax.Array:
    x = x.astype(self.dtype)
    xn = LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_0")(x)
    y = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      use_bias=True,
      force_fp32_for_softmax=True,
      deterministic=True,
      name="attn",
    )(xn, xn, mask=attn_mask)
    x = self._residual(x, y, deterministic)
    xn = LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_1")(x)
    y = MLP(mlp_dim=self.mlp_dim, dtype=self.dtype, name="mlp")(xn)
    return self._residual(x, y, deterministic)


class Transformer(nn.Module):
  """Stack of ``num_layers`` :class:`ResidualAttentionBlock` named ``resblocks_{i}``.

  Block i drops with ``p_i = i / max(L - 1, 1) * stochastic_droplayer_rate``
  (:func:`droplayer_rates`).

  Attributes:
    num_layers: L; num_heads: heads; mlp_dim: MLP width (``None``: 4 D);
    stochastic_droplayer_rate: max drop probability; dtype: compute dtype.

  Call: ``x [N, S, D]``, optional ``attn_mask [N, 1, S, S]``, keyword ``deterministic``;
  returns ``[N, S, D]``.

  Source: SPEC §1; scenic `scenic/projects/owl_vit/clip/layers.py` (``Transformer``).
  """

  num_layers: int
  num_heads: int
  mlp_dim: int | None = None
  stochastic_droplayer_rate: float = 0.0
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(
    self, x: jax.Array, attn_mask: jax.Array | None = None, *, deterministic: bool = True
  ) -> jax.Array:
    for i, p in enumerate(droplayer_rates(self.num_layers, self.stochastic_droplayer_rate)):
      x = ResidualAttentionBlock(
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        droplayer_p=p,
        dtype=self.dtype,
        name=f"resblocks_{i}",
      )(x, attn_mask, deterministic=deterministic)
    return x


class VisionTransformer(nn.Module):
  """CLIP ViT image tower without the final projection (OWL-ViT uses all tokens).

  ``conv1`` (kernel = stride = patch, no bias, padding SAME) -> flatten row-major -> prepend
  ``class_embedding`` -> add ``positional_embedding [P+1, D]`` -> ``ln_pre`` -> blocks ->
  ``ln_post`` on all tokens.

  Attributes:
    patch_size: patch side p (pixels); features: width D; num_layers; num_heads;
    mlp_dim (``None``: 4 D); stochastic_droplayer_rate; dtype (compute).

  Call: ``images [B, S, S, 3]`` float, already CLIP-normalised (:func:`normalize_image`),
  with ``S`` a multiple of ``patch_size``; keyword ``deterministic``. Returns
  ``[B, 1 + (S/p)^2, D]`` in ``dtype`` (token 0 = class token). The positional embedding has
  ``1 + (S/p)^2`` rows, so ``S`` is fixed by the parameters.

  Raises:
    ValueError: if ``S`` is not a multiple of ``patch_size`` or images are not square.

  Source: SPEC §1 (vision tower); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``VisionTransformer``, ``out_features=None``).
  """

  patch_size: int
  features: int
  num_layers: int
  num_heads: int
  mlp_dim: int | None = None
  stochastic_droplayer_rate: float = 0.0
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
    if images.ndim != 4 or images.shape[1] != images.shape[2]:
      raise ValueError(f"expected square NHWC images [B, S, S, 3], got {images.shape}")
    if images.shape[1] % self.patch_size:
      raise ValueError(f"image side {images.shape[1]} is not a multiple of patch {self.patch_size}")
    x = nn.Conv(
      self.features,
      kernel_size=(self.patch_size, self.patch_size),
      strides=(self.patch_size, self.patch_size),
      padding="SAME",
      use_bias=False,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      name="conv1",
    )(images.astype(self.dtype))
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    scale = self.features**-0.5
    cls = self.param(
      "class_embedding", nn.initializers.normal(stddev=scale), (self.features,), jnp.float32
    )
    posemb = self.param(
      "positional_embedding",
      nn.initializers.normal(stddev=scale),
      (x.shape[1] + 1, self.features),
      jnp.float32,
    )
    cls = jnp.broadcast_to(cls.astype(self.dtype), (x.shape[0], 1, self.features))
    x = jnp.concatenate([cls, x], axis=1) + posemb[None].astype(self.dtype)
    x = LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_pre")(x)
    x = Transformer(
      num_layers=self.num_layers,
      num_heads=self.num_heads,
      mlp_dim=self.mlp_dim,
      stochastic_droplayer_rate=self.stochastic_droplayer_rate,
      dtype=self.dtype,
      name="transformer",
    )(x, deterministic=deterministic)
    return LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_post")(x)


class TextEncoder(nn.Module):
  """CLIP text tower.

  ``token_embedding + positional_embedding`` -> blocks with mask = causal AND (token > 0)
  (for both query and key positions) -> ``ln_final`` -> the row at ``argmax(token id)`` (the
  EOT, the largest id) -> ``text_projection`` (Dense, no bias). Not normalised.

  Attributes:
    vocab_size: V; features: width Dt; num_layers; num_heads; out_features: E;
    context_length: L (16; the positional embedding has L rows);
    mlp_dim (``None``: 4 Dt); stochastic_droplayer_rate; dtype (compute).

  Call: ``text [N, L]`` int token ids (0 = padding), keyword ``deterministic``. Returns
  ``[N, E]`` in ``dtype``. An all-zero row is computed without NaNs (its value is
  meaningless; the detector masks such queries).

  Raises:
    ValueError: if ``text`` is not ``[N, context_length]``.

  Source: SPEC §1 (text tower); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``TextEncoder``).
  """

  vocab_size: int
  features: int
  num_layers: int
  num_heads: int
  out_features: int
  context_length: int = 16
  mlp_dim: int | None = None
  stochastic_droplayer_rate: float = 0.0
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, text: jax.Array, *, deterministic: bool = True) -> jax.Array:
    if text.ndim != 2 or text.shape[1] != self.context_length:
      raise ValueError(f"expected tokens [N, {self.context_length}], got shape {text.shape}")
    posemb = self.param(
      "positional_embedding",
      nn.initializers.normal(stddev=0.01),
      (self.context_length, self.features),
      jnp.float32,
    )
    valid = text > 0
    mask = nn.combine_masks(nn.make_attention_mask(valid, valid), nn.make_causal_mask(text))
    x = nn.Embed(
      self.vocab_size,
      self.features,
      embedding_init=nn.initializers.normal(stddev=0.02),
      dtype=self.dtype,
      param_dtype=jnp.float32,
      name="token_embedding",
    )(text)
    x = x + posemb[None].astype(self.dtype)
    x = Transformer(
      num_layers=self.num_layers,
      num_heads=self.num_heads,
      mlp_dim=self.mlp_dim,
      stochastic_droplayer_rate=self.stochastic_droplayer_rate,
      dtype=self.dtype,
      name="transformer",
    )(x, attn_mask=mask, deterministic=deterministic)
    x = LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_final")(x)
    x = x[jnp.arange(x.shape[0]), jnp.argmax(text, axis=-1)]
    return nn.Dense(
      self.out_features,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=nn.initializers.normal(stddev=self.features**-0.5),
      name="text_projection",
    )(x)


class CLIP(nn.Module):
  """CLIP image and text towers under one scope (``visual``, ``text``, ``logit_scale``).

  Attributes:
    vocab_size, embed_dim (E), context_length (L);
    text_width, text_layers, text_heads, text_mlp_dim;
    vision_width, vision_layers, vision_heads, vision_mlp_dim, patch_size;
    text_stochastic_droplayer_rate, vision_stochastic_droplayer_rate; dtype (compute).

  Methods:
    ``encode_image(images [B,S,S,3] CLIP-normalised, deterministic) -> [B, 1+P, D]``
    (all tokens after ``ln_post``, no projection); ``encode_text(tokens [N, L],
    deterministic) -> [N, E]`` (not normalised).

  The scalar ``logit_scale`` (init log(1/0.07)) is CLIP's contrastive temperature; the
  detector does not use it but keeps it so the parameter tree equals scenic's.

  Source: SPEC §1, §1.1; scenic `scenic/projects/owl_vit/clip/layers.py` (``CLIP``,
  ``vision_return_map=True``).
  """

  vocab_size: int
  embed_dim: int
  text_width: int
  text_layers: int
  text_heads: int
  vision_width: int
  vision_layers: int
  vision_heads: int
  patch_size: int
  context_length: int = 16
  text_mlp_dim: int | None = None
  vision_mlp_dim: int | None = None
  text_stochastic_droplayer_rate: float = 0.0
  vision_stochastic_droplayer_rate: float = 0.0
  dtype: Dtype = jnp.float32

  def setup(self):
    self.visual = VisionTransformer(
      patch_size=self.patch_size,
      features=self.vision_width,
      num_layers=self.vision_layers,
      num_heads=self.vision_heads,
      mlp_dim=self.vision_mlp_dim,
      stochastic_droplayer_rate=self.vision_stochastic_droplayer_rate,
      dtype=self.dtype,
    )
    self.text = TextEncoder(
      vocab_size=self.vocab_size,
      features=self.text_width,
      num_layers=self.text_layers,
      num_heads=self.text_heads,
      out_features=self.embed_dim,
      context_length=self.context_length,
      mlp_dim=self.text_mlp_dim,
      stochastic_droplayer_rate=self.text_stochastic_droplayer_rate,
      dtype=self.dtype,
    )
    self.logit_scale = self.param(
      "logit_scale", nn.initializers.constant(float(np.log(1 / 0.07))), (), jnp.float32
    )

  def encode_image(self, images: jax.Array, deterministic: bool = True) -> jax.Array:
    """``images [B, S, S, 3]`` (CLIP-normalised) -> tokens ``[B, 1 + P, D]``."""
    return self.visual(images, deterministic=deterministic)

  def encode_text(self, text: jax.Array, deterministic: bool = True) -> jax.Array:
    """``text [N, L]`` int32 -> ``[N, E]`` (not normalised)."""
    return self.text(text, deterministic=deterministic)

  def __call__(
    self,
    images: jax.Array | None = None,
    text: jax.Array | None = None,
    *,
    deterministic: bool = True,
  ):
    """Returns ``(image_tokens or None, text_embeddings or None)``."""
    img = None if images is None else self.encode_image(images, deterministic)
    txt = None if text is None else self.encode_text(text, deterministic)
    return img, txt

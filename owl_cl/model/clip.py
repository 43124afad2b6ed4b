"""CLIP text and vision towers (Flax linen) as used by OWL-ViT v1.

Source: docs/reference.md §1 (transformer block, vision tower, text tower) and §1.1 (parameter
tree);
scenic `scenic/projects/owl_vit/clip/layers.py` (the ViT+stochastic-depth fork of
`scenic/projects/baselines/clip/layers.py`). Parameter names and shapes match scenic so that
scenic checkpoints load unchanged:

* block ``resblocks_{i}/{ln_0, attn/{query,key,value,out}, ln_1, mlp/{c_fc, c_proj}}``;
* vision ``visual/{conv1, class_embedding, positional_embedding, ln_pre, transformer, ln_post}``;
* text ``text/{token_embedding, positional_embedding, transformer, ln_final, text_projection}``;
* ``clip/logit_scale`` (scalar, unused by the detector).

Precision: every module takes ``dtype`` (the compute dtype, e.g. ``jnp.float32`` or
``jnp.bfloat16``); parameters are always float32 (``param_dtype``); attention logits and
softmax are float32 whatever ``dtype`` is.

Attention runs through ``jax.nn.dot_product_attention`` (:class:`SelfAttention`): XLA's
implementation, or cuDNN's fused (flash) kernel on NVIDIA GPUs, chosen by ``attention``
(:func:`resolve_attention`). Rematerialisation per residual block is chosen by ``remat``
(:func:`remat_policy`). Neither changes the parameter tree.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "ATTENTION_IMPLEMENTATIONS",
  "CLIP",
  "REMAT_POLICIES",
  "SelfAttention",
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
  "remat_policy",
  "resolve_attention",
]

Dtype = Any

#: LayerNorm epsilon of the CLIP towers (PyTorch default; flax's default is 1e-6). docs/reference.md
# §1.
LAYER_NORM_EPS = 1e-5
#: CLIP pixel normalisation constants (RGB). docs/reference.md §1, vision tower.
CLIP_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def quick_gelu(x: jax.Array) -> jax.Array:
  """CLIP's GELU approximation ``x * sigmoid(1.702 x)``.

  Args:
    x: array of any shape and float dtype.

  Returns:
    Array of the same shape and dtype.

  Source: docs/reference.md §1 (MLP); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``quick_gelu``).
  """
  return x * jax.nn.sigmoid(1.702 * x)


def normalize_image(images: jax.Array) -> jax.Array:
  """CLIP pixel normalisation ``(x - mean) / std`` per RGB channel.

  Args:
    images: float ``[..., 3]`` RGB in [0, 1] (NHWC).

  Returns:
    float32 array of the same shape.

  Source: docs/reference.md §1 (vision tower); scenic `scenic/projects/owl_vit/clip/model.py`
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

  Source: docs/reference.md §1 (stochastic depth); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``Transformer``).
  """
  return [i / max(num_layers - 1, 1) * rate for i in range(num_layers)]


LayerNorm = functools.partial(nn.LayerNorm, epsilon=LAYER_NORM_EPS)

#: Values of the ``attention`` field: 'auto' picks per platform and dtype
#: (:func:`resolve_attention`); 'xla' and 'cudnn' are ``jax.nn.dot_product_attention``'s
#: implementations.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")

#: Values of the ``remat`` field besides the ``jax.checkpoint_policies`` names below:
#: 'none' (keep every activation) and 'block' (keep only each block's input; recompute the
#: block in the backward pass).
_REMAT_MODES = ("none", "block")
#: The ``jax.checkpoint_policies`` that are policies themselves (not factories needing
#: arguments), usable as ``remat``.
_POLICY_NAMES = (
  "everything_saveable",
  "nothing_saveable",
  "dots_saveable",
  "checkpoint_dots",
  "dots_with_no_batch_dims_saveable",
  "checkpoint_dots_with_no_batch_dims",
)
REMAT_POLICIES = _REMAT_MODES + tuple(
  n for n in _POLICY_NAMES if hasattr(jax.checkpoint_policies, n)
)

# cuDNN's fused attention (jax.nn.dot_product_attention(implementation='cudnn')) takes
# float16/bfloat16 only and head dimensions up to 128 that are multiples of 8.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128


def resolve_attention(
  attention: str, dtype: Any, head_dim: int, platform: str | None = None
) -> str:
  """The ``jax.nn.dot_product_attention`` implementation for an ``attention`` setting.

  'auto' gives 'cudnn' on a GPU when ``dtype`` is bfloat16/float16 and ``head_dim`` is a
  multiple of 8 no larger than 128 (cuDNN's fused kernel's limits), and 'xla' otherwise
  (CPU, TPU, float32). 'xla' and 'cudnn' are returned as given (cuDNN then fails at compile
  time where it is unsupported: a float32 dtype, no NVIDIA GPU).

  Args:
    attention: one of :data:`ATTENTION_IMPLEMENTATIONS`.
    dtype: compute dtype of the attention inputs (e.g. ``jnp.bfloat16``).
    head_dim: per-head width (64 in every CLIP tower).
    platform: ``jax.default_backend()`` when None ('cpu', 'gpu', 'tpu').

  Returns:
    'xla' or 'cudnn'.

  Raises:
    ValueError: unknown ``attention`` (the message lists the known values).

  Source: ``jax.nn.dot_product_attention`` (implementation argument and cuDNN limits).
  """
  if attention not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(
      f"attention={attention!r} is unknown; known: {list(ATTENTION_IMPLEMENTATIONS)}"
    )
  if attention != "auto":
    return attention
  platform = platform or jax.default_backend()
  cudnn_ok = (
    platform == "gpu"
    and any(jnp.dtype(dtype) == jnp.dtype(d) for d in _CUDNN_DTYPES)
    and head_dim % 8 == 0
    and head_dim <= _CUDNN_MAX_HEAD_DIM
  )
  return "cudnn" if cudnn_ok else "xla"


def remat_policy(remat: str):
  """``(use_remat, policy)`` of a ``remat`` setting, for ``nn.remat(..., policy=policy)``.

  Args:
    remat: 'none' (no rematerialisation), 'block' (save only each residual block's input,
      recompute the rest in the backward pass: ``policy=None``) or a name of
      ``jax.checkpoint_policies`` (:data:`REMAT_POLICIES`), e.g.
      'dots_with_no_batch_dims_saveable' (keep the outputs of the weight matmuls, recompute
      attention, softmax, LayerNorm and GELU).

  Returns:
    ``(False, None)`` for 'none'; ``(True, None)`` for 'block'; ``(True, policy)`` otherwise.

  Raises:
    ValueError: unknown ``remat`` (the message lists the known values).

  Source: ``jax.checkpoint`` / ``flax.linen.remat`` documentation.
  """
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r} is unknown; known: {list(REMAT_POLICIES)}")
  if remat == "none":
    return False, None
  if remat == "block":
    return True, None
  return True, getattr(jax.checkpoint_policies, remat)


def _pad_seq(x: jax.Array, target: int, axis: int) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, target - x.shape[axis])
  return jnp.pad(x, pad)


# `SelfAttention` parameters whose gradient is zero in exact arithmetic, each with the
# parameter whose gradient scales its rounding noise: the key projection's bias only adds
# q . b_k to every logit of a softmax row, which the softmax cancels, so its gradient is the
# noise of sums of the key kernel's gradient terms (the first GPU run's check, which divided
# that noise by itself, read 1.06).
ZERO_GRADIENT_SCALED_BY = {"['key']['bias']": "['key']['kernel']"}


def gradient_scale_path(path: str) -> str:
  """The gradient whose largest magnitude a comparison of the gradient at ``path`` is relative to.

  Args:
    path: a ``jax.tree_util.keystr`` path into a gradient tree, e.g.
      ``"['params']['attn']['key']['bias']"``.
  Returns:
    ``path`` itself, or, for a parameter of ``ZERO_GRADIENT_SCALED_BY`` (zero gradient in
    exact arithmetic), the path of the parameter that scales its rounding noise.

  Source: the softmax is invariant to a constant added to every logit of a row.
  """
  for zero, scaled_by in ZERO_GRADIENT_SCALED_BY.items():
    if path.endswith(zero):
      return path[: -len(zero)] + scaled_by
  return path


class SelfAttention(nn.Module):
  """Multi-head self-attention with biases, scenic's parameter tree, ``jax.nn`` kernel.

  ``q, k, v = DenseGeneral(x) -> [N, S, H, D/H]`` (``query``, ``key``, ``value``: kernel
  ``[D, H, D/H]``, bias ``[H, D/H]``); ``o = softmax(q k^T / sqrt(D/H) + mask) v`` through
  ``jax.nn.dot_product_attention`` (logits and softmax in float32); ``out``: kernel
  ``[H, D/H, D]``, bias ``[D]``. The tree and initialisers are those of flax's
  ``nn.MultiHeadDotProductAttention`` (which scenic uses), so checkpoints load unchanged and
  float32 outputs agree with it to rounding.

  cuDNN: its kernel needs bfloat16/float16 inputs, turns a mask into an additive bias, and
  its backward pass with a bias needs an even sequence length. An odd length S (the vision
  tower's 1 + 60 * 60 = 3601 tokens) is therefore padded to S + 1 with zero rows, the padded
  keys excluded through ``key_value_seq_lengths`` (and the mask, when given, padded with
  False), and the padded rows dropped from the output.

  Attributes:
    num_heads: H (D must be divisible by H).
    dtype: compute dtype of the projections and of q/k/v; params float32.
    attention: 'auto' | 'xla' | 'cudnn' (:func:`resolve_attention`).

  Call: ``x [N, S, D]``, optional ``mask [N, 1|H, S, S]`` bool (True = attend). Returns
  ``[N, S, D]`` in ``dtype``. Rows whose mask is all False attend uniformly to every
  position (as flax's module), which keeps them finite.

  Raises:
    ValueError: D not divisible by H; unknown ``attention``; mask of the wrong shape.

  Source: docs/reference.md §1 (attention with biases on q/k/v/out, §1.1 tree); flax
  ``nn.MultiHeadDotProductAttention``; ``jax.nn.dot_product_attention``.
  """

  num_heads: int
  dtype: Dtype = jnp.float32
  attention: str = "auto"

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    n, s, width = x.shape
    if width % self.num_heads:
      raise ValueError(f"width {width} is not divisible by num_heads={self.num_heads}")
    head_dim = width // self.num_heads
    impl = resolve_attention(self.attention, self.dtype, head_dim)
    if mask is not None and (mask.ndim != 4 or mask.shape[-2:] != (s, s)):
      raise ValueError(f"mask must be [N, 1|H, {s}, {s}], got {mask.shape}")
    dense = functools.partial(
      nn.DenseGeneral,
      features=(self.num_heads, head_dim),
      axis=-1,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      use_bias=True,
    )
    q = dense(name="query")(x)
    k = dense(name="key")(x)
    v = dense(name="value")(x)
    if mask is not None:
      mask = jnp.asarray(mask, bool)
    if impl == "cudnn" and s % 2:
      # Padded fallback for cuDNN (see the class docstring): pad to an even length and mask
      # the padded keys by length; the padded query rows are dropped below.
      target = s + 1
      q, k, v = (_pad_seq(t, target, 1) for t in (q, k, v))
      if mask is not None:
        mask = _pad_seq(_pad_seq(mask, target, 2), target, 3)
      lengths = jnp.full((n,), s, jnp.int32)
      y = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation="cudnn",
      )[:, :s]
    else:
      y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
    return nn.DenseGeneral(
      features=width,
      axis=(-2, -1),
      dtype=self.dtype,
      param_dtype=jnp.float32,
      use_bias=True,
      name="out",
    )(y)


class MLP(nn.Module):
  """Transformer MLP: ``c_proj(quick_gelu(c_fc(x)))``.

  Attributes:
    mlp_dim: hidden width (4 D in CLIP); ``None`` means ``4 * x.shape[-1]``.
    dtype: compute dtype; params float32.

  Input ``[..., D]`` -> output ``[..., D]`` (dtype ``dtype``).

  Source: docs/reference.md §1; scenic `scenic/projects/owl_vit/clip/layers.py` (``MLP``).
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
    attention: attention implementation (:class:`SelfAttention`).

  Call: ``x [N, S, D]``, optional ``attn_mask [N, 1|H, S, S]`` (bool/0-1, True = attend),
  ``deterministic`` (positional or keyword, so that ``nn.remat`` can mark it static);
  returns ``[N, S, D]`` in ``dtype``.

  Source: docs/reference.md §1 (transformer block); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``ResidualAttentionBlock``).
  """

  num_heads: int
  mlp_dim: int | None = None
  droplayer_p: float = 0.0
  dtype: Dtype = jnp.float32
  attention: str = "auto"

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
    self, x: jax.Array, attn_mask: jax.Array | None = None, deterministic: bool = True
  ) -> jax.Array:
    x = x.astype(self.dtype)
    xn = LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_0")(x)
    y = SelfAttention(
      num_heads=self.num_heads, dtype=self.dtype, attention=self.attention, name="attn"
    )(xn, attn_mask)
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
    stochastic_droplayer_rate: max drop probability; dtype: compute dtype;
    attention: attention implementation (:class:`SelfAttention`);
    remat: rematerialisation of each block (:func:`remat_policy`): with anything but
      'none', each block is wrapped in ``nn.remat`` (same parameter names and values,
      same outputs and gradients; the backward pass recomputes what the policy did not
      save).

  Call: ``x [N, S, D]``, optional ``attn_mask [N, 1, S, S]``, keyword ``deterministic``;
  returns ``[N, S, D]``.

  Source: docs/reference.md §1; scenic `scenic/projects/owl_vit/clip/layers.py` (``Transformer``).
  """

  num_layers: int
  num_heads: int
  mlp_dim: int | None = None
  stochastic_droplayer_rate: float = 0.0
  dtype: Dtype = jnp.float32
  attention: str = "auto"
  remat: str = "none"

  @nn.compact
  def __call__(
    self, x: jax.Array, attn_mask: jax.Array | None = None, *, deterministic: bool = True
  ) -> jax.Array:
    use_remat, policy = remat_policy(self.remat)
    block_cls = ResidualAttentionBlock
    if use_remat:
      # Argument 3 (counting self) is `deterministic`, a Python bool: static.
      block_cls = nn.remat(ResidualAttentionBlock, policy=policy, static_argnums=(3,))
    for i, p in enumerate(droplayer_rates(self.num_layers, self.stochastic_droplayer_rate)):
      x = block_cls(
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        droplayer_p=p,
        dtype=self.dtype,
        attention=self.attention,
        name=f"resblocks_{i}",
      )(x, attn_mask, deterministic)
    return x


class VisionTransformer(nn.Module):
  """CLIP ViT image tower without the final projection (OWL-ViT uses all tokens).

  ``conv1`` (kernel = stride = patch, no bias, padding SAME) -> flatten row-major -> prepend
  ``class_embedding`` -> add ``positional_embedding [P+1, D]`` -> ``ln_pre`` -> blocks ->
  ``ln_post`` on all tokens.

  Attributes:
    patch_size: patch side p (pixels); features: width D; num_layers; num_heads;
    mlp_dim (``None``: 4 D); stochastic_droplayer_rate; dtype (compute); attention, remat
    (:class:`Transformer`).

  Call: ``images [B, S, S, 3]`` float, already CLIP-normalised (:func:`normalize_image`),
  with ``S`` a multiple of ``patch_size``; keyword ``deterministic``. Returns
  ``[B, 1 + (S/p)^2, D]`` in ``dtype`` (token 0 = class token). The positional embedding has
  ``1 + (S/p)^2`` rows, so ``S`` is fixed by the parameters.

  Raises:
    ValueError: if ``S`` is not a multiple of ``patch_size`` or images are not square.

  Source: docs/reference.md §1 (vision tower); scenic `scenic/projects/owl_vit/clip/layers.py`
  (``VisionTransformer``, ``out_features=None``).
  """

  patch_size: int
  features: int
  num_layers: int
  num_heads: int
  mlp_dim: int | None = None
  stochastic_droplayer_rate: float = 0.0
  dtype: Dtype = jnp.float32
  attention: str = "auto"
  remat: str = "none"

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
      attention=self.attention,
      remat=self.remat,
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
    mlp_dim (``None``: 4 Dt); stochastic_droplayer_rate; dtype (compute); attention, remat
    (:class:`Transformer`).

  Call: ``text [N, L]`` int token ids (0 = padding), keyword ``deterministic``. Returns
  ``[N, E]`` in ``dtype``. An all-zero row is computed without NaNs (its value is
  meaningless; the detector masks such queries).

  Raises:
    ValueError: if ``text`` is not ``[N, context_length]``.

  Source: docs/reference.md §1 (text tower); scenic `scenic/projects/owl_vit/clip/layers.py`
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
  attention: str = "auto"
  remat: str = "none"

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
      attention=self.attention,
      remat=self.remat,
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

  Its fields: vocab_size, embed_dim (E), context_length (L); text_width, text_layers,
  text_heads, text_mlp_dim; vision_width, vision_layers, vision_heads, vision_mlp_dim,
  patch_size; text_stochastic_droplayer_rate, vision_stochastic_droplayer_rate; dtype
  (compute); attention, remat (:class:`Transformer`, both towers).

  Its methods: ``encode_image(images [B,S,S,3] CLIP-normalised, deterministic) -> [B, 1+P, D]``
  (all tokens after ``ln_post``, no projection); ``encode_text(tokens [N, L], deterministic)
  -> [N, E]`` (not normalised).

  The scalar ``logit_scale`` (init log(1/0.07)) is CLIP's contrastive temperature; the
  detector does not use it but keeps it so the parameter tree equals scenic's.

  Source: docs/reference.md §1, §1.1; scenic `scenic/projects/owl_vit/clip/layers.py` (``CLIP``,
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
  attention: str = "auto"
  remat: str = "none"

  def setup(self):
    self.visual = VisionTransformer(
      patch_size=self.patch_size,
      features=self.vision_width,
      num_layers=self.vision_layers,
      num_heads=self.vision_heads,
      mlp_dim=self.vision_mlp_dim,
      stochastic_droplayer_rate=self.vision_stochastic_droplayer_rate,
      dtype=self.dtype,
      attention=self.attention,
      remat=self.remat,
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
      attention=self.attention,
      remat=self.remat,
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

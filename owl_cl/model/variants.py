"""Model variants and their frozen configuration (OWL-ViT v1 and OWLv2).

:data:`VARIANTS` names every architecture (docs/reference.md §1 table; docs/owlv2.md for the
``owlv2_*`` ones); :class:`ModelConfig` is the frozen configuration every module, converter and
checkpoint reads; :func:`get_variant_config` looks a variant up. ``owl_cl.model.owl_vit``
re-exports all three.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Iterator
import dataclasses
from typing import Any

import jax.numpy as jnp

from owl_cl.config_fields import Rule
from owl_cl.config_fields import boolean
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.config_fields import real
from owl_cl.model.clip import ATTENTION_IMPLEMENTATIONS
from owl_cl.model.clip import REMAT_POLICIES
from owl_cl.model.text import DEFAULT_CONTEXT_LENGTH
from owl_cl.model.tokenizer import DEFAULT_VOCAB_SIZE
from owl_cl.model.tokenizer import known_tokenizers

__all__ = [
  "ARCHITECTURE_FIELDS",
  "MODEL_VERSIONS",
  "OVERRIDE_RULES",
  "ModelConfig",
  "VARIANTS",
  "get_variant_config",
]

#: Model versions: ``'v1'`` (OWL-ViT, Minderer et al. 2022) and ``'owlv2'`` (OWLv2, Minderer,
#: Gritsenko, Houlsby, NeurIPS 2023: the v1 tree plus scenic's ``objectness_head``).
MODEL_VERSIONS = ("v1", "owlv2")

# --------------------------------------------------------------------------------------------
# Variants (docs/reference.md §1 table; ``tiny`` is ours, sized for 2 CPU cores).
# --------------------------------------------------------------------------------------------

_COMMON = dict(
  context_length=DEFAULT_CONTEXT_LENGTH,
  text_stochastic_depth=0.1,
  vision_stochastic_depth=0.2,
  hf_compat=False,
  attention="auto",
  remat="none",
  version="v1",
  objectness_top_k=0,
)

_VIT_B32 = dict(
  _COMMON,
  tokenizer="clip",
  vocab_size=49408,
  embed_dim=512,
  image_size=768,
  patch_size=32,
  vision_width=768,
  vision_layers=12,
  vision_heads=12,
  vision_mlp_dim=3072,
  text_width=512,
  text_layers=12,
  text_heads=8,
  text_mlp_dim=2048,
  dtype=jnp.bfloat16,
)

VARIANTS: dict[str, dict[str, Any]] = {
  "tiny": dict(
    _COMMON,
    tokenizer="word_hash",
    vocab_size=DEFAULT_VOCAB_SIZE,
    embed_dim=128,
    image_size=64,
    patch_size=8,
    vision_width=128,
    vision_layers=4,
    vision_heads=2,
    vision_mlp_dim=512,
    text_width=128,
    text_layers=2,
    text_heads=2,
    text_mlp_dim=512,
    dtype=jnp.float32,
  ),
  "vit_b32": _VIT_B32,
  # B/16 is B/32 with 16-pixel patches (4x the image tokens: 2304 at 768 px).
  "vit_b16": dict(_VIT_B32, patch_size=16),
  "vit_l14": dict(
    _COMMON,
    tokenizer="clip",
    vocab_size=49408,
    embed_dim=768,
    image_size=840,
    patch_size=14,
    vision_width=1024,
    vision_layers=24,
    vision_heads=16,
    vision_mlp_dim=4096,
    text_width=768,
    text_layers=12,
    text_heads=12,
    text_mlp_dim=3072,
    dtype=jnp.bfloat16,
  ),
}
# OWLv2 (docs/owlv2.md): the v1 towers with scenic's objectness head, at scenic's input sizes
# (`owl_v2_clip_b16.py`: 960 px, 60 x 60 tokens; `owl_v2_clip_l14.py`: 1008 px, 72 x 72).
# ``owlv2_tiny`` is ours, the ``tiny`` towers, for tests and the built-in benchmark.
VARIANTS["owlv2_tiny"] = dict(VARIANTS["tiny"], version="owlv2")
VARIANTS["owlv2_b16"] = dict(VARIANTS["vit_b16"], version="owlv2", image_size=960)
VARIANTS["owlv2_l14"] = dict(VARIANTS["vit_l14"], version="owlv2", image_size=1008)


def _field(rule: Rule, doc: str, *, architecture: bool = False, **default) -> Any:
  """A `ModelConfig` field with its `config.model.overrides` rule and a short doc;
  `architecture`: a parameter tree's shapes determine it (`ARCHITECTURE_FIELDS`)."""
  return dataclasses.field(
    **default, metadata={"rule": rule, "doc": doc, "architecture": architecture}
  )


def _dtype_is_not_an_override(value: Any) -> str:
  del value
  return "is set by config.model.dtype (e.g. 'bfloat16'), not an override"


@dataclasses.dataclass(frozen=True)
class ModelConfig(collections.abc.Mapping):
  """Frozen model configuration; attribute (``cfg.image_size``) and mapping
  (``cfg['image_size']``, ``dict(cfg)``, ``**cfg``) access. Fields = :class:`OwlViT` fields,
  documented in :func:`get_variant_config`. ``replace(**changes)`` returns a modified copy
  (unknown names raise TypeError). Derived: ``grid_size`` (S / patch), ``num_tokens`` (T).

  Source: docs/reference.md §1 table.
  """

  tokenizer: str = _field(choice(known_tokenizers), "the query tokenizer's name")
  vocab_size: int = _field(integer(1), "text token ids", architecture=True)
  context_length: int = _field(integer(1), "L, tokens per query", architecture=True)
  embed_dim: int = _field(integer(1), "E, the joint embedding's width", architecture=True)
  image_size: int = _field(integer(1), "S, pixels per image side", architecture=True)
  patch_size: int = _field(integer(1), "pixels per patch side", architecture=True)
  vision_width: int = _field(integer(1), "D, the image tower's width", architecture=True)
  vision_layers: int = _field(integer(1), "image tower blocks", architecture=True)
  vision_heads: int = _field(integer(1), "image tower attention heads", architecture=True)
  vision_mlp_dim: int = _field(integer(1), "image tower MLP width", architecture=True)
  text_width: int = _field(integer(1), "text tower width", architecture=True)
  text_layers: int = _field(integer(1), "text tower blocks", architecture=True)
  text_heads: int = _field(integer(1), "text tower attention heads", architecture=True)
  text_mlp_dim: int = _field(integer(1), "text tower MLP width", architecture=True)
  text_stochastic_depth: float = _field(real(0.0, 1.0), "text tower drop-path rate")
  vision_stochastic_depth: float = _field(real(0.0, 1.0), "image tower drop-path rate")
  hf_compat: bool = _field(boolean, "HF transformers' numerics")
  # The compute dtype is config.model.dtype (a name, turned into the jnp type by
  # `detector.model_fields`); an override would pass the name through unconverted.
  dtype: Any = _field(_dtype_is_not_an_override, "compute dtype (a jnp type)")
  # Execution choices that leave the parameters and (up to rounding) the outputs unchanged;
  # defaults so that configurations written before they existed still load.
  attention: str = _field(choice(ATTENTION_IMPLEMENTATIONS), "attention kernel", default="auto")
  remat: str = _field(choice(REMAT_POLICIES), "rematerialisation", default="none")
  # OWLv2 (docs/owlv2.md); defaults so that v1 configurations written before them still load.
  version: str = _field(choice(MODEL_VERSIONS), "'v1' | 'owlv2'", default="v1")
  objectness_top_k: int = _field(integer(0), "OWLv2 heads' tokens in training", default=0)

  def __getitem__(self, key: str) -> Any:
    if key not in self.__dataclass_fields__:
      raise KeyError(key)
    return getattr(self, key)

  def __iter__(self) -> Iterator[str]:
    return iter(self.__dataclass_fields__)

  def __len__(self) -> int:
    return len(self.__dataclass_fields__)

  def as_dict(self) -> dict[str, Any]:
    """A plain, mutable ``dict`` copy."""
    return {k: getattr(self, k) for k in self}

  def replace(self, **changes) -> ModelConfig:
    """Copy with some fields replaced."""
    return dataclasses.replace(self, **changes)

  @property
  def grid_size(self) -> int:
    """Tokens per image side, ``image_size // patch_size``."""
    return self.image_size // self.patch_size

  @property
  def num_tokens(self) -> int:
    """Image tokens T = grid_size ** 2."""
    return self.grid_size**2


#: The fields a parameter tree determines (`convert.infer_model_config`), in field order.
ARCHITECTURE_FIELDS = tuple(
  f.name for f in dataclasses.fields(ModelConfig) if f.metadata["architecture"]
)

#: The rule of each field as a `config.model.overrides.<field>` (`validation.model_problems`);
#: the cross-field rules (image size a multiple of the patch size, ...) are there.
OVERRIDE_RULES: dict[str, Rule] = {
  f.name: f.metadata["rule"] for f in dataclasses.fields(ModelConfig)
}


def get_variant_config(variant: str) -> ModelConfig:
  """Configuration of a model variant (a frozen :class:`ModelConfig`, usable as a mapping).

  Keys (= :class:`OwlViT` fields): ``tokenizer`` (str, tokenizer name for
  ``owl_cl.model.tokenizer.get_tokenizer``), ``vocab_size``, ``context_length`` (L = 16),
  ``embed_dim`` (E), ``image_size`` (S, pixels), ``patch_size`` (pixels), ``vision_width``
  (D), ``vision_layers``, ``vision_heads``, ``vision_mlp_dim``, ``text_width``,
  ``text_layers``, ``text_heads``, ``text_mlp_dim``, ``text_stochastic_depth`` (0.1),
  ``vision_stochastic_depth`` (0.2), ``hf_compat`` (False), ``dtype`` (compute dtype:
  float32 for ``tiny``, bfloat16 for the ViT variants, docs/reference.md §0), ``attention`` ('auto'
  |
  'xla' | 'cudnn': the ``jax.nn.dot_product_attention`` implementation,
  ``owl_cl.model.clip.resolve_attention``), ``remat`` ('none' | 'block' | a
  ``jax.checkpoint_policies`` name: rematerialisation per residual block,
  ``owl_cl.model.clip.remat_policy``), ``version`` ('v1' | 'owlv2': OWLv2 adds the
  objectness head, docs/owlv2.md), ``objectness_top_k`` (int >= 0; OWLv2 in training only:
  the heads see only the k tokens of highest objectness, scenic's ``objectness_top_k``; 0 =
  all tokens).

  Args:
    variant: one of ``'tiny'``, ``'vit_b32'``, ``'vit_b16'``, ``'vit_l14'``, ``'owlv2_tiny'``,
      ``'owlv2_b16'`` (960 px), ``'owlv2_l14'`` (1008 px).

  Raises:
    ValueError: unknown variant (the message lists the known ones).

  Source: docs/reference.md §1 table; scenic `scenic/projects/owl_vit/clip/model.py` (``CONFIGS``),
  `configs/owl_v2_clip_b16.py`, `configs/owl_v2_clip_l14.py`.
  """
  if variant not in VARIANTS:
    raise ValueError(f"unknown model variant {variant!r}; known: {sorted(VARIANTS)}")
  return ModelConfig(**VARIANTS[variant])

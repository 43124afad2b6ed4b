"""The `model` config section, written once (`config_spec`): which OWL-ViT a run builds.

`ModelSpec` is the schema of `config.model`: `owl_cl/configs/base.py` takes its defaults,
`config_rules.FIELD_RULES` its rules, docs/configs.md its docs, and `Detector` converts
`config.model` to it once (`config_spec.from_config`). The fields of the model itself (the 13
architecture fields, drop-path rates, ...) are `variants.ModelConfig`'s, which
`model.overrides` may set (`variants.OVERRIDE_RULES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax.core import FrozenDict
import jax.numpy as jnp

from owl_cl import config_spec
from owl_cl.config_fields import choice
from owl_cl.config_fields import mapping
from owl_cl.config_fields import text
from owl_cl.model.clip import ATTENTION_IMPLEMENTATIONS
from owl_cl.model.clip import REMAT_POLICIES
from owl_cl.model.tokenizer import known_tokenizers
from owl_cl.model.variants import VARIANTS

#: The compute dtypes `model.dtype` may name (jnp types of those names).
DTYPES = ("float32", "bfloat16", "float16")

# Why a field leaves the cache keys of what the model builds (pre-trained model, buffer):
# these choose how a step executes, not what it computes (the same values up to rounding).
_HOW_NOT_WHAT = "how a step executes, not what it computes (the same values up to rounding)"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """`config.model`: the variant, its tokenizer, its field overrides and how it executes."""

  variant: str = config_spec.field(
    "tiny",
    choice(sorted(VARIANTS)),
    "The architecture (`owl_cl.model.VARIANTS`; docs/reference.md §1): `tiny` is ours, for "
    "2 CPU cores; `vit_b32`, `vit_b16`, `vit_l14` OWL-ViT v1; `owlv2_*` OWLv2.",
  )
  tokenizer: str = config_spec.field(
    "word_hash",
    choice(known_tokenizers),
    "The query tokenizer: `word_hash` (the tiny model's) or `clip` (the ViT variants' BPE, "
    "docs/reference.md §2).",
  )
  tokenizer_vocab_path: str | None = config_spec.field(
    None,
    text(optional=True),
    "The `clip` tokenizer's local vocabulary: an HF checkpoint folder with vocab.json and "
    "merges.txt, or OpenAI's bpe_simple_vocab_16e6.txt.gz; nothing is downloaded.",
    type_=str,
  )
  overrides: Any = config_spec.field(
    FrozenDict({"context_length": 8}),
    mapping,
    "Fields of the variant's `ModelConfig` to replace, e.g. `vision_layers=2`. The tiny "
    "model's queries are a few words: a text context of 8 halves its text tower's cost.",
  )
  dtype: str | None = config_spec.field(
    None,
    choice(DTYPES, optional=True),
    "Compute dtype of the towers; parameters, softmax, heads, loss and optimizer stay "
    "float32. None: the variant's (float32 for tiny, bfloat16 for the ViTs).",
    type_=str,
  )
  attention: str = config_spec.field(
    "auto",
    choice(ATTENTION_IMPLEMENTATIONS),
    "The attention kernel (`jax.nn.dot_product_attention`): `auto` (cuDNN's fused kernel "
    "on a GPU in bf16/fp16, XLA elsewhere), `xla` or `cudnn`.",
    key=_HOW_NOT_WHAT,
  )
  remat: str = config_spec.field(
    "none",
    choice(REMAT_POLICIES),
    "Rematerialisation per residual block: `none`, `block` (recompute each block in the "
    "backward pass) or a `jax.checkpoint_policies` name.",
    key=_HOW_NOT_WHAT,
  )

  def model_fields(self) -> dict[str, Any]:
    """`create_model` keyword arguments: `dtype` (the jnp type of its name; None keeps the
    variant's), `attention`, `remat`, then `overrides` (which win)."""
    fields: dict[str, Any] = {}
    if self.dtype is not None:
      fields["dtype"] = getattr(jnp, self.dtype)
    fields.update(attention=self.attention, remat=self.remat)
    fields.update(dict(self.overrides))
    return fields

  def description(self) -> str:
    """ "config.model.variant='tiny' with overrides {...}" (for error messages)."""
    overrides = dict(self.overrides)
    return f"config.model.variant={self.variant!r}" + (
      f" with overrides {overrides}" if overrides else ""
    )

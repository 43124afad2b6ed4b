"""What every format shares: the parameter tree a loader must produce, and its model config.

Every loader in this package returns the ``params`` collection as a nested ``dict`` of float32
``np.ndarray`` equal, in paths and shapes, to our module's tree (``jax.eval_shape`` of
``OwlViT.init``, docs/reference.md §1.1). :func:`check_params` is the one place that compares
a tree with the module's; :class:`CheckpointMismatchError` lists every difference at once.
:func:`infer_model_config` reads the architecture back off a tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import math
import re
from typing import Any

import flax
from flax.traverse_util import flatten_dict
from flax.traverse_util import unflatten_dict
import jax
import jax.numpy as jnp
import numpy as np

from owl_cl.model import owl_vit as owl_lib

PyTree = Any
Target = owl_lib.ModelConfig | PyTree

# An error lists at most this many paths per kind; a wrong variant mismatches hundreds.
_MAX_LISTED = 60


class CheckpointMismatchError(ValueError):
  """A checkpoint's parameter names/shapes differ from the module's.

  Attributes:
    source: the file (or description) the parameters came from.
    missing: paths the module needs that the checkpoint lacks.
    unexpected: paths the checkpoint has that the module does not.
    wrong_shape: ``(path, checkpoint shape, expected shape)`` triples.
  """

  def __init__(
    self,
    source: str,
    missing: Sequence[str] = (),
    unexpected: Sequence[str] = (),
    wrong_shape: Sequence[tuple[str, tuple, tuple]] = (),
    what: str = "",
  ):
    self.source = source
    self.missing = list(missing)
    self.unexpected = list(unexpected)
    self.wrong_shape = list(wrong_shape)
    lines = [f"parameters of {source} do not match the model{what}:"]
    for title, items in (
      ("missing", self.missing),
      ("unexpected", self.unexpected),
      (
        "wrong shape",
        [f"{p}: checkpoint {tuple(a)} vs expected {tuple(b)}" for p, a, b in self.wrong_shape],
      ),
    ):
      if items:
        lines.append(f"  {title} ({len(items)}):")
        lines += [f"    {x}" for x in items[:_MAX_LISTED]]
        if len(items) > _MAX_LISTED:
          lines.append(f"    ... and {len(items) - _MAX_LISTED} more")
    super().__init__("\n".join(lines))


def flatten(tree: PyTree) -> dict[str, Any]:
  """``{'a/b/c': leaf}`` of a nested (possibly frozen) mapping; leaves are not copied."""
  return flatten_dict(flax.core.unfreeze(tree), sep="/")


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """Inverse of :func:`flatten`: a nested ``dict`` from ``{'a/b/c': leaf}``."""
  return unflatten_dict(dict(flat), sep="/")


def abstract_params(config: owl_lib.ModelConfig) -> PyTree:
  """The module's parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated).

  Args:
    config: a :class:`owl_cl.model.owl_vit.ModelConfig` (or any mapping of its fields).

  Returns:
    Nested ``dict`` = ``jax.eval_shape(OwlViT(**config).init, ...)['params']``.

  Source: docs/reference.md §1.1.
  """
  cfg = dict(config)
  model = owl_lib.OwlViT(**cfg)
  images = jax.ShapeDtypeStruct((1, cfg["image_size"], cfg["image_size"], 3), jnp.float32)
  queries = jax.ShapeDtypeStruct((1, 1, cfg["context_length"]), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), images, queries)
  return flax.core.unfreeze(variables)["params"]


def _resolve_target(target: Target) -> PyTree:
  if isinstance(target, owl_lib.ModelConfig):
    return abstract_params(target)
  return target


def check_params(params: PyTree, target: Target, source: str) -> dict[str, np.ndarray]:
  """Checks a parameter tree against the module's and returns it as float32 numpy.

  Args:
    params: nested mapping of arrays (numpy, jax, anything ``np.asarray`` takes).
    target: a ``ModelConfig`` (its :func:`abstract_params`) or a tree with ``.shape``
      leaves (arrays or ``jax.ShapeDtypeStruct``).
    source: file name (or description) quoted in errors.

  Returns:
    Nested ``dict`` of ``np.ndarray`` in the target's dtypes (float32), same paths as the
    target.

  Raises:
    CheckpointMismatchError: listing every missing, unexpected and wrongly shaped path
      (with both shapes).

  Source: docs/reference.md §1.1, §2.
  """
  like = flatten(_resolve_target(target))
  got = flatten(params)
  missing = sorted(set(like) - set(got))
  unexpected = sorted(set(got) - set(like))
  wrong = [
    (k, tuple(np.shape(got[k])), tuple(like[k].shape))
    for k in sorted(set(got) & set(like))
    if tuple(np.shape(got[k])) != tuple(like[k].shape)
  ]
  if missing or unexpected or wrong:
    raise CheckpointMismatchError(source, missing, unexpected, wrong)
  return unflatten({k: np.asarray(got[k]).astype(like[k].dtype, copy=False) for k in like})


# --------------------------------------------------------------------------------------------
# Model configurations.
# --------------------------------------------------------------------------------------------


def model_config_to_dict(config: owl_lib.ModelConfig) -> dict[str, Any]:
  """JSON-friendly ``dict`` of a ``ModelConfig`` (``dtype`` as its name, e.g. 'float32')."""
  out = dict(config)
  out["dtype"] = jnp.dtype(out["dtype"]).name
  return out


def model_config_from_dict(fields: Mapping[str, Any]) -> owl_lib.ModelConfig:
  """Inverse of :func:`model_config_to_dict`.

  Raises:
    ValueError: missing or unknown fields (named).
  """
  names = {f.name for f in dataclasses.fields(owl_lib.ModelConfig)}
  # Fields with a default (attention, remat) may be absent from older files.
  optional = {
    f.name for f in dataclasses.fields(owl_lib.ModelConfig) if f.default is not dataclasses.MISSING
  }
  if not names - optional <= set(fields) <= names:
    raise ValueError(
      f"model config fields differ: missing {sorted(names - optional - set(fields))}, "
      f"unknown {sorted(set(fields) - names)}"
    )
  values = dict(fields)
  values["dtype"] = jnp_dtype(values["dtype"])
  return owl_lib.ModelConfig(**values)


def jnp_dtype(name: Any) -> Any:
  """'float32' / 'bfloat16' (or a dtype) -> the ``jnp`` scalar type the variants use."""
  return getattr(jnp, jnp.dtype(name).name)


def infer_model_config(
  params: PyTree,
  *,
  tokenizer: str = "clip",
  hf_compat: bool = False,
  dtype: Any = jnp.float32,
  text_stochastic_depth: float = 0.1,
  vision_stochastic_depth: float = 0.2,
) -> owl_lib.ModelConfig:
  """Reads the architecture (widths, layers, heads, patch, image size, ...) off a tree.

  Args:
    params: our parameter tree (arrays or ``ShapeDtypeStruct``).
    tokenizer: a `ModelConfig` field a tree does not determine.
    hf_compat: a `ModelConfig` field a tree does not determine.
    dtype: a `ModelConfig` field a tree does not determine.
    text_stochastic_depth: a `ModelConfig` field a tree does not determine.
    vision_stochastic_depth: a `ModelConfig` field a tree does not determine.

  Returns:
    ``ModelConfig``; ``image_size = sqrt(P) * patch`` from the vision positional
    embedding ``[P + 1, D]``; ``version='owlv2'`` when the tree has ``objectness_head``.

  Raises:
    ValueError: a needed leaf is absent (named) or the positional grid is not square.

  Source: docs/reference.md §1.1.
  """
  flat = flatten(params)

  def shape(path):
    if path not in flat:
      raise ValueError(f"cannot infer the model config: parameter {path} is missing")
    return tuple(flat[path].shape)

  def layers(tower):
    prefix = f"backbone/clip/{tower}/transformer/"
    idx = {
      int(m.group(1))
      for k in flat
      for m in [re.match(re.escape(prefix) + r"resblocks_(\d+)/", k)]
      if m
    }
    if not idx:
      raise ValueError(f"cannot infer the model config: no {prefix}resblocks_* blocks")
    return max(idx) + 1

  vis, txt = "backbone/clip/visual", "backbone/clip/text"
  patch = shape(f"{vis}/conv1/kernel")[0]
  tokens = shape(f"{vis}/positional_embedding")[0] - 1
  grid = math.isqrt(tokens)
  if grid * grid != tokens:
    raise ValueError(f"vision positional embedding has {tokens} patch rows: not a square grid")
  vocab, text_width = shape(f"{txt}/token_embedding/embedding")
  return owl_lib.ModelConfig(
    tokenizer=tokenizer,
    vocab_size=vocab,
    context_length=shape(f"{txt}/positional_embedding")[0],
    embed_dim=shape(f"{txt}/text_projection/kernel")[1],
    image_size=grid * patch,
    patch_size=patch,
    vision_width=shape(f"{vis}/class_embedding")[0],
    vision_layers=layers("visual"),
    vision_heads=shape(f"{vis}/transformer/resblocks_0/attn/query/kernel")[1],
    vision_mlp_dim=shape(f"{vis}/transformer/resblocks_0/mlp/c_fc/kernel")[1],
    text_width=text_width,
    text_layers=layers("text"),
    text_heads=shape(f"{txt}/transformer/resblocks_0/attn/query/kernel")[1],
    text_mlp_dim=shape(f"{txt}/transformer/resblocks_0/mlp/c_fc/kernel")[1],
    text_stochastic_depth=text_stochastic_depth,
    vision_stochastic_depth=vision_stochastic_depth,
    hf_compat=hf_compat,
    dtype=dtype,
    # OWLv2's tree is v1's plus the objectness head (docs/owlv2.md).
    version="owlv2" if any(k.startswith("objectness_head/") for k in flat) else "v1",
  )

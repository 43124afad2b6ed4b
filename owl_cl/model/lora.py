"""LoRA: low-rank adapters on OWL-ViT's Dense layers, through qwix (docs/lora.md).

LoRA (Hu et al., ICLR 2022, "LoRA: Low-Rank Adaptation of Large Language Models") keeps a
layer's kernel W [d_in, d_out] frozen and learns W + (alpha / r) A B with A [d_in, r] and
B [r, d_out], B = 0 at initialisation (so the adapted model starts as the pre-trained one).
qwix (`qwix.apply_lora_to_model`, `LoraProvider`, `LoraRule`) intercepts the `dot_general` of
every linen module whose '/'-joined path matches a rule's `module_path` regex in full and adds
`<kernel>_lora_a` / `<kernel>_lora_b` parameters beside the kernel, in the same scenic tree
(docs/reference.md §1.1): a LoRA parameter tree is the base tree plus those leaves.

A kernel with several input or output axes (the attention's `DenseGeneral` query / key /
value [D, H, D/H] and out [H, D/H, D]) gets A [prod(input axes), r] and B [r, prod(output
axes)] (qwix `_create_lora_layer_shapes`); its input axes lead, so the merged kernel is
W + (alpha / r) (A B).reshape(W.shape) (`merge`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp

from owl_cl.train import optim
from owl_cl.train import spec as train_spec

PyTree = Any

# The adapted layers by default (`train.lora.targets`' default): attention q/k/v/out and the MLP's
# Dense layers of every block of both towers; with the targets' check, defined beside the
# `train.lora` section's spec (owl_cl/train/spec.py).
DEFAULT_TARGETS = train_spec.DEFAULT_TARGETS
targets_problem = train_spec.targets_problem

# The model methods qwix intercepts: every entry point of `OwlViT` the steps call
# (`owl_cl.train.step`: the text tower alone, the image tower alone, the heads).
MODEL_METHODS = ("__call__", "text_embedder", "image_embedder", "class_predictor", "box_predictor")

# Suffixes qwix gives an adapter's two parameters (beside the kernel they adapt).
SUFFIX_A, SUFFIX_B = optim.ADAPTER_SUFFIXES

# A `train.frozen`-style regex (matched in full against a '/'-joined path) that matches every
# parameter but the adapters: the base model, frozen while the adapters train.
FROZEN_BASE = rf".*(?<!{SUFFIX_A})(?<!{SUFFIX_B})"


@dataclasses.dataclass(frozen=True)
class LoraOptions:
  """The adapters of a run (`train.lora`, docs/lora.md).

  Attributes:
    rank: r >= 1, the inner dimension of A [d_in, r] and B [r, d_out].
    alpha: the update's scale numerator (> 0): the layer adds (alpha / r) x A B.
    dropout: in [0, 1): dropout on the adapter's input in training (Hu et al.; qwix applies it
      to x before x A); 0 = none.
    targets: regexes matched in full against module paths ('/'-joined, e.g.
      'backbone/clip/visual/transformer/resblocks_0/attn/query').
  """

  rank: int
  alpha: float
  dropout: float = 0.0
  targets: tuple[str, ...] = DEFAULT_TARGETS

  @property
  def scale(self) -> float:
    """alpha / rank: the factor of A B in the merged kernel."""
    return self.alpha / self.rank


def options_from_config(lora_config) -> LoraOptions | None:
  """`train.lora` (a ConfigDict or mapping with rank, alpha, dropout, targets) as options;
  None when LoRA is off (rank 0 or no section)."""
  if lora_config is None or not lora_config.get("rank"):
    return None
  return LoraOptions(
    rank=int(lora_config["rank"]),
    alpha=float(lora_config["alpha"]),
    dropout=float(lora_config["dropout"]),
    targets=tuple(lora_config["targets"]),
  )


# Memoised: qwix makes a new subclass of the model's class per call, which compares unequal to
# the one of an earlier call, so the jitted steps built on an equal LoRA model in a later run
# of the process (`owl_cl.train.step_cache`, keyed by the model) would not be reused. The
# returned module holds no state (parameters are passed to `apply`).
@functools.lru_cache(maxsize=16)
def lora_model(model: nn.Module, options: LoraOptions, *, train: bool) -> nn.Module:
  """`model` with adapters on the Dense layers `options.targets` matches (qwix).

  Args:
    model: an `OwlViT` (linen; any variant, v1 or OWLv2).
    options: rank, alpha, dropout, targets.
    train: True keeps `options.dropout` (the train step's 'dropout' rng draws its masks);
      False drops it, for eval-mode forwards (retrieval features, evaluation), which pass no
      rng (qwix applies its dropout whenever the rate is > 0).

  Returns:
    A linen module with `model`'s methods and fields; its parameters are `model`'s plus
    `<kernel>_lora_a` float32 [d_in, r] and `<kernel>_lora_b` float32 [r, d_out] in every
    targeted module. Its methods must be named through `type(returned)` (qwix intercepts the
    subclass's methods, not `OwlViT`'s). Apply it to jax Arrays (as every jitted step does):
    qwix finds a layer's kernel among its `jax.Array` parameters, and a NumPy kernel would be
    passed over silently (the layer then runs without its adapter).

  Source: qwix `apply_lora_to_model`, `LoraProvider`, `LoraRule` (qwix 0.1.8,
  `qwix/_src/providers/lora.py`).
  """
  # Imported here: qwix (with flax.nnx) takes about 0.17 s to import, which every process
  # paid though only a LoRA run needs it.
  import qwix

  rules = [
    qwix.LoraRule(
      module_path=pattern,
      rank=options.rank,
      alpha=options.alpha,
      dropout=options.dropout if train else 0.0,
    )
    for pattern in options.targets
  ]
  return qwix.apply_lora_to_model(model, qwix.LoraProvider(rules), methods=MODEL_METHODS)


def is_adapter(path: tuple[str, ...]) -> bool:
  """True for the path (below `params`) of an adapter's A or B."""
  return path[-1].endswith((SUFFIX_A, SUFFIX_B))


def _split(params: PyTree, adapters: bool) -> PyTree:
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: v for k, v in flat.items() if is_adapter(k) == adapters})


def adapters_of(params: PyTree) -> PyTree:
  """The adapter leaves of a LoRA parameter tree (the same nesting, nothing else)."""
  return _split(params, True)


def base_of(params: PyTree) -> PyTree:
  """A LoRA parameter tree without its adapters: the base model's tree."""
  return _split(params, False)


def combine(base: PyTree, adapters: PyTree) -> PyTree:
  """The LoRA parameter tree of `base` (the model's parameters) and `adapters`.

  Raises:
    ValueError: `base` holds an adapter, or an adapter's kernel is not in `base` (named).
  """
  flat_base = traverse_util.flatten_dict(base)
  flat_adapters = traverse_util.flatten_dict(adapters)
  if held := [k for k in flat_base if is_adapter(k)]:
    raise ValueError(f"the base parameters already hold adapters: {'/'.join(held[0])}")
  for path in flat_adapters:
    kernel = path[:-1] + (path[-1][: -len(SUFFIX_A)],)
    if not is_adapter(path) or kernel not in flat_base:
      raise ValueError(f"adapter {'/'.join(path)} has no kernel {'/'.join(kernel)} in the base")
  return traverse_util.unflatten_dict({**flat_base, **flat_adapters})


def init_adapters(model: nn.Module, options: LoraOptions, key: jax.Array) -> PyTree:
  """Fresh adapters of `model`: A by qwix's He-uniform initialiser, B = 0.

  Only the adapters are returned (the base parameters qwix's `init` draws, and the forward
  it traces, are dead code under jit, which XLA drops).

  Args:
    model: the base `OwlViT`.
    options: the adapters (`LoraOptions`).
    key: PRNG key of A's draw.

  Returns:
    The adapter tree (`adapters_of` layout): float32 A [d_in, r], B [r, d_out] per targeted
    kernel.

  Raises:
    ValueError: no module of `model` matches `options.targets` (a typo would train nothing).
  """
  adapted = lora_model(model, options, train=False)
  config = model.config
  images = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
  queries = jnp.ones((1, 1, config.context_length), jnp.int32)
  adapters = jax.jit(lambda k: adapters_of(adapted.init(k, images, queries)["params"]))(key)
  if not adapters:
    raise ValueError(f"train.lora.targets {list(options.targets)} match no Dense layer")
  return adapters


def abstract_adapters(model: nn.Module, options: LoraOptions) -> PyTree:
  """The shapes and dtypes of `init_adapters` (`jax.ShapeDtypeStruct` leaves; no compute)."""
  return jax.eval_shape(lambda: init_adapters(model, options, jax.random.PRNGKey(0)))


def merge(params: PyTree, options: LoraOptions) -> PyTree:
  """The base model's parameters with every adapter merged into its kernel.

  W' = W + (alpha / r) (A B).reshape(W.shape), computed in float32: `model` applied to W'
  equals the LoRA model applied to `params` up to float32 rounding (the product is summed in
  another order).

  Args:
    params: a LoRA parameter tree (`combine`).
    options: rank and alpha of its adapters.

  Returns:
    A tree of the base model's layout (no adapter leaves).

  Raises:
    ValueError: an adapter whose shapes do not fit its kernel (named).

  Source: Hu et al. 2022, §4.1 ("we can explicitly compute and store W = W0 + BA ... no
  additional inference latency").
  """
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if not is_adapter(k)}
  for path, a in flat.items():
    if not path[-1].endswith(SUFFIX_A):
      continue
    kernel_path = path[:-1] + (path[-1][: -len(SUFFIX_A)],)
    b = flat[kernel_path[:-1] + (kernel_path[-1] + SUFFIX_B,)]
    kernel = out[kernel_path]
    # The kernel's input axes lead: A's rows are their product (qwix's reshape of A).
    leading = [math.prod(kernel.shape[:i]) for i in range(1, kernel.ndim)]
    if (
      a.ndim != 2
      or b.ndim != 2
      or a.shape[0] not in leading
      or a.shape[0] * b.shape[1] != (kernel.size)
    ):
      raise ValueError(
        f"adapter of {'/'.join(kernel_path)}: A {a.shape}, B {b.shape} do not fit the kernel "
        f"{kernel.shape}"
      )
    delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).reshape(kernel.shape)
    out[kernel_path] = (kernel.astype(jnp.float32) + options.scale * delta).astype(kernel.dtype)
  return traverse_util.unflatten_dict(out)


def adapter_bytes(adapters: PyTree) -> int:
  """Bytes of an adapter tree's leaves (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters))


def dense_module_paths(params: PyTree) -> list[str]:
  """The '/'-joined paths of the modules of `params` that hold a `kernel` (Dense layers)."""
  return sorted(
    {"/".join(path[:-1]) for path in traverse_util.flatten_dict(params) if path[-1] == "kernel"}
  )

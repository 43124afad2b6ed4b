"""How each of our leaves is laid out in a torch state dict (HF and OpenAI CLIP alike).

Flax stores a dense kernel as ``[in, out]`` and splits attention projections per head; torch
stores ``[out, in]`` with the heads fused. Each :class:`Layout` converts one kind of leaf both
ways and predicts the torch shape, so a wrong checkpoint is reported before any reshape fails.
Source: docs/reference.md §1.2.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one of our leaves is stored in torch: to_torch(ours), from_torch(w, our shape),
  torch_shape(our shape)."""

  name: str
  to_torch: Callable[[np.ndarray], np.ndarray]
  from_torch: Callable[[np.ndarray, tuple], np.ndarray]
  torch_shape: Callable[[tuple], tuple]


SAME = Layout("same", lambda x: x, lambda w, s: w, lambda s: tuple(s))
# torch Linear weight [out, in] = flax kernel [in, out].T
LINEAR = Layout("linear", lambda x: x.T, lambda w, s: w.T, lambda s: tuple(s[::-1]))
# q/k/v: kernel [D, H, dh] <-> weight [H*dh, D]; bias [H, dh] <-> [H*dh]
QKV = Layout(
  "qkv",
  lambda x: x.reshape(x.shape[0], -1).T,
  lambda w, s: w.T.reshape(s),
  lambda s: (int(np.prod(s[1:])), s[0]),
)
HEAD_BIAS = Layout(
  "head_bias", lambda x: x.reshape(-1), lambda w, s: w.reshape(s), lambda s: (int(np.prod(s)),)
)
# out: kernel [H, dh, D] <-> weight [D, H*dh]
OUT = Layout(
  "out",
  lambda x: x.reshape(-1, x.shape[-1]).T,
  lambda w, s: w.T.reshape(s),
  lambda s: (s[2], s[0] * s[1]),
)
# conv: HWIO <-> OIHW
CONV = Layout(
  "conv",
  lambda x: x.transpose(3, 2, 0, 1),
  lambda w, s: w.transpose(2, 3, 1, 0),
  lambda s: (s[3], s[2], s[0], s[1]),
)


def contiguous(x: np.ndarray) -> np.ndarray:
  """C-contiguous copy if needed, keeping 0-d arrays 0-d (unlike np.ascontiguousarray)."""
  return np.asarray(x, order="C")


def to_numpy(value: Any) -> np.ndarray:
  """torch tensor / array -> numpy; floating values as float32 (bf16/fp16 upcast)."""
  if hasattr(value, "detach"):  # torch.Tensor
    import torch

    value = value.detach().cpu()
    if value.is_floating_point() and value.dtype != torch.float32:
      value = value.float()
    value = value.numpy()
  value = np.asarray(value)
  if np.issubdtype(value.dtype, np.floating) and value.dtype != np.float32:
    value = value.astype(np.float32)
  return value

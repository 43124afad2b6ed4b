"""Comparing two gradient trees array by array, relative to each array's magnitude.

Used where two computations of the same gradients must agree within a rounding tolerance:
cuDNN against XLA attention, a rematerialised model against the plain one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from owl_cl.model import clip as clip_lib


def _arrays_by_path(tree: Any) -> dict[str, np.ndarray]:
  """{`jax.tree_util.keystr` path: float32 NumPy array} of a tree's leaves."""
  return {
    jax.tree_util.keystr(p): np.asarray(v, np.float32)
    for p, v in jax.tree_util.tree_leaves_with_path(tree)
  }


def grad_agreement(ref: Any, got: Any) -> dict[str, float]:
  """The largest |got - ref| of each array over the largest |ref| of its scaling array.

  The scaling array is the array itself, except for a gradient that is zero in exact
  arithmetic (the attention key bias's: softmax cancels q . b_k). Such a gradient is rounding
  noise of terms as large as another array's gradient, so it is divided by that array's
  largest |ref| (`clip_lib.gradient_scale_path`: the key kernel's).

  Args:
    ref: pytree of arrays of any float dtype (outputs and gradients; compared in float32).
    got: pytree of the same structure as `ref`.
  Returns:
    {`jax.tree_util.keystr` path: relative difference (float, >= 0; NaN if `got` holds
    NaN)}. A scale below 1e-30 counts as 1e-30.
  Raises:
    KeyError: `got` lacks a path of `ref`, or a zero-gradient path's scaling array is not in
      `ref`.
  Source: `clip_lib.ZERO_GRADIENT_SCALED_BY`.
  """
  ref_arrays, got_arrays = _arrays_by_path(ref), _arrays_by_path(got)
  out = {}
  for path, a in ref_arrays.items():
    scale_path = clip_lib.gradient_scale_path(path)
    scale = max(float(np.max(np.abs(ref_arrays[scale_path]))), 1e-30)
    out[path] = float(np.max(np.abs(got_arrays[path] - a))) / scale
  return out

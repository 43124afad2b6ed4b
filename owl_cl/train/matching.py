"""Exact minimum-cost bipartite assignment in JAX (no host callback).

A shortest-augmenting-path Hungarian algorithm (Kuhn-Munkres with the Jonker-Volgenant /
"e-maxx" potentials formulation) written with `lax.fori_loop` / `lax.while_loop` over static
shapes, so it compiles for CPU, GPU and TPU, runs under `jit` and `vmap`, and needs no round
trip to the host (the SciPy matcher in `owl_cl.train.matcher` is a `pure_callback`).

The algorithm. Rows are assigned one at a time. For row i, a Dijkstra-like search over the
columns grows a tree of tight edges under the reduced costs `c[r, j] - u[r] - v[j]`: each
iteration marks the column j0 reached last as used, relaxes `minv[j]` (the smallest reduced
cost from the tree to column j) for every unused column from the row matched to j0, takes
the unused column with the smallest `minv` (the slack `delta`), and shifts the potentials by
`delta` (u up on the tree's rows, v down on its columns) so that edge becomes tight. When the
column reached is free, the path back through `way` is augmented. Every iteration is one
vectorised pass over the m columns; a row needs at most (rows assigned so far + 1)
iterations, so the worst case is O(n^2 m) and the usual case close to O(n m). The potentials
stay dual-feasible throughout, which is what makes the result exactly optimal (up to the
floating-point rounding of the potentials; integer costs are solved exactly).

Reference design: scenic `scenic/model_lib/matchers/hungarian_tpu.py` (a JAX Hungarian for
TPUs, built on the classic step-by-step Munkres reduction); this module uses the
shortest-augmenting-path formulation instead (Jonker & Volgenant 1987; the O(n^2 m) variant
described at cp-algorithms.com, "Hungarian algorithm").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["assign_rows", "linear_sum_assignment", "match_targets"]


def _checked_inputs(cost, row_active, col_allowed) -> tuple[Array, Array, Array]:
  """`assign_rows`'s inputs as float cost [n, m] (integers -> float32), bool row_active [n]
  and bool col_allowed [m] (None: all True); ValueError for other shapes."""
  cost = jnp.asarray(cost)
  if cost.ndim != 2:
    raise ValueError(f"cost must be [n, m], got shape {cost.shape}")
  n, m = cost.shape
  row_active = jnp.ones((n,), bool) if row_active is None else jnp.asarray(row_active, bool)
  col_allowed = jnp.ones((m,), bool) if col_allowed is None else jnp.asarray(col_allowed, bool)
  if row_active.shape != (n,) or col_allowed.shape != (m,):
    raise ValueError(
      f"row_active must be [{n}] and col_allowed [{m}], got {row_active.shape} and "
      f"{col_allowed.shape}"
    )
  if not jnp.issubdtype(cost.dtype, jnp.floating):
    cost = cost.astype(jnp.float32)
  return cost, row_active, col_allowed


def assign_rows(cost: Array, row_active: Array | None = None, col_allowed: Array | None = None):
  """Minimum-cost assignment of every active row to a distinct allowed column.

  Minimises ``sum_r cost[r, col[r]]`` over the active rows, each getting a different allowed
  column. Inactive rows and disallowed columns take no part. The number of active rows must
  not exceed the number of allowed columns (dynamic; otherwise the rows that cannot be
  placed are left unassigned and the result is not optimal).

  Args:
    cost: float [n, m] finite costs (float32 or float64; computed in that dtype).
    row_active: bool [n] or None (all rows).
    col_allowed: bool [m] or None (all columns).

  Returns:
    int32 [n]: the column of each row, -1 for inactive (or unplaceable) rows.

  Raises:
    ValueError: cost is not 2-D, or the masks' shapes disagree with it.

  Source: Jonker & Volgenant (1987), shortest augmenting paths with potentials; scenic
  `matchers/hungarian_tpu.py` is the reference design (not its algorithm).
  """
  cost, row_active, col_allowed = _checked_inputs(cost, row_active, col_allowed)
  n, m = cost.shape
  dtype = cost.dtype
  inf = jnp.asarray(jnp.inf, dtype)
  # Column m is the search's virtual start column (the "column 0" of the classic
  # formulation): it holds the row being inserted and is never a candidate.
  cost_ext = jnp.concatenate([cost, jnp.zeros((n, 1), dtype)], axis=1)
  allowed = jnp.concatenate([col_allowed, jnp.zeros((1,), bool)])
  virtual = m

  def insert_row(i, state):
    u, v, p = state
    p = p.at[virtual].set(i)

    def search_cond(s):
      _, _, p, _, _, _, j0, ok = s
      return ok & (p[j0] >= 0)

    def search_step(s):
      u, v, p, minv, used, way, j0, _ = s
      used = used.at[j0].set(True)
      i0 = p[j0]
      reduced = cost_ext[i0] - u[i0] - v
      free = allowed & ~used
      better = free & (reduced < minv)
      minv = jnp.where(better, reduced, minv)
      way = jnp.where(better, j0, way)
      slack = jnp.where(free, minv, inf)
      j1 = jnp.argmin(slack).astype(jnp.int32)
      delta = slack[j1]
      ok = jnp.isfinite(delta)  # False only when no free column is reachable
      delta = jnp.where(ok, delta, jnp.zeros((), dtype))
      # Shift the potentials of the search tree (rows matched to used columns, used
      # columns) by delta; the slack of every other free column drops by delta.
      tree_rows = jnp.where(used, p, n)
      u = u.at[tree_rows].add(delta, mode="drop")
      v = jnp.where(used, v - delta, v)
      minv = jnp.where(free, minv - delta, minv)
      return u, v, p, minv, used, way, jnp.where(ok, j1, j0), ok

    init = (
      u,
      v,
      p,
      jnp.full((m + 1,), inf),
      jnp.zeros((m + 1,), bool),
      jnp.full((m + 1,), virtual, jnp.int32),
      jnp.int32(virtual),
      row_active[i],
    )
    u, v, p, _, _, way, j0, ok = jax.lax.while_loop(search_cond, search_step, init)

    # Augment along `way` from the free column reached back to the virtual column.
    def augment_step(s):
      p, j0 = s
      j1 = way[j0]
      return p.at[j0].set(p[j1]), j1

    start = jnp.where(ok & row_active[i], j0, virtual).astype(jnp.int32)
    p, _ = jax.lax.while_loop(lambda s: s[1] != virtual, augment_step, (p, start))
    return u, v, p.at[virtual].set(-1)

  state = (
    jnp.zeros((n,), dtype),
    jnp.zeros((m + 1,), dtype),
    jnp.full((m + 1,), -1, jnp.int32),
  )
  _, _, p = jax.lax.fori_loop(0, n, insert_row, state)
  rows = p[:m]
  return (
    jnp.full((n,), -1, jnp.int32)
    .at[jnp.where(rows >= 0, rows, n)]
    .set(jnp.arange(m, dtype=jnp.int32), mode="drop")
  )


def linear_sum_assignment(cost: Array) -> tuple[Array, Array]:
  """JAX counterpart of ``scipy.optimize.linear_sum_assignment`` for a dense matrix.

  Args:
    cost: float [n, m] finite costs, either orientation.

  Returns:
    (row_ind, col_ind) int32 [min(n, m)]: the assigned pairs, sorted by row as SciPy's.

  Raises:
    ValueError: cost is not 2-D.

  Source: `assign_rows`; SciPy's API.
  """
  cost = jnp.asarray(cost)
  if cost.ndim != 2:
    raise ValueError(f"cost must be [n, m], got shape {cost.shape}")
  n, m = cost.shape
  if n <= m:
    cols = assign_rows(cost)
    return jnp.arange(n, dtype=jnp.int32), cols
  rows = assign_rows(cost.T)  # [m]: the row of each column
  order = jnp.argsort(rows)
  return rows[order].astype(jnp.int32), order.astype(jnp.int32)


def match_targets(cost: Array, target_mask: Array) -> Array:
  """Hungarian matching of tokens to real targets, in JAX (the ``'jax'`` matcher).

  Every real target gets a distinct token (when there are at least as many tokens as real
  targets; otherwise every token gets a distinct real target) at minimum total cost; the
  other tokens get K - 1, the appended padding instance.

  Args:
    cost: float [..., T, K] finite matching costs (`owl_cl.train.matcher.matching_cost`).
    target_mask: bool [..., K], True for real targets.

  Returns:
    int32 [..., T]: the target index of each token (K - 1 for unmatched tokens).

  Raises:
    ValueError: shapes of cost and target_mask disagree.

  Source: docs/reference.md §3 (exact Hungarian matching); scenic `matchers/hungarian_tpu.py`
  (role).
  """
  cost = jnp.asarray(cost)
  target_mask = jnp.asarray(target_mask, bool)
  if cost.ndim < 2 or target_mask.shape != cost.shape[:-2] + cost.shape[-1:]:
    raise ValueError(
      f"expected cost [..., T, K] and target_mask [..., K], got {cost.shape} and "
      f"{target_mask.shape}"
    )
  *batch, t, k = cost.shape
  flat_cost = cost.reshape(-1, t, k)
  flat_mask = target_mask.reshape(-1, k)

  def one(c, mask):
    def targets_as_rows():  # each real target picks a token
      token = assign_rows(c.T, row_active=mask)  # [K]
      ok = token >= 0
      return (
        jnp.full((t,), k - 1, jnp.int32)
        .at[jnp.where(ok, token, t)]
        .set(jnp.arange(k, dtype=jnp.int32), mode="drop")
      )

    def tokens_as_rows():  # more real targets than tokens: each token picks a target
      target = assign_rows(c, col_allowed=mask)  # [T]
      return jnp.where(target >= 0, target, k - 1).astype(jnp.int32)

    if k <= t:  # static: real targets never outnumber tokens
      return targets_as_rows()
    return jax.lax.cond(jnp.sum(mask) <= t, targets_as_rows, tokens_as_rows)

  out = jax.vmap(one)(flat_cost, flat_mask)
  return out.reshape(*batch, t)

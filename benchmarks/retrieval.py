"""Retrieval benchmark: time per retrieval call of every algorithm, JAX vs a NumPy reference.

Measures, at the paper's sizes (N 54,226 buffer images, C 365 classes, k 8 top tokens, E 768,
B 16 new images, N_c 168 (ASER) / 352 (ASER-PC, SW-ASER-PC) candidates, K 20):

  * every retrieval algorithm of the registry (`owl_cl.replay.retrieval.registry.get_algorithm`),
    jitted, one call = one training step's retrieval (B replays), median over repeats after
    a compiling warm-up call; against its NumPy reference (`NUMPY_REFERENCES`, by registry
    name), or timed alone with the note 'no NumPy reference' when it has none;
  * the kernels (`knn_shapley`, `prototype_weighted_probs`, `adversarial_shapley_value`,
    `normalized_entropy`, `similarity_weighted_probs`) at the sizes one call uses;
  * the fixed parts of a call (`bench_floors`): the replay state's round trip through a
    jitted call and the per-call availability passes, against NumPy's whole `uniform` and
    `uniform_balanced` calls;
  * ASER-PC's precomputation of the left term over the whole buffer. At the full size it is
    N*k = 433,808 evaluation tokens against as many candidate tokens (a sort of 1.9e11
    entries), far beyond a CPU run: one chunk of evaluation images against the whole buffer
    is timed and scaled by the number of chunks (reported as an estimate).

each side by side with a straightforward, vectorised NumPy implementation of the same maths
(written here from docs/reference.md §7, not from the JAX code), run in the same process on the same
synthetic buffer. The ratio is NumPy time / JAX time (> 1: JAX is faster). The kernels'
outputs are also compared (max absolute difference): the NumPy references double as an
independent check of the JAX kernels. The retrieval calls draw random numbers, so their
outputs are not compared, only timed.

The synthetic buffer has a realistic class membership: each image holds 1-4 classes, class
frequencies are Zipf-like (a few frequent classes, a long tail) and every class has members.
Embeddings are random normal (timing does not depend on their values).

Usage:
  python benchmarks/retrieval.py [--quick | --smoke] [--sizes 54226,1000000] [--repeats 30]
  [--out benchmarks/results] [--train-step-seconds 0.25] [--skip-kernels] [--skip-floors]
  [--skip-precompute] [--processes 1]

`--processes P` > 1 also times the algorithms of each size in P fresh processes, one after
the other, and adds their medians and min-max to the report: a sub-millisecond call's time
differs from process to process (on the 2-core CPU `uniform_balanced` at 54k took 0.36-0.38 ms
in 7 of 8 processes and 0.52 ms in the eighth), so one process's table can place it on either
side of the NumPy reference.

`--sizes` runs every size in turn (default: the paper's N = 54,226 and N = 1M). At N = 1M the
buffer's [N, k, E] embeddings use E = 32 (`MILLION`: 1M x 8 x 768 float32 would be 24.6 GB
per array); they are read only by the ASV algorithms' N_c candidate rows.

Writes `<out>/retrieval[_quick|_smoke].json` and `.md` (`--smoke`: every row at tiny sizes,
`SMOKE`, in seconds). The script runs
unchanged on CPU, GPU or TPU (the device is recorded). `--train-step-seconds` is a measured
train step time to express retrieval as a fraction of it (default: the tiny model's CPU
step of docs/benchmarks.md, about 0.25 s for 32 images; the L/14 GPU step is not measured here).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from owl_cl import utils  # noqa: E402
from owl_cl.replay import class_index  # noqa: E402
from owl_cl.replay import state as state_lib  # noqa: E402
from owl_cl.replay.retrieval import class_selection  # noqa: E402
from owl_cl.replay.retrieval import dedup  # noqa: E402
from owl_cl.replay.retrieval import knn_shapley  # noqa: E402
from owl_cl.replay.retrieval import registry  # noqa: E402
from owl_cl.replay.retrieval import sample_selection  # noqa: E402
from owl_cl.replay.retrieval import spec as retrieval_spec  # noqa: E402

EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class Sizes:
  num_images: int = 54_226  # N
  num_classes: int = 365  # C
  top_k: int = 8  # k
  embed_dim: int = 768  # E
  batch: int = 16  # B
  candidates_aser: int = 168  # N_c of ASER
  candidates_pc: int = 352  # N_c of ASER-PC, SW-ASER-PC
  knn_k: int = 20  # K
  precompute_chunk: int = 16  # evaluation images per timed precomputation chunk
  embed_dtype: str = "float32"  # dtype of the buffer's [N, k, E] embeddings


FULL = Sizes()
# N = 1M: 1M x 8 x 768 float32 is 24.6 GB per embedding array (12.3 GB in bfloat16), more
# than this machine's memory; the buffer's [N, k, E] embeddings use E = 32 (float32, 1 GB
# each). They are read only by the ASV algorithms (N_c candidate rows per call), so only
# those rows' cost is lower than at E = 768; everything that scales with N is unchanged.
MILLION = dataclasses.replace(FULL, num_images=1_000_000, embed_dim=32)
QUICK = Sizes(
  num_images=600,
  num_classes=40,
  top_k=4,
  embed_dim=64,
  batch=8,
  candidates_aser=32,
  candidates_pc=48,
  knn_k=5,
  precompute_chunk=600,
)
# --smoke: every path in seconds (tests, CI); the sizes of
# tests/benchmarks/test_benchmark_retrieval.py.
SMOKE = Sizes(
  num_images=200,
  num_classes=12,
  top_k=2,
  embed_dim=8,
  batch=4,
  candidates_aser=8,
  candidates_pc=12,
  knn_k=3,
  precompute_chunk=200,
)

# Paper hyperparameters (suppl. Table 7): SWIL / GRASP w = 1, ASER c = 0.15; tau of
# A-SW-GRASP 0.99 (configs/base.py).
SWIL_W, GRASP_W, ASV_C, TAU = 1.0, 1.0, 0.15, 0.99


# ------------------------------------------------------------------------- synthetic data
def synthetic_buffer(sizes: Sizes, seed: int = 0) -> dict[str, np.ndarray]:
  """NumPy arrays of a random buffer with 1-4 classes per image (Zipf-like frequencies)."""
  rng = np.random.default_rng(seed)
  n, c, k, e = sizes.num_images, sizes.num_classes, sizes.top_k, sizes.embed_dim
  freq = 1.0 / np.arange(1, c + 1) ** 0.8
  freq /= freq.sum()
  membership = np.zeros((n, c), bool)
  num_classes = rng.integers(1, 5, n)
  for count in range(1, 5):
    rows = np.flatnonzero(num_classes == count)
    for _ in range(count):
      membership[rows, rng.choice(c, rows.size, p=freq)] = True
  membership[rng.choice(n, c, replace=False), np.arange(c)] = True  # every class has members
  prototypes = rng.standard_normal((sizes.num_classes, sizes.embed_dim), dtype=np.float32)
  class_embeddings = rng.standard_normal((n, k, e), dtype=np.float32)
  query_embeddings = rng.standard_normal((n, k, e), dtype=np.float32)
  distances = np.full((n, c), np.inf, np.float32)
  distances[membership] = rng.uniform(0.05, 1.5, int(membership.sum())).astype(np.float32)
  return dict(
    class_membership=membership,
    prototypes=prototypes,
    prototype_distances=distances,
    class_embeddings=class_embeddings,
    query_embeddings=query_embeddings,
  )


def synthetic_features(sizes: Sizes, seed: int = 1) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  shape = (sizes.batch, sizes.top_k, sizes.embed_dim)
  return dict(
    class_embeddings=rng.standard_normal(shape, dtype=np.float32),
    query_embeddings=rng.standard_normal(shape, dtype=np.float32),
  )


# ------------------------------------------------------------------ NumPy reference maths
def np_normalize(x):
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def np_swil_probs(class_embeddings, prototypes, w, class_eligible):
  """p[b, c] proportional to (min_k cosine distance + 1e-8)^(-w) over eligible classes."""
  cos = np.einsum("bke,ce->bkc", np_normalize(class_embeddings), np_normalize(prototypes))
  d = np.clip(1.0 - cos, 0.0, 2.0).min(axis=1)  # [B, C]
  s = np.where(class_eligible[None], (d + EPS) ** (-w), 0.0)
  total = s.sum(-1, keepdims=True)
  return np.where(total > 0, s / np.where(total > 0, total, 1.0), 0.0)


def np_prototype_probs(distances, eligible, w):
  """GRASP p_i proportional to (d_i + 1e-8)^(-w) over eligible members (eqs. 1-2)."""
  eligible = eligible & np.isfinite(distances)
  s = np.where(eligible, (np.where(eligible, distances, 1.0) + EPS) ** (-w), 0.0)
  total = s.sum(-1, keepdims=True)
  return np.where(total > 0, s / np.where(total > 0, total, 1.0), 0.0)


def np_normalized_entropy(p, axis=-1):
  """H(p) / log n."""
  plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
  return -plogp.sum(axis) / np.log(p.shape[axis])


def np_knn_shapley(distances, utilities, k, valid=None):
  """Exact KNN-SV (docs/reference.md §7): candidates sorted by distance (ties: lower index nearer),
  s_N = u_N / max(N, K), s_m = s_{m+1} + (u_m - u_{m+1}) / K * min(K, m) / m, unrolled as a
  reverse cumulative sum; invalid candidates get 0 and do not count in N."""
  distances = np.asarray(distances, np.float32)
  utilities = np.asarray(utilities, np.float32)
  n_e, n_c = distances.shape
  cols = np.arange(n_c) if valid is None else np.flatnonzero(valid)
  n = cols.size
  out = np.zeros((n_e, n_c), np.float32)
  if n == 0:
    return out
  order = np.argsort(distances[:, cols], axis=1, kind="stable")
  u = np.take_along_axis(utilities[:, cols], order, axis=1)
  m = np.arange(1, n, dtype=np.float32)
  terms = (u[:, :-1] - u[:, 1:]) * (np.minimum(k, m) / (k * m))
  s = np.empty_like(u)
  s[:, -1] = u[:, -1] / max(n, k)
  s[:, :-1] = s[:, -1:] + np.cumsum(terms[:, ::-1], axis=1)[:, ::-1]
  unsorted = np.empty_like(s)
  np.put_along_axis(unsorted, order, s, axis=1)
  out[:, cols] = unsorted
  return out


def np_l2(a, b):
  sq = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None, :] - 2.0 * a @ b.T
  return np.sqrt(np.maximum(sq, 0.0))


def np_image_knn_shapley(e_class, e_query, c_class, c_query, k, reduce, valid=None):
  """Image-level KNN-SV, all-to-all over tokens (paper suppl. §C): L2 distance of class
  embeddings, utility = cosine of query embeddings, [N_e,t,N_c,t] reduced over both t."""
  n_e, t, e = e_class.shape
  n_c = c_class.shape[0]
  d = np_l2(e_class.reshape(-1, e), c_class.reshape(-1, e))
  u = np_normalize(e_query.reshape(-1, e)) @ np_normalize(c_query.reshape(-1, e)).T
  token_valid = None if valid is None else np.repeat(valid, t)
  sv = np_knn_shapley(d, u, k, token_valid).reshape(n_e, t, n_c, t)
  return reduce(reduce(sv, axis=3), axis=1)


def np_asv(sv_left, sv_right, c, valid=None):
  """ASV (eq. 3) = w * mean_j sv_left[j, i] - min_j sv_right[j, i], w = c |min S_r| /
  |min S_l| (eq. 4)."""
  n_c = sv_left.shape[0]
  valid = np.ones(n_c, bool) if valid is None else valid
  left = sv_left[np.ix_(valid, valid)]
  right = sv_right[:, valid]
  denominator = abs(left.min())
  w = c * abs(right.min()) / denominator if denominator > 0 else c
  out = np.full(n_c, -np.inf, np.float32)
  out[valid] = w * left.mean(axis=0) - right.min(axis=0)
  return out


def np_precompute_rows(rows_class, rows_query, class_embeddings, query_embeddings, k):
  """One chunk of ASER-PC's precomputation: max-reduced KNN-SVs [rows, N]."""
  return np_image_knn_shapley(rows_class, rows_query, class_embeddings, query_embeddings, k, np.max)


class NumpyRetrieval:
  """The Table 2 compositions in NumPy (docs/reference.md §7), dedup 'dataset' (replays marked)."""

  def __init__(self, buffer: dict[str, np.ndarray], sizes: Sizes, seed: int = 0):
    self.b = buffer
    self.sizes = sizes
    self.rng = np.random.default_rng(seed)
    self.replayed = np.zeros(sizes.num_images, bool)
    self.pointer = -1
    self.members = [np.flatnonzero(col) for col in buffer["class_membership"].T]
    self.left = self.left_min = None
    # float32 [N]: forgetting-aware retrieval's rises (none observed: all equal) until set.
    self.forgetting_scores = np.zeros(sizes.num_images, np.float32)

  # class steps
  def _class_eligible(self, eligible):
    return np.array([eligible[m].any() for m in self.members])

  def balanced(self, class_eligible, num):
    c = class_eligible.size
    order = (self.pointer + 1 + np.arange(c)) % c
    cycle = order[class_eligible[order]]
    chosen = cycle[np.arange(num) % cycle.size]
    self.pointer = int(chosen[-1])
    return chosen

  def swil_probs(self, features, class_eligible):
    return np_swil_probs(features["class_embeddings"], self.b["prototypes"], SWIL_W, class_eligible)

  def sample_classes(self, probs):
    cumulative = probs.cumsum(-1)
    draws = self.rng.random((probs.shape[0], 1)) * cumulative[:, -1:]
    return (cumulative < draws).sum(-1)

  # sample steps (sequential, without replacement)
  def uniform_in_class(self, classes, eligible):
    out = []
    for cls in classes:
      members = self.members[cls]
      pool = members[eligible[members]]
      if pool.size == 0:
        pool = np.flatnonzero(eligible)
      i = pool[self.rng.integers(pool.size)]
      eligible[i] = False
      out.append(i)
    return np.array(out)

  def prototype_in_class(self, classes, eligible, weights):
    out = []
    for cls, w in zip(classes, weights):
      members = self.members[cls]
      p = np_prototype_probs(self.b["prototype_distances"][members, cls], eligible[members], w)
      if p.sum() > 0:
        i = members[self.rng.choice(members.size, p=p)]
      else:  # no eligible member left: any eligible image
        pool = np.flatnonzero(eligible)
        i = pool[self.rng.integers(pool.size)]
      eligible[i] = False
      out.append(i)
    return np.array(out)

  def _asv_select(self, classes, eligible, features, precomputed):
    candidates = self.uniform_in_class(classes, eligible.copy())
    cand_class = self.b["class_embeddings"][candidates]
    cand_query = self.b["query_embeddings"][candidates]
    k = self.sizes.knn_k
    right = np_image_knn_shapley(
      features["class_embeddings"], features["query_embeddings"], cand_class, cand_query, k, np.min
    )
    if precomputed:
      left_term = self.left[candidates]
      denominator = abs(self.left_min[candidates].min())
      w = ASV_C * abs(right.min()) / denominator if denominator > 0 else ASV_C
      asv = w * left_term - right.min(axis=0)
    else:
      left = np_image_knn_shapley(cand_class, cand_query, cand_class, cand_query, k, np.max)
      asv = np_asv(left, right, ASV_C)
    return candidates[np.argsort(-asv, kind="stable")[: self.sizes.batch]]

  # One method per algorithm: (eligible [N] bool, features) -> the B chosen indices.
  def uniform(self, eligible, features):
    del features
    return self.rng.choice(np.flatnonzero(eligible), self.sizes.batch, replace=False)

  def uniform_balanced(self, eligible, features):
    del features
    classes = self.balanced(self._class_eligible(eligible), self.sizes.batch)
    return self.uniform_in_class(classes, eligible.copy())

  def grasp(self, eligible, features):
    del features
    num = self.sizes.batch
    classes = self.balanced(self._class_eligible(eligible), num)
    return self.prototype_in_class(classes, eligible.copy(), np.full(num, GRASP_W))

  def swil(self, eligible, features):
    classes = self.sample_classes(self.swil_probs(features, self._class_eligible(eligible)))
    return self.uniform_in_class(classes, eligible.copy())

  def sw_grasp(self, eligible, features):
    classes = self.sample_classes(self.swil_probs(features, self._class_eligible(eligible)))
    return self.prototype_in_class(classes, eligible.copy(), np.full(self.sizes.batch, GRASP_W))

  def a_sw_grasp(self, eligible, features):
    class_eligible = self._class_eligible(eligible)
    probs = self.swil_probs(features, class_eligible)
    use_grasp = np_normalized_entropy(probs) > TAU
    classes = self.sample_classes(probs)
    if use_grasp.any():
      classes[use_grasp] = self.balanced(class_eligible, int(use_grasp.sum()))
    return self.prototype_in_class(classes, eligible.copy(), np.where(use_grasp, GRASP_W, 0.0))

  def aser(self, eligible, features):
    classes = self.balanced(self._class_eligible(eligible), self.sizes.candidates_aser)
    return self._asv_select(classes, eligible, features, precomputed=False)

  def aser_pc(self, eligible, features):
    classes = self.balanced(self._class_eligible(eligible), self.sizes.candidates_pc)
    return self._asv_select(classes, eligible, features, precomputed=True)

  def sw_aser_pc(self, eligible, features):
    probs = self.swil_probs(features, self._class_eligible(eligible))
    rows = np.arange(self.sizes.candidates_pc) % self.sizes.batch
    return self._asv_select(self.sample_classes(probs[rows]), eligible, features, precomputed=True)

  def forgetting_aware(self, eligible, features):
    del features
    classes = self.balanced(self._class_eligible(eligible), self.sizes.batch)
    return np_forgetting_in_class(self, classes, eligible.copy(), self.forgetting_scores)

  def sw_forgetting_aware(self, eligible, features):
    classes = self.sample_classes(self.swil_probs(features, self._class_eligible(eligible)))
    return np_forgetting_in_class(self, classes, eligible.copy(), self.forgetting_scores)

  def run(self, method: Callable, features: dict[str, np.ndarray]) -> np.ndarray:
    """One retrieval call of `method` (a method of this class, e.g. `NumpyRetrieval.grasp`):
    a fresh dedup period when fewer than B images are left, then the B chosen images marked
    replayed. Returns their indices [B]."""
    if (~self.replayed).sum() < self.sizes.batch:
      self.replayed[:] = False
    indices = method(self, ~self.replayed, features)
    self.replayed[indices] = True
    return indices

  def __call__(self, name: str, features: dict[str, np.ndarray]) -> np.ndarray:
    """One call of the NumPy reference of the registry algorithm `name` (`NUMPY_REFERENCES`).

    Raises:
      KeyError: `name` has no NumPy reference.
    """
    return self.run(NUMPY_REFERENCES[name], features)


# The NumPy reference of each registry algorithm, by its registry name: the one place that
# pairs them. `bench_algorithms` iterates the registry; an algorithm missing here is timed in
# JAX alone and its row says it has no NumPy reference.
NUMPY_REFERENCES: dict[str, Callable] = {
  "uniform": NumpyRetrieval.uniform,
  "uniform_balanced": NumpyRetrieval.uniform_balanced,
  "grasp": NumpyRetrieval.grasp,
  "swil": NumpyRetrieval.swil,
  "sw_grasp": NumpyRetrieval.sw_grasp,
  "a_sw_grasp": NumpyRetrieval.a_sw_grasp,
  "aser": NumpyRetrieval.aser,
  "aser_pc": NumpyRetrieval.aser_pc,
  "sw_aser_pc": NumpyRetrieval.sw_aser_pc,
  "forgetting_aware": NumpyRetrieval.forgetting_aware,
  "sw_forgetting_aware": NumpyRetrieval.sw_forgetting_aware,
}
NO_REFERENCE = "no NumPy reference"


# Forgetting-aware retrieval (beyond the paper, `owl_cl.replay.retrieval.forgetting`): its
# NumPy reference, apart from the Table 2 ones. T and eps: the config's defaults.
FORGETTING_T = retrieval_spec.RetrievalSpec.forgetting_temperature
FORGETTING_EPS = retrieval_spec.RetrievalSpec.forgetting_exploration


def np_forgetting_in_class(ref: NumpyRetrieval, classes, eligible, scores) -> np.ndarray:
  """One image per class, p = (1 - eps) softmax(score / T) + eps / M over the eligible
  members (M of them), without replacement; no member left: any eligible image."""
  out = []
  for cls in classes:
    members = ref.members[cls]
    members = members[eligible[members]]
    if members.size:
      z = np.exp((scores[members] - scores[members].max()) / FORGETTING_T)
      p = (1 - FORGETTING_EPS) * z / z.sum() + FORGETTING_EPS / members.size
      i = members[ref.rng.choice(members.size, p=p)]
    else:
      pool = np.flatnonzero(eligible)
      i = pool[ref.rng.integers(pool.size)]
    eligible[i] = False
    out.append(i)
  return np.array(out)


# ----------------------------------------------------------------------------- timing
def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
  """Median / min wall time of `fn()` (JAX results are blocked on) after `warmup` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def _row(kind, name, jax_t, np_t, shape, max_abs_diff=None, note=""):
  return {
    "kind": kind,
    "name": name,
    "shape": shape,
    "jax_s": jax_t,
    "numpy_s": np_t,
    "ratio_numpy_over_jax": (np_t["median_s"] / jax_t["median_s"] if jax_t and np_t else None),
    "max_abs_diff": max_abs_diff,
    "note": note,
  }


def bench_kernels(sizes: Sizes, buf, feats, repeats: int) -> list[dict]:
  rows = []
  rng = np.random.default_rng(2)
  c, b, t = sizes.num_classes, sizes.batch, sizes.top_k
  # similarity_weighted_probs: [B,k,E] x [C,E].
  eligible_c = rng.random(c) < 0.95
  j = jax.jit(lambda x, p, el: class_selection.similarity_weighted_probs(x, p, SWIL_W, el))
  args = (
    jnp.asarray(feats["class_embeddings"]),
    jnp.asarray(buf["prototypes"]),
    jnp.asarray(eligible_c),
  )
  ref = np_swil_probs(feats["class_embeddings"], buf["prototypes"], SWIL_W, eligible_c)
  diff = float(np.abs(np.asarray(j(*args)) - ref).max())
  rows.append(
    _row(
      "kernel",
      "similarity_weighted_probs",
      median_seconds(lambda: j(*args), repeats),
      median_seconds(
        lambda: np_swil_probs(feats["class_embeddings"], buf["prototypes"], SWIL_W, eligible_c),
        repeats,
      ),
      f"[{b},{t},{sizes.embed_dim}] x [{c},{sizes.embed_dim}]",
      diff,
    )
  )
  # normalized_entropy of the SWIL distributions [B, C].
  j = jax.jit(sample_selection.normalized_entropy)
  p = jnp.asarray(ref)
  diff = float(np.abs(np.asarray(j(p)) - np_normalized_entropy(ref)).max())
  rows.append(
    _row(
      "kernel",
      "normalized_entropy",
      median_seconds(lambda: j(p), repeats),
      median_seconds(lambda: np_normalized_entropy(ref), repeats),
      f"[{b},{c}]",
      diff,
    )
  )
  # prototype_weighted_probs: one class column per slot over the whole buffer [B, N].
  cols = rng.integers(0, c, b)
  d = np.ascontiguousarray(buf["prototype_distances"][:, cols].T)
  el = rng.random(d.shape) < 0.9
  j = jax.jit(lambda d, e: sample_selection.prototype_weighted_probs(d, e, GRASP_W))
  dj, ej = jnp.asarray(d), jnp.asarray(el)
  ref = np_prototype_probs(d, el, GRASP_W)
  diff = float(np.abs(np.asarray(j(dj, ej)) - ref).max())
  rows.append(
    _row(
      "kernel",
      "prototype_weighted_probs",
      median_seconds(lambda: j(dj, ej), repeats),
      median_seconds(lambda: np_prototype_probs(d, el, GRASP_W), repeats),
      f"[{b},{sizes.num_images}]",
      diff,
    )
  )
  # knn_shapley: ASER-PC right term (B*k eval tokens x N_c*k candidate tokens) and ASER's
  # left term (N_c*k x N_c*k).
  for label, n_e, n_c in (
    (f"right term, N_c={sizes.candidates_pc}", b * t, sizes.candidates_pc * t),
    (
      f"left term, N_c={sizes.candidates_aser}",
      sizes.candidates_aser * t,
      sizes.candidates_aser * t,
    ),
  ):
    dist = rng.random((n_e, n_c), dtype=np.float32)
    util = rng.uniform(-1, 1, (n_e, n_c)).astype(np.float32)
    valid = rng.random(n_c) < 0.97
    j = jax.jit(lambda d, u, v: knn_shapley.knn_shapley(d, u, sizes.knn_k, v))
    args = tuple(map(jnp.asarray, (dist, util, valid)))
    ref = np_knn_shapley(dist, util, sizes.knn_k, valid)
    diff = float(np.abs(np.asarray(j(*args)) - ref).max())
    rows.append(
      _row(
        "kernel",
        f"knn_shapley ({label})",
        median_seconds(lambda: j(*args), repeats),
        median_seconds(lambda: np_knn_shapley(dist, util, sizes.knn_k, valid), repeats),
        f"[{n_e},{n_c}], K={sizes.knn_k}",
        diff,
      )
    )
  # adversarial_shapley_value: [N_c, N_c] left, [B, N_c] right.
  n_c = sizes.candidates_pc
  left = rng.uniform(-0.01, 0.05, (n_c, n_c)).astype(np.float32)
  right = rng.uniform(-0.05, 0.01, (b, n_c)).astype(np.float32)
  j = jax.jit(lambda l, r: sample_selection.adversarial_shapley_value(l, r, ASV_C))
  lj, rj = jnp.asarray(left), jnp.asarray(right)
  ref = np_asv(left, right, ASV_C)
  diff = float(np.abs(np.asarray(j(lj, rj)) - ref).max())
  rows.append(
    _row(
      "kernel",
      "adversarial_shapley_value",
      median_seconds(lambda: j(lj, rj), repeats),
      median_seconds(lambda: np_asv(left, right, ASV_C), repeats),
      f"[{n_c},{n_c}] + [{b},{n_c}]",
      diff,
    )
  )
  return rows


def bench_precompute(sizes: Sizes, buf, buffer, repeats: int) -> dict:
  """ASER-PC left-term precomputation: one chunk timed, scaled to the whole buffer."""
  n, rows = sizes.num_images, min(sizes.precompute_chunk, sizes.num_images)
  num_chunks = -(-n // rows)
  k = sizes.knn_k
  r_class = buf["class_embeddings"][:rows]
  r_query = buf["query_embeddings"][:rows]

  @jax.jit
  def chunk(rc, rq, cc, cq):
    return knn_shapley.image_knn_shapley(rc, rq, cc, cq, k, reduction="max")[0]

  args = (
    jnp.asarray(r_class),
    jnp.asarray(r_query),
    buffer.class_embeddings,
    buffer.query_embeddings,
  )
  ref = np_precompute_rows(r_class, r_query, buf["class_embeddings"], buf["query_embeddings"], k)
  diff = float(np.abs(np.asarray(chunk(*args)) - ref).max())
  reps = max(1, min(repeats, 3))
  jt = median_seconds(lambda: chunk(*args), reps)
  nt = median_seconds(
    lambda: np_precompute_rows(
      r_class, r_query, buf["class_embeddings"], buf["query_embeddings"], k
    ),
    reps,
    warmup=0,
  )
  scale = lambda t: dict(
    t,
    median_s=t["median_s"] * num_chunks,
    min_s=t["min_s"] * num_chunks,
    chunk_median_s=t["median_s"],
  )
  note = (
    f"{rows} of {n} evaluation images timed, x{num_chunks} chunks (estimate)"
    if num_chunks > 1
    else "whole buffer"
  )
  return _row(
    "precompute",
    "aser_pc left term (whole buffer)",
    scale(jt),
    scale(nt),
    f"[{n}*{sizes.top_k}] x [{n}*{sizes.top_k}] tokens, K={k}",
    diff,
    note,
  )


def algorithm_hyperparameters(name: str, sizes: Sizes) -> dict:
  """The hyperparameters that make a registry algorithm do the NumPy reference's work at
  `sizes`: an algorithm with a candidate set (its registry entry's `num_candidates`, the
  paper's N_c: `FULL.candidates_aser` or `FULL.candidates_pc`) gets the N_c of `sizes` that
  stands for it, and K = `sizes.knn_k` (the registry's defaults are the paper's, which only
  the full sizes use). A candidate set of another size is capped at `sizes.candidates_pc`."""
  entry = registry.ALGORITHMS[name]
  paper_n_c = getattr(entry, "num_candidates", None)
  if paper_n_c is None:
    return {}
  scaled = {FULL.candidates_aser: sizes.candidates_aser, FULL.candidates_pc: sizes.candidates_pc}
  out = dict(num_candidates=scaled.get(paper_n_c, min(paper_n_c, sizes.candidates_pc)))
  if "knn_k" in entry.hyperparameter_names:
    out["knn_k"] = sizes.knn_k
  return out


def _precomputed(name: str) -> bool:
  """Whether the registry algorithm `name` reads the precomputed ASV left term."""
  return bool(getattr(registry.ALGORITHMS[name], "precomputed", False))


def bench_algorithms(sizes: Sizes, buf, buffer, feats, names, repeats: int) -> list[dict]:
  rows = []
  features = {k: jnp.asarray(v) for k, v in feats.items()}
  rng = np.random.default_rng(3)
  left = rng.uniform(-0.01, 0.05, sizes.num_images).astype(np.float32)
  left_min = (left - 0.02).astype(np.float32)
  scores = rng.normal(0.0, 0.5, sizes.num_images).astype(np.float32)
  for name in names:
    algorithm = registry.get_algorithm(
      name, dedup="dataset", **algorithm_hyperparameters(name, sizes)
    )
    rstate = state_lib.init_replay_state(sizes.num_images, jax.random.PRNGKey(0), sizes.num_classes)
    if _precomputed(name):
      # The per-call cost does not depend on the precomputed values (timed separately).
      rstate = rstate.replace(
        asv_left=jnp.asarray(left),
        asv_left_min=jnp.asarray(left_min),
        asv_left_ready=jnp.ones((), bool),
      )
    if getattr(algorithm, "observes_losses", False):
      # Observed losses (the per-call cost does not depend on their values): rise = scores.
      rstate = algorithm.prepare(rstate, buffer).replace(
        forget_latest=jnp.asarray(scores + 1.0), forget_reference=jnp.ones_like(scores)
      )
    call = jax.jit(algorithm, static_argnums=3)
    holder = {"state": rstate}

    def run_jax():
      indices, valid, holder["state"] = call(holder["state"], buffer, features, sizes.batch)
      return indices

    jt = median_seconds(run_jax, repeats)
    nt, note = None, NO_REFERENCE
    if name in NUMPY_REFERENCES:
      ref = NumpyRetrieval(buf, sizes)
      ref.left, ref.left_min = left, left_min
      ref.forgetting_scores = scores
      nt, note = median_seconds(lambda: ref(name, feats), repeats), ""
    rows.append(_row("algorithm", name, jt, nt, f"B={sizes.batch}", note=note))
    numpy_ms = f"{nt['median_s'] * 1e3:.2f} ms" if nt else NO_REFERENCE
    print(f"  {name}: jax {jt['median_s'] * 1e3:.2f} ms, numpy {numpy_ms}", flush=True)
  return rows


def bench_floors(sizes: Sizes, buf, buffer, feats, repeats: int) -> list[dict]:
  """The fixed parts of a retrieval call, jitted alone, against NumPy's whole `uniform` and
  `uniform_balanced` calls (the NumPy column): what no algorithm can go below on a backend.

  Rows (kind 'floor'):
    * the state round trip: a call that takes (ReplayState, ReplayBuffer, features) and
      returns the state with its key split and B images marked (`dedup.mark_replayed`), the
      least any algorithm's call does;
    * the buffer's availability (`class_index.block_pool`): the O(N) pass over the dedup
      mask that `uniform` makes for its per-block counts;
    * the classes' availability (`class_index.pools` + `class_available_counts`): the O(P)
      pass over the member index that every class-based algorithm makes once per call.
  """
  rstate = state_lib.init_replay_state(sizes.num_images, jax.random.PRNGKey(0), sizes.num_classes)
  marked = jnp.arange(sizes.batch, dtype=jnp.int32)

  @jax.jit
  def round_trip(rstate, buffer, features):
    del buffer, features
    rstate = rstate.replace(key=jax.random.split(rstate.key)[0])
    return dedup.mark_replayed(rstate, marked, jnp.ones_like(marked, bool))

  holder = {"state": rstate}
  features = {k: jnp.asarray(v) for k, v in feats.items()}

  def run_round_trip():
    holder["state"] = round_trip(holder["state"], buffer, features)
    return holder["state"].key

  # Every image eligible, as the timed algorithm calls (a fresh dedup period) see them.
  eligible = jnp.ones((sizes.num_images,), bool)
  block_pool = jax.jit(lambda e: class_index.block_pool(e).block_counts)
  index = buffer.class_index

  @jax.jit
  def class_pass(index, e):
    return class_index.class_available_counts(index, class_index.pools(index, e))

  def numpy_call(method):
    ref = NumpyRetrieval(buf, sizes)
    return median_seconds(lambda: ref.run(method, feats), repeats)

  uniform_s = numpy_call(NumpyRetrieval.uniform)
  uniform_balanced_s = numpy_call(NumpyRetrieval.uniform_balanced)
  return [
    _row(
      "floor",
      "state round trip",
      median_seconds(run_round_trip, repeats),
      uniform_s,
      f"B={sizes.batch}",
      note="key split + B images marked; NumPy: its whole uniform call",
    ),
    _row(
      "floor",
      "class_index.block_pool",
      median_seconds(lambda: block_pool(eligible), repeats),
      uniform_s,
      f"[{sizes.num_images}]",
      note="uniform's O(N) availability pass; NumPy: its whole uniform call",
    ),
    _row(
      "floor",
      "class_index.pools",
      median_seconds(lambda: class_pass(index, eligible), repeats),
      uniform_balanced_s,
      f"P={index.members.shape[0]}",
      note="the class-based calls' O(P) availability pass; NumPy: its whole uniform_balanced call",
    ),
  ]


# ------------------------------------------------------------------------------ report
def _fmt_s(t: dict | None) -> str:
  if not t:
    return "not measured"
  s = t["median_s"]
  return f"{s * 1e3:.2f} ms" if s < 1 else (f"{s:.2f} s" if s < 600 else f"{s / 3600:.2f} h")


def render_markdown(report: dict) -> str:
  """Markdown of a report: one table per buffer size (`report['runs']`)."""
  return "\n".join(_render_run(report, run) for run in report["runs"])


def _render_run(report: dict, run: dict) -> str:
  sizes = run["sizes"]
  step = report.get("train_step_seconds")
  lines = [
    f"Device: {report['device']} ({report['backend']}), JAX {report['jax_version']}, "
    f"NumPy {report['numpy_version']}; sizes: N={sizes['num_images']}, "
    f"C={sizes['num_classes']}, k={sizes['top_k']}, E={sizes['embed_dim']} "
    f"(buffer embeddings {sizes['embed_dtype']} [N, k, E]), "
    f"B={sizes['batch']}, N_c={sizes['candidates_aser']}/{sizes['candidates_pc']}, "
    f"K={sizes['knn_k']}; median of {run['repeats']} repeats after a warm-up.",
    "",
  ]
  header = ["What", "shape", "JAX", "NumPy", "NumPy / JAX", "max |JAX - NumPy|"]
  if step:
    header.append(f"JAX / train step ({step:g} s)")
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in run["rows"]:
    ratio = row["ratio_numpy_over_jax"]
    cells = [
      f"{row['kind']}: `{row['name']}`" + (f" ({row['note']})" if row["note"] else ""),
      row["shape"],
      _fmt_s(row["jax_s"]),
      _fmt_s(row["numpy_s"]),
      f"{ratio:.1f}x" if ratio else "-",
      f"{row['max_abs_diff']:.1e}" if row["max_abs_diff"] is not None else "-",
    ]
    if step:
      cells.append(
        f"{row['jax_s']['median_s'] / step:.1%}"
        if row["jax_s"] and row["kind"] == "algorithm"
        else "-"
      )
    lines.append("| " + " | ".join(cells) + " |")
  for name in report.get("not_measured", []):
    lines.append(
      f"| algorithm: `{name}` | - | not measured | not measured | - | - |"
      + (" - |" if step else "")
    )
  if run.get("processes"):
    lines += _render_processes(run["processes"])
  return "\n".join(lines) + "\n"


def sizes_for(num_images: int) -> Sizes:
  """The paper's sizes with N = num_images; above 100k images the embeddings of `MILLION`."""
  base = FULL if num_images <= 100_000 else MILLION
  return dataclasses.replace(base, num_images=int(num_images))


def bench_size(sizes: Sizes, names, args) -> dict:
  """Every row of one buffer size: the member index build, kernels, algorithms, floors,
  precompute."""
  print(f"sizes: {sizes}; device: {jax.devices()[0]}", flush=True)
  buf = synthetic_buffer(sizes)
  feats = synthetic_features(sizes)
  start = time.perf_counter()
  index = class_index.build_class_index(buf["class_membership"], buf["prototype_distances"])
  jax.block_until_ready(index)
  index_s = time.perf_counter() - start
  del index
  buffer = state_lib.make_replay_buffer(
    buf["class_membership"],
    buf["prototypes"],
    buf["prototype_distances"],
    buf["class_embeddings"],
    buf["query_embeddings"],
  )
  jax.block_until_ready(buffer)
  # The NumPy reference reads the JAX copies (zero-copy views on CPU): one copy in memory.
  for name in ("class_embeddings", "query_embeddings", "prototype_distances"):
    buf[name] = np.asarray(getattr(buffer, name))
  index = buffer.class_index
  rows = [
    _row(
      "build",
      "class_index.build_class_index",
      {"median_s": index_s, "min_s": index_s, "repeats": 1},
      None,
      f"P={index.members.shape[0]} positions, b={index.block}, "
      f"class slice {index.class_blocks * index.block}",
      note="once per buffer, in make_replay_buffer, host NumPy",
    )
  ]
  if not args.skip_kernels:
    print("kernels", flush=True)
    rows += bench_kernels(sizes, buf, feats, args.repeats)
  print("algorithms", flush=True)
  rows += bench_algorithms(sizes, buf, buffer, feats, names, args.repeats)
  if not args.skip_floors:
    print("floors", flush=True)
    rows += bench_floors(sizes, buf, buffer, feats, args.repeats)
  if not args.skip_precompute and any(_precomputed(name) for name in names):
    print("precompute", flush=True)
    rows.append(bench_precompute(sizes, buf, buffer, args.repeats))
  return {"sizes": dataclasses.asdict(sizes), "repeats": args.repeats, "rows": rows}


def algorithms_in_processes(sizes: Sizes, names, args) -> dict:
  """The algorithm rows of `sizes` measured again in `args.processes` fresh processes, one
  after the other (this script with --skip-kernels --skip-precompute). Returns {name:
  {'jax_ms': [per process], 'numpy_ms': [per process]}}: medians of `args.repeats` calls."""
  per_name = {name: {"jax_ms": [], "numpy_ms": []} for name in names}
  with tempfile.TemporaryDirectory() as out:
    for p in range(args.processes):
      print(f"process {p + 1}/{args.processes}, N={sizes.num_images}", flush=True)
      command = [sys.executable, os.path.abspath(__file__), "--skip-kernels", "--skip-precompute"]
      command += ["--skip-floors"]
      command += ["--repeats", str(args.repeats), "--algorithms", ",".join(names)]
      command += ["--out", out]
      mode = "--smoke" if args.smoke else "--quick" if args.quick else None
      command += [mode] if mode else ["--sizes", str(sizes.num_images)]
      subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
      suffix = "_smoke" if args.smoke else "_quick" if args.quick else ""
      with open(os.path.join(out, f"retrieval{suffix}.json")) as f:
        rows = json.load(f)["runs"][0]["rows"]
      for row in rows:
        if row["kind"] == "algorithm":
          per_name[row["name"]]["jax_ms"].append(row["jax_s"]["median_s"] * 1e3)
          if row["numpy_s"]:  # else it has no NumPy reference
            per_name[row["name"]]["numpy_ms"].append(row["numpy_s"]["median_s"] * 1e3)
  return per_name


def _render_processes(per_name: dict) -> list[str]:
  count = len(next(iter(per_name.values()))["jax_ms"]) if per_name else 0
  lines = [
    "",
    f"The algorithms again in {count} fresh processes (median of each process's median; "
    "min-max over the processes):",
    "",
    "| algorithm | JAX | NumPy | NumPy / JAX | processes with JAX <= NumPy |",
    "|---|---|---|---|---|",
  ]
  for name, t in per_name.items():
    jax_ms, np_ms = np.asarray(t["jax_ms"]), np.asarray(t["numpy_ms"])
    jax_cell = f"{np.median(jax_ms):.2f} ms ({jax_ms.min():.2f}-{jax_ms.max():.2f})"
    if not np_ms.size:
      lines.append(f"| `{name}` | {jax_cell} | {NO_REFERENCE} | - | - |")
      continue
    lines.append(
      f"| `{name}` | {jax_cell} "
      f"| {np.median(np_ms):.2f} ms ({np_ms.min():.2f}-{np_ms.max():.2f}) "
      f"| {np.median(np_ms) / np.median(jax_ms):.1f}x | {int((jax_ms <= np_ms).sum())} of {count} |"
    )
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes for a fast check")
  parser.add_argument(
    "--smoke", action="store_true", help="every path at tiny sizes in seconds (tests, CI)"
  )
  parser.add_argument(
    "--sizes",
    default="54226,1000000",
    help="comma-separated buffer sizes N (default: the paper's 54,226 and 1M; ignored "
    "with --quick)",
  )
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument(
    "--train-step-seconds",
    type=float,
    default=0.25,
    help="a measured train step time (s) to express retrieval as a "
    "fraction of it; default: the built-in tiny model, CPU",
  )
  parser.add_argument(
    "--algorithms",
    default=None,
    help="comma-separated registry names (default: every algorithm of the registry)",
  )
  parser.add_argument("--skip-precompute", action="store_true")
  parser.add_argument("--skip-kernels", action="store_true")
  parser.add_argument("--skip-floors", action="store_true")
  parser.add_argument(
    "--processes",
    type=int,
    default=1,
    help="also time the algorithms in this many fresh processes per size and report their "
    "spread (a call's time differs from process to process by up to 1.5x; default 1: none)",
  )
  args = parser.parse_args(argv)
  if args.processes < 1:
    parser.error(f"--processes must be >= 1, got {args.processes}")
  if args.smoke:
    all_sizes = [SMOKE]
    args.repeats = min(args.repeats, 2)
  elif args.quick:
    all_sizes = [QUICK]
  else:
    all_sizes = [sizes_for(int(n)) for n in args.sizes.split(",") if n]
  names = [n for n in (args.algorithms or ",".join(registry.ALGORITHMS)).split(",") if n]
  known = [n for n in names if n in registry.ALGORITHMS]
  missing = [n for n in names if n not in registry.ALGORITHMS]
  runs = [bench_size(sizes, known, args) for sizes in all_sizes]
  if args.processes > 1:
    for run, sizes in zip(runs, all_sizes):
      run["processes"] = algorithms_in_processes(sizes, known, args)
  device = jax.devices()[0]
  report = {
    "runs": runs,
    "quick": args.quick,
    "smoke": args.smoke,
    "device": getattr(device, "device_kind", str(device)),
    "backend": jax.default_backend(),
    "jax_version": jax.__version__,
    "numpy_version": np.__version__,
    "host": platform.node(),
    "cpu_count": os.cpu_count(),
    "date_utc": time.strftime("%Y-%m-%d", time.gmtime()),
    "train_step_seconds": args.train_step_seconds,
    "not_measured": missing,
  }
  suffix = "_smoke" if args.smoke else "_quick" if args.quick else ""
  stem = os.path.join(args.out, "retrieval" + suffix)
  utils.write_report(stem, report, render_markdown(report), indent=2)
  return report


if __name__ == "__main__":
  main()

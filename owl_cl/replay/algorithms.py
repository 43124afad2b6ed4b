"""Retrieval algorithms by name: compositions of primitives (paper Table 2, docs/reference.md §7).

Every algorithm has the signature

    algorithm(rstate, buffer, features, num_replay, active=None) -> (indices, valid, rstate)

  rstate:     `ReplayState` (uses and advances `rstate.key`, the dedup mask and counters,
              the balanced class pointer/order);
  buffer:     `ReplayBuffer` (jnp arrays, passed as an argument, never closed over);
  features:   dict of the new batch: `class_embeddings` float [B, k, E] for algorithms with a
              similarity step, plus `query_embeddings` float [B, k, E] for the ASV algorithms
              (`train.step.make_embed_step`); may be empty for 'uniform', 'uniform_balanced',
              'grasp' (`algorithm.needs_features` tells);
  num_replay: static int, replays to retrieve (1:1 with the new batch: num_replay = B);
  active:     optional bool [num_replay] slot mask (traced; None = all active) for loss
              adaptivity (docs/reference.md §9). Inactive slots return valid False, are not marked
              by
              dedup, do not consume the balanced class pointer and do not count in the
              exhaustion check; the i-th active slot gets what slot i would get with all
              slots active (for balanced: the i-th class of the cycle);
  indices:    int32 [num_replay] buffer indices (0 where invalid); valid: bool [num_replay].

It is jittable with `jax.jit(algorithm, static_argnums=3)`. One call: (1) the in-call dedup
reset if the buffer is exhausted or a 'fraction' period ends (`dedup.auto_reset_if_exhausted`);
(2) eligible images from the dedup mask; (3) the class step (if any) on the classes that still
have an eligible image (others get probability 0 / are skipped); (4) the sample step;
(5) the replays are marked (`dedup.mark_replayed`). `algorithm.retrieve_with_records(...)`
returns, in addition, a dict of per-call analysis records (paper Figures 3-5; see
`RECORD_KEYS`), computed in the same jitted call. `algorithm.prepare(rstate, buffer)` fills
state that is computed once per buffer (ASER-PC's precomputed left term); call it before the
first retrieval (a no-op for the other algorithms).

A new composition is one registry line, e.g. `'grasp': Composition(balanced_step,
prototype_weighted_step)`. Step protocols (hyperparameters are keyword-only arguments with
defaults; `get_algorithm` discovers them by name and rejects unknown ones):

  class step:  step(key, rstate, buffer, features, class_eligible [C], active [num], **hp)
               -> (classes int32 [num] (-1 = no class), rstate, records dict)
  sample step: step(key, rstate, buffer, features, classes [num] | None, eligible [N],
               active [num], without_replacement, pool, **hp)
               -> (indices int32 [num], valid bool [num], records dict)

`pool` is `class_index.pools(buffer.class_index, eligible)`, the per-position availability
the call's class eligibility was computed from: one O(P) pass per call, handed to the sample
step instead of recomputed (XLA does not merge the two: at N = 1M, uniform_balanced took
13 ms with both, 3 ms with one).

Registry entries may also be any other builder object with `hyperparameter_names` and
`build(name, dedup, hyperparameters) -> algorithm`: A-SW-GRASP's per-image switch
(`AdaptiveComposition`) and the ASV algorithms (`AsvComposition`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from owl_cl.replay import asv_left
from owl_cl.replay import class_index as class_index_lib
from owl_cl.replay import class_selection
from owl_cl.replay import dedup as dedup_lib
from owl_cl.replay import knn_shapley
from owl_cl.replay import sample_selection
from owl_cl.replay.state import ReplayBuffer
from owl_cl.replay.state import ReplayState
from owl_cl.train.sharding import fetch_replicated
from owl_cl.train.sharding import replicate

Array = jax.Array

BALANCED_ORDERS = ("sequential", "reshuffled")
# A-SW-GRASP's switch entropy: over the classes with an eligible image (default) | over every
# class with a prototype (released code).
ADAPTIVE_ENTROPY_CLASSES = ("eligible", "all")
# A class that runs out of eligible images within one call: 'fallback' (eligible classes fixed
# at the start of the call; its slot draws uniformly among the remaining images) | 'redraw'
# (released code: per slot, the class step sees the classes still available -> balanced
# skips the class, similarity-weighted redraws). Class + sample compositions only.
EXHAUSTED_CLASS = ("fallback", "redraw")
# Draw within a class where the paper draws uniformly: A-SW-GRASP's SWIL slots and the ASV
# algorithms' candidate sets. 'uniform' (paper) | 'grasp' (prototype-weighted with exponent
# `grasp_weight`: the released option `bal_prob_type='GRASP'`).
WITHIN_CLASS_WEIGHTINGS = ("uniform", "grasp")
# ASV candidate sets: 'shared' (one set for the batch, the top candidates replayed; paper) |
# 'per_image' (SW-ASER only: each new image draws N_c / B candidates from its own SWIL class
# and replays the best of its own subset; the released option `caser.balanced=True`).
CANDIDATE_SUBSETS = ("shared", "per_image")
# Tokens the ASV's KNN distances are measured between: the class embeddings (paper, released
# default) | the ViT's output image tokens of the same top-k tokens (released option
# cls_embeds=False). The utility stays the cosine of the query embeddings.
ASV_FEATURES = ("class_embeddings", "image_features")

# Per-call analysis records (`retrieve_with_records`); each algorithm returns the subset that
# applies to it. B = new images, N_c = candidates, num = num_replay.
RECORD_KEYS = {
  "sampled_classes": "int32 [num]: class step class of each replay slot (-1: none/inactive)",
  "swil_entropy": "float32 [B]: normalised entropy of p_SWIL of each new image (Fig. 4)",
  "grasp_entropy": "float32 [num]: normalised entropy of the GRASP distribution of the "
  "slot's class over its eligible members (NaN: not GRASP) (Fig. 3)",
  "used_grasp": "bool [num]: A-SW-GRASP slot used GRASP (entropy > tau)",
  "knn_sv": "float32 [B, N_c]: right-term KNN-SVs of the candidates (Fig. 5 left)",
  "knn_sv_valid": "bool [N_c]: valid candidates of knn_sv",
  "min_sv_rank": "int32 [B]: distance rank (1 = nearest) of the lowest-KNN-SV candidate of "
  "each new image (Fig. 5 right)",
  "selected_rank": "int32 [num]: distance rank of each replayed candidate to its nearest "
  "new image (-1: invalid slot)",
}


# ----------------------------------------------------------------------------- class steps
def balanced_step(
  key, rstate, buffer, features, class_eligible, active, *, balanced_order: str = "sequential"
):
  """Balanced class step: the paper's sequential cycle (`class_selection.balanced_classes`)
  or the released code's order reshuffled every pass ('reshuffled',
  `class_selection.balanced_classes_reshuffled`). Advances the class pointer by the active
  slots only.
  """
  del buffer, features
  num = active.shape[0]
  if balanced_order == "sequential":
    classes, pointer = class_selection.balanced_classes(
      rstate.class_pointer, class_eligible, num, active=active
    )
    rstate = rstate.replace(class_pointer=pointer)
  elif balanced_order == "reshuffled":
    if rstate.class_order.shape != class_eligible.shape:
      raise ValueError(
        'balanced_order="reshuffled" needs ReplayState.class_order of shape '
        f"{class_eligible.shape}, got {rstate.class_order.shape}: make the state "
        "with init_replay_state(N, key, num_classes=C)"
      )
    classes, pointer, order = class_selection.balanced_classes_reshuffled(
      key, rstate.class_pointer, rstate.class_order, class_eligible, active
    )
    rstate = rstate.replace(class_pointer=pointer, class_order=order)
  else:
    raise ValueError(f"balanced_order must be one of {BALANCED_ORDERS}, got {balanced_order!r}")
  return classes, rstate, {"sampled_classes": classes}


def _class_index(buffer: ReplayBuffer) -> class_index_lib.ClassIndex:
  """The buffer's member index; ValueError if the buffer was not made by make_replay_buffer."""
  if buffer.class_index is None:
    raise ValueError(
      "ReplayBuffer.class_index is None: build the buffer with state.make_replay_buffer "
      "(it derives the per-class member index from class_membership)"
    )
  return buffer.class_index


def _new_image_rows(num: int, batch: int) -> Array:
  """Row of the new batch serving each replay slot: slot j -> new image j mod B."""
  return jnp.arange(num, dtype=jnp.int32) % batch


def _require(features: Mapping[str, Array], names, who: str):
  missing = [n for n in names if n not in features]
  if missing:
    raise ValueError(
      f"{who} needs features {missing} (from train.step.make_embed_step); got {sorted(features)}"
    )


def _swil_probs(buffer, features, class_eligible, swil_weight, swil_reduction="min"):
  _require(features, ("class_embeddings",), "similarity-weighted class selection")
  return class_selection.similarity_weighted_probs(
    features["class_embeddings"], buffer.prototypes, swil_weight, class_eligible, swil_reduction
  )


def similarity_weighted_step(
  key,
  rstate,
  buffer,
  features,
  class_eligible,
  active,
  *,
  swil_weight: float = 1.0,
  swil_reduction: str = "min",
):
  """Similarity-weighted (SWIL) class step: one class per new image.

  Uses `features['class_embeddings']` [B, k, E] and `buffer.prototypes`; slot j serves new
  image j mod B (slots = new images when num_replay = B). Hyperparameter `swil_weight` is w
  of docs/reference.md §7 (default 1.0); `swil_reduction` reduces the distances over the k
  embeddings
  ('min', paper; 'mean', the released `swil_reduce_type='avg'`). Inactive slots get -1.
  """
  probs = _swil_probs(buffer, features, class_eligible, swil_weight, swil_reduction)
  slot_probs = probs[_new_image_rows(active.shape[0], probs.shape[0])]
  classes = jnp.where(active, class_selection.sample_classes(key, slot_probs), -1)
  return (
    classes,
    rstate,
    {"sampled_classes": classes, "swil_entropy": sample_selection.normalized_entropy(probs)},
  )


# ---------------------------------------------------------------------------- sample steps
def uniform_step(
  key, rstate, buffer, features, classes, eligible, active, without_replacement, pool=None
):
  """Uniform over all eligible buffer images, no class step (always without replacement)."""
  del rstate, buffer, features, classes, without_replacement, pool
  indices, valid = sample_selection.uniform_active(key, eligible, active)
  return indices, valid, {}


def uniform_in_class_step(
  key, rstate, buffer, features, classes, eligible, active, without_replacement, pool=None
):
  """Uniform among the eligible members of each slot's class (`uniform_in_class_active`)."""
  del rstate, features
  indices, valid = sample_selection.uniform_in_class_active(
    key,
    _class_index(buffer),
    eligible,
    classes,
    active,
    without_replacement=without_replacement,
    pool=pool,
  )
  return indices, valid, {}


def _grasp_entropy(buffer, eligible, classes, weights, pool=None):
  """Normalised entropy (by log of the number of eligible members) of each slot's GRASP
  distribution, at the start of the call; NaN for slots without a class. Reads each slot's
  class members only (`class_index.by_class_size`), not an [N] column per slot. `pool`: the
  call's `class_index.pools` of `eligible` (None: computed here)."""
  index = _class_index(buffer)
  pool = class_index_lib.pools(index, eligible) if pool is None else pool

  def entropy_of(inputs):
    c, w = inputs

    def within(blocks):
      _, distances, in_class = class_index_lib.class_slice(index, c, blocks)
      members = in_class & class_index_lib.slice_flags(index, pool, c, blocks)
      members = members & jnp.isfinite(distances)
      probs = sample_selection.prototype_weighted_probs(distances, members, w)
      count = jnp.sum(members)
      plogp = jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0)
      entropy = -plogp.sum() / jnp.log(jnp.maximum(count, 2).astype(jnp.float32))
      return jnp.where(count > 1, entropy, 0.0)

    return class_index_lib.by_class_size(index, c, within)

  # lax.map (a scan), not vmap: under vmap the size switch would run every branch.
  entropy = jax.lax.map(entropy_of, (classes, weights))
  return jnp.where(classes >= 0, entropy, jnp.nan)


def prototype_weighted_step(
  key,
  rstate,
  buffer,
  features,
  classes,
  eligible,
  active,
  without_replacement,
  pool=None,
  *,
  grasp_weight: float = 1.0,
):
  """Prototype-weighted (GRASP) sample selection within each slot's class (eqs. 1-2).

  Hyperparameter `grasp_weight` is w of eq. 1 (paper 1.0; released code default 0.7).
  """
  del rstate, features
  num = active.shape[0]
  weights = jnp.full((num,), grasp_weight, jnp.float32)
  indices, valid = sample_selection.prototype_weighted_in_class(
    key,
    _class_index(buffer),
    eligible,
    classes,
    weights,
    active,
    without_replacement=without_replacement,
    pool=pool,
  )
  return indices, valid, {"grasp_entropy": _grasp_entropy(buffer, eligible, classes, weights, pool)}


# ----------------------------------------------------------------------------- composition
def _keyword_hyperparameters(fn: Callable | None) -> tuple[str, ...]:
  if fn is None:
    return ()
  return tuple(
    p.name
    for p in inspect.signature(fn).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
  )


def _keyword_defaults(fn: Callable | None) -> dict[str, Any]:
  if fn is None:
    return {}
  return {
    p.name: p.default
    for p in inspect.signature(fn).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
  }


def _check_active(active, num_replay: int) -> Array:
  if active is None:
    return jnp.ones((num_replay,), bool)
  active = jnp.asarray(active, bool)
  if active.shape != (num_replay,):
    raise ValueError(f"active must be bool [num_replay={num_replay}], got shape {active.shape}")
  return active


class _AlgorithmBase:
  """Shared call protocol of every algorithm (module docstring)."""

  dedup: dedup_lib.DedupSchedule

  def __call__(
    self,
    rstate: ReplayState,
    buffer: ReplayBuffer,
    features: Mapping[str, Array],
    num_replay: int,
    active: Array | None = None,
  ) -> tuple[Array, Array, ReplayState]:
    """Retrieves `num_replay` buffer images; see the module docstring for shapes."""
    indices, valid, rstate, _ = self.retrieve_with_records(
      rstate, buffer, features, num_replay, active
    )
    return indices, valid, rstate

  def retrieve_with_records(self, rstate, buffer, features, num_replay, active=None):
    """As `__call__`, plus a dict of analysis records (`RECORD_KEYS`)."""
    num_replay = int(num_replay)
    active = _check_active(active, num_replay)
    features = {} if features is None else features
    rstate = dedup_lib.auto_reset_if_exhausted(rstate, self.dedup, jnp.sum(active, dtype=jnp.int32))
    eligible = dedup_lib.eligible_images(rstate, self.dedup)
    # One O(P) pass: the class eligibility and the sample step's availability (module doc).
    index = _class_index(buffer)
    pool = class_index_lib.pools(index, eligible)
    class_eligible = (class_index_lib.class_available_counts(index, pool) > 0) & buffer.class_valid
    key, class_key, sample_key = jax.random.split(rstate.key, 3)
    rstate = rstate.replace(key=key)
    indices, valid, rstate, records = self._select(
      class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active, pool
    )
    valid = jnp.asarray(valid, bool) & active
    indices = jnp.where(valid, jnp.asarray(indices, jnp.int32), 0)
    rstate = dedup_lib.mark_replayed(rstate, indices, valid, self.dedup)
    rstate = dedup_lib.reset_after_call(rstate, self.dedup)
    return indices, valid, rstate, records

  def prepare(
    self, rstate: ReplayState, buffer: ReplayBuffer, *, mesh=None, cache_prefix=None
  ) -> ReplayState:
    """Once-per-buffer state (ASER-PC's left term); identity for most algorithms.

    `mesh` (the device mesh the work is split over) and `cache_prefix` (the cached replay
    store's folder, next to which such state is cached) serve `AsvAlgorithm.prepare`.
    """
    del buffer, mesh, cache_prefix
    return rstate


@dataclasses.dataclass(frozen=True)
class RetrievalAlgorithm(_AlgorithmBase):
  """A configured class step + sample step (hashable; jit with `static_argnums=3`).

  Attributes:
    name: registry name.
    class_step / sample_step: the primitives (see module docstring).
    dedup: the DedupSchedule.
    class_hyperparameters / sample_hyperparameters: tuples of (name, value) bound to the steps.
    exhausted_class: 'fallback' | 'redraw' (`EXHAUSTED_CLASS`; hyperparameter of the
      compositions with a class step).
  """

  name: str
  class_step: Callable | None
  sample_step: Callable
  dedup: dedup_lib.DedupSchedule
  class_hyperparameters: tuple[tuple[str, Any], ...] = ()
  sample_hyperparameters: tuple[tuple[str, Any], ...] = ()
  exhausted_class: str = "fallback"

  @property
  def needs_features(self) -> bool:
    """Whether the algorithm reads the new batch's features (e.g. SWIL's class embeddings);
    callers skip the extra embedding forward pass otherwise."""
    return self.class_step in FEATURE_STEPS or self.sample_step in FEATURE_STEPS

  def _select(
    self, class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active, pool
  ):
    if self.exhausted_class == "redraw" and self.class_step is not None:
      return self._select_per_slot(
        class_key, sample_key, rstate, buffer, features, eligible, active
      )
    classes = None
    records = {}
    if self.class_step is not None:
      classes, rstate, records = self.class_step(
        class_key,
        rstate,
        buffer,
        features,
        class_eligible,
        active,
        **dict(self.class_hyperparameters),
      )
    indices, valid, sample_records = self.sample_step(
      sample_key,
      rstate,
      buffer,
      features,
      classes,
      eligible,
      active,
      self.dedup.samples_without_replacement,
      pool,
      **dict(self.sample_hyperparameters),
    )
    return indices, valid, rstate, {**records, **sample_records}

  def _select_per_slot(self, class_key, sample_key, rstate, buffer, features, eligible, active):
    """exhausted_class='redraw' (released code): slot by slot, the class step sees only the
    classes that still have an image not taken by this call's earlier slots, so a class that
    runs out within the call is skipped (balanced) or redrawn (similarity-weighted); the
    sample step then draws from that class. Records: `sampled_classes` only."""
    num = active.shape[0]
    class_keys = jax.random.split(class_key, num)
    sample_keys = jax.random.split(sample_key, num)
    marks = self.dedup.samples_without_replacement
    class_hp = dict(self.class_hyperparameters)
    sample_hp = dict(self.sample_hyperparameters)

    def slot(carry, inputs):
      rstate, available = carry
      j, ck, sk, on = inputs
      # The slot's new image (slot j serves new image j mod B), as a batch of one.
      row = {k: jax.lax.dynamic_index_in_dim(v, j % v.shape[0]) for k, v in features.items()}
      class_now = (
        sample_selection.class_eligibility(_class_index(buffer), available) & buffer.class_valid
      )
      classes, rstate, _ = self.class_step(ck, rstate, buffer, row, class_now, on[None], **class_hp)
      index, valid, _ = self.sample_step(
        sk, rstate, buffer, row, classes, available, on[None], marks, **sample_hp
      )
      found = valid[0] & on
      if marks:
        available = available.at[index[0]].set(available[index[0]] & ~found)
      return (rstate, available), (index[0], found, classes[0])

    (rstate, _), (indices, valid, classes) = jax.lax.scan(
      slot,
      (rstate, jnp.asarray(eligible, bool)),
      (jnp.arange(num, dtype=jnp.int32), class_keys, sample_keys, active),
    )
    return indices, valid, rstate, {"sampled_classes": jnp.where(valid, classes, -1)}


@dataclasses.dataclass(frozen=True)
class Composition:
  """Registry entry: a class step (or None) followed by a sample step."""

  class_step: Callable | None
  sample_step: Callable

  @property
  def hyperparameter_names(self) -> tuple[str, ...]:
    extra = ("exhausted_class",) if self.class_step is not None else ()
    return (
      _keyword_hyperparameters(self.class_step) + _keyword_hyperparameters(self.sample_step) + extra
    )

  def build(
    self, name: str, dedup: dedup_lib.DedupSchedule, hyperparameters: Mapping[str, Any]
  ) -> RetrievalAlgorithm:
    class_names = _keyword_hyperparameters(self.class_step)
    sample_names = _keyword_hyperparameters(self.sample_step)
    return RetrievalAlgorithm(
      exhausted_class=hyperparameters.get("exhausted_class", "fallback"),
      name=name,
      class_step=self.class_step,
      sample_step=self.sample_step,
      dedup=dedup,
      class_hyperparameters=tuple(
        (k, v) for k, v in sorted(hyperparameters.items()) if k in class_names
      ),
      sample_hyperparameters=tuple(
        (k, v) for k, v in sorted(hyperparameters.items()) if k in sample_names
      ),
    )


# ------------------------------------------------------------------------------ A-SW-GRASP
@dataclasses.dataclass(frozen=True)
class AdaptiveSwGraspAlgorithm(_AlgorithmBase):
  """A-SW-GRASP: per new image, GRASP (balanced class + prototype-weighted sample) if the
  normalised entropy of its SWIL class distribution exceeds `adaptive_entropy_threshold`
  (tau), else SWIL (similarity-weighted class + uniform sample). Only GRASP slots consume
  the balanced class pointer. `adaptive_entropy_classes`: the switch's entropy is that of
  p_SWIL over the classes that still have an eligible image ('eligible', default) or over
  every class with a buffer member ('all', as in the released code).
  `within_class_weighting`: the SWIL slots draw within their class uniformly ('uniform', the
  paper) or prototype-weighted with `grasp_weight` ('grasp', the released
  `bal_prob_type='GRASP'`).

  Source: paper §4 "Composing and Modifying Primitives" item 2; released code
  `get_SWIL_retrieval_indices(adaptivity='img')` (entropy H / log C of p_SWIL).
  """

  name: str
  dedup: dedup_lib.DedupSchedule
  swil_weight: float = 1.0
  grasp_weight: float = 1.0
  adaptive_entropy_threshold: float = 0.99
  balanced_order: str = "sequential"
  adaptive_entropy_classes: str = "eligible"
  swil_reduction: str = "min"
  within_class_weighting: str = "uniform"

  needs_features = True

  def _select(
    self, class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active, pool
  ):
    num = active.shape[0]
    probs = _swil_probs(
      buffer, features, class_eligible, self.swil_weight, self.swil_reduction
    )  # [B, C]
    if self.adaptive_entropy_classes == "all":
      # Released code: the switch reads p_SWIL over every class with a prototype, before
      # classes without an unreplayed image are removed (it redraws those afterwards).
      entropy_probs = _swil_probs(
        buffer, features, buffer.class_valid, self.swil_weight, self.swil_reduction
      )
    else:
      entropy_probs = probs
    entropy = sample_selection.normalized_entropy(entropy_probs)  # [B]
    rows = _new_image_rows(num, probs.shape[0])
    use_grasp = entropy[rows] > self.adaptive_entropy_threshold
    balanced_key, swil_key = jax.random.split(class_key)
    grasp_classes, rstate, _ = balanced_step(
      balanced_key,
      rstate,
      buffer,
      features,
      class_eligible,
      active & use_grasp,
      balanced_order=self.balanced_order,
    )
    swil_classes = class_selection.sample_classes(swil_key, probs[rows])
    classes = jnp.where(active, jnp.where(use_grasp, grasp_classes, swil_classes), -1)
    # SWIL slots draw uniformly within their class (w = 0), or GRASP-weighted as the GRASP
    # slots with the released bal_prob_type='GRASP'.
    swil_slot_weight = self.grasp_weight if self.within_class_weighting == "grasp" else 0.0
    weights = jnp.where(use_grasp, jnp.float32(self.grasp_weight), jnp.float32(swil_slot_weight))
    indices, valid = sample_selection.prototype_weighted_in_class(
      sample_key,
      _class_index(buffer),
      eligible,
      classes,
      weights,
      active,
      without_replacement=self.dedup.samples_without_replacement,
      pool=pool,
    )
    grasp_entropy = jnp.where(
      use_grasp, _grasp_entropy(buffer, eligible, classes, weights, pool), jnp.nan
    )
    return (
      indices,
      valid,
      rstate,
      {
        "sampled_classes": classes,
        "swil_entropy": entropy,
        "grasp_entropy": grasp_entropy,
        "used_grasp": use_grasp & active,
      },
    )


@dataclasses.dataclass(frozen=True)
class AdaptiveComposition:
  """Registry entry of A-SW-GRASP (`AdaptiveSwGraspAlgorithm`)."""

  @property
  def hyperparameter_names(self) -> tuple[str, ...]:
    return (
      "swil_weight",
      "grasp_weight",
      "adaptive_entropy_threshold",
      "balanced_order",
      "adaptive_entropy_classes",
      "swil_reduction",
      "within_class_weighting",
    )

  def build(self, name, dedup, hyperparameters):
    return AdaptiveSwGraspAlgorithm(name=name, dedup=dedup, **hyperparameters)


# ------------------------------------------------------------------------------------- ASV
def _distance_ranks(distances: Array) -> Array:
  """int32 ranks (1 = nearest, ties by index) along the last axis; +inf entries rank last."""
  order = jnp.argsort(distances, axis=-1, stable=True)
  return (jnp.argsort(order, axis=-1, stable=True) + 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AsvAlgorithm(_AlgorithmBase):
  """ASER / ASER-PC / SW-ASER-PC: a candidate set drawn by a class step + uniform sample
  step (N_c distinct eligible images, not marked), scored by the adversarial Shapley value
  against the new batch; the top-scoring candidates are replayed (one per active slot).

  Attributes:
    name, dedup: as `RetrievalAlgorithm`.
    candidate_class_step: `balanced_step` (ASER, ASER-PC) or `similarity_weighted_step`
      (SW-ASER-PC; candidate j serves new image j mod B).
    precomputed: ASER-PC: the left term is `ReplayState.asv_left` (whole buffer as candidate
      and evaluation set, `prepare`); else computed over the candidate set each call.
    num_candidates: N_c (paper 168 ASER, 352 ASER-PC).
    knn_k: K of the KNN-SV (paper 20).
    asv_c: c of eq. 4 (paper 0.15).
    asv_token_matching: 'all_to_all' (paper) | 'nearest_token' (released code).
    asv_distance: 'l2' (released code; the paper does not say) | 'cosine'.
    asv_weight_reduction: 'min' (paper eq. 4) | 'max' (released code).
    asv_chunk_size: evaluation images per chunk of the precomputation.
    within_class_weighting: candidates drawn within their class 'uniform' (paper) | 'grasp'
      (prototype-weighted with `grasp_weight`; released `bal_prob_type='GRASP'`).
    grasp_weight: w of the 'grasp' candidate draw (released `ub_coeff`).
    asv_left_term: True (eq. 3) | False: ASV = -(right term), the candidates' value to the
      buffer is ignored (released `no_buff=True`); the precomputation is then skipped.
    asv_shapley: 'knn' (paper) | 'tknn' (released `SV_type='TKNN'`,
      `knn_shapley.threshold_knn_shapley`) for both terms.
    asv_distance_threshold: TKNN's distance threshold (released `l2_thresh`; None: none).
    tknn_num_classes: C of TKNN's 1/C term (released 400).
    candidate_subsets: 'shared' (paper) | 'per_image' (similarity-weighted candidate step
      only; released `caser.balanced=True`): new image b draws one SWIL class and N_c / B
      candidates of that class (fewer if it runs out; no fallback to other classes); the
      ASV is computed as usual over all N_c candidates and slot j (new image b = j mod B)
      replays the (j div B)-th best candidate of image b's subset.
    asv_features: 'class_embeddings' (paper) | 'image_features' (released `cls_embeds=False`):
      the KNN distances are between `features[asv_features]` and `buffer.<asv_features>`.
    class_hyperparameters: (name, value) of the candidate class step.
  Source: paper §4, eqs. (3)-(4), suppl. §C; docs/reference.md §7.
  """

  name: str
  dedup: dedup_lib.DedupSchedule
  candidate_class_step: Callable
  precomputed: bool
  num_candidates: int = 168
  knn_k: int = 20
  asv_c: float = 0.15
  asv_token_matching: str = "all_to_all"
  asv_distance: str = "l2"
  asv_weight_reduction: str = "min"
  asv_chunk_size: int = 64
  within_class_weighting: str = "uniform"
  grasp_weight: float = 1.0
  asv_left_term: bool = True
  asv_shapley: str = "knn"
  asv_distance_threshold: float | None = None
  tknn_num_classes: float = knn_shapley.TKNN_NUM_CLASSES
  candidate_subsets: str = "shared"
  asv_features: str = "class_embeddings"
  class_hyperparameters: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if self.candidate_subsets == "per_image" and (
      self.candidate_class_step is not similarity_weighted_step
    ):
      raise ValueError(
        f"{self.name}: candidate_subsets='per_image' needs the similarity-weighted candidate "
        "step (sw_aser_pc); the released code has per-image subsets for SW-ASER only"
      )

  needs_features = True

  def _distance_tokens(self, buffer: ReplayBuffer) -> Array:
    """The buffer's [N, k, D] tokens the KNN distances are measured between."""
    tokens = getattr(buffer, self.asv_features)
    if tokens is None:
      raise ValueError(
        f"{self.name}: asv_features={self.asv_features!r} needs a buffer with image_features "
        "(built with replay.aser.asv_features='image_features')"
      )
    return tokens

  def _shapley_options(self) -> dict[str, Any]:
    """Keyword arguments of `knn_shapley.image_knn_shapley` shared by both terms."""
    return dict(
      token_matching=self.asv_token_matching,
      distance=self.asv_distance,
      shapley=self.asv_shapley,
      threshold=self.asv_distance_threshold,
      num_classes=self.tknn_num_classes,
    )

  def left_term_options(self) -> dict:
    """What the precomputed left term depends on besides the buffer (its cache key's
    material, `asv_left.left_term_options`)."""
    return asv_left.left_term_options(
      self.knn_k, features=self.asv_features, **self._shapley_options()
    )

  def prepare(
    self, rstate: ReplayState, buffer: ReplayBuffer, *, mesh=None, cache_prefix=None
  ) -> ReplayState:
    """Fills `asv_left`/`asv_left_min` over the whole buffer once (precomputed variants).

    Host-side loop over jitted chunks sharded over `mesh` (`asv_left.compute_left_term`;
    None: the mesh the buffer is replicated on, else one device). With `cache_prefix` (the
    cached replay store's folder) the result is cached next to the store and the computation
    resumes after an interruption (`asv_left.cached_left_term`). A no-op when already
    `asv_left_ready` (e.g. restored from a checkpoint), for ASER, or without the left term
    (`asv_left_term=False`).
    """
    if (
      not self.precomputed
      or not self.asv_left_term
      or bool(fetch_replicated(rstate.asv_left_ready))
    ):
      return rstate
    tokens = self._distance_tokens(buffer)
    mesh = asv_left.mesh_of(tokens, mesh)
    arguments = (tokens, buffer.query_embeddings, self.left_term_options())
    settings = dict(mesh=mesh, chunk_size=self.asv_chunk_size)
    if cache_prefix is None:
      left, left_min = asv_left.compute_left_term(*arguments, **settings)
    else:
      left, left_min = asv_left.cached_left_term(cache_prefix, *arguments, **settings)
    # Replicated on the mesh as the buffer (global arrays in a multi-process run).
    left, left_min = replicate((jnp.asarray(left), jnp.asarray(left_min)), mesh)
    return rstate.replace(asv_left=left, asv_left_min=left_min, asv_left_ready=jnp.ones((), bool))

  def _select(
    self, class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active, pool
  ):
    _require(
      features,
      ("class_embeddings", "query_embeddings", self.asv_features),
      f"retrieval {self.name!r}",
    )
    tokens = self._distance_tokens(buffer)
    num, n_c = active.shape[0], int(self.num_candidates)
    if n_c < num:
      raise ValueError(f"{self.name}: num_candidates={n_c} < num_replay={num}")
    per_image = self.candidate_subsets == "per_image"
    if per_image:
      batch = features["class_embeddings"].shape[0]
      if n_c % batch:
        raise ValueError(
          f"{self.name}: candidate_subsets='per_image' needs num_candidates={n_c} divisible "
          f"by the new batch size {batch}"
        )
      subset = n_c // batch
      # A new image draws its subset if any slot it serves (slot j -> image j mod B) is active.
      image_active = (
        jnp.zeros((batch,), jnp.int32).at[jnp.arange(num) % batch].max(active.astype(jnp.int32)) > 0
      )
      image_classes, rstate, class_records = self.candidate_class_step(
        class_key,
        rstate,
        buffer,
        features,
        class_eligible,
        image_active,
        **dict(self.class_hyperparameters),
      )
      # Candidate b * subset + r belongs to new image b.
      classes = jnp.repeat(image_classes, subset)
      candidate_active = jnp.repeat(image_active, subset)
    else:
      candidate_active = jnp.broadcast_to(jnp.any(active), (n_c,))
      classes, rstate, class_records = self.candidate_class_step(
        class_key,
        rstate,
        buffer,
        features,
        class_eligible,
        candidate_active,
        **dict(self.class_hyperparameters),
      )
    # Per-image subsets stop at an exhausted class (released): no fallback to other classes.
    fallback = not per_image
    if self.within_class_weighting == "grasp":
      # Released bal_prob_type='GRASP': the candidates of a class are drawn prototype-weighted.
      candidates, candidate_valid = sample_selection.prototype_weighted_in_class(
        sample_key,
        _class_index(buffer),
        eligible,
        classes,
        self.grasp_weight,
        candidate_active,
        without_replacement=True,
        fallback=fallback,
        pool=pool,
      )
    else:
      candidates, candidate_valid = sample_selection.uniform_in_class_active(
        sample_key,
        _class_index(buffer),
        eligible,
        classes,
        candidate_active,
        without_replacement=True,
        fallback=fallback,
        pool=pool,
      )
    options = self._shapley_options()
    right, distances = knn_shapley.image_knn_shapley(
      features[self.asv_features],
      features["query_embeddings"],
      tokens[candidates],
      buffer.query_embeddings[candidates],
      self.knn_k,
      candidate_valid,
      reduction="min",
      **options,
    )  # [B, N_c]
    if not self.asv_left_term:
      # Released no_buff: ASV = -(right term), i.e. zero left term (w irrelevant).
      left_term, extreme = jnp.zeros((n_c,), jnp.float32), jnp.float32(0.0)
    elif self.precomputed:
      left_term = rstate.asv_left[candidates]
      if self.asv_weight_reduction == "min":
        extreme = jnp.min(jnp.where(candidate_valid, rstate.asv_left_min[candidates], jnp.inf))
      else:
        extreme = jnp.max(jnp.where(candidate_valid, left_term, -jnp.inf))
      extreme = jnp.where(jnp.isfinite(extreme), extreme, 0.0)
    else:
      cand_class = tokens[candidates]
      cand_query = buffer.query_embeddings[candidates]
      left, _ = knn_shapley.image_knn_shapley(
        cand_class,
        cand_query,
        cand_class,
        cand_query,
        self.knn_k,
        candidate_valid,
        reduction="max",
        **options,
      )  # [N_c, N_c]
      left_term, extreme = sample_selection.left_term_and_extreme(
        left, candidate_valid, self.asv_weight_reduction
      )
    asv, _ = sample_selection.asv_from_terms(
      left_term, extreme, right, candidate_valid, self.asv_c, self.asv_weight_reduction
    )
    if per_image:
      # Slot j: the (j div B)-th best candidate of new image (j mod B)'s subset.
      image = jnp.arange(num) % batch
      rank = jnp.arange(num, dtype=jnp.int32) // batch
      own = jnp.argsort(-asv.reshape(batch, subset), axis=-1, stable=True)  # [B, subset]
      rank_c = jnp.clip(rank, 0, subset - 1)
      chosen = image * subset + own[image, rank_c]
      count = jnp.sum(candidate_valid.reshape(batch, subset), axis=-1, dtype=jnp.int32)
      valid = active & (rank < count[image])
    else:
      order = jnp.argsort(-asv, stable=True)  # best first
      rank = jnp.clip(jnp.cumsum(active, dtype=jnp.int32) - 1, 0, n_c - 1)
      chosen = order[rank]
      valid = active & (rank < jnp.sum(candidate_valid, dtype=jnp.int32))
    indices = candidates[chosen]
    # Records (paper Fig. 5): distance ranks of candidates per new image.
    ranks = _distance_ranks(distances)  # [B, N_c]
    lowest = jnp.argmin(jnp.where(candidate_valid[None, :], right, jnp.inf), axis=-1)
    min_sv_rank = jnp.take_along_axis(ranks, lowest[:, None], axis=-1)[:, 0]
    selected_rank = jnp.where(valid, jnp.min(ranks[:, chosen], axis=0), -1)
    records = {
      "sampled_classes": jnp.where(valid, classes[chosen], -1),
      "knn_sv": right,
      "knn_sv_valid": candidate_valid,
      "min_sv_rank": min_sv_rank,
      "selected_rank": selected_rank,
    }
    if "swil_entropy" in class_records:
      records["swil_entropy"] = class_records["swil_entropy"]
    return indices, valid, rstate, records


_ASV_NAMES = (
  "num_candidates",
  "knn_k",
  "asv_c",
  "asv_token_matching",
  "asv_distance",
  "asv_weight_reduction",
  "within_class_weighting",
  "grasp_weight",
  "asv_left_term",
  "asv_shapley",
  "asv_distance_threshold",
  "tknn_num_classes",
  "candidate_subsets",
  "asv_features",
)


@dataclasses.dataclass(frozen=True)
class AsvComposition:
  """Registry entry of an ASV algorithm: candidate class step, precomputed left term or not,
  and the default candidate set size N_c."""

  candidate_class_step: Callable
  precomputed: bool
  num_candidates: int

  @property
  def hyperparameter_names(self) -> tuple[str, ...]:
    extra = ("asv_chunk_size",) if self.precomputed else ()
    return _keyword_hyperparameters(self.candidate_class_step) + _ASV_NAMES + extra

  def build(self, name, dedup, hyperparameters):
    class_names = _keyword_hyperparameters(self.candidate_class_step)
    own = {k: v for k, v in hyperparameters.items() if k not in class_names}
    own.setdefault("num_candidates", self.num_candidates)
    return AsvAlgorithm(
      name=name,
      dedup=dedup,
      candidate_class_step=self.candidate_class_step,
      precomputed=self.precomputed,
      class_hyperparameters=tuple(
        (k, v) for k, v in sorted(hyperparameters.items()) if k in class_names
      ),
      **own,
    )


# Steps that read the new batch's features (`features['class_embeddings']`, ...).
FEATURE_STEPS = (similarity_weighted_step,)

# The Table 2 compositions (hyperparameter defaults: paper suppl. Table 7 / docs/reference.md §7).
ALGORITHMS: dict[str, Any] = {
  "uniform": Composition(None, uniform_step),
  "uniform_balanced": Composition(balanced_step, uniform_in_class_step),
  "grasp": Composition(balanced_step, prototype_weighted_step),
  "swil": Composition(similarity_weighted_step, uniform_in_class_step),
  "sw_grasp": Composition(similarity_weighted_step, prototype_weighted_step),
  "a_sw_grasp": AdaptiveComposition(),
  "aser": AsvComposition(balanced_step, precomputed=False, num_candidates=168),
  "aser_pc": AsvComposition(balanced_step, precomputed=True, num_candidates=352),
  "sw_aser_pc": AsvComposition(similarity_weighted_step, precomputed=True, num_candidates=352),
}


def get_algorithm(
  name: str, *, dedup: str | dedup_lib.DedupSchedule = "dataset", **hyperparameters
):
  """Looks up a retrieval algorithm by its Table 2 name and binds its hyperparameters.

  Args:
    name: one of `ALGORITHMS` ('uniform', 'uniform_balanced', 'grasp', 'swil', 'sw_grasp',
      'a_sw_grasp', 'aser', 'aser_pc', 'sw_aser_pc').
    dedup: dedup schedule name ('none' | 'epoch' | 'dataset' | 'fraction' (1/3)) or a
      DedupSchedule (e.g. `DedupSchedule('fraction', 0.25)`); default 'dataset' (docs/reference.md
      §8).
    **hyperparameters: the algorithm's hyperparameters (`ALGORITHMS[name].hyperparameter_names`),
      e.g. `swil_weight` (w of SWIL, 1.0), `grasp_weight` (w of GRASP, 1.0),
      `balanced_order` ('sequential' | 'reshuffled'), `adaptive_entropy_threshold` (tau),
      `num_candidates`, `knn_k` (20), `asv_c` (0.15), `asv_token_matching`, `asv_distance`,
      `asv_weight_reduction`, `asv_chunk_size`, and the released code's options
      `within_class_weighting` ('uniform' | 'grasp'), `asv_left_term`, `asv_shapley`
      ('knn' | 'tknn'), `asv_distance_threshold`, `tknn_num_classes`, `candidate_subsets`
      ('shared' | 'per_image'), `asv_features` ('class_embeddings' | 'image_features').
  Returns:
    a callable `(rstate, buffer, features, num_replay, active=None) -> (indices, valid, rstate)`.
  Raises:
    ValueError: unknown algorithm name (listing the known ones), unknown hyperparameter for
      that algorithm (listing the accepted ones), or unknown dedup schedule / option value.
  Source: paper Table 2, docs/reference.md §7-§8.
  """
  if name not in ALGORITHMS:
    raise ValueError(f"unknown retrieval algorithm {name!r}; known: {sorted(ALGORITHMS)}")
  entry = ALGORITHMS[name]
  accepted = tuple(entry.hyperparameter_names)
  unknown = sorted(set(hyperparameters) - set(accepted))
  if unknown:
    raise ValueError(
      f"retrieval algorithm {name!r} got unknown hyperparameters {unknown}; "
      f"accepted: {sorted(accepted)} (and dedup)"
    )
  _check_option_values(hyperparameters)
  return entry.build(name, dedup_lib.as_schedule(dedup), dict(hyperparameters))


def _check_option_values(hp: Mapping[str, Any]):
  choices = {
    "balanced_order": BALANCED_ORDERS,
    "adaptive_entropy_classes": ADAPTIVE_ENTROPY_CLASSES,
    "swil_reduction": class_selection.SWIL_REDUCTIONS,
    "exhausted_class": EXHAUSTED_CLASS,
    "asv_token_matching": knn_shapley.TOKEN_MATCHING,
    "asv_distance": knn_shapley.DISTANCES,
    "asv_weight_reduction": sample_selection.WEIGHT_REDUCTIONS,
    "within_class_weighting": WITHIN_CLASS_WEIGHTINGS,
    "asv_shapley": knn_shapley.SHAPLEY,
    "asv_left_term": (True, False),
    "candidate_subsets": CANDIDATE_SUBSETS,
    "asv_features": ASV_FEATURES,
  }
  for field, allowed in choices.items():
    if field in hp and hp[field] not in allowed:
      raise ValueError(f"retrieval hyperparameter {field}={hp[field]!r} is not one of {allowed}")
  for field in ("num_candidates", "knn_k", "asv_chunk_size"):
    if field in hp and int(hp[field]) < 1:
      raise ValueError(f"retrieval hyperparameter {field}={hp[field]!r} must be >= 1")
  for field in ("asv_distance_threshold", "tknn_num_classes"):
    if field in hp and hp[field] is not None and not float(hp[field]) > 0:
      raise ValueError(f"retrieval hyperparameter {field}={hp[field]!r} must be > 0")

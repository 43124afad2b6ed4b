"""The retrieval call protocol and the class step + sample step compositions (paper Table 2).

`AlgorithmBase` is the call every algorithm shares (the dedup reset, the eligibility, the
marking; `owl_cl.replay.retrieval` package docstring); `Composition` is the registry entry of
a class step followed by a sample step (`steps.py`), built into a `RetrievalAlgorithm`.
Source: paper §4, Table 2; docs/reference.md §7-§8.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from owl_cl.replay import class_index as class_index_lib
from owl_cl.replay.retrieval import dedup as dedup_lib
from owl_cl.replay.retrieval import sample_selection
from owl_cl.replay.retrieval import steps
from owl_cl.replay.state import ReplayBuffer
from owl_cl.replay.state import ReplayState

Array = jax.Array

# A class that runs out of eligible images within one call: 'fallback' (eligible classes fixed
# at the start of the call; its slot draws uniformly among the remaining images) | 'redraw'
# (released code: per slot, the class step sees the classes still available -> balanced
# skips the class, similarity-weighted redraws). Class + sample compositions and A-SW-GRASP
# (`adaptive.AdaptiveSwGraspAlgorithm`).
EXHAUSTED_CLASS = ("fallback", "redraw")

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
  "forgetting_rise": "float32 [num]: forgetting score (loss rise) of each replayed image "
  "(NaN: invalid slot; `forgetting.forgetting_step`)",
}


def keyword_hyperparameters(fn: Callable | None) -> tuple[str, ...]:
  """The names of `fn`'s keyword-only parameters (a step's hyperparameters); () for None."""
  if fn is None:
    return ()
  return tuple(
    p.name
    for p in inspect.signature(fn).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
  )


def _check_active(active, num_replay: int) -> Array:
  if active is None:
    return jnp.ones((num_replay,), bool)
  active = jnp.asarray(active, bool)
  if active.shape != (num_replay,):
    raise ValueError(f"active must be bool [num_replay={num_replay}], got shape {active.shape}")
  return active


class AlgorithmBase:
  """Shared call protocol of every algorithm (the `owl_cl.replay.retrieval` package docstring)."""

  dedup: dedup_lib.DedupSchedule

  def __call__(
    self,
    rstate: ReplayState,
    buffer: ReplayBuffer,
    features: Mapping[str, Array],
    num_replay: int,
    active: Array | None = None,
  ) -> tuple[Array, Array, ReplayState]:
    """Retrieves `num_replay` buffer images; shapes: the package docstring."""
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
    # One O(P) pass: the class eligibility and the sample step's availability (package doc).
    index = steps.class_index_of(buffer)
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
class RetrievalAlgorithm(AlgorithmBase):
  """A configured class step + sample step (hashable; jit with `static_argnums=3`).

  Attributes:
    name: registry name.
    class_step / sample_step: the primitives (`steps.py`).
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
    return self.class_step in steps.FEATURE_STEPS or self.sample_step in steps.FEATURE_STEPS

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
        sample_selection.class_eligibility(steps.class_index_of(buffer), available)
        & buffer.class_valid
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
      keyword_hyperparameters(self.class_step) + keyword_hyperparameters(self.sample_step) + extra
    )

  def build(
    self, name: str, dedup: dedup_lib.DedupSchedule, hyperparameters: Mapping[str, Any]
  ) -> RetrievalAlgorithm:
    class_names = keyword_hyperparameters(self.class_step)
    sample_names = keyword_hyperparameters(self.sample_step)
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

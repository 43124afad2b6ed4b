"""Retrieval algorithms by name: compositions of primitives (paper Table 2, SPEC §7).

Every algorithm has the signature

    algorithm(rstate, buffer, features, num_replay) -> (indices, valid, rstate)

  rstate:     `ReplayState` (uses and advances `rstate.key`, the dedup mask and counters,
              and the balanced class pointer);
  buffer:     `ReplayBuffer` (jnp arrays, passed as an argument, never closed over);
  features:   dict of the new batch, at least `class_embeddings` float [B, k, E] for
              algorithms with a similarity step (`selection.top_k_embeddings`); may be empty
              for 'uniform' / 'uniform_balanced';
  num_replay: static int, replays to retrieve (1:1 with the new batch: num_replay = B);
  indices:    int32 [num_replay] buffer indices; valid: bool [num_replay].

It is jittable with `jax.jit(algorithm, static_argnums=3)`. One call: (1) the in-call dedup
auto-reset if the buffer is exhausted (`dedup.auto_reset_if_exhausted`); (2) eligible images
from the dedup mask; (3) the class step (if any) on the classes that still have an eligible
image; (4) the sample step; (5) the replays are marked (`dedup.mark_replayed`).

A new composition is one registry line, e.g. `'grasp': Composition(balanced_step,
prototype_weighted_step)`. Step protocols (hyperparameters are keyword-only arguments with
defaults; `get_algorithm` discovers them by name and rejects unknown ones):

  class step:  step(key, rstate, buffer, features, class_eligible [C], num, **hp)
               -> (classes int32 [num] (-1 = no class), rstate)
  sample step: step(key, rstate, buffer, features, classes [num] | None, eligible [N], num,
               without_replacement, **hp) -> (indices int32 [num], valid bool [num])

Registry entries may also be any other builder object with `hyperparameter_names` and
`build(name, dedup, hyperparameters) -> algorithm` (e.g. A-SW-GRASP's per-image switch).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from owl_cl.replay import class_selection
from owl_cl.replay import dedup as dedup_lib
from owl_cl.replay import sample_selection
from owl_cl.replay.state import ReplayBuffer, ReplayState

Array = jax.Array


# ----------------------------------------------------------------------------- class steps
def balanced_step(key, rstate, buffer, features, class_eligible, num):
  """Balanced class step (`class_selection.balanced_classes`); advances the class pointer."""
  del key, buffer, features
  classes, pointer = class_selection.balanced_classes(rstate.class_pointer, class_eligible, num)
  return classes, rstate.replace(class_pointer=pointer)


def _new_image_rows(num: int, batch: int) -> Array:
  """Row of the new batch serving each replay slot: slot j -> new image j mod B."""
  return jnp.arange(num, dtype=jnp.int32) % batch


def similarity_weighted_step(key, rstate, buffer, features, class_eligible, num, *,
                             swil_weight: float = 1.0):
  """Similarity-weighted (SWIL) class step: one class per new image.

  Uses `features['class_embeddings']` [B, k, E] and `buffer.prototypes`; slot j serves new
  image j mod B (slots = new images when num_replay = B). Hyperparameter `swil_weight` is w
  of SPEC §7 (default 1.0).
  """
  if 'class_embeddings' not in features:
    raise ValueError("similarity-weighted class selection needs features['class_embeddings']")
  embeddings = features['class_embeddings']
  probs = class_selection.similarity_weighted_probs(embeddings, buffer.prototypes, swil_weight,
                                                    class_eligible)
  probs = probs[_new_image_rows(num, embeddings.shape[0])]
  return class_selection.sample_classes(key, probs), rstate


# ---------------------------------------------------------------------------- sample steps
def uniform_step(key, rstate, buffer, features, classes, eligible, num, without_replacement):
  """Uniform over all eligible buffer images, no class step (always without replacement)."""
  del rstate, buffer, features, classes, without_replacement
  return sample_selection.uniform(key, eligible, num)


def uniform_in_class_step(key, rstate, buffer, features, classes, eligible, num,
                          without_replacement):
  """Uniform among the eligible members of each slot's class (`uniform_in_class`)."""
  del rstate, features, num
  return sample_selection.uniform_in_class(key, buffer.class_membership, eligible, classes,
                                           without_replacement=without_replacement)


# ----------------------------------------------------------------------------- composition
def _keyword_hyperparameters(fn: Optional[Callable]) -> Tuple[str, ...]:
  if fn is None:
    return ()
  return tuple(p.name for p in inspect.signature(fn).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class RetrievalAlgorithm:
  """A configured retrieval algorithm (hashable; jit with `static_argnums=3`).

  Attributes:
    name: registry name.
    class_step / sample_step: the primitives (see module docstring).
    dedup: the DedupSchedule.
    class_hyperparameters / sample_hyperparameters: tuples of (name, value) bound to the steps.
  """
  name: str
  class_step: Optional[Callable]
  sample_step: Callable
  dedup: dedup_lib.DedupSchedule
  class_hyperparameters: Tuple[Tuple[str, Any], ...] = ()
  sample_hyperparameters: Tuple[Tuple[str, Any], ...] = ()

  @property
  def needs_features(self) -> bool:
    """Whether the algorithm reads the new batch's features (e.g. SWIL's class embeddings);
    callers skip the extra embedding forward pass otherwise."""
    return self.class_step in FEATURE_STEPS or self.sample_step in FEATURE_STEPS

  def __call__(self, rstate: ReplayState, buffer: ReplayBuffer, features: Mapping[str, Array],
               num_replay: int, active: Optional[Array] = None
               ) -> Tuple[Array, Array, ReplayState]:
    """Retrieves `num_replay` buffer images; see the module docstring for shapes.

    `active`: optional bool [num_replay] (traced; None = all active): slots to fill (loss
    adaptivity, SPEC §9). Inactive slots return valid=False and are not marked by dedup.
    (Minimal version: the class and sample steps still run for every slot.)
    """
    num_replay = int(num_replay)
    rstate = dedup_lib.auto_reset_if_exhausted(rstate, self.dedup, num_replay)
    eligible = dedup_lib.eligible_images(rstate, self.dedup)
    key, class_key, sample_key = jax.random.split(rstate.key, 3)
    rstate = rstate.replace(key=key)
    features = {} if features is None else features
    classes = None
    if self.class_step is not None:
      class_eligible = (sample_selection.class_eligibility(buffer.class_membership, eligible)
                        & buffer.class_valid)
      classes, rstate = self.class_step(class_key, rstate, buffer, features, class_eligible,
                                        num_replay, **dict(self.class_hyperparameters))
    indices, valid = self.sample_step(
        sample_key, rstate, buffer, features, classes, eligible, num_replay,
        self.dedup.marks_replays, **dict(self.sample_hyperparameters))
    indices = jnp.asarray(indices, jnp.int32)
    valid = jnp.asarray(valid, bool)
    if active is not None:
      valid = valid & jnp.asarray(active, bool)
    rstate = dedup_lib.mark_replayed(rstate, indices, valid, self.dedup)
    return indices, valid, rstate


@dataclasses.dataclass(frozen=True)
class Composition:
  """Registry entry: a class step (or None) followed by a sample step."""
  class_step: Optional[Callable]
  sample_step: Callable

  @property
  def hyperparameter_names(self) -> Tuple[str, ...]:
    return _keyword_hyperparameters(self.class_step) + _keyword_hyperparameters(self.sample_step)

  def build(self, name: str, dedup: dedup_lib.DedupSchedule,
            hyperparameters: Mapping[str, Any]) -> RetrievalAlgorithm:
    class_names = _keyword_hyperparameters(self.class_step)
    sample_names = _keyword_hyperparameters(self.sample_step)
    return RetrievalAlgorithm(
        name=name, class_step=self.class_step, sample_step=self.sample_step, dedup=dedup,
        class_hyperparameters=tuple((k, v) for k, v in sorted(hyperparameters.items())
                                    if k in class_names),
        sample_hyperparameters=tuple((k, v) for k, v in sorted(hyperparameters.items())
                                     if k in sample_names))


# Steps that read the new batch's features (`features['class_embeddings']`, ...).
FEATURE_STEPS = (similarity_weighted_step,)

# The Table 2 compositions. Issue 4 adds grasp, sw_grasp, a_sw_grasp, aser, aser_pc, sw_aser_pc.
ALGORITHMS: Dict[str, Any] = {
    'uniform': Composition(None, uniform_step),
    'uniform_balanced': Composition(balanced_step, uniform_in_class_step),
    'swil': Composition(similarity_weighted_step, uniform_in_class_step),
}


def get_algorithm(name: str, *, dedup: Union[str, dedup_lib.DedupSchedule] = 'dataset',
                  **hyperparameters) -> RetrievalAlgorithm:
  """Looks up a retrieval algorithm by its Table 2 name and binds its hyperparameters.

  Args:
    name: one of `ALGORITHMS` ('uniform', 'uniform_balanced', 'swil').
    dedup: dedup schedule name ('none' | 'epoch' | 'dataset') or DedupSchedule; default
      'dataset' (the paper's best, SPEC §8).
    **hyperparameters: the steps' hyperparameters, e.g. `swil_weight` (w of SWIL, 1.0).
  Returns:
    a callable `(rstate, buffer, features, num_replay) -> (indices, valid, rstate)`.
  Raises:
    ValueError: unknown algorithm name (listing the known ones), unknown hyperparameter for
      that algorithm (listing the accepted ones), or unknown dedup schedule.
  Source: paper Table 2, SPEC §7-§8.
  """
  if name not in ALGORITHMS:
    raise ValueError(f'unknown retrieval algorithm {name!r}; known: {sorted(ALGORITHMS)}')
  entry = ALGORITHMS[name]
  accepted = tuple(entry.hyperparameter_names)
  unknown = sorted(set(hyperparameters) - set(accepted))
  if unknown:
    raise ValueError(f'retrieval algorithm {name!r} got unknown hyperparameters {unknown}; '
                     f'accepted: {sorted(accepted)} (and dedup)')
  return entry.build(name, dedup_lib.as_schedule(dedup), dict(hyperparameters))

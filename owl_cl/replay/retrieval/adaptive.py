"""A-SW-GRASP: per new image, GRASP or SWIL by the entropy of its SWIL class distribution.

Source: paper §4 "Composing and Modifying Primitives" item 2; docs/reference.md §7.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from owl_cl.replay.retrieval import class_selection
from owl_cl.replay.retrieval import compose
from owl_cl.replay.retrieval import dedup as dedup_lib
from owl_cl.replay.retrieval import sample_selection
from owl_cl.replay.retrieval import steps

# A-SW-GRASP's switch entropy: over the classes with an eligible image (default) | over every
# class with a prototype (released code).
ADAPTIVE_ENTROPY_CLASSES = ("eligible", "all")


@dataclasses.dataclass(frozen=True)
class AdaptiveSwGraspAlgorithm(compose.AlgorithmBase):
  """A-SW-GRASP: per new image, GRASP (balanced class + prototype-weighted sample) if the
  normalised entropy of its SWIL class distribution exceeds `adaptive_entropy_threshold`
  (tau), else SWIL (similarity-weighted class + uniform sample). Only GRASP slots consume
  the balanced class pointer. `adaptive_entropy_classes`: the switch's entropy is that of
  p_SWIL over the classes that still have an eligible image ('eligible', default) or over
  every class with a buffer member ('all', as in the released code).
  `within_class_weighting`: the SWIL slots draw within their class uniformly ('uniform', the
  paper) or prototype-weighted with `grasp_weight` ('grasp', the released
  `bal_prob_type='GRASP'`). `exhausted_class` (`compose.EXHAUSTED_CLASS`): the classes are
  those eligible at the start of the call, a slot whose class ran out within the call
  drawing among the remaining images ('fallback'), or, slot by slot, only the classes that
  still have an image not taken by the call's earlier slots ('redraw', the released code:
  `_select_per_slot`).

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
  exhausted_class: str = "fallback"

  needs_features = True

  def _select(
    self, class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active, pool
  ):
    if self.exhausted_class == "redraw":
      return self._select_per_slot(
        class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active
      )
    num = active.shape[0]
    probs = steps.swil_probs(
      buffer, features, class_eligible, self.swil_weight, self.swil_reduction
    )  # [B, C]
    entropy = self._entropy(buffer, features, class_eligible)  # [B]
    rows = steps.new_image_rows(num, probs.shape[0])
    use_grasp = entropy[rows] > self.adaptive_entropy_threshold
    balanced_key, swil_key = jax.random.split(class_key)
    grasp_classes, rstate, _ = steps.balanced_step(
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
      steps.class_index_of(buffer),
      eligible,
      classes,
      weights,
      active,
      without_replacement=self.dedup.samples_without_replacement,
      pool=pool,
    )
    grasp_entropy = jnp.where(
      use_grasp, steps.grasp_entropy(buffer, eligible, classes, weights, pool), jnp.nan
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

  def _entropy(self, buffer, features, class_eligible) -> jax.Array:
    """float32 [B]: the switch's normalised entropy of p_SWIL, over `class_eligible`
    ('eligible') or over every class with a member ('all': the released code reads p_SWIL
    over every class with a prototype, before it redraws a class without an unreplayed
    image)."""
    classes = buffer.class_valid if self.adaptive_entropy_classes == "all" else class_eligible
    probs = steps.swil_probs(buffer, features, classes, self.swil_weight, self.swil_reduction)
    return sample_selection.normalized_entropy(probs)

  def _select_per_slot(
    self, class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active
  ):
    """exhausted_class='redraw', as the released `get_SWIL_retrieval_indices(adaptivity=
    'img')`: slot by slot (slot j serves new image j mod B), the classes are those that still
    have an image not taken by this call's earlier slots. The switch's entropy is read per
    slot over them ('eligible'; 'all': over every class, as the released code); a GRASP slot's
    balanced pointer skips a class without such an image, a SWIL slot draws its class from
    p_SWIL over them (the released code redraws until it hits one: the same distribution);
    the slot then draws within the class as `_select` does. Records: `sampled_classes`,
    `used_grasp`, and, as `_select` reads them at the start of the call, `swil_entropy` [B]
    and `grasp_entropy` [num].
    """
    steps.require_features(features, ("class_embeddings",), "A-SW-GRASP")
    num = active.shape[0]
    rows = steps.new_image_rows(num, features["class_embeddings"].shape[0])
    keys = jax.random.split(class_key, (num, 2))
    sample_keys = jax.random.split(sample_key, num)
    index = steps.class_index_of(buffer)
    swil_slot_weight = self.grasp_weight if self.within_class_weighting == "grasp" else 0.0

    def slot(carry, inputs):
      rstate, available = carry
      row_index, (balanced_key, swil_key), sample_key, on = inputs
      row = {k: jax.lax.dynamic_index_in_dim(v, row_index) for k, v in features.items()}
      class_now = sample_selection.class_eligibility(index, available) & buffer.class_valid
      use_grasp = self._entropy(buffer, row, class_now)[0] > self.adaptive_entropy_threshold
      grasp_class, rstate, _ = steps.balanced_step(
        balanced_key,
        rstate,
        buffer,
        row,
        class_now,
        (on & use_grasp)[None],
        balanced_order=self.balanced_order,
      )
      probs = steps.swil_probs(buffer, row, class_now, self.swil_weight, self.swil_reduction)
      swil_class = class_selection.sample_classes(swil_key, probs)
      classes = jnp.where(on, jnp.where(use_grasp, grasp_class, swil_class), -1)
      weight = jnp.where(use_grasp, jnp.float32(self.grasp_weight), jnp.float32(swil_slot_weight))
      found_index, valid = sample_selection.prototype_weighted_in_class(
        sample_key,
        index,
        available,
        classes,
        weight[None],
        on[None],
        without_replacement=self.dedup.samples_without_replacement,
      )
      found = valid[0] & on
      if self.dedup.samples_without_replacement:
        available = available.at[found_index[0]].set(available[found_index[0]] & ~found)
      return (rstate, available), (found_index[0], found, classes[0], use_grasp & on)

    (rstate, _), (indices, valid, classes, used_grasp) = jax.lax.scan(
      slot,
      (rstate, jnp.asarray(eligible, bool)),
      (rows, keys, sample_keys, active),
    )
    weights = jnp.where(used_grasp, jnp.float32(self.grasp_weight), jnp.float32(swil_slot_weight))
    records = {
      "sampled_classes": jnp.where(valid, classes, -1),
      "swil_entropy": self._entropy(buffer, features, class_eligible),
      "grasp_entropy": jnp.where(
        used_grasp, steps.grasp_entropy(buffer, eligible, classes, weights), jnp.nan
      ),
      "used_grasp": used_grasp,
    }
    return indices, valid, rstate, records


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
      "exhausted_class",
    )

  def build(self, name, dedup, hyperparameters):
    return AdaptiveSwGraspAlgorithm(name=name, dedup=dedup, **hyperparameters)

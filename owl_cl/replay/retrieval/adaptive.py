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
    probs = steps.swil_probs(
      buffer, features, class_eligible, self.swil_weight, self.swil_reduction
    )  # [B, C]
    if self.adaptive_entropy_classes == "all":
      # Released code: the switch reads p_SWIL over every class with a prototype, before
      # classes without an unreplayed image are removed (it redraws those afterwards).
      entropy_probs = steps.swil_probs(
        buffer, features, buffer.class_valid, self.swil_weight, self.swil_reduction
      )
    else:
      entropy_probs = probs
    entropy = sample_selection.normalized_entropy(entropy_probs)  # [B]
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

"""`ExampleSpec`: what one training example is made of (its query tokens and its sizes).

One frozen value carried by the input pipeline (`input_pipeline.preprocess_train_example`,
`train_map_dataset`, `train_dataset`), the detector (`Detector.example_spec`) and the replay
buffer's build (`replay.build.BufferSpec.example`) instead of six keywords.

Source: docs/reference.md §3 (queries and targets per image), §5 (image size).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from owl_cl.data.label_ops import check_tokens

__all__ = ["ExampleSpec", "MODEL_INPUT_KEYS", "TRAIN_EXAMPLE_KEYS", "EVAL_META_KEYS"]

# The batch dict's keys (docs/CONVENTIONS.md "Batch dict"): the arrays a train step consumes,
# a training example's (those and its query classes), and the host-side bookkeeping of an
# evaluation batch.
MODEL_INPUT_KEYS = ("images", "queries", "labels", "boxes")
TRAIN_EXAMPLE_KEYS = MODEL_INPUT_KEYS + ("query_class",)
EVAL_META_KEYS = ("image_id", "orig_size", "example_mask")


@dataclasses.dataclass(frozen=True, eq=False)
class ExampleSpec:
  """The settings of a training example (docs/CONVENTIONS.md "Batch dict").

  Attributes:
    class_tokens: int32 [C, L] tokenised class names, or [C, P, L] with P prompt variants (one
      drawn uniformly per query, docs/reference.md §2 training prompts).
    empty_tokens: int32 [L] tokens of '' (query 0 and padding queries).
    image_size: S, side of the square network input in pixels (> 0).
    num_queries: Q, queries per image including the padding query 0 (>= 1).
    max_instances: M, target instances per image (>= 1).
    num_negatives: maximum random / annotated negative queries per image (>= 0; released
      code: 50).

  Raises:
    ValueError: token shapes that do not agree (`label_ops.check_tokens`), or a size out of
      range (names the field and its value). Tokens are converted to int32 arrays.
  """

  class_tokens: np.ndarray
  empty_tokens: np.ndarray
  image_size: int
  num_queries: int
  max_instances: int
  num_negatives: int

  def __post_init__(self):
    class_tokens, empty_tokens = check_tokens(self.class_tokens, self.empty_tokens)
    # Frozen: the converted arrays are set through object.__setattr__ (dataclasses' own way).
    object.__setattr__(self, "class_tokens", class_tokens)
    object.__setattr__(self, "empty_tokens", empty_tokens)
    for field, low in (("image_size", 1), ("num_queries", 1), ("max_instances", 1)) + (
      ("num_negatives", 0),
    ):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"ExampleSpec.{field} must be an integer >= {low}, got {value!r}")
      object.__setattr__(self, field, int(value))

  @property
  def num_classes(self) -> int:
    """C, the number of classes of `class_tokens`."""
    return int(self.class_tokens.shape[0])

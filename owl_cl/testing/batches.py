"""Synthetic detection batches for train-step tests (the tiny models of `owl_cl.testing`).

`detection_batch` builds what `owl_cl.train.step` consumes for new or replayed images, with
random images, queries and boxes drawn from a caller's NumPy generator, so a test that calls
it twice gets two different batches and the same seed gives the same batches everywhere
(single-device, 8-device and multi-process tests compare steps on them).
"""

from __future__ import annotations

import numpy as np

# The tiny models' tokenizer ids of start / end of text (vocab_size=64: the last two ids).
SOT_ID, EOT_ID = 62, 63


def detection_batch(
  rng: np.random.Generator,
  batch_size: int,
  *,
  num_queries: int = 4,
  max_boxes: int = 3,
  query_length: int = 16,
  image_size: int = 32,
) -> dict[str, np.ndarray]:
  """A batch of `batch_size` images with three labelled boxes over `num_queries` queries.

  Query 0 is the empty prompt `[SOT, EOT]` (padding); queries 1.. are one random token each.
  Box 0 is labelled with query 1, box 1 with query 2, box 2 with query 0 (a padding box whose
  label is the empty query), so every image has two real instances.

  Args:
    rng: the generator the batch is drawn from (advanced).
    batch_size: B.
    num_queries: Q >= 3.
    max_boxes: M >= 3 (boxes beyond 3 are unlabelled padding).
    query_length: L, token ids per query.
    image_size: S, pixels per image side.

  Returns:
    {'images': float32 [B, S, S, 3] in [0, 1), 'queries': int32 [B, Q, L],
     'labels': float32 [B, M, Q] one-hot, 'boxes': float32 [B, M, 4] (cx, cy, w, h),
     normalised to the image}.
  """
  b, q, m = batch_size, num_queries, max_boxes
  queries = np.zeros((b, q, query_length), np.int32)
  queries[:, :, 0] = SOT_ID
  queries[:, :, 1] = EOT_ID
  queries[:, 1:, 1] = rng.integers(1, 60, (b, q - 1))
  queries[:, 1:, 2] = EOT_ID
  labels = np.zeros((b, m, q), np.float32)
  labels[:, 0, 1] = 1
  labels[:, 1, 2] = 1
  labels[:, 2, 0] = 1
  cxcy = rng.uniform(0.3, 0.7, (b, m, 2))
  wh = rng.uniform(0.1, 0.3, (b, m, 2))
  return {
    "images": rng.uniform(size=(b, image_size, image_size, 3)).astype(np.float32),
    "queries": queries,
    "labels": labels,
    "boxes": np.concatenate([cxcy, wh], -1).astype(np.float32),
  }

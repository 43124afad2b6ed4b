"""The JAX processes of a multi-process run as the scorers' `category_shards.Peers`.

A module of its own so that `category_shards` and the scorers stay free of JAX: the spawned
scoring workers import them, and JAX would cost each worker seconds and memory.
"""

from __future__ import annotations

import jax

from owl_cl import distributed
from owl_cl.eval import category_shards


def jax_peers() -> category_shards.Peers | None:
  """This run's JAX processes sharing the category shards (`distributed.gather_objects`
  exchanges the parts), or None with a single process.

  Returns:
    `category_shards.Peers(jax.process_index(), jax.process_count(), gather_objects)`, or
    None when `jax.process_count()` is 1.
  """
  if jax.process_count() == 1:
    return None
  return category_shards.Peers(jax.process_index(), jax.process_count(), distributed.gather_objects)

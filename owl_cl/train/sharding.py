"""Device mesh and shardings (DESIGN.md "Sharding").

One `jax.sharding.Mesh` over all devices with the axis `data`. Batches are sharded along
their leading axis; parameters, optimizer state and the replay state are replicated, so every
device (and every host) computes the same retrieval. The same code runs on 1 device and on 8
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

DATA_AXIS = "data"


def create_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh with axis 'data' over `devices` (default: all devices)."""
  devices = list(jax.devices() if devices is None else devices)
  return Mesh(np.asarray(devices), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of arrays whose leading axis is the batch: split along 'data'."""
  return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding (parameters, optimizer and replay state)."""
  return NamedSharding(mesh, P())


def check_batch_divisible(batch_size: int, mesh: Mesh, field: str) -> None:
  """Raises ValueError if `batch_size` does not split evenly over the mesh's 'data' axis."""
  n = mesh.shape[DATA_AXIS]
  if batch_size % n:
    raise ValueError(
      f"{field}={batch_size} is not divisible by the {n} devices of the mesh; "
      f"choose a multiple of {n}"
    )


def shard_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
  """Places a host batch (numpy, leading axis B) on the mesh, split along 'data'.

  Single-host only: every host would call `jax.make_array_from_process_local_data` instead
  (multi-host arrives with the cluster launchers).
  """
  sharding = batch_sharding(mesh)
  return {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places a pytree on every device of the mesh."""
  return jax.device_put(tree, replicated(mesh))

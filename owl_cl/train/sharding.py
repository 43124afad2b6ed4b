"""Device mesh and shardings (docs/architecture.md "Sharding").

One `jax.sharding.Mesh` over all devices with the axis `data`. Batches are sharded along
their leading axis; parameters, optimizer state and the replay state are replicated, so every
device (and every host) computes the same retrieval. The same code runs on 1 device and on 8
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), and on several JAX processes (hosts):
each process holds only the rows of a batch that land on its own devices (`process_rows`) and
`shard_batch` assembles the global array from them (`jax.make_array_from_process_local_data`).
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


def process_rows(global_batch_size: int, mesh: Mesh) -> slice:
  """The rows of a global batch that live on this process's devices of `mesh`.

  Each process reads (or gathers) only these rows and passes them to `shard_batch`. With one
  process this is every row, `slice(0, global_batch_size)`.

  Args:
    global_batch_size: B, the leading size of the global batch (a multiple of the mesh's
      'data' axis).
    mesh: the mesh of `create_mesh`.
  Returns:
    slice(start, stop) into [0, B): stop - start = B * local devices / mesh devices.
  Raises:
    ValueError: B is not divisible by the mesh's devices, or this process's devices hold
      non-contiguous rows (a mesh whose device order interleaves processes; `create_mesh`
      over `jax.devices()` never does).
  Source: `jax.sharding.NamedSharding.addressable_devices_indices_map`.
  """
  check_batch_divisible(global_batch_size, mesh, "global_batch_size")
  index_map = batch_sharding(mesh).addressable_devices_indices_map((global_batch_size,))
  bounds = sorted(idx[0].indices(global_batch_size)[:2] for idx in index_map.values())
  start, stop = bounds[0][0], bounds[-1][1]
  # A 1-D mesh splits the batch into equal, disjoint blocks; this process's blocks must touch.
  if any(b[0] != a[1] for a, b in zip(bounds, bounds[1:])):
    raise ValueError(
      f"process {jax.process_index()} holds non-contiguous rows {bounds} of the batch; build "
      "the mesh with create_mesh(jax.devices()) so each process's devices are adjacent"
    )
  return slice(start, stop)


def local_rows(x: Any, mesh: Mesh) -> Any:
  """This process's rows (`process_rows`) of a replicated host array or pytree of them.

  Used for the replay batch: retrieval is replicated (every process computes the same indices
  [R] and mask [R]), and each process gathers from its replay store only the slots that land on
  its devices: `store.gather(local_rows(indices, mesh), local_rows(valid, mesh))`.

  Args:
    x: NumPy array (or pytree of them) with the global leading axis [B, ...].
    mesh: the mesh of `create_mesh`.
  Returns:
    The same structure with leading axis [B * local devices / mesh devices, ...].
  Raises:
    ValueError: leaves of different leading sizes, or as `process_rows`.
  Source: `process_rows`.
  """
  leaves = jax.tree.leaves(x)
  sizes = {np.shape(leaf)[0] for leaf in leaves}
  if len(sizes) != 1:
    raise ValueError(f"local_rows: leaves have different leading sizes {sorted(sizes)}")
  rows = process_rows(sizes.pop(), mesh)
  return jax.tree.map(lambda leaf: np.asarray(leaf)[rows], x)


def host_local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a global array split along its leading axis (e.g. eval outputs).

  The inverse of `shard_batch` for one process: the rows held by its devices, in order, as
  NumPy (no cross-process transfer). Pass the result of every eval batch to
  `owl_cl.distributed.gather_rows` to get the whole eval set on every process. With one
  process this is `np.asarray(x)`.

  Args:
    x: `jax.Array` [B, ...] sharded along its leading axis (replicated arrays work too).
  Returns:
    NumPy array [B_local, ...], the rows of `process_rows(B, mesh)`.
  Raises:
    ValueError: this process's rows are not contiguous (see `process_rows`).
  Source: `jax.Array.addressable_shards`.
  """
  if x.is_fully_addressable:
    return np.asarray(x)
  blocks = {}
  for shard in x.addressable_shards:
    start, stop, _ = shard.index[0].indices(x.shape[0]) if shard.index else (0, 1, 1)
    blocks[(start, stop)] = shard.data  # replicas of one block (several devices) kept once
  bounds = sorted(blocks)
  if any(b[0] != a[1] for a, b in zip(bounds, bounds[1:])):
    raise ValueError(f"process {jax.process_index()} holds non-contiguous rows {bounds}")
  return np.concatenate([np.asarray(blocks[b]) for b in bounds])


def shard_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles global batch arrays, split along 'data', from this process's rows.

  Every process calls it with the same keys and only its own rows (`process_rows`); the global
  leading size is B_local * mesh devices / local devices of the mesh. With one process the
  local rows are the whole batch, so this equals `jax.device_put(batch, batch_sharding(mesh))`.
  Values that already are `jax.Array`s (e.g. a per-example mask computed on the mesh) are
  taken as global arrays and resharded in place with `jax.device_put`.

  Args:
    batch: dict of NumPy arrays [B_local, ...] (or global `jax.Array`s [B, ...]).
    mesh: the mesh of `create_mesh`.
  Returns:
    dict of global `jax.Array`s [B, ...] with `batch_sharding(mesh)`.
  Raises:
    ValueError: B_local does not split evenly over this process's devices of the mesh (field
      named), or this process has no device in the mesh.
  Source: `jax.make_array_from_process_local_data`.
  """
  sharding = batch_sharding(mesh)
  num_local = len(sharding.addressable_devices)
  if not num_local:
    raise ValueError(f"process {jax.process_index()} has no device in the mesh")
  num_global = mesh.shape[DATA_AXIS]
  out = {}
  for k, v in batch.items():
    if isinstance(v, jax.Array):
      out[k] = jax.device_put(v, sharding)
      continue
    v = np.asarray(v)
    if not v.ndim or v.shape[0] % num_local:
      raise ValueError(
        f"batch[{k!r}] has local leading size {v.shape[:1]}, not a multiple of this process's "
        f"{num_local} devices"
      )
    global_shape = (v.shape[0] * num_global // num_local,) + v.shape[1:]
    out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
  return out


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places a pytree on every device of the mesh."""
  return jax.device_put(tree, replicated(mesh))


def fetch_replicated(tree: Any) -> Any:
  """Host copy of a pytree of replicated arrays (parameters, metrics), on every process.

  `jax.device_get` needs fully addressable arrays, and in a multi-process run a replicated
  array spans other processes' devices too; every process already holds a full copy, so its
  first local copy is read. Single process: `jax.device_get`.

  Args:
    tree: pytree of `jax.Array`s with a fully replicated sharding (non-arrays pass through).
  Returns:
    The same pytree of NumPy arrays (same shapes and dtypes).
  Raises:
    ValueError: a leaf that is split across processes (use `host_local_rows` and
      `owl_cl.distributed.gather_rows` for those).
  Source: `jax.Array.addressable_data`, `jax.Array.is_fully_replicated`.
  """

  def fetch(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    if not x.is_fully_replicated:
      raise ValueError(
        f"fetch_replicated: an array of shape {x.shape} with sharding {x.sharding} is split "
        "across processes"
      )
    return np.asarray(x.addressable_data(0))

  return jax.tree.map(fetch, tree)

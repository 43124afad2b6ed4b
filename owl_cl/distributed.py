"""Multi-host runs on JAX's multi-controller runtime: one process per host, one program.

Every host runs the same command (`python -m owl_cl.main --distributed ...`); `initialize`
joins them into one JAX runtime. Then:

- data: each process reads only its rows of every global batch (`sharding.process_rows`, the
  pipeline's `batch_rows`; or its block of a list of image ids, `process_shard`) and passes
  them to `owl_cl.train.sharding.shard_batch`, which assembles the global batch; evaluation
  predictions are gathered back (`gather_rows`) so AP is computed once over the whole eval set,
  each process scoring its share of the category shards (`gather_objects` exchanges them);
- replay: retrieval is replicated (every process computes the same indices) and each process
  gathers only its slots (`owl_cl.train.sharding.local_rows`);
- output: process 0 alone writes results, records and TensorBoard (`is_writer`); every
  process prefixes its log lines with its index (`install_log_prefix`);
- failures: `fail_fast` ends a failing process at once, so JAX's coordination service stops
  the others with a message naming it; `barrier` waits with a timeout and names who is late.

What JAX does when one process dies (observed with jax 0.10.2, 2 CPU processes): a process
that exits without `jax.distributed.shutdown` (crash, kill, `os._exit`) stops sending
heartbeats; after `heartbeat_timeout_seconds` the coordination service aborts every other
process (SIGABRT, exit status 134) with "The following tasks are unhealthy (stopped sending
heartbeats): <index>". If process 0 (the coordinator) dies, the others abort at once ("the
leader task was preempted/died"). A process that ends through a Python exception runs the
normal interpreter exit instead, which waits at JAX's shutdown barrier: if the others' next
collective has never run, it fails after 30 s (Gloo: "GetKeyValue() timed out"); if it has
(the usual case in a training loop), they hang in it until the shutdown barrier times out
(`shutdown_timeout_seconds`, 300 s) and every process aborts with a message that names the
healthy process as the late one. Hence `fail_fast`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import dataclasses
import logging as py_logging
import os
import pickle
import sys
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from owl_cl import utils
from owl_cl.preemption import EXIT_PREEMPTED

# Keys under which a failing process leaves its message in the coordination service's
# key-value store, so `barrier` can name it.
_FAILURE_KEY = "owl_cl/failed/"


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """Where the coordinator is and who this process is (arguments of jax.distributed)."""

  coordinator_address: str  # host:port of process 0's coordination service
  num_processes: int
  process_id: int


def _int_field(value: Any, field: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{field} must be an integer, got {value!r}") from None


def cluster_spec(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  environ: Mapping[str, str] | None = None,
) -> ClusterSpec | None:
  """The explicit cluster layout from arguments, else the environment; None if there is none.

  Each value comes from its argument, else `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` /
  `JAX_PROCESS_ID`, else (count and index only) SLURM's `SLURM_NTASKS` / `SLURM_PROCID`. With no
  coordinator address the layout is left to `jax.distributed.initialize()`'s own detection
  (Cloud TPU metadata) and this returns None.

  Args:
    coordinator_address: 'host:port' of process 0.
    num_processes: number of processes (hosts) in the run.
    process_id: this process's index in [0, num_processes).
    environ: the environment (default `os.environ`).
  Returns:
    ClusterSpec, or None when no coordinator address is given.
  Raises:
    ValueError: a coordinator address without a count or index, a value that is not an
      integer, a process_id outside [0, num_processes), or an address without ':port' (the
      field and value are named).
  Source: the arguments of `jax.distributed.initialize`.
  """
  env = os.environ if environ is None else environ
  address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  if not address:
    return None
  count = num_processes
  if count is None:
    count = env.get("JAX_NUM_PROCESSES", env.get("SLURM_NTASKS"))
  index = process_id
  if index is None:
    index = env.get("JAX_PROCESS_ID", env.get("SLURM_PROCID"))
  if count is None:
    raise ValueError(
      f"coordinator_address={address!r} but num_processes is unset (flag --num_processes, "
      "JAX_NUM_PROCESSES or SLURM_NTASKS)"
    )
  if index is None:
    raise ValueError(
      f"coordinator_address={address!r} but process_id is unset (flag --process_id, "
      "JAX_PROCESS_ID or SLURM_PROCID)"
    )
  count = _int_field(count, "num_processes")
  index = _int_field(index, "process_id")
  if count < 1:
    raise ValueError(f"num_processes must be >= 1, got {count}")
  if not 0 <= index < count:
    raise ValueError(f"process_id must lie in [0, {count}), got {index}")
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator_address must be 'host:port', got {address!r}")
  return ClusterSpec(address, count, index)


def initialize(
  spec: ClusterSpec | None = None,
  *,
  initialization_timeout_s: int = 300,
  heartbeat_timeout_s: int = 100,
) -> None:
  """Joins this process to the multi-process JAX runtime; call before any other JAX call.

  With a `ClusterSpec` (see `cluster_spec`) the coordinator, count and index are passed
  explicitly and JAX's cluster auto-detection is switched off: under SLURM it would otherwise
  limit each process to the GPU numbered by `SLURM_LOCALID` (one GPU per node when the job runs
  one task per node). Without one, `jax.distributed.initialize()` detects the cluster itself
  (Cloud TPU VM metadata). CPU processes use Gloo collectives (JAX's CPU default).

  Args:
    spec: explicit layout, or None for JAX's auto-detection.
    initialization_timeout_s: seconds to wait for all processes to join.
    heartbeat_timeout_s: seconds without a heartbeat after which the coordination service
      declares a process dead and aborts the others (naming it).
  Raises:
    RuntimeError / ValueError from JAX: no cluster detected, coordinator unreachable, or the
      runtime already initialized.
  Source: `jax.distributed.initialize`, `jax_cpu_collectives_implementation`.
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if spec is None:
    jax.distributed.initialize(
      initialization_timeout=initialization_timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
  else:
    jax.distributed.initialize(
      coordinator_address=spec.coordinator_address,
      num_processes=spec.num_processes,
      process_id=spec.process_id,
      cluster_detection_method="deactivate",
      initialization_timeout=initialization_timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
    )


def _runtime() -> tuple[Any, int, int]:
  """(coordination client or None, process index, process count) without starting a backend.

  jax.process_index() would initialize the XLA backend, which in a multi-process run blocks
  until every process has joined; the failure paths must not wait on a dead peer.
  """
  # No public accessor exists for the coordination client (key-value store, barriers).
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top

  state = jax_distributed.global_state
  if state.client is None:
    return None, 0, 1
  return state.client, int(state.process_id), int(state.num_processes)


def is_writer() -> bool:
  """True on the process that writes results, records, TensorBoard: process 0.

  Returns: bool (True with a single process).
  Source: `jax.process_index`.
  """
  return jax.process_index() == 0


def log_prefix() -> str:
  """'[process i/n] ' in a multi-process run, '' with a single process.

  Returns: str.
  Source: `jax.distributed` state (index and count as passed to `initialize`).
  """
  _, index, count = _runtime()
  return f"[process {index}/{count}] " if count > 1 else ""


class _PrefixFilter(py_logging.Filter):
  """Prepends a fixed prefix to every record's message (a handler filter)."""

  def __init__(self, prefix: str):
    super().__init__()
    self.prefix = prefix

  def filter(self, record: py_logging.LogRecord) -> bool:
    if not getattr(record, "_owl_cl_prefixed", False):
      record.msg = f"{self.prefix}{record.msg}"
      record._owl_cl_prefixed = True
    return True


def install_log_prefix(handler: py_logging.Handler | None = None) -> str:
  """Prefixes every log line of this process with its index (`log_prefix`).

  Call once after `initialize`; a no-op with a single process, so single-host logs stay as they
  are.

  Args:
    handler: the logging handler to filter (default: absl's handler).
  Returns:
    The prefix installed ('' with a single process).
  Source: `logging.Filter`, `absl.logging.get_absl_handler`.
  """
  prefix = log_prefix()
  if prefix:
    target = handler if handler is not None else logging.get_absl_handler()
    target.addFilter(_PrefixFilter(prefix))
  return prefix


def process_shard(
  ids: Sequence[Any], process_index: int | None = None, process_count: int | None = None
) -> list[Any]:
  """This process's contiguous block of `ids` (image ids of a dataset), covering all once.

  Blocks are in process order and differ in size by at most one (the first `len % count`
  blocks are one longer), so concatenating every process's block gives `ids` back in order;
  `gather_rows` of per-image predictions therefore returns them in dataset order.

  Args:
    ids: the whole dataset's ids [N], in the same order on every process.
    process_index: this process (default `jax.process_index()`).
    process_count: number of processes (default `jax.process_count()`).
  Returns:
    list [N // count or N // count + 1].
  Raises:
    ValueError: process_count < 1 or process_index outside [0, process_count).
  Source: `numpy.array_split` block layout.
  """
  count = jax.process_count() if process_count is None else int(process_count)
  index = jax.process_index() if process_index is None else int(process_index)
  if count < 1:
    raise ValueError(f"process_count must be >= 1, got {count}")
  if not 0 <= index < count:
    raise ValueError(f"process_index must lie in [0, {count}), got {index}")
  base, extra = divmod(len(ids), count)
  start = index * base + min(index, extra)
  stop = start + base + (index < extra)
  return list(ids[start:stop])


def gather_rows(tree: Any) -> Any:
  """Concatenates every process's rows of a pytree of host arrays, on every process.

  Shards may differ in length (e.g. `process_shard` of an eval set): each process pads its rows
  to the longest shard, `process_allgather` stacks them, and the padding is cut off again. The
  result is in process order, so shards of `process_shard` come back in dataset order. With a
  single process the input is returned (as NumPy).

  Args:
    tree: pytree of NumPy-convertible arrays [n_local, ...] sharing the leading size n_local
      (which may be 0); same structure, dtypes and trailing shapes on every process.
  Returns:
    The same pytree of NumPy arrays [sum of n_local over processes, ...].
  Raises:
    ValueError: leaves with different leading sizes.
  Source: `jax.experimental.multihost_utils.process_allgather`.
  """
  tree = jax.tree.map(np.asarray, tree)
  leaves = jax.tree.leaves(tree)
  sizes = {leaf.shape[0] if leaf.ndim else -1 for leaf in leaves}
  if len(sizes) > 1 or -1 in sizes:
    raise ValueError(f"gather_rows: leaves need one common leading size, got {sorted(sizes)}")
  if jax.process_count() == 1:
    return tree
  n = sizes.pop() if sizes else 0
  counts = np.asarray(multihost_utils.process_allgather(np.int64(n))).reshape(-1)
  longest = int(counts.max())

  def pad(leaf):
    return np.concatenate([leaf, np.zeros((longest - n,) + leaf.shape[1:], leaf.dtype)])

  stacked = multihost_utils.process_allgather(jax.tree.map(pad, tree))  # [P, longest, ...]
  return jax.tree.map(
    lambda s: np.concatenate([np.asarray(s)[p, :c] for p, c in enumerate(counts)]), stacked
  )


def gather_objects(value: Any) -> list[Any]:
  """Every process's picklable `value`, on every process, in process order.

  Collective: every process calls it at the same point. Each value is pickled to bytes, and
  the bytes and their lengths go through `gather_rows` (one all-gather each). For results a
  process computed alone, such as its category shards' precision arrays
  (`owl_cl.eval.category_shards.run` with `peers`); the peers are this run's own
  processes, so unpickling their bytes is as safe as the run's code.

  Args:
    value: any picklable object (tens of MB at most: it travels through device memory).
  Returns:
    list [process_count] of the values (`[value]` itself with a single process).
  Source: `jax.experimental.multihost_utils.process_allgather` (via `gather_rows`).
  """
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
  sizes = gather_rows(np.asarray([data.size], np.int64))
  joined = gather_rows(data)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  return [pickle.loads(joined[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]


def failed_processes() -> dict[int, str]:
  """Messages left by processes that failed inside `fail_fast` (index -> message).

  Returns: dict (empty with a single process or when none failed).
  Source: the coordination service's key-value store (`key_value_dir_get`).
  """
  client, _, count = _runtime()
  if client is None or count == 1:
    return {}
  out = {}
  for key, value in client.key_value_dir_get(_FAILURE_KEY):
    out[int(key.rsplit("/", 1)[-1])] = value
  return out


def writer_value(value: bool) -> bool:
  """Process 0's `value` on every process (`value` itself with a single process).

  Collective: every process calls it at the same point (it waits for the others). For the
  decisions only the writer makes, e.g. whether a cache entry passed its integrity check.

  Returns: bool.
  Source: `jax.experimental.multihost_utils.broadcast_one_to_all`.
  """
  if jax.process_count() == 1:
    return bool(value)
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(bool(value))))


@contextlib.contextmanager
def cache_entry_lock(path: str, what: str) -> Iterator[bool]:
  """`utils.cache_entry_lock` of the cache entry `path`, held by the writer (process 0).

  A multi-process run is one user of the cache: its writer takes the lock (waiting for
  another run that builds the entry), and the other processes, which only read the entry,
  follow the writer's decisions (`writer_value`). Taken on every process, the run's own
  processes would wait for one another. Collective (every process enters it together).

  Yields:
    The writer's answer on every process: True, the entry may be built; False, the cache
    cannot be written (`utils.cache_entry_lock`).
  """
  with utils.cache_entry_lock(path, what) if is_writer() else contextlib.nullcontext(True) as ok:
    yield writer_value(ok)


def barrier(name: str, timeout_s: float = 600.0) -> None:
  """Waits until every process reaches `name`; fails after `timeout_s` naming who did not.

  Use at the points where all processes must agree before going on (end of a dataset, before
  process 0 writes results), so a hung or dead peer turns into an error instead of a hang.
  A no-op with a single process.

  Args:
    name: barrier id, the same on every process and unique per use (e.g. f"stage-{i}").
    timeout_s: seconds to wait.
  Raises:
    RuntimeError: the barrier timed out or a process failed; the message names the processes
      (failure messages left by `fail_fast`, and JAX's list of late tasks).
  Source: the coordination service's `wait_at_barrier` (jax.distributed client).
  """
  client, index, count = _runtime()
  if client is None or count == 1:
    return
  try:
    client.wait_at_barrier(f"owl_cl/{name}", int(timeout_s * 1000))
  except Exception as e:  # JaxRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
    failed = failed_processes()
    who = "; ".join(f"process {i}: {m}" for i, m in sorted(failed.items()))
    raise RuntimeError(
      f"process {index}/{count}: barrier {name!r} failed after up to {timeout_s:g} s"
      + (f"; failed processes: {who}" if who else "")
      + f". JAX: {e}"
    ) from e


@contextlib.contextmanager
def fail_fast(exit_code: int = 1) -> Iterator[None]:
  """Turns an exception in a multi-process run into the end of the whole run, naming this process.

  On an exception the process logs "process i of n failed: ..." with the traceback, leaves the
  message in the coordination service (read by `barrier` / `failed_processes`) and exits at
  once with `os._exit(exit_code)`, skipping the orderly `jax.distributed.shutdown`: its
  heartbeats stop, and after the heartbeat timeout JAX aborts every other process with "tasks
  unhealthy (stopped sending heartbeats): i". Without this, the others would wait in their
  next collective. With a single process the exception propagates unchanged.

  Args:
    exit_code: this process's exit status on failure.
  Raises:
    The body's exception, with a single process only.
  Source: `jax.distributed` coordination service (heartbeats, `key_value_set`).
  """
  try:
    yield
  except BaseException as e:
    client, index, count = _runtime()
    # A preempted run (SIGTERM) stops on every process at the same step (agreed by
    # `preemption.any_process`), so it ends in order like a normal exit.
    orderly = isinstance(e, SystemExit) and (not e.code or e.code == EXIT_PREEMPTED)
    if client is None or count == 1 or orderly:
      raise  # one process, or a normal exit (sys.exit(0)): nothing to end
    message = f"{type(e).__name__}: {e}"
    logging.exception("process %d of %d failed: %s", index, count, message)
    with contextlib.suppress(Exception):  # best effort: the coordinator may be gone
      client.key_value_set(f"{_FAILURE_KEY}{index}", message[:2000])
    print(f"owl_cl: process {index} of {count} failed: {message}", file=sys.stderr, flush=True)
    logging.flush()
    sys.stdout.flush()
    os._exit(exit_code)

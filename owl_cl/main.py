r"""Entry point: `python -m owl_cl.main --config=configs/swil.py [--workdir=DIR]`.

Runs the whole pipeline (`owl_cl.experiment.run`): pre-trained model (loaded, or pre-trained
here on the built-in benchmark and cached), replay buffer, continual fine-tuning over the
downstream sequence, evaluation after every stage, `results.json` / `results.md` in the
workdir. The same command on the same workdir resumes after the last finished dataset.
Multi-host (TPU pod slices, several GPU nodes): add `--distributed` on every host (the
coordinator from `--coordinator_address` / `JAX_COORDINATOR_ADDRESS`, else JAX's detection).
Any config field can be overridden: `--config.replay.dedup=epoch`.
glibc's malloc is set first to keep freed memory for reuse (`--keep_freed_memory`, default on;
`owl_cl.host_memory`, docs/host_cost.md): XLA:CPU's per-step buffers no longer cost page faults.

Errors of the user's input (a bad config value, missing or malformed data, a checkpoint of
another model, a workdir of another run or in use by another process, a stored file that
fails its integrity check, a full disk) print one message
naming the culprit, without a traceback (`--verbose` or `--verbosity=1` adds it), and exit
with status 2; a diverged training (non-finite loss) exits with status 1. SIGTERM (SLURM,
TPU maintenance) saves a step checkpoint at the next step boundary and exits with status 75
(`preemption.EXIT_PREEMPTED`); the same command resumes.
"""

from __future__ import annotations

import ast
import logging as py_logging
import os
import sys
import time
import traceback

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from owl_cl import distributed
from owl_cl import experiment
from owl_cl import host_memory
from owl_cl import preemption
from owl_cl.config_fields import ConfigError
from owl_cl.data.coco import DataError
from owl_cl.eval.results import ResultsConflictError
from owl_cl.integrity import IntegrityError
from owl_cl.model.convert import CheckpointMismatchError
from owl_cl.train.checkpointing import DiskFullError
from owl_cl.train.loop_state import TrainingDivergedError
from owl_cl.utils import ReadOnlyCacheError
from owl_cl.utils import WorkdirLockedError

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "Path to a config file, e.g. configs/swil.py (optionally ':arg').",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "Output folder. Default: workdirs/<experiment_name>_<timestamp> (a new folder, so no run "
  "overwrites another). Re-using a workdir resumes the run it holds.",
)
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed",
  False,
  "Multi-host (Cloud TPU VM pods, multi-node GPU): call jax.distributed.initialize() before "
  "anything else, so every host joins one JAX runtime (coordinator from the environment: "
  "TPU metadata, or --coordinator_address / JAX_COORDINATOR_ADDRESS with the process count and "
  "index from the flags below, JAX_NUM_PROCESSES / JAX_PROCESS_ID or SLURM_NTASKS / "
  "SLURM_PROCID). Run the same command on every host.",
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  None,
  "With --distributed: 'host:port' of process 0 (default: JAX_COORDINATOR_ADDRESS; unset: "
  "jax.distributed.initialize() detects the cluster, e.g. Cloud TPU).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "With --distributed: number of processes (default from the environment)."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "With --distributed: this process's index (default from the environment)."
)

_KEEP_FREED_MEMORY = flags.DEFINE_bool(
  "keep_freed_memory",
  True,
  "glibc malloc keeps freed memory for reuse instead of returning it to the OS and faulting it "
  "back every step (owl_cl.host_memory; docs/host_cost.md). Same results; --nokeep_freed_memory "
  "or any MALLOC_* / GLIBC_TUNABLES variable in the environment leaves glibc's defaults.",
)

_VERBOSE = flags.DEFINE_bool(
  "verbose",
  False,
  "Print the Python traceback of known errors (bad config, data, checkpoints, workdir) too.",
)

# Exit statuses of the known errors (`main`): bad input, and a run that stopped on its own.
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 1


def default_workdir(experiment_name: str) -> str:
  """`workdirs/<experiment_name>_<YYYYmmdd-HHMMSS>` below the current folder."""
  return os.path.join("workdirs", f"{experiment_name}_{time.strftime('%Y%m%d-%H%M%S')}")


class QuietLibraryInfo(py_logging.Filter):
  """Drops the INFO lines of two libraries (their warnings and errors pass): orbax's, which
  log every checkpoint file operation, and JAX's, whose backend probe on a machine without a
  TPU logs "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so ...".

  JAX logs that at INFO on purpose: jax/_src/xla_bridge.py (jax 0.10) registers the TPU
  backend with `fail_quietly=True`, and a quiet backend that fails to start is logged with
  `logger.info` (with JAX_PLATFORMS naming it, it is an error instead). Setting JAX_PLATFORMS
  would also silence it, but would choose the platform for GPU and TPU users too.
  JAX's warnings (a GPU present without a CUDA jaxlib, ...) still show; `--verbosity=1`
  keeps every line (`main` does not install the filter then).
  """

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING:
      return True
    jax = record.name == "jax" or record.name.startswith(("jax.", "jaxlib."))
    return not jax and "orbax" not in record.pathname


def main(argv):
  if _KEEP_FREED_MEMORY.value:
    # First: before JAX creates the threads that allocate (a thread keeps its malloc arena).
    malloc = host_memory.keep_freed_memory()
  if not logging.level_debug():
    logging.get_absl_handler().addFilter(QuietLibraryInfo())
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _DISTRIBUTED.value and (
    _COORDINATOR.value or _NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None
  ):
    raise app.UsageError("--coordinator_address/--num_processes/--process_id need --distributed")
  if _DISTRIBUTED.value:
    import jax  # pylint: disable=g-import-not-at-top

    spec = distributed.cluster_spec(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    distributed.initialize(spec)  # Before any other JAX call (device lists, compilation).
    distributed.install_log_prefix()
    logging.info(
      "jax.distributed: process %d of %d, %d local / %d global devices",
      jax.process_index(),
      jax.process_count(),
      jax.local_device_count(),
      jax.device_count(),
    )
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/swil.py")
  workdir = _WORKDIR.value or default_workdir(config.experiment_name)
  logging.info("workdir: %s", os.path.abspath(workdir))
  if _KEEP_FREED_MEMORY.value:
    logging.info("malloc keeps freed memory (--keep_freed_memory): %s", malloc)
  # One process's exception ends the whole multi-process run (the others are stopped by JAX's
  # coordination service, naming it); with one process it propagates as usual. A known error
  # (the user's input) is one message and exit status 2 on the process that found it.
  with distributed.fail_fast():
    try:
      experiment.run(config, workdir)
    except preemption.Preempted as e:
      # Not a failure: every process saved and stops here, with the status a job script
      # can requeue on.
      logging.warning("%s (exit status %d)", e, preemption.EXIT_PREEMPTED)
      print(f"preempted: {e}", file=sys.stderr, flush=True)
      sys.exit(preemption.EXIT_PREEMPTED)
    except known_errors() as e:
      fail(e, verbose=_VERBOSE.value or logging.level_debug())


def known_errors() -> tuple[type[BaseException], ...]:
  """The exceptions that are the user's input, not a bug: reported without a traceback."""
  return (
    ConfigError,
    DataError,
    CheckpointMismatchError,
    ResultsConflictError,
    WorkdirLockedError,
    TrainingDivergedError,
    IntegrityError,
    DiskFullError,
    ReadOnlyCacheError,
  )


def fail(error: BaseException, verbose: bool = False) -> None:
  """Prints `error` as one message (with its traceback when verbose) and exits non-zero.

  Raises:
    SystemExit: EXIT_DIVERGED for a diverged training, else EXIT_BAD_INPUT.
  """
  if verbose:
    traceback.print_exception(error)
  print(f"error: {error}", file=sys.stderr, flush=True)
  sys.exit(EXIT_DIVERGED if isinstance(error, TrainingDivergedError) else EXIT_BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad command line reported as one line (exit status 2).

  ml_collections raises AttributeError / KeyError (with a "did you mean" hint) for an
  override of a field the config lacks, absl a `flags.Error` for a value of the wrong type
  (`--config.data.num_queries=abc`); absl would print a traceback or exit with status 1.
  A tuple field given several times with a tuple among the values is refused
  (`repeated_tuple_problem`).
  """
  try:
    rest = flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    # The message arrives as the repr of a KeyError's: undo its quoting and line breaks.
    hint = str(e.args[0] if e.args else e).strip("'\"")
    hint = hint.replace("\\'", "'").replace("\\n", " ").replace("\n", " ")
    print(f"error: unknown config field in the command line: {hint}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
  except flags.Error as e:
    print(f"error: bad command line: {short_flag_error(str(e))}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
  problem = config_file_problem(_CONFIG.value, flag_values(argv, "config"))
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
  # ml_collections defines a tuple field's flag as a MultiFlag (config_flags).
  tuple_flags = {
    name
    for name in flags.FLAGS
    if name.startswith("config.") and isinstance(flags.FLAGS[name], flags.MultiFlag)
  }
  problem = repeated_tuple_problem(argv, tuple_flags)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
  return rest


def short_flag_error(message: str) -> str:
  """absl's message of a bad flag on one line. A config file's `get_config` that raised
  (`--config=configs/swil.py:unknownarg`) arrives with its whole traceback (ml_collections
  adds it): only the flag and the exception's own last line are kept."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  if any(line.startswith("Traceback (most recent call last)") for line in lines):
    return f"{lines[0]} {lines[-1]}"
  return " ".join(lines)


def config_file_problem(config, values: list[str]) -> str:
  """'' unless `--config` names a file that cannot be loaded (`configs/nosuch.py`), then one
  line naming it and why. ml_collections defers that error to the config's first use (a
  stand-in config raising OSError on any access, with the loader's reason as its cause)."""
  if config is None:
    return ""
  try:
    config.get("experiment_name")
  except OSError as e:
    lines = [line.strip() for line in str(e.__cause__ or e).splitlines() if line.strip()]
    return f"--config={values[-1] if values else ''} cannot be loaded: {lines[-1]}"
  return ""


def flag_values(argv: list[str], name: str) -> list[str]:
  """The values `--name=value` / `--name value` of flag `name` in `argv`, in order."""
  values = []
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      values.append(arg[len(name) + 3 :])
    elif arg == f"--{name}" and i + 1 < len(argv):
      values.append(argv[i + 1])
  return values


def repeated_tuple_problem(argv: list[str], tuple_flags: set[str]) -> str:
  """'' unless a tuple field of the config is given more than once with a tuple among its
  values (e.g. `--config.data.builtin.downstream=thermal --config.data.builtin.downstream=()`).

  ml_collections joins the values of a tuple field's repeated flags into one tuple (`--f=a
  --f=b` is ('a', 'b')), so a later override does not replace an earlier one: there the
  empty tuple adds nothing and ('thermal',) would run. Refused, naming the flag and its
  values, rather than guessing which one was meant.

  Args:
    argv: the command line. tuple_flags: names of the config's tuple-field flags
      ('config.data.builtin.downstream').
  """
  for name in sorted(tuple_flags):
    values = flag_values(argv, name)
    if len(values) < 2 or not any(_is_tuple_literal(v) for v in values):
      continue
    return (
      f"--{name} is given {len(values)} times ({', '.join(repr(v) for v in values)}): the "
      "values of a tuple field's repeated flags are joined into one tuple, so a later one "
      f"does not replace an earlier one; give the whole tuple once, e.g. "
      f'--{name}=\'("a", "b")\''
    )
  return ""


def _is_tuple_literal(value: str) -> bool:
  """Whether `value` reads as a Python tuple or list ('()', '("a", "b")', '[1]')."""
  try:
    return isinstance(ast.literal_eval(value), (tuple, list))
  except (ValueError, SyntaxError):
    return False


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)

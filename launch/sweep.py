r"""Command lines of a sweep: algorithms x task orders x seeds (x optional config grids).

    python launch/sweep.py --algorithms=no_replay,uniform,swil --seeds=0,1,2 \
        [--orders=random_0,random_1] [--seed-fields=seeds.data,seeds.retrieval] \
        [--paper | --config-arg=builtin2] [--set replay.dedup=epoch,dataset] \
        [--fixed data.root=/data] \
        [--root=workdirs/sweep] [--task-file=sweep.tasks] [--run] [--processes=N]

Each command is `python -m owl_cl.main --config=configs/<algorithm>.py[:paper|:builtin2]
--workdir=<root>/<algorithm>[_<order>]_seed<k>[_<field>=<v>...] [--config.task_order=<order>]
--config.<seed field>=<k>... [--config.<field>=<v> ...]`. Without `--orders` the seed sets
`sequence_seed` (a seeded shuffle of the sequence, as before); with `--orders` (stored task
orders, owl_cl/data/orders/) it sets `seeds.data` and `seeds.retrieval`, so the runs of one
sweep share the cached pre-trained model and buffer (`seeds.model` stays `seed`);
`--seed-fields` names other fields (e.g. `seed` to vary everything, `seeds.retrieval` alone;
docs/experiments.md, "Seeds"). The order is deterministic: algorithms as given, then orders,
then seeds, then the `--set` grid (itertools.product in the order of the flags). Every workdir
is distinct; re-running a command on its workdir resumes it (owl_cl.main), so a sweep can be
re-submitted after a failure or preemption.

Default (dry run): print the commands, one per line. `--task-file F`: also write them to F,
one per line, for `launch/slurm_gpu.sbatch` (line i+1 = array task i); an existing F with
other contents is never overwritten. `--run`: run them here, skipping complete runs
(`results.json` status 'complete'); an interrupted run resumes (owl_cl.main). `--processes N`
(with `--run`): up to N runs at once, the first one alone (it fills the shared cache: the
built-in benchmark, the pre-trained model, the buffer; with `--seed-fields` `seed` or
`seeds.model`, each model seed's first run before that seed's others), a line with the rate
and the time left after each; each run's output goes to `<root>/logs/<name>.log`. Stops
launching at the first failure and returns its status. The committed sweeps' designs run
with `launch/sweep_design.py`.

Values are checked before anything is printed: algorithms against the registries (the
retrieval algorithms and the baselines, `known_algorithms`), every
`--set` / `--fixed` field against the algorithm's config. A value list is split on commas
outside brackets, so `--set "data.augment.mosaic_sizes=(1,2),(1,2,3)"` gives two values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import glob
import importlib
import importlib.util
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python launch/sweep.py` from anywhere: import owl_cl (a checkout).
  sys.path.insert(0, REPO)

from owl_cl import configs  # noqa: E402 (after the checkout joins sys.path)
from owl_cl.replay.retrieval import registry  # noqa: E402


def known_algorithms(configs_dir: str | None = None) -> list[str]:
  """Algorithm config names, sorted. The package's configs: every retrieval algorithm of the
  registry (`registry.ALGORITHMS`, configs/<name>.py) and every baseline
  (`owl_cl.configs.BASELINES`); `configs_dir`: its <name>.py files but base.py and
  __init__.py."""
  if configs_dir is None:
    return sorted(set(registry.ALGORITHMS) | set(configs.BASELINES))
  names = [
    os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(configs_dir, "*.py"))
  ]
  return sorted(n for n in names if n not in ("base", "__init__"))


def split_values(text: str) -> list[str]:
  """Splits `a,b,(1,2)` on commas outside (), [], {} -> ['a', 'b', '(1,2)'].

  Raises:
    ValueError: unbalanced brackets or an empty value (names the text).
  """
  values, depth, current = [], 0, ""
  for char in text:
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
      if depth < 0:
        raise ValueError(f"unbalanced brackets in {text!r}")
    if char == "," and depth == 0:
      values.append(current)
      current = ""
    else:
      current += char
  if depth:
    raise ValueError(f"unbalanced brackets in {text!r}")
  values.append(current)
  values = [v.strip() for v in values]
  if any(not v for v in values):
    raise ValueError(f"empty value in {text!r}")
  return values


def parse_assignment(text: str, *, multiple: bool) -> tuple[str, list[str]]:
  """`field=v1,v2` -> ('field', ['v1', 'v2']) (or one value when not `multiple`).

  Raises:
    ValueError: no '=' or an empty field / value.
  """
  field, sep, value = text.partition("=")
  field = field.strip()
  if field.startswith("config."):
    field = field[len("config.") :]
  if not sep or not field or not value.strip():
    raise ValueError(f"expected FIELD=VALUE{'S' if multiple else ''}, got {text!r}")
  return field, (split_values(value) if multiple else [value.strip()])


def _check_field(config, field: str, where: str) -> None:
  node = config
  for n, part in enumerate(field.split(".")):
    try:
      node = node[part]
    except (KeyError, AttributeError, TypeError):
      raise ValueError(
        f"{where}: config field {field!r} does not exist (no "
        f"{'.'.join(field.split('.')[: n + 1])!r})"
      ) from None


def _config_arg(paper: bool, config_arg: str = "") -> str:
  """The `get_config` argument: 'paper' and/or `config_arg` (e.g. 'builtin2'), comma-joined."""
  return ",".join(p for p in ("paper" if paper else "", config_arg) if p)


def _load_config(algorithm: str, paper: bool, configs_dir: str | None = None, config_arg: str = ""):
  if configs_dir is None:
    module = importlib.import_module(f"configs.{algorithm}")
  else:
    path = os.path.join(configs_dir, f"{algorithm}.py")
    spec = importlib.util.spec_from_file_location(f"sweep_config_{algorithm}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  return module.get_config(_config_arg(paper, config_arg))


@dataclasses.dataclass(frozen=True)
class Task:
  """One run of the sweep: its workdir and its command line (argv, unquoted).

  `cache_group`: the runs that share one pre-trained model and buffer (the model seed when the
  sweep's seed sets it, else None: one model for the whole sweep); `run_tasks` runs a group's
  first task before the group's others.
  """

  algorithm: str
  seed: int
  grid: tuple[tuple[str, str], ...]
  workdir: str
  argv: tuple[str, ...]
  order: str | None = None
  cache_group: int | None = None

  @property
  def command(self) -> str:
    """The shell-quoted command line."""
    return " ".join(shlex.quote(a) for a in self.argv)


# The seed fields that choose the pre-trained model (and so the cache entries a run fills).
MODEL_SEED_FIELDS = ("seed", "seeds.model")


def workdir_head(label: str) -> str:
  """A row label as the head of its workdirs' names: 'swil+wise_ft(0.5)' -> 'swil+wise_ft_0.5'
  ('(' becomes '_', ')' goes, other characters but letters, digits and `._=-+,` become '-')."""
  return _name_part("", label.replace("(", "_").replace(")", ""))[1:]


def _name_part(field: str, value: str) -> str:
  part = f"{field}={value}"
  return "".join(c if c.isalnum() or c in "._=-+," else "-" for c in part)


def build_sweep(
  algorithms: Sequence[str],
  seeds: Sequence[int],
  *,
  root: str = "workdirs/sweep",
  paper: bool = False,
  grid: Sequence[tuple[str, Sequence[str]]] = (),
  fixed: Sequence[tuple[str, str]] = (),
  python: str = "python",
  check_fields: bool = True,
  orders: Sequence[str] = (),
  seed_fields: Sequence[str] | None = None,
  configs_dir: str | None = None,
  config_arg: str = "",
  label: str = "",
) -> list[Task]:
  """The sweep's tasks in deterministic order (algorithm, order, seed, then grid product).

  Args:
    algorithms: config names (configs/<name>.py), e.g. ['no_replay', 'swil'].
    seeds: the values of the `seed_fields`.
    root: parent folder of the workdirs `<root>/<algorithm>[_<order>]_seed<k>[_<field>=<v>...]`
      (characters other than letters, digits and `._=-+,` in a value become '-').
    paper: use `configs/<algorithm>.py:paper` (the paper's protocol on real data).
    grid: [(field, [values])]: one task per combination; fields appear in the workdir name.
    fixed: [(field, value)]: passed to every task, not in the workdir name (e.g. data.root).
    python: the interpreter of the command lines.
    check_fields: check that every field exists in each algorithm's config.
    orders: stored task orders (`config.task_order`: a name, index or '<suite>/<name>'); ()
      keeps each config's own order.
    seed_fields: config fields each seed sets; default ['sequence_seed'] without orders,
      ['seeds.data', 'seeds.retrieval'] with orders (module docstring).
    configs_dir: a folder of `<algorithm>.py` config files (each with `get_config(arg)`) used
      instead of the repository's configs/; the commands name its files.
    config_arg: a further `get_config` argument of every config, e.g. 'builtin2' (version 2
      of the built-in benchmark): `--config=configs/<algorithm>.py:builtin2`.
    label: with one algorithm, the runs' name (`--config.experiment_name=<label>`, a report's
      row, e.g. 'swil+wise_ft(0.5)') and their workdirs' head (`workdir_head`) instead of the
      algorithm's; '' keeps the config's own.

  Returns:
    [Task] of len(algorithms) * max(1, len(orders)) * len(seeds) * prod(len(values)).

  Raises:
    ValueError: an unknown algorithm (the message lists the known ones), no algorithms or
      seeds, an unknown order, a repeated field, a field missing from the config, or two tasks
      with the same workdir.
  """
  known = known_algorithms(configs_dir)
  unknown = [a for a in algorithms if a not in known]
  if unknown:
    raise ValueError(f"unknown algorithm(s) {unknown}; known: {', '.join(known)}")
  if not algorithms or not seeds:
    raise ValueError("a sweep needs at least one algorithm and one seed.")
  if label and len(algorithms) != 1:
    raise ValueError(f"a label ({label!r}) names the runs of one algorithm, got {algorithms}")
  if seed_fields is None:
    seed_fields = ["seeds.data", "seeds.retrieval"] if orders else ["sequence_seed"]
  if not seed_fields:
    raise ValueError("--seed-fields: at least one field.")
  if orders:
    from owl_cl.data import orders as orders_lib  # pylint: disable=g-import-not-at-top

    for order in orders:
      if problem := orders_lib.task_order_problem(order):
        raise ValueError(f"--orders: {order!r} {problem}")
  seed_set = list(seed_fields) + (["task_order"] if orders else [])
  named = [("experiment_name", label)] if label else []
  fields = [f for f, _ in grid] + [f for f, _ in list(fixed) + named] + seed_set

  arg = _config_arg(paper, config_arg)

  def config_path(algorithm: str) -> str:
    return os.path.join(configs_dir or "configs", f"{algorithm}.py")

  repeated = sorted({f for f in fields if fields.count(f) > 1})
  if repeated:
    raise ValueError(
      f"field(s) {repeated} given more than once ({', '.join(seed_set)} set by the sweep)."
    )
  if check_fields:
    for algorithm in dict.fromkeys(algorithms):
      try:
        config = _load_config(algorithm, paper, configs_dir, config_arg)
      except ValueError as e:  # an unknown config argument
        raise ValueError(f"--config-arg={config_arg!r}: {e}") from None
      for field in fields:
        _check_field(config, field, f"{config_path(algorithm)}{':' + arg if arg else ''}")
  tasks, workdirs = [], set()
  grid_fields = [f for f, _ in grid]
  for algorithm, order, seed in itertools.product(algorithms, list(orders) or [None], seeds):
    for values in itertools.product(*[list(v) for _, v in grid]):
      pairs = tuple(zip(grid_fields, values))
      head = workdir_head(label) if label else algorithm
      head = head if order is None else f"{head}_{_name_part('', order)[1:]}"
      name = "_".join([f"{head}_seed{int(seed)}"] + [_name_part(f, v) for f, v in pairs])
      workdir = os.path.join(root, name)
      if workdir in workdirs:
        raise ValueError(
          f"two tasks share the workdir {workdir!r}; give distinct algorithms, seeds and values."
        )
      workdirs.add(workdir)
      argv = [
        python,
        "-m",
        "owl_cl.main",
        f"--config={config_path(algorithm)}{':' + arg if arg else ''}",
        f"--workdir={workdir}",
      ]
      if order is not None:
        argv.append(f"--config.task_order={order}")
      argv += [f"--config.{f}={int(seed)}" for f in seed_fields]
      argv += [f"--config.{f}={v}" for f, v in list(pairs) + list(fixed) + named]
      group = int(seed) if set(MODEL_SEED_FIELDS) & set(seed_fields) else None
      tasks.append(Task(algorithm, int(seed), pairs, workdir, tuple(argv), order, group))
  return tasks


def is_complete(workdir: str) -> bool:
  """Whether `<workdir>/results.json` says the run is complete (status 'complete'); an
  unreadable or missing file is not complete (its command resumes or restarts the run)."""
  try:
    with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
      return json.load(f).get("status") == "complete"
  except (OSError, ValueError, AttributeError):
    return False


def _log_path(task: Task) -> str:
  root = os.path.dirname(os.path.normpath(task.workdir))
  return os.path.join(root, "logs", os.path.basename(os.path.normpath(task.workdir)) + ".log")


def run_tasks(
  tasks: Sequence[Task],
  processes: int = 1,
  *,
  poll_seconds: float = 1.0,
  keep_going: bool = False,
  clock=time.monotonic,
  on_end: Callable[[Task, int], None] | None = None,
) -> int:
  """Runs the tasks here (cwd: the repository) in their order, skipping complete ones.

  Args:
    tasks: `build_sweep`'s tasks (a design's, in its priority order).
    processes: at most this many at once; 1 runs them one after another in this terminal.
      With more, each writes to `<root>/logs/<name>.log` (appended).
    poll_seconds: how often running tasks are checked.
    keep_going: after a failure, go on starting the other tasks (a long unattended sweep);
      default: no new task starts after it (running ones finish).
    clock: seconds, for the progress lines (tests pass a fake).
    on_end: called as `on_end(task, exit_status)` as soon as each task ends, before the next
      starts (`launch/sweep_design.py` copies a complete run's results there, so a sweep
      killed later keeps every run that ended).

  The first pending task of each `cache_group` (it fills the group's cache: the pre-trained
  model, the buffer) runs before the group's others start, beside other groups' tasks; with
  one group (the model shared) it runs alone. A task starts when a process is free, in order,
  skipping those whose group's first task has not ended. After each task, a progress line on
  stderr: tasks ended, failed, the rate over this invocation and the estimated time left.

  Returns:
    0, or the exit status of the first task that failed.

  Raises:
    ValueError: processes < 1.
  """
  if processes < 1:
    raise ValueError(f"--processes must be >= 1, got {processes}")
  pending = []
  for task in tasks:
    if is_complete(task.workdir):
      print(f"# complete, skipped: {task.workdir}", file=sys.stderr, flush=True)
    else:
      pending.append(task)
  total, begin = len(pending), clock()
  first_of = {}  # cache group -> its first pending task (filling its cache)
  for task in pending:
    first_of.setdefault(task.cache_group, task)
  filled: set[int | None] = set()

  def start(task: Task, n: int) -> subprocess.Popen:
    print(f"# [{n}/{total}] {task.workdir}", file=sys.stderr, flush=True)
    if processes == 1:
      return subprocess.Popen(list(task.argv), cwd=REPO)
    os.makedirs(os.path.dirname(_log_path(task)), exist_ok=True)
    with open(_log_path(task), "ab") as log:
      return subprocess.Popen(list(task.argv), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

  running: list[tuple[Task, subprocess.Popen]] = []
  failed = started = ended = failures = 0
  while (pending and not (failed and not keep_going)) or running:
    while len(running) < processes and not (failed and not keep_going):
      ready = [t for t in pending if t.cache_group in filled or first_of[t.cache_group] is t]
      if not ready:
        break
      pending.remove(ready[0])
      started += 1
      running.append((ready[0], start(ready[0], started)))
    finished = [(t, p) for t, p in running if p.poll() is not None]
    if not finished:
      time.sleep(poll_seconds)
      continue
    for task, proc in finished:
      running.remove((task, proc))
      filled.add(task.cache_group)
      ended += 1
      if proc.returncode:
        where = "" if processes == 1 else f" (log: {_log_path(task)})"
        print(f"# failed with status {proc.returncode}: {task.command}{where}", file=sys.stderr)
        failed = failed or proc.returncode
        failures += 1
      if on_end is not None:
        on_end(task, proc.returncode)
      print(f"# {progress_line(ended, total, failures, clock() - begin)}", file=sys.stderr)
  return failed


def progress_line(ended: int, total: int, failures: int, elapsed_s: float) -> str:
  """'12/228 ended (1 failed), 14.2 runs/h, about 15.2 h left' (the rate: tasks ended per hour
  of this invocation; the time left: the tasks not ended at that rate)."""
  rate = 3600.0 * ended / elapsed_s if elapsed_s > 0 else math.inf
  left = (total - ended) / rate * 3600.0 if rate > 0 else math.inf
  when = "done" if ended == total else f"about {format_duration(left)} left"
  return f"{ended}/{total} ended ({failures} failed), {rate:.1f} runs/h, {when}"


def format_duration(seconds: float) -> str:
  """'45 s', '12 min', '3.4 h'."""
  if not math.isfinite(seconds):
    return "unknown time"
  if seconds < 90:
    return f"{seconds:.0f} s"
  if seconds < 5400:
    return f"{seconds / 60:.0f} min"
  return f"{seconds / 3600:.1f} h"


def write_task_file(path: str, tasks: Sequence[Task]) -> None:
  """Writes one command per line (atomically). An existing file with the same contents is
  left as is; one with other contents is refused (FileExistsError naming it)."""
  text = "".join(t.command + "\n" for t in tasks)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if f.read() == text:
        return
    raise FileExistsError(
      f"{path} exists with other commands; remove it or choose another "
      "--task-file (a running array job may still read it)."
    )
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
  """Command line (module docstring). Returns the exit status."""
  parser = argparse.ArgumentParser(
    prog="launch/sweep.py",
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n", 2)[2],
  )
  parser.add_argument(
    "--algorithms", required=True, help=f"comma-separated, of: {', '.join(known_algorithms())}"
  )
  parser.add_argument("--seeds", default="0", help="comma-separated seeds (0)")
  parser.add_argument("--orders", default="", help="comma-separated stored task orders")
  parser.add_argument(
    "--seed-fields",
    help="config fields each seed sets (default sequence_seed; with --orders "
    "seeds.data,seeds.retrieval)",
  )
  parser.add_argument(
    "--processes", type=int, default=1, help="with --run: runs at once (first alone)"
  )
  parser.add_argument("--root", default="workdirs/sweep", help="parent of the workdirs")
  parser.add_argument("--paper", action="store_true", help="configs/<algorithm>.py:paper")
  parser.add_argument(
    "--config-arg",
    default="",
    help="a get_config argument of every config, e.g. builtin2 (configs/<algorithm>.py:builtin2)",
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=V1,V2",
    help="grid over a config field (repeatable)",
  )
  parser.add_argument(
    "--fixed",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="config override for every task, not in the workdir name",
  )
  parser.add_argument("--python", default="python", help="interpreter in the commands")
  parser.add_argument("--configs-dir", help="folder of <algorithm>.py configs (default configs/)")
  parser.add_argument("--task-file", help="write the commands here for slurm_gpu.sbatch")
  parser.add_argument(
    "--dry-run",
    dest="dry_run",
    action="store_true",
    default=True,
    help="print the commands only (default)",
  )
  parser.add_argument(
    "--run", dest="dry_run", action="store_false", help="run the commands here, one after another"
  )
  args = parser.parse_args(argv)
  try:
    seeds = [int(s) for s in split_values(args.seeds)]
  except ValueError:
    parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
  try:
    tasks = build_sweep(
      split_values(args.algorithms),
      seeds,
      root=args.root,
      paper=args.paper,
      config_arg=args.config_arg,
      grid=[parse_assignment(s, multiple=True) for s in args.set],
      fixed=[(f, v[0]) for f, v in (parse_assignment(s, multiple=False) for s in args.fixed)],
      python=args.python,
      orders=split_values(args.orders) if args.orders else (),
      seed_fields=split_values(args.seed_fields) if args.seed_fields else None,
      configs_dir=args.configs_dir,
    )
  except ValueError as e:
    parser.error(str(e))
  if args.processes < 1:
    parser.error(f"--processes must be >= 1, got {args.processes}")
  for task in tasks:
    print(task.command)
  if args.task_file:
    write_task_file(args.task_file, tasks)
    print(
      f"# {len(tasks)} tasks in {args.task_file}; submit with: sbatch --array=0-"
      f"{len(tasks) - 1} launch/slurm_gpu.sbatch {args.task_file}",
      file=sys.stderr,
    )
  if not args.dry_run:
    return run_tasks(tasks, args.processes)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

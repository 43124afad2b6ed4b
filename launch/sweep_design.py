r"""One command for a committed sweep: its runs, the copy of their results, and its report.

    python launch/sweep_design.py round2 [--run] [--root=workdirs/sweep_round2] \
        [--processes=2] [--report-only] [--interim] [--allow-code-change] \
        [--smoke --cache-dir=DIR]

DESIGN is a design of `launch/designs.py` (`builtin`: the first committed sweep, `round2`:
docs/design_round2.md). Without `--run` (or `--report-only`) it prints the design's line (rows,
runs, planning estimate of the time) and its commands, and runs nothing.

`--run`: every run of the design in its priority order (`designs.run_order`), `--processes` at a
time (`launch/sweep.py`'s `run_tasks`): complete runs are skipped (a complete workdir in the root,
or a complete copy in `<out>/runs/`: a committed run), an interrupted one resumes, the first run of
each model seed runs before that seed's others (it pre-trains the model and fills the buffer they
share), a failed run does not stop the others, and a line after each run gives the rate and the time
left. The runs of a cell (`cell_of`: one pre-trained model and one order, the runs a paired
comparison pairs) are copied (step 1) together as soon as the cell's last run ends, so a sweep
killed at any point has every whole cell in `<out>/runs/` and no part of one: commit that folder,
and the same command on another machine or checkout runs only the rest (a sweep longer than one
sitting), each cell on one machine. Before any run it refuses (exit 2) when the code a run executes
(`run_code_paths`) differs from the commit a copied run records, so the runs of one design all ran
one code (`--allow-code-change` overrides); a copied run recorded with a dirty tree, or made on
another CPU or with other package versions (its `environment.json`), is named in a warning, and so
is a model seed whose copied runs hold two pre-trained models (their stage-0 metrics differ: a model
rebuilt elsewhere), at the start and as soon as a run shows it. Then, as with `--report-only`:

1. the results.json of each run of a complete cell is copied to `<out>/runs/<workdir name>/`
   (atomically; checkpoints and records stay in the root), with `environment.json` beside it
   (`environment()`: the CPU model and flags, Python and package versions of the machine that
   copies it, the one that ran it, as the workdir is local), so the report is reproduced from
   committed files alone; an identical copy is left as it is;
2. `python -m owl_cl.report <out>/runs --reference R [--plan P] --order <rows>`: report.md,
   report.json and the figures in `<out>` (rows with runs, in the design's order), and the
   same report of each order's runs in `<out>/by_order/<order>/` (the order effect; with
   two orders or more);
3. factor 3: `owl_cl.analysis.protection` of the copied runs (`<out>/protection.md`) and/or
   `owl_cl.analysis.interference` of the root's records (`<out>/interference.md`), as the
   design says.

Steps 2-3 of a design with an analysis plan wait for every planned run: its confirmatory
claims are stated for the design's n, so with runs missing nothing is written (a line says
how many), unless `--interim` asks for an exploratory report without the plan in
`<out>/interim/` (to check a long sweep's runs as it goes, not to commit).

`--smoke`: the same at tiny size (`owl_cl.testing.configs.tiny_config`): the design's first-run
row and its first composed row (`smoke_design`), model seed 0, the stored order `reversed`,
configs written to `<root>/configs/`, the report in `<root>/report` unless `--out` is given,
no analysis plan. The exit status is the first failure's (a run's, or 2 from a report).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import configparser
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time

LAUNCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(LAUNCH)
for _path in (REPO, LAUNCH):  # `python launch/sweep_design.py` from anywhere: a checkout
  if _path not in sys.path:
    sys.path.insert(0, _path)

import designs  # noqa: E402 (after the checkout joins sys.path)
import sweep  # noqa: E402

from owl_cl.analysis import interference  # noqa: E402
from owl_cl.analysis import protection  # noqa: E402
from owl_cl.analysis import report as report_lib  # noqa: E402
from owl_cl.testing import reproduction  # noqa: E402

RUNS = "runs"
INTERIM = "interim"  # the folder of `--interim`'s report (`<out>/interim`)
ENVIRONMENT = "environment.json"
# The package and its requirements: what a run executes, less `run_code_paths`' exclusions.
CODE_PATHS = ("owl_cl", "setup.py")
IMPORT_LAYERS = os.path.join(REPO, ".importlinter")
# The distributions whose versions a copied run's environment.json records besides the
# fingerprint's jax, jaxlib and numpy (the numerics and the scoring).
PACKAGES = ("flax", "optax", "scipy", "pycocotools", "lvis")
# Environment entries that do not decide a run's bits (the kernel's version string).
NOT_COMPARED = ("platform",)
SMOKE_ORDER = "reversed"  # a stored order of the tiny configs' two-dataset benchmark
SMOKE_CONFIG = """# A tiny config of `launch/sweep_design.py --smoke` (owl_cl.testing.configs).
from owl_cl.testing.configs import tiny_config


def get_config(arg=""):
  del arg  # the tiny configs are version 1 of the built-in benchmark at the tiny budget
  return tiny_config({name!r}, {cache!r})
"""


@dataclasses.dataclass(frozen=True)
class Planned:
  """One run of a design: its row and its `sweep.Task`."""

  row: designs.Row
  task: sweep.Task

  @property
  def name(self) -> str:
    """Its workdir's name (also its folder in `<out>/runs/`)."""
    return os.path.basename(os.path.normpath(self.task.workdir))


def plan_runs(
  design: designs.Design, root: str, *, python: str = "python", configs_dir: str | None = None
) -> list[Planned]:
  """The design's runs in priority order (`designs.run_order`), as `launch/sweep.py` tasks.

  Raises:
    ValueError: from `sweep.build_sweep` (an unknown config, order or field).
  """
  by_run = {}
  for row in design.rows:
    tasks = sweep.build_sweep(
      [row.config],
      design.seeds,
      root=root,
      fixed=row.overrides,
      python=python,
      orders=design.orders,
      seed_fields=design.seed_fields,
      configs_dir=configs_dir,
      config_arg=design.config_arg,
      label="" if row.name == row.config else row.name,
    )
    for task in tasks:
      by_run[(row.name, task.seed, task.order)] = Planned(row, task)
  return [by_run[(row.name, seed, order)] for row, seed, order in designs.run_order(design)]


def environment() -> dict:
  """The machine and packages of this process: `owl_cl.testing.reproduction.fingerprint()`
  (what decides a run's bits besides its code and config: the CPU model and a digest of its
  flags, the core count, XLA_FLAGS, jax, jaxlib, numpy), the platform, Python and the
  versions of `PACKAGES` ('packages': {name: version or None})."""
  packages = {}
  for name in PACKAGES:
    try:
      packages[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      packages[name] = None
  return {
    **reproduction.fingerprint(),
    "platform": platform.platform(),
    "python": platform.python_version(),
    "packages": packages,
  }


def _write_atomically(path: str, write) -> None:
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    write(f)
  os.replace(path + ".tmp", path)


def copy_result(p: Planned, out: str) -> bool:
  """Copies the run's results.json to `<out>/runs/<name>/` when its workdir is complete
  (through a temporary file and a rename: a copy is whole or absent), with `ENVIRONMENT`
  beside it (`environment()`, and the UTC time of the copy). A copy equal to the workdir's
  is left as it is, with its environment. Returns whether the run has a copy now."""
  if not sweep.is_complete(p.task.workdir):
    return committed(p, out)  # an incomplete run stays in the root, where running resumes it
  folder = os.path.join(out, RUNS, p.name)
  source, target = (
    os.path.join(p.task.workdir, "results.json"),
    os.path.join(folder, "results.json"),
  )
  with open(source, "rb") as f:
    data = f.read()
  if os.path.isfile(target):
    with open(target, "rb") as f:
      if f.read() == data:
        return True
  os.makedirs(folder, exist_ok=True)
  record = {**environment(), "copied_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  _write_atomically(os.path.join(folder, ENVIRONMENT), lambda f: json.dump(record, f, indent=1))
  shutil.copyfile(source, target + ".tmp")
  os.replace(target + ".tmp", target)
  return True


def cell_of(p: Planned) -> tuple:
  """The run's cell: (cache group, order), the runs of one pre-trained model and one task
  order, which a paired comparison pairs."""
  return (p.task.cache_group, p.task.order)


def copy_results(planned: Sequence[Planned], out: str) -> int:
  """`copy_result` of every run of each cell of `planned` whose runs are all complete (in the
  root or already copied); a cell with a run missing is not copied at all, so that no cell's
  runs come from two machines. Returns how many planned runs have a copy."""
  cells: dict[tuple, list[Planned]] = {}
  for p in planned:
    cells.setdefault(cell_of(p), []).append(p)
  for members in cells.values():
    if all(sweep.is_complete(p.task.workdir) or committed(p, out) for p in members):
      for p in members:
        copy_result(p, out)
  return sum(committed(p, out) for p in planned)


def _copied(p: Planned, out: str, name: str) -> dict | None:
  try:
    with open(os.path.join(out, RUNS, p.name, name), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def committed(p: Planned, out: str) -> bool:
  """Whether `<out>/runs/<name>/results.json` is a complete run's (a committed run: the
  sweep does not run it again; delete the folder to run it again)."""
  record = _copied(p, out, "results.json")
  return isinstance(record, dict) and record.get("status") == "complete"


def run_code_paths(layers_file: str = IMPORT_LAYERS) -> tuple[str, ...]:
  """The git pathspecs of the code `python -m owl_cl.main` executes: `CODE_PATHS`, less the
  modules that the import layers (`layers_file`, checked by lint-imports in CI) put in main's
  layer (independent of main) or above it: `report`, `analysis` and `testing` today, so a
  change of the report alone leaves a sweep's runs comparable.

  Raises:
    ValueError: the layers contract names no `main`.
  """
  parser = configparser.ConfigParser()
  parser.read(layers_file, encoding="utf-8")
  text = parser["importlinter:contract:layers"]["layers"]
  # One layer a line, top first; independent modules of one layer separated by '|'.
  rows = [[m.strip() for m in line.split("|")] for line in text.strip().splitlines()]
  top = next((i for i, row in enumerate(rows) if "main" in row), None)
  if top is None:
    raise ValueError(f"{layers_file}: no layer holds main")
  package = CODE_PATHS[0]
  above = [m for row in rows[: top + 1] for m in row if m != "main"]
  excluded = []
  for module in above:
    path = f"{package}/{module}"
    path = path if os.path.isdir(os.path.join(REPO, path)) else f"{path}.py"
    excluded.append(f":(exclude){path}")
  return (*CODE_PATHS, *excluded)


def code_changes(commit: str | None, repo: str = REPO, other: str | None = None) -> list[str] | str:
  """The files of `run_code_paths` that differ between `commit` and the commit `other` (None:
  the working tree of the checkout `repo`) (`git diff --name-only`), or a sentence saying why
  they cannot be compared."""
  if not commit:
    return "its commit is not recorded"
  try:
    done = subprocess.run(
      [
        "git",
        "-C",
        repo,
        "diff",
        "--name-only",
        commit,
        *([other] if other else []),
        "--",
        *run_code_paths(),
      ],
      capture_output=True,
      text=True,
      timeout=60,
      check=False,
    )
  except (OSError, subprocess.SubprocessError) as e:
    return f"git could not run ({type(e).__name__})"
  if done.returncode != 0:
    return f"git diff failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
  return done.stdout.split()


def check_committed(
  planned: Sequence[Planned], out: str, repo: str = REPO
) -> tuple[list[str], list[str]]:
  """(refusals, warnings) about the copied runs a sweep goes on from. Refused: a recorded
  commit whose run code (`run_code_paths`) differs from the working tree's, or that cannot
  be compared (not recorded, not in this checkout's history). Warned: a commit recorded
  with a dirty tree (any tracked file changed, `owl_cl.eval.provenance`), and a copy whose
  environment (`environment()`: CPU model and flags, XLA_FLAGS, package versions) differs
  from this machine's."""
  refusals, warnings, commits, machines, here = [], [], {}, {}, environment()
  for p in planned:
    record = _copied(p, out, "results.json") if committed(p, out) else None
    if record is None:
      continue
    key = (record.get("commit"), bool(record.get("dirty")))
    commits.setdefault(key, []).append(p.name)
    env = _copied(p, out, ENVIRONMENT) or {}
    differ = tuple(k for k in here if k not in NOT_COMPARED and env.get(k) != here[k])
    if differ:  # one line per other machine, not per run
      other = json.dumps({k: env.get(k) for k in differ}, sort_keys=True)
      machines.setdefault((differ, other), []).append(p.name)
  for (differ, other), names in machines.items():
    warnings.append(
      f"{len(names)} copied run(s) (e.g. {names[0]}) ran with another {' and '.join(differ)}: "
      f"{other} (here: {json.dumps({k: here[k] for k in differ}, sort_keys=True)})"
    )
  for (commit, dirty), names in commits.items():
    changes = code_changes(commit, repo)
    where = f"{len(names)} copied run(s) (e.g. {names[0]}) of commit {commit}"
    if isinstance(changes, str):
      refusals.append(f"{where}: the code cannot be compared ({changes})")
    elif changes:
      refusals.append(f"{where}: the package code differs here: {', '.join(changes)}")
    elif dirty:  # a tracked file differed from the commit: perhaps only a doc, so a warning
      warnings.append(f"{where} recorded a dirty tree: its code may differ from the commit's")
  return refusals, warnings


def pretrained_fingerprint(record: dict) -> str | None:
  """A digest of a run's stage-0 metrics (`results.json`: the pre-trained model evaluated on
  every set before any training), equal for every run of one pre-trained model whatever its
  order or algorithm; None without a stage."""
  stages = record.get("stages") or []
  if not stages:
    return None
  text = json.dumps(stages[0].get("metrics"), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_mismatches(planned: Sequence[Planned], out: str) -> list[str]:
  """One line per cache group (model seed) whose copied runs hold more than one pre-trained
  model (`pretrained_fingerprint`): a model rebuilt on another machine, whose arithmetic
  differs, so that the group's pairs would mix two models."""
  groups: dict[object, dict[str, list[str]]] = {}
  for p in planned:
    record = _copied(p, out, "results.json") if committed(p, out) else None
    digest = pretrained_fingerprint(record) if record else None
    if digest:
      groups.setdefault(p.task.cache_group, {}).setdefault(digest, []).append(p.name)
  return [
    f"the copied runs of model seed {group} hold {len(found)} different pre-trained models "
    "(their stage-0 metrics differ): "
    + "; ".join(f"{len(names)} like {names[0]}" for names in found.values())
    for group, found in groups.items()
    if len(found) > 1
  ]


def rebuilt_model(p: Planned, planned: Sequence[Planned], out: str) -> str | None:
  """A line when the run `p` just ended (its workdir's results) has another pre-trained model
  than the copied runs of its model seed (`pretrained_fingerprint`), else None."""
  try:
    with open(os.path.join(p.task.workdir, "results.json"), encoding="utf-8") as f:
      digest = pretrained_fingerprint(json.load(f))
  except (OSError, ValueError):
    return None
  group = [q for q in planned if q.task.cache_group == p.task.cache_group and q is not p]
  copied = {pretrained_fingerprint(_copied(q, out, "results.json") or {}) for q in group}
  copied.discard(None)
  if digest is None or not copied or digest in copied:
    return None
  return (
    f"{p.name}'s pre-trained model differs from the copied runs' of model seed "
    f"{p.task.cache_group} (their stage-0 metrics differ: rebuilt on another machine); each "
    "cell stays on one model, the model seed now names two"
  )


def _first_failure(*statuses: int) -> int:
  return next((s for s in statuses if s), 0)


def write_reports(
  design: designs.Design, planned: Sequence[Planned], root: str, out: str, into: str | None = None
) -> int:
  """The design's report of the runs copied to `<out>/runs` (module docstring, steps 2-3),
  written into `into` (default `out`). Returns 0 or the first non-zero status of the reports
  (2: `report.ReportError`)."""
  runs, out = os.path.join(out, RUNS), into or out
  have = [p for p in planned if os.path.isfile(os.path.join(runs, p.name, "results.json"))]

  def options(among: Sequence[Planned]) -> list[str]:  # the rows with runs, in the design's order
    rows = {p.row.name for p in among}
    order = ",".join(r.name for r in design.rows if r.name in rows)
    return ["--reference", design.reference, "--order", order]

  plan = ["--plan", design.plan] if design.plan else []
  status = report_lib.main([runs, *options(have), *plan, "--out", out])
  for task_order in design.orders if len(design.orders) > 1 else ():
    mine = [p for p in have if p.task.order == task_order]
    if mine:  # the order's own report: no plan (the plan's n is the whole design's)
      dirs = sorted({os.path.join(runs, p.name) for p in mine})
      folder = os.path.join(out, "by_order", task_order)
      status = _first_failure(status, report_lib.main([*dirs, *options(mine), "--out", folder]))
  if design.protection:
    argv = [runs, "--out", os.path.join(out, "protection.md")]
    status = _first_failure(status, protection.main(argv))
  if design.interference:
    argv = [root, "--out", os.path.join(out, "interference.md")]
    status = _first_failure(status, interference.main(argv))
  return status


def smoke_design(design: designs.Design, out: str) -> designs.Design:
  """`design` at tiny size: its first-run row (the reference) and its first composed row
  (replay with WiSE-FT, `designs.COMPOSED`); model seed 0, order `SMOKE_ORDER`, no plan."""
  composed = [designs.row_name(c, a) for c, a in designs.COMPOSED]
  names = {*design.first_rows[:1], *composed[:1]}
  return dataclasses.replace(
    design,
    name=f"{design.name}_smoke",
    rows=tuple(r for r in design.rows if r.name in names),
    seeds=(0,),
    orders=(SMOKE_ORDER,),
    config_arg="",
    out=out,
    plan=None,
    interference=False,
    protection=False,
  )


def write_smoke_configs(design: designs.Design, folder: str, cache_dir: str) -> None:
  """A tiny config file per config of the design's rows in `folder` (cache: `cache_dir`)."""
  os.makedirs(folder, exist_ok=True)
  for config in dict.fromkeys(r.config for r in design.rows):
    text = SMOKE_CONFIG.format(name=config, cache=os.path.abspath(cache_dir))
    with open(os.path.join(folder, f"{config}.py"), "w", encoding="utf-8") as f:
      f.write(text)


def _place(given: str | None, default: str) -> str:
  """A folder of the command: `given` (relative to the current folder) or the design's
  `default` (relative to the repository), as a path relative to the repository when the
  current folder is the repository (the runs start there; report.json names the runs by it),
  else absolute."""
  here = os.path.abspath(os.getcwd()) == REPO
  if given:
    return given if here or os.path.isabs(given) else os.path.abspath(given)
  return default if here or os.path.isabs(default) else os.path.join(REPO, default)


def refuse_to_go_on(planned: Sequence[Planned], out: str, allow: bool) -> bool:
  """Prints `check_committed`'s warnings and refusals (stderr); whether to refuse (any
  refusal, unless `allow`)."""
  refusals, warnings = check_committed(planned, out)
  warnings += model_mismatches(planned, out)
  for line in warnings:
    print(f"# warning: {line}", file=sys.stderr)
  for line in refusals:
    print(f"error: {line}", file=sys.stderr)
  if refusals and not allow:
    print(
      "error: the sweep would go on from copied runs of other code; nothing run "
      "(--allow-code-change goes on anyway)",
      file=sys.stderr,
    )
  return bool(refusals) and not allow


def run_design(design: designs.Design, planned: Sequence[Planned], out: str, processes: int) -> int:
  """Runs the planned runs that have no complete copy in `<out>/runs`, copying each cell as its
  last run ends (module docstring, `--run`). Returns `sweep.run_tasks`' status."""
  todo = [p for p in planned if not committed(p, out)]
  if len(todo) < len(planned):
    hours = designs.estimate_seconds(design, len(todo)) / 3600.0
    print(
      f"# {len(planned) - len(todo)} of {len(planned)} runs already copied to "
      f"{os.path.join(out, RUNS)} (skipped); {len(todo)} to run, estimate {hours:.1f} h",
      file=sys.stderr,
      flush=True,
    )
  by_workdir, warned = {p.task.workdir: p for p in todo}, set()

  def on_end(task: sweep.Task, exit_status: int) -> None:
    if exit_status:
      return
    p = by_workdir[task.workdir]
    line = rebuilt_model(p, planned, out)
    if line and p.task.cache_group not in warned:  # once per model seed
      print(f"# warning: {line}", file=sys.stderr, flush=True)
      warned.add(p.task.cache_group)
    copy_results([q for q in planned if cell_of(q) == cell_of(p)], out)

  return sweep.run_tasks([p.task for p in todo], processes, keep_going=True, on_end=on_end)


def main(argv: Sequence[str] | None = None) -> int:
  """Command line (module docstring). Returns the exit status."""
  parser = argparse.ArgumentParser(
    prog="launch/sweep_design.py",
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n", 2)[2],
  )
  parser.add_argument("design", choices=sorted(designs.DESIGNS), help="the design to run")
  parser.add_argument("--root", help="parent of the workdirs (default the design's)")
  parser.add_argument("--out", help="report folder (default the design's)")
  parser.add_argument("--processes", type=int, default=2, help="runs at once (2)")
  parser.add_argument("--python", default=sys.executable, help="interpreter of the runs")
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--run", action="store_true", help="run, copy and report")
  mode.add_argument("--report-only", action="store_true", help="copy and report, no runs")
  parser.add_argument("--smoke", action="store_true", help="tiny size (module docstring)")
  parser.add_argument("--cache-dir", help="with --smoke: the tiny runs' cache folder")
  parser.add_argument(
    "--interim",
    action="store_true",
    help="a design with an analysis plan and runs missing: write an exploratory report "
    "without the plan into <out>/interim (default: no report until every run is copied)",
  )
  parser.add_argument(
    "--allow-code-change",
    action="store_true",
    help="go on from copied runs whose commit's package code differs from this checkout's",
  )
  args = parser.parse_args(argv)
  if args.processes < 1:
    parser.error(f"--processes must be >= 1, got {args.processes}")
  if args.cache_dir and not args.smoke:
    parser.error("--cache-dir is for --smoke (a design's runs use their configs' cache_dir)")
  design, configs_dir = designs.DESIGNS[args.design], None
  root = _place(args.root, design.root)
  if args.smoke:
    design = smoke_design(design, _place(args.out, os.path.join(root, "report")))
    configs_dir = os.path.join(root, "configs")
    write_smoke_configs(design, configs_dir, args.cache_dir or os.path.join(root, "cache"))
  out = _place(args.out, design.out)
  try:
    planned = plan_runs(design, root, python=args.python, configs_dir=configs_dir)
  except ValueError as e:
    parser.error(str(e))
  print(f"# {designs.summary(design)}", file=sys.stderr, flush=True)
  if not (args.run or args.report_only):
    for p in planned:
      print(p.task.command)
    return 0
  status = 0
  if args.run:
    if refuse_to_go_on(planned, out, args.allow_code_change):
      return 2
    status = run_design(design, planned, out, args.processes)
  copied = copy_results(planned, out)
  print(f"# {copied} complete runs copied to {os.path.join(out, RUNS)}", file=sys.stderr)
  into = None
  if design.plan and copied < len(planned):
    # The plan's confirmatory claims are about every run of the design (its n, its power): a
    # report of part of them would state them at another n, after looking at the data.
    if not args.interim:
      print(
        f"# {len(planned) - copied} of {len(planned)} runs not copied yet: the report of the "
        f"analysis plan {design.plan!r} waits for every run; nothing written (--interim: an "
        f"exploratory report without the plan in {os.path.join(out, INTERIM)})",
        file=sys.stderr,
      )
      return status
    design, into = dataclasses.replace(design, plan=None), os.path.join(out, INTERIM)
  return _first_failure(status, write_reports(design, planned, root, out, into))


if __name__ == "__main__":
  raise SystemExit(main())

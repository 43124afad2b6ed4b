r"""One command for a committed sweep: its runs, the copy of their results, and its report.

    python launch/sweep_design.py round2 [--run] [--root=workdirs/sweep_round2] \
        [--processes=2] [--report-only] [--smoke --cache-dir=DIR]

DESIGN is a design of `launch/designs.py` (`builtin`: the first committed sweep, `round2`:
docs/design_round2.md). Without `--run` (or `--report-only`) it prints the design's line (rows,
runs, planning estimate of the time) and its commands, and runs nothing.

`--run`: every run of the design in its priority order (`designs.run_order`), `--processes` at
a time (`launch/sweep.py`'s `run_tasks`): complete runs are skipped, an interrupted one
resumes, the first run of each model seed runs before that seed's others (it pre-trains the
model and fills the buffer they share), a failed run does not stop the others, and a line
after each run gives the rate and the time left. Then, as with `--report-only`:

1. each complete run's results.json is copied to `<out>/runs/<workdir name>/` (atomically;
   checkpoints and records stay in the root), so the report is reproduced from committed
   files alone;
2. `python -m owl_cl.report <out>/runs --reference R [--plan P] --order <rows>`: report.md,
   report.json and the figures in `<out>` (rows with runs, in the design's order), and the
   same report of each order's runs in `<out>/by_order/<order>/` (the order effect; with
   two orders or more);
3. factor 3: `owl_cl.analysis.protection` of the copied runs (`<out>/protection.md`) and/or
   `owl_cl.analysis.interference` of the root's records (`<out>/interference.md`), as the
   design says.

`--smoke`: the same at tiny size (`owl_cl.testing.configs.tiny_config`): the design's first-run
row and its first composed row (`smoke_design`), model seed 0, the stored order `reversed`,
configs written to `<root>/configs/`, the report in `<root>/report` unless `--out` is given,
no analysis plan. The exit status is the first failure's (a run's, or 2 from a report).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import dataclasses
import os
import shutil
import sys

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

RUNS = "runs"
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


def copy_results(planned: Sequence[Planned], out: str) -> int:
  """Copies each complete run's results.json to `<out>/runs/<name>/results.json` (through a
  temporary file and a rename: a copy is whole or absent). Returns how many were copied."""
  copied = 0
  for p in planned:
    if not sweep.is_complete(p.task.workdir):
      continue  # an incomplete run stays in the root, where running again resumes it
    folder = os.path.join(out, RUNS, p.name)
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "results.json")
    shutil.copyfile(os.path.join(p.task.workdir, "results.json"), target + ".tmp")
    os.replace(target + ".tmp", target)
    copied += 1
  return copied


def _first_failure(*statuses: int) -> int:
  return next((s for s in statuses if s), 0)


def write_reports(design: designs.Design, planned: Sequence[Planned], root: str, out: str) -> int:
  """The design's report of the runs copied to `<out>/runs` (module docstring, steps 2-3).
  Returns 0 or the first non-zero status of the reports (2: `report.ReportError`)."""
  have = [p for p in planned if os.path.isfile(os.path.join(out, RUNS, p.name, "results.json"))]
  rows = {p.row.name for p in have}
  order = ",".join(r.name for r in design.rows if r.name in rows)
  options = ["--reference", design.reference, "--order", order]
  options += ["--plan", design.plan] if design.plan else []
  status = report_lib.main([os.path.join(out, RUNS), *options, "--out", out])
  for task_order in design.orders if len(design.orders) > 1 else ():
    dirs = sorted({os.path.join(out, RUNS, p.name) for p in have if p.task.order == task_order})
    if dirs:  # the order's own report: no plan (the plan's n is the whole design's)
      folder = os.path.join(out, "by_order", task_order)
      status = _first_failure(status, report_lib.main([*dirs, *options[:4], "--out", folder]))
  if design.protection:
    argv = [os.path.join(out, RUNS), "--out", os.path.join(out, "protection.md")]
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
    status = sweep.run_tasks([p.task for p in planned], args.processes, keep_going=True)
  copied = copy_results(planned, out)
  print(f"# {copied} complete runs copied to {os.path.join(out, RUNS)}", file=sys.stderr)
  return _first_failure(status, write_reports(design, planned, root, out))


if __name__ == "__main__":
  raise SystemExit(main())

"""Host-cost benchmark: CPU time, kernel time and page faults of the main job.

Runs `python -m owl_cl.main --config=configs/swil.py` (the command a new user runs first) in a
subprocess, with a private cache folder and workdir under a temporary folder, and reads the
child's resource usage from `os.wait4` (what `/usr/bin/time -v` prints): user and system CPU
seconds, wall seconds, peak RSS, minor and major page faults, voluntary and involuntary
context switches. Beside them: the machine, the 1-minute load average before and after (on a
shared machine the wall time means little; the CPU times and the faults depend much less on
the load), the commit, and a digest of the run's `results.json` metrics, so that rows of
different commits show whether the results are identical. The main job runs the built-in
benchmark version 2 since 3f85287; the committed rows of earlier commits ran version 1, the
default then (docs/host_cost.md).

Two modes: `--cache empty` (default: the first run of a fresh clone: it generates the built-in
benchmark, pre-trains, builds the buffer, trains over the sequence, evaluates) and `--cache
warm` (a first run fills the cache untimed, then the timed run loads the pre-trained model and
the buffer: the per-step costs dominate; `--cache-dir DIR`: an existing cache folder, no
filling run). Any `--config.*` override after `--` is passed on,
e.g. `-- --config.pretrain.num_steps=60` for a shorter stand-in.

Every run is appended as a row to `<out>/<name>.json` (rows of earlier runs kept, so a
before and an after row come from the same script) and the table `<out>/<name>.md` is
rewritten from all rows.

Usage:
  python benchmarks/host.py --label before [--cache empty|warm] [--out benchmarks/results]
    [--name host] [--smoke] [-- --config.field=value ...]

`--smoke`: the tiny budget of the tests (owl_cl.testing.configs.tiny_budget, seconds of CPU),
written to `host_smoke.*` so it never overwrites a real result.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from owl_cl import utils  # noqa: E402

CONFIG = "configs/swil.py"
# The smoke run's config: configs/swil.py with the tests' tiny budget (a config file, since
# the model's size overrides are not fields of configs/swil.py).
SMOKE_CONFIG = """from owl_cl.testing import configs


def get_config(arg=""):
  c = configs.load_config("swil", ",".join(p for p in (configs.TINY_ARG, arg) if p))
  c.compilation_cache_dir = ""
  return configs.tiny_budget(c)
"""


def commit() -> str:
  """`git describe`-like: the HEAD commit's short hash, '+dirty' when the tree has changes."""
  try:
    head = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      cwd=REPO,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def metrics_digest(results_path: str) -> str:
  """sha256 (first 16 hex digits) of `results.json` without its run id, config and timings.

  Only what a run computes enters: every field except those that differ between identical
  runs (the run id, the config with its folders, the step timings, wall times, dates, paths).
  """
  with open(results_path) as f:
    results = json.load(f)
  skip = ("run_id", "config", "timings", "created_at", "updated_at")
  results = {k: v for k, v in results.items() if k not in skip}

  def strip(x):
    if isinstance(x, dict):
      return {
        k: strip(v)
        for k, v in sorted(x.items())
        if not any(t in k.lower() for t in ("time", "seconds", "date", "dir", "path", "host"))
      }
    if isinstance(x, list):
      return [strip(v) for v in x]
    return x

  text = json.dumps(strip(results), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_main(
  workdir: str, cache_dir: str, overrides: list[str], env: dict, config: str = CONFIG
) -> dict:
  """The main job in a subprocess; its resource usage from `os.wait4` (units in the keys)."""
  cmd = [
    sys.executable,
    "-m",
    "owl_cl.main",
    f"--config={config}",
    f"--workdir={workdir}",
    f"--config.cache_dir={cache_dir}",
    *overrides,
  ]
  log_path = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log")
  load_before = os.getloadavg()[0]
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
  wall = time.perf_counter() - start
  code = os.waitstatus_to_exitcode(status)
  if code:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"the main job failed (exit status {code}): {' '.join(cmd)}\n{tail}")
  return dict(
    user_s=usage.ru_utime,
    sys_s=usage.ru_stime,
    wall_s=wall,
    max_rss_mib=usage.ru_maxrss / 1024,  # Linux: KiB
    minor_faults=usage.ru_minflt,
    major_faults=usage.ru_majflt,
    voluntary_switches=usage.ru_nvcsw,
    involuntary_switches=usage.ru_nivcsw,
    load_before=load_before,
    load_after=os.getloadavg()[0],
    metrics_digest=metrics_digest(os.path.join(workdir, "results.json")),
  )


def measure(
  cache: str,
  overrides: list[str],
  keep: str | None,
  cache_dir: str | None,
  smoke: bool,
  config: str = CONFIG,
) -> dict:
  """One timed run of the main job: 'empty' cache, or 'warm' after an untimed filling run
  (`cache_dir`: an existing cache folder instead, filled by an earlier run of the same
  overrides, so no filling run)."""
  env = dict(os.environ, PYTHONPATH=REPO)
  # With `keep`, the runs' folders (workdirs with results.json, logs) stay there.
  context = tempfile.TemporaryDirectory(prefix="host-bench-", dir=keep)
  if keep:
    os.makedirs(keep, exist_ok=True)
    context = contextlib.nullcontext(tempfile.mkdtemp(prefix="host-bench-", dir=keep))
  with context as tmp:
    if smoke:
      config = os.path.join(tmp, "smoke_config.py")
      with open(config, "w") as f:
        f.write(SMOKE_CONFIG)
    if cache_dir:
      return run_main(os.path.join(tmp, "run"), cache_dir, overrides, env, config)
    cache_dir = os.path.join(tmp, "cache")
    if cache == "warm":
      run_main(os.path.join(tmp, "fill"), cache_dir, overrides, env, config)
    return run_main(os.path.join(tmp, "run"), cache_dir, overrides, env, config)


def machine() -> dict:
  return {
    "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
    "cpu": utils.cpu_model(),
    "python": platform.python_version(),
  }


def render_markdown(rows: list[dict]) -> str:
  lines = [
    "# Host cost of the main job",
    "",
    "`python -m owl_cl.main --config=<config>` in a subprocess, resource usage from `os.wait4` "
    "(as `/usr/bin/time -v`). The load is the 1-minute load average before / after the run: "
    "on a loaded machine compare user, sys and faults, not wall.",
    "",
    "| label | commit | config | cache | overrides | user s | sys s | wall s | max RSS MiB | "
    "minor faults | load | metrics digest | date |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['label']} | {r['commit']} | `{r['config']}` | {r['cache']} | "
      f"{' '.join(r['overrides']) or '-'} | "
      f"{r['user_s']:.1f} | {r['sys_s']:.1f} | {r['wall_s']:.0f} | {r['max_rss_mib']:.0f} | "
      f"{r['minor_faults']:,} | {r['load_before']:.1f} / {r['load_after']:.1f} | "
      f"{r['metrics_digest']} | {r['date']} |"
    )
  machines = sorted({f"{r['machine']['machine']}, {r['machine']['cpu']}" for r in rows})
  lines += ["", "Machines: " + "; ".join(machines) + "."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--label", required=True, help="the row's name, e.g. 'before'")
  parser.add_argument("--cache", choices=("empty", "warm"), default="empty")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--name", default=None, help="file stem (default host[_smoke])")
  parser.add_argument(
    "--cache-dir", default=None, help="an existing cache folder (warm, no filling run)"
  )
  parser.add_argument(
    "--keep",
    default=None,
    help="keep the runs' folders under KEEP (default: a temporary folder, removed)",
  )
  parser.add_argument(
    "--commit", default=None, help="the row's commit (default: this checkout's, from git)"
  )
  parser.add_argument("--smoke", action="store_true", help="the tests' tiny budget (seconds)")
  parser.add_argument(
    "--config",
    default=CONFIG,
    help=f"the main job's --config (default {CONFIG}; e.g. {CONFIG}:builtin1)",
  )
  parser.add_argument("overrides", nargs="*", help="--config.* overrides of the main job")
  args = parser.parse_args(argv)
  name = args.name or ("host_smoke" if args.smoke else "host")
  overrides = list(args.overrides)
  row = dict(
    label=args.label,
    commit=args.commit or commit(),
    cache="warm" if args.cache_dir else args.cache,
    config="tiny (smoke)" if args.smoke else args.config,
    overrides=list(args.overrides),
    machine=machine(),
    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
  )
  row.update(measure(args.cache, overrides, args.keep, args.cache_dir, args.smoke, args.config))
  stem = os.path.join(args.out, name)
  rows = []
  if os.path.exists(stem + ".json"):
    with open(stem + ".json") as f:
      rows = json.load(f)["rows"]
  rows.append(row)
  os.makedirs(args.out, exist_ok=True)
  utils.write_report(stem, {"rows": rows}, render_markdown(rows), indent=1)
  return row


if __name__ == "__main__":
  main()

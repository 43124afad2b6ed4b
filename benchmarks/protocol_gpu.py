"""The dress rehearsal of the main job at real size (issue 48 item 2): per-phase costs of a run.

Runs `python -m owl_cl.main --config=configs/<algorithm>.py:rehearsal` (the paper's model and
step on the built-in benchmark: `configs/base.py` `apply_rehearsal`) in a child process, with
random L/14 weights written by the HF converter (`owl_cl.model.convert.hf.save_hf_checkpoint`)
and given as `init_checkpoint`, so the converter's read path runs too. The child wraps the
run's phases with timers (nothing in the library changes) and writes them out; this script
then reads them with the run's results.json and writes `<out>/protocol_gpu.{json,md}`
(`protocol_gpu_smoke.*` with `--smoke`), per phase:

* wall seconds, images and images/s;
* compile seconds (JAX's compile events: tracing, lowering and XLA compilation);
* host RSS at the phase's end and the process's peak (VmRSS, VmHWM);
* for training: the step's median, and the fraction of step time the device waited for the
  host (`host_idle`, owl_cl.train.timing) and for the next new batch (`input`);
* for evaluation: the time in COCO / LVIS scoring (`coco_eval.coco_evaluate`,
  `lvis_eval.lvis_evaluate`) and the rest (the model's forward passes, the input pipeline and
  the detections' conversion), per set;
* for checkpoints: write time, restore time (each written checkpoint is read back at once
  into trees of the same shapes) and size on disk, for the stage checkpoints (parameters +
  replay state) and the step checkpoint at each dataset's last step (the whole train state,
  Adam moments included: `checkpoint.every_steps` is set above the steps of a dataset).

Usage:
  python benchmarks/protocol_gpu.py                 # on a GPU: the rehearsal at its sizes
  python benchmarks/protocol_gpu.py --smoke --out D  # the tiny model on CPU (CI)
  options: --algorithm swil, --workdir DIR (default: a temporary folder, removed), --override
  config.field=value (repeatable; e.g. --override=config.data.builtin.num_pretrain_train=3000)

Nothing is asserted; issue 48 item 3 extrapolates the paper's protocol from these figures
(docs/benchmarks.md, "The paper's protocol, extrapolated").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")

# The smoke run: the tiny model at its own size, float32, a few images per set.
SMOKE_OVERRIDES = (
  "config.model.variant=tiny",
  "config.model.dtype=float32",
  "config.model.remat=none",
  "config.data.num_queries=8",
  "config.data.num_negatives=4",
  "config.data.max_instances=4",
  "config.data.eval_batch_size=8",
  "config.train.batch_size=4",
  "config.data.builtin.num_pretrain_train=40",
  "config.data.builtin.num_pretrain_val=8",
  "config.data.builtin.num_held_out_val=8",
  "config.data.builtin.num_tail_val=8",
  "config.data.builtin.num_downstream_train=8",
  "config.data.builtin.num_downstream_test=8",
  "config.replay.selection.min_per_class=2",
  "config.data.validate_images=false",
)
# Every run: a step checkpoint at each dataset's last step only (every_steps above any
# dataset's steps), none by the clock.
RUN_OVERRIDES = ("config.checkpoint.every_steps=100000",)

# ------------------------------------------------------------------------------ the child


class _Recorder:
  """Open phase records (a stack) and the finished ones; compile events go to every open one.
  Each finished record is written to `path` at once (a run killed later keeps it)."""

  def __init__(self, path: str):
    self.path = path
    self.open: list[dict] = []
    self.done: list[dict] = []
    self.start = time.perf_counter()

  def write(self) -> None:
    wall = time.perf_counter() - self.start
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"records": self.done, "wall_s": wall, **_rss()}, f)
    os.replace(tmp, self.path)

  @contextlib.contextmanager
  def phase(self, kind: str, name: str):
    record = {"kind": kind, "name": name, "compile_s": 0.0, "scoring_s": 0.0}
    self.open.append(record)
    t0 = time.perf_counter()
    try:
      yield record
    finally:
      record["wall_s"] = time.perf_counter() - t0
      record.update(_rss())
      self.open.remove(record)
      self.done.append(record)
      self.write()

  def compile_event(self, event: str, duration: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
      for record in self.open:
        record["compile_s"] += duration

  def add_scoring(self, seconds: float) -> None:
    if self.open:
      self.open[-1]["scoring_s"] += seconds


def _rss() -> dict:
  """The process's resident set now and at its peak, in MB (/proc/self/status)."""
  out = {}
  try:
    with open("/proc/self/status") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
          out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = int(value.split()[0]) / 1024
  except OSError:
    pass
  return out


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _install(rec: _Recorder) -> None:
  """Wraps the run's phase functions with `rec`'s timers (the library is not changed)."""
  import jax  # noqa: PLC0415

  from owl_cl import experiment  # noqa: PLC0415
  from owl_cl import trainer  # noqa: PLC0415
  from owl_cl.detector import Detector  # noqa: PLC0415
  from owl_cl.eval import coco_eval  # noqa: PLC0415
  from owl_cl.eval import lvis_eval  # noqa: PLC0415
  from owl_cl.replay import setup as replay_setup  # noqa: PLC0415
  from owl_cl.train import checkpointing  # noqa: PLC0415

  jax.monitoring.register_event_duration_secs_listener(rec.compile_event)

  def timed(kind, name_of):
    def wrap(fn):
      @functools.wraps(fn)
      def inner(*args, **kwargs):
        with rec.phase(kind, name_of(*args, **kwargs)) as record:
          out = fn(*args, **kwargs)
          if kind == "eval" and isinstance(out, dict):
            record["images"] = out.get("num_images")
          return out

      return inner

    return wrap

  def scoring(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
      t0 = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        rec.add_scoring(time.perf_counter() - t0)

    return inner

  def checkpoint(kind, restore):
    def wrap(save):
      @functools.wraps(save)
      def inner(self, *args, **kwargs):
        with rec.phase(kind, f"{kind} {args[0]}") as record:
          save(self, *args, **kwargs)
        t0 = time.perf_counter()
        restore(self, *args)
        record["restore_s"] = time.perf_counter() - t0
        record["bytes"] = _dir_bytes(self.directory)

      return inner

    return wrap

  experiment.read_init_checkpoint = timed("init", lambda *a, **k: "init_checkpoint (HF)")(
    experiment.read_init_checkpoint
  )
  replay_setup.build_store = timed("buffer", lambda *a, **k: "buffer build")(
    replay_setup.build_store
  )
  trainer.train_on_dataset = timed("train", lambda det, ds, *a, **k: f"train {ds.name}")(
    trainer.train_on_dataset
  )
  Detector.evaluate_dataset = timed("eval", lambda self, p, ds, desc, **k: desc)(
    Detector.evaluate_dataset
  )
  coco_eval.coco_evaluate = scoring(coco_eval.coco_evaluate)
  lvis_eval.lvis_evaluate = scoring(lvis_eval.lvis_evaluate)
  # Each checkpoint is read back at once into trees of the same shapes: its restore time.
  checkpointing.StageCheckpointer.save = checkpoint(
    "stage_checkpoint",
    lambda self, stage, params, replay, meta: self.restore(stage, params, replay),
  )(checkpointing.StageCheckpointer.save)
  checkpointing.StepCheckpointer.save = checkpoint(
    "step_checkpoint", lambda self, phase, step, items, meta: self.restore(phase, step, items)
  )(checkpointing.StepCheckpointer.save)


def child(records_path: str, main_argv: list[str]) -> None:
  """Runs owl_cl.main with `main_argv` under the timers; writes the records (JSON) at exit."""
  from absl import app  # noqa: PLC0415

  rec = _Recorder(records_path)
  _install(rec)
  from owl_cl import main as main_lib  # noqa: PLC0415

  sys.argv = ["owl_cl.main", *main_argv]
  status = 0
  try:
    app.run(main_lib.main, flags_parser=main_lib.parse_flags)
  except SystemExit as e:
    status = e.code or 0
  finally:
    rec.write()
  sys.exit(status)


# ------------------------------------------------------------------------------ the parent


def write_init_checkpoint(config, path: str) -> dict:
  """Random weights of the run's model (seed 0) written in HF's layout by the converter."""
  import jax  # noqa: PLC0415

  from owl_cl.detector import Detector  # noqa: PLC0415
  from owl_cl.model.convert import hf  # noqa: PLC0415
  from owl_cl.model.convert import tree  # noqa: PLC0415

  t0 = time.perf_counter()
  detector = Detector(config)
  params = jax.device_get(detector.init_params(0))
  init_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  hf.save_hf_checkpoint(params, path, tree.infer_model_config(params))
  return {"init_s": init_s, "write_s": time.perf_counter() - t0, "bytes": _dir_bytes(path)}


def _config(algorithm: str, overrides: list[str]):
  """The run's config as owl_cl.main builds it: the algorithm's file at ':rehearsal' and the
  overrides (`config.a.b=value`, parsed as the command line parses them)."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  # ml_collections reads the overrides from sys.argv when --config is parsed (as in main).
  holder = config_flags.DEFINE_config_file("config")
  argv = [sys.argv[0], f"--config={ROOT}/configs/{algorithm}.py:rehearsal"]
  argv += [f"--{o}" for o in overrides]
  saved, sys.argv = sys.argv, argv
  try:
    flags.FLAGS(argv)
  finally:
    sys.argv = saved
  return holder.value


def summarize(records: list[dict], results: dict, config) -> list[dict]:
  """The per-phase rows: the child's records joined with results.json's step timings."""
  timings = (results.get("timings") or {}).get("step_timings") or {}
  images_per_step = config.train.batch_size * (1 + config.replay.ratio)
  rows = []
  for r in records:
    row = dict(r)
    if r["kind"] == "train":
      name = r["name"].removeprefix("train ")
      t = timings.get(name) or {}
      if t.get("steps"):
        mean = t["mean"]
        step = t["median"]["step_seconds"]
        row.update(
          steps=t["steps"],
          step_s=step,
          images_per_s=images_per_step / step if step else None,
          host_idle_fraction=t.get("host_idle_fraction"),
          input_fraction=mean["input"] / mean["step_seconds"] if mean["step_seconds"] else None,
        )
    elif r["kind"] == "eval" and r.get("images"):
      row["images_per_s"] = r["images"] / r["wall_s"]
      row["model_s"] = r["wall_s"] - r["scoring_s"]
    elif r["kind"] == "buffer":
      row["images"] = config.data.builtin.num_pretrain_train
      row["images_per_s"] = row["images"] / r["wall_s"]
    rows.append(row)
  return rows


def _f(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def render(report: dict) -> str:
  dev = report["device"]
  lines = [
    f"# The dress rehearsal ({report['mode']})",
    "",
    f"Device kind {dev['device_kind']!r} ({dev['device_count']} devices); nvidia-smi: "
    f"{dev['nvidia_smi']}; {report['date']}; commit {report['commit']}.",
    "",
    f"`python -m owl_cl.main {' '.join(report['main_argv'])}` (exit {report['exit_status']}), "
    f"{report['run_wall_s']:.0f} s in all; random weights written by the HF converter in "
    f"{report['init_checkpoint']['write_s']:.1f} s "
    f"({report['init_checkpoint']['bytes'] / 1e9:.2f} GB).",
    "",
    "| phase | wall s | compile s | images | images/s | step s | device waits: host / input "
    "| scoring s | model + input s | ckpt restore s | ckpt GB | RSS GB (peak) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in report["phases"]:
    wait = (
      f"{_f(r.get('host_idle_fraction'), '.1%')} / {_f(r.get('input_fraction'), '.1%')}"
      if "step_s" in r
      else "-"
    )
    lines.append(
      f"| {r['name']} | {r['wall_s']:.1f} | {r['compile_s']:.1f} | {_f(r.get('images'), 'd')} "
      f"| {_f(r.get('images_per_s'))} | {_f(r.get('step_s'), '.3f')} | {wait} "
      f"| {_f(r['scoring_s'] if r['kind'] == 'eval' else None)} | {_f(r.get('model_s'))} "
      f"| {_f(r.get('restore_s'), '.2f')} | {_f(r.get('bytes') and r['bytes'] / 1e9, '.2f')} "
      f"| {_f(r.get('rss_mb', 0) / 1024, '.2f')} ({_f(r.get('peak_rss_mb', 0) / 1024, '.2f')}) |"
    )
  return "\n".join(lines) + "\n"


def _commit() -> str:
  try:
    out = subprocess.run(
      ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"
  except OSError:
    return "unknown"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="the tiny model at tiny sizes (CI)")
  p.add_argument("--out", default=os.path.join(BENCHMARKS, "results"))
  p.add_argument("--algorithm", default="swil")
  p.add_argument("--workdir", default=None, help="default: a temporary folder, removed")
  p.add_argument("--override", action="append", default=[], help="config.field=value")
  p.add_argument(
    "--timeout",
    type=float,
    default=None,
    help="seconds for the whole script: the run is killed in time for the report to be written",
  )
  args = p.parse_args(argv)
  started = time.perf_counter()
  # This process writes the weights on the device and exits only after the run: it takes
  # what it uses, not JAX's default 75% of the device's memory, which the run needs. The run
  # gets the environment as it was.
  child_env = dict(os.environ)
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  sys.path.insert(0, ROOT)
  from owl_cl import utils  # noqa: PLC0415

  device_info = _load_device_info()
  owned = tempfile.mkdtemp(prefix="protocol_gpu_") if args.workdir is None else None
  base = args.workdir or owned
  os.makedirs(base, exist_ok=True)
  overrides = [*RUN_OVERRIDES, *(SMOKE_OVERRIDES if args.smoke else ()), *args.override] + [
    f"config.cache_dir={base}/cache",
    f"config.init_checkpoint={base}/init_hf",
  ]
  config = _config(args.algorithm, overrides)
  init = write_init_checkpoint(config, os.path.join(base, "init_hf"))
  main_argv = [f"--config=configs/{args.algorithm}.py:rehearsal"] + [f"--{o}" for o in overrides]
  main_argv.append(f"--workdir={base}/run")
  records_path = os.path.join(base, "records.json")
  cmd = [sys.executable, os.path.abspath(__file__), "--child", records_path, *main_argv]
  t0 = time.perf_counter()
  try:
    # What the budget leaves after the weights were written, less 10 s for the report.
    left = None if args.timeout is None else max(args.timeout - (t0 - started) - 10, 1)
    status = subprocess.run(cmd, cwd=ROOT, timeout=left, env=child_env).returncode
  except subprocess.TimeoutExpired:
    status = "killed at --timeout"
  run_wall = time.perf_counter() - t0
  child_out = {"records": []}
  if os.path.exists(records_path):
    with open(records_path) as f:
      child_out = json.load(f)
  results_path = os.path.join(base, "run", "results.json")
  results = {}
  if os.path.exists(results_path):
    with open(results_path) as f:
      results = json.load(f)
  report = {
    "mode": "smoke" if args.smoke else "full",
    "device": device_info.describe(),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "commit": _commit(),
    "main_argv": main_argv,
    "exit_status": status,
    "run_wall_s": run_wall,
    "init_checkpoint": init,
    "phases": summarize(child_out["records"], results, config),
    "buffer": results.get("buffer"),
    "child_peak_rss_mb": child_out.get("peak_rss_mb"),
  }
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "protocol_gpu_smoke" if args.smoke else "protocol_gpu")
  utils.write_report(stem, report, render(report), indent=2)
  if owned:
    shutil.rmtree(owned, ignore_errors=True)
  return report


def _load_device_info():
  import importlib.util  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location(
    "benchmark_device_info", os.path.join(BENCHMARKS, "device_info.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--child":
    sys.path.insert(0, ROOT)
    child(sys.argv[2], sys.argv[3:])
  else:
    main()

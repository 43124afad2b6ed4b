"""Scoring shared by the JAX processes of a multi-process run, against each scoring it all.

In a multi-process run every process holds the gathered detections of an evaluation set. Before
shared scoring each process scored the whole set; now each scores every P-th category
shard and the arrays are exchanged (`owl_cl.eval.category_shards.run`, collective). This times
both, each side in its own P processes joined by `jax.distributed.initialize` on a localhost
coordinator (CPU), on the synthetic Objects365 set of benchmarks/protocol_host.py (the same
generator and seed; `--images` of them):

  python benchmarks/scoring_hosts.py --hosts 2 --images 20000 \
    --coco-backend faster_coco_eval --out benchmarks/results/scoring_hosts
  python benchmarks/scoring_hosts.py --smoke --out D   # 60 images, 2 workers each (CI)

A side's time is its slowest process's: the processes go on in lockstep after an evaluation.
Each worker process scores with `--processes` workers (`eval.scoring_processes`); shards are
chosen by `category_shards.shard_count` (the same for both sides but for the hosts' factor,
recorded). Both sides' metrics must be equal in every process, to the bit (checked: the run
fails otherwise). Writes `<out>/scoring_hosts.{json,md}` with the machine, load, commit, date.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIDES = ("each_scores_all", "shared")
O365 = ("o365_val", 365, 100)  # name, classes, detections per image (protocol_host.Sizes)


def _worker(args) -> None:
  """One JAX process of one side: builds the set, times `coco_evaluate`, writes its record."""
  from owl_cl import distributed  # noqa: PLC0415

  distributed.initialize(
    distributed.cluster_spec(f"127.0.0.1:{args.port}", args.hosts, args.process_id),
    initialization_timeout_s=120,
  )
  import numpy as np  # noqa: PLC0415
  from pycocotools import coco as pycoco  # noqa: PLC0415

  from owl_cl.eval import coco_eval  # noqa: PLC0415
  from owl_cl.eval import peers  # noqa: PLC0415

  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import protocol_host  # noqa: PLC0415  (benchmarks/ is no package)

  name, classes, dets = O365
  gt, detections = protocol_host.synthetic_eval(
    name, args.images, classes, dets, np.random.default_rng(0)
  )
  ground = pycoco.COCO()
  ground.dataset = gt
  ground.createIndex()
  distributed.barrier("scoring-start", timeout_s=600)
  t0 = time.perf_counter()
  metrics = coco_eval.coco_evaluate(
    ground,
    detections,
    max_dets=dets,
    backend=args.coco_backend,
    processes=args.processes,
    peers=peers.jax_peers() if args.side == "shared" else None,
  )
  seconds = time.perf_counter() - t0
  distributed.barrier("scoring-end", timeout_s=600)
  record = {"seconds": seconds, "detections": len(detections), "metrics": metrics}
  with open(os.path.join(args.tmp, f"{args.side}_{args.process_id}.json"), "w") as f:
    json.dump(record, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _side(args, side: str) -> list[dict]:
  """Runs one side's `args.hosts` processes; their records, in process order.

  Raises:
    RuntimeError: a process failed (its output's end is in the message).
  """
  port = str(_free_port())
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
  procs = []
  for pid in range(args.hosts):
    command = [sys.executable, os.path.abspath(__file__), "--worker", f"--side={side}"]
    command += [f"--port={port}", f"--process-id={pid}", f"--tmp={args.tmp}"]
    command += [f"--hosts={args.hosts}", f"--images={args.images}"]
    command += [f"--processes={args.processes}", f"--coco-backend={args.coco_backend}"]
    procs.append(
      subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    )
  outputs = [proc.communicate()[0].decode(errors="replace") for proc in procs]
  for pid, (proc, output) in enumerate(zip(procs, outputs)):
    if proc.returncode:
      raise RuntimeError(f"{side}: process {pid} exited {proc.returncode}:\n{output[-3000:]}")
  records = []
  for pid in range(args.hosts):
    with open(os.path.join(args.tmp, f"{side}_{pid}.json")) as f:
      records.append(json.load(f))
  return records


def render(report: dict) -> str:
  s = report["sides"]
  lines = [
    "# Scoring shared by the processes of a multi-process run (benchmarks/scoring_hosts.py)",
    "",
    f"{report['cpu']} ({report['machine']}), commit {report['code']['commit'][:7]}"
    f"{' (dirty)' if report['code'].get('dirty') else ''}, {report['date']}, load "
    f"{report['load_before']:.2f} before, {report['load_after']:.2f} after.",
    f"Synthetic Objects365 set: {report['images']:,} images x {O365[2]} detections, "
    f"{O365[1]} classes, {report['coco_backend']}; {report['hosts']} JAX processes on this "
    f"machine, {report['processes']} scoring worker(s) each.",
    "",
    "| side | shards | seconds per process | side's time (slowest) |",
    "|---|---:|---|---:|",
  ]
  for side in SIDES:
    per = ", ".join(f"{x:.1f}" for x in s[side]["seconds"])
    lines.append(f"| {side} | {s[side]['shards']} | {per} | {s[side]['time']:.1f} s |")
  lines += [
    "",
    f"Ratio each_scores_all / shared: **{report['ratio']:.2f}x**. AP {report['AP']:.6f}; "
    "every metric equal on both sides and in every process: "
    f"{report['metrics_equal']}.",
  ]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "scoring_hosts"))
  p.add_argument("--hosts", type=int, default=2, help="JAX processes on this machine")
  p.add_argument("--images", type=int, default=20_000)
  p.add_argument("--processes", type=int, default=1, help="scoring workers per JAX process")
  p.add_argument(
    "--coco-backend", default="pycocotools", choices=("pycocotools", "faster_coco_eval")
  )
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
  p.add_argument("--port", help=argparse.SUPPRESS)
  p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
  p.add_argument("--tmp", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return _worker(args)
  if args.hosts < 2 or args.images < 1 or args.processes < 1:
    p.error("--hosts must be >= 2, --images and --processes >= 1")
  from owl_cl import utils  # noqa: PLC0415
  from owl_cl.eval import category_shards  # noqa: PLC0415
  from owl_cl.eval import provenance  # noqa: PLC0415

  if args.smoke:  # 2 workers each: the shared side's 4 shards are spawned and exchanged
    args.images, args.processes = 60, 2
  report = {
    "machine": f"{os.cpu_count()} logical CPUs",
    "cpu": utils.cpu_model(),
    "code": provenance.code_provenance(),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "load_before": os.getloadavg()[0],
    "hosts": args.hosts,
    "images": args.images,
    "processes": args.processes,
    "coco_backend": args.coco_backend,
    "sides": {},
  }
  texts = set()
  with tempfile.TemporaryDirectory(prefix="scoring_hosts_") as args.tmp:
    for side in SIDES:
      print(f"{side} ...", flush=True)
      records = _side(args, side)
      hosts = args.hosts if side == "shared" else 1
      report["sides"][side] = {
        "seconds": [r["seconds"] for r in records],
        "time": max(r["seconds"] for r in records),
        "shards": category_shards.shard_count(
          records[0]["detections"], O365[1], args.processes, None, hosts
        ),
      }
      texts.update(json.dumps(r["metrics"], sort_keys=True) for r in records)
  report["load_after"] = os.getloadavg()[0]
  report["metrics_equal"] = len(texts) == 1
  if not report["metrics_equal"]:
    raise RuntimeError(f"the sides' metrics differ: {sorted(texts)}")
  report["AP"] = json.loads(texts.pop())["AP"]
  s = report["sides"]
  report["ratio"] = s["each_scores_all"]["time"] / s["shared"]["time"]
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "scoring_hosts_smoke" if args.smoke else "scoring_hosts")
  utils.write_report(stem, report, render(report), indent=2)
  return report


if __name__ == "__main__":
  main()

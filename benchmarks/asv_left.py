"""ASER-PC's left term at scale: measured on this machine, projected to the paper's buffer.

Times `owl_cl.replay.retrieval.asv_left.compute_left_term` (what a run uses: jitted chunks of
evaluation images sharded over the mesh, each committed to a progress folder) on synthetic top-k
tokens (unit-norm random class and query embeddings, [N, k, E]; the time does not depend on their
values):

  * the whole left term of --num-images images (default 5,000: N*k = 40,000 tokens), chunks
    of --chunk images: the first chunk (compilation included), the median of the others,
    the total with the commits;
  * one chunk of --full-chunk images against the paper's whole buffer (--full-images 54,226:
    N*k = 433,808 candidate tokens), compiled by a first call, then the median of 3 calls.
    On CPU the KNN-SV's order comes from one NumPy sort at every size
    (`knn_shapley._host_sort_order`); with XLA's sort (other backends) it changes above
    46,340 candidate tokens from two packed int32 sorts to one stable two-operand sort
    (`knn_shapley._exact_sort_order`), so there the small run alone under-predicts.

Projection. All-to-all, each of the N*k evaluation tokens is scored against all N*k candidate
tokens (a distance, a sort and a scan of N*k entries), so
    T(N) = T(N0) * (N / N0)^2            (quadratic in N*k; the sort adds a log(N k) factor:
                                           x log(N k) / log(N0 k) as an upper bound)
on the same sort path; the direct estimate is T(N) = t_chunk(N, c) * ceil(N / c) from the
full-size chunk. On D devices every chunk's rows split D ways and the devices exchange only
the chunk's [N] sums and minima (psum / pmin, 8 bytes per image), so T_D = T_1 / D for D equal
devices (not measurable here: host devices share the same CPU cores).

Usage:
  nice -n 10 python benchmarks/asv_left.py [--num-images 5000] [--chunk 64] [--full-chunk 8]
    [--skip-full] [--out benchmarks/results] [--smoke]

Writes `<out>/asv_left.json` and `<out>/asv_left.md` (`--smoke`: tiny sizes, `asv_left_smoke.*`).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from owl_cl import utils  # noqa: E402
from owl_cl.replay.retrieval import asv_left  # noqa: E402
from owl_cl.replay.retrieval import knn_shapley  # noqa: E402
from owl_cl.train import sharding  # noqa: E402

PAPER_IMAGES = 54_226  # the released buffer (docs/reference.md §6)
PAPER_DEVICES = 8  # one node of 8 A100s (docs/reference.md §11)


def synthetic_tokens(n: int, k: int, e: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Unit-norm random class and query embeddings float32 [n, k, e] each."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(2):
    x = rng.standard_normal((n, k, e), dtype=np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    out.append(x)
  return out[0], out[1]


def _clocks() -> tuple[float, float]:
  """(wall, this process's CPU time over all its threads) in seconds."""
  return time.perf_counter(), time.process_time()


def run_whole(n: int, k: int, e: int, chunk: int, options: dict, mesh) -> dict:
  """The whole left term of n images; per-chunk wall and CPU times from the chunk hook.

  CPU time (all threads of this process) is reported besides wall time: on a machine shared
  with other jobs the wall time measures the contention as much as the computation.
  """
  class_tokens, query_embeddings = synthetic_tokens(n, k, e)
  stamps = [_clocks()]
  with tempfile.TemporaryDirectory() as folder:
    asv_left.compute_left_term(
      class_tokens,
      query_embeddings,
      options,
      mesh=mesh,
      chunk_size=chunk,
      folder=os.path.join(folder, "left.build"),
      chunk_hook=lambda c: stamps.append(_clocks()),
    )
    end = _clocks()
  wall, cpu = (np.diff([s[i] for s in stamps]) for i in (0, 1))
  median = lambda x: float(statistics.median(x[1:])) if len(x) > 1 else float(x[0])
  return dict(
    images=n,
    tokens=n * k,
    chunk=chunk,
    chunks=len(wall),
    first_chunk_s=float(wall[0]),
    median_chunk_s=median(wall),
    compile_s=float(wall[0]) - median(wall),
    total_s=end[0] - stamps[0][0],
    steady_total_s=median(wall) * len(wall),
    median_chunk_cpu_s=median(cpu),
    total_cpu_s=end[1] - stamps[0][1],
    steady_total_cpu_s=median(cpu) * len(cpu),
  )


def run_full_chunk(
  n: int, k: int, e: int, chunk: int, options: dict, mesh, repeats: int = 3
) -> dict:
  """One chunk of `chunk` evaluation images against all n images: compiled by a first call,
  then the median of `repeats` calls on the next chunks (wall and CPU time)."""
  class_tokens, query_embeddings = synthetic_tokens(n, k, e, seed=1)
  tokens = sharding.replicate(class_tokens, mesh)
  queries = sharding.replicate(query_embeddings, mesh)
  del class_tokens, query_embeddings
  function = asv_left.chunk_function(mesh, n, chunk, options)
  stamps = [_clocks()]
  for i in range(1 + repeats):
    jax.block_until_ready(function(np.int32(i * chunk), tokens, queries))
    stamps.append(_clocks())
  wall, cpu = (np.diff([s[i] for s in stamps]) for i in (0, 1))
  chunk_s = float(statistics.median(wall[1:]))
  return dict(
    images=n,
    tokens=n * k,
    chunk=chunk,
    repeats=repeats,
    first_chunk_s=float(wall[0]),
    chunk_s=chunk_s,
    chunk_cpu_s=float(statistics.median(cpu[1:])),
    compile_s=float(wall[0]) - chunk_s,
    sort=sort_path(n * k),
  )


def sort_path(candidate_tokens: int) -> str:
  """The sort that orders the KNN-SV's candidates on this backend (`knn_shapley._sort_order`)."""
  if jax.default_backend() == "cpu":
    return "host NumPy"
  if candidate_tokens > knn_shapley.PACKED_SORT_MAX_CANDIDATES:
    return "stable two-operand"
  return "packed int32"


def projections(whole: dict, full: dict | None, k: int, clock: str = "") -> dict:
  """Projected single-device and 8-device times of the paper's buffer (module docstring), from
  the wall times (`clock` '') or the CPU times ('cpu')."""
  suffix = f"_{clock}_s" if clock else "_s"
  ratio = PAPER_IMAGES / whole["images"]
  quadratic = whole["steady_total" + suffix] * ratio**2
  log_factor = math.log(PAPER_IMAGES * k) / math.log(whole["tokens"])
  out = dict(
    from_small_quadratic_s=quadratic,
    from_small_quadratic_log_s=quadratic * log_factor,
    log_factor=log_factor,
  )
  if full is not None:
    # t_chunk grows linearly with the candidates: scaled when the chunk was not of the paper's N.
    out["from_full_chunk_s"] = (
      full["chunk" + suffix]
      * math.ceil(PAPER_IMAGES / full["chunk"])
      * PAPER_IMAGES
      / full["images"]
    )
  for name in list(out):
    if name.endswith("_s"):
      out[f"{name[:-2]}_{PAPER_DEVICES}_devices_s"] = out[name] / PAPER_DEVICES
  return out


def _hours(seconds: float) -> str:
  if seconds < 60:
    return f"{seconds:.1f} s"
  return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def render_markdown(report: dict) -> str:
  """The results as a Markdown table (wall time and CPU time side by side)."""
  w, f = report["whole"], report.get("full_chunk")
  p, q = report["projection"], report["projection_cpu"]
  lines = [
    f"Device: {report['device']} x {report['devices']} ({report['backend']}), JAX "
    f"{report['jax_version']}, {report['cpu_count']} CPU cores (load "
    f"average {report['load_average']:.1f} at the start, {report['load_average_end']:.1f} at "
    f"the end); k={report['k']}, E={report['embed']}, K={report['knn_k']}, all-to-all, L2. "
    "CPU = this process's CPU time over all its threads.",
    "",
    "| What | wall | CPU |",
    "|---|---|---|",
    f"| N={w['images']:,} (N*k={w['tokens']:,}): first of {w['chunks']} chunks of {w['chunk']} "
    f"images (compile {w['compile_s']:.1f} s) | {w['first_chunk_s']:.1f} s | - |",
    f"| N={w['images']:,}: median chunk | {w['median_chunk_s']:.2f} s "
    f"| {w['median_chunk_cpu_s']:.2f} s |",
    f"| N={w['images']:,}: whole left term, with compile and commits | {_hours(w['total_s'])} "
    f"| {_hours(w['total_cpu_s'])} |",
  ]
  if f is not None:
    lines.append(
      f"| N={f['images']:,} (N*k={f['tokens']:,}, {f['sort']} sort): one chunk of {f['chunk']} "
      f"images, median of {f['repeats']} (compile {f['compile_s']:.1f} s) | {f['chunk_s']:.1f} s "
      f"| {f['chunk_cpu_s']:.1f} s |"
    )
  rows = [
    ("from_small_quadratic", f"(N/{w['images']:,})^2 x {w['chunks']} median chunks"),
    ("from_small_quadratic_log", f"same x log(N k) ratio {p['log_factor']:.2f}"),
  ]
  if f is not None:
    rows.append(("from_full_chunk", f"full-size chunk x {math.ceil(PAPER_IMAGES / f['chunk'])}"))
  for devices in (1, PAPER_DEVICES):
    for name, label in rows:
      key = f"{name}_s" if devices == 1 else f"{name}_{PAPER_DEVICES}_devices_s"
      lines.append(
        f"| projection, N={PAPER_IMAGES:,}, {devices} device{'s' * (devices > 1)}: {label}"
        f"{f' / {devices}' if devices > 1 else ''} | {_hours(p[key])} | {_hours(q[key])} |"
      )
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-images", type=int, default=5000)
  parser.add_argument("--chunk", type=int, default=64, help="images per chunk (config 64)")
  parser.add_argument("--k", type=int, default=8, help="top-k tokens per image")
  parser.add_argument("--embed", type=int, default=768, help="embedding width E (L/14 768)")
  parser.add_argument("--knn-k", type=int, default=20, help="K of the KNN-SV (paper 20)")
  parser.add_argument("--full-images", type=int, default=PAPER_IMAGES)
  parser.add_argument("--full-chunk", type=int, default=8)
  parser.add_argument("--skip-full", action="store_true")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="40 images of 2 tokens (E 8, K 3) in chunks of 8, one chunk of 4 against 60 "
    "(seconds; tests, CI); writes asv_left_smoke.*",
  )
  args = parser.parse_args(argv)
  if args.smoke:
    args.num_images, args.chunk, args.k, args.embed, args.knn_k = 40, 8, 2, 8, 3
    args.full_images, args.full_chunk = 60, 4
  mesh = sharding.create_mesh()
  options = asv_left.left_term_options(args.knn_k)
  load = os.getloadavg()[0]
  print(f"devices: {jax.devices()}; load average {load:.1f}", flush=True)
  whole = run_whole(args.num_images, args.k, args.embed, args.chunk, options, mesh)
  print(whole, flush=True)
  full = None
  if not args.skip_full:
    full = run_full_chunk(args.full_images, args.k, args.embed, args.full_chunk, options, mesh)
    print(full, flush=True)
  device = jax.devices()[0]
  report = dict(
    device=getattr(device, "device_kind", str(device)),
    devices=jax.device_count(),
    backend=jax.default_backend(),
    jax_version=jax.__version__,
    host=platform.node(),
    cpu_count=os.cpu_count(),
    load_average=load,
    k=args.k,
    embed=args.embed,
    knn_k=args.knn_k,
    options=options,
    whole=whole,
    full_chunk=full,
    projection=projections(whole, full, args.k),
    projection_cpu=projections(whole, full, args.k, "cpu"),
    load_average_end=os.getloadavg()[0],
  )
  stem = os.path.join(args.out, "asv_left_smoke" if args.smoke else "asv_left")
  utils.write_report(stem, report, render_markdown(report), indent=2)
  return report


if __name__ == "__main__":
  main()

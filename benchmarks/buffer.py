"""Replay-buffer build benchmark: peak memory, throughput and store size of the streaming builder.

Builds the replay store (`owl_cl.replay.build.build_store`: three streaming passes, chunked and
resumable, docs/reference.md §6) over synthetic pre-training sets of several sizes (default 20k
and 200k images) with the tiny model at a small resolution, each size in a fresh subprocess,
and reports per size:

  * peak RSS of the build's process (`ru_maxrss` of the child, from `os.wait4`): the claim
    is that host memory does not grow with the pre-training set, so the 200k build's peak
    should stay within 1.25x of the 20k build's;
  * images/s: of pass 1 (every image: preprocessing + forward + loss, timed between its first
    and last chunk commits, so compilation is excluded) and of the whole build (wall time);
  * store bytes per kept image (all files of the store folder / kept images).

The synthetic source draws each image from its index (no files): a noise background with 1-3
rectangles of class colours, 20 classes. The model has random weights (the selection's losses
are then arbitrary but the work is the same): the threshold keeps no image and the per-class
minimum tops every class up to `--keep-fraction` x N / C images; an image holds about two
classes, so the default 0.18 keeps about 9% of the images (the paper's 54k of 600k).

The paper projection (no measurement): bytes per buffer image of the store, features + logits
(bfloat16 DER++ logits [T, Q], top-k class and query embeddings [k, E] float32, membership [C]
and prototype distances [C]) and the examples without pixels (queries, targets, image id and
source index: the images are kept by reference), and of the optional uint8 image cache on
local disk (`replay.image_cache`, at most S x S x 3 per image), for OWL-ViT L/14 at 840 px with
the paper's settings (configs/base.py 'paper', Objects365: C = 365), times 54,226 images. The
forward passes of the Objects365 build are projected as FLOPs (pass 1 over every image,
passes 2 and 3 over the kept ones) from the step benchmark's eval-forward FLOPs per image
(benchmarks/results/step.json); a time is projected only when that file holds a measured
eval-forward throughput (`eval_forward_images_per_s`), which a CPU-only run does not.

Usage:
  python benchmarks/buffer.py [--sizes 20000,200000] [--batch-size 64] [--keep-fraction 0.18]
  [--out benchmarks/results] [--render-only] [--smoke]

Writes `<out>/buffer.json` and `<out>/buffer.md` (`--smoke`: one 64-image build, `buffer_smoke.*`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from owl_cl import utils  # noqa: E402
from owl_cl.configs import base  # noqa: E402
from owl_cl.detector import Detector  # noqa: E402
from owl_cl.model import owl_vit  # noqa: E402
from owl_cl.replay import build as build_lib  # noqa: E402
from owl_cl.replay import setup as replay_setup  # noqa: E402
from owl_cl.testing.configs import tiny_config  # noqa: E402

NUM_CLASSES = 20
IMAGE_SIZE = 32
CHUNK_IMAGES = 1024
# The paper's buffer (docs/reference.md §6, §11) and Objects365 v2's training images.
PAPER_BUFFER_IMAGES = 54_226
OBJECTS365_IMAGES = 1_742_289
OBJECTS365_CLASSES = 365


class SyntheticSource:
  """`num_images` small images drawn from their index (a pre-training source without files).

  `load(i)` -> dict(image uint8 [side, side, 3], boxes float32 [m, 4] xyxy pixels, labels int32
  [m] in [0, num_classes), image_id i), m in 1..3; `targets(i)` the same without the image.
  """

  def __init__(self, num_images: int, num_classes: int = NUM_CLASSES, side: int = IMAGE_SIZE):
    self.num_images, self.num_classes, self.side = num_images, num_classes, side
    self.class_names = [f"thing{c}" for c in range(num_classes)]
    self.annotation_file = f"synthetic:{num_images}:{num_classes}:{side}"
    self.colours = np.random.default_rng(0).integers(0, 256, (num_classes, 3), dtype=np.uint8)

  def __len__(self) -> int:
    return self.num_images

  def targets(self, index: int) -> dict:
    rng = np.random.default_rng([7, index])
    m = int(rng.integers(1, 4))
    corners = rng.integers(0, self.side, (m, 2, 2))
    lo, hi = corners.min(axis=1), corners.max(axis=1) + 2
    boxes = np.concatenate([lo, np.minimum(hi, self.side)], axis=1).astype(np.float32)
    labels = rng.integers(0, self.num_classes, m).astype(np.int32)
    return dict(boxes=boxes, labels=labels, image_id=int(index), rng=rng)

  def load(self, index: int) -> dict:
    t = self.targets(index)
    image = t.pop("rng").integers(0, 256, (self.side, self.side, 3), dtype=np.uint8)
    for (x0, y0, x1, y1), c in zip(t["boxes"].astype(int), t["labels"]):
      image[y0:y1, x0:x1] = self.colours[c]
    return dict(image=image, **t)

  __getitem__ = load


def child(
  num_images: int, batch_size: int, keep_fraction: float, workdir: str, chunk_images: int
) -> dict:
  """One build in this process; returns its figures (the parent measures the peak RSS)."""
  config = tiny_config("swil", workdir)
  config.model.overrides.image_size = IMAGE_SIZE
  config.data.eval_batch_size = batch_size
  detector = Detector(config)
  params = detector.init_params(0)
  source = SyntheticSource(num_images)
  options = replay_setup.build_options(detector, source)
  options["buffer_spec"] = dataclasses.replace(
    options["buffer_spec"],
    loss_threshold=-np.inf,
    min_per_class=max(1, round(keep_fraction * num_images / NUM_CLASSES)),
    logits_dtype="bfloat16",
  )
  # Several commits even at small sizes (pass 1's rate is timed between its first and last).
  options["chunk_images"] = chunk_images
  commits = []
  path = os.path.join(workdir, "store")
  start = time.perf_counter()
  stats = build_lib.build_store(
    detector.model,
    params,
    source,
    path,
    chunk_hook=lambda name, batches: commits.append((name, batches, time.perf_counter())),
    **options,
  )
  seconds = time.perf_counter() - start
  losses = [(b, t) for name, b, t in commits if name == "losses"]
  (b0, t0), (b1, t1) = losses[0], losses[-1]
  sizes = {
    name[: -len(".npy")]: os.path.getsize(os.path.join(path, name))
    for name in os.listdir(path)
    if name.endswith(".npy")
  }
  kept = stats["images_kept"]
  return dict(
    images=num_images,
    images_kept=kept,
    batch_size=batch_size,
    seconds=seconds,
    images_per_s=num_images / seconds,
    pass1_images_per_s=(min(b1 * batch_size, num_images) - b0 * batch_size) / (t1 - t0),
    store_bytes=sum(sizes.values()),
    store_bytes_per_image=sum(sizes.values()) / kept,
    store_bytes_per_image_by_array={k: v / kept for k, v in sorted(sizes.items())},
    peak_rss_bytes_self=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    devices=[str(d) for d in jax.devices()],
  )


def run_size(
  num_images: int, batch_size: int, keep_fraction: float, chunk_images: int = CHUNK_IMAGES
) -> dict:
  """`child` in a fresh subprocess; adds its peak RSS (bytes, `ru_maxrss` from os.wait4)."""
  with tempfile.TemporaryDirectory(prefix="buffer-bench-") as workdir:
    out = os.path.join(workdir, "result.json")
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      "--child",
      str(num_images),
      "--batch-size",
      str(batch_size),
      "--keep-fraction",
      str(keep_fraction),
      "--workdir",
      workdir,
      "--chunk-images",
      str(chunk_images),
      "--result",
      out,
    ]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=REPO))
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
      raise RuntimeError(f"the {num_images}-image build failed ({proc.returncode})")
    with open(out) as f:
      result = json.load(f)
  # Linux reports ru_maxrss in KiB.
  result["peak_rss_bytes"] = usage.ru_maxrss * 1024
  return result


def paper_projection(step_results: str) -> dict:
  """Store bytes per buffer image for L/14 at 840 px (paper settings) and the forward FLOPs /
  time of the Objects365 build (see the module docstring)."""
  c = base.get_config("paper")
  v = owl_vit.VARIANTS[c.model.variant]
  s, q, m, k = v["image_size"], c.data.num_queries, c.data.max_instances, c.replay.top_k
  t, e, length = (s // v["patch_size"]) ** 2, v["embed_dim"], v["context_length"]
  features = {
    "stored_logits (bfloat16 [T, Q])": 2 * t * q,
    "class + query embeddings (float32 2 x [k, E])": 4 * 2 * k * e,
    "class_membership (bool [C])": OBJECTS365_CLASSES,
    "prototype_distances (float32 [C])": 4 * OBJECTS365_CLASSES,
  }
  # The images are kept by reference (source index, image id), not as pixels.
  examples = {
    "queries (int32 [Q, L])": 4 * q * length,
    "labels (float32 [M, Q])": 4 * m * q,
    "boxes, query_class, image_id, source_index": 4 * m * 4 + 4 * q + 8 + 8,
  }
  per_image = sum(features.values()) + sum(examples.values())
  result = dict(
    variant=c.model.variant,
    image_size=s,
    num_tokens=t,
    num_queries=q,
    embed_dim=e,
    top_k=k,
    num_classes=OBJECTS365_CLASSES,
    buffer_images=PAPER_BUFFER_IMAGES,
    features_bytes_by_array=features,
    examples_bytes_by_array=examples,
    features_bytes_per_image_paper=sum(features.values()),
    examples_bytes_per_image_paper=sum(examples.values()),
    store_bytes_per_image_paper=per_image,
    store_bytes_paper_buffer=per_image * PAPER_BUFFER_IMAGES,
    # Optional, on local disk: the resized uint8 pixels (at most S x S x 3).
    image_cache_bytes_per_image_paper=s * s * 3,
    image_cache_bytes_paper_buffer=s * s * 3 * PAPER_BUFFER_IMAGES,
    # What the store held per image before images were kept by reference (float32 pixels).
    pixels_bytes_per_image_before=4 * s * s * 3,
  )
  if os.path.exists(step_results):
    with open(step_results) as f:
      step = json.load(f)
    flops = step.get("arithmetic", {}).get("model_flops_per_image_eval")
    if flops:
      forwards = OBJECTS365_IMAGES + 2 * PAPER_BUFFER_IMAGES
      result.update(objects365_forwards=forwards, objects365_forward_flops=forwards * flops)
      rate = step.get("eval_forward_images_per_s")
      result["objects365_forward_hours"] = forwards / rate / 3600 if rate else None
  return result


def environment() -> dict:
  import jax  # noqa: PLC0415

  return {
    "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
    "devices": [str(d) for d in jax.devices()],
    "jax": jax.__version__,
    "python": platform.python_version(),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
  }


def _label(n: int) -> str:
  return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def render_markdown(report: dict) -> str:
  env = report["environment"]
  lines = [
    "# Replay-buffer build benchmark",
    "",
    f"Machine: {env['machine']}; devices: {env['devices']}; jax {env['jax']}; {env['date']}.",
    f"Tiny model (random weights) at {IMAGE_SIZE} px, {NUM_CLASSES} classes, batch "
    f"{report['batch_size']}, DER++ logits in bfloat16; each size built in a fresh process.",
    "",
    "| images | kept | peak RSS MiB | pass-1 images/s | build images/s | build s | "
    "store bytes / kept image |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in report["runs"]:
    lines.append(
      f"| {r['images']:,} | {r['images_kept']:,} | {r['peak_rss_bytes'] / 2**20:.0f} | "
      f"{r['pass1_images_per_s']:.0f} | {r['images_per_s']:.0f} | {r['seconds']:.0f} | "
      f"{r['store_bytes_per_image']:,.0f} |"
    )
  if report.get("rss_ratio_200k_over_20k") is not None:
    lines += ["", f"Peak RSS 200k / 20k: {report['rss_ratio_200k_over_20k']:.3f} (target <= 1.25)."]
  p = report["paper"]
  lines += [
    "",
    f"## Projection: {p['variant']} at {p['image_size']} px ({p['num_tokens']} tokens, "
    f"{p['num_queries']} queries, k {p['top_k']}, E {p['embed_dim']}, C {p['num_classes']})",
    "",
    "| array | bytes / buffer image |",
    "|---|---|",
  ]
  for k, v in {**p["features_bytes_by_array"], **p["examples_bytes_by_array"]}.items():
    lines.append(f"| {k} | {v:,} |")
  lines += [
    "",
    f"Store: {p['store_bytes_per_image_paper']:,} bytes per image (features + logits "
    f"{p['features_bytes_per_image_paper']:,}, examples without pixels "
    f"{p['examples_bytes_per_image_paper']:,}: images by reference), "
    f"{p['store_bytes_paper_buffer'] / 1e9:.1f} GB for {p['buffer_images']:,} images. The "
    f"optional uint8 image cache on local disk (`replay.image_cache`) takes up to "
    f"{p['image_cache_bytes_per_image_paper']:,} bytes per image "
    f"({p['image_cache_bytes_paper_buffer'] / 1e9:.0f} GB); the store held "
    f"{p['pixels_bytes_per_image_before']:,} bytes of float32 pixels per image before.",
  ]
  if p.get("objects365_forward_flops"):
    hours = p.get("objects365_forward_hours")
    lines.append(
      f"Objects365 build: {p['objects365_forwards']:,} forwards, "
      f"{p['objects365_forward_flops'] / 1e18:.2f} EFLOP (model FLOPs); "
      + (f"{hours:.1f} h at the measured forward rate." if hours else "no measured forward rate.")
    )
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="20000,200000")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--keep-fraction", type=float, default=0.18)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--name", default=None, help="file stem (default buffer[_smoke])")
  parser.add_argument("--chunk-images", type=int, default=CHUNK_IMAGES)
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="one 64-image build in batches of 8, chunks of 32 (seconds; tests, CI)",
  )
  parser.add_argument(
    "--render-only",
    action="store_true",
    help="rewrite <out>/<name>.md from <out>/<name>.json, the paper projection (arithmetic, "
    "no measurement) recomputed",
  )
  parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  parser.add_argument("--result", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.smoke:
    args.sizes, args.batch_size, args.chunk_images = "64", 8, 32
  args.name = args.name or ("buffer_smoke" if args.smoke else "buffer")
  if args.child:
    result = child(args.child, args.batch_size, args.keep_fraction, args.workdir, args.chunk_images)
    with open(args.result, "w") as f:
      json.dump(result, f)
    return None
  stem = os.path.join(args.out, args.name)
  if args.render_only:
    with open(stem + ".json") as f:
      report = json.load(f)
    report["paper"] = paper_projection(
      os.path.join(os.path.dirname(__file__), "results", "step.json")
    )
    report["store_bytes_per_image_paper"] = report["paper"]["store_bytes_per_image_paper"]
    utils.atomic_write_json(stem + ".json", report, indent=1)
    utils.atomic_write_text(stem + ".md", render_markdown(report))
    return report
  runs = []
  for n in [int(s) for s in args.sizes.split(",") if s]:
    print(f"building over {n:,} images", flush=True)
    runs.append(run_size(n, args.batch_size, args.keep_fraction, args.chunk_images))
    print(json.dumps(runs[-1], indent=1), flush=True)
  report = dict(
    environment=environment(),
    batch_size=args.batch_size,
    keep_fraction=args.keep_fraction,
    runs=runs,
    paper=paper_projection(os.path.join(os.path.dirname(__file__), "results", "step.json")),
  )
  by_size = {r["images"]: r for r in runs}
  for n in by_size:
    report[f"peak_rss_bytes_{_label(n)}"] = by_size[n]["peak_rss_bytes"]
  if 20000 in by_size and 200000 in by_size:
    report["rss_ratio_200k_over_20k"] = (
      by_size[200000]["peak_rss_bytes"] / by_size[20000]["peak_rss_bytes"]
    )
  report["store_bytes_per_image_paper"] = report["paper"]["store_bytes_per_image_paper"]
  utils.write_report(stem, report, render_markdown(report), indent=1)
  return report


if __name__ == "__main__":
  main()

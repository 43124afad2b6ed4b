"""The host side of the paper's protocol, measured on CPU (issue 48 item 2): no GPU needed.

Writes `<out>/protocol_host.{json,md}` (`protocol_host_smoke.*` with `--smoke`):

1. **Input pipeline** (`input`): training images/s on ONE core (this process pinned to one CPU,
   one reader thread) at 840 px, 126 queries, 100 instances, batches of 16, from synthetic
   JPEG files of Objects365's typical size (`--jpeg-size`, 1024 x 768, 8 boxes each), with the
   `:paper` preset's preprocessing (resize with pad, no augmentation: the preset turns none
   on) and with scenic's OWL-ViT augmentations (flip, random crop, mosaics of 1 / 2 / 3,
   docs/reference.md §5), through `input_pipeline.train_dataset` as the trainer calls it.
2. **Scoring** (`scoring`): COCO AP (`coco_eval.coco_evaluate`, pycocotools) and LVIS AP
   (`lvis_eval.lvis_evaluate`) of synthetic detections at the paper's evaluation sizes:
   Objects365 v2 val (80,000 images, 365 classes, 100 detections per image) and LVIS v1 val
   (19,809 images, 1,203 classes, 300 per image). Ground truth: 1-12 boxes per image (random
   classes); detections: jittered copies of the ground truth plus random boxes, random scores.
3. **Checkpoints** (`checkpoint`): write and restore time and size of the L/14 train state
   (float32 parameters + Adam's two moments, `StepCheckpointer` as the trainer writes it) and
   of a 54,226-image buffer store's per-image arrays (the sizes of benchmarks/buffer.py's
   paper projection, written in 16 MiB chunks and read back with a SHA-256 of every file, as
   `replay.store_verification='full'` reads them).
4. **Buffer build host cost** (`buffer`): CPU seconds per pre-training image of the streaming
   build (benchmarks/buffer.py's child: the tiny model at 64 px, so its forward is a small
   part: an upper bound of the host's share), from the children's rusage.

Usage:
  python benchmarks/protocol_host.py            # the paper's sizes: ~10 GB free disk, an idle
                                                # machine; tens of minutes
  python benchmarks/protocol_host.py --smoke --out D   # every part at a tiny size (CI)
  options: --parts input,scoring,checkpoint,buffer, --tmp DIR (where the files go),
  --coco-backend pycocotools|faster_coco_eval, --eval-sets o365_val,lvis_val,
  --scoring-images N (the scoring part at a smaller size), --scoring-processes P and
  --scoring-shards S (category shards in P worker processes: `owl_cl.eval.category_shards`)
  python benchmarks/protocol_host.py --parts=scoring --eval-sets=o365_val \
    --scoring-images=2000 --coco-backend=faster_coco_eval --out D   # one backend's COCO time
  python benchmarks/protocol_host.py --combine benchmarks/results/protocol_host
      # measures nothing: the records of DIR/<part>/ (one invocation each) as one
      # <out>/protocol_host.{json,md}, each record whole with its own CPU, load and commit

Timings are wall seconds of one process on one core unless a row says otherwise; the load
average before and after is recorded (a shared machine's figures are not the machine's).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PARTS = ("input", "scoring", "checkpoint", "buffer")


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What each part measures at (FULL: the paper's; SMOKE: seconds on CPU)."""

  variant: str = "vit_l14"
  jpeg_images: int = 64
  jpeg_size: tuple[int, int] = (1024, 768)
  input_batches: int = 4
  batch_size: int = 16
  num_queries: int = 126
  max_instances: int = 100
  # (name, images, classes, detections per image, protocol)
  eval_sets: tuple = (
    ("o365_val", 80_000, 365, 100, "coco"),
    ("lvis_val", 19_809, 1203, 300, "lvis"),
  )
  buffer_images: int = 54_226
  buffer_build_images: int = 2_000
  # scenic's mosaics and their probabilities (the tiny model's 64 px is not divisible by 3).
  mosaic: tuple = ((1, 2, 3), (0.4, 0.3, 0.3))
  # `coco_eval.coco_evaluate`'s backend for the COCO sets (`coco_eval.COCO_BACKENDS`).
  coco_backend: str = "pycocotools"
  # The scorers' `processes` and `shards` (`owl_cl.eval.category_shards`; None: chosen).
  scoring_processes: int = 1
  scoring_shards: int | None = None


FULL = Sizes()
SMOKE = Sizes(
  variant="tiny",
  jpeg_images=6,
  jpeg_size=(96, 64),
  input_batches=2,
  batch_size=2,
  num_queries=8,
  max_instances=4,
  eval_sets=(("o365_val", 20, 6, 10, "coco"), ("lvis_val", 20, 8, 10, "lvis")),
  buffer_images=40,
  buffer_build_images=64,
  mosaic=((1, 2), (0.5, 0.5)),
)


def _load(name: str):
  spec = importlib.util.spec_from_file_location(
    f"benchmark_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


# ------------------------------------------------------------------------------ 1. input


def write_jpegs(folder: str, sizes: Sizes, rng: np.random.Generator) -> str:
  """`sizes.jpeg_images` JPEG files (smooth colour fields + noise, quality 90) with 8 boxes each
  of 20 classes, and their COCO json; returns the json's path."""
  from PIL import Image  # noqa: PLC0415

  w, h = sizes.jpeg_size
  images, annotations = [], []
  for i in range(sizes.jpeg_images):
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * (c + 1) + yy * (3 - c)) % 256 for c in range(3)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    name = f"{i:06d}.jpg"
    Image.fromarray(pixels).save(os.path.join(folder, name), quality=90)
    images.append({"id": i + 1, "file_name": name, "width": w, "height": h})
    for _ in range(8):
      bw, bh = rng.uniform(0.05, 0.4) * w, rng.uniform(0.05, 0.4) * h
      x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
      annotations.append(
        {
          "id": len(annotations) + 1,
          "image_id": i + 1,
          "category_id": int(rng.integers(1, 21)),
          "bbox": [x, y, bw, bh],
          "area": bw * bh,
          "iscrowd": 0,
        }
      )
  path = os.path.join(folder, "instances.json")
  categories = [{"id": c, "name": f"class {c}"} for c in range(1, 21)]
  with open(path, "w") as f:
    json.dump({"images": images, "annotations": annotations, "categories": categories}, f)
  return path


def part_input(sizes: Sizes, tmp: str) -> dict:
  """Training images per second on one core, without and with scenic's augmentations."""
  from owl_cl.data import coco  # noqa: PLC0415

  folder = os.path.join(tmp, "jpegs")
  os.makedirs(folder, exist_ok=True)
  source = coco.CocoSource(write_jpegs(folder, sizes, np.random.default_rng(0)), folder)
  pinned = hasattr(os, "sched_setaffinity")
  if pinned:
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [min(cpus)])  # one core (restored below)
  try:
    return _time_pipeline(sizes, tmp, source)
  finally:
    if pinned:
      os.sched_setaffinity(0, cpus)


def _time_pipeline(sizes: Sizes, tmp: str, source) -> dict:
  from owl_cl.configs import base  # noqa: PLC0415
  from owl_cl.data import input_pipeline  # noqa: PLC0415
  from owl_cl.detector import Detector  # noqa: PLC0415

  out = {"jpeg_size": list(sizes.jpeg_size), "batch_size": sizes.batch_size}
  for label, augment in (("paper preset (no augmentation)", False), ("scenic augmentations", True)):
    config = base.get_config("rehearsal")
    config.model.variant = sizes.variant
    config.data.num_queries = sizes.num_queries
    config.data.num_negatives = min(50, sizes.num_queries - 1)
    config.data.max_instances = sizes.max_instances
    config.cache_dir = os.path.join(tmp, "cache")
    if augment:
      config.data.augment.hflip = True
      config.data.augment.random_crop = True
      config.data.augment.mosaic_sizes, config.data.augment.mosaic_probs = sizes.mosaic
    detector = Detector(config)
    batches = input_pipeline.train_dataset(
      source,
      detector.example_spec(detector.train_class_tokens(source)),
      batch_size=sizes.batch_size,
      seed=0,
      epoch=0,
      num_threads=1,
      prefetch=1,
      **detector.example_options(source),
      **detector.augment_options(),
    )
    next(batches)  # the first batch: the pipeline's start-up
    t0, cpu0 = time.perf_counter(), time.process_time()
    n = 0
    for _ in range(sizes.input_batches):
      try:
        next(batches)
      except StopIteration:
        break
      n += sizes.batch_size
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out[label] = {
      "image_size": detector.image_size,
      "images": n,
      "images_per_s": n / wall,
      "cpu_s_per_image": cpu / n,
    }
  return out


# ------------------------------------------------------------------------------ 2. scoring


def synthetic_eval(name, images, classes, dets, rng):
  """(ground truth dict, detections) of one synthetic evaluation set (module docstring)."""
  gt = {"images": [], "annotations": [], "categories": []}
  lvis = name.startswith("lvis")
  gt["categories"] = [
    {"id": c, "name": f"c{c}", **({"frequency": "rfc"[c % 3]} if lvis else {})}
    for c in range(1, classes + 1)
  ]
  detections = []
  for i in range(1, images + 1):
    gt["images"].append(
      {
        "id": i,
        "width": 640,
        "height": 480,
        "file_name": f"{i}.jpg",
        **({"neg_category_ids": [], "not_exhaustive_category_ids": []} if lvis else {}),
      }
    )
    boxes = rng.uniform(
      [0, 0, 10, 10], [500, 380, 140, 100], size=(int(rng.integers(1, min(12, dets) + 1)), 4)
    )
    cats = rng.integers(1, classes + 1, len(boxes))
    for box, c in zip(boxes, cats):
      gt["annotations"].append(
        {
          "id": len(gt["annotations"]) + 1,
          "image_id": i,
          "category_id": int(c),
          "bbox": box.tolist(),
          "area": float(box[2] * box[3]),
          "iscrowd": 0,
        }
      )
    # Jittered copies of the ground truth, then random boxes, up to `dets` per image.
    jitter = boxes + rng.normal(0, 5, boxes.shape)
    extra = rng.uniform([0, 0, 10, 10], [500, 380, 140, 100], size=(dets - len(boxes), 4))
    all_boxes = np.concatenate([jitter, extra])
    all_cats = np.concatenate([cats, rng.integers(1, classes + 1, len(extra))])
    for box, c, s in zip(all_boxes, all_cats, rng.uniform(size=len(all_boxes))):
      detections.append(
        {"image_id": i, "category_id": int(c), "bbox": np.abs(box).tolist(), "score": float(s)}
      )
  return gt, detections


class ChildPeak:
  """The largest VmHWM (peak resident set since exec) of this process's child processes,
  read from /proc every `interval` seconds while the context is open (Linux; 0 elsewhere).

  Why not `getrusage(RUSAGE_CHILDREN).ru_maxrss`: a spawned child is forked, then exec'd, and
  Linux carries the forked copy's resident size (every page it shared with this process) into
  the exec'd program's ru_maxrss, so a worker of a 4 GB parent reads 4 GB however little it
  used itself; VmHWM belongs to the exec'd program's own address space."""

  def __init__(self, interval: float = 0.25):
    import threading  # noqa: PLC0415

    self.interval, self.peak_kib = interval, 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)

  def _children(self) -> list[str]:
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/stat") as f:
          # Field 4, after the parenthesised command (which may hold spaces).
          if f.read().rsplit(")", 1)[1].split()[1] == me:
            out.append(pid)
      except (OSError, IndexError):
        continue  # gone meanwhile
    return out

  def _sample(self) -> None:
    while not self._stop.wait(self.interval):
      for pid in self._children():
        try:
          with open(f"/proc/{pid}/status") as f:
            for line in f:
              if line.startswith("VmHWM:"):
                self.peak_kib = max(self.peak_kib, int(line.split()[1]))
        except (OSError, ValueError):
          continue

  def __enter__(self):
    if os.path.isdir("/proc"):
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()


def part_scoring(sizes: Sizes, tmp: str) -> dict:
  """Scoring seconds of each evaluation set (ground truth loading included, as a run pays)."""
  from owl_cl.eval import category_shards  # noqa: PLC0415

  rng = np.random.default_rng(0)
  out = {}
  sharding = {"processes": sizes.scoring_processes, "shards": sizes.scoring_shards}
  worker_peak_kib = 0
  for name, images, classes, dets, protocol in sizes.eval_sets:
    gt, detections = synthetic_eval(name, images, classes, dets, rng)
    t0 = time.perf_counter()
    with ChildPeak() as workers:
      metrics = _score(protocol, gt, detections, dets, sizes, sharding)
    worker_peak_kib = max(worker_peak_kib, workers.peak_kib)
    seconds = time.perf_counter() - t0
    out[name] = {
      "protocol": protocol,
      **({"backend": sizes.coco_backend} if protocol == "coco" else {}),
      "images": images,
      "classes": classes,
      "detections": len(detections),
      "processes": sizes.scoring_processes,
      "shards": category_shards.shard_count(
        len(detections), classes, sizes.scoring_processes, sizes.scoring_shards
      ),
      "seconds": seconds,
      "ms_per_image": 1e3 * seconds / images,
      "AP": float(metrics["AP"]),
      "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, float)},
    }
  # Peak resident memory: this process (ru_maxrss, KiB on Linux), the largest worker (VmHWM).
  out["peak_rss_gb"] = {
    "this_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "largest_worker": worker_peak_kib / 2**20,
  }
  return out


def _score(protocol, gt, detections, dets, sizes, sharding) -> dict:
  """One synthetic set's metrics, ground truth indexing included (as a run pays)."""
  from pycocotools import coco as pycoco  # noqa: PLC0415

  from owl_cl.eval import coco_eval  # noqa: PLC0415
  from owl_cl.eval import lvis_eval  # noqa: PLC0415

  if protocol == "coco":
    ground = pycoco.COCO()
    ground.dataset = gt
    ground.createIndex()
    return coco_eval.coco_evaluate(
      ground, detections, max_dets=dets, backend=sizes.coco_backend, progress=True, **sharding
    )
  return lvis_eval.lvis_evaluate(
    lvis_eval.load_lvis_ground_truth(gt), detections, max_dets=dets, progress=True, **sharding
  )


# ------------------------------------------------------------------------------ 3. checkpoint


def _tree_bytes_on_disk(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def part_checkpoint(sizes: Sizes, tmp: str) -> dict:
  """The train state's and the buffer store's write and restore times and sizes."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from owl_cl import model as model_lib  # noqa: PLC0415
  from owl_cl.train import checkpointing  # noqa: PLC0415

  model = model_lib.create_model(sizes.variant)
  s = model.image_size
  like = jax.eval_shape(
    model.init,
    jax.random.PRNGKey(0),
    jax.ShapeDtypeStruct((1, s, s, 3), jnp.float32),
    jax.ShapeDtypeStruct((1, 2, model.context_length), jnp.int32),
  )["params"]
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), like)
  state = {"params": params, "mu": params, "nu": params}  # AdamW's state: two moments
  folder = os.path.join(tmp, "step_checkpoints")
  ckpt = checkpointing.StepCheckpointer(folder)
  t0 = time.perf_counter()
  ckpt.save(1, 10, state, {})
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  ckpt.restore(1, 10, state)
  restore_s = time.perf_counter() - t0
  out = {
    "train_state": {
      "variant": sizes.variant,
      "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
      "bytes": _tree_bytes_on_disk(folder),
      "write_s": write_s,
      "restore_s": restore_s,
    }
  }
  shutil.rmtree(folder, ignore_errors=True)
  out["buffer_store"] = _store_write_read(sizes, tmp)
  return out


CHUNK = 16 << 20  # the store's verification chunk (docs/stored_state.md)


def _store_write_read(sizes: Sizes, tmp: str) -> dict:
  """Writes the store's per-image arrays (bytes per image from buffer.py's paper projection;
  smoke: 1 KB per image) in 16 MiB chunks with fsync, then reads every file back hashing it."""
  if sizes.variant == "tiny":
    per_image = 1024
  else:
    projection = _load("buffer").paper_projection(
      os.path.join(ROOT, "benchmarks/results/step.json")
    )
    per_image = int(projection["store_bytes_per_image_paper"])
  total = per_image * sizes.buffer_images
  path = os.path.join(tmp, "store.bin")
  block = np.random.default_rng(0).integers(0, 256, min(CHUNK, total), np.uint8).tobytes()
  t0 = time.perf_counter()
  with open(path, "wb") as f:
    left = total
    while left > 0:
      f.write(block[: min(left, len(block))])
      left -= len(block)
    f.flush()
    os.fsync(f.fileno())
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(CHUNK):
      digest.update(chunk)
  read_s = time.perf_counter() - t0
  os.remove(path)
  return {
    "images": sizes.buffer_images,
    "bytes_per_image": per_image,
    "bytes": total,
    "write_s": write_s,
    "read_and_hash_s": read_s,
    "note": "read back from the page cache when the file fits in memory: a lower bound",
  }


# ------------------------------------------------------------------------------ 4. buffer


def part_buffer(sizes: Sizes, tmp: str) -> dict:
  """CPU seconds per image of benchmarks/buffer.py's streaming build (in its own process)."""
  buffer = _load("buffer")
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  n = sizes.buffer_build_images
  # Several chunk commits (the child times pass 1 between its first and last).
  result = buffer.run_size(n, 16, 0.18, chunk_images=min(buffer.CHUNK_IMAGES, n // 4))
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return {
    "images": sizes.buffer_build_images,
    "wall_s": result["seconds"],
    "cpu_s": cpu,
    "cpu_ms_per_image": 1e3 * cpu / sizes.buffer_build_images,
    "note": "tiny model at 64 px: its forward pass included (an upper bound of the host's share)",
  }


# ------------------------------------------------------------------------------ driver

RUNNERS = {
  "input": part_input,
  "scoring": part_scoring,
  "checkpoint": part_checkpoint,
  "buffer": part_buffer,
}


def render(report: dict) -> str:
  r = report["parts"]
  lines = [
    f"# The protocol's host side ({report['mode']})",
    "",
    f"{report['machine']} ({report['cpu']}); load average {report['load_before']} before, "
    f"{report['load_after']} after; {report['date']}; commit {report['code']['commit']}"
    f"{' (dirty)' if report['code'].get('dirty') else ''}.",
    "",
  ]
  if "input" in r:
    lines += [
      "## Input pipeline, one core",
      "",
      "| preprocessing | px | images/s | CPU ms/image |",
      "|---|---|---|---|",
    ]
    for label, v in r["input"].items():
      if isinstance(v, dict):
        lines.append(
          f"| {label} | {v['image_size']} | {v['images_per_s']:.2f} | "
          f"{1e3 * v['cpu_s_per_image']:.1f} |"
        )
  if "scoring" in r:
    lines += [
      "",
      "## Scoring (synthetic detections)",
      "",
      "| set | images | classes | detections | processes / shards | s | ms/image |",
      "|---|---|---|---|---|---|---|",
    ]
    for name, v in r["scoring"].items():
      if name == "peak_rss_gb":
        continue
      # Records from before category shards scored in this process, in one pass.
      split = f"{v.get('processes', 1)} / {v.get('shards', 1)}"
      lines.append(
        f"| {name} ({v['protocol']}) | {v['images']} | {v['classes']} | {v['detections']} | "
        f"{split} | {v['seconds']:.1f} | {v['ms_per_image']:.2f} |"
      )
    if "peak_rss_gb" in r["scoring"]:
      rss = r["scoring"]["peak_rss_gb"]
      lines += [
        "",
        f"Peak RSS: this process {rss['this_process']:.1f} GiB, the largest worker "
        f"{rss['largest_worker']:.1f} GiB.",
      ]
  if "checkpoint" in r:
    t, b = r["checkpoint"]["train_state"], r["checkpoint"]["buffer_store"]
    lines += [
      "",
      "## Checkpoints",
      "",
      f"Train state ({t['variant']}, {t['parameters']:,} parameters, + Adam): "
      f"{t['bytes'] / 1e9:.2f} GB, "
      f"written in {t['write_s']:.1f} s, restored in {t['restore_s']:.1f} s. Buffer store "
      f"({b['images']:,} images x {b['bytes_per_image']:,} B): {b['bytes'] / 1e9:.2f} GB, written "
      f"in {b['write_s']:.1f} s, read and hashed in {b['read_and_hash_s']:.1f} s ({b['note']}).",
    ]
  if "buffer" in r:
    v = r["buffer"]
    lines += [
      "",
      "## Buffer build",
      "",
      f"{v['images']} images: {v['cpu_s']:.1f} CPU s, {v['cpu_ms_per_image']:.1f} CPU ms per "
      f"image ({v['note']}).",
    ]
  return "\n".join(lines) + "\n"


def scoring_sizes(sizes: Sizes, args) -> Sizes:
  """`sizes` with the scoring options applied: the COCO backend, the named eval sets only,
  at most `--scoring-images` images each. ValueError for an unknown set or backend."""
  from owl_cl.eval import coco_eval  # noqa: PLC0415

  if args.coco_backend not in coco_eval.COCO_BACKENDS:
    raise ValueError(f"--coco-backend={args.coco_backend!r}; known: {coco_eval.COCO_BACKENDS}")
  sets = sizes.eval_sets
  if args.eval_sets:
    names = args.eval_sets.split(",")
    unknown = sorted(set(names) - {s[0] for s in sets})
    if unknown:
      raise ValueError(f"--eval-sets: unknown {unknown}; known: {[s[0] for s in sets]}")
    sets = tuple(s for s in sets if s[0] in names)
  if args.scoring_images:
    sets = tuple((n, min(i, args.scoring_images), *rest) for n, i, *rest in sets)
  return dataclasses.replace(
    sizes,
    eval_sets=sets,
    coco_backend=args.coco_backend,
    scoring_processes=args.scoring_processes,
    scoring_shards=args.scoring_shards,
  )


RECORD = "protocol_host.json"


def combine(folder: str) -> dict:
  """The records of `folder`'s subfolders (`<sub>/protocol_host.json`, one invocation each),
  unchanged, as {'combined_from', 'records': {sub: record}, 'without_record': {sub: [its
  files]}} (a part that left no record, e.g. one killed out of memory, is named with what it
  left). Raises FileNotFoundError when `folder` has no record at all."""
  records, without = {}, {}
  for sub in sorted(os.listdir(folder)):
    path = os.path.join(folder, sub)
    if not os.path.isdir(path):
      continue
    if os.path.isfile(os.path.join(path, RECORD)):
      with open(os.path.join(path, RECORD), encoding="utf-8") as f:
        records[sub] = json.load(f)
    else:
      without[sub] = sorted(os.listdir(path))
  if not records:
    raise FileNotFoundError(f"{folder}: no subfolder holds a {RECORD}")
  return {
    "combined_from": os.path.relpath(folder, ROOT),
    "records": records,
    "without_record": without,
  }


def render_combined(combined: dict) -> str:
  """Markdown: a table of the records (parts, CPU, load, date, commit), then each record's
  own page (`render`) one heading level down, and the folders without a record."""
  lines = [
    "# The protocol's host side: every part's record",
    "",
    f"The records of `{combined['combined_from']}/`, one invocation per part (so that a "
    "failed part lost only itself), combined unchanged by `benchmarks/protocol_host.py "
    "--combine`. Each names its own machine, load and commit.",
    "",
    "| folder | parts | CPU | load before / after | date | commit |",
    "|---|---|---|---|---|---|",
  ]
  for sub, r in combined["records"].items():
    code = r["code"]
    lines.append(
      f"| {sub} | {', '.join(r['parts'])} | {r['machine']}, {r['cpu']} | "
      f"{r['load_before']:.2f} / {r['load_after']:.2f} | {r['date']} | "
      f"{(code['commit'] or '?')[:10]}{' (dirty)' if code.get('dirty') else ''} |"
    )
  for sub, files in combined["without_record"].items():
    lines.append(f"| {sub} | no record: {', '.join(files) or 'empty'} | | | | |")
  for sub, r in combined["records"].items():
    page = render(r).splitlines()[1:]  # its title becomes the folder's heading
    lines += ["", f"## {sub}", *("#" + line if line.startswith("#") else line for line in page)]
  return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
  p.add_argument("--parts", default=",".join(PARTS))
  p.add_argument("--tmp", default=None, help="where the files go (default: a temporary folder)")
  p.add_argument(
    "--coco-backend",
    default="pycocotools",
    help="COCOeval of the COCO sets: pycocotools or "
    "faster_coco_eval (time each in its own process: one run per backend)",
  )
  p.add_argument(
    "--eval-sets", default=None, help="scoring: only these sets (e.g. o365_val; default all)"
  )
  p.add_argument(
    "--scoring-images", type=int, default=None, help="scoring: at most this many images per set"
  )
  p.add_argument(
    "--scoring-processes",
    type=int,
    default=1,
    help="scoring: worker processes over category shards (owl_cl.eval.category_shards)",
  )
  p.add_argument(
    "--scoring-shards",
    type=int,
    default=None,
    help="scoring: category shards (default: chosen by category_shards.shard_count)",
  )
  p.add_argument(
    "--combine",
    metavar="DIR",
    help="measure nothing: combine the records of DIR/<part>/ into <out>/protocol_host.*",
  )
  args = p.parse_args(argv)
  if args.combine:
    from owl_cl import utils  # noqa: PLC0415

    combined = combine(args.combine)
    os.makedirs(args.out, exist_ok=True)
    utils.write_report(
      os.path.join(args.out, "protocol_host"), combined, render_combined(combined), indent=2
    )
    return combined
  parts = [x for x in args.parts.split(",") if x]
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    p.error(f"--parts: unknown {unknown}; known: {','.join(PARTS)}")
  from owl_cl import utils  # noqa: PLC0415
  from owl_cl.eval import provenance  # noqa: PLC0415

  sizes = scoring_sizes(SMOKE if args.smoke else FULL, args)
  tmp = tempfile.mkdtemp(prefix="protocol_host_", dir=args.tmp)
  report = {
    "mode": "smoke" if args.smoke else "full",
    "sizes": dataclasses.asdict(sizes),
    "machine": f"{os.cpu_count()} logical CPUs",
    "cpu": utils.cpu_model(),
    # The code measured: commit, dirty, commit_source (`owl_cl.eval.provenance`).
    "code": provenance.code_provenance(),
    "load_before": os.getloadavg()[0],
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "parts": {},
  }
  try:
    for name in parts:
      print(f"{name} ...", flush=True)
      report["parts"][name] = RUNNERS[name](sizes, tmp)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  report["load_after"] = os.getloadavg()[0]
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "protocol_host_smoke" if args.smoke else "protocol_host")
  utils.write_report(stem, report, render(report), indent=2)
  return report


if __name__ == "__main__":
  main()

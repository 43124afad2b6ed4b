"""The built-in benchmark on disk: splits written as COCO json + PNG, the cache folder.

`ensure_benchmark` generates every split once into a folder keyed by its parameters and
`FORMAT_VERSION` (atomically) and returns a `BuiltinBenchmark` that reads it back through
`owl_cl.data.coco.CocoSource`. Package docstring: `owl_cl.data.builtin`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any
import zlib

from absl import logging
import numpy as np
from PIL import Image
from PIL import ImageDraw

from owl_cl import config_spec
from owl_cl import integrity
from owl_cl import utils
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.config_fields import names
from owl_cl.data.builtin import vocabulary
from owl_cl.data.builtin.render import Assets
from owl_cl.data.builtin.render import render_scene
from owl_cl.data.builtin.vocabulary import BENCHMARK_VERSIONS
from owl_cl.data.builtin.vocabulary import DOWNSTREAM_NAMES
from owl_cl.data.builtin.vocabulary import HELD_OUT_PAIRS
from owl_cl.data.builtin.vocabulary import NUISANCE_SHAPES
from owl_cl.data.builtin.vocabulary import PRETRAIN_PAIRS
from owl_cl.data.builtin.vocabulary import Domain
from owl_cl.data.builtin.vocabulary import ObjectStyle
from owl_cl.data.coco import CocoSource

FORMAT_VERSION = 3  # bump whenever generated content changes (keys the cache)
# Version 2's dataset of the tail-classes evaluation set (split 'val').
TAIL_DATASET = "pretrain_tail"


# ------------------------------------------------------------------------------------------
# Writing a split.
# ------------------------------------------------------------------------------------------
def _split_code(dataset: str, split: str) -> int:
  return zlib.crc32(f"{dataset}/{split}".encode())


def _write_split(
  root: str,
  dataset: str,
  split: str,
  dom: Domain,
  num_images: int,
  seed: int,
  assets: Assets,
  pbar,
  version: int = 1,
) -> dict[str, int]:
  from pycocotools import mask as mask_utils

  img_dir = os.path.join(root, dataset, "images")
  os.makedirs(img_dir, exist_ok=True)
  distractors = [
    ObjectStyle("shape", NUISANCE_SHAPES, "color", c, p)
    for c, p in (dom.distractor_pairs or PRETRAIN_PAIRS)
  ]
  images, anns = [], []
  code = _split_code(dataset, split)
  for i in range(num_images):
    rng = np.random.default_rng(np.random.SeedSequence([seed, code, i]))
    img, objs = render_scene(assets, dom, split, rng, distractors)
    H, W = img.shape[:2]
    fname = f"{split}_{i:06d}.png"
    Image.fromarray(img).save(os.path.join(img_dir, fname), format="PNG", compress_level=3)
    image_id = i + 1
    images.append(dict(id=image_id, file_name=fname, height=H, width=W))
    for ci, x, y, m in objs:
      h, w = m.shape
      full = np.zeros((H, W), np.uint8, order="F")
      full[y : y + h, x : x + w] = m
      rle = mask_utils.encode(full)
      anns.append(
        dict(
          id=len(anns) + 1,
          image_id=image_id,
          category_id=ci + 1,
          bbox=[x, y, w, h],
          area=int(m.sum()),
          iscrowd=0,
          segmentation=dict(size=[H, W], counts=rle["counts"].decode("ascii")),
        )
      )
    if pbar is not None:
      pbar.update(1)
  cats = [dict(id=i + 1, name=n, supercategory=dataset) for i, (n, _) in enumerate(dom.classes)]
  info = dict(
    description=f"owl_cl built-in benchmark: {dataset}/{split}",
    format_version=FORMAT_VERSION,
    seed=seed,
    dataset=dataset,
    split=split,
    domain=dom.description,
  )
  if version != 1:  # version 1's files stay byte for byte as before the field existed
    info["benchmark_version"] = version
  with open(os.path.join(root, dataset, f"{split}.json"), "w") as f:
    json.dump(
      dict(info=info, images=images, annotations=anns, categories=cats), f, separators=(",", ":")
    )
  return dict(images=len(images), instances=len(anns))


# ------------------------------------------------------------------------------------------
# Public API.
# ------------------------------------------------------------------------------------------
# Why the generation parameters but `version` stay out of the cache keys of what is trained on
# the benchmark (`config_spec` key reasons).
_GENERATED = (
  "changes the generated files; the keys hold the pre-training annotation file's digest "
  "(pretrain_data), which changes with it"
)


@dataclasses.dataclass(frozen=True)
class BuiltinSpec:
  """`config.data.builtin`: every generation parameter of the built-in benchmark, written once
  (`config_spec`: `data_spec.DataSpec` nests it; `ensure_benchmark` takes its fields). They,
  with FORMAT_VERSION, key the benchmark's cache folder (`key`). The defaults are version 1's;
  `configs/base.py` sets version 2's (`apply_builtin_v2`) unless the config argument is
  'builtin1' or 'paper' (docs/experiments.md). `num_tail_val` sizes version 2's tail-classes
  evaluation set (unused by version 1).
  """

  version: int = config_spec.field(
    1,
    choice(BENCHMARK_VERSIONS),
    "1: the original benchmark; 2: the one where the retrieval algorithm matters by "
    "construction (docs/experiments.md).",
  )
  seed: int = config_spec.field(0, integer(0), "The generation seed.", key=_GENERATED)
  num_pretrain_train: int = config_spec.field(
    4000, integer(1), "Images of the pre-training train split.", key=_GENERATED
  )
  num_pretrain_val: int = config_spec.field(
    200, integer(1), "Images of the pre-training val split.", key=_GENERATED
  )
  num_held_out_val: int = config_spec.field(
    100, integer(1), "Images of the held-out classes' val split.", key=_GENERATED
  )
  num_downstream_train: int = config_spec.field(
    200, integer(1), "Images of each downstream train split.", key=_GENERATED
  )
  num_downstream_test: int = config_spec.field(
    60, integer(1), "Images of each downstream test split.", key=_GENERATED
  )
  num_tail_val: int = config_spec.field(
    200, integer(1), "Images of version 2's tail-classes set (pretrain_tail).", key=_GENERATED
  )
  downstream: tuple = config_spec.field(
    ("thermal", "negative", "clutter", "textured", "tiny"),
    names(lambda: DOWNSTREAM_NAMES, what="built-in dataset"),
    "The sequence, an ODinW stand-in with one domain shift each; 'glyphs' and 'digits' are "
    "also available (docs/experiments.md).",
    key=_GENERATED,
  )

  def as_dict(self) -> dict[str, Any]:
    """The parameters as stored and keyed: version 1 without `version` and `num_tail_val`
    (fields added with version 2), so version 1's cache keys and metadata are unchanged."""
    out = dataclasses.asdict(self)
    if self.version == 1:
      del out["version"], out["num_tail_val"]
    return out

  def key(self) -> str:
    """Version 1: 'builtin_v<FORMAT_VERSION>_<12 hex digits of sha256 of the parameters>';
    version 2: 'builtin2_v<FORMAT_VERSION>_<...>' (the version enters the hash too)."""
    payload = json.dumps(dict(self.as_dict(), format_version=FORMAT_VERSION), sort_keys=True)
    prefix = "builtin" if self.version == 1 else f"builtin{self.version}"
    return f"{prefix}_v{FORMAT_VERSION}_{hashlib.sha256(payload.encode()).hexdigest()[:12]}"

  def splits(self) -> list[tuple[str, str, Domain, int]]:
    """(dataset, split, domain, number of images) in generation order.

    Raises:
      ValueError: a `version` not in `BENCHMARK_VERSIONS`, or an unknown downstream name.
    """
    if self.version not in BENCHMARK_VERSIONS:
      raise ValueError(
        f"built-in benchmark version {self.version!r} unknown; known: {BENCHMARK_VERSIONS}"
      )
    domains = vocabulary.downstream_domains(self.version)
    unknown = [d for d in self.downstream if d not in domains]
    if unknown:
      raise ValueError(f"unknown downstream datasets {unknown}; known: {DOWNSTREAM_NAMES}")
    pre = vocabulary.pretrain_domain(self.version)
    held = vocabulary.colour_pattern_domain(
      "held_out", HELD_OUT_PAIRS, "held-out colour-pattern pairs, never in pre-training"
    )
    out = [
      ("pretrain", "train", pre, self.num_pretrain_train),
      ("pretrain", "val", pre, self.num_pretrain_val),
      ("held_out", "val", held, self.num_held_out_val),
    ]
    if self.version == 2:
      out.append((TAIL_DATASET, "val", vocabulary.tail_domain(), self.num_tail_val))
    for d in self.downstream:
      out.append((d, "train", domains[d], self.num_downstream_train))
      out.append((d, "test", domains[d], self.num_downstream_test))
    return out


@dataclasses.dataclass(frozen=True)
class SplitFiles:
  """One split on disk: its COCO json, the folder its file names are relative to, and its
  name 'dataset/split'."""

  annotation_file: str
  image_dir: str
  name: str = ""

  def source(self, name: str | None = None, **kwargs) -> CocoSource:
    """`CocoSource(annotation_file, image_dir, name or self.name, **kwargs)`; decoded images
    are cached in memory by default (`cache_images=True`): the built-in benchmark's splits are
    small (5,600 images of about 100 x 100 pixels by default, 170 MB decoded), and a run's
    pre-training reads each of its images about ten times (1,200 steps of 32 images over
    4,000), which decoded each time took 83 s of the first `swil` run's CPU."""
    kwargs.setdefault("cache_images", True)
    return CocoSource(self.annotation_file, self.image_dir, name or self.name or None, **kwargs)


@dataclasses.dataclass(frozen=True)
class DownstreamDataset:
  """One downstream dataset: name, train/test `SplitFiles` and class names."""

  name: str
  train: SplitFiles
  test: SplitFiles
  classes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BuiltinBenchmark:
  """A generated built-in benchmark (see the module docstring).

  Attributes:
    root: the cache folder `<cache_dir>/<BuiltinSpec.key()>` (`builtin_v<FORMAT_VERSION>_<hash>`
      for version 1).
    config: the `BuiltinSpec` it was generated from.
    splits: (dataset, split) -> SplitFiles; datasets 'pretrain' (train, val), 'held_out' (val)
      and each downstream name (train, test).
    downstream_names: downstream datasets in canonical order (the CL order is a seeded shuffle
      chosen by the experiment, docs/reference.md §10).
    classes: dataset -> class names in contiguous index order.
    counts: 'dataset/split' -> dict(images, instances).
    generation_seconds: wall time of the generation that produced the cache.
    design: version 2's design as generated (`vocabulary.design`: class frequencies, tail
      classes, interference, reappearing class, negative control); {} for version 1.
  """

  root: str
  config: BuiltinSpec
  splits: dict[tuple[str, str], SplitFiles]
  downstream_names: tuple[str, ...]
  classes: dict[str, tuple[str, ...]]
  counts: dict[str, dict[str, int]]
  generation_seconds: float
  design: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def version(self) -> int:
    """The benchmark version (1 or 2)."""
    return self.config.version

  @property
  def tail_val(self) -> SplitFiles | None:
    """Version 2's tail-classes evaluation set (None in version 1)."""
    return self.splits.get((TAIL_DATASET, "val"))

  @property
  def fingerprint(self) -> str:
    """The cache key, its folder's name (`BuiltinSpec.key`: 'builtin_v<FORMAT_VERSION>_<hash>'
    for version 1, 'builtin2_v<FORMAT_VERSION>_<hash>' for version 2)."""
    return os.path.basename(self.root)

  @property
  def pretrain_train(self) -> SplitFiles:
    return self.splits[("pretrain", "train")]

  @property
  def pretrain_val(self) -> SplitFiles:
    return self.splits[("pretrain", "val")]

  @property
  def held_out_val(self) -> SplitFiles:
    return self.splits[("held_out", "val")]

  @property
  def downstream(self) -> tuple[DownstreamDataset, ...]:
    """The downstream datasets in canonical order."""
    return tuple(
      DownstreamDataset(d, self.splits[(d, "train")], self.splits[(d, "test")], self.classes[d])
      for d in self.downstream_names
    )

  @property
  def pretrain_classes(self) -> tuple[str, ...]:
    return self.classes["pretrain"]

  @property
  def held_out_classes(self) -> tuple[str, ...]:
    return self.classes["held_out"]

  def split(self, dataset: str, split: str) -> SplitFiles:
    """SplitFiles of (dataset, split); KeyError naming the available ones otherwise."""
    try:
      return self.splits[(dataset, split)]
    except KeyError:
      raise KeyError(
        f"no split {dataset}/{split}; available: {sorted('/'.join(k) for k in self.splits)}"
      ) from None

  def source(self, dataset: str, split: str, **kwargs) -> CocoSource:
    """`CocoSource` of (dataset, split), named 'dataset/split' (`SplitFiles.source`: decoded
    images cached in memory by default)."""
    return self.split(dataset, split).source(f"{dataset}/{split}", **kwargs)

  def describe(self) -> str:
    """A markdown summary: per dataset its domain shift, classes and image/instance counts."""
    descr = {
      "pretrain": "colour x fill-pattern pairs on muted photograph backgrounds, "
      "shapes vary (O365 stand-in)"
      + (", class frequency proportional to 1 / rank" if self.version == 2 else ""),
      "held_out": "held-out colour-pattern pairs, never in pre-training (LVIS-rare stand-in)",
      TAIL_DATASET: vocabulary.tail_domain().description,
    }
    descr.update({n: d.description for n, d in vocabulary.downstream_domains(self.version).items()})
    lines = [
      f"Built-in benchmark `{os.path.basename(self.root)}` (version {self.version}, seed "
      f"{self.config.seed}, format v{FORMAT_VERSION})",
      "",
      "| dataset | split(s): images / instances | classes | domain |",
      "|---|---|---|---|",
    ]
    extra = [TAIL_DATASET] if self.tail_val is not None else []
    for ds in ["pretrain", "held_out"] + extra + list(self.downstream_names):
      parts = [
        f"{sp} {self.counts[f'{ds}/{sp}']['images']} / {self.counts[f'{ds}/{sp}']['instances']}"
        for sp in ("train", "val", "test")
        if f"{ds}/{sp}" in self.counts
      ]
      lines.append(
        f"| {ds} | {'; '.join(parts)} | {len(self.classes[ds])}: "
        f"{', '.join(self.classes[ds])} | {descr[ds]} |"
      )
    return "\n".join(lines)


def _benchmark_from_meta(root: str, meta: dict[str, Any]) -> BuiltinBenchmark:
  cfg = meta["config"]
  cfg = BuiltinSpec(**dict(cfg, downstream=tuple(cfg["downstream"])))
  splits = {}
  for ds, sp in ((k.split("/")[0], k.split("/")[1]) for k in meta["counts"]):
    splits[(ds, sp)] = SplitFiles(
      os.path.join(root, ds, f"{sp}.json"), os.path.join(root, ds, "images"), f"{ds}/{sp}"
    )
  return BuiltinBenchmark(
    root=root,
    config=cfg,
    splits=splits,
    downstream_names=tuple(cfg.downstream),
    classes={k: tuple(v) for k, v in meta["classes"].items()},
    counts=meta["counts"],
    generation_seconds=float(meta["generation_seconds"]),
    design=meta.get("design", {}),
  )


_META = "benchmark.json"


def _complete(root: str) -> dict[str, Any] | None:
  """The metadata if `root` holds a complete generation (metadata, every json, every PNG)."""
  try:
    with open(os.path.join(root, _META)) as f:
      meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
      return None
    per_dataset: dict[str, int] = {}
    for key, c in meta["counts"].items():
      ds, sp = key.split("/")
      if not os.path.isfile(os.path.join(root, ds, f"{sp}.json")):
        return None
      per_dataset[ds] = per_dataset.get(ds, 0) + c["images"]
    for ds, n in per_dataset.items():
      if len([f for f in os.listdir(os.path.join(root, ds, "images")) if f.endswith(".png")]) != n:
        return None
    return meta
  except (OSError, ValueError, KeyError):
    return None


def generate_benchmark(root: str, config: BuiltinSpec, *, progress: bool = True) -> dict[str, Any]:
  """Generate every split of `config` into the (new, empty) folder `root`, non-atomically.

  Returns the metadata dict written last to `root/benchmark.json` (its presence marks the
  generation complete). Prefer `ensure_benchmark`, which adds caching and atomicity.
  """
  from tqdm.auto import tqdm

  t0 = time.perf_counter()
  assets = Assets()
  todo = config.splits()
  counts, classes = {}, {}
  with tqdm(
    total=sum(n for *_, n in todo), desc="built-in benchmark", unit="img", disable=not progress
  ) as pbar:
    for ds, sp, dom, n in todo:
      counts[f"{ds}/{sp}"] = _write_split(
        root, ds, sp, dom, n, config.seed, assets, pbar, config.version
      )
      classes[ds] = [c for c, _ in dom.classes]
  import PIL
  import skimage
  import sklearn

  meta = dict(
    format_version=FORMAT_VERSION,
    key=config.key(),
    config=config.as_dict(),
    counts=counts,
    classes=classes,
    generation_seconds=round(time.perf_counter() - t0, 3),
    versions=dict(
      numpy=np.__version__,
      pillow=PIL.__version__,
      skimage=skimage.__version__,
      sklearn=sklearn.__version__,
    ),
  )
  if config.version != 1:  # version 1's metadata as before the field existed
    meta["benchmark_version"] = config.version
    meta["design"] = vocabulary.design(config.version)
  with open(os.path.join(root, _META), "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
  return meta


def ensure_benchmark(
  cache_dir: str, seed: int = 0, *, progress: bool = True, **parameters: Any
) -> BuiltinBenchmark:
  """Return the built-in benchmark, generating it into `cache_dir` if needed.

  The cache folder is `cache_dir/<BuiltinSpec.key()>/` (version 1:
  `builtin_v<FORMAT_VERSION>_<hash of all parameters>`; version 2: `builtin2_v...`). It is
  trusted only if complete (metadata present, every json and PNG there) and every file matches
  the manifest written with it (`integrity.verify_directory`). Otherwise the benchmark is
  generated into a temporary sibling folder, its manifest written last, and renamed into place
  atomically, so an interrupted or failed generation never leaves a cache that is later
  trusted. A damaged folder is set aside (`.corrupt-<time>`, a warning naming the file); an
  incomplete one, or one generated before manifests were written, is replaced (generation is
  deterministic and takes seconds). Concurrent runs take the folder's lock
  (`utils.cache_entry_lock`): one generates, the others wait and reuse it. Deterministic: the
  same parameters give byte-identical json and identical PNG pixels (every image's
  randomness derives from (seed, dataset/split, index)).

  Args:
    cache_dir: parent folder (created if missing).
    seed: generation seed (int >= 0).
    parameters: the other fields of `BuiltinSpec` (each its default when not given): the
      split sizes, `downstream` (a subset of `DOWNSTREAM_NAMES`), `version` (1, or 2:
      docs/experiments.md, "Built-in benchmark version 2": long-tailed pre-training classes,
      the `pretrain_tail/val` set, interfering downstream classes, a reappearing class, a
      negative control; metadata in `design`) and `num_tail_val`.
    progress: show a tqdm progress bar.

  Returns:
    `BuiltinBenchmark`.

  Raises:
    ValueError: unknown version or downstream name (before anything is written).
    TypeError: a keyword that is no field of `BuiltinSpec`.
    OSError: file system errors.

  Size: 5,600 images with `BuiltinSpec`'s defaults. 3,320 images (1,200 pre-training train
  images, all 7 downstream datasets) took ~21 s of CPU time on one core (measured; ~50 s wall
  on a shared, busy 2-core machine), of which ~3 s loading the bundled photographs.
  """
  if "downstream" in parameters:
    parameters["downstream"] = tuple(parameters["downstream"])
  config = BuiltinSpec(seed=seed, **parameters)
  config.splits()  # validates the version and the names
  root = os.path.join(os.fspath(cache_dir), config.key())
  # The lock creates `cache_dir`; where it cannot be written, an intact benchmark is read.
  with utils.cache_entry_lock(root, "built-in benchmark") as writable:
    if integrity.has_manifest(root):
      try:
        integrity.verify_directory(root)
        meta = _complete(root)
        if meta is not None:
          return _benchmark_from_meta(root, meta)
      except integrity.IntegrityError as e:
        integrity.set_aside(root, str(e))
        logging.warning("the built-in benchmark was damaged (%s); generating it again", e)
    elif os.path.exists(root):
      logging.info(
        "the built-in benchmark at %s is incomplete or predates checksums: generating it again",
        root,
      )
    if not writable:
      state = "incomplete" if os.path.exists(root) else "not in the cache"
      raise utils.ReadOnlyCacheError(root, "the built-in benchmark", state)
    # An incomplete leftover (a killed generation that predates atomic writes, or one of an
    # earlier version without a manifest) is replaced.
    with utils.atomic_directory(root, if_exists="replace") as tmp:
      generate_benchmark(tmp, config, progress=progress)
      integrity.write_manifest(tmp)  # the commit mark, last
  meta = _complete(root)
  if meta is None:
    raise OSError(f"built-in benchmark at {root} is incomplete after generation")
  return _benchmark_from_meta(root, meta)


def render_preview(
  benchmark: BuiltinBenchmark,
  path: str,
  *,
  per_dataset: int = 6,
  cell: int = 128,
  draw_boxes: bool = True,
) -> str:
  """Save a PNG grid: one row per dataset (first split), `per_dataset` scenes each, boxes and
  class names drawn. Returns `path`."""
  extra = [TAIL_DATASET] if benchmark.tail_val is not None else []
  datasets = ["pretrain", "held_out"] + extra + list(benchmark.downstream_names)
  label_h = 12
  grid = Image.new(
    "RGB", (per_dataset * (cell + 4) + 70, len(datasets) * (cell + label_h + 4)), (255, 255, 255)
  )
  draw = ImageDraw.Draw(grid)
  for r, ds in enumerate(datasets):
    sp = "train" if (ds, "train") in benchmark.splits else "val"
    src = benchmark.source(ds, sp)
    y0 = r * (cell + label_h + 4)
    draw.text((2, y0 + cell // 2), ds, fill=(0, 0, 0))
    for c in range(min(per_dataset, len(src))):
      ex = src.load(c)
      im = Image.fromarray(ex["image"])
      s = cell / max(im.size)
      im = im.resize((round(im.size[0] * s), round(im.size[1] * s)), Image.NEAREST)
      d = ImageDraw.Draw(im)
      names = []
      if draw_boxes:
        for b, l in zip(ex["boxes"] * s, ex["labels"]):
          d.rectangle(
            [float(b[0]), float(b[1]), float(b[2]) - 1, float(b[3]) - 1], outline=(0, 255, 0)
          )
          names.append(src.class_names[l])
      x0 = 70 + c * (cell + 4)
      grid.paste(im, (x0, y0))
      draw.text((x0, y0 + cell), ", ".join(sorted(set(names)))[:28], fill=(0, 0, 0))
  grid.save(path)
  return path

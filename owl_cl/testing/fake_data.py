"""Tiny fake ODinW / Objects365 / LVIS / Visual Genome folders in the real files' layout.

For tests (here and of code built on `owl_cl.data.odinw` / `owl_cl.data.pretraining`): each
writer creates, under a data root, the same folders, file names and json schema as the real
downloads (paths: `owl_cl.data.odinw` and `owl_cl.data.pretraining` module docstrings), with a
few small JPEG images whose objects are solid rectangles (one colour per class, on a grey
noise background) and whose annotations are those rectangles' boxes. Deterministic in `seed`.

* `write_fake_odinw(root, names=None, num_images=None, seed=0)`: GLIP ODinW-35 Roboflow exports
  (`annotations_without_background.json`: `info`, `licenses`, categories with ids from 1 and the
  removed category 0's name as `supercategory`, image ids from 0, `.rf.<hash>.jpg` file names,
  annotations with `area`, `segmentation: []`, `iscrowd: 0`); Dice in one `export/` folder with
  split-prefixed jsons; ChessPieces with its box-less category 1.
* `write_fake_glip(root, suite, names=None, num_images=None, seed=0)`: members of GLIP's
  ODinW-13 / ODinW-35 (`owl_cl.data.suites`) in GLIP's folder names, same json format, with
  made-up class names (`glip_category_names`).
* `write_fake_glip(..., variant='zira')`: ODinW-13 in ZiRa's / DitHub's folders
  (`suites.ODINW13_ZIRA`, train and test splits).
* `write_fake_coco2017(root, split='val', num_images=4, seed=0)`: COCO 2017
  (`coco/annotations/instances_<split>2017.json`, images in `coco/<split>2017/`) with a few
  of COCO's category ids and names (`FAKE_COCO_CATEGORIES`, ids not contiguous).
* `write_fake_objects365(root, num_images=None, seed=0)`: Objects365 v2
  (`objects365/annotations/zhiyuan_objv2_{train,val}.json`, file names
  `images/v1/patchN/objects365_v1_XXXXXXXX.jpg` stored as `objects365/{train,val}/patchN/...`),
  including categories that scenic forbids (LVIS-rare look-alikes).
* `write_fake_lvis(root, num_images=None, seed=0)`: LVIS v1 (`lvis/lvis_v1_{train,val}.json`;
  images without `file_name` but with `coco_url`, `neg_category_ids`,
  `not_exhaustive_category_ids`; categories with `frequency` r/c/f, `synonyms`, `synset`,
  `def`, `image_count`, `instance_count`), images in `coco/{train2017,val2017}/`.
* `write_fake_visual_genome(root, num_images=6, seed=0)`: `visual_genome/objects.json`,
  `visual_genome/image_data.json`, images in `visual_genome/VG_100K{,_2}/<image_id>.jpg`.

Each returns a dict describing what it wrote (paths, and per split the json content) so tests
can compare against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import json
import os
from typing import Any

import numpy as np
from PIL import Image

from owl_cl.data import odinw
from owl_cl.data import pretraining
from owl_cl.data import suites

__all__ = [
  "write_fake_odinw",
  "write_fake_glip",
  "glip_category_names",
  "write_fake_coco2017",
  "FAKE_COCO_CATEGORIES",
  "write_fake_objects365",
  "write_fake_lvis",
  "write_fake_visual_genome",
  "FAKE_O365_CATEGORIES",
  "FAKE_LVIS_CATEGORIES",
]

# A few real Objects365 v2 category names (ids as in zhiyuan_objv2): 'Dumbbell' and
# 'Hot-air balloon' match LVIS-rare names ('dumbbell', 'hot-air_balloon') and are forbidden.
FAKE_O365_CATEGORIES = (
  (1, "Person"),
  (3, "Car"),
  (9, "Bottle"),
  (85, "Cow"),
  (295, "Dumbbell"),
  (325, "Hot-air balloon"),
)

# (id, name, frequency, synonyms) of a few real LVIS v1 categories.
FAKE_LVIS_CATEGORIES = (
  (3, "aerosol_can", "c", ["aerosol_can", "spray_can"]),
  (12, "apple", "f", ["apple"]),
  (13, "applesauce", "r", ["applesauce"]),
  (35, "baboon", "r", ["baboon"]),
  (95, "bicycle", "f", ["bicycle"]),
  (1202, "zucchini", "c", ["zucchini", "courgette"]),
)


def _palette(k: int) -> tuple[int, int, int]:
  rng = np.random.default_rng(1000 + k)
  return tuple(int(v) for v in rng.integers(30, 226, size=3))


def _draw_image(
  path: str,
  height: int,
  width: int,
  boxes: Sequence[Sequence[float]],
  colours: Sequence[tuple[int, int, int]],
  rng: np.random.Generator,
) -> None:
  """Grey noise background with solid rectangles at integer xywh `boxes`; saved as JPEG."""
  img = rng.integers(100, 156, size=(height, width, 3)).astype(np.uint8)
  for (x, y, w, h), c in zip(boxes, colours):
    img[int(y) : int(y + h), int(x) : int(x + w)] = c
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(img).save(path, quality=95, subsampling=0)


def _random_boxes(rng: np.random.Generator, height: int, width: int, n: int) -> list[list[int]]:
  """n integer [x, y, w, h] boxes inside the image, each side >= 4 px."""
  out = []
  for _ in range(n):
    w = int(rng.integers(4, max(5, width // 2)))
    h = int(rng.integers(4, max(5, height // 2)))
    x = int(rng.integers(0, width - w + 1))
    y = int(rng.integers(0, height - h + 1))
    out.append([x, y, w, h])
  return out


def _split_counts(
  num_images: Any, splits: Sequence[str], default: dict[str, int]
) -> dict[str, int]:
  if num_images is None:
    return {s: default[s] for s in splits}
  if isinstance(num_images, int):
    return {s: num_images for s in splits}
  return {s: int(num_images.get(s, default[s])) for s in splits}


def _write_json(path: str, data: dict) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f)


# ------------------------------------------------------------------------------------------
# ODinW
# ------------------------------------------------------------------------------------------
def write_fake_odinw(
  root: str,
  names: Iterable[str] | None = None,
  num_images: Any = None,
  seed: int = 0,
  image_size: tuple[int, int] = (24, 48),
) -> dict[str, dict[str, dict[str, Any]]]:
  """Write fake ODinW datasets under `root/odinw/` in GLIP's ODinW-35 layout.

  Args:
    root: data root (the folder that will hold `odinw/`).
    names: keys of `owl_cl.data.odinw.ODINW_DATASETS` (default: all 15).
    num_images: images per split: int, dict split -> int, or None (train 8, val 3, test 4).
    seed: int; everything written is a function of (names, num_images, seed).
    image_size: (min, max) side length in pixels.

  Returns:
    {name: {split: dict(annotation_file, image_dir, json=<the written dict>)}}.

  Every class of a dataset appears in its training split when the split has at least
  ceil(C / 3) images (classes are assigned round-robin, 1-3 boxes per image); the box-less
  categories of `exclude_category_ids` get no boxes.
  """
  names = list(odinw.ODINW_NAMES if names is None else names)
  counts = _split_counts(num_images, odinw.SPLITS, dict(train=8, val=3, test=4))
  out: dict[str, dict[str, dict[str, Any]]] = {}
  for d, name in enumerate(names):
    spec = odinw.odinw_spec(name)
    cats = [
      dict(id=i, name=n, supercategory=spec.supercategory)
      for i, n in enumerate(spec.category_names, start=1)
    ]
    usable = [c["id"] for c in cats if c["id"] not in spec.exclude_category_ids]
    out[name] = {}
    for s, split in enumerate(odinw.SPLITS):
      rng = np.random.default_rng([seed, d, s])
      ann_rel, img_rel = spec.paths(split)
      out[name][split] = _write_roboflow_split(
        os.path.join(root, ann_rel),
        os.path.join(root, img_rel),
        name,
        split,
        cats,
        usable,
        counts[split],
        rng,
        image_size,
      )
  return out


def _write_roboflow_split(
  ann_path: str,
  img_dir: str,
  name: str,
  split: str,
  cats: list[dict],
  usable: Sequence[int],
  count: int,
  rng: np.random.Generator,
  image_size: tuple[int, int],
) -> dict[str, Any]:
  """One split of a Roboflow export (`write_fake_odinw`'s format): `count` JPEGs in `img_dir`
  and the json `ann_path`; classes `usable` assigned round-robin, 1-3 boxes per image.

  Returns:
    dict(annotation_file, image_dir, json=<the written dict>).
  """
  images, annotations = [], []
  next_cat = 0
  for k in range(count):
    h, w = (int(v) for v in rng.integers(image_size[0], image_size[1] + 1, size=2))
    file_name = f"{split}_{k:04d}_jpg.rf.{rng.integers(16**8):08x}.jpg"
    images.append(
      dict(
        id=k,
        license=1,
        file_name=file_name,
        height=h,
        width=w,
        date_captured="2021-01-01T00:00:00+00:00",
      )
    )
    boxes = _random_boxes(rng, h, w, int(rng.integers(1, 4)))
    colours = []
    for b in boxes:
      cid = usable[next_cat % len(usable)]
      next_cat += 1
      colours.append(_palette(cid))
      annotations.append(
        dict(
          id=len(annotations),
          image_id=k,
          category_id=cid,
          bbox=b,
          area=b[2] * b[3],
          segmentation=[],
          iscrowd=0,
        )
      )
    _draw_image(os.path.join(img_dir, file_name), h, w, boxes, colours, rng)
  data = dict(
    info=dict(
      year="2021",
      version="1",
      description="Exported from roboflow.ai",
      contributor="",
      url=f"https://public.roboflow.ai/object-detection/{name}",
      date_created="2021-01-01T00:00:00+00:00",
    ),
    licenses=[
      dict(id=1, url="https://creativecommons.org/publicdomain/zero/1.0/", name="Public Domain")
    ],
    categories=cats,
    images=images,
    annotations=annotations,
  )
  _write_json(ann_path, data)
  return dict(annotation_file=ann_path, image_dir=img_dir, json=data)


def glip_category_names(name: str, num_classes: int = 2) -> list[str]:
  """The fake class names of GLIP member `name`: '<first word of name, lower case> <k>'."""
  stem = name.split("_")[0].lower()
  return [f"{stem} {k}" for k in range(1, num_classes + 1)]


def write_fake_glip(
  root: str,
  suite: str = "odinw13",
  names: Iterable[str] | None = None,
  num_images: Any = None,
  seed: int = 0,
  image_size: tuple[int, int] = (24, 48),
  num_classes: int = 2,
  variant: str | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
  """Write fake members of GLIP's ODinW-13 / ODinW-35 under `root/odinw/` in GLIP's folders.

  The folders and json names are those of `owl_cl.data.suites` (GLIP's `DATASETS.REGISTER`:
  a folder per split with `annotations_without_background.json`; 'export' members with every
  image in one folder and `<split>_annotations_without_background.json`; PascalVOC's test split
  is its valid folder, written once). Each member gets `num_classes` categories with ids from
  1 named by `glip_category_names` (GLIP's real class lists are not reproduced), in the
  Roboflow format of `write_fake_odinw`. `variant='zira'` writes ODinW-13 in ZiRa's / DitHub's
  folders instead (`suites.ODINW13_ZIRA`: train and test splits; docs/ivlod.md).

  Args:
    root: data root (the folder that will hold `odinw/`).
    suite: 'odinw13' | 'odinw35'. names: members (the suite's names; default all).
    num_images: images per split: int, dict split -> int, or None (train 4, val 2, test 2).
    seed: int; everything written is a function of the arguments.
    image_size: (min, max) side length in pixels. num_classes: categories per member.
    variant: suite 'odinw13': a key of `suites.ODINW13_VARIANTS` (None: 'glip').

  Returns:
    {name: {split: dict(annotation_file, image_dir, json=<the written dict>)}}.

  Raises:
    DataError: an unknown suite or member (`suites.suite_entries`).
  """
  if suite not in ("odinw13", "odinw35"):
    raise ValueError(f"suite must be 'odinw13' or 'odinw35', got {suite!r}")
  entries = suites.suite_entries(
    suite, root, names=None if names is None else list(names), variant=variant
  )
  counts = _split_counts(num_images, odinw.SPLITS, dict(train=4, val=2, test=2))
  out: dict[str, dict[str, dict[str, Any]]] = {}
  for d, entry in enumerate(entries):
    cats = [
      dict(id=i, name=n, supercategory="none")
      for i, n in enumerate(glip_category_names(entry.name, num_classes), start=1)
    ]
    usable = [c["id"] for c in cats if c["id"] not in entry.exclude_category_ids]
    out[entry.name] = {}
    for s, split in enumerate(odinw.SPLITS):
      if split not in entry.split_names:
        continue
      spec = entry.split(split)
      same = [w for w in out[entry.name].values() if w["annotation_file"] == spec.annotation_file]
      if same:  # PascalVOC: the test split is the valid folder
        out[entry.name][split] = same[0]
        continue
      out[entry.name][split] = _write_roboflow_split(
        spec.annotation_file,
        spec.image_dir,
        entry.name,
        split,
        cats,
        usable,
        counts[split],
        np.random.default_rng([seed, d, s]),
        image_size,
      )
  return out


# ------------------------------------------------------------------------------------------
# COCO 2017
# ------------------------------------------------------------------------------------------
# A few of COCO 2017's categories (id, name, supercategory): the ids are not contiguous, as in
# instances_val2017.json (80 classes with ids 1..90).
FAKE_COCO_CATEGORIES = (
  (1, "person", "person"),
  (3, "car", "vehicle"),
  (90, "toothbrush", "indoor"),
)


def write_fake_coco2017(
  root: str,
  split: str = "val",
  num_images: int = 4,
  seed: int = 0,
  image_size: tuple[int, int] = (24, 48),
) -> dict[str, Any]:
  """Write a fake COCO 2017 split under `root/coco/` in the layout of `pretraining.coco_paths`.

  Args:
    root: data root (the folder that will hold `coco/`).
    split: 'train' | 'val'. num_images: images written (>= 1).
    seed: int; everything written is a function of the arguments.
    image_size: (min, max) side length in pixels.

  Returns:
    dict(annotation_file, image_dir, json=<the written dict>).

  Raises:
    ValueError: an unknown split (`pretraining.coco_paths`).
  """
  ann, img = pretraining.coco_paths(root, split)
  cats = [dict(id=i, name=n, supercategory=s) for i, n, s in FAKE_COCO_CATEGORIES]
  usable = [c["id"] for c in cats]
  rng = np.random.default_rng([seed, 2017])
  return _write_roboflow_split(ann, img, "coco", split, cats, usable, num_images, rng, image_size)


# ------------------------------------------------------------------------------------------
# Objects365
# ------------------------------------------------------------------------------------------
def write_fake_objects365(
  root: str, num_images: Any = None, seed: int = 0, image_size: tuple[int, int] = (24, 48)
) -> dict[str, dict[str, Any]]:
  """Write a fake Objects365 v2 under `root/objects365/` (layout: `owl_cl.data.pretraining`).

  Args:
    root: data root. num_images: int, dict split -> int ('train', 'val') or None (8 / 4).
    seed: int. image_size: (min, max) side in pixels.

  Returns:
    {split: dict(annotation_file, image_dir, json)}. Every image has 1-4 boxes; categories
    (`FAKE_O365_CATEGORIES`) are assigned round-robin so each appears, forbidden ones included.
  """
  counts = _split_counts(num_images, ("train", "val"), dict(train=8, val=4))
  cats = [dict(id=i, name=n) for i, n in FAKE_O365_CATEGORIES]
  out = {}
  next_image_id = 420917
  for s, split in enumerate(("train", "val")):
    rng = np.random.default_rng([seed, 365, s])
    ann_path, img_dir = pretraining.objects365_paths(root, split)
    images, annotations = [], []
    next_cat = 0
    for k in range(counts[split]):
      h, w = (int(v) for v in rng.integers(image_size[0], image_size[1] + 1, size=2))
      image_id = next_image_id
      next_image_id += 1 + int(rng.integers(0, 5))
      version = "v1" if split == "train" else "v2"
      patch = k % 2 + (0 if split == "train" else 16)
      file_name = f"images/{version}/patch{patch}/objects365_{version}_{image_id:08d}.jpg"
      images.append(dict(height=h, id=image_id, license=5, width=w, file_name=file_name, url=""))
      boxes = _random_boxes(rng, h, w, int(rng.integers(1, 5)))
      colours = []
      for b in boxes:
        cid = cats[next_cat % len(cats)]["id"]
        next_cat += 1
        colours.append(_palette(cid))
        annotations.append(
          dict(
            id=len(annotations) + 51,
            iscrowd=0,
            isfake=0,
            area=float(b[2] * b[3]),
            isreflected=0,
            bbox=[float(v) for v in b],
            image_id=image_id,
            category_id=cid,
          )
        )
      path = os.path.join(img_dir, pretraining.objects365_relative_path(images[-1]))
      _draw_image(path, h, w, boxes, colours, rng)
    data = dict(
      images=images,
      annotations=annotations,
      categories=cats,
      licenses=[dict(name="", id=5, url="")],
    )
    _write_json(ann_path, data)
    out[split] = dict(annotation_file=ann_path, image_dir=img_dir, json=data)
  return out


# ------------------------------------------------------------------------------------------
# LVIS
# ------------------------------------------------------------------------------------------
def write_fake_lvis(
  root: str, num_images: Any = None, seed: int = 0, image_size: tuple[int, int] = (24, 48)
) -> dict[str, dict[str, Any]]:
  """Write a fake LVIS v1 under `root/lvis/` with COCO 2017 images under `root/coco/`.

  Args:
    root: data root. num_images: int, dict split -> int ('train', 'val') or None (8 / 4).
    seed: int. image_size: (min, max) side in pixels.

  Returns:
    {split: dict(annotation_file, image_dir, json)}. As in LVIS v1 val, some val images live in
    `train2017/` (their `coco_url` says so). Per image: 1-3 boxes of categories assigned
    round-robin over `FAKE_LVIS_CATEGORIES`; `neg_category_ids` = one category not in the
    image; `not_exhaustive_category_ids` = the first annotated category on every third image.
  """
  counts = _split_counts(num_images, ("train", "val"), dict(train=8, val=4))
  out = {}
  used = 1
  for s, split in enumerate(("train", "val")):
    rng = np.random.default_rng([seed, 1203, s])
    ann_path, img_dir = pretraining.lvis_paths(root, split)
    images, annotations = [], []
    image_count = {c[0]: set() for c in FAKE_LVIS_CATEGORIES}
    instance_count = {c[0]: 0 for c in FAKE_LVIS_CATEGORIES}
    next_cat = 0
    for k in range(counts[split]):
      h, w = (int(v) for v in rng.integers(image_size[0], image_size[1] + 1, size=2))
      image_id = 100 * used + int(rng.integers(0, 100))
      used += 1
      folder = "val2017" if (split == "val" and k % 2 == 0) else "train2017"
      url = f"http://images.cocodataset.org/{folder}/{image_id:012d}.jpg"
      boxes = _random_boxes(rng, h, w, int(rng.integers(1, 4)))
      colours, cids = [], []
      for b in boxes:
        cid = FAKE_LVIS_CATEGORIES[next_cat % len(FAKE_LVIS_CATEGORIES)][0]
        next_cat += 1
        cids.append(cid)
        colours.append(_palette(cid))
        x, y, bw, bh = (float(v) for v in b)
        annotations.append(
          dict(
            id=len(annotations) + 1,
            image_id=image_id,
            category_id=cid,
            bbox=[x, y, bw, bh],
            area=bw * bh,
            segmentation=[[x, y, x + bw, y, x + bw, y + bh, x, y + bh]],
          )
        )
        image_count[cid].add(image_id)
        instance_count[cid] += 1
      absent = [c[0] for c in FAKE_LVIS_CATEGORIES if c[0] not in cids]
      neg = [absent[int(rng.integers(len(absent)))]] if absent else []
      images.append(
        dict(
          id=image_id,
          width=w,
          height=h,
          license=1,
          date_captured="",
          flickr_url=f"http://farm1.staticflickr.com/{image_id}.jpg",
          coco_url=url,
          neg_category_ids=neg,
          not_exhaustive_category_ids=[cids[0]] if k % 3 == 0 else [],
        )
      )
      _draw_image(os.path.join(img_dir, folder, f"{image_id:012d}.jpg"), h, w, boxes, colours, rng)
    cats = [
      dict(
        id=i,
        name=n,
        frequency=f,
        synonyms=syn,
        synset=f"{n}.n.01",
        **{"def": f"definition of {n}"},
        image_count=len(image_count[i]),
        instance_count=instance_count[i],
      )
      for i, n, f, syn in FAKE_LVIS_CATEGORIES
    ]
    data = dict(
      info=dict(description="LVIS v1 (fake)", version="1.0", year=2020),
      licenses=[dict(id=1, name="", url="")],
      images=images,
      annotations=annotations,
      categories=cats,
    )
    _write_json(ann_path, data)
    out[split] = dict(annotation_file=ann_path, image_dir=img_dir, json=data)
  return out


# ------------------------------------------------------------------------------------------
# Visual Genome
# ------------------------------------------------------------------------------------------
FAKE_VG_NAMES = ("tree", "man", "shirt", "window", "wind chimes", "Sky")


def write_fake_visual_genome(
  root: str, num_images: int = 6, seed: int = 0, image_size: tuple[int, int] = (24, 48)
) -> dict[str, Any]:
  """Write a fake Visual Genome v1.4 under `root/visual_genome/`.

  `image_data.json`: list of {image_id, width, height, url, coco_id, flickr_id};
  `objects.json`: list of {image_id, image_url, objects: [{object_id, x, y, w, h, names,
  synsets}]}; images in `VG_100K/` (odd ids) and `VG_100K_2/` (even ids) as `<image_id>.jpg`.
  Names include 'wind chimes' (forbidden by scenic) and 'Sky' (case); one object of image 1
  has two names.

  Returns dict(objects_file, image_data_file, image_dir, objects, image_data).
  """
  rng = np.random.default_rng([seed, 108077])
  paths = pretraining.visual_genome_paths(root)
  image_data, objects = [], []
  next_name, next_object = 0, 1058549
  for k in range(num_images):
    image_id = k + 1
    h, w = (int(v) for v in rng.integers(image_size[0], image_size[1] + 1, size=2))
    folder = "VG_100K" if image_id % 2 else "VG_100K_2"
    url = f"https://cs.stanford.edu/people/rak248/{folder}/{image_id}.jpg"
    image_data.append(
      dict(width=w, url=url, height=h, image_id=image_id, coco_id=None, flickr_id=None)
    )
    boxes = _random_boxes(rng, h, w, int(rng.integers(1, 4)))
    objs, colours = [], []
    for j, (x, y, bw, bh) in enumerate(boxes):
      name = FAKE_VG_NAMES[next_name % len(FAKE_VG_NAMES)]
      next_name += 1
      names = [name, "plant"] if (image_id == 1 and j == 0) else [name]
      objs.append(
        dict(
          synsets=[f"{name.lower().replace(' ', '_')}.n.01"],
          h=bh,
          object_id=next_object,
          names=names,
          w=bw,
          y=y,
          x=x,
        )
      )
      next_object += 1
      colours.append(_palette(FAKE_VG_NAMES.index(name)))
    objects.append(dict(image_id=image_id, objects=objs, image_url=url))
    _draw_image(
      os.path.join(paths["image_dir"], folder, f"{image_id}.jpg"), h, w, boxes, colours, rng
    )
  _write_json(paths["image_data_file"], image_data)
  _write_json(paths["objects_file"], objects)
  return dict(paths, objects=objects, image_data=image_data)

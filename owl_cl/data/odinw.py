"""The 15 ODinW datasets of the paper, in GLIP's ODinW-35 COCO layout.

Public API (used by the paper protocol; keep these names):

* `ODINW_DATASETS`: dict name -> `OdinwSpec` in the paper's table order (docs/reference.md §10):
Pothole,
  WildfireSmoke, ThermalCheetah, ThermalDogsAndPeople, BCCD, ShellfishOpenImages, EgoHands
  (specific), AerialMaritimeDrone (tiled), BrackishUnderwater, Dice (mediumColor), Aquarium,
  ChessPieces, AmericanSignLanguageLetters, Plantdoc (416x416), OxfordPets (by-breed).
* `ODINW_NAMES`: the 15 names in that order.
* `odinw_source(root, name, split, *, subset_seed=0, **coco_options) -> CocoSource`.
* `balanced_subset(source, size, seed) -> list[int]` (image ids).
* `expected_files(root, names) -> list[str]`, `missing_files(root, names) -> list[str]`,
  `check_odinw(root, names)` (raises one `DataError` listing every missing file),
  `layout_description(names) -> str` (the folder tree a user must provide).

Layout. `root` is the data root that holds the `odinw/` folder (GLIP's `DATASET/` folder; the
released code's `data/`), exactly as GLIP's `configs/odinw_35/*.yaml` register it, e.g.
`<root>/odinw/AerialMaritimeDrone/tiled/train/annotations_without_background.json` with the
images next to it in `<root>/odinw/AerialMaritimeDrone/tiled/train/`. Splits are `train`,
`val` (folder `valid/`) and `test`. Two datasets differ: Dice (`dice/mediumColor/export/`
holds all images and `{train,val,test}_annotations_without_background.json`), and
BrackishUnderwater, whose variant is `1920x1080` as in the released code
(`data/add_wh_and_non_excl.py`; docs/reference.md §10) although GLIP's ODinW-35 config registers
`960x540` (both are in the downloaded `brackishUnderwater.zip`; pass `variant` to
`odinw_source` for the other one).

The `annotations_without_background.json` files are Roboflow COCO exports from which GLIP
removed Roboflow's category 0 (the dataset-level supercategory, e.g. `{"id": 0, "name":
"potholes", "supercategory": "none"}`); category ids start at 1 and every category carries the
former category 0's name as `supercategory`. Image ids start at 0. ChessPieces keeps a
category 1 (GLIP names it '  ', supercategory 'pieces') that has no boxes: it is excluded here
(`exclude_category_ids`), as the released code drops it from its class list
(`data/odinw_ds_info.py`), leaving the 12 piece classes.

Balanced subsets (paper Table "Datasets", marked *): EgoHands 1000, BrackishUnderwater 800,
AmericanSignLanguageLetters 780 training images. The released code loads them from
`data/subsets/<name>_0.pkl`, which it does not publish, so "balanced" is defined here
(`balanced_subset`): classes take turns, in a seeded random order, and each turn adds one not
yet chosen training image that contains the class (drawn uniformly among them); a class with no
image left drops out; images without boxes are only used once all classes are exhausted. The
number of images chosen "for" each class therefore differs by at most one while every class
still has images (780 = 26 letters x 30 for AmericanSignLanguageLetters, 1000 = 4 x 250 for
EgoHands, 800 = 6 x 133.3 for BrackishUnderwater). Only the training split is subsetted; a
dataset whose training split is not larger than the subset size is used whole.

Source: docs/reference.md §10; paper supplementary (Datasets table); GLIP `configs/odinw_35/*.yaml`
(folders, json names, categories); released code `data/add_wh_and_non_excl.py` (the variants
it trained on), `main.py` (top-100 detections for EgoHands and BrackishUnderwater).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import dataclasses
import os

import numpy as np

from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError

__all__ = [
  "OdinwSpec",
  "ODINW_DATASETS",
  "ODINW_NAMES",
  "SPLITS",
  "odinw_spec",
  "odinw_paths",
  "odinw_source",
  "balanced_subset",
  "expected_files",
  "missing_files",
  "check_odinw",
  "layout_description",
]

SPLITS = ("train", "val", "test")
_ANN = "annotations_without_background.json"


@dataclasses.dataclass(frozen=True)
class OdinwSpec:
  """One ODinW dataset.

  Attributes:
    name: the registry key (paper's name, CamelCase).
    folder: GLIP's dataset folder under `odinw/` (e.g. 'pothole', 'AerialMaritimeDrone').
    variant: the export folder under it ('' when the splits sit directly in `folder`).
    single_folder: True when all splits share one image folder with split-prefixed jsons
      (Dice's `export/`).
    category_names: the category names of the json, in id order 1..C (GLIP's
      OVERRIDE_CATEGORY; ids are 1-based).
    supercategory: the supercategory every category carries (Roboflow's removed category 0).
    exclude_category_ids: category ids without boxes that are not classes (ChessPieces: 1).
    subset_size: size of the balanced training subset (None: the whole training split).
    num_train, num_test: image counts of the paper's Datasets table (num_train after
      subsetting).
    max_detections: detections kept per image at evaluation (docs/reference.md §4: 100 for
      EgoHands and BrackishUnderwater, 300 otherwise).
  """

  name: str
  folder: str
  variant: str
  category_names: tuple[str, ...]
  supercategory: str
  num_train: int
  num_test: int
  single_folder: bool = False
  exclude_category_ids: tuple[int, ...] = ()
  subset_size: int | None = None
  max_detections: int = 300

  @property
  def num_classes(self) -> int:
    """C, classes after `exclude_category_ids`."""
    return len(self.category_names) - len(self.exclude_category_ids)

  @property
  def base_dir(self) -> str:
    """The dataset's folder relative to the data root, e.g. 'odinw/pothole'."""
    return "/".join(p for p in ("odinw", self.folder, self.variant) if p)

  def paths(self, split: str) -> tuple[str, str]:
    """(annotation json, image folder) of `split`, relative to the data root.

    Raises:
      ValueError: split not in ('train', 'val', 'test').
    """
    if split not in SPLITS:
      raise ValueError(f"{self.name}: split must be one of {SPLITS}, got {split!r}")
    if self.single_folder:
      return f"{self.base_dir}/{split}_{_ANN}", self.base_dir
    folder = f"{self.base_dir}/{'valid' if split == 'val' else split}"
    return f"{folder}/{_ANN}", folder


def _letters() -> tuple[str, ...]:
  return tuple(chr(ord("A") + i) for i in range(26))


_PETS = (
  "cat-Abyssinian",
  "cat-Bengal",
  "cat-Birman",
  "cat-Bombay",
  "cat-British_Shorthair",
  "cat-Egyptian_Mau",
  "cat-Maine_Coon",
  "cat-Persian",
  "cat-Ragdoll",
  "cat-Russian_Blue",
  "cat-Siamese",
  "cat-Sphynx",
  "dog-american_bulldog",
  "dog-american_pit_bull_terrier",
  "dog-basset_hound",
  "dog-beagle",
  "dog-boxer",
  "dog-chihuahua",
  "dog-english_cocker_spaniel",
  "dog-english_setter",
  "dog-german_shorthaired",
  "dog-great_pyrenees",
  "dog-havanese",
  "dog-japanese_chin",
  "dog-keeshond",
  "dog-leonberger",
  "dog-miniature_pinscher",
  "dog-newfoundland",
  "dog-pomeranian",
  "dog-pug",
  "dog-saint_bernard",
  "dog-samoyed",
  "dog-scottish_terrier",
  "dog-shiba_inu",
  "dog-staffordshire_bull_terrier",
  "dog-wheaten_terrier",
  "dog-yorkshire_terrier",
)

_PLANTDOC = (
  "Apple Scab Leaf",
  "Apple leaf",
  "Apple rust leaf",
  "Bell_pepper leaf",
  "Bell_pepper leaf spot",
  "Blueberry leaf",
  "Cherry leaf",
  "Corn Gray leaf spot",
  "Corn leaf blight",
  "Corn rust leaf",
  "Peach leaf",
  "Potato leaf",
  "Potato leaf early blight",
  "Potato leaf late blight",
  "Raspberry leaf",
  "Soyabean leaf",
  "Soybean leaf",
  "Squash Powdery mildew leaf",
  "Strawberry leaf",
  "Tomato Early blight leaf",
  "Tomato Septoria leaf spot",
  "Tomato leaf",
  "Tomato leaf bacterial spot",
  "Tomato leaf late blight",
  "Tomato leaf mosaic virus",
  "Tomato leaf yellow virus",
  "Tomato mold leaf",
  "Tomato two spotted spider mites leaf",
  "grape leaf",
  "grape leaf black rot",
)

_CHESS = (
  "  ",
  "black bishop",
  "black king",
  "black knight",
  "black pawn",
  "black queen",
  "black rook",
  "white bishop",
  "white king",
  "white knight",
  "white pawn",
  "white queen",
  "white rook",
)

_SPECS = (
  OdinwSpec("Pothole", "pothole", "", ("pothole",), "potholes", 465, 67),
  OdinwSpec("WildfireSmoke", "WildfireSmoke", "", ("smoke",), "Smoke", 516, 74),
  OdinwSpec("ThermalCheetah", "ThermalCheetah", "", ("cheetah", "human"), "cheetah", 90, 14),
  OdinwSpec(
    "ThermalDogsAndPeople", "thermalDogsAndPeople", "", ("dog", "person"), "dogs-person", 142, 20
  ),
  OdinwSpec("BCCD", "BCCD", "BCCD.v3-raw.coco", ("Platelets", "RBC", "WBC"), "cells", 255, 36),
  OdinwSpec(
    "ShellfishOpenImages",
    "ShellfishOpenImages",
    "raw",
    ("Crab", "Lobster", "Shrimp"),
    "shellfish",
    407,
    58,
  ),
  OdinwSpec(
    "EgoHands",
    "EgoHands",
    "specific",
    ("myleft", "myright", "yourleft", "yourright"),
    "hands",
    1000,
    480,
    subset_size=1000,
    max_detections=100,
  ),
  OdinwSpec(
    "AerialMaritimeDrone",
    "AerialMaritimeDrone",
    "tiled",
    ("boat", "car", "dock", "jetski", "lift"),
    "movable-objects",
    371,
    32,
  ),
  OdinwSpec(
    "BrackishUnderwater",
    "brackishUnderwater",
    "1920x1080",
    ("crab", "fish", "jellyfish", "shrimp", "small_fish", "starfish"),
    "animals",
    800,
    1468,
    subset_size=800,
    max_detections=100,
  ),
  OdinwSpec(
    "Dice",
    "dice",
    "mediumColor/export",
    ("1", "2", "3", "4", "5", "6"),
    "dice",
    576,
    71,
    single_folder=True,
  ),
  OdinwSpec(
    "Aquarium",
    "Aquarium",
    "Aquarium Combined.v2-raw-1024.coco",
    ("fish", "jellyfish", "penguin", "puffin", "shark", "starfish", "stingray"),
    "creatures",
    448,
    63,
  ),
  OdinwSpec(
    "ChessPieces",
    "ChessPieces",
    "Chess Pieces.v23-raw.coco",
    _CHESS,
    "pieces",
    202,
    29,
    exclude_category_ids=(1,),
  ),
  OdinwSpec(
    "AmericanSignLanguageLetters",
    "AmericanSignLanguageLetters",
    "American Sign Language Letters.v1-v1.coco",
    _letters(),
    "Letters",
    780,
    72,
    subset_size=780,
  ),
  OdinwSpec("Plantdoc", "plantdoc", "416x416", _PLANTDOC, "leaves", 2128, 239),
  OdinwSpec("OxfordPets", "OxfordPets", "by-breed", _PETS, "pets", 2437, 345),
)

ODINW_DATASETS: dict[str, OdinwSpec] = {s.name: s for s in _SPECS}
ODINW_NAMES: tuple[str, ...] = tuple(ODINW_DATASETS)


def odinw_spec(name: str) -> OdinwSpec:
  """The spec of dataset `name`.

  Raises:
    KeyError: unknown name (the message lists the known ones).
  """
  try:
    return ODINW_DATASETS[name]
  except KeyError:
    raise KeyError(f"unknown ODinW dataset {name!r}; known: {', '.join(ODINW_NAMES)}") from None


def _names(names: Iterable[str] | None) -> list[str]:
  if names is None:
    return list(ODINW_NAMES)
  if isinstance(names, str):
    names = [names]
  names = list(names)
  for n in names:
    odinw_spec(n)
  return names


def odinw_paths(root: str, name: str, split: str, *, variant: str | None = None) -> tuple[str, str]:
  """(annotation json, image folder) absolute paths of `split` of dataset `name` under `root`.

  `variant` overrides the spec's export folder (e.g. '960x540' for BrackishUnderwater).
  """
  spec = odinw_spec(name)
  if variant is not None:
    spec = dataclasses.replace(spec, variant=variant)
  ann, img = spec.paths(split)
  return os.path.join(root, ann), os.path.join(root, img)


def balanced_subset(source: CocoSource, size: int, seed: int) -> list[int]:
  """Class-balanced subset of `size` image ids of `source` (definition: module docstring).

  Args:
    source: the full training split.
    size: number of images to keep (>= 0); all images when size >= len(source).
    seed: int; the subset is a pure function of (the source's annotations, size, seed).

  Returns:
    list of `size` distinct COCO image ids, ascending.

  Source: paper supplementary (Datasets table: balanced subsets); definition documented here
  because the released code's subset files are not published.
  """
  if size < 0:
    raise ValueError(f"size must be >= 0, got {size}")
  n = len(source)
  if size >= n:
    return list(source.image_ids)
  rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xBA1A]))
  per_class: list[list[int]] = [[] for _ in range(source.num_classes)]
  for i in range(n):
    for c in np.unique(source.targets(i)["labels"]):
      per_class[int(c)].append(i)
  pools = [list(rng.permutation(p)) for p in per_class]
  order = [int(c) for c in rng.permutation(source.num_classes)]
  chosen: list[int] = []
  taken = np.zeros(n, bool)
  while len(chosen) < size:
    active = False
    for c in order:
      pool = pools[c]
      while pool and taken[pool[-1]]:
        pool.pop()
      if not pool:
        continue
      active = True
      i = int(pool.pop())
      taken[i] = True
      chosen.append(i)
      if len(chosen) == size:
        break
    if not active:
      break
  if len(chosen) < size:  # every class exhausted: fill with images without boxes
    rest = rng.permutation(np.nonzero(~taken)[0])[: size - len(chosen)]
    chosen.extend(int(i) for i in rest)
  return sorted(source.image_ids[i] for i in chosen)


def odinw_source(
  root: str,
  name: str,
  split: str,
  *,
  subset_seed: int | None = 0,
  subset_size: int | None = None,
  variant: str | None = None,
  **coco_options,
) -> CocoSource:
  """The `split` of ODinW dataset `name` as a `CocoSource`.

  Args:
    root: data root holding `odinw/` (see the module docstring).
    name: a key of `ODINW_DATASETS`.
    split: 'train', 'val' or 'test'.
    subset_seed: seed of the balanced training subset for EgoHands / BrackishUnderwater /
      AmericanSignLanguageLetters (`balanced_subset`); None uses the whole training split.
      Ignored for other datasets and splits.
    subset_size: overrides the spec's subset size (e.g. small sizes for tests on fake data);
      also enables subsetting for datasets without one. None: the spec's.
    variant: overrides the export folder (e.g. '960x540' for BrackishUnderwater).
    **coco_options: passed to `CocoSource` (check_files, on_invalid, cache_images, ...).

  Returns:
    CocoSource named `name` (train) or `name/split`; classes in category id order without
    `exclude_category_ids`.

  Raises:
    KeyError: unknown name. ValueError: unknown split.
    DataError: missing json / image folder / image, malformed json (names file, field, value),
      or a category list that differs from the spec's (names the json and both lists).
  """
  spec = odinw_spec(name)
  ann, img = odinw_paths(root, name, split, variant=variant)
  if not os.path.isfile(ann):
    raise DataError(
      f"ODinW {name} {split}: annotation file not found: {ann}\n"
      f"expected layout:\n{layout_description([name])}"
    )
  label = name if split == "train" else f"{name}/{split}"
  source = CocoSource(
    ann, img, label, exclude_category_ids=spec.exclude_category_ids, **coco_options
  )
  expected = [
    n for i, n in enumerate(spec.category_names, start=1) if i not in spec.exclude_category_ids
  ]
  if source.class_names != expected:
    raise DataError(
      f"{ann}: field 'categories' has names {source.class_names!r} (ids "
      f"{source.category_ids}), expected {expected!r} for ODinW {name}"
    )
  size = spec.subset_size if subset_size is None else subset_size
  if split == "train" and size is not None and subset_seed is not None:
    ids = balanced_subset(source, size, subset_seed)
    if len(ids) < len(source):
      source = source.subset(ids, name=name)
  return source


def expected_files(
  root: str, names: Iterable[str] | None = None, splits: Sequence[str] = SPLITS
) -> list[str]:
  """Paths (under `root`) of every annotation json and image folder the datasets need.

  Image files are listed by `CocoSource` when it opens a json (check_files=True).
  Returns a sorted list of unique absolute paths.
  """
  out = set()
  for n in _names(names):
    for split in splits:
      out.update(odinw_paths(root, n, split))
  return sorted(out)


def missing_files(
  root: str, names: Iterable[str] | None = None, splits: Sequence[str] = SPLITS
) -> list[str]:
  """The subset of `expected_files(root, names, splits)` that does not exist (sorted)."""
  return [p for p in expected_files(root, names, splits) if not os.path.exists(p)]


def check_odinw(
  root: str, names: Iterable[str] | None = None, splits: Sequence[str] = SPLITS
) -> None:
  """Raise one `DataError` listing every missing json / folder (and the expected layout)."""
  missing = missing_files(root, names, splits)
  if missing:
    raise DataError(
      f"ODinW under {root}: {len(missing)} missing path(s):\n  "
      + "\n  ".join(missing)
      + f"\nexpected layout:\n{layout_description(names)}"
    )


def layout_description(names: Iterable[str] | None = None) -> str:
  """Human-readable folder tree (relative to the data root) of the given datasets."""
  lines = [
    "<root>/  (GLIP ODinW-35 layout; download: "
    "https://vlpdatasets.blob.core.windows.net/odinw/odinw/odinw_35/<folder>.zip, "
    "unzip into <root>/odinw/)"
  ]
  for n in _names(names):
    spec = odinw_spec(n)
    extra = []
    if spec.subset_size:
      extra.append(f"balanced {spec.subset_size}-image training subset")
    if spec.exclude_category_ids:
      extra.append(f"category ids {list(spec.exclude_category_ids)} excluded")
    lines.append(f"  {n}: {spec.num_classes} classes" + (f" ({'; '.join(extra)})" if extra else ""))
    for split in SPLITS:
      ann, img = spec.paths(split)
      lines.append(f"    {split:5s} {ann}  (images in {img}/)")
  return "\n".join(lines)

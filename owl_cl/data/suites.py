"""Named suites: lists of `DatasetEntry` for well-known dataset collections.

* 'odinw_paper' (alias 'odinw15'): the paper's 15 ODinW datasets (`owl_cl.data.odinw`
  registry, its order; kind 'odinw', so each loads exactly as the paper protocol loads it:
  same folders, class check, balanced training subsets, max detections).
* 'odinw35': GLIP's ODinW-35, the 35 configs of `configs/odinw_35/_all.json` of
  microsoft/GLIP, named by their config file stem (e.g. 'AerialMaritimeDrone_large'), with
  the folders and annotation files its `DATASETS.REGISTER` train / val / test entries name.
* 'odinw13': GLIP's ODinW-13, the 13 configs of `configs/odinw_13/` of microsoft/GLIP; with
  `variant='zira'` the ODinW-13 of the IVLOD papers (ZiRa NeurIPS'24, DitHub NeurIPS'25):
  other exports of 5 of the 13 datasets, train and test splits (`ODINW13_ZIRA`,
  docs/ivlod.md).
* 'builtin': the downstream datasets of a generated built-in benchmark
  (`builtin_entries` also gives its pre-training and held-out sets).

GLIP layouts (paths relative to the data root that holds `odinw/`): most datasets have a
folder per split, `<base>/{train,valid,test}/annotations_without_background.json` with the
images beside it; 'export' datasets keep every image in `<base>/` with
`<base>/{train,val,test}_annotations_without_background.json`; GLIP registers PascalVOC's
valid folder as its test split too. ChessPieces' box-less category 1 (named '  ') is excluded
as in the paper's registry. Other per-dataset choices of GLIP (its `TEST: ("val",)`, few-shot
splits) are not reproduced: the suites declare the train / val / test splits.

Config form (`entries_from_config`): a list whose items are entries (`entry_from_config`) or
suites `dict(suite='odinw13', root='/data', names=[...optional subset...], variant='zira')`.

Source: microsoft/GLIP `configs/odinw_13/*.yaml`, `configs/odinw_35/*.yaml` and
`configs/odinw_35/_all.json`; docs/reference.md §10 (the paper's 15); JarintotionDin/
ZiRaGroundingDINO and chiara-cap/DitHub `groundingdino/config/configs/common/data/odinw/*.py`
(the 'zira' variant).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import os
from typing import Any

from owl_cl.data import odinw
from owl_cl.data.coco import DataError
from owl_cl.data.entries import DatasetEntry
from owl_cl.data.entries import SplitSpec
from owl_cl.data.entries import entry_from_config

__all__ = [
  "SUITES",
  "ODINW35",
  "ODINW13",
  "ODINW13_ZIRA",
  "ODINW13_VARIANTS",
  "ODINW13_VARIANT_SUITES",
  "GlipDataset",
  "variant_hint",
  "suite_entries",
  "builtin_entries",
  "entries_from_config",
]

_ANN = "annotations_without_background.json"
_FOLDERS, _EXPORT, _VOC = "folders", "export", "voc"


@dataclasses.dataclass(frozen=True)
class GlipDataset:
  """One ODinW dataset in GLIP's folder layout (an export of GLIP's ODinW-35 download).

  Attributes:
    name: GLIP's config file stem (ZiRa's variant: see `ODINW13_ZIRA`). base: its folder
      under `odinw/`.
    layout: 'folders' | 'export' | 'voc' (folders, the valid folder also the test split).
    splits: the splits the suite declares.
    test_dir: the test split's folder under `odinw/` when it is not the layout's (ZiRa's
      NorthAmericaMushrooms: the train folder of another export); '' for the layout's.
  """

  name: str
  base: str
  layout: str = _FOLDERS
  splits: tuple[str, ...] = ("train", "val", "test")
  test_dir: str = ""

  def paths(self, root: str, split: str) -> tuple[str, str]:
    """(annotation json, image folder) of split 'train' | 'val' | 'test' under `root`."""
    if split == "test" and self.test_dir:
      d = os.path.join(root, "odinw", *self.test_dir.split("/"))
      return os.path.join(d, _ANN), d
    base = os.path.join(root, "odinw", *self.base.split("/"))
    if self.layout == _EXPORT:
      return os.path.join(base, f"{split}_{_ANN}"), base
    folder = {"train": "train", "val": "valid", "test": "valid" if self.layout == _VOC else "test"}
    d = os.path.join(base, folder[split])
    return os.path.join(d, _ANN), d


ODINW35: tuple[GlipDataset, ...] = tuple(
  GlipDataset(*row)
  for row in (
    ("AerialMaritimeDrone_large", "AerialMaritimeDrone/large"),
    ("AerialMaritimeDrone_tiled", "AerialMaritimeDrone/tiled"),
    (
      "AmericanSignLanguageLetters_American_Sign_Language_Letters.v1-v1.coco",
      "AmericanSignLanguageLetters/American Sign Language Letters.v1-v1.coco",
    ),
    ("Aquarium_Aquarium_Combined.v2-raw-1024.coco", "Aquarium/Aquarium Combined.v2-raw-1024.coco"),
    ("BCCD_BCCD.v3-raw.coco", "BCCD/BCCD.v3-raw.coco"),
    ("ChessPieces_Chess_Pieces.v23-raw.coco", "ChessPieces/Chess Pieces.v23-raw.coco"),
    ("CottontailRabbits", "CottontailRabbits"),
    ("DroneControl_Drone_Control.v3-raw.coco", "DroneControl/Drone Control.v3-raw.coco"),
    ("EgoHands_generic", "EgoHands/generic"),
    ("EgoHands_specific", "EgoHands/specific"),
    ("HardHatWorkers_raw", "HardHatWorkers/raw"),
    ("MaskWearing_raw", "MaskWearing/raw"),
    ("MountainDewCommercial", "MountainDewCommercial"),
    (
      "NorthAmericaMushrooms_North_American_Mushrooms.v1-416x416.coco",
      "NorthAmericaMushrooms/North American Mushrooms.v1-416x416.coco",
    ),
    ("OxfordPets_by-breed", "OxfordPets/by-breed"),
    ("OxfordPets_by-species", "OxfordPets/by-species"),
    ("PKLot_640", "PKLot/640"),
    ("Packages_Raw", "Packages/Raw"),
    ("PascalVOC", "PascalVOC", _VOC),
    ("Raccoon_Raccoon.v2-raw.coco", "Raccoon/Raccoon.v2-raw.coco"),
    ("ShellfishOpenImages_raw", "ShellfishOpenImages/raw"),
    ("ThermalCheetah", "ThermalCheetah"),
    ("UnoCards_raw", "UnoCards/raw"),
    ("VehiclesOpenImages_416x416", "VehiclesOpenImages/416x416"),
    ("WildfireSmoke", "WildfireSmoke"),
    ("boggleBoards_416x416AutoOrient_export_", "boggleBoards/416x416AutoOrient/export", _EXPORT),
    ("brackishUnderwater_960x540", "brackishUnderwater/960x540"),
    ("dice_mediumColor_export", "dice/mediumColor/export", _EXPORT),
    ("openPoetryVision_512x512", "openPoetryVision/512x512"),
    ("pistols_export", "pistols/export", _EXPORT),
    ("plantdoc_416x416", "plantdoc/416x416"),
    ("pothole", "pothole"),
    ("selfdrivingCar_fixedLarge_export_", "selfdrivingCar/fixedLarge/export", _EXPORT),
    ("thermalDogsAndPeople", "thermalDogsAndPeople"),
    ("websiteScreenshots", "websiteScreenshots"),
  )
)

_ODINW13_NAMES = (
  "AerialMaritimeDrone_large",
  "Aquarium_Aquarium_Combined.v2-raw-1024.coco",
  "CottontailRabbits",
  "EgoHands_generic",
  "NorthAmericaMushrooms_North_American_Mushrooms.v1-416x416.coco",
  "Packages_Raw",
  "PascalVOC",
  "Raccoon_Raccoon.v2-raw.coco",
  "ShellfishOpenImages_raw",
  "VehiclesOpenImages_416x416",
  "pistols_export",
  "pothole",
  "thermalDogsAndPeople",
)
_BY_NAME = {d.name: d for d in ODINW35}
ODINW13: tuple[GlipDataset, ...] = tuple(_BY_NAME[n] for n in _ODINW13_NAMES)

_ZIRA_MUSHROOMS = "NorthAmericaMushrooms/North American Mushrooms"
# ODinW-13 as ZiRa (NeurIPS'24) and DitHub (NeurIPS'25) read it, in the same order as ODINW13
# (member i of both is the same dataset; docs/ivlod.md lists each difference and its source):
# the folders their released data configs register (ZiRaGroundingDINO and chiara-cap/DitHub,
# groundingdino/config/configs/common/data/odinw/*.py), train and test splits only (neither
# registers a validation split). Names: GLIP's stem where the data are GLIP's, else the same
# pattern with the folder ZiRa reads (docs/ivlod.md).
ODINW13_ZIRA: tuple[GlipDataset, ...] = (
  GlipDataset("AerialMaritimeDrone_tiled", "AerialMaritimeDrone/tiled", splits=("train", "test")),
  dataclasses.replace(ODINW13[1], splits=("train", "test")),
  dataclasses.replace(ODINW13[2], splits=("train", "test")),
  dataclasses.replace(ODINW13[3], splits=("train", "test")),
  # Trained on v1's train split, tested on the v2 (augmented) export's train split, as
  # ZiRa's config since its commit 305516e and DitHub's config register them.
  GlipDataset(
    "NorthAmericaMushrooms_v1-416x416_v2-416x416augmented",
    f"{_ZIRA_MUSHROOMS}.v1-416x416.coco",
    splits=("train", "test"),
    test_dir=f"{_ZIRA_MUSHROOMS}.v2-416x416augmented.coco/train",
  ),
  GlipDataset("Packages_augmented-v1", "Packages/augmented-v1", splits=("train", "test")),
  dataclasses.replace(ODINW13[6], splits=("train", "test")),
  GlipDataset(
    "Raccoon_Raccoon.v38-416x416-resize.coco",
    "Raccoon/Raccoon.v38-416x416-resize.coco",
    splits=("train", "test"),
  ),
  GlipDataset(
    "ShellfishOpenImages_416x416", "ShellfishOpenImages/416x416", splits=("train", "test")
  ),
  dataclasses.replace(ODINW13[9], splits=("train", "test")),
  dataclasses.replace(ODINW13[10], splits=("train", "test")),
  dataclasses.replace(ODINW13[11], splits=("train", "test")),
  dataclasses.replace(ODINW13[12], splits=("train", "test")),
)
# The ODinW-13 variants (`data.odinw13_variant`, a suite item's `variant`): 'glip' GLIP's
# configs/odinw_13 (the default), 'zira' ZiRa's / DitHub's (the IVLOD papers').
ODINW13_VARIANTS: dict[str, tuple[GlipDataset, ...]] = {"glip": ODINW13, "zira": ODINW13_ZIRA}
# The suite name each variant's entries carry (and whose stored task orders they follow).
ODINW13_VARIANT_SUITES = {"glip": "odinw13", "zira": "odinw13_zira"}

# Box-less categories that are not classes (the paper registry's choice for ChessPieces).
_EXCLUDE = {"ChessPieces_Chess_Pieces.v23-raw.coco": odinw.ODINW_DATASETS["ChessPieces"]}

SUITES = ("odinw_paper", "odinw15", "odinw13", "odinw35", "builtin")


def _pick(available: Sequence[str], names: Sequence[str] | None, suite: str) -> list[str]:
  if names is None:
    return list(available)
  if isinstance(names, str):
    names = [names]
  unknown = [n for n in names if n not in available]
  if unknown:
    raise DataError(
      f"suite {suite!r}: field 'names' has unknown value(s) {unknown}; known: {list(available)}"
    )
  return list(names)


def suite_entries(
  suite: str,
  root: str | None = None,
  *,
  names: Sequence[str] | None = None,
  subset_seed: int | None = 0,
  benchmark: Any = None,
  variant: str | None = None,
) -> list[DatasetEntry]:
  """The entries of a named suite (module docstring), in the suite's order.

  Args:
    suite: one of `SUITES`.
    root: data root holding `odinw/` (ODinW suites).
    names: keep only these members (in the given order); default all.
    subset_seed: balanced training subset seed of the paper's suite (None: whole splits).
    benchmark: suite 'builtin': a generated `owl_cl.data.builtin.BuiltinBenchmark`.
    variant: suite 'odinw13': which ODinW-13 is read, a key of `ODINW13_VARIANTS` ('glip'
      GLIP's folders, train / val / test; 'zira' ZiRa's and DitHub's, train / test;
      docs/ivlod.md); None: 'glip'. Other suites take None only.

  Returns:
    list of `DatasetEntry` (files are not looked at: `check_entry`); a 'zira' entry's `suite`
    is 'odinw13_zira' (its stored task orders, `owl_cl.data.orders`).

  Raises:
    DataError: unknown suite, member or variant, a variant for another suite, or a missing
      root / benchmark (each names the field and its value).
  """
  if suite not in SUITES:
    raise DataError(f"field 'suite' has value {suite!r}, expected one of {SUITES}")
  if variant is not None and suite != "odinw13":
    raise DataError(
      f"suite {suite!r}: field 'variant' ({variant!r}) applies to suite 'odinw13' only"
    )
  if variant is not None and variant not in ODINW13_VARIANTS:
    raise DataError(
      f"suite 'odinw13': field 'variant' has value {variant!r}, expected one of "
      f"{list(ODINW13_VARIANTS)}"
    )
  if suite == "builtin":
    if benchmark is None:
      raise DataError("suite 'builtin' needs the generated benchmark (builtin.ensure_benchmark)")
    entries = builtin_entries(benchmark)["sequence"]
    keep = _pick([e.name for e in entries], names, suite)
    by = {e.name: e for e in entries}
    return [by[n] for n in keep]
  if not root:
    raise DataError(f"suite {suite!r}: field 'root' (the data root holding odinw/) is missing")
  root = os.path.expanduser(root)
  if suite in ("odinw_paper", "odinw15"):
    return [
      entry_from_config(dict(name=n, kind="odinw", member=n, root=root, subset_seed=subset_seed))
      for n in _pick(odinw.ODINW_NAMES, names, suite)
    ]
  members = ODINW35 if suite == "odinw35" else ODINW13_VARIANTS[variant or "glip"]
  label = ODINW13_VARIANT_SUITES[variant or "glip"] if suite == "odinw13" else suite
  by = {d.name: d for d in members}
  out = []
  for n in _pick([d.name for d in members], names, label):
    d = by[n]
    splits = tuple(
      (s, SplitSpec(annotation_file=a, image_dir=i))
      for s in d.splits
      for a, i in [d.paths(root, s)]
    )
    spec = _EXCLUDE.get(n)
    out.append(
      DatasetEntry(
        name=n,
        kind="coco",
        splits=splits,
        exclude_category_ids=spec.exclude_category_ids if spec else (),
        suite=label,
      )
    )
  return out


def variant_hint(entry: DatasetEntry) -> list[str]:
  """What to do when an ODinW-13 member's files are missing but another variant's are there.

  Args:
    entry: an entry of suite 'odinw13' (variant 'glip') or 'odinw13_zira' (variant 'zira').

  Returns:
    One line per other variant whose train annotation file of the same dataset exists under
    the entry's data root: it names that file, the config field and the value to set
    (`data.odinw13_variant`, docs/ivlod.md); [] when there is none (or `entry` is no
    ODinW-13 member).
  """
  variant = next((v for v, s in ODINW13_VARIANT_SUITES.items() if s == entry.suite), None)
  names = [d.name for d in ODINW13_VARIANTS.get(variant, ())]
  if entry.name not in names or "train" not in entry.split_names:
    return []
  index = names.index(entry.name)
  relative = ODINW13_VARIANTS[variant][index].paths("", "train")[0]
  ann = entry.split("train").annotation_file
  if not ann.endswith(relative):
    return []
  root = ann[: len(ann) - len(relative)] or "."
  out = []
  for other, members in ODINW13_VARIANTS.items():
    found = members[index].paths(root, "train")[0]
    if other != variant and os.path.isfile(found):
      out.append(
        f"dataset {entry.name!r} is ODinW-13 variant {variant!r} "
        f"(config.data.odinw13_variant), but the data root holds the {other!r} variant's "
        f"{members[index].name!r} ({found}): set config.data.odinw13_variant={other!r} or "
        f"add the {variant!r} variant's folders (docs/ivlod.md)"
      )
  return out


def builtin_entries(benchmark: Any) -> dict[str, Any]:
  """The built-in benchmark's datasets as entries (kind 'coco', its generated jsons).

  Args:
    benchmark: `owl_cl.data.builtin.BuiltinBenchmark` (from `builtin.ensure_benchmark`).

  Returns:
    dict(pretrain=DatasetEntry (train, val), held_out=DatasetEntry (val),
    sequence=[DatasetEntry (train, test) per downstream dataset, canonical order]).
  """

  def entry(name: str, splits: Sequence[str]) -> DatasetEntry:
    specs = []
    for s in splits:
      f = benchmark.split(name, s)
      specs.append((s, SplitSpec(annotation_file=f.annotation_file, image_dir=f.image_dir)))
    return DatasetEntry(name=name, kind="coco", splits=tuple(specs), suite="builtin")

  return dict(
    pretrain=entry("pretrain", ("train", "val")),
    held_out=entry("held_out", ("val",)),
    sequence=[entry(n, ("train", "test")) for n in benchmark.downstream_names],
  )


def entries_from_config(cfg: Any, *, benchmark: Any = None) -> list[DatasetEntry]:
  """Entries from a config list (or one item): entry dicts and suite dicts
  `dict(suite=..., root=..., names=[...], subset_seed=..., variant=...)`, expanded in order.

  Raises:
    DataError: every problem of every item, in one error (each names the item index).
  """
  if hasattr(cfg, "to_dict") or isinstance(cfg, dict):
    cfg = [cfg]
  out, problems = [], []
  for i, item in enumerate(cfg):
    item = item.to_dict() if hasattr(item, "to_dict") else item
    try:
      if isinstance(item, dict) and "suite" in item:
        extra = sorted(set(item) - {"suite", "root", "names", "subset_seed", "variant"})
        if extra:
          raise DataError(
            f"suite field(s) {extra} unknown (known: suite, root, names, subset_seed, variant)"
          )
        out.extend(
          suite_entries(
            item["suite"],
            item.get("root"),
            names=item.get("names"),
            subset_seed=item.get("subset_seed", 0),
            benchmark=benchmark,
            variant=item.get("variant"),
          )
        )
      else:
        out.append(entry_from_config(item))
    except DataError as e:
      problems.append(f"datasets[{i}]: {e}")
  if problems:
    raise DataError("\n".join(problems))
  return out

"""Kind 'odinw': a member of the paper's 15 ODinW datasets, below a data `root`.

    dict(name="EgoHands", kind="odinw", member="EgoHands", root="/data")

The `owl_cl.data.odinw` registry gives the folders, the expected categories, the balanced
training subsets and `max_detections`; splits default to train, val and test. Loaded exactly
as `odinw.odinw_source` does (the paper protocol's reference).

Source: docs/reference.md §10 (the paper's datasets); GLIP's ODinW-35 layout.
"""

from __future__ import annotations

import os

from owl_cl.data import odinw
from owl_cl.data.coco import CocoSource
from owl_cl.data.readers import coco as coco_reader
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.reader import SPLITS
from owl_cl.data.readers.reader import DatasetEntry
from owl_cl.data.readers.reader import SplitSpec

__all__ = ["READER"]


def _splits(cfg: dict, where: str, problems: list) -> list:
  """The member's registry paths of the declared splits (all three when none is declared);
  none once there is any problem."""
  member, root = str(cfg.get("member", "") or ""), reader_lib.entry_root(cfg)
  if member not in odinw.ODINW_DATASETS:
    problems.append(
      f"{where}: field 'member' has value {member!r}, expected one of {odinw.ODINW_NAMES}"
    )
  if not root:
    problems.append(f"{where}: field 'root' (the data root holding odinw/) is missing")
  if problems:
    return []
  declared = [s for s in SPLITS if s in cfg] or list(SPLITS)
  return [(s, SplitSpec(*odinw.odinw_paths(root, member, s))) for s in declared]


def _defaults(cfg: dict) -> dict:
  spec = odinw.ODINW_DATASETS.get(str(cfg.get("member", "") or ""))
  if spec is None:
    return {}
  return {
    "exclude_category_ids": spec.exclude_category_ids,
    "subset_size": spec.subset_size,
    "max_detections": spec.max_detections,
  }


def _check(entry: DatasetEntry) -> list[str]:
  where0 = f"dataset {entry.name!r}"
  missing = odinw.missing_files(entry.root, [entry.member], entry.split_names)
  problems = [f"{where0} (ODinW {entry.member}): missing {p}" for p in missing]
  spec = odinw.ODINW_DATASETS[entry.member]
  expected = [
    n for i, n in enumerate(spec.category_names, start=1) if i not in spec.exclude_category_ids
  ]
  names_by_split = {}
  for split, split_spec in entry.splits:
    if not os.path.isfile(split_spec.annotation_file):
      continue  # reported above with the layout
    where = f"{where0} field '{split}'"
    names = coco_reader.json_split_problems(entry, split_spec, where, problems, expected)
    if names is not None:
      names_by_split[split] = names
  return problems + coco_reader.same_classes_problems(entry, names_by_split)


def _load(entry: DatasetEntry, split: str, coco_options: dict) -> CocoSource:
  entry.split(split)  # an undeclared split is refused
  return odinw.odinw_source(
    entry.root,
    entry.member,
    split,
    subset_seed=entry.subset_seed,
    subset_size=entry.subset_size,
    **coco_options,
  )


READER = reader_lib.register(
  reader_lib.Reader(
    kind="odinw",
    splits=_splits,
    load=_load,
    check=_check,
    fields=("member", "root"),
    defaults=_defaults,
    root_folder="odinw",
  )
)

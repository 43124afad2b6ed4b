"""The kinds whose files sit at fixed places below a data `root` (Objects365, LVIS, COCO 2017).

An entry names only its `root` and, optionally, its splits as fields set to True
(`dict(name="o365", kind="objects365", root="/data", train=True)`); `rooted_reader` makes the
`Reader` of one such kind from its paths and its loader.

Source: `owl_cl.data.pretraining` (the layout below the data root, docs/paper_protocol.md).
"""

from __future__ import annotations

from collections.abc import Callable
import os

from owl_cl.data.coco import CocoSource
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.reader import SPLITS
from owl_cl.data.readers.reader import DatasetEntry
from owl_cl.data.readers.reader import SplitSpec

__all__ = ["rooted_reader"]


def rooted_reader(
  kind: str,
  folder: str,
  default_splits: tuple[str, ...],
  paths: Callable[[str, str], tuple[str, str]],
  load: Callable[[DatasetEntry, str, dict], CocoSource],
  evaluation: str,
  label: str,
) -> reader_lib.Reader:
  """The `Reader` of a kind with fixed files below the data root.

  Args:
    kind: its `kind`. folder: the folder below the root holding it (named in messages).
    default_splits: the splits of an entry that names none.
    paths: (root, split) -> (annotation json, image folder).
    load: `Reader.load`. evaluation: its protocol (its jsons are large: not read to infer
      it). label: its results-table column label.
  """

  def splits(cfg: dict, where: str, problems: list) -> list:
    root = reader_lib.entry_root(cfg)
    if not root:
      problems.append(f"{where}: field 'root' (the data root holding {folder}/) is missing")
    declared = [s for s in SPLITS if s in cfg]
    for s in declared:
      if s == "test" or cfg[s] not in (True, None, "", {}):
        problems.append(
          f"{where} field {s!r}: kind {kind!r} has fixed files; give only the split names "
          f"('train', 'val') as fields set to True, got {cfg[s]!r}"
        )
    if problems:
      return []
    chosen = [s for s in declared if cfg[s] is not None] or list(default_splits)
    return [(s, SplitSpec(*paths(root, s))) for s in chosen]

  def check(entry: DatasetEntry) -> list[str]:
    # Their jsons are large (Objects365 train: GBs): only the files are checked here.
    problems = []
    for split, spec in entry.splits:
      where = f"dataset {entry.name!r} field '{split}'"
      if not os.path.isfile(spec.annotation_file):
        problems.append(f"{where} 'annotation_file': file not found: {spec.annotation_file!r}")
      if not os.path.isdir(spec.image_dir):
        problems.append(f"{where} 'image_dir': folder not found: {spec.image_dir!r}")
    return problems

  return reader_lib.Reader(
    kind=kind,
    splits=splits,
    load=load,
    check=check,
    fields=("root",),
    evaluation=evaluation,
    root_folder=folder,
    label=label,
  )

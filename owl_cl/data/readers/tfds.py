"""Kind 'tfds': a TFDS dataset's ArrayRecord files, read without TensorFlow.

    dict(name="coco", kind="tfds", tfds="tfds:coco/2017", data_dir="/d/tfds",
         train="train", test="validation")   # a string is the TFDS split name

The entry-level `tfds`, `data_dir`, `category_ids` and `categories_file` are the default of
every split; a split is a TFDS split name or a dict of `SplitSpec` fields.

Source: TFDS data_source / ArrayRecord docs; `owl_cl.data.tfds_source`.
"""

from __future__ import annotations

import os

from owl_cl.data import tfds_source
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError
from owl_cl.data.readers import coco as coco_reader
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.reader import DatasetEntry
from owl_cl.data.readers.reader import SplitSpec

__all__ = ["READER"]

_ENTRY_DEFAULTS = ("tfds", "data_dir", "category_ids", "categories_file")
_DEFAULT_TFDS_SPLIT = {"train": "train", "val": "validation", "test": "test"}


def _splits(cfg: dict, where: str, problems: list) -> list:
  def complete(value: dict, split: str, fwhere: str, problems: list) -> bool:
    for k in _ENTRY_DEFAULTS:
      if not value.get(k) and cfg.get(k):
        value[k] = cfg[k]
    value.setdefault("split", _DEFAULT_TFDS_SPLIT[split])
    if not str(value.get("tfds", "")).startswith(tfds_source.TFDS_PREFIX):
      problems.append(
        f"{fwhere}: field 'tfds' has value {value.get('tfds')!r}, expected "
        f"'tfds:<name>[:<version>]'"
      )
    value["data_dir"] = os.path.expanduser(str(value.get("data_dir", "") or ""))
    if value.get("category_ids") is not None:
      try:
        value["category_ids"] = reader_lib.ints(value["category_ids"], f"{fwhere} 'category_ids'")
      except DataError as e:
        problems.append(str(e))
        return False
    return True

  return coco_reader.declared_splits(cfg, where, problems, complete)


def _split_problems(entry: DatasetEntry, spec: SplitSpec, where: str) -> list[str]:
  """The problems of one split: the TFDS folder and split, and the categories file the
  'lvis' protocol needs."""
  problems = list(
    tfds_source.tfds_problems(
      spec.tfds, spec.data_dir or None, spec.split, where, spec.category_ids
    )
  )
  tfds_ok = not problems
  if spec.categories_file and not os.path.isfile(spec.categories_file):
    problems.append(f"{where} 'categories_file': file not found: {spec.categories_file!r}")
  elif not spec.categories_file and (
    entry.evaluation == "lvis"
    or (
      entry.evaluation is None
      and tfds_ok
      and tfds_source.tfds_has_lvis_fields(spec.tfds, spec.data_dir or None)
    )
  ):
    problems.append(
      f"{where}: the evaluation protocol is 'lvis' but TFDS has no category 'frequency' "
      f"(LVIS APr groups): set 'categories_file' to a json with the LVIS categories, or "
      f"'evaluation' to 'coco'"
    )
  return problems


def _check(entry: DatasetEntry) -> list[str]:
  return [
    p
    for split, spec in entry.splits
    for p in _split_problems(entry, spec, f"dataset {entry.name!r} field '{split}'")
  ]


def _load(entry: DatasetEntry, split: str, coco_options: dict) -> CocoSource:
  spec = entry.split(split)
  source = tfds_source.tfds_source(
    spec.tfds,
    spec.data_dir or None,
    spec.split,
    name=entry.name if split == "train" else f"{entry.name}/{split}",
    category_ids=spec.category_ids,
    where=f"dataset {entry.name!r} field {split!r}",
    categories_file=spec.categories_file or None,
    exclude_category_ids=entry.exclude_category_ids,
    **coco_options,
  )
  return reader_lib.balanced_train_subset(entry, split, source)


def _infer_evaluation(entry: DatasetEntry, split: str) -> str:
  spec = entry.split(split)
  return "lvis" if tfds_source.tfds_has_lvis_fields(spec.tfds, spec.data_dir or None) else "coco"


READER = reader_lib.register(
  reader_lib.Reader(
    kind="tfds",
    splits=_splits,
    load=_load,
    check=_check,
    fields=_ENTRY_DEFAULTS,
    infer_evaluation=_infer_evaluation,
  )
)

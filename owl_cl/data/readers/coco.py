"""Kind 'coco': a COCO json + the image folder its `file_name`s are relative to, per split.

    dict(name="robot_kitchen", kind="coco",
         train=dict(annotation_file="/d/kitchen/train.json", image_dir="/d/kitchen/images"),
         test=dict(annotation_file="/d/kitchen/test.json", image_dir="/d/kitchen/images"))

Also the COCO-json checks the other json kinds share (`json_split_problems`, `json_protocol`).

Source: COCO data format (cocodataset.org/#format-data); LVIS v1 format (lvisdataset.org).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import json
import os

from owl_cl.data import tfds_source
from owl_cl.data.coco import DataError
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.reader import SPLITS
from owl_cl.data.readers.reader import DatasetEntry
from owl_cl.data.readers.reader import SplitSpec

__all__ = [
  "READER",
  "declared_splits",
  "read_json",
  "has_lvis_fields",
  "json_split_problems",
  "same_classes_problems",
  "json_protocol",
]

_LVIS_IMAGE_FIELDS = ("neg_category_ids", "not_exhaustive_category_ids")
_SPLIT_KEYS = {f.name for f in dataclasses.fields(SplitSpec)}


def declared_splits(cfg: dict, where: str, problems: list, complete=None) -> list:
  """Each declared split's `SplitSpec` (a dict of its fields; `complete(value, fwhere,
  problems)` fills and checks a kind's own, returning False to leave the split out). A string
  is refused (a TFDS split name) unless `complete` accepts {'split': <string>}. Problems are
  appended to `problems`; a split with one is left out."""
  splits = []
  kind = cfg.get("kind")
  for s in SPLITS:
    if s not in cfg or cfg[s] is None:
      continue
    value = cfg[s]
    fwhere = f"{where} field '{s}'"
    if isinstance(value, str):
      if kind != "tfds":
        problems.append(f"{fwhere}: a string ({value!r}) is a TFDS split name; kind is {kind!r}")
        continue
      value = {"split": value}
    try:
      value = reader_lib.as_dict(value, fwhere)
    except DataError as e:
      problems.append(str(e))
      continue
    unknown = sorted(set(value) - _SPLIT_KEYS)
    if unknown:
      problems.append(f"{fwhere}: unknown field(s) {unknown} (known: {sorted(_SPLIT_KEYS)})")
      continue
    if complete is not None and not complete(value, s, fwhere, problems):
      continue
    splits.append((s, SplitSpec(**value)))
  if not splits and not problems:
    problems.append(f"{where}: declares none of the splits {SPLITS}")
  return splits


def _coco_split(value: dict, split: str, fwhere: str, problems: list) -> bool:
  for k in ("annotation_file", "image_dir"):
    if not value.get(k):
      problems.append(f"{fwhere}: field {k!r} is missing or empty")
    else:
      value[k] = os.path.expanduser(str(value[k]))
  return True


def read_json(path: str, where: str, problems: list[str]) -> dict | None:
  """The COCO json at `path`, or None with the problem appended (missing, not json, no COCO
  lists 'images', 'annotations', 'categories')."""
  if not path or not os.path.isfile(path):
    problems.append(f"{where} 'annotation_file': file not found: {path!r}")
    return None
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    problems.append(f"{where} 'annotation_file': {path}: not valid json ({e})")
    return None
  if not isinstance(data, dict) or not all(
    isinstance(data.get(k), list) for k in ("images", "annotations", "categories")
  ):
    problems.append(
      f"{where} 'annotation_file': {path} lacks the COCO lists 'images', 'annotations', "
      f"'categories'"
    )
    return None
  return data


def _coco_names(data: dict, exclude: tuple[int, ...]) -> list[str]:
  cats = [c for c in data["categories"] if isinstance(c, dict)]
  # The class order of `CocoSource`: ascending category id.
  cats = sorted(
    (c for c in cats if c.get("id") not in exclude),
    key=lambda c: (0, c["id"], "") if isinstance(c.get("id"), int) else (1, 0, str(c.get("id"))),
  )
  return [str(c.get("name", "")) for c in cats]


def has_lvis_fields(data: dict) -> bool:
  """LVIS per-image fields on an image, or `frequency` on a category, of a COCO json."""
  return any(
    isinstance(im, dict) and any(f in im for f in _LVIS_IMAGE_FIELDS) for im in data["images"]
  ) or any(isinstance(c, dict) and "frequency" in c for c in data["categories"])


def json_split_problems(
  entry: DatasetEntry,
  spec: SplitSpec,
  where: str,
  problems: list[str],
  expected: Sequence[str] | None = None,
) -> list[str] | None:
  """The checks of one COCO-json split, appended to `problems`: image folder, json, images,
  categories (`expected` names when given), LVIS frequencies when the protocol is 'lvis',
  category names. Returns its class names, or None when its json cannot be read."""
  if not spec.image_dir or not os.path.isdir(spec.image_dir):
    problems.append(f"{where} 'image_dir': folder not found: {spec.image_dir!r}")
  data = read_json(spec.annotation_file, where, problems)
  if data is None:
    return None
  if not data["images"]:
    problems.append(f"{where} 'annotation_file': {spec.annotation_file} has no images")
  names = _coco_names(data, entry.exclude_category_ids)
  if expected is not None and names != list(expected):
    problems.append(
      f"{where} 'annotation_file': {spec.annotation_file} has categories {names}, "
      f"expected {list(expected)} for ODinW {entry.member}"
    )
  if not names:
    problems.append(f"{where} 'annotation_file': {spec.annotation_file} has no categories")
  if entry.evaluation == "lvis" or (entry.evaluation is None and has_lvis_fields(data)):
    lacking = [
      c.get("id")
      for c in data["categories"]
      if isinstance(c, dict) and c.get("frequency") not in ("r", "c", "f")
    ]
    if lacking:
      problems.append(
        f"{where} 'annotation_file': the evaluation protocol is 'lvis' but categories "
        f"{lacking[:10]} of {spec.annotation_file} have no LVIS 'frequency' (r, c or f)"
      )
  for p in tfds_source._name_problems(names, f"{where} 'annotation_file' categories"):  # pylint: disable=protected-access
    problems.append(f"{p} (in {spec.annotation_file})")
  return names


def same_classes_problems(entry: DatasetEntry, names_by_split: dict[str, list[str]]) -> list[str]:
  """A problem per split whose class list differs from the first split's."""
  ref = next(iter(names_by_split.items()), None)
  return [
    f"dataset {entry.name!r}: field '{split}' categories {names} differ from field "
    f"'{ref[0]}' categories {ref[1]}"
    for split, names in names_by_split.items()
    if ref is not None and names != ref[1]
  ]


def _check(entry: DatasetEntry) -> list[str]:
  problems: list[str] = []
  names_by_split = {}
  for split, spec in entry.splits:
    names = json_split_problems(entry, spec, f"dataset {entry.name!r} field '{split}'", problems)
    if names is not None:
      names_by_split[split] = names
  return problems + same_classes_problems(entry, names_by_split)


def json_protocol(entry: DatasetEntry, split: str) -> str:
  """'lvis' when `split`'s COCO json has LVIS fields (`neg_category_ids` /
  `not_exhaustive_category_ids` on an image, `frequency` on a category), else 'coco'.

  Raises:
    DataError: undeclared split; unreadable json.
  """
  problems: list[str] = []
  data = read_json(
    entry.split(split).annotation_file, f"dataset {entry.name!r} field '{split}'", problems
  )
  if data is None:
    raise DataError(problems[0])
  return "lvis" if has_lvis_fields(data) else "coco"


READER = reader_lib.register(
  reader_lib.Reader(
    kind="coco",
    splits=lambda cfg, where, problems: declared_splits(cfg, where, problems, _coco_split),
    load=reader_lib.coco_json_source,
    check=_check,
  )
)

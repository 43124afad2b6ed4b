"""A dataset entry's value types and the registry of readers, one per entry `kind`.

`SplitSpec` and `DatasetEntry` are what a declared dataset becomes (`entries.entry_from_config`);
a `Reader` says how entries of its `kind` are declared, checked and read, and `register` adds
it to `READERS`, the one registry `owl_cl.data.entries`, `owl_cl.benchmark` and validation look
kinds up in (big_vision's one module per dataset). A reader module defines its `Reader` and
calls `register`; `owl_cl.data.readers` imports the built-in ones, and a config file imports
its own (docs/extending.md ("A dataset format")).

Source: COCO data format (cocodataset.org/#format-data); docs/data.md ("Your own data").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import os
from typing import Any

from owl_cl.data import odinw
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError

__all__ = [
  "SPLITS",
  "EVALUATIONS",
  "SplitSpec",
  "DatasetEntry",
  "Reader",
  "READERS",
  "register",
  "get",
  "as_dict",
  "ints",
  "entry_root",
  "balanced_train_subset",
  "coco_json_source",
]

SPLITS = ("train", "val", "test")
EVALUATIONS = ("coco", "lvis")


@dataclasses.dataclass(frozen=True)
class SplitSpec:
  """Where one split comes from.

  Attributes:
    annotation_file: kind 'coco' / 'odinw': the COCO json (boxes [x, y, w, h] pixels).
    image_dir: kind 'coco' / 'odinw': the folder the json's `file_name`s are relative to.
    tfds: kind 'tfds': 'tfds:<name>[:<version>]'.
    data_dir: kind 'tfds': the TFDS data folder ('' -> $TFDS_DATA_DIR or ~/tensorflow_datasets).
    split: kind 'tfds': the TFDS split name (e.g. 'train', 'validation').
    category_ids: kind 'tfds': the category id of each 0-based label (default:
      `owl_cl.data.tfds_source` rules: COCO's 80 ids for coco/*, else label + 1).
    categories_file: kind 'tfds': a json whose `categories` (e.g. LVIS v1's, with `frequency`)
      are merged into the TFDS categories by id.
  """

  annotation_file: str = ""
  image_dir: str = ""
  tfds: str = ""
  data_dir: str = ""
  split: str = ""
  category_ids: tuple[int, ...] | None = None
  categories_file: str = ""

  def describe(self) -> str:
    """'tfds:coco/2017 split validation (data_dir /d)' or 'json <file>, images <dir>'."""
    if self.tfds:
      return f"{self.tfds} split {self.split} (data_dir {self.data_dir or 'default'})"
    return f"json {self.annotation_file}, images {self.image_dir}"


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
  """One dataset, declared as data (`owl_cl.data.entries`).

  Attributes:
    name: display name (results tables, logs); unique within a run.
    kind: a registered reader's kind (`READERS`), e.g. 'coco' | 'tfds' | 'odinw'.
    splits: ((split, SplitSpec), ...) for the splits it has, in ('train', 'val', 'test') order.
    evaluation: 'coco' | 'lvis' | None (None: the reader's, else inferred,
      `entries.evaluation_protocol`).
    exclude_category_ids: category ids that are not classes (dropped with their boxes).
    subset_size: balanced training subset size (`odinw.balanced_subset`); None: whole split.
    subset_seed: seed of that subset; None disables subsetting.
    max_detections: detections kept per image at evaluation, replacing both the predictions
      kept (`eval.top_k` / `eval.lvis_top_k`) and the scorer's maxDets (`eval.max_dets` /
      `eval.lvis_max_dets`) for this dataset (docs/reference.md §4); None: the config's. Kind
      'odinw' defaults to the registry's (100 for EgoHands and BrackishUnderwater, else 300).
    member: kind 'odinw': the registry name (e.g. 'EgoHands'); root: its data root.
    suite: the named suite it came from ('' for a user entry).
  """

  name: str
  kind: str
  splits: tuple[tuple[str, SplitSpec], ...]
  evaluation: str | None = None
  exclude_category_ids: tuple[int, ...] = ()
  subset_size: int | None = None
  subset_seed: int | None = 0
  max_detections: int | None = None
  member: str = ""
  root: str = ""
  suite: str = ""

  @property
  def split_names(self) -> tuple[str, ...]:
    """The splits declared, e.g. ('train', 'test')."""
    return tuple(s for s, _ in self.splits)

  def split(self, split: str) -> SplitSpec:
    """The `SplitSpec` of `split`.

    Raises:
      DataError: the entry does not declare `split` (names the entry and its splits).
    """
    for s, spec in self.splits:
      if s == split:
        return spec
    raise DataError(
      f"dataset {self.name!r}: no split {split!r} (declared: {list(self.split_names)})"
    )


# (entry config dict, 'dataset <name>' for messages, problems) -> the declared splits. A
# problem is appended to `problems` (naming the entry, the field and the value), not raised,
# so one error lists every problem of every entry.
SplitsFn = Callable[[dict, str, list], list[tuple[str, SplitSpec]]]


@dataclasses.dataclass(frozen=True)
class Reader:
  """How entries of one `kind` are declared, checked and read.

  Attributes:
    kind: the entry's `kind` value, e.g. 'coco'.
    splits: `SplitsFn`: the entry's splits from its config (paths resolved, nothing read).
    load: (entry, split, coco_options) -> the split as a `CocoSource` (boxes xyxy float32
      pixels in `load()`); `coco_options` go to `CocoSource` (e.g. `exif_orientation`).
      Raises DataError naming the file, field and value.
    check: entry -> every problem `load` would meet on any declared split, without reading
      images (messages naming the entry, the split field and the value; [] when fine).
    fields: the entry-level config fields of this kind beyond the common ones
      (`entries.COMMON_FIELDS`); another kind's entry setting one is refused.
    defaults: entry config -> defaults of `exclude_category_ids`, `subset_size`,
      `max_detections` (e.g. the ODinW registry's); None: none.
    evaluation: the protocol an entry that sets none gets ('coco' | 'lvis') without reading
      its annotations (large jsons); None: inferred by `infer_evaluation`.
    infer_evaluation: (entry, split) -> 'coco' | 'lvis' from the annotations; None: from the
      split's COCO json (`readers.coco.json_protocol`).
    root_folder: the folder below the config's `data.root` holding the dataset ('' when not
      below it): an entry without `root` then takes `data.root` (`benchmark.declaration`).
    label: the results table's column label of such a set ('' : the entry's name).
  """

  kind: str
  splits: SplitsFn
  load: Callable[[DatasetEntry, str, dict], CocoSource]
  check: Callable[[DatasetEntry], list[str]]
  fields: tuple[str, ...] = ()
  defaults: Callable[[dict], dict[str, Any]] | None = None
  evaluation: str | None = None
  infer_evaluation: Callable[[DatasetEntry, str], str] | None = None
  root_folder: str = ""
  label: str = ""


# kind -> Reader, in registration order (the built-in kinds first: `owl_cl.data.readers`).
READERS: dict[str, Reader] = {}


def register(reader: Reader) -> Reader:
  """Adds `reader` to `READERS` and returns it.

  Raises:
    ValueError: another reader already has its kind, or its evaluation is not in EVALUATIONS.
  """
  if reader.kind in READERS and READERS[reader.kind] is not reader:
    raise ValueError(f"a reader of kind {reader.kind!r} is already registered")
  if reader.evaluation not in (None, *EVALUATIONS):
    raise ValueError(
      f"reader {reader.kind!r}: evaluation {reader.evaluation!r} not in {EVALUATIONS}"
    )
  READERS[reader.kind] = reader
  return reader


def get(kind: str) -> Reader:
  """The reader of `kind`.

  Raises:
    DataError: no reader of that kind is registered (names the known kinds).
  """
  if kind not in READERS:
    raise DataError(f"no dataset reader of kind {kind!r}; known: {tuple(READERS)}")
  return READERS[kind]


def as_dict(cfg: Any, where: str) -> dict[str, Any]:
  """`cfg` (a dict or an ml_collections ConfigDict) as a dict.

  Raises:
    DataError: `cfg` is not a mapping (names `where` and the value).
  """
  if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
    cfg = cfg.to_dict()
  if not isinstance(cfg, Mapping):
    raise DataError(f"{where}: must be a dict, got {type(cfg).__name__} {cfg!r}")
  return dict(cfg)


def ints(value: Any, where: str) -> tuple[int, ...]:
  """`value` (a sequence) as a tuple of ints.

  Raises:
    DataError: an element that is not an integer (names `where` and the value).
  """
  try:
    return tuple(int(v) for v in value)
  except (TypeError, ValueError):
    raise DataError(f"{where}: must be a list of integers, got {value!r}") from None


def entry_root(cfg: dict) -> str:
  """An entry config's `root`, '~' expanded ('' when unset)."""
  return os.path.expanduser(str(cfg.get("root", "") or ""))


def balanced_train_subset(entry: DatasetEntry, split: str, source: CocoSource) -> CocoSource:
  """`source` restricted to the entry's balanced training subset (`odinw.balanced_subset`)
  when `split` is 'train' and the entry sets `subset_size` and `subset_seed`; else `source`."""
  if split == "train" and entry.subset_size is not None and entry.subset_seed is not None:
    ids = odinw.balanced_subset(source, entry.subset_size, entry.subset_seed)
    if len(ids) < len(source):
      return source.subset(ids, name=entry.name)
  return source


def coco_json_source(entry: DatasetEntry, split: str, coco_options: dict) -> CocoSource:
  """The `CocoSource` of `split`'s COCO json and image folder (`entry.split(split)`): named
  `entry.name` for 'train', `<name>/<split>` otherwise, the entry's excluded category ids left
  out, restricted to its balanced training subset (`balanced_train_subset`). `coco_options`:
  `CocoSource`'s keyword options. The `Reader.load` of every kind whose splits are COCO jsons
  (kinds 'coco', 'coco2017').

  Raises:
    DataError: undeclared split; what `CocoSource` raises for an unreadable json.
  """
  spec = entry.split(split)
  label = entry.name if split == "train" else f"{entry.name}/{split}"
  source = CocoSource(
    spec.annotation_file,
    spec.image_dir,
    label,
    exclude_category_ids=entry.exclude_category_ids,
    **coco_options,
  )
  return balanced_train_subset(entry, split, source)

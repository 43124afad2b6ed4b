"""Dataset entries: one detection dataset declared as data (COCO folder, TFDS, ODinW member).

A `DatasetEntry` says, per split ('train' | 'val' | 'test'), where the split comes from; the
library turns it into the `CocoSource` every other part of owl_cl consumes:

* kind 'coco': a COCO json + the image folder its `file_name`s are relative to, per split;
* kind 'tfds': 'tfds:<name>[:<version>]' + a TFDS data folder, and the TFDS split name of each
  split (ArrayRecord files, read without TensorFlow: `owl_cl.data.tfds_source`);
* kind 'odinw': a member of the paper's 15 ODinW datasets (`owl_cl.data.odinw` registry:
  folders, category check, balanced training subsets), loaded exactly as `odinw_source` does;
* kind 'objects365' / 'lvis': Objects365 v2 (splits train, val) / LVIS v1 (split val; train
  when declared) below `root`, read by their own readers (`owl_cl.data.pretraining`: forbidden
  categories removed from Objects365 train, LVIS images found through `coco_url`);
* kind 'coco2017': COCO 2017 (split val; train when declared) below `root`,
  `<root>/coco/annotations/instances_<split>2017.json` with the images in
  `<root>/coco/<split>2017/` (`pretraining.coco_paths`), read by pycocotools like kind 'coco'
  (the IVLOD protocol's zero-shot "ZCOCO" set, docs/ivlod.md).

Named suites (ODinW-13, ODinW-35, the paper's 15, the built-in benchmark) expand to lists of
entries: `owl_cl.data.suites`.

Config form (a dict or `ml_collections.ConfigDict`; `entry_from_config`):

    dict(name="robot_kitchen", kind="coco",
         train=dict(annotation_file="/d/kitchen/train.json", image_dir="/d/kitchen/images"),
         test=dict(annotation_file="/d/kitchen/test.json", image_dir="/d/kitchen/images"))
    dict(name="coco", kind="tfds", tfds="tfds:coco/2017", data_dir="/d/tfds",
         train="train", test="validation")   # a string is the TFDS split name

The evaluation protocol ('coco': COCO AP; 'lvis': federated LVIS AP / APr) is the entry's
`evaluation` when set, else inferred from the annotations (`evaluation_protocol`): LVIS fields
(`neg_category_ids` / `not_exhaustive_category_ids` on images, `frequency` on categories)
present -> 'lvis'.

Source: COCO data format (cocodataset.org/#format-data); LVIS v1 format (lvisdataset.org);
TFDS data_source / ArrayRecord docs; docs/reference.md §10 (the paper's datasets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import numbers
import os
from typing import Any

from owl_cl.data import odinw
from owl_cl.data import pretraining
from owl_cl.data import tfds_source
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError

__all__ = [
  "KINDS",
  "SPLITS",
  "EVALUATIONS",
  "SplitSpec",
  "DatasetEntry",
  "entry_from_config",
  "load_split",
  "check_entry",
  "check_entries",
  "evaluation_protocol",
]

KINDS = ("coco", "tfds", "odinw", "objects365", "lvis", "coco2017")
# Kinds whose files sit at fixed places below a data `root`, with their default splits.
_ROOTED_SPLITS = {"objects365": ("train", "val"), "lvis": ("val",), "coco2017": ("val",)}
_ROOTED_PATHS = {
  "objects365": pretraining.objects365_paths,
  "lvis": pretraining.lvis_paths,
  "coco2017": pretraining.coco_paths,
}
SPLITS = ("train", "val", "test")
EVALUATIONS = ("coco", "lvis")
_LVIS_IMAGE_FIELDS = ("neg_category_ids", "not_exhaustive_category_ids")


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
  """One dataset, declared as data (see the module docstring).

  Attributes:
    name: display name (results tables, logs); unique within a run.
    kind: 'coco' | 'tfds' | 'odinw'.
    splits: ((split, SplitSpec), ...) for the splits it has, in ('train', 'val', 'test') order.
    evaluation: 'coco' | 'lvis' | None (None: inferred, `evaluation_protocol`).
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


_ENTRY_KEYS = {
  "name",
  "kind",
  "evaluation",
  "exclude_category_ids",
  "subset_size",
  "subset_seed",
  "max_detections",
  "member",
  "root",
  "tfds",
  "data_dir",
  "category_ids",
  "categories_file",
  *SPLITS,
}
_SPLIT_KEYS = {f.name for f in dataclasses.fields(SplitSpec)}
_KIND_FIELDS = {
  "member": ("odinw",),
  "root": ("odinw", "objects365", "lvis", "coco2017"),
  "tfds": ("tfds",),
  "data_dir": ("tfds",),
  "category_ids": ("tfds",),
  "categories_file": ("tfds",),
}
_DEFAULT_TFDS_SPLIT = {"train": "train", "val": "validation", "test": "test"}


def _as_dict(cfg: Any, where: str) -> dict[str, Any]:
  if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
    cfg = cfg.to_dict()
  if not isinstance(cfg, Mapping):
    raise DataError(f"{where}: must be a dict, got {type(cfg).__name__} {cfg!r}")
  return dict(cfg)


def _ints(value: Any, where: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in value)
  except (TypeError, ValueError):
    raise DataError(f"{where}: must be a list of integers, got {value!r}") from None


def entry_from_config(cfg: Any) -> DatasetEntry:
  """A `DatasetEntry` from its config form (module docstring).

  Keys: name, kind, train / val / test (a dict of `SplitSpec` fields; for kind 'tfds' also a
  string, the TFDS split name), evaluation, exclude_category_ids, subset_size, subset_seed,
  max_detections, member, root; for kind 'tfds' the entry-level tfds / data_dir /
  category_ids are the default of every split. Kind 'odinw' needs only member and root (the
  registry gives the paths; splits default to train, val, test). `max_detections` (int >= 1)
  applies to every kind; unset it is None (the config's) or, for kind 'odinw', the registry's.

  Raises:
    DataError: every structural problem at once (unknown key, missing name or kind, unknown
      kind / evaluation / member, a split of the wrong type or with unknown fields, a
      'coco' split without annotation_file / image_dir, a 'tfds' split without tfds, a
      max_detections that is not a positive integer), each
      naming the entry, the field and the value. Files are not looked at: `check_entry`.
  """
  cfg = _as_dict(cfg, "dataset entry")
  name = str(cfg.get("name", "") or "")
  where = f"dataset {name!r}" if name else f"dataset entry {cfg!r}"
  problems = []
  for k in sorted(set(cfg) - _ENTRY_KEYS):
    problems.append(f"{where}: unknown field {k!r} (known: {sorted(_ENTRY_KEYS)})")
  kind = cfg.get("kind")
  if not name:
    problems.append(f"{where}: field 'name' is missing or empty")
  if kind not in KINDS:
    problems.append(f"{where}: field 'kind' has value {kind!r}, expected one of {KINDS}")
  evaluation = cfg.get("evaluation")
  if evaluation not in (None, *EVALUATIONS):
    problems.append(
      f"{where}: field 'evaluation' has value {evaluation!r}, expected one of {EVALUATIONS}"
    )
  member = str(cfg.get("member", "") or "")
  root = os.path.expanduser(str(cfg.get("root", "") or ""))
  # Fields of one kind given to another would be silently ignored: refuse them.
  for k, kinds in _KIND_FIELDS.items():
    if cfg.get(k) not in (None, "") and kind in KINDS and kind not in kinds:
      problems.append(f"{where}: field {k!r} ({cfg[k]!r}) applies to kind {kinds}, not {kind!r}")
  if kind == "odinw":
    splits = _odinw_splits(cfg, where, member, root, problems)
  elif kind in _ROOTED_SPLITS:
    splits = _rooted_splits(cfg, where, kind, root, problems)
  else:
    splits = _declared_splits(cfg, where, kind, problems)
  spec = odinw.ODINW_DATASETS.get(member) if kind == "odinw" else None
  max_detections = _max_detections(cfg, where, spec, problems)
  if problems:
    raise DataError("\n".join(problems))
  if max_detections is not None:
    max_detections = int(max_detections)
  return DatasetEntry(
    name=name,
    kind=kind,
    splits=tuple(splits),
    evaluation=evaluation,
    exclude_category_ids=_ints(
      cfg.get("exclude_category_ids", spec.exclude_category_ids if spec else ()),
      f"{where} field 'exclude_category_ids'",
    ),
    subset_size=cfg.get("subset_size", spec.subset_size if spec else None),
    subset_seed=cfg.get("subset_seed", 0),
    max_detections=max_detections,
    member=member,
    root=root,
  )


def _odinw_splits(cfg, where, member, root, problems) -> list[tuple[str, SplitSpec]]:
  """Kind 'odinw': the member's registry paths of the declared splits (all three when none
  is declared). Problems are appended to `problems`; no splits once there is any."""
  splits = []
  if member not in odinw.ODINW_DATASETS:
    problems.append(
      f"{where}: field 'member' has value {member!r}, expected one of {odinw.ODINW_NAMES}"
    )
  if not root:
    problems.append(f"{where}: field 'root' (the data root holding odinw/) is missing")
  if not problems:
    for s in SPLITS:
      if s in cfg or not any(x in cfg for x in SPLITS):
        ann, img = odinw.odinw_paths(root, member, s)
        splits.append((s, SplitSpec(annotation_file=ann, image_dir=img)))
  return splits


def _rooted_splits(cfg, where, kind, root, problems) -> list[tuple[str, SplitSpec]]:
  """Kinds 'objects365' / 'lvis' / 'coco2017': the fixed files of the splits named (fields set
  to True; default `_ROOTED_SPLITS`). Problems are appended to `problems`; no splits once
  there is any."""
  splits = []
  if not root:
    folder = "coco" if kind == "coco2017" else kind
    problems.append(f"{where}: field 'root' (the data root holding {folder}/) is missing")
  paths = _ROOTED_PATHS[kind]
  declared = [s for s in SPLITS if s in cfg]
  for s in declared:
    if s == "test" or cfg[s] not in (True, None, "", {}):
      problems.append(
        f"{where} field {s!r}: kind {kind!r} has fixed files; give only the split names "
        f"('train', 'val') as fields set to True, got {cfg[s]!r}"
      )
  if not problems:
    for s in [s for s in declared if cfg[s] is not None] or _ROOTED_SPLITS[kind]:
      ann, img = paths(root, s)
      splits.append((s, SplitSpec(annotation_file=ann, image_dir=img)))
  return splits


def _declared_splits(cfg, where, kind, problems) -> list[tuple[str, SplitSpec]]:
  """Kinds 'coco' / 'tfds': each declared split's `SplitSpec` (for 'tfds', a string is the
  TFDS split name and the entry-level tfds / data_dir / category_ids / categories_file are
  the defaults). Problems are appended to `problems`; a split with one is left out."""
  splits = []
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
      value = _as_dict(value, fwhere)
    except DataError as e:
      problems.append(str(e))
      continue
    unknown = sorted(set(value) - _SPLIT_KEYS)
    if unknown:
      problems.append(f"{fwhere}: unknown field(s) {unknown} (known: {sorted(_SPLIT_KEYS)})")
      continue
    if kind == "tfds":
      for k in ("tfds", "data_dir", "category_ids", "categories_file"):
        if not value.get(k) and cfg.get(k):
          value[k] = cfg[k]
      value.setdefault("split", _DEFAULT_TFDS_SPLIT[s])
      if not str(value.get("tfds", "")).startswith(tfds_source.TFDS_PREFIX):
        problems.append(
          f"{fwhere}: field 'tfds' has value {value.get('tfds')!r}, expected "
          f"'tfds:<name>[:<version>]'"
        )
      value["data_dir"] = os.path.expanduser(str(value.get("data_dir", "") or ""))
      if value.get("category_ids") is not None:
        try:
          value["category_ids"] = _ints(value["category_ids"], f"{fwhere} 'category_ids'")
        except DataError as e:
          problems.append(str(e))
          continue
    elif kind == "coco":
      for k in ("annotation_file", "image_dir"):
        if not value.get(k):
          problems.append(f"{fwhere}: field {k!r} is missing or empty")
        else:
          value[k] = os.path.expanduser(str(value[k]))
    splits.append((s, SplitSpec(**value)))
  if kind in ("coco", "tfds") and not splits and not problems:
    problems.append(f"{where}: declares none of the splits {SPLITS}")
  return splits


def _max_detections(cfg, where, spec, problems):
  """The entry's `max_detections`: its own value, else an ODinW member's registry default
  (`spec`), else None. A value that is not a positive integer is appended to `problems`."""
  # An entry's own value wins; an ODinW member's default is the registry's (paper protocol).
  max_detections = cfg.get("max_detections")
  if max_detections is None and spec is not None:
    max_detections = spec.max_detections
  if max_detections is not None and (
    isinstance(max_detections, bool)
    or not isinstance(max_detections, numbers.Integral)
    or max_detections < 1
  ):
    problems.append(
      f"{where}: field 'max_detections' has value {max_detections!r}, expected a positive "
      f"integer (detections kept per image) or None (the config's eval.top_k / max_dets)"
    )
  return max_detections


def load_split(entry: DatasetEntry, split: str, **coco_options) -> CocoSource:
  """The `split` of `entry` as a `CocoSource`.

  Args:
    entry: the dataset. split: 'train' | 'val' | 'test' (declared by the entry).
    **coco_options: passed to `CocoSource` (check_files, on_invalid, cache_images, ...).

  Returns:
    CocoSource named `entry.name` (train) or '<name>/<split>': boxes xyxy float32 pixels in
    `load()`, COCO xywh pixels in `.coco`; `iscrowd` boxes kept for evaluation only; LVIS
    per-image fields and category `frequency` carried when the annotations have them. Kind
    'odinw' is `odinw.odinw_source(root, member, split, subset_seed=...)` (same images, boxes,
    labels and balanced subset as the paper protocol).

  Raises:
    DataError: undeclared split, and every error of `CocoSource` / `tfds_source` (missing or
      malformed file, names file, field and value).
  """
  spec = entry.split(split)
  label = entry.name if split == "train" else f"{entry.name}/{split}"
  if entry.kind in ("objects365", "lvis"):
    read = pretraining.objects365_source if entry.kind == "objects365" else pretraining.lvis_source
    return read(entry.root, split, **coco_options)
  if entry.kind == "odinw":
    return odinw.odinw_source(
      entry.root,
      entry.member,
      split,
      subset_seed=entry.subset_seed,
      subset_size=entry.subset_size,
      **coco_options,
    )
  if entry.kind == "tfds":
    source = tfds_source.tfds_source(
      spec.tfds,
      spec.data_dir or None,
      spec.split,
      name=label,
      category_ids=spec.category_ids,
      where=f"dataset {entry.name!r} field {split!r}",
      categories_file=spec.categories_file or None,
      exclude_category_ids=entry.exclude_category_ids,
      **coco_options,
    )
  elif entry.kind in ("coco", "coco2017"):
    source = CocoSource(
      spec.annotation_file,
      spec.image_dir,
      label,
      exclude_category_ids=entry.exclude_category_ids,
      **coco_options,
    )
  else:
    raise DataError(f"dataset {entry.name!r}: field 'kind' has value {entry.kind!r}")
  if split == "train" and entry.subset_size is not None and entry.subset_seed is not None:
    ids = odinw.balanced_subset(source, entry.subset_size, entry.subset_seed)
    if len(ids) < len(source):
      source = source.subset(ids, name=label)
  return source


def _read_json(path: str, where: str, problems: list[str]) -> dict | None:
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


def check_entry(entry: DatasetEntry, required: Sequence[str] = ()) -> list[str]:
  """Every problem that would stop `load_split` on any declared split, without reading images.

  `required`: splits the entry's role needs (e.g. ('train', 'test') for a sequence task).

  Reads the COCO jsons (kind 'coco' / 'odinw') or the TFDS metadata (kind 'tfds'); image
  files are not opened (`CocoSource` checks they exist when a split is loaded).

  Returns:
    list of messages, each naming the entry, the split field and the value (empty: fine):
    no split declared / a `required` split missing; missing annotation file or image
    folder; unreadable json; json without COCO lists; a split without images; an empty
    category name; two categories with the same name (names are the prompts: a clash
    makes two classes one); splits whose class lists differ; unreadable TFDS folder,
    tfrecord-only TFDS dataset (with how to prepare it as ArrayRecord), unknown / empty
    TFDS split; an 'odinw' member with a missing file.
  """
  where0 = f"dataset {entry.name!r}"
  problems: list[str] = []
  if not entry.splits:
    return [f"{where0}: declares none of the splits {SPLITS}"]
  for split in required:
    if split not in entry.split_names:
      problems.append(
        f"{where0}: no {split!r} split (declared: {list(entry.split_names)}); its role in "
        f"the run needs {list(required)}"
      )
  if entry.kind == "odinw":
    missing = odinw.missing_files(entry.root, [entry.member], entry.split_names)
    problems.extend(f"{where0} (ODinW {entry.member}): missing {p}" for p in missing)
  if entry.kind in _ROOTED_SPLITS:
    # Their jsons are large (Objects365 train: GBs): only the files are checked here.
    for split, spec in entry.splits:
      where = f"{where0} field '{split}'"
      if not os.path.isfile(spec.annotation_file):
        problems.append(f"{where} 'annotation_file': file not found: {spec.annotation_file!r}")
      if not os.path.isdir(spec.image_dir):
        problems.append(f"{where} 'image_dir': folder not found: {spec.image_dir!r}")
    return problems
  names_by_split: dict[str, list[str]] = {}
  for split, spec in entry.splits:
    where = f"{where0} field '{split}'"
    if entry.kind == "tfds":
      problems.extend(_tfds_split_problems(entry, spec, where))
      continue
    if entry.kind == "odinw" and not os.path.isfile(spec.annotation_file):
      continue  # reported above with the layout
    names = _coco_split_problems(entry, spec, where, problems)
    if names is not None:
      names_by_split[split] = names
  ref = next(iter(names_by_split.items()), None)
  for split, names in names_by_split.items():
    if ref is not None and names != ref[1]:
      problems.append(
        f"{where0}: field '{split}' categories {names} differ from field '{ref[0]}' "
        f"categories {ref[1]}"
      )
  return problems


def _tfds_split_problems(entry: DatasetEntry, spec: SplitSpec, where: str) -> list[str]:
  """`check_entry`'s problems of one 'tfds' split: the TFDS folder and split, and the
  categories file the 'lvis' protocol needs."""
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


def _coco_split_problems(
  entry: DatasetEntry, spec: SplitSpec, where: str, problems: list[str]
) -> list[str] | None:
  """`check_entry`'s checks of one COCO-json split (kinds 'coco', 'odinw'), appended to
  `problems`. Returns its class names, or None when its json cannot be read."""
  if not spec.image_dir or not os.path.isdir(spec.image_dir):
    problems.append(f"{where} 'image_dir': folder not found: {spec.image_dir!r}")
  data = _read_json(spec.annotation_file, where, problems)
  if data is None:
    return None
  if not data["images"]:
    problems.append(f"{where} 'annotation_file': {spec.annotation_file} has no images")
  names = _coco_names(data, entry.exclude_category_ids)
  if entry.kind == "odinw":
    spec_o = odinw.ODINW_DATASETS[entry.member]
    expected = [
      n
      for i, n in enumerate(spec_o.category_names, start=1)
      if i not in spec_o.exclude_category_ids
    ]
    if names != expected:
      problems.append(
        f"{where} 'annotation_file': {spec.annotation_file} has categories {names}, "
        f"expected {expected} for ODinW {entry.member}"
      )
  if not names:
    problems.append(f"{where} 'annotation_file': {spec.annotation_file} has no categories")
  if entry.evaluation == "lvis" or (entry.evaluation is None and _has_lvis_fields(data)):
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


def check_entries(entries: Sequence[DatasetEntry], required: Sequence[str] = ()) -> None:
  """Check a run's entries together: `check_entry(e, required)` of each, and duplicate names.

  Raises:
    DataError: one error listing every problem of every entry.
  """
  problems = []
  seen = set()
  for e in entries:
    if e.name in seen:
      problems.append(f"dataset {e.name!r}: field 'name' is used by two entries")
    seen.add(e.name)
    problems.extend(check_entry(e, required))
  if problems:
    raise DataError(f"{len(problems)} dataset problem(s):\n  " + "\n  ".join(problems))


def evaluation_protocol(entry: DatasetEntry, split: str = "test") -> str:
  """'coco' or 'lvis': `entry.evaluation` when set, else inferred from `split`'s annotations
  (LVIS fields `neg_category_ids` / `not_exhaustive_category_ids` on an image or `frequency`
  on a category -> 'lvis'; TFDS: the features `neg_category_ids` /
  `not_exhaustive_category_ids`).

  Raises:
    DataError: undeclared split; unreadable json or TFDS folder.
  """
  if entry.evaluation is not None:
    return entry.evaluation
  spec = entry.split(split)
  if entry.kind == "tfds":
    return "lvis" if tfds_source.tfds_has_lvis_fields(spec.tfds, spec.data_dir or None) else "coco"
  problems: list[str] = []
  data = _read_json(spec.annotation_file, f"dataset {entry.name!r} field '{split}'", problems)
  if data is None:
    raise DataError(problems[0])
  return "lvis" if _has_lvis_fields(data) else "coco"


def _has_lvis_fields(data: dict) -> bool:
  """LVIS per-image fields on an image, or `frequency` on a category, of a COCO json."""
  return any(
    isinstance(im, dict) and any(f in im for f in _LVIS_IMAGE_FIELDS) for im in data["images"]
  ) or any(isinstance(c, dict) and "frequency" in c for c in data["categories"])

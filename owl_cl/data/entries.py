"""Dataset entries: one detection dataset declared as data (COCO folder, TFDS, ODinW member).

A `DatasetEntry` says, per split ('train' | 'val' | 'test'), where the split comes from; the
library turns it into the `CocoSource` every other part of owl_cl consumes. Each `kind` is
read by one reader module of `owl_cl.data.readers`, registered in `readers.READERS` (built
in: 'coco', a COCO json + its image folder per split; 'tfds', a TFDS dataset's ArrayRecord
files read without TensorFlow; 'odinw', a member of the paper's 15 ODinW datasets;
'objects365', 'lvis', 'coco2017', the fixed files below a data `root`). This module holds
what every kind shares: the entry's common fields, the checks and the dispatch.

Named suites (ODinW-13, ODinW-35, the paper's 15, the built-in benchmark) expand to lists of
entries: `owl_cl.data.suites`.

Config form (a dict or `ml_collections.ConfigDict`; `entry_from_config`):

    dict(name="robot_kitchen", kind="coco",
         train=dict(annotation_file="/d/kitchen/train.json", image_dir="/d/kitchen/images"),
         test=dict(annotation_file="/d/kitchen/test.json", image_dir="/d/kitchen/images"))
    dict(name="coco", kind="tfds", tfds="tfds:coco/2017", data_dir="/d/tfds",
         train="train", test="validation")   # a string is the TFDS split name

The evaluation protocol ('coco': COCO AP; 'lvis': federated LVIS AP / APr) is the entry's
`evaluation` when set, else its reader's, else inferred from the annotations
(`evaluation_protocol`): LVIS fields
(`neg_category_ids` / `not_exhaustive_category_ids` on images, `frequency` on categories)
present -> 'lvis'.

Source: COCO data format (cocodataset.org/#format-data); LVIS v1 format (lvisdataset.org);
TFDS data_source / ArrayRecord docs; docs/reference.md §10 (the paper's datasets).
"""

from __future__ import annotations

from collections.abc import Sequence
import numbers
from typing import Any

from owl_cl.data import readers
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError
from owl_cl.data.readers.reader import EVALUATIONS
from owl_cl.data.readers.reader import SPLITS
from owl_cl.data.readers.reader import DatasetEntry
from owl_cl.data.readers.reader import SplitSpec

__all__ = [
  "kinds",
  "SPLITS",
  "EVALUATIONS",
  "COMMON_FIELDS",
  "SplitSpec",
  "DatasetEntry",
  "entry_from_config",
  "load_split",
  "check_entry",
  "check_entries",
  "evaluation_protocol",
]

# The entry fields of every kind (a reader adds its own, `Reader.fields`).
COMMON_FIELDS = (
  "name",
  "kind",
  "evaluation",
  "exclude_category_ids",
  "subset_size",
  "subset_seed",
  "max_detections",
)


def kinds() -> tuple[str, ...]:
  """The registered kinds (`readers.READERS`), built-in ones first."""
  return tuple(readers.READERS)


def _kind_fields() -> dict[str, tuple[str, ...]]:
  """{reader field: the kinds that have it}, e.g. {'root': ('odinw', 'objects365', ...)}."""
  out: dict[str, tuple[str, ...]] = {}
  for kind, reader in readers.READERS.items():
    for field in reader.fields:
      out[field] = out.get(field, ()) + (kind,)
  return out


def entry_from_config(cfg: Any) -> DatasetEntry:
  """A `DatasetEntry` from its config form (module docstring).

  Keys: `COMMON_FIELDS` (name, kind, evaluation, exclude_category_ids, subset_size,
  subset_seed, max_detections), train / val / test, and the fields of the kind's reader
  (`Reader.fields`: 'odinw' member and root; 'tfds' the entry-level tfds / data_dir /
  category_ids / categories_file, the default of every split; the rooted kinds root). The
  reader turns the splits into `SplitSpec`s (`Reader.splits`) and may give defaults (kind
  'odinw': the registry's). `max_detections` (int >= 1) applies to every kind; unset it is
  None (the config's) or the reader's default.

  Raises:
    DataError: every structural problem at once (unknown key, missing name or kind, unknown
      kind / evaluation / member, a split of the wrong type or with unknown fields, a
      'coco' split without annotation_file / image_dir, a 'tfds' split without tfds, a
      max_detections that is not a positive integer), each
      naming the entry, the field and the value. Files are not looked at: `check_entry`.
  """
  cfg = readers.reader.as_dict(cfg, "dataset entry")
  name = str(cfg.get("name", "") or "")
  where = f"dataset {name!r}" if name else f"dataset entry {cfg!r}"
  kind_fields = _kind_fields()
  known_keys = {*COMMON_FIELDS, *kind_fields, *SPLITS}
  problems = [
    f"{where}: unknown field {k!r} (known: {sorted(known_keys)})"
    for k in sorted(set(cfg) - known_keys)
  ]
  kind = cfg.get("kind")
  if not name:
    problems.append(f"{where}: field 'name' is missing or empty")
  reader = readers.READERS.get(kind) if isinstance(kind, str) else None
  if reader is None:
    problems.append(f"{where}: field 'kind' has value {kind!r}, expected one of {kinds()}")
  evaluation = cfg.get("evaluation")
  if evaluation not in (None, *EVALUATIONS):
    problems.append(
      f"{where}: field 'evaluation' has value {evaluation!r}, expected one of {EVALUATIONS}"
    )
  # Fields of one kind given to another would be silently ignored: refuse them.
  for k, owners in kind_fields.items():
    if cfg.get(k) not in (None, "") and reader is not None and kind not in owners:
      problems.append(f"{where}: field {k!r} ({cfg[k]!r}) applies to kind {owners}, not {kind!r}")
  splits = reader.splits(cfg, where, problems) if reader is not None else []
  defaults = reader.defaults(cfg) if reader is not None and reader.defaults else {}
  max_detections = _max_detections(cfg, where, defaults.get("max_detections"), problems)
  if problems:
    raise DataError("\n".join(problems))
  return DatasetEntry(
    name=name,
    kind=kind,
    splits=tuple(splits),
    evaluation=evaluation,
    exclude_category_ids=readers.reader.ints(
      cfg.get("exclude_category_ids", defaults.get("exclude_category_ids", ())),
      f"{where} field 'exclude_category_ids'",
    ),
    subset_size=cfg.get("subset_size", defaults.get("subset_size")),
    subset_seed=cfg.get("subset_seed", 0),
    max_detections=None if max_detections is None else int(max_detections),
    member=str(cfg.get("member", "") or ""),
    root=readers.reader.entry_root(cfg),
  )


def _max_detections(cfg, where, default, problems):
  """The entry's `max_detections`: its own value, else the reader's `default` (an ODinW
  member's registry value), else None. A value that is not a positive integer is appended to
  `problems`."""
  max_detections = cfg.get("max_detections")
  if max_detections is None:
    max_detections = default
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
  """The `split` of `entry` as a `CocoSource`, read by the reader of its kind (`Reader.load`).

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
    DataError: undeclared split, unregistered kind, and every error of the reader
      (`CocoSource` / `tfds_source`: missing or malformed file, names file, field and value).
  """
  entry.split(split)
  return readers.get(entry.kind).load(entry, split, coco_options)


def check_entry(entry: DatasetEntry, required: Sequence[str] = ()) -> list[str]:
  """Every problem that would stop `load_split` on any declared split, without reading images.

  `required`: splits the entry's role needs (e.g. ('train', 'test') for a sequence task).

  Returns:
    list of messages, each naming the entry, the split field and the value (empty: fine):
    no split declared / a `required` split missing, then the reader's (`Reader.check`; for
    the json kinds: missing annotation file or image folder, unreadable json, json without
    COCO lists, a split without images, an empty or repeated category name, splits whose
    class lists differ; 'tfds': unreadable folder, tfrecord-only dataset, unknown / empty
    split; 'odinw': a missing file; the rooted kinds: only that their files exist).
  """
  where0 = f"dataset {entry.name!r}"
  if not entry.splits:
    return [f"{where0}: declares none of the splits {SPLITS}"]
  problems = [
    f"{where0}: no {split!r} split (declared: {list(entry.split_names)}); its role in "
    f"the run needs {list(required)}"
    for split in required
    if split not in entry.split_names
  ]
  return problems + readers.get(entry.kind).check(entry)


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
  """'coco' or 'lvis': `entry.evaluation` when set, else its reader's (`Reader.evaluation`,
  kinds whose jsons are large), else inferred from `split`'s annotations
  (`Reader.infer_evaluation`; by default the COCO json: LVIS fields `neg_category_ids` /
  `not_exhaustive_category_ids` on an image or `frequency` on a category -> 'lvis').

  Raises:
    DataError: undeclared split; unreadable json or TFDS folder; unregistered kind.
  """
  if entry.evaluation is not None:
    return entry.evaluation
  reader = readers.get(entry.kind)
  if reader.evaluation is not None:
    return reader.evaluation
  infer = reader.infer_evaluation or readers.coco.json_protocol
  return infer(entry, split)

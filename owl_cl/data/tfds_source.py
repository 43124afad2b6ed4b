"""TFDS detection datasets (ArrayRecord) as `CocoSource`s, with no TensorFlow at read time.

A prepared TFDS dataset is a folder `<data_dir>/<name>/<version>/` holding `dataset_info.json`,
`features.json` and the record shards. `tfds_source` opens it with
`tfds.builder_from_directory(...).as_data_source(split)` (the random-access ArrayRecord reader
behind `tfds.data_source`; it needs no registered builder class, so any prepared folder works),
reads every record's annotations once, and returns the same in-memory `CocoSource` a COCO json
gives. Only the fields used are decoded (`_Records`), with TFDS' numpy decoders: no `tensorflow`
module is imported. Pixels are not decoded then: the image stays encoded
(`tfds.decode.SkipDecoding`), only its header is parsed for the size, and `TfdsImageReader`
(the `image_reader` hook of `CocoSource`, chosen over materialising image files: no copy of
the dataset on disk) decodes the bytes with PIL when the pipeline loads an example.

Features read (TFDS `coco/2017` and `lvis` 1.2-1.4 name them so; any detection dataset with
`objects/bbox` + `objects/label` works):

* `image` (encoded bytes), `image/id` (int; default: the record index), `image/filename`;
* `objects/bbox`: float32 [M, 4] normalised `[ymin, xmin, ymax, xmax]` (`tfds.features.BBox`);
* `objects/label`: int [M] 0-based `ClassLabel`; its `names` are the category names;
* optional `objects/is_crowd` (bool), `objects/area` (pixels^2), `objects/id` (annotation id);
* optional (LVIS) `neg_category_ids`, `not_exhaustive_category_ids`: 0-based labels per image.

Conversion (exact up to float32 storage): with image size W x H in pixels,
`x = xmin W`, `y = ymin H`, `w = (xmax - xmin) W`, `h = (ymax - ymin) H` (COCO xywh pixels),
computed in float64. TFDS stored `x / W` etc. as float32 (relative error <= 2^-24), so a
coordinate differs from the original COCO json value by at most ~6e-8 * W px (4e-5 px for a
640 px image). Category id of label `k`: `category_ids[k]` when given; the 80 COCO ids for
`coco/*` datasets with 80 classes (TFDS orders labels as the json's `categories`, i.e. by id);
otherwise `k + 1` (LVIS ids are 1..1203, TFDS `lvis` stores `category_id - 1`).
The LVIS `frequency` of a category is not a TFDS feature: pass `categories_file` (e.g. the LVIS
v1 json, or any json with a `categories` list) to merge each category's json fields (frequency,
synonyms, ...) by id; the names must agree.

Source: TFDS `tfds.data_source` / ArrayRecord guide; `tfds.features.BBoxFeature`
(normalised ymin, xmin, ymax, xmax); TFDS builders `object_detection/coco.py`
(`coco/2017`) and `datasets/lvis/lvis_dataset_builder.py` (`lvis` 1.1-1.4).
"""

from __future__ import annotations

from collections.abc import Sequence
import glob
import io
import json
import os
from typing import Any

import numpy as np
from PIL import Image

from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError

__all__ = [
  "COCO_2017_CATEGORY_IDS",
  "TFDS_PREFIX",
  "TfdsImageReader",
  "parse_tfds_name",
  "default_data_dir",
  "tfds_dataset_dir",
  "tfds_problems",
  "tfds_has_lvis_fields",
  "tfds_source",
]

TFDS_PREFIX = "tfds:"

# The 80 category ids of COCO 2017 instances, ascending (the json's `categories` order, which
# TFDS `coco/2017` labels follow: label k <-> the k-th category).
COCO_2017_CATEGORY_IDS = tuple(
  i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)
)

ARRAY_RECORD_HINT = (
  "prepare it as ArrayRecord (random access): `tfds build <name> --file_format=array_record "
  "--data_dir=<data_dir>`, or in Python `tfds.builder(name, data_dir=...).download_and_prepare("
  "file_format='array_record')`"
)

_LVIS_FIELDS = ("neg_category_ids", "not_exhaustive_category_ids")


def parse_tfds_name(ref: str) -> tuple[str, str | None]:
  """'tfds:<name>[:<version>]' -> (name, version or None), e.g. 'tfds:coco/2017:1.1.0' ->
  ('coco/2017', '1.1.0'). The 'tfds:' prefix is optional.

  Raises:
    DataError: empty name, or a version that is not 'X.Y.Z'.
  """
  body = ref[len(TFDS_PREFIX) :] if ref.startswith(TFDS_PREFIX) else ref
  name, _, version = body.partition(":")
  name = name.strip("/")
  if not name:
    raise DataError(f"TFDS reference {ref!r}: empty dataset name (expected 'tfds:<name>[:X.Y.Z]')")
  if version and not (version.count(".") == 2 and all(p.isdigit() for p in version.split("."))):
    raise DataError(f"TFDS reference {ref!r}: version {version!r} is not of the form X.Y.Z")
  return name, version or None


def default_data_dir() -> str:
  """TFDS' default data folder: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
  return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def _version_key(v: str) -> tuple[int, ...]:
  return tuple(int(p) for p in v.split("."))


def tfds_dataset_dir(ref: str, data_dir: str | None = None) -> str:
  """The prepared folder `<data_dir>/<name>/<version>` of 'tfds:<name>[:<version>]'.

  Without a version, the highest 'X.Y.Z' folder present is used.

  Raises:
    DataError: no such folder (the message lists the versions found).
  """
  name, version = parse_tfds_name(ref)
  data_dir = os.path.expanduser(data_dir or default_data_dir())
  base = os.path.join(data_dir, *name.split("/"))
  found = sorted(
    (
      v
      for v in (os.listdir(base) if os.path.isdir(base) else [])
      if v.count(".") == 2 and all(p.isdigit() for p in v.split("."))
    ),
    key=_version_key,
  )
  if version is None:
    if not found:
      raise DataError(
        f"{ref}: no prepared version under {base} (data_dir {data_dir!r}); {ARRAY_RECORD_HINT}"
      )
    version = found[-1]
  path = os.path.join(base, version)
  if not os.path.isfile(os.path.join(path, "dataset_info.json")):
    raise DataError(
      f"{ref}: {path} is not a prepared TFDS dataset (no dataset_info.json; versions found: "
      f"{found or 'none'}); {ARRAY_RECORD_HINT}"
    )
  return path


def _builder(path: str):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  return tfds.builder_from_directory(path)


def _feature_keys(features) -> set[str]:
  """Flat 'a/b' keys of a FeaturesDict (through Sequence wrappers)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  out = set()

  def walk(f, prefix):
    if isinstance(f, tfds.features.Sequence):
      f = f.feature
    if isinstance(f, tfds.features.FeaturesDict):
      for k in f.keys():
        walk(f[k], f"{prefix}{k}/")
    out.add(prefix.rstrip("/"))

  walk(features, "")
  out.discard("")
  return out


def _sub(features, key: str):
  """The feature at 'a/b' (through Sequence wrappers)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  f = features
  for k in key.split("/"):
    if isinstance(f, tfds.features.Sequence):
      f = f.feature
    f = f[k]
  if isinstance(f, tfds.features.Sequence):
    f = f.feature
  return f


def tfds_problems(
  ref: str,
  data_dir: str | None,
  split: str,
  where: str,
  category_ids: Sequence[int] | None = None,
) -> list[str]:
  """Every problem that would stop `tfds_source(ref, data_dir, split)`, read from the folder's
  metadata only (no record is read).

  Args:
    ref: 'tfds:<name>[:<version>]'. data_dir: TFDS data folder (None: `default_data_dir`).
    split: the TFDS split name. where: prefix of each message (entry and field).
    category_ids: the declared category id per label (checked: one per class, distinct).

  Returns:
    list of messages (empty when readable): missing / unreadable folder, tfrecord-only
    dataset (with how to prepare it as ArrayRecord), unknown split, empty split, missing
    `image` / `objects/bbox` / `objects/label` features, empty class names, duplicate names.
  """
  try:
    path = tfds_dataset_dir(ref, data_dir)
  except DataError as e:
    return [f"{where}: {e}"]
  try:
    with open(os.path.join(path, "dataset_info.json")) as f:
      info = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    return [f"{where}: {path}/dataset_info.json is unreadable ({e})"]
  problems = []
  fmt = info.get("fileFormat", "tfrecord")
  shards = glob.glob(os.path.join(path, "*.array_record-*"))
  if fmt != "array_record" or not shards:
    problems.append(
      f"{where}: {ref} at {path} is stored as {fmt!r} (not random access; "
      f"{len(shards)} ArrayRecord shards found); {ARRAY_RECORD_HINT}"
    )
    return problems
  try:
    builder = _builder(path)
  except Exception as e:  # pylint: disable=broad-except  # any failure: report, do not crash
    return [f"{where}: cannot open the TFDS folder {path}: {type(e).__name__}: {e}"]
  splits = builder.info.splits
  if split not in splits:
    problems.append(
      f"{where}: split {split!r} not in {ref} at {path} (splits: {sorted(splits.keys())})"
    )
  elif splits[split].num_examples == 0:
    problems.append(f"{where}: split {split!r} of {ref} at {path} has no examples")
  keys = _feature_keys(builder.info.features)
  for k in ("image", "objects/bbox", "objects/label"):
    if k not in keys:
      problems.append(
        f"{where}: {ref} at {path} has no feature {k!r} (features: {sorted(keys)}); a detection "
        f"dataset needs 'image', 'objects/bbox' and 'objects/label'"
      )
  if "objects/label" in keys:
    names = list(_sub(builder.info.features, "objects/label").names)
    problems.extend(_name_problems(names, f"{where}: {ref} objects/label names"))
    if category_ids is not None and (
      len(category_ids) != len(names) or len(set(category_ids)) != len(category_ids)
    ):
      problems.append(
        f"{where}: field 'category_ids' has value {list(category_ids)}: expected {len(names)} "
        f"distinct ids, one per objects/label class"
      )
  return problems


def _name_problems(names: Sequence[str], where: str) -> list[str]:
  out = []
  for i, n in enumerate(names):
    if not str(n).strip():
      out.append(f"{where}: class {i} has an empty name {n!r}")
  seen: dict[str, int] = {}
  for i, n in enumerate(names):
    key = str(n).strip().lower()
    if key and key in seen:
      out.append(f"{where}: classes {seen[key]} and {i} share the name {n!r}")
    seen.setdefault(key, i)
  return out


def tfds_has_lvis_fields(ref: str, data_dir: str | None = None) -> bool:
  """Whether the dataset has the LVIS per-image fields `neg_category_ids` /
  `not_exhaustive_category_ids` (then its evaluation protocol is 'lvis').

  Raises:
    DataError: see `tfds_dataset_dir`.
  """
  keys = _feature_keys(_builder(tfds_dataset_dir(ref, data_dir)).info.features)
  return any(f in keys for f in _LVIS_FIELDS)


_TOP_FIELDS = ("image", "image/id", "image/filename", *_LVIS_FIELDS)
_OBJECT_FIELDS = ("bbox", "label", "is_crowd", "area", "id")


class _Records:
  """Random access to the records of one split, decoding only the fields read here.

  The ArrayRecord reader of `tfds.data_source` returns raw bytes
  (`DeserializeMethod.RAW_BYTES`); they are decoded with a FeaturesDict restricted to
  `_TOP_FIELDS` and `objects/_OBJECT_FIELDS` (numpy backend), the image left encoded
  (`SkipDecoding`). Restricting matters: TFDS `lvis` stores a PNG mask per object
  (`objects/segmentation`), which `tfds.decode.SkipDecoding` cannot skip inside a Sequence
  in the numpy backend and which would otherwise be decoded for every object.
  """

  def __init__(self, path: str, split: str, fields: Sequence[str] = _TOP_FIELDS):
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    builder = _builder(path)
    features = builder.info.features
    names = set(features.keys())
    kept = {k: features[k] for k in fields if k in names and k != "objects"}
    if "objects" in fields and "objects" in names:
      obj = features["objects"].feature
      kept["objects"] = tfds.features.Sequence(
        {k: obj[k] for k in _OBJECT_FIELDS if k in set(obj.keys())}
      )
    self._features = tfds.features.FeaturesDict(kept)
    self._decoders = {"image": tfds.decode.SkipDecoding()}
    self._raw = builder.as_data_source(
      split=split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES
    )

  def __len__(self) -> int:
    return len(self._raw)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return self._features.deserialize_example_np(self._raw[index], decoders=self._decoders)


class TfdsImageReader:
  """`CocoSource` image hook: decodes image `info['tfds_record']` of a TFDS split with PIL.

  Picklable (grain workers): the ArrayRecord reader is opened lazily in each process.

  Args:
    path: the prepared dataset folder (`tfds_dataset_dir`). split: TFDS split name.

  Returns (call): uint8 [H, W, 3] RGB (grayscale / palette / alpha images converted by PIL,
    as `CocoSource` does for files).
  """

  def __init__(self, path: str, split: str):
    self.path = path
    self.split = split
    self._source = None

  def __getstate__(self):
    return {"path": self.path, "split": self.split, "_source": None}

  def _open(self):
    if self._source is None:
      self._source = _Records(self.path, self.split, ("image",))
    return self._source

  def __call__(self, info: dict) -> np.ndarray:
    data = self._open()[int(info["tfds_record"])]["image"]
    with Image.open(io.BytesIO(data)) as im:
      return np.asarray(im.convert("RGB"))

  def __repr__(self) -> str:
    return f"TfdsImageReader({self.path!r}, {self.split!r})"


def _ids(values: Any) -> list[int]:
  return [int(v) for v in np.asarray(values).reshape(-1)]


def _merge_categories(categories: list[dict], path: str, where: str) -> list[dict]:
  """Categories with the fields of `path`'s `categories` (matched by id; names must agree)."""
  try:
    with open(path) as f:
      extra = json.load(f)["categories"]
    by_id = {int(c["id"]): c for c in extra}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise DataError(f"{where}: categories_file {path} has no readable 'categories' ({e!r})") from e
  out = []
  for c in categories:
    more = by_id.get(c["id"])
    if more is None:
      raise DataError(f"{where}: categories_file {path} has no category id {c['id']}")
    if str(more.get("name", c["name"])) != c["name"]:
      raise DataError(
        f"{where}: categories_file {path} category id {c['id']} has name {more.get('name')!r}, "
        f"the TFDS label has {c['name']!r}"
      )
    out.append(dict(more, **c))
  return out


def _convert_record(ex, r, keys, names, category_ids, where, next_ann_id):
  """One TFDS record -> (its COCO image entry, its COCO annotations, the next free annotation
  id). Boxes: TFDS's normalised (ymin, xmin, ymax, xmax) -> xywh float pixels of the image
  size read from the encoded image's header (no pixel decoding).

  Raises:
    DataError: an undecodable image header, or a label outside the class list (naming the
      record, image id and field).
  """
  annotations = []
  image_id = int(ex["image/id"]) if "image/id" in keys else r
  try:
    with Image.open(io.BytesIO(ex["image"])) as im:
      width, height = im.size  # header only: no pixel decoding
  except OSError as e:
    raise DataError(f"{where}: record {r} (image id {image_id}) field 'image': {e}") from e
  entry: dict[str, Any] = dict(id=image_id, height=height, width=width, tfds_record=r)
  if "image/filename" in keys:
    fn = ex["image/filename"]
    entry["file_name"] = fn.decode() if isinstance(fn, bytes) else str(fn)
  for field in _LVIS_FIELDS:
    if field in keys:
      bad = [k for k in _ids(ex[field]) if not 0 <= k < len(names)]
      if bad:
        raise DataError(
          f"{where}: record {r} (image id {image_id}) field {field!r} has values {bad} "
          f"outside the {len(names)} classes"
        )
      entry[field] = [category_ids[k] for k in _ids(ex[field])]
  objects = ex["objects"]
  bbox = np.asarray(objects["bbox"], np.float64).reshape(-1, 4)
  labels = _ids(objects["label"])
  crowd = _ids(objects["is_crowd"]) if "objects/is_crowd" in keys else [0] * len(labels)
  ann_ids = _ids(objects["id"]) if "objects/id" in keys else None
  areas = np.asarray(objects["area"], np.float64) if "objects/area" in keys else None
  for j, ((ymin, xmin, ymax, xmax), k) in enumerate(zip(bbox, labels)):
    if not 0 <= k < len(names):
      raise DataError(
        f"{where}: record {r} (image id {image_id}) field 'objects/label' has value {k}, "
        f"outside the {len(names)} classes"
      )
    x, y = xmin * width, ymin * height
    w, h = (xmax - xmin) * width, (ymax - ymin) * height
    if ann_ids is None:
      aid = next_ann_id
      next_ann_id += 1
    else:
      aid = ann_ids[j]
    annotations.append(
      dict(
        id=aid,
        image_id=image_id,
        category_id=category_ids[k],
        bbox=[float(x), float(y), float(w), float(h)],
        area=float(areas[j]) if areas is not None else float(w * h),
        iscrowd=int(crowd[j]),
      )
    )
  return entry, annotations, next_ann_id


def tfds_source(
  ref: str,
  data_dir: str | None,
  split: str,
  *,
  name: str | None = None,
  category_ids: Sequence[int] | None = None,
  where: str | None = None,
  categories_file: str | None = None,
  **coco_options,
) -> CocoSource:
  """Split `split` of TFDS dataset `ref` as a `CocoSource` (conversion: module docstring).

  Args:
    ref: 'tfds:<name>[:<version>]', e.g. 'tfds:coco/2017', 'tfds:lvis:1.4.0'.
    data_dir: the TFDS data folder (None: `default_data_dir()`).
    split: TFDS split name ('train', 'validation', 'test', 'minival', slices not supported).
    name: display name (default '<name>/<split>').
    category_ids: the dataset's category id of each 0-based label (length C, distinct);
      default: see the module docstring.
    categories_file: optional json with a `categories` list (e.g. lvis_v1_val.json) whose
      entries' fields (LVIS `frequency`, `synonyms`, ...) are merged into the categories by id.
    where: prefix of error messages (default `ref`), e.g. "dataset 'x' field 'train'".
    **coco_options: passed to `CocoSource` (on_invalid, box_tolerance, exclude_category_ids,
      image_ids, cache_images).

  Returns:
    CocoSource whose `coco.dataset` is the equivalent COCO json: images {id, file_name,
    height, width (pixels), tfds_record (record index), LVIS fields}, annotations {id,
    image_id, category_id, bbox xywh float pixels, area, iscrowd}, categories {id, name};
    images decoded by `TfdsImageReader`.

  Raises:
    DataError: any problem of `tfds_problems` (all listed in one error); category_ids of the
      wrong length or with duplicates; a label outside the class list; an undecodable image
      header (names the dataset, split, record and field).
  """
  problems = tfds_problems(ref, data_dir, split, where or ref, category_ids)
  if problems:
    raise DataError("\n".join(problems))
  path = tfds_dataset_dir(ref, data_dir)
  builder = _builder(path)
  features = builder.info.features
  keys = _feature_keys(features)
  names = [str(n) for n in _sub(features, "objects/label").names]
  tname, _ = parse_tfds_name(ref)
  if category_ids is None:
    if tname.split("/")[0] == "coco" and len(names) == len(COCO_2017_CATEGORY_IDS):
      category_ids = COCO_2017_CATEGORY_IDS
    else:
      category_ids = range(1, len(names) + 1)
  category_ids = [int(c) for c in category_ids]
  if len(category_ids) != len(names) or len(set(category_ids)) != len(category_ids):
    raise DataError(
      f"{ref}: category_ids {category_ids} must give {len(names)} distinct ids, one per "
      f"objects/label class {names}"
    )
  source = _Records(path, split, (*_TOP_FIELDS, "objects"))
  images, annotations = [], []
  next_ann_id = 1
  where = f"{where + ': ' if where else ''}{ref} ({path}) split {split!r}"
  for r in range(len(source)):
    entry, anns, next_ann_id = _convert_record(
      source[r], r, keys, names, category_ids, where, next_ann_id
    )
    images.append(entry)
    annotations.extend(anns)
  categories = [dict(id=c, name=n) for c, n in zip(category_ids, names)]
  if categories_file:
    categories = _merge_categories(categories, categories_file, where)
  dataset = dict(images=images, annotations=annotations, categories=categories)
  return CocoSource(
    f"{ref}:{split} ({path})",
    path,
    name or f"{tname}/{split}",
    dataset=dataset,
    image_reader=TfdsImageReader(path, split),
    **coco_options,
  )

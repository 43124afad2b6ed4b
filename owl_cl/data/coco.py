"""COCO-format detection datasets as grain random-access sources.

`CocoSource` reads a COCO json (real data such as ODinW / Objects365 exports, or the built-in
benchmark of `owl_cl.data.builtin`) with pycocotools, validates it eagerly and serves decoded
examples by integer index, so it can be handed to `grain.MapDataset.source`.

Conventions (docs/CONVENTIONS.md, "Data"): class indices are contiguous 0..C-1 in ascending COCO
category id order; boxes are float32 xyxy in pixels of the original image; images uint8 RGB.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
import contextlib
import io
import json
import numbers
import os
from typing import Any

import numpy as np
from PIL import Image
from PIL import ImageOps
from pycocotools.coco import COCO

__all__ = ["DataError", "CocoSource"]


# The most bytes of derived arrays (`CocoSource.derived`) one source keeps in memory.
DERIVED_BUDGET_BYTES = 1 << 30


class DataError(ValueError):
  """A dataset file is missing or malformed; the message names the file, field and value."""


_REQUIRED_TOP = ("images", "annotations", "categories")
_REQUIRED_IMAGE = ("id", "file_name", "height", "width")
_REQUIRED_ANN = ("image_id", "category_id", "bbox")
_REQUIRED_CAT = ("id", "name")

# What `decode_image` does with an image whose EXIF orientation tag (0x0112) is not 1
# (docs/reference.md §5, "EXIF orientation"): 'ignore' decodes the stored pixels (the frame
# COCO boxes, PIL, torchvision's CocoDetection and pycocotools users assume), 'apply' rotates /
# flips them as the tag says (PIL.ImageOps.exif_transpose: the frame a photo viewer shows),
# 'refuse' raises DataError naming the file and the tag.
EXIF_ORIENTATIONS = ("ignore", "apply", "refuse")
_EXIF_ORIENTATION_TAG = 0x0112
# Orientations 5-8 turn the image by 90 degrees (width and height swap).
_EXIF_TRANSPOSING = (5, 6, 7, 8)
# PIL modes of 16-bit greyscale (a 16-bit PNG opens as 'I;16'; older Pillow gave 'I').
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def _require(entry: Any, fields: Sequence[str], where: str, path: str, index: int) -> None:
  if not isinstance(entry, dict):
    raise DataError(f"{path}: {where}[{index}] must be an object, got {type(entry).__name__}")
  for f in fields:
    if f not in entry:
      raise DataError(
        f"{path}: {where}[{index}] is missing required field '{f}' (entry: {_short(entry)})"
      )


def _require_int_id(entry: dict, where: str, path: str, index: int) -> None:
  """Raises DataError unless `entry['id']` is an integer (a NumPy one too): the COCO format's
  ids are ints (cocodataset.org/#format-data), and the ids are sorted (a str among ints cannot
  be: the TypeError it gave)."""
  value = entry["id"]
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    raise DataError(
      f"{path}: {where}[{index}] field 'id' has value {value!r} ({type(value).__name__}): "
      "COCO ids are integers"
    )


# Problems listed in one error; the rest are counted (a broken export can have millions).
MAX_LISTED_PROBLEMS = 50


def problem_list(problems: Sequence[str], limit: int = MAX_LISTED_PROBLEMS) -> str:
  """`problems` one per line (the first `limit`, then '... and N more'); one problem as is."""
  lines = list(problems[:limit])
  if len(problems) > limit:
    lines.append(f"... and {len(problems) - limit} more")
  return "\n".join(lines)


def _short(obj: Any, limit: int = 160) -> str:
  s = json.dumps(obj, default=str)
  return s if len(s) <= limit else s[:limit] + "..."


class CocoSource:
  """A COCO detection dataset served as a grain `RandomAccessDataSource`.

  Args:
    annotation_file: path of the COCO json (`images`, `annotations`, `categories` required;
      per image `id, file_name, height, width`; per annotation `image_id, category_id, bbox`
      [x, y, w, h] in pixels; per category `id, name`).
    image_dir: folder that `file_name` is relative to.
    name: display name (default: the json file's stem).
    check_files: stat every image file at construction (cheap; a missing image then fails
      before training starts). When False, a missing file raises at `load`.
    box_tolerance: pixels a box may extend beyond the image before it is an error; boxes within
      the tolerance are clipped to the image.
    cache_images: keep decoded images in memory after their first load (for small datasets
      such as the built-in benchmark: ~40 KB per 128 px image; each grain worker process
      holds its own cache).
    on_invalid: 'raise' (default) raises `DataError` for a degenerate / out-of-image box;
      'skip' drops such annotations (counted in `num_skipped`). Unknown category ids, unknown
      image ids, missing fields and missing files always raise.
    dataset: the already-parsed json object (e.g. a Visual Genome export converted in memory);
      `annotation_file` then only names its origin in messages and need not exist.
    exclude_category_ids: COCO category ids removed from the dataset together with all their
      annotations (e.g. the forbidden Objects365 categories, or ChessPieces' empty category);
      they are neither classes nor negatives. Ids not in 'categories' raise `DataError`.
      Removed annotations are counted in `num_excluded`.
    image_ids: keep only these images (and their annotations), e.g. a balanced subset; ids not
      in 'images' raise `DataError`. Default: all images.
    file_name_fn: maps an image's json entry to its path relative to `image_dir` (LVIS images
      have no 'file_name', only 'coco_url'); when given, 'file_name' is not required.
    image_reader: maps an image's json entry to its decoded pixels (uint8 [H, W, 3] RGB) when
      the images are not files (e.g. a TFDS ArrayRecord dataset,
      `owl_cl.data.tfds_source.TfdsImageReader`); 'file_name' is then not required, no file is
      checked and `image_dir` only names the origin. It must pickle (grain worker processes).
    exif_orientation: an image file with an EXIF orientation tag other than 1: 'ignore' (the
      stored pixels), 'apply' (rotated as the tag says) or 'refuse' (`EXIF_ORIENTATIONS`;
      `config.data.exif_orientation`). Files only: a reader's pixels are its own.

  Per-image federated fields (LVIS): when an image entry has `neg_category_ids` /
  `not_exhaustive_category_ids` (lists of category ids), `federated` is True and `load()` adds
  `negative_labels` / `not_exhaustive_labels` (int32 [K], contiguous indices; ids of excluded
  categories are dropped). Unknown ids in these fields raise `DataError`.

  Attributes:
    class_names: list[str], contiguous index -> category name.
    category_entries: list[dict], contiguous index -> the category's json entry (LVIS:
      `frequency`, `synonyms`, `image_count`, ...).
    category_ids: list[int], contiguous index -> COCO category id (ascending).
    image_ids: list[int], source index -> COCO image id (ascending).
    coco: the pycocotools `COCO` object (all annotations, crowd ones included; for evaluation).
    num_skipped: annotations dropped by `on_invalid='skip'`.
    num_excluded: annotations dropped by `exclude_category_ids`.
    federated: whether the json has per-image `neg_category_ids` / `not_exhaustive_category_ids`.

  `iscrowd=1` annotations are kept in `coco` but excluded from `load()`'s training targets.

  Raises:
    DataError: missing annotation file; unreadable json; missing required field (names the
      entry); an image or category id that is not an int; duplicate image id (names both
      positions) or category id. Then, all listed in
      one error (up to `MAX_LISTED_PROBLEMS`): a category with an empty name; annotation
      with unknown `category_id` or `image_id`; box not finite, with w <= 0 or h <= 0 or
      outside the image by more than `box_tolerance`; duplicate annotation id (names both
      positions); missing image file (names the path and image id).

  Source: docs/CONVENTIONS.md "Data"; docs/reference.md §4 (contiguous index <-> category id mapped
  explicitly, never assumed).
  """

  def __init__(
    self,
    annotation_file: str,
    image_dir: str,
    name: str | None = None,
    *,
    check_files: bool = True,
    box_tolerance: float = 2.0,
    on_invalid: str = "raise",
    cache_images: bool = False,
    dataset: dict | None = None,
    exclude_category_ids: Sequence[int] = (),
    image_ids: Sequence[int] | None = None,
    file_name_fn: Callable[[dict], str] | None = None,
    image_reader: Callable[[dict], np.ndarray] | None = None,
    exif_orientation: str = "ignore",
  ):
    if on_invalid not in ("raise", "skip"):
      raise ValueError(f"on_invalid must be 'raise' or 'skip', got {on_invalid!r}")
    if exif_orientation not in EXIF_ORIENTATIONS:
      raise ValueError(
        f"exif_orientation must be one of {list(EXIF_ORIENTATIONS)}, got {exif_orientation!r}"
      )
    self.exif_orientation = exif_orientation
    self.annotation_file = os.fspath(annotation_file)
    self._cache: dict[int, np.ndarray] | None = {} if cache_images else None
    # (index, key) -> what `derived` computed from the image's pixels (`cache_images` only).
    self._derived: dict[tuple[int, Hashable], np.ndarray] | None = {} if cache_images else None
    self._derived_bytes = 0  # of the arrays in `_derived` (at most DERIVED_BUDGET_BYTES)
    self.image_dir = os.fspath(image_dir)
    self.name = name or os.path.splitext(os.path.basename(self.annotation_file))[0]
    self._options = dict(
      check_files=check_files,
      box_tolerance=box_tolerance,
      on_invalid=on_invalid,
      cache_images=cache_images,
      file_name_fn=file_name_fn,
      image_reader=image_reader,
      exif_orientation=exif_orientation,
    )
    self._image_reader = image_reader
    if image_reader is not None:
      check_files = False  # no files: the reader serves the pixels
    path = self.annotation_file
    data = _read_json(path, self.image_dir, dataset)
    # Every problem of the file below (empty names, missing images, bad boxes) is collected
    # and raised together: one run shows all of them, not the first. Structural errors
    # (missing fields, duplicate image / category ids) raise at once.
    problems: list[str] = []
    cat_by_id, excluded = _check_categories(data["categories"], exclude_category_ids, path)
    self.category_ids: list[int] = sorted(c for c in cat_by_id if c not in excluded)
    self.category_entries: list[dict] = [cat_by_id[c] for c in self.category_ids]
    self.class_names: list[str] = [str(cat_by_id[c]["name"]) for c in self.category_ids]
    for c, n in zip(self.category_ids, self.class_names):
      if not n.strip():
        # A class name is the text query of the class (prompts): an empty one is no query.
        problems.append(f"{path}: category id {c!r} has an empty name {n!r}")
    self._cat_to_index = {c: i for i, c in enumerate(self.category_ids)}

    named = file_name_fn is not None or image_reader is not None
    images, selection = _check_images(
      data["images"], ("id", "height", "width") if named else _REQUIRED_IMAGE, image_ids, path
    )
    self.image_ids: list[int] = sorted(images)
    self._images = [images[i] for i in self.image_ids]
    names = _file_names(self._images, file_name_fn, image_reader, path)
    self._paths = [os.path.join(self.image_dir, n) for n in names]
    self._parse_federated(path, excluded)
    if check_files:
      problems += _missing_files(self._images, self._paths, self.image_dir, path)

    index = _index_annotations(
      data["annotations"],
      images,
      self._cat_to_index,
      excluded,
      selection,
      box_tolerance,
      on_invalid,
      path,
    )
    self.num_skipped, self.num_excluded = index.num_skipped, index.num_excluded
    problems += index.problems
    if problems:
      raise DataError(problem_list(problems))
    self._boxes, self._labels = _target_arrays(index.per_image, self.image_ids)

    if self.num_skipped or self.num_excluded or selection is not None:
      data = dict(
        data, annotations=index.kept, images=self._images, categories=self.category_entries
      )
    # pycocotools index, built from the already-parsed json (it prints; keep quiet).
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
      coco.createIndex()
    self.coco = coco

  _FEDERATED_FIELDS = (
    ("neg_category_ids", "negative_labels"),
    ("not_exhaustive_category_ids", "not_exhaustive_labels"),
  )

  def _parse_federated(self, path: str, excluded: set) -> None:
    """Per-image LVIS federated fields -> contiguous int32 arrays (see the class docstring)."""
    self.federated = any(f in im for im in self._images for f, _ in self._FEDERATED_FIELDS)
    self._federated: dict[str, list[np.ndarray]] = {}
    if not self.federated:
      return
    for field, key in self._FEDERATED_FIELDS:
      rows = []
      for im in self._images:
        ids = im.get(field, [])
        if not isinstance(ids, list):
          raise DataError(
            f"{path}: image id {im['id']} field '{field}' must be a list of "
            f"category ids, got {_short(ids)}"
          )
        out = []
        for cid in ids:
          if cid in excluded:
            continue
          if cid not in self._cat_to_index:
            raise DataError(
              f"{path}: image id {im['id']} field '{field}' has value {cid!r}, "
              f"which is not in 'categories'"
            )
          out.append(self._cat_to_index[cid])
        rows.append(np.asarray(sorted(set(out)), np.int32))
      self._federated[key] = rows

  def federated_labels(self, index: int) -> dict[str, np.ndarray]:
    """LVIS federated labels of image `index`: dict(negative_labels int32 [K1],
    not_exhaustive_labels int32 [K2]) of contiguous class indices (sorted, unique); an empty
    dict when the json has no federated fields. Source: LVIS v1 format; docs/reference.md §3-§4."""
    return {k: v[index].copy() for k, v in self._federated.items()}

  def subset(self, image_ids: Sequence[int], name: str | None = None) -> CocoSource:
    """A new source with only `image_ids` (and their annotations), same options and classes.

    Raises:
      DataError: an id not in this source.
    """
    return CocoSource(
      self.annotation_file,
      self.image_dir,
      name or self.name,
      dataset=self.coco.dataset,
      image_ids=image_ids,
      **self._options,
    )

  # --- grain RandomAccessDataSource protocol -------------------------------------------------
  def __len__(self) -> int:
    return len(self.image_ids)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return self.load(index)

  def __repr__(self) -> str:
    return (
      f"CocoSource(name={self.name!r}, images={len(self)}, classes={len(self.class_names)}, "
      f"file={self.annotation_file!r})"
    )

  @property
  def num_boxes(self) -> int:
    """The training boxes of all images (crowd and excluded-category annotations not counted)."""
    return sum(len(labels) for labels in self._labels)

  @property
  def num_classes(self) -> int:
    """C, the number of categories."""
    return len(self.class_names)

  def image_info(self, index: int) -> dict[str, Any]:
    """The json entry of image `index` (id, file_name, height, width, ...)."""
    return self._images[index]

  def targets(self, index: int) -> dict[str, np.ndarray]:
    """Training targets of image `index` without decoding it.

    Returns dict(boxes float32 [M, 4] xyxy pixels (clipped to the image), labels int32 [M]
    contiguous class indices); crowd annotations excluded. Arrays are copies.
    """
    return dict(boxes=self._boxes[index].copy(), labels=self._labels[index].copy())

  @property
  def reads_files(self) -> bool:
    """True when the pixels come from image files (False: from an `image_reader`, e.g. TFDS)."""
    return self._image_reader is None

  def image_path(self, index: int) -> str:
    """The file image `index` is read from (for a reader source: `image_dir` + its name)."""
    return self._paths[index]

  def decode_image(self, index: int) -> np.ndarray:
    """Decodes the pixels of image `index` as `load` does, without its in-memory cache.

    16-bit greyscale (PIL mode 'I;16', e.g. a 16-bit PNG) is scaled to 8 bits, round(v * 255 /
    65535), not clipped (PIL's `convert('RGB')` clips it to white). A PNG must end with its
    IEND chunk (PIL decodes one cut after its last pixel data without a word). An EXIF
    orientation tag other than 1 is handled per `exif_orientation` (class docstring).

    Returns:
      uint8 [H, W, 3] RGB (every pixel decoded, so a truncated file fails here).

    Raises:
      DataError: the image file is missing, undecodable, a PNG cut before IEND, of a mode
        with no 8-bit meaning (32-bit integer or float pixels), tagged with an EXIF
        orientation under 'refuse', or its decoded size differs from the json's height /
        width (names the json, the path, the image id and the value).
    """
    info = self._images[index]
    p = self._paths[index]
    where = f"{self.annotation_file}: image {p} (image id {info['id']})"
    orientation = 1
    try:
      if self._image_reader is not None:
        image = np.asarray(self._image_reader(info), np.uint8)
      else:
        with open(p, "rb") as f:
          data = f.read()
        with Image.open(io.BytesIO(data)) as im:
          if im.format == "PNG":
            # verify() walks the chunks to IEND with their CRCs; it consumes its image.
            with Image.open(io.BytesIO(data)) as check:
              check.verify()
          orientation = int(im.getexif().get(_EXIF_ORIENTATION_TAG, 1) or 1)
          image = self._pixels(im, orientation, where)
    except DataError:
      raise
    except FileNotFoundError as e:
      raise DataError(
        f"{self.annotation_file}: image file not found: {p} (image id {info['id']})"
      ) from e
    except (OSError, SyntaxError, ValueError) as e:
      # PIL: OSError (truncated / unidentified files), SyntaxError (some broken headers,
      # a PNG cut inside its IEND chunk), ValueError (impossible modes or sizes).
      raise DataError(
        f"{self.annotation_file}: cannot decode image {p} (image id {info['id']}): {e}"
      ) from e
    if image.shape[0] != int(info["height"]) or image.shape[1] != int(info["width"]):
      hint = ""
      if (
        orientation in _EXIF_TRANSPOSING
        and self.exif_orientation == "ignore"
        and (image.shape[1], image.shape[0]) == (int(info["height"]), int(info["width"]))
      ):
        hint = (
          f"; its EXIF orientation {orientation} turns it by 90 degrees, to the json's size: "
          "if the boxes were drawn on the turned image, set config.data.exif_orientation='apply'"
        )
      raise DataError(
        f"{where} decodes to {image.shape[1]}x{image.shape[0]} (WxH) but the json says "
        f"width={info['width']} height={info['height']}{hint}"
      )
    return image

  def _pixels(self, im: Image.Image, orientation: int, where: str) -> np.ndarray:
    """uint8 [H, W, 3] RGB of the open PIL image `im` (`decode_image`'s conversions)."""
    if orientation != 1:
      if self.exif_orientation == "refuse":
        raise DataError(
          f"{where} has EXIF orientation {orientation} and "
          "config.data.exif_orientation='refuse' (use 'ignore' for the stored pixels, "
          "'apply' for the turned ones)"
        )
      if self.exif_orientation == "apply":
        im = ImageOps.exif_transpose(im)
    if im.mode in _SIXTEEN_BIT_MODES:
      grey = np.asarray(im).astype(np.float64)
      grey = np.rint(grey * (255.0 / 65535.0)).astype(np.uint8)
      return np.repeat(grey[..., None], 3, axis=-1)
    if im.mode in ("I", "F"):
      # 32-bit integer or float pixels (TIFF, PFM): no bit depth says what white is.
      raise DataError(
        f"{where} has PIL mode {im.mode!r} (32-bit {'float' if im.mode == 'F' else 'integer'} "
        "pixels), which has no 8-bit scale; convert it to 8-bit RGB or 16-bit greyscale"
      )
    return np.asarray(im.convert("RGB"))

  def _checked_index(self, index: int) -> int:
    """`index` in [0, len) (a negative one counts from the end); IndexError naming the source
    when out of range."""
    if not -len(self) <= index < len(self):
      raise IndexError(f"{self.name}: index {index} out of range for {len(self)} images")
    return int(index) % len(self)

  def derived(self, index: int, key: Hashable, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """`compute()`: an array computed from the pixels of image `index` alone, `key` naming how
    (e.g. its network input at one size and padding: `input_pipeline`).

    Kept in memory, read-only, beside the decoded image when the source keeps those
    (`cache_images`), so a later epoch or evaluation reuses it, while the kept arrays total at
    most `DERIVED_BUDGET_BYTES` (the built-in benchmark's 64-pixel network inputs: about
    200 MB; at 768 pixels one image's is 7 MB, so only the first ones are kept); computed on
    every call otherwise. Each process (grain worker) holds its own. Two threads asking at
    once may both compute it: `compute` is deterministic, so either result is the same array
    (and both may count it, so the budget can be passed by one entry per racing thread: no
    lock, which a source pickled into grain's workers could not carry).

    Raises:
      IndexError: index out of range. Whatever `compute` raises.
    """
    index = self._checked_index(index)
    if self._derived is None:
      return compute()
    entry = (index, key)
    value = self._derived.get(entry)
    if value is None:
      value = np.asarray(compute())
      if self._derived_bytes + value.nbytes <= DERIVED_BUDGET_BYTES:
        value.setflags(write=False)
        self._derived[entry] = value
        self._derived_bytes += value.nbytes
    return value

  def load(self, index: int) -> dict[str, Any]:
    """Decode example `index` (0 <= index < len).

    Returns dict(image uint8 [H, W, 3] RGB, boxes float32 [M, 4] xyxy pixels, labels int32 [M]
    contiguous class indices, image_id int), plus `negative_labels` / `not_exhaustive_labels`
    int32 [K] for federated (LVIS) sources. Non-crowd annotations only.

    Raises:
      IndexError: index out of range.
      DataError: the image file is missing or unreadable (names path and image id), or its
        decoded size differs from the json's height/width.
    """
    index = self._checked_index(index)
    info = self._images[index]
    if self._cache is not None and index in self._cache:
      return dict(
        image=self._cache[index],
        boxes=self._boxes[index].copy(),
        labels=self._labels[index].copy(),
        image_id=int(info["id"]),
        **self.federated_labels(index),
      )
    image = self.decode_image(index)
    if self._cache is not None:
      image.setflags(write=False)
      self._cache[index] = image
    return dict(
      image=image,
      boxes=self._boxes[index].copy(),
      labels=self._labels[index].copy(),
      image_id=int(info["id"]),
      **self.federated_labels(index),
    )


# ------------------------------------------------------------------------------------------
# CocoSource's construction: read the json, check categories / images / annotations, index
# the training targets. Each raises DataError naming the file, the entry and the value.
# ------------------------------------------------------------------------------------------
def _read_json(path: str, image_dir: str, dataset: dict | None) -> dict:
  """The json object of `path` (or `dataset`, already parsed) with its top-level lists."""
  if dataset is None and not os.path.isfile(path):
    raise DataError(f"annotation file not found: {path}")
  if not os.path.isdir(image_dir):
    raise DataError(f"{path}: image_dir does not exist: {image_dir}")
  if dataset is not None:
    data = dataset
  else:
    try:
      with open(path) as f:
        data = json.load(f)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}: not valid json ({e})") from e
  if not isinstance(data, dict):
    raise DataError(f"{path}: top level must be an object, got {type(data).__name__}")
  for field in _REQUIRED_TOP:
    if field not in data:
      raise DataError(f"{path}: missing required top-level field '{field}'")
    if not isinstance(data[field], list):
      raise DataError(f"{path}: field '{field}' must be a list, got {type(data[field]).__name__}")
  return data


def _check_categories(
  cats: list, exclude_category_ids: Sequence[int], path: str
) -> tuple[dict[Any, dict], set]:
  """(category id -> entry, the excluded ids); duplicate ids and unknown excluded ids raise."""
  cat_by_id: dict[Any, dict] = {}
  for i, c in enumerate(cats):
    _require(c, _REQUIRED_CAT, "categories", path, i)
    _require_int_id(c, "categories", path, i)
    if c["id"] in cat_by_id:
      raise DataError(f"{path}: categories[{i}] duplicate id {c['id']!r}")
    cat_by_id[c["id"]] = c
  excluded = set()
  for cid in exclude_category_ids:
    if cid not in cat_by_id:
      raise DataError(
        f"{path}: exclude_category_ids value {cid!r} is not a category id in "
        f"'categories' (known ids: {_short(sorted(cat_by_id), 80)})"
      )
    excluded.add(cid)
  return cat_by_id, excluded


class _Selection:
  """The kept image ids of `image_ids=` and every id of 'images' (to tell a dropped image's
  annotation from one of an unknown image)."""

  def __init__(self, keep: set, known: set):
    self.keep, self.known = keep, known


def _check_images(
  entries: list, required: Sequence[str], image_ids: Sequence[int] | None, path: str
) -> tuple[dict[Any, dict], _Selection | None]:
  """(image id -> entry of the kept images, the selection or None for all images).

  Missing fields, duplicate ids, non-positive sizes and `image_ids` not in 'images' raise.
  """
  selection = None
  if image_ids is not None:
    selection = _Selection(set(image_ids), {im.get("id") for im in entries if isinstance(im, dict)})
    unknown = sorted(selection.keep - selection.known, key=str)
    if unknown:
      raise DataError(f"{path}: image_ids value(s) {_short(unknown, 80)} not in 'images'")
  images: dict[Any, dict] = {}
  image_index: dict[Any, int] = {}  # image id -> its position in 'images'
  for i, im in enumerate(entries):
    _require(im, required, "images", path, i)
    _require_int_id(im, "images", path, i)
    if selection is not None and im["id"] not in selection.keep:
      continue
    if im["id"] in images:
      raise DataError(
        f"{path}: images[{i}] field 'id' has value {im['id']!r}, which images"
        f"[{image_index[im['id']]}] also has (image ids must be unique)"
      )
    h, w = im["height"], im["width"]
    if not (isinstance(h, (int, float)) and isinstance(w, (int, float)) and h > 0 and w > 0):
      raise DataError(
        f"{path}: images[{i}] (id {im['id']}) has invalid size height={h!r} width={w!r}"
      )
    images[im["id"]] = im
    image_index[im["id"]] = i
  return images, selection


def _file_names(
  images: list[dict],
  file_name_fn: Callable[[dict], str] | None,
  image_reader: Callable[[dict], np.ndarray] | None,
  path: str,
) -> list[str]:
  """Each image's path relative to image_dir (a reader's images: a name for messages)."""
  if image_reader is not None:
    return [str(im.get("file_name", im["id"])) for im in images]
  if file_name_fn is None:
    return [im["file_name"] for im in images]
  names = []
  for im in images:
    try:
      names.append(file_name_fn(im))
    except (KeyError, ValueError, TypeError) as e:
      raise DataError(
        f"{path}: image id {im['id']}: cannot derive the file name from the "
        f"entry {_short(im)} ({e!r})"
      ) from e
  return names


def _missing_files(images: list[dict], paths: list[str], image_dir: str, path: str) -> list[str]:
  """One problem per image whose file does not exist."""
  return [
    f"{path}: image file not found: {p} (image id {im['id']}, "
    f"file_name {im.get('file_name', os.path.relpath(p, image_dir))!r})"
    for im, p in zip(images, paths)
    if not os.path.isfile(p)
  ]


def _four_numbers(bbox: Any) -> bool:
  """Whether a COCO `bbox` is a list / tuple of 4 ints or floats."""
  return (
    isinstance(bbox, (list, tuple))
    and len(bbox) == 4
    and all(isinstance(v, (int, float)) for v in bbox)
  )


def _box_problem(
  bbox: Sequence[float], width: float, height: float, box_tolerance: float
) -> tuple[str | None, tuple[float, float, float, float] | None]:
  """(what is wrong with the COCO `bbox` [x, y, w, h] (4 numbers) of a W x H image or None,
  the box xyxy clipped to the image when it is fine)."""
  x, y, w, h = (float(v) for v in bbox)
  W, H = float(width), float(height)
  if not (np.isfinite([x, y, w, h]).all()):
    return "is not finite", None
  if w <= 0 or h <= 0:
    return "is degenerate (w <= 0 or h <= 0)", None
  if (
    x < -box_tolerance
    or y < -box_tolerance
    or x + w > W + box_tolerance
    or y + h > H + box_tolerance
  ):
    return f"lies outside the {int(W)}x{int(H)} (WxH) image by more than {box_tolerance} px", None
  x0, y0 = max(x, 0.0), max(y, 0.0)
  x1, y1 = min(x + w, W), min(y + h, H)
  if x1 <= x0 or y1 <= y0:
    return "is empty after clipping to the image", None
  return None, (x0, y0, x1, y1)


class _AnnotationIndex:
  """The annotations' pass: per kept image its (x0, y0, x1, y1, class) rows (crowd excluded),
  the kept annotation entries, the counts of skipped / excluded ones and the problems."""

  def __init__(self, image_ids):
    self.per_image: dict[Any, list[tuple]] = {i: [] for i in image_ids}
    self.kept: list[dict] = []
    self.num_skipped = 0
    self.num_excluded = 0
    self.problems: list[str] = []


def _index_annotations(
  annotations: list,
  images: dict[Any, dict],
  cat_to_index: dict[Any, int],
  excluded: set,
  selection: _Selection | None,
  box_tolerance: float,
  on_invalid: str,
  path: str,
) -> _AnnotationIndex:
  """Check every annotation and index the valid ones by image (see `_AnnotationIndex`).

  Missing fields and an unknown image id under `image_ids=` raise at once; the rest (duplicate
  ids, unknown category / image ids, bad boxes unless on_invalid='skip') are problems.
  """
  index = _AnnotationIndex(sorted(images))
  # pycocotools indexes annotations by id (`COCO.anns[id]`): of two with one id the later
  # silently replaces the earlier, and evaluation then scores against another image's box.
  ann_index: dict[Any, int] = {}
  for i, a in enumerate(annotations):
    _require(a, _REQUIRED_ANN, "annotations", path, i)
    aid = a.get("id", i)
    where = f"{path}: annotations[{i}] (id {aid})"
    if "id" in a:
      if a["id"] in ann_index:
        index.problems.append(
          f"{path}: annotations[{i}] field 'id' has value {a['id']!r}, which annotations"
          f"[{ann_index[a['id']]}] also has (annotation ids must be unique)"
        )
        continue
      ann_index[a["id"]] = i
    if a["category_id"] in excluded:
      index.num_excluded += 1
      continue
    if selection is not None and a["image_id"] not in selection.keep:
      if a["image_id"] not in selection.known:
        raise DataError(
          f"{where} field 'image_id' has value {a['image_id']!r}, which is not in 'images'"
        )
      continue
    if a["category_id"] not in cat_to_index:
      index.problems.append(
        f"{where} field 'category_id' has value {a['category_id']!r}, which is not in "
        f"'categories' (known ids: {_short(sorted(cat_to_index), 80)})"
      )
      continue
    im = images.get(a["image_id"])
    if im is None:
      index.problems.append(
        f"{where} field 'image_id' has value {a['image_id']!r}, which is not in 'images'"
      )
      continue
    if not _four_numbers(a["bbox"]):
      index.problems.append(
        f"{where} field 'bbox' must be 4 numbers [x, y, w, h], got {a['bbox']!r}"
      )
      continue
    problem, xyxy = _box_problem(a["bbox"], im["width"], im["height"], box_tolerance)
    if problem is not None:
      if on_invalid == "raise":
        index.problems.append(
          f"{path}: annotations[{i}] (id {aid}, image_id {a['image_id']}) "
          f"field 'bbox' value {list(a['bbox'])!r} {problem}"
        )
      index.num_skipped += 1
      continue
    index.kept.append(a)
    if not a.get("iscrowd", 0):
      index.per_image[a["image_id"]].append((*xyxy, cat_to_index[a["category_id"]]))
  return index


def _target_arrays(
  per_image: dict[Any, list[tuple]], image_ids: list
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Per image (in `image_ids` order): boxes float32 [M, 4] xyxy pixels, labels int32 [M]."""
  boxes, labels = [], []
  for iid in image_ids:
    rows = per_image[iid]
    if rows:
      arr = np.asarray(rows, dtype=np.float64)
      boxes.append(arr[:, :4].astype(np.float32))
      labels.append(arr[:, 4].astype(np.int32))
    else:
      boxes.append(np.zeros((0, 4), np.float32))
      labels.append(np.zeros((0,), np.int32))
  return boxes, labels

"""COCO-format detection datasets as grain random-access sources.

`CocoSource` reads a COCO json (real data such as ODinW / Objects365 exports, or the built-in
benchmark of `owl_cl.data.builtin`) with pycocotools, validates it eagerly and serves decoded
examples by integer index, so it can be handed to `grain.MapDataset.source`.

Conventions (docs/CONVENTIONS.md, "Data"): class indices are contiguous 0..C-1 in ascending COCO
category id order; boxes are float32 xyxy in pixels of the original image; images uint8 RGB.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
import io
import json
import os
from typing import Any

import numpy as np
from PIL import Image
from PIL import ImageOps
from pycocotools.coco import COCO

__all__ = ["DataError", "CocoSource"]


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
      entry); duplicate image id (names both positions) or category id. Then, all listed in
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
    if dataset is None and not os.path.isfile(path):
      raise DataError(f"annotation file not found: {path}")
    if not os.path.isdir(self.image_dir):
      raise DataError(f"{path}: image_dir does not exist: {self.image_dir}")
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

    # Categories.
    cats = data["categories"]
    cat_by_id: dict[int, dict] = {}
    for i, c in enumerate(cats):
      _require(c, _REQUIRED_CAT, "categories", path, i)
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
    self.category_ids: list[int] = sorted(c for c in cat_by_id if c not in excluded)
    self.category_entries: list[dict] = [cat_by_id[c] for c in self.category_ids]
    self.class_names: list[str] = [str(cat_by_id[c]["name"]) for c in self.category_ids]
    # Every problem of the file below (empty names, missing images, bad boxes) is collected
    # and raised together: one run shows all of them, not the first.
    problems: list[str] = []
    for c, n in zip(self.category_ids, self.class_names):
      if not n.strip():
        # A class name is the text query of the class (prompts): an empty one is no query.
        problems.append(f"{path}: category id {c!r} has an empty name {n!r}")
    self._cat_to_index = {c: i for i, c in enumerate(self.category_ids)}
    self.num_excluded = 0

    # Images.
    required_image = (
      _REQUIRED_IMAGE
      if file_name_fn is None and image_reader is None
      else ("id", "height", "width")
    )
    keep_ids = None
    if image_ids is not None:
      keep_ids = set(image_ids)
      known = {im.get("id") for im in data["images"] if isinstance(im, dict)}
      unknown = sorted(keep_ids - known, key=str)
      if unknown:
        raise DataError(f"{path}: image_ids value(s) {_short(unknown, 80)} not in 'images'")
    images: dict[int, dict] = {}
    image_index: dict[Any, int] = {}  # image id -> its position in 'images'
    for i, im in enumerate(data["images"]):
      _require(im, required_image, "images", path, i)
      if keep_ids is not None and im["id"] not in keep_ids:
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
    self.image_ids: list[int] = sorted(images)
    self._images = [images[i] for i in self.image_ids]
    if image_reader is not None:
      names = [str(im.get("file_name", im["id"])) for im in self._images]
    elif file_name_fn is None:
      names = [im["file_name"] for im in self._images]
    else:
      names = []
      for im in self._images:
        try:
          names.append(file_name_fn(im))
        except (KeyError, ValueError, TypeError) as e:
          raise DataError(
            f"{path}: image id {im['id']}: cannot derive the file name from the "
            f"entry {_short(im)} ({e!r})"
          ) from e
    self._paths = [os.path.join(self.image_dir, n) for n in names]
    self._parse_federated(path, excluded)
    if check_files:
      for im, p in zip(self._images, self._paths):
        if not os.path.isfile(p):
          problems.append(
            f"{path}: image file not found: {p} (image id {im['id']}, "
            f"file_name {im.get('file_name', os.path.relpath(p, self.image_dir))!r})"
          )

    # Annotations -> per-image training targets (crowd excluded).
    self.num_skipped = 0
    per_image: dict[int, list[tuple]] = {i: [] for i in self.image_ids}
    kept_anns = []
    # pycocotools indexes annotations by id (`COCO.anns[id]`): of two with one id the later
    # silently replaces the earlier, and evaluation then scores against another image's box.
    ann_index: dict[Any, int] = {}
    for i, a in enumerate(data["annotations"]):
      _require(a, _REQUIRED_ANN, "annotations", path, i)
      aid = a.get("id", i)
      if "id" in a:
        if a["id"] in ann_index:
          problems.append(
            f"{path}: annotations[{i}] field 'id' has value {a['id']!r}, which annotations"
            f"[{ann_index[a['id']]}] also has (annotation ids must be unique)"
          )
          continue
        ann_index[a["id"]] = i
      if a["category_id"] in excluded:
        self.num_excluded += 1
        continue
      if keep_ids is not None and a["image_id"] not in keep_ids:
        if a["image_id"] not in known:
          raise DataError(
            f"{path}: annotations[{i}] (id {aid}) field 'image_id' has value "
            f"{a['image_id']!r}, which is not in 'images'"
          )
        continue
      if a["category_id"] not in self._cat_to_index:
        problems.append(
          f"{path}: annotations[{i}] (id {aid}) field 'category_id' has value "
          f"{a['category_id']!r}, which is not in 'categories' "
          f"(known ids: {_short(self.category_ids, 80)})"
        )
        continue
      im = images.get(a["image_id"])
      if im is None:
        problems.append(
          f"{path}: annotations[{i}] (id {aid}) field 'image_id' has value "
          f"{a['image_id']!r}, which is not in 'images'"
        )
        continue
      bbox = a["bbox"]
      if (
        not isinstance(bbox, (list, tuple))
        or len(bbox) != 4
        or not all(isinstance(v, (int, float)) for v in bbox)
      ):
        problems.append(
          f"{path}: annotations[{i}] (id {aid}) field 'bbox' must be 4 numbers "
          f"[x, y, w, h], got {bbox!r}"
        )
        continue
      x, y, w, h = (float(v) for v in bbox)
      W, H = float(im["width"]), float(im["height"])
      problem = None
      if not (np.isfinite([x, y, w, h]).all()):
        problem = "is not finite"
      elif w <= 0 or h <= 0:
        problem = "is degenerate (w <= 0 or h <= 0)"
      elif (
        x < -box_tolerance
        or y < -box_tolerance
        or x + w > W + box_tolerance
        or y + h > H + box_tolerance
      ):
        problem = f"lies outside the {int(W)}x{int(H)} (WxH) image by more than {box_tolerance} px"
      if problem is None:
        x0, y0 = max(x, 0.0), max(y, 0.0)
        x1, y1 = min(x + w, W), min(y + h, H)
        if x1 <= x0 or y1 <= y0:
          problem = "is empty after clipping to the image"
      if problem is not None:
        if on_invalid == "raise":
          problems.append(
            f"{path}: annotations[{i}] (id {aid}, image_id {a['image_id']}) "
            f"field 'bbox' value {list(bbox)!r} {problem}"
          )
        self.num_skipped += 1
        continue
      kept_anns.append(a)
      if not a.get("iscrowd", 0):
        per_image[a["image_id"]].append((x0, y0, x1, y1, self._cat_to_index[a["category_id"]]))

    if problems:
      raise DataError(problem_list(problems))

    self._boxes = []
    self._labels = []
    for iid in self.image_ids:
      rows = per_image[iid]
      if rows:
        arr = np.asarray(rows, dtype=np.float64)
        self._boxes.append(arr[:, :4].astype(np.float32))
        self._labels.append(arr[:, 4].astype(np.int32))
      else:
        self._boxes.append(np.zeros((0, 4), np.float32))
        self._labels.append(np.zeros((0,), np.int32))

    if self.num_skipped or self.num_excluded or keep_ids is not None:
      data = dict(
        data, annotations=kept_anns, images=self._images, categories=self.category_entries
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
    if not -len(self) <= index < len(self):
      raise IndexError(f"{self.name}: index {index} out of range for {len(self)} images")
    index = int(index) % len(self)
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

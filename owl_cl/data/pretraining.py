"""Pre-training / evaluation datasets at real scale: Objects365, LVIS v1, Visual Genome.

Every loader returns an `owl_cl.data.coco.CocoSource` (the same interface as ODinW and the
built-in benchmark). Paths are relative to one data root (the `data.root` of the config):

```
<root>/objects365/annotations/zhiyuan_objv2_train.json   Objects365 v2 (official release)
<root>/objects365/annotations/zhiyuan_objv2_val.json
<root>/objects365/train/patch0/objects365_v1_00000000.jpg ...  (json file_name
<root>/objects365/val/patch16/objects365_v2_00908726.jpg ...    'images/v1/patch0/<file>')
<root>/lvis/lvis_v1_train.json, <root>/lvis/lvis_v1_val.json   LVIS v1
<root>/coco/train2017/000000391895.jpg, <root>/coco/val2017/...  COCO 2017 images (LVIS's)
<root>/visual_genome/objects.json, image_data.json               Visual Genome v1.4
<root>/visual_genome/VG_100K/<image_id>.jpg, VG_100K_2/<image_id>.jpg
```

* **Objects365**: Objects365 v2's json names images `images/v{1,2}/patchN/<file>.jpg` while
  the download unpacks them to `{train,val}/patchN/<file>.jpg`; the last two path components
  are used (`objects365_relative_path`, as mmdetection's Objects365V2Dataset does).
* **Forbidden categories.** OWL-ViT must never see boxes of LVIS-rare classes so that LVIS APr
  stays zero-shot. scenic (`owl_vit/preprocessing/label_ops.py`, `RemoveForbiddenLabels` in
  the training preprocessing of `configs/clip_*.py`) removes every O365 / VG label that,
  after canonicalisation (lower case, characters outside `[a-z0-9- ]` -> space, whitespace and
  dash runs collapsed, then dashes removed), equals an LVIS-rare class name or one of its
  `O365_AND_VG_FORBIDDEN` list (hand-curated near matches such as 'apple sauce', 'wind
  chimes'). The released code does the same (`data/o365_forbid_cat_ids.py`,
  `data/vg_forbid_cat_ids.py`) and skips those annotations (`data/o365_ds_info.py`). Here
  "forbidden" means exactly that: the category (O365) or name (VG) is removed together with all
  its boxes (`CocoSource(exclude_category_ids=...)`), so it is neither a positive nor a random
  negative; the image itself is kept. Both lists are stored verbatim in
  `forbidden_labels.json` (337 LVIS-rare names, 275 near matches). `objects365_source`
  removes them for the `train` split by default and keeps all 365 categories for `val`
  (evaluation on the full label space, as the paper's O365 mAP).
* **LVIS v1**: images have no `file_name`; the file is derived from `coco_url`
  (`http://images.cocodataset.org/train2017/000000391895.jpg` -> `train2017/000000391895.jpg`
  under `<root>/coco/`; LVIS val uses images of both COCO folders). Per image
  `neg_category_ids` / `not_exhaustive_category_ids` are exposed by `CocoSource.load` as
  `negative_labels` / `not_exhaustive_labels` (contiguous indices; the training pipeline uses
  `negative_labels` as the first negatives, docs/reference.md §3); categories keep `frequency` ('r',
  'c',
  'f'), see `lvis_frequency_groups`. For LVIS evaluation use the `lvis` package on
  `source.annotation_file`.
* **Visual Genome** (replay-buffer candidate, paper §5): the original v1.4 files
  (`objects.json`: per image `{image_id, objects: [{object_id, x, y, w, h, names, synsets}]}`,
  `image_data.json`: `{image_id, width, height, url, ...}`), which is what researchers download
  and what the released code reads (`data/vg_ds_info.py`). `visual_genome_to_coco` converts
  them in memory: each distinct name (stripped, lower-cased) is a category (ids 1.. in sorted
  name order), each (object, name) pair an annotation with the object's box (an object with
  two names gives two identical boxes, merged into one multi-label instance by the pipeline's
  IoU >= 0.9 merge, as the released code's multi-label VG targets); as in the released code an
  object is dropped when any of its names is forbidden. The image file is the last two
  components of `url` (`VG_100K_2/1.jpg`).

Source: docs/reference.md §3, §4, §6; scenic owl_vit `preprocessing/label_ops.py`; released code
`data/o365_*.py`, `data/vg_*.py`, `data/lvis_*.py`; LVIS v1 and Objects365 v2 formats.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import functools
import json
import os
import re
from typing import Any

import numpy as np

from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError
from owl_cl.model.text import canonicalize_label

__all__ = [
  "forbidden_label_names",
  "forbidden_key",
  "is_forbidden",
  "forbidden_category_ids",
  "objects365_paths",
  "objects365_relative_path",
  "objects365_source",
  "lvis_paths",
  "coco_paths",
  "coco_url_relative_path",
  "lvis_source",
  "lvis_frequency_groups",
  "visual_genome_paths",
  "visual_genome_to_coco",
  "visual_genome_source",
  "pretraining_expected_files",
]

_FORBIDDEN_FILE = os.path.join(os.path.dirname(__file__), "forbidden_labels.json")


# ------------------------------------------------------------------------------------------
# Forbidden labels (scenic).
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def forbidden_label_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(LVIS-rare class names [337], O365/VG near matches [275]) as stored by scenic."""
  with open(_FORBIDDEN_FILE) as f:
    data = json.load(f)
  return tuple(data["lvis_rare"]), tuple(data["o365_and_vg_forbidden"])


def forbidden_key(name: str) -> str:
  """scenic's comparison form of a label: canonicalised (docs/reference.md §2), dash runs
  collapsed, the not-promptable marker '#' and then all dashes removed.

  'Hot-air balloon' -> 'hotair balloon'.
  """
  text = re.sub(r"-+", "-", canonicalize_label(name)).replace("#", "")
  return text.replace("-", "")


@functools.lru_cache(maxsize=1)
def _forbidden_keys() -> frozenset[str]:
  rare, near = forbidden_label_names()
  return frozenset(forbidden_key(n) for n in rare + near)


def is_forbidden(name: str, forbidden: Iterable[str] | None = None) -> bool:
  """Whether label `name` matches a forbidden label (default: scenic's two lists).

  Source: scenic owl_vit `label_ops._is_forbidden_label`.
  """
  keys = _forbidden_keys() if forbidden is None else {forbidden_key(n) for n in forbidden}
  return forbidden_key(name) in keys


def forbidden_category_ids(
  categories: Sequence[dict[str, Any]], forbidden: Iterable[str] | None = None
) -> list[int]:
  """Ids of the COCO `categories` entries whose `name` is forbidden (input order)."""
  keys = _forbidden_keys() if forbidden is None else {forbidden_key(n) for n in forbidden}
  return [c["id"] for c in categories if forbidden_key(str(c["name"])) in keys]


def _read_json(path: str, what: str) -> Any:
  if not os.path.isfile(path):
    raise DataError(f"{what}: file not found: {path}")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: not valid json ({e})") from e


def _last_components(path: str, n: int = 2) -> str:
  parts = [p for p in str(path).replace("\\", "/").split("/") if p]
  if len(parts) < n:
    raise ValueError(f"expected at least {n} path components in {path!r}")
  return "/".join(parts[-n:])


# ------------------------------------------------------------------------------------------
# Objects365.
# ------------------------------------------------------------------------------------------
def objects365_paths(root: str, split: str) -> tuple[str, str]:
  """(annotation json, image folder) of Objects365 v2 `split` ('train' | 'val') under `root`."""
  if split not in ("train", "val"):
    raise ValueError(f"Objects365 split must be 'train' or 'val', got {split!r}")
  return (
    os.path.join(root, "objects365", "annotations", f"zhiyuan_objv2_{split}.json"),
    os.path.join(root, "objects365", split),
  )


def objects365_relative_path(image: dict[str, Any]) -> str:
  """Image path relative to the split folder: the last two components of `file_name`
  ('images/v1/patch8/objects365_v1_00420917.jpg' -> 'patch8/objects365_v1_00420917.jpg').

  Raises:
    KeyError: no 'file_name'. ValueError: fewer than two path components.
  """
  return _last_components(image["file_name"])


def objects365_source(
  root: str | None = None,
  split: str = "train",
  *,
  remove_forbidden: bool | None = None,
  forbidden: Iterable[str] | None = None,
  annotation_file: str | None = None,
  image_dir: str | None = None,
  **coco_options,
) -> CocoSource:
  """Objects365 v2 `split` as a `CocoSource`.

  Args:
    root: data root (layout in the module docstring); or give both `annotation_file` and
      `image_dir`.
    split: 'train' or 'val'.
    remove_forbidden: remove forbidden categories and their boxes (default: True for 'train',
      False for 'val').
    forbidden: label names that are forbidden (default: scenic's lists).
    **coco_options: passed to `CocoSource` (check_files, on_invalid, cache_images, ...).

  Returns:
    CocoSource named 'objects365/<split>'.

  Raises:
    DataError: missing/malformed json (names file, field and value), missing image.
  """
  if annotation_file is None or image_dir is None:
    if root is None:
      raise ValueError("give root, or both annotation_file and image_dir")
    ann, img = objects365_paths(root, split)
    annotation_file, image_dir = annotation_file or ann, image_dir or img
  if remove_forbidden is None:
    remove_forbidden = split == "train"
  data = _read_json(annotation_file, f"Objects365 {split}")
  if not isinstance(data, dict) or not isinstance(data.get("categories"), list):
    raise DataError(f"{annotation_file}: missing or invalid top-level field 'categories'")
  exclude = []
  if remove_forbidden:
    for i, c in enumerate(data["categories"]):
      if not isinstance(c, dict) or "name" not in c or "id" not in c:
        raise DataError(
          f"{annotation_file}: categories[{i}] is missing required field "
          f"'id' or 'name' (entry: {c!r})"
        )
    exclude = forbidden_category_ids(data["categories"], forbidden)
  return CocoSource(
    annotation_file,
    image_dir,
    f"objects365/{split}",
    dataset=data,
    exclude_category_ids=exclude,
    file_name_fn=objects365_relative_path,
    **coco_options,
  )


# ------------------------------------------------------------------------------------------
# LVIS.
# ------------------------------------------------------------------------------------------
def lvis_paths(root: str, split: str) -> tuple[str, str]:
  """(annotation json, COCO image root) of LVIS v1 `split` ('train' | 'val') under `root`."""
  if split not in ("train", "val"):
    raise ValueError(f"LVIS split must be 'train' or 'val', got {split!r}")
  return os.path.join(root, "lvis", f"lvis_v1_{split}.json"), os.path.join(root, "coco")


def coco_paths(root: str, split: str) -> tuple[str, str]:
  """(annotation json, image folder) of COCO 2017 `split` ('train' | 'val') under `root`:
  `<root>/coco/annotations/instances_<split>2017.json` and `<root>/coco/<split>2017` (the
  layout of cocodataset.org's zips unpacked into `<root>/coco/`, whose images LVIS shares).

  Raises:
    ValueError: another split.
  """
  if split not in ("train", "val"):
    raise ValueError(f"COCO 2017 split must be 'train' or 'val', got {split!r}")
  coco = os.path.join(root, "coco")
  return os.path.join(coco, "annotations", f"instances_{split}2017.json"), os.path.join(
    coco, f"{split}2017"
  )


def coco_url_relative_path(image: dict[str, Any]) -> str:
  """'http://images.cocodataset.org/val2017/000000397133.jpg' -> 'val2017/000000397133.jpg'.

  Raises:
    KeyError: no 'coco_url'. ValueError: fewer than two path components.
  """
  return _last_components(image["coco_url"])


_FREQUENCIES = ("r", "c", "f")


def lvis_source(
  root: str | None = None,
  split: str = "val",
  *,
  annotation_file: str | None = None,
  image_dir: str | None = None,
  **coco_options,
) -> CocoSource:
  """LVIS v1 `split` as a federated `CocoSource` (see the module docstring).

  Raises:
    DataError: missing/malformed json, an image without `coco_url`, a category without a valid
      `frequency` (names file, field and value), unknown ids in `neg_category_ids` /
      `not_exhaustive_category_ids`, a missing image file.
  """
  if annotation_file is None or image_dir is None:
    if root is None:
      raise ValueError("give root, or both annotation_file and image_dir")
    ann, img = lvis_paths(root, split)
    annotation_file, image_dir = annotation_file or ann, image_dir or img
  data = _read_json(annotation_file, f"LVIS {split}")
  for i, im in enumerate(data.get("images", []) if isinstance(data, dict) else []):
    if isinstance(im, dict) and "coco_url" not in im and "file_name" not in im:
      raise DataError(
        f"{annotation_file}: images[{i}] (id {im.get('id')}) has neither 'coco_url' nor 'file_name'"
      )
  source = CocoSource(
    annotation_file,
    image_dir,
    f"lvis/{split}",
    dataset=data,
    file_name_fn=_lvis_file_name,
    **coco_options,
  )
  lvis_frequency_groups(source)  # validates 'frequency'
  return source


def _lvis_file_name(image: dict[str, Any]) -> str:
  if "coco_url" in image:
    return coco_url_relative_path(image)
  return image["file_name"]


def lvis_frequency_groups(source: CocoSource) -> dict[str, np.ndarray]:
  """Contiguous class indices of each LVIS frequency group.

  Returns:
    dict 'r' | 'c' | 'f' -> int32 [C_group] ascending (rare: < 10 training images, common:
    10-100, frequent: > 100; LVIS v1's `frequency` field).

  Raises:
    DataError: a category without `frequency` or with a value outside ('r', 'c', 'f').
  """
  groups: dict[str, list[int]] = {f: [] for f in _FREQUENCIES}
  for i, c in enumerate(source.category_entries):
    f = c.get("frequency")
    if f not in groups:
      raise DataError(
        f"{source.annotation_file}: category id {c.get('id')} ({c.get('name')!r})"
        f" field 'frequency' has value {f!r}, expected one of 'r', 'c', 'f'"
      )
    groups[f].append(i)
  return {f: np.asarray(v, np.int32) for f, v in groups.items()}


# ------------------------------------------------------------------------------------------
# Visual Genome.
# ------------------------------------------------------------------------------------------
def visual_genome_paths(root: str) -> dict[str, str]:
  """dict(objects_file, image_data_file, image_dir) of Visual Genome v1.4 under `root`."""
  base = os.path.join(root, "visual_genome")
  return dict(
    objects_file=os.path.join(base, "objects.json"),
    image_data_file=os.path.join(base, "image_data.json"),
    image_dir=base,
  )


def _vg_name(name: Any) -> str:
  return " ".join(str(name).split()).lower()


def visual_genome_to_coco(
  objects: Sequence[dict[str, Any]],
  image_data: Sequence[dict[str, Any]],
  *,
  remove_forbidden: bool = True,
  forbidden: Iterable[str] | None = None,
  image_ids: Iterable[int] | None = None,
  objects_file: str = "objects.json",
  image_data_file: str = "image_data.json",
) -> dict[str, Any]:
  """Visual Genome v1.4 `objects.json` + `image_data.json` -> a COCO dict (module docstring).

  Args:
    objects: parsed objects.json (list of per-image dicts with 'image_id' (or 'id') and
      'objects': [{x, y, w, h, names, ...}]).
    image_data: parsed image_data.json (list of {image_id (or id), width, height, url}).
    remove_forbidden: drop objects any of whose names is forbidden (released code).
    forbidden: forbidden names (default: scenic's lists).
    image_ids: keep only these images (e.g. a de-duplicated training list); default all.
    objects_file: the objects file's name, used in error messages.
    image_data_file: the image-data file's name, used in error messages.

  Returns:
    dict(images [{id, file_name, height, width}], annotations [{id, image_id, category_id,
    bbox, area, iscrowd=0}], categories [{id, name}]).

  Raises:
    DataError: missing fields, an object on an image absent from image_data (names file,
      entry and value).
  """
  keys = None
  if remove_forbidden:
    keys = _forbidden_keys() if forbidden is None else {forbidden_key(n) for n in forbidden}
  keep = None if image_ids is None else set(int(i) for i in image_ids)
  images: dict[int, dict[str, Any]] = {}
  for i, im in enumerate(image_data):
    iid = im.get("image_id", im.get("id")) if isinstance(im, dict) else None
    if iid is None or "width" not in im or "height" not in im or "url" not in im:
      raise DataError(
        f"{image_data_file}: entry [{i}] needs 'image_id', 'width', 'height' and "
        f"'url' (entry: {json.dumps(im, default=str)[:160]})"
      )
    if keep is not None and iid not in keep:
      continue
    try:
      file_name = _last_components(im["url"])
    except ValueError as e:
      raise DataError(
        f"{image_data_file}: entry [{i}] (image_id {iid}) field 'url' has value {im['url']!r}: {e}"
      ) from e
    images[iid] = dict(id=iid, file_name=file_name, height=im["height"], width=im["width"])
  pairs: list[tuple[int, list[float], str]] = []
  names = set()
  for i, entry in enumerate(objects):
    iid = entry.get("image_id", entry.get("id")) if isinstance(entry, dict) else None
    if iid is None or not isinstance(entry.get("objects"), list):
      raise DataError(f"{objects_file}: entry [{i}] needs 'image_id' and a list 'objects'")
    if keep is not None and iid not in keep:
      continue
    if iid not in images:
      raise DataError(
        f"{objects_file}: entry [{i}] field 'image_id' has value {iid!r}, which "
        f"is not in {image_data_file}"
      )
    for j, o in enumerate(entry["objects"]):
      if not all(k in o for k in ("x", "y", "w", "h", "names")):
        raise DataError(
          f"{objects_file}: entry [{i}] (image_id {iid}) objects[{j}] needs "
          f"'x', 'y', 'w', 'h', 'names' (object: {json.dumps(o)[:160]})"
        )
      obj_names = [_vg_name(n) for n in o["names"]]
      obj_names = [n for n in dict.fromkeys(obj_names) if n]
      if keys is not None and any(forbidden_key(n) in keys for n in obj_names):
        continue
      box = [float(o["x"]), float(o["y"]), float(o["w"]), float(o["h"])]
      for n in obj_names:
        pairs.append((iid, box, n))
        names.add(n)
  cat_ids = {n: k for k, n in enumerate(sorted(names), start=1)}
  annotations = [
    dict(id=k, image_id=iid, category_id=cat_ids[n], bbox=box, area=box[2] * box[3], iscrowd=0)
    for k, (iid, box, n) in enumerate(pairs, start=1)
  ]
  return dict(
    images=[images[i] for i in sorted(images)],
    annotations=annotations,
    categories=[dict(id=k, name=n) for n, k in cat_ids.items()],
  )


def visual_genome_source(
  root: str | None = None,
  *,
  objects_file: str | None = None,
  image_data_file: str | None = None,
  image_dir: str | None = None,
  remove_forbidden: bool = True,
  forbidden: Iterable[str] | None = None,
  image_ids: Iterable[int] | None = None,
  **coco_options,
) -> CocoSource:
  """Visual Genome as a `CocoSource` (replay-buffer candidate; conversion in
  `visual_genome_to_coco`). Boxes outside the image by more than `box_tolerance` raise unless
  `on_invalid='skip'` (VG has a few such boxes: pass on_invalid='skip' for the real data).

  Raises:
    DataError: missing/malformed files (names file, field and value), missing images.
  """
  paths = visual_genome_paths(root) if root is not None else {}
  objects_file = objects_file or paths.get("objects_file")
  image_data_file = image_data_file or paths.get("image_data_file")
  image_dir = image_dir or paths.get("image_dir")
  if not (objects_file and image_data_file and image_dir):
    raise ValueError("give root, or objects_file, image_data_file and image_dir")
  data = visual_genome_to_coco(
    _read_json(objects_file, "Visual Genome objects"),
    _read_json(image_data_file, "Visual Genome image data"),
    remove_forbidden=remove_forbidden,
    forbidden=forbidden,
    image_ids=image_ids,
    objects_file=objects_file,
    image_data_file=image_data_file,
  )
  return CocoSource(objects_file, image_dir, "visual_genome", dataset=data, **coco_options)


def pretraining_expected_files(root: str) -> dict[str, list[str]]:
  """The json files and image folders of each dataset: dict name -> list of paths."""
  o365 = [p for s in ("train", "val") for p in objects365_paths(root, s)]
  lvis = [lvis_paths(root, s)[0] for s in ("train", "val")]
  lvis += [os.path.join(root, "coco", f) for f in ("train2017", "val2017")]
  vg = visual_genome_paths(root)
  return dict(
    objects365=sorted(set(o365)),
    lvis=lvis,
    visual_genome=[vg["objects_file"], vg["image_data_file"], vg["image_dir"]],
  )

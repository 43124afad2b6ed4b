"""A stage's detections of one evaluation set, per image, on disk (`eval.save_detections`).

`<workdir>/detections/<stage name>/<eval set>.json.gz`: a gzip-compressed JSON list of COCO
result dicts {'image_id': int, 'category_id': int (the set's own category id), 'bbox': [x, y,
w, h] in the image's pixels, 'score': float in [0, 1]}, as `detection.to_coco_detections`
makes them and the scoring (pycocotools / lvis) reads them: every detection kept per image
(eval.top_k, or lvis_top_k for an LVIS set). Written atomically (`utils.atomic_write`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import gzip
import json
import os
from typing import Any

from owl_cl.utils import atomic_write

__all__ = ["DETECTIONS_DIR", "detections_path", "write_detections", "read_detections"]

DETECTIONS_DIR = "detections"


def detections_path(workdir: str, stage: str, eval_set: str) -> str:
  """`<workdir>/detections/<stage>/<eval set>.json.gz`."""
  return os.path.join(workdir, DETECTIONS_DIR, stage, f"{eval_set}.json.gz")


def write_detections(path: str, detections: Sequence[Mapping[str, Any]]) -> None:
  """Writes `detections` (COCO result dicts) to `path` (gzip JSON), atomically (the folder is
  created when missing).

  Raises:
    OSError: the file could not be written (a previous file is left as it was).
  """
  rows = [
    {
      "image_id": int(d["image_id"]),
      "category_id": int(d["category_id"]),
      "bbox": [float(v) for v in d["bbox"]],
      "score": float(d["score"]),
    }
    for d in detections
  ]

  def write(tmp: str) -> None:
    # No name and mtime 0 in the gzip header: the same detections give the same bytes.
    with open(tmp, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:
      f.write(json.dumps(rows, separators=(",", ":")).encode())

  atomic_write(path, write)


def read_detections(path: str) -> list[dict[str, Any]]:
  """The detections written by `write_detections`.

  Raises:
    FileNotFoundError; ValueError: not a gzip JSON list of detections (names the file).
  """
  try:
    with gzip.open(path, "rb") as f:
      rows = json.loads(f.read())
  except (OSError, ValueError) as e:
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(f"{path}: not a detections file ({e})") from e
  if not isinstance(rows, list) or any(not isinstance(r, dict) for r in rows):
    raise ValueError(f"{path}: not a list of detections")
  return rows

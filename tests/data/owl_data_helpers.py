"""Helpers for tests/data: tiny COCO datasets written to a folder."""

import json
import os

import numpy as np
from PIL import Image


def write_coco(
  root, images, annotations, categories, *, write_images=True, json_name="ann.json", colors=None
):
  """Write a COCO json and (optionally) solid-colour PNGs; returns (json path, image dir)."""
  img_dir = os.path.join(root, "images")
  os.makedirs(img_dir, exist_ok=True)
  if write_images:
    for k, im in enumerate(images):
      c = (colors or {}).get(im["id"], (10 * k % 255, 100, 200))
      arr = np.zeros((im["height"], im["width"], 3), np.uint8) + np.uint8(c)
      Image.fromarray(arr).save(os.path.join(img_dir, im["file_name"]))
  path = os.path.join(root, json_name)
  with open(path, "w") as f:
    json.dump(dict(images=images, annotations=annotations, categories=categories), f)
  return path, img_dir


def basic_dataset():
  """3 images, categories with unsorted non-contiguous ids (7 'dog', 3 'cat', 12 'bird')."""
  images = [
    dict(id=5, file_name="a.png", height=40, width=60),
    dict(id=2, file_name="b.png", height=30, width=20),
    dict(id=9, file_name="c.png", height=16, width=16),
  ]
  categories = [dict(id=7, name="dog"), dict(id=3, name="cat"), dict(id=12, name="bird")]
  annotations = [
    dict(id=1, image_id=5, category_id=7, bbox=[10, 5, 20, 10], iscrowd=0),
    dict(id=2, image_id=5, category_id=3, bbox=[0, 0, 60, 40], iscrowd=0),
    dict(id=3, image_id=5, category_id=12, bbox=[1, 1, 5, 5], iscrowd=1),  # crowd: skipped
    dict(id=4, image_id=2, category_id=12, bbox=[2.5, 3, 10, 20.5], iscrowd=0),
  ]
  return images, annotations, categories

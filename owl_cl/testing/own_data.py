"""Own-data fixtures: COCO folders and a TFDS ArrayRecord dataset made from built-in images.

`write_own_data(out_dir, benchmark)` writes the data of the worked example of docs/data.md
("Your own data", `configs/examples/own_data.py`) from a generated built-in benchmark: two
COCO-format folders and one TFDS dataset prepared as ArrayRecord. Writing the TFDS dataset
needs `tensorflow_datasets` (a test-time dependency); reading it does not
(`owl_cl.data.tfds_source`).

Layout under `out_dir`:
  kitchen/{train,test}.json + kitchen/images/     COCO folder (a copy of one built-in dataset)
  warehouse/{train,test}.json + warehouse/images/ COCO folder (another one)
  tfds/own_data_shelf/1.0.0/                      TFDS 'tfds:own_data_shelf', ArrayRecord,
                                                  splits train / test
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from typing import Any

import numpy as np

from owl_cl.data import builtin
from owl_cl.testing.configs import TINY_BUILTIN

# The built-in downstream dataset each example dataset copies (tiny configs generate these).
SOURCES = {"kitchen": "thermal", "warehouse": "digits", "shelf": "digits"}
TFDS_NAME = "own_data_shelf"


def write_coco_copy(out_dir: str, benchmark: Any, dataset: str) -> None:
  """Copies built-in `dataset`'s train / test (jsons + images) as a COCO folder `out_dir`."""
  image_dir = os.path.join(out_dir, "images")
  os.makedirs(image_dir, exist_ok=True)
  for split in ("train", "test"):
    files = benchmark.split(dataset, split)
    with open(files.annotation_file) as f:
      data = json.load(f)
    for im in data["images"]:
      # Both splits share one image folder, as many exports do: prefix the file names.
      new = f"{split}_{os.path.basename(im['file_name'])}"
      shutil.copyfile(os.path.join(files.image_dir, im["file_name"]), os.path.join(image_dir, new))
      im["file_name"] = new
    with open(os.path.join(out_dir, f"{split}.json"), "w") as f:
      json.dump(data, f)


@functools.cache
def _builder_class():
  """The TFDS builder class of 'own_data_shelf' (defined once: TFDS registers it by name)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class OwnDataShelf(tfds.core.GeneratorBasedBuilder):
    """A built-in dataset as a TFDS detection dataset (features of `coco/2017`)."""

    VERSION = tfds.core.Version("1.0.0")
    # A one-component module: TFDS then looks for no package resources beside the code.
    __module__ = TFDS_NAME

    def __init__(self, *, splits: dict, categories: list, **kwargs):
      self._splits, self._categories = splits, categories
      super().__init__(**kwargs)

    def _info(self):
      label = tfds.features.ClassLabel(names=[c["name"] for c in self._categories])
      objects = {
        "id": np.int64,
        "area": np.int64,
        "bbox": tfds.features.BBoxFeature(),
        "label": label,
        "is_crowd": np.bool_,
      }
      features = {
        "image": tfds.features.Image(encoding_format="png"),
        "image/id": np.int64,
        "image/filename": tfds.features.Text(),
        "objects": tfds.features.Sequence(objects),
      }
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
      return {s: self._generate_examples(*self._splits[s]) for s in self._splits}

    def _generate_examples(self, data, image_dir):
      by_image: dict[int, list] = {}
      for a in data["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
      for im in data["images"]:
        h, w = im["height"], im["width"]
        objects = []
        for a in by_image.get(im["id"], []):
          x, y, bw, bh = a["bbox"]
          box = tfds.features.BBox(
            ymin=y / h, xmin=x / w, ymax=min((y + bh) / h, 1.0), xmax=min((x + bw) / w, 1.0)
          )
          objects.append(
            dict(
              id=a["id"],
              area=int(round(a.get("area", bw * bh))),
              bbox=box,
              label=a["category_id"] - 1,
              is_crowd=bool(a.get("iscrowd", 0)),
            )
          )
        with open(os.path.join(image_dir, im["file_name"]), "rb") as f:
          image = f.read()
        ex = {"image": image, "image/id": im["id"], "image/filename": im["file_name"]}
        yield im["id"], dict(ex, objects=objects)

  return OwnDataShelf


def write_tfds_copy(data_dir: str, benchmark: Any, dataset: str) -> str:
  """Prepares built-in `dataset` as the ArrayRecord TFDS dataset 'own_data_shelf:1.0.0'.

  Features as TFDS `coco/2017`: `image` (the PNG bytes as they are), `image/id`,
  `image/filename`, `objects` {id, area, bbox (normalised [ymin, xmin, ymax, xmax]), label
  (0-based: category id - 1, the built-in ids being 1..K), is_crowd}. Returns its folder.
  """
  splits = {}
  for split in ("train", "test"):
    files = benchmark.split(dataset, split)
    with open(files.annotation_file) as f:
      splits[split] = (json.load(f), files.image_dir)
  categories = sorted(splits["train"][0]["categories"], key=lambda c: c["id"])
  if [c["id"] for c in categories] != list(range(1, len(categories) + 1)):
    raise ValueError(f"{dataset}: category ids must be 1..K for TFDS labels id - 1")

  builder = _builder_class()(
    splits=splits, categories=categories, data_dir=data_dir, file_format="array_record"
  )
  builder.download_and_prepare(file_format="array_record")
  return os.path.join(data_dir, TFDS_NAME, "1.0.0")


def write_own_data(out_dir: str, benchmark: Any) -> dict[str, str]:
  """Writes the worked example's three datasets (module docstring) from `benchmark`.

  Returns:
    {'kitchen': folder, 'warehouse': folder, 'tfds': TFDS data_dir}.
  """
  write_coco_copy(os.path.join(out_dir, "kitchen"), benchmark, SOURCES["kitchen"])
  write_coco_copy(os.path.join(out_dir, "warehouse"), benchmark, SOURCES["warehouse"])
  write_tfds_copy(os.path.join(out_dir, "tfds"), benchmark, SOURCES["shelf"])
  return {
    "kitchen": os.path.join(out_dir, "kitchen"),
    "warehouse": os.path.join(out_dir, "warehouse"),
    "tfds": os.path.join(out_dir, "tfds"),
  }


def main(argv: list[str]) -> None:
  """`python -m owl_cl.testing.own_data OUT_DIR [--quick] [--cache_dir=DIR]`.

  Writes the worked example's data (module docstring) under OUT_DIR from a built-in benchmark
  generated in (or read from) `<cache_dir>/builtin` (default cache ~/.cache/owl_cl): its
  default sizes (200 training / 60 test images per dataset), or with `--quick` the tiny
  benchmark of `owl_cl.testing.configs.TINY_BUILTIN` (16 / 16), the one the quick try
  (`configs/examples/own_data.py:OUT_DIR,quick`) generates, so that run reuses it.
  """
  import argparse  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(
    prog="python -m owl_cl.testing.own_data",
    description="Writes the datasets of docs/data.md's 'Your own data' example (two COCO "
    "folders and a TFDS ArrayRecord dataset) from the built-in benchmark's images.",
  )
  parser.add_argument("out_dir", help="the data folder (the config's argument)")
  parser.add_argument(
    "--quick", action="store_true", help="the tiny benchmark of the quick try (16 images/split)"
  )
  parser.add_argument("--cache_dir", default="~/.cache/owl_cl", help="the run's cache_dir")
  args = parser.parse_args(argv[1:])
  cache = os.path.expanduser(args.cache_dir)
  sizes = dict(TINY_BUILTIN) if args.quick else {}
  # The example's datasets among the benchmark's downstream ones (the tiny one has them all).
  sizes.setdefault("downstream", tuple(sorted(set(SOURCES.values()))))
  bench = builtin.ensure_benchmark(os.path.join(cache, "builtin"), **sizes)
  for name, path in write_own_data(os.path.expanduser(args.out_dir), bench).items():
    print(f"{name}: {path}")


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  main(sys.argv)

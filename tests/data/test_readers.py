"""owl_cl.data.readers: one reader module per entry kind, registered in one place.

A throwaway reader of a format owl_cl does not know (a CSV of boxes, one row per box) is
written as one module in a temporary folder, exactly as docs/extending.md ("A dataset
format") tells a user to, imported, and used: declared, checked, loaded (against the COCO
source of the same data) and run end to end.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import sys
import textwrap

import numpy as np
from PIL import Image
import pytest

from owl_cl import benchmark
from owl_cl import experiment
from owl_cl.data import coco
from owl_cl.data import entries
from owl_cl.data import readers
from owl_cl.testing.configs import tiny_config

KIND = "csv_boxes"

# The whole reader: the file docs/extending.md ("A dataset format") shows (kept equal by
# `test_the_docs_show_this_reader`), formatted as `ruff format` formats the page's code.
READER_MODULE = '''\
"""Kind 'csv_boxes': one CSV row per box, `file_name,width,height,label,x,y,w,h` (pixels)."""

import csv
import os

from owl_cl.data.coco import CocoSource
from owl_cl.data.readers import reader


def _splits(cfg, where, problems):
  # Each split: dict(csv=<file>, images=<folder its file_names are relative to>).
  out = []
  for split in reader.SPLITS:
    if cfg.get(split):
      files = dict(cfg[split])
      out.append((split, reader.SplitSpec(annotation_file=files["csv"], image_dir=files["images"])))
  if not out:
    problems.append(f"{where}: declares none of the splits {reader.SPLITS}")
  return out


def _coco(path):
  """The CSV as a COCO dict: images by file name, categories by label in sorted order."""
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  files = sorted({r["file_name"] for r in rows})
  labels = sorted({r["label"] for r in rows})
  images = {n: i + 1 for i, n in enumerate(files)}
  sizes = {r["file_name"]: (int(r["width"]), int(r["height"])) for r in rows}
  return {
    "images": [
      {"id": images[n], "file_name": n, "width": sizes[n][0], "height": sizes[n][1]} for n in files
    ],
    "categories": [{"id": i + 1, "name": n} for i, n in enumerate(labels)],
    "annotations": [
      {
        "id": k + 1,
        "image_id": images[r["file_name"]],
        "category_id": labels.index(r["label"]) + 1,
        "bbox": [float(r[c]) for c in "xywh"],
        "area": float(r["w"]) * float(r["h"]),
        "iscrowd": 0,
      }
      for k, r in enumerate(rows)
    ],
  }


def _load(entry, split, coco_options):
  spec = entry.split(split)
  name = entry.name if split == "train" else f"{entry.name}/{split}"
  return CocoSource(
    spec.annotation_file, spec.image_dir, name, dataset=_coco(spec.annotation_file), **coco_options
  )


def _check(entry):
  problems = []
  for split, spec in entry.splits:
    if not os.path.isfile(spec.annotation_file):
      problems.append(f"dataset {entry.name!r} field {split!r}: no file {spec.annotation_file}")
    if not os.path.isdir(spec.image_dir):
      problems.append(f"dataset {entry.name!r} field {split!r}: no folder {spec.image_dir}")
  return problems


READER = reader.register(
  reader.Reader(kind="csv_boxes", splits=_splits, load=_load, check=_check, evaluation="coco")
)
'''


@pytest.fixture
def csv_reader(tmp_path, monkeypatch):
  """The throwaway reader module, imported from a temporary folder; unregistered after."""
  folder = tmp_path / "user_code"
  folder.mkdir()
  (folder / "csv_boxes_reader.py").write_text(READER_MODULE)
  monkeypatch.syspath_prepend(str(folder))
  module = importlib.import_module("csv_boxes_reader")
  yield module
  readers.READERS.pop(KIND, None)
  sys.modules.pop("csv_boxes_reader", None)


def _write_csv(annotation_file: str, path: str) -> None:
  """A COCO json's boxes as the reader's CSV rows (one per box)."""
  with open(annotation_file) as f:
    data = json.load(f)
  images = {im["id"]: im for im in data["images"]}
  names = {c["id"]: c["name"] for c in data["categories"]}
  with open(path, "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["file_name", "width", "height", "label", "x", "y", "w", "h"])
    for a in data["annotations"]:
      im = images[a["image_id"]]
      out.writerow(
        [im["file_name"], im["width"], im["height"], names[a["category_id"]], *a["bbox"]]
      )


def _csv_entry(tmp_path, config) -> dict:
  """The entry of a CSV copy of the built-in 'thermal' dataset of `config`."""
  bench = benchmark.load_benchmark(config)
  thermal = next(d for d in bench.sequence if d.name == "thermal")
  entry = {"name": "thermal_csv", "kind": KIND}
  for split, source in (("train", thermal.train), ("test", thermal.test)):
    path = str(tmp_path / f"{split}.csv")
    _write_csv(source.annotation_file, path)
    entry[split] = {"csv": path, "images": source.image_dir}
  return entry


def _png(path, width: int, height: int) -> None:
  Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(path)


def test_a_reader_module_adds_a_kind(csv_reader, tmp_path):
  assert entries.kinds()[-1] == KIND and readers.get(KIND) is csv_reader.READER
  _png(tmp_path / "a.png", 60, 40)
  _png(tmp_path / "b.png", 20, 30)
  rows = "a.png,60,40,dog,10,5,20,10\na.png,60,40,cat,0,0,60,40\nb.png,20,30,bird,2.5,3,10,20.5\n"
  (tmp_path / "train.csv").write_text("file_name,width,height,label,x,y,w,h\n" + rows)
  entry_config = {
    "name": "pets",
    "kind": KIND,
    "train": {"csv": str(tmp_path / "train.csv"), "images": str(tmp_path)},
  }
  entry = entries.entry_from_config(entry_config)
  assert entry.split_names == ("train",) and entries.check_entry(entry) == []
  assert entries.evaluation_protocol(entry, "train") == "coco"
  source = entries.load_split(entry, "train")
  # Hand-worked: classes in label order, images in file-name order, boxes xywh -> xyxy.
  assert source.class_names == ["bird", "cat", "dog"] and len(source) == 2
  a, b = source.load(0), source.load(1)
  np.testing.assert_array_equal(a["boxes"], [[10, 5, 30, 15], [0, 0, 60, 40]])
  np.testing.assert_array_equal(a["labels"], [2, 1])
  np.testing.assert_array_equal(b["boxes"], [[2.5, 3, 12.5, 23.5]])
  np.testing.assert_array_equal(b["labels"], [0])
  # Its problems are its own; a field of another kind is refused for it.
  missing = dict(entry_config, test={"csv": str(tmp_path / "none.csv"), "images": str(tmp_path)})
  assert entries.check_entry(entries.entry_from_config(missing)) == [
    f"dataset 'pets' field 'test': no file {tmp_path / 'none.csv'}"
  ]
  with pytest.raises(
    coco.DataError, match=r"field 'member' \('Dice'\) applies to kind \('odinw',\)"
  ):
    entries.entry_from_config(dict(entry_config, member="Dice"))


def test_an_unregistered_kind_names_the_known_ones():
  with pytest.raises(coco.DataError) as e:
    entries.entry_from_config({"name": "x", "kind": KIND, "train": {}})
  assert f"field 'kind' has value {KIND!r}, expected one of {tuple(readers.READERS)}" in str(
    e.value
  )
  assert KIND not in readers.READERS


def test_the_built_in_kinds_and_their_roles():
  assert entries.kinds() == ("coco", "tfds", "odinw", "objects365", "lvis", "coco2017")
  rooted = {k: r.root_folder for k, r in readers.READERS.items() if r.root_folder}
  assert rooted == {
    "odinw": "odinw",
    "objects365": "objects365",
    "lvis": "lvis",
    "coco2017": "coco",
  }
  assert {k: r.evaluation for k, r in readers.READERS.items() if r.evaluation} == {
    "objects365": "coco",
    "lvis": "lvis",
    "coco2017": "coco",
  }
  with pytest.raises(ValueError, match="already registered"):
    readers.register(readers.Reader("coco", *(lambda *a: None,) * 3))


def test_the_docs_show_this_reader():
  with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "extending.md")) as f:
    page = f.read()
  assert textwrap.dedent(READER_MODULE).strip() in page


@pytest.mark.slow
def test_a_reader_module_runs_end_to_end(csv_reader, tmp_path, pretrained_cache_dir):
  # Without replay (the reader is what is tested) and 4 images per evaluated set: the
  # cheapest whole run, the session's pre-trained model loaded.
  config = tiny_config("no_replay", pretrained_cache_dir)
  config.data.sequence = [_csv_entry(tmp_path, config)]
  config.max_eval_images = 4
  workdir = str(tmp_path / "run")
  experiment.run(config, workdir)
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  assert results["status"] == "complete"
  assert [s["name"] for s in results["stages"]] == ["pretrained", "thermal_csv"]
  ap = results["stages"][-1]["metrics"]["thermal_csv"]["AP"]
  assert isinstance(ap, float) and 0.0 <= ap <= 1.0

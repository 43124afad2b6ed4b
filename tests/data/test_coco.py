"""CocoSource: parsing, index mapping, crowd handling, and the DataError messages."""

import copy
import os

import grain
import numpy as np
from owl_data_helpers import basic_dataset
from owl_data_helpers import write_coco
import pytest

from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError


def test_parse_and_load(coco_files):
  ann, img_dir = coco_files
  src = CocoSource(ann, img_dir)
  assert src.name == "ann"
  assert src.category_ids == [3, 7, 12]
  assert src.class_names == ["cat", "dog", "bird"]
  assert src.image_ids == [2, 5, 9]
  assert len(src) == 3 and src.num_classes == 3
  ex = src.load(1)  # image id 5
  assert ex["image_id"] == 5
  assert ex["image"].dtype == np.uint8 and ex["image"].shape == (40, 60, 3)
  np.testing.assert_array_equal(ex["labels"], np.array([1, 0], np.int32))  # dog, cat; no crowd
  np.testing.assert_allclose(ex["boxes"], [[10, 5, 30, 15], [0, 0, 60, 40]])
  assert ex["boxes"].dtype == np.float32 and ex["labels"].dtype == np.int32
  ex = src[0]  # image id 2: bird, float box
  np.testing.assert_allclose(ex["boxes"], [[2.5, 3, 12.5, 23.5]])
  np.testing.assert_array_equal(ex["labels"], [2])
  ex = src.load(2)  # image id 9: no annotations
  assert ex["boxes"].shape == (0, 4) and ex["labels"].shape == (0,)
  # The pycocotools index keeps every annotation (crowd included) for evaluation.
  assert len(src.coco.getAnnIds(imgIds=[5])) == 3
  with pytest.raises(IndexError):
    src.load(3)


def test_grain_source_and_cache(coco_files):
  ann, img_dir = coco_files
  src = CocoSource(ann, img_dir, "x", cache_images=True)
  ds = grain.MapDataset.source(src)
  a = ds[1]
  b = src.load(1)
  np.testing.assert_array_equal(a["image"], b["image"])
  assert a["image_id"] == 5


def test_missing_annotation_file(tmp_path):
  p = str(tmp_path / "nope.json")
  with pytest.raises(DataError, match="annotation file not found") as e:
    CocoSource(p, str(tmp_path))
  assert p in str(e.value)


def test_missing_image_file(tmp_path):
  images, anns, cats = basic_dataset()
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  os.remove(os.path.join(img_dir, "b.png"))
  with pytest.raises(DataError) as e:
    CocoSource(ann, img_dir)
  msg = str(e.value)
  assert os.path.join(img_dir, "b.png") in msg and "image id 2" in msg and ann in msg
  # Lazily: the error comes at load time and names the path and id too.
  src = CocoSource(ann, img_dir, check_files=False)
  with pytest.raises(DataError, match="image id 2") as e:
    src.load(0)
  assert "b.png" in str(e.value)


def test_unknown_category(tmp_path):
  images, anns, cats = basic_dataset()
  anns[1]["category_id"] = 99
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  with pytest.raises(DataError) as e:
    CocoSource(ann, img_dir)
  msg = str(e.value)
  assert ann in msg and "category_id" in msg and "99" in msg and "annotations[1]" in msg


def test_unknown_image_id(tmp_path):
  images, anns, cats = basic_dataset()
  anns[0]["image_id"] = 1234
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  with pytest.raises(DataError, match="image_id.*1234"):
    CocoSource(ann, img_dir)


@pytest.mark.parametrize(
  "bbox,why",
  [
    ([10, 5, 0, 10], "degenerate"),
    ([10, 5, 20, -1], "degenerate"),
    ([50, 5, 20, 10], "outside"),  # x1 = 70 > 60 + 2
    ([-5, 5, 20, 10], "outside"),
  ],
)
def test_degenerate_or_outside_box(tmp_path, bbox, why):
  images, anns, cats = basic_dataset()
  anns[0]["bbox"] = bbox
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  with pytest.raises(DataError) as e:
    CocoSource(ann, img_dir)
  msg = str(e.value)
  assert ann in msg and "'bbox'" in msg and str(bbox) in msg and why in msg
  # on_invalid='skip' drops it instead.
  src = CocoSource(ann, img_dir, on_invalid="skip")
  assert src.num_skipped == 1
  np.testing.assert_array_equal(src.load(1)["labels"], [0])  # only 'cat' (id 3) left
  assert len(src.coco.getAnnIds(imgIds=[5])) == 2


def test_box_within_tolerance_is_clipped(tmp_path):
  images, anns, cats = basic_dataset()
  anns[0]["bbox"] = [50, 5, 11.5, 10]  # x1 = 61.5 <= 60 + 2
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  src = CocoSource(ann, img_dir)
  np.testing.assert_allclose(src.load(1)["boxes"][0], [50, 5, 60, 15])


@pytest.mark.parametrize(
  "where,field",
  [("images", "height"), ("annotations", "bbox"), ("categories", "name"), (None, "categories")],
)
def test_missing_fields(tmp_path, where, field):
  images, anns, cats = basic_dataset()
  data = dict(images=images, annotations=anns, categories=cats)
  if where is None:
    del data[field]
  else:
    del data[where][0][field]
  import json

  ann = str(tmp_path / "ann.json")
  (tmp_path / "images").mkdir()
  with open(ann, "w") as f:
    json.dump(data, f)
  with pytest.raises(DataError) as e:
    CocoSource(ann, str(tmp_path / "images"), check_files=False)
  assert f"'{field}'" in str(e.value) and ann in str(e.value)


def test_image_size_mismatch(tmp_path):
  images, anns, cats = basic_dataset()
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  images2 = copy.deepcopy(images)
  images2[1]["height"] = 31
  ann2, _ = write_coco(
    str(tmp_path), images2, anns, cats, write_images=False, json_name="ann2.json"
  )
  src = CocoSource(ann2, img_dir)
  with pytest.raises(DataError, match="height=31"):
    src.load(0)

"""CocoSource: parsing, index mapping, crowd handling, and the DataError messages."""

import copy
import os

import grain
import numpy as np
from owl_data_helpers import basic_dataset
from owl_data_helpers import write_coco
import pytest

from owl_cl.data import coco as coco_lib
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


# ----------------------------------------------------------------------------- decoding


def one_image_source(tmp_path, write, height, width, **options) -> CocoSource:
  """A CocoSource of one image `img.<ext>` written by `write(path_without_ext) -> ext`, with
  the json size `height` x `width` and no annotation."""
  img_dir = tmp_path / "images"
  img_dir.mkdir(exist_ok=True)
  ext = write(str(img_dir / "img"))
  images = [dict(id=1, file_name=f"img.{ext}", height=height, width=width)]
  ann, _ = write_coco(
    str(tmp_path), images, [], [dict(id=1, name="cup")], write_images=False, json_name="a.json"
  )
  return CocoSource(ann, str(img_dir), **options)


def test_sixteen_bit_png_is_scaled_to_eight_bits(tmp_path):
  from PIL import Image  # pylint: disable=g-import-not-at-top

  # Every 16-bit level class: 0, 128 (rounds to 0), 257*k (exactly k), 65535 (255).
  grey = np.array([[0, 128, 257, 32896], [257 * 200, 65000, 65535, 1000]], np.uint16)

  def write(stem):
    Image.fromarray(grey).save(stem + ".png")  # PIL writes mode I;16 as a 16-bit PNG
    return "png"

  image = one_image_source(tmp_path, write, 2, 4).decode_image(0)
  expected = np.rint(grey.astype(np.float64) * 255.0 / 65535.0).astype(np.uint8)
  np.testing.assert_array_equal(expected, [[0, 0, 1, 128], [200, 253, 255, 4]])  # by hand
  assert image.dtype == np.uint8 and image.shape == (2, 4, 3)
  np.testing.assert_array_equal(image, np.repeat(expected[..., None], 3, axis=-1))


def test_png_cut_before_iend_is_refused(tmp_path):
  from PIL import Image  # pylint: disable=g-import-not-at-top

  def write(stem):
    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(stem + ".png")
    with open(stem + ".png", "rb") as f:
      data = f.read()
    assert data.endswith(b"IEND\xaeB`\x82")
    with open(stem + ".png", "wb") as f:
      f.write(data[:-12])  # the whole IEND chunk gone: PIL alone decodes every pixel
    return "png"

  source = one_image_source(tmp_path, write, 6, 5)
  with Image.open(source.image_path(0)) as im:
    assert np.asarray(im.convert("RGB")).shape == (6, 5, 3)  # what the check is for
  with pytest.raises(DataError, match=r"cannot decode image .*img.png \(image id 1\): .*trunc"):
    source.decode_image(0)


def write_oriented_jpeg(stem: str, orientation: int) -> np.ndarray:
  """A 4x6 (HxW) JPEG of four flat quadrants tagged with EXIF `orientation`; returns the
  stored pixels as decoded by PIL (JPEG is lossy: the reference is the decoded file)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  pixels = np.zeros((4, 6, 3), np.uint8)
  pixels[:2, :3], pixels[:2, 3:], pixels[2:, :3], pixels[2:, 3:] = 0, 80, 160, 240
  exif = Image.Exif()
  exif[0x0112] = orientation
  Image.fromarray(pixels).save(stem + ".jpg", exif=exif, quality=100)
  with Image.open(stem + ".jpg") as im:
    return np.asarray(im.convert("RGB"))


@pytest.mark.parametrize("policy", ["ignore", "apply", "refuse"])
def test_exif_orientation_policy(policy, tmp_path):
  stored = {}

  def write(stem):
    stored["pixels"] = write_oriented_jpeg(stem, 6)  # 6: turn 90 degrees clockwise to view
    return "jpg"

  # The json gives the frame the boxes were drawn in: stored 6x4 (WxH) or turned 4x6.
  height, width = (6, 4) if policy == "apply" else (4, 6)
  source = one_image_source(tmp_path, write, height, width, exif_orientation=policy)
  if policy == "refuse":
    with pytest.raises(DataError, match=r"img.jpg \(image id 1\) has EXIF orientation 6 and"):
      source.decode_image(0)
    return
  image = source.decode_image(0)
  # Orientation 6 = the stored image turned 90 degrees clockwise (np.rot90 k=-1).
  expected = stored["pixels"] if policy == "ignore" else np.rot90(stored["pixels"], k=-1)
  np.testing.assert_array_equal(image, expected)


def test_exif_turned_json_size_names_the_policy(tmp_path):
  """'ignore' with a json in the turned frame: the mismatch says which setting fits."""

  def write(stem):
    write_oriented_jpeg(stem, 8)  # 8: turn 90 degrees counter-clockwise to view
    return "jpg"

  source = one_image_source(tmp_path, write, 6, 4)
  with pytest.raises(DataError, match="EXIF orientation 8 turns it by 90 degrees") as e:
    source.decode_image(0)
  assert "decodes to 6x4 (WxH) but the json says width=4 height=6" in str(e.value)
  assert "config.data.exif_orientation='apply'" in str(e.value)


def test_duplicate_annotation_id_is_refused(tmp_path):
  images, anns, cats = basic_dataset()
  anns[3]["id"] = 2  # image 2's bird would replace image 5's cat in pycocotools' index
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  with pytest.raises(DataError) as e:
    CocoSource(ann, img_dir)
  assert str(e.value) == (
    f"{ann}: annotations[3] field 'id' has value 2, which annotations[1] also has "
    "(annotation ids must be unique)"
  )


def test_duplicate_image_id_is_refused(tmp_path):
  images, anns, cats = basic_dataset()
  images[2]["id"] = 5
  ann, img_dir = write_coco(str(tmp_path), images, anns, cats)
  with pytest.raises(DataError) as e:
    CocoSource(ann, img_dir)
  assert str(e.value) == (
    f"{ann}: images[2] field 'id' has value 5, which images[0] also has (image ids must be unique)"
  )


def test_derived_arrays_kept_only_with_the_images(coco_files):
  ann, img_dir = coco_files
  for keep in (True, False):
    src = CocoSource(ann, img_dir, "x", cache_images=keep)
    computed = []

    def compute(computed=computed):
      computed.append(1)
      return np.arange(3.0)

    first = src.derived(1, "k", compute)
    again = src.derived(-2, "k", compute)  # the same image, indexed from the end
    other = src.derived(1, "another key", compute)
    np.testing.assert_array_equal(again, [0.0, 1.0, 2.0])
    if keep:
      assert again is first and other is not first and len(computed) == 2
      assert not first.flags.writeable  # shared between batches: never written
    else:
      assert len(computed) == 3
    with pytest.raises(IndexError, match="out of range"):
      src.derived(3, "k", compute)


def test_derived_arrays_kept_within_the_budget(coco_files, monkeypatch):
  # 24 bytes each, 50 bytes kept at most: the first two entries stay, the third is computed on
  # every call (still returned, never kept).
  monkeypatch.setattr(coco_lib, "DERIVED_BUDGET_BYTES", 50)
  ann, img_dir = coco_files
  src = CocoSource(ann, img_dir, "x", cache_images=True)
  first = [src.derived(i, "k", lambda: np.zeros(3)) for i in range(3)]
  again = [src.derived(i, "k", lambda: np.ones(3)) for i in range(3)]
  assert again[0] is first[0] and again[1] is first[1]
  np.testing.assert_array_equal(again[2], np.ones(3))  # computed again: over the budget

"""ODinW registry: GLIP ODinW-35 layout, fake exports parsed, balanced subsets, missing files."""

import json

import numpy as np
from owl_data_helpers import write_coco
import pytest

from owl_cl.data import odinw
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError
from owl_cl.testing import fake_data

# Paper supplementary, Datasets table: (# concepts, # train, # test). ChessPieces lists 13
# concepts: its json has 13 categories, one of them box-less and excluded here (12 classes).
PAPER_TABLE = {
  "Pothole": (1, 465, 67),
  "WildfireSmoke": (1, 516, 74),
  "ThermalCheetah": (2, 90, 14),
  "ThermalDogsAndPeople": (2, 142, 20),
  "BCCD": (3, 255, 36),
  "ShellfishOpenImages": (4, 407, 58),
  "EgoHands": (4, 1000, 480),
  "AerialMaritimeDrone": (5, 371, 32),
  "BrackishUnderwater": (6, 800, 1468),
  "Dice": (6, 576, 71),
  "Aquarium": (7, 448, 63),
  "ChessPieces": (13, 202, 29),
  "AmericanSignLanguageLetters": (26, 780, 72),
  "Plantdoc": (30, 2128, 239),
  "OxfordPets": (37, 2437, 345),
}


def test_registry_matches_paper_table():
  assert odinw.ODINW_NAMES == tuple(PAPER_TABLE)
  for name, (concepts, train, test) in PAPER_TABLE.items():
    spec = odinw.ODINW_DATASETS[name]
    # ShellfishOpenImages: the paper lists 4 concepts, GLIP's export has 3 categories.
    expected = 3 if name == "ShellfishOpenImages" else concepts
    assert len(spec.category_names) == expected, name
    assert (spec.num_train, spec.num_test) == (train, test), name
  assert odinw.ODINW_DATASETS["ChessPieces"].num_classes == 12
  subsets = {n: s.subset_size for n, s in odinw.ODINW_DATASETS.items() if s.subset_size}
  assert subsets == {
    "EgoHands": 1000,
    "BrackishUnderwater": 800,
    "AmericanSignLanguageLetters": 780,
  }
  assert {n for n, s in odinw.ODINW_DATASETS.items() if s.max_detections == 100} == {
    "EgoHands",
    "BrackishUnderwater",
  }
  with pytest.raises(KeyError, match="known"):
    odinw.odinw_spec("PascalVOC")


def test_paths_are_glips():
  spec = odinw.ODINW_DATASETS
  assert spec["AerialMaritimeDrone"].paths("train") == (
    "odinw/AerialMaritimeDrone/tiled/train/annotations_without_background.json",
    "odinw/AerialMaritimeDrone/tiled/train",
  )
  assert spec["EgoHands"].paths("val") == (
    "odinw/EgoHands/specific/valid/annotations_without_background.json",
    "odinw/EgoHands/specific/valid",
  )
  assert spec["Dice"].paths("val") == (
    "odinw/dice/mediumColor/export/val_annotations_without_background.json",
    "odinw/dice/mediumColor/export",
  )
  assert spec["AmericanSignLanguageLetters"].paths("test")[0] == (
    "odinw/AmericanSignLanguageLetters/American Sign Language Letters.v1-v1.coco/test/"
    "annotations_without_background.json"
  )
  assert spec["BrackishUnderwater"].paths("test")[1] == "odinw/brackishUnderwater/1920x1080/test"
  ann, img = odinw.odinw_paths("/r", "BrackishUnderwater", "train", variant="960x540")
  assert ann == "/r/odinw/brackishUnderwater/960x540/train/annotations_without_background.json"
  with pytest.raises(ValueError):
    spec["Pothole"].paths("valid")


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("data"))
  written = fake_data.write_fake_odinw(
    root, ["Pothole", "Dice", "ChessPieces"], num_images={"train": 9, "val": 3, "test": 4}, seed=1
  )
  return root, written


def test_fake_exports_parse(fake_root):
  root, written = fake_root
  for name in ("Pothole", "Dice", "ChessPieces"):
    for split in odinw.SPLITS:
      src = odinw.odinw_source(root, name, split)
      data = written[name][split]["json"]
      assert len(src) == len(data["images"])
      assert src.image_ids == sorted(im["id"] for im in data["images"])
      assert src.image_ids[0] == 0  # Roboflow image ids start at 0
      spec = odinw.ODINW_DATASETS[name]
      assert src.num_classes == spec.num_classes
      # Boxes: json [x, y, w, h] -> xyxy, per image, classes mapped by category id.
      for i in (0, len(src) - 1):
        ex = src.load(i)
        anns = [a for a in data["annotations"] if a["image_id"] == ex["image_id"]]
        want = np.array(
          [
            [a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
            for a in anns
          ],
          np.float32,
        )
        np.testing.assert_array_equal(ex["boxes"], want)
        assert [src.category_ids[l] for l in ex["labels"]] == [a["category_id"] for a in anns]
        # The rectangle of the last (topmost) box has its class colour (JPEG: tolerance).
        x0, y0, x1, y1 = want[-1].astype(int)
        centre = ex["image"][(y0 + y1) // 2, (x0 + x1) // 2].astype(int)
        assert np.abs(centre - fake_data._palette(anns[-1]["category_id"])).max() <= 16
  chess = odinw.odinw_source(root, "ChessPieces", "train")
  assert chess.class_names[0] == "black bishop" and 1 not in chess.category_ids
  assert chess.num_excluded == 0
  dice = odinw.odinw_source(root, "Dice", "val")
  assert dice.image_dir.endswith("odinw/dice/mediumColor/export")


def test_category_mismatch_is_named(tmp_path):
  root = str(tmp_path)
  written = fake_data.write_fake_odinw(root, ["Pothole"], num_images=2)
  path = written["Pothole"]["test"]["annotation_file"]
  data = json.load(open(path))
  data["categories"][0]["name"] = "crater"
  json.dump(data, open(path, "w"))
  with pytest.raises(
    DataError,
    match=r"annotations_without_background\.json.*'categories'.*"
    r"crater",
  ):
    odinw.odinw_source(root, "Pothole", "test")
  with pytest.raises(DataError, match="annotation file not found.*EgoHands"):
    odinw.odinw_source(root, "EgoHands", "train")


def test_missing_files_listing(tmp_path):
  root = str(tmp_path)
  all_pothole = odinw.expected_files(root, ["Pothole"])
  assert len(all_pothole) == 6  # 3 jsons + 3 image folders
  assert odinw.missing_files(root, ["Pothole"]) == all_pothole
  dice = odinw.expected_files(root, "Dice")
  assert len(dice) == 4  # 3 jsons + the shared export folder
  fake_data.write_fake_odinw(root, ["Pothole"], num_images=1)
  assert odinw.missing_files(root, ["Pothole", "Dice"]) == dice
  with pytest.raises(DataError) as e:
    odinw.check_odinw(root, ["Pothole", "Dice"])
  for p in dice:
    assert p in str(e.value)
  assert "val_annotations_without_background.json" in odinw.layout_description(["Dice"])
  odinw.check_odinw(root, ["Pothole"])  # complete: no error
  assert len(odinw.expected_files(root)) == 15 * 6 - 2


def _single_class_source(tmp_path, per_class):
  """One box per image; class c has per_class[c] images."""
  images, anns = [], []
  for c, n in enumerate(per_class):
    for _ in range(n):
      k = len(images)
      images.append(dict(id=100 + k, file_name=f"{k}.png", height=8, width=8))
      anns.append(dict(id=k, image_id=100 + k, category_id=c + 1, bbox=[1, 1, 4, 4]))
  images.append(dict(id=999, file_name="empty.png", height=8, width=8))  # no boxes
  cats = [dict(id=c + 1, name=f"c{c}") for c in range(len(per_class))]
  ann, img = write_coco(str(tmp_path), images, anns, cats)
  return CocoSource(ann, img)


def _class_counts(src, ids):
  sub = src.subset(ids)
  return np.bincount(
    np.concatenate([sub.targets(i)["labels"] for i in range(len(sub))]), minlength=src.num_classes
  )


def test_balanced_subset_hand_worked(tmp_path):
  src = _single_class_source(tmp_path, [20, 10, 4])
  ids = odinw.balanced_subset(src, 12, seed=0)
  assert len(ids) == len(set(ids)) == 12 and ids == sorted(ids)
  assert _class_counts(src, ids).tolist() == [4, 4, 4]
  # Class 2 runs out after 4 rounds; the other two keep alternating (differ by <= 1).
  counts = _class_counts(src, odinw.balanced_subset(src, 15, seed=3))
  assert counts[2] == 4 and sorted(counts[:2].tolist()) == [5, 6]
  # Seeded and deterministic.
  assert odinw.balanced_subset(src, 12, seed=0) == ids
  assert odinw.balanced_subset(src, 12, seed=1) != ids
  # All box images used before the box-less one; larger than the source: everything.
  assert 999 not in odinw.balanced_subset(src, 34, seed=0)
  assert odinw.balanced_subset(src, 35, seed=0) == src.image_ids
  assert odinw.balanced_subset(src, 100, seed=0) == src.image_ids


def test_odinw_source_subset(tmp_path):
  root = str(tmp_path)
  fake_data.write_fake_odinw(
    root, ["AmericanSignLanguageLetters"], num_images={"train": 30, "val": 2, "test": 2}, seed=0
  )
  full = odinw.odinw_source(root, "AmericanSignLanguageLetters", "train", subset_seed=None)
  assert len(full) == 30  # spec subset (780) larger than the split: used whole
  assert len(odinw.odinw_source(root, "AmericanSignLanguageLetters", "train")) == 30
  sub = odinw.odinw_source(
    root, "AmericanSignLanguageLetters", "train", subset_size=13, subset_seed=5
  )
  again = odinw.odinw_source(
    root, "AmericanSignLanguageLetters", "train", subset_size=13, subset_seed=5
  )
  assert len(sub) == 13 and sub.image_ids == again.image_ids
  assert set(sub.image_ids) <= set(full.image_ids)
  assert sub.class_names == full.class_names and sub.name == "AmericanSignLanguageLetters"
  assert set(sub.coco.getImgIds()) == set(sub.image_ids)
  for i in range(len(sub)):
    j = full.image_ids.index(sub.image_ids[i])
    np.testing.assert_array_equal(sub.targets(i)["boxes"], full.targets(j)["boxes"])
  # Balanced: images chosen for each class differ by at most one -> the 13 images cover 13
  # distinct classes (each fake image holds 1-3 classes).
  covered = set(np.concatenate([sub.targets(i)["labels"] for i in range(len(sub))]).tolist())
  assert len(covered) >= 13
  # Subsets only apply to the training split.
  assert len(odinw.odinw_source(root, "AmericanSignLanguageLetters", "val", subset_size=1)) == 2

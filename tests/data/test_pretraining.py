"""Objects365 (forbidden categories), LVIS v1 (federated fields), Visual Genome sources."""

import json

import numpy as np
import pytest

from owl_cl.data import pretraining as PT
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError
from owl_cl.testing import fake_data


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  r = str(tmp_path_factory.mktemp("data"))
  written = dict(
    o365=fake_data.write_fake_objects365(r, seed=2),
    lvis=fake_data.write_fake_lvis(r, seed=2),
    vg=fake_data.write_fake_visual_genome(r, seed=2),
  )
  return r, written


def test_forbidden_labels_scenic_matching():
  rare, near = PT.forbidden_label_names()
  assert len(rare) == 337 and len(near) == 275
  assert "hot-air_balloon" in rare and "wind chimes" in near
  # Canonicalisation: case, '_' and '-' do not matter; whole-label matches only.
  assert (
    PT.forbidden_key("Hot-air balloon") == PT.forbidden_key("hot-air_balloon") == ("hotair balloon")
  )
  assert PT.is_forbidden("Dumbbell") and PT.is_forbidden("Wind Chimes")
  assert PT.is_forbidden("Apple Sauce") and PT.is_forbidden("applesauce")
  assert not PT.is_forbidden("Person") and not PT.is_forbidden("apple")
  assert not PT.is_forbidden("dumbbell rack")
  assert PT.is_forbidden("person", forbidden=["PERSON"])
  cats = [dict(id=1, name="Person"), dict(id=295, name="Dumbbell"), dict(id=7, name="Axe")]
  assert PT.forbidden_category_ids(cats) == [295, 7]


def test_objects365_train_removes_forbidden(root):
  r, written = root
  data = written["o365"]["train"]["json"]
  src = PT.objects365_source(r, "train")
  assert src.class_names == ["Person", "Car", "Bottle", "Cow"]
  forbidden_ids = {295, 325}
  n_forbidden = sum(a["category_id"] in forbidden_ids for a in data["annotations"])
  assert n_forbidden > 0 and src.num_excluded == n_forbidden
  assert len(src) == len(data["images"])  # images are kept
  assert not forbidden_ids & {c["id"] for c in src.coco.dataset["categories"]}
  total = sum(len(src.targets(i)["labels"]) for i in range(len(src)))
  assert total == len(data["annotations"]) - n_forbidden
  # Files: 'images/v1/patchN/<file>' -> '<root>/objects365/train/patchN/<file>'.
  ex = src.load(0)
  im = data["images"][0]
  assert ex["image"].shape == (im["height"], im["width"], 3)
  assert PT.objects365_relative_path(im) == "/".join(im["file_name"].split("/")[-2:])
  val = PT.objects365_source(r, "val")
  assert len(val.class_names) == 6 and val.num_excluded == 0
  assert PT.objects365_source(r, "val", remove_forbidden=True).num_classes == 4


def test_lvis_federated_fields(root):
  r, written = root
  for split in ("train", "val"):
    data = written["lvis"][split]["json"]
    src = PT.lvis_source(r, split)
    assert src.federated and len(src) == len(data["images"])
    by_id = {im["id"]: im for im in data["images"]}
    for i in range(len(src)):
      im = by_id[src.image_ids[i]]
      fed = src.federated_labels(i)
      assert [src.category_ids[k] for k in fed["negative_labels"]] == sorted(im["neg_category_ids"])
      assert [src.category_ids[k] for k in fed["not_exhaustive_labels"]] == sorted(
        im["not_exhaustive_category_ids"]
      )
    ex = src.load(len(src) - 1)  # decodes (file from coco_url)
    np.testing.assert_array_equal(
      ex["negative_labels"], src.federated_labels(len(src) - 1)["negative_labels"]
    )
  val = PT.lvis_source(r, "val")
  folders = {im["coco_url"].split("/")[-2] for im in written["lvis"]["val"]["json"]["images"]}
  assert folders == {"train2017", "val2017"}  # both COCO folders, as LVIS v1 val
  groups = PT.lvis_frequency_groups(val)
  names = {f: [val.class_names[i] for i in g] for f, g in groups.items()}
  assert names == {
    "r": ["applesauce", "baboon"],
    "c": ["aerosol_can", "zucchini"],
    "f": ["apple", "bicycle"],
  }
  assert val.category_entries[0]["synonyms"] == ["aerosol_can", "spray_can"]
  assert PT.coco_url_relative_path(
    {"coco_url": "http://images.cocodataset.org/val2017/000000397133.jpg"}
  ) == ("val2017/000000397133.jpg")


def _edit(path, fn):
  data = json.load(open(path))
  fn(data)
  json.dump(data, open(path, "w"))


def test_lvis_errors_name_file_field_value(tmp_path):
  r = str(tmp_path)
  w = fake_data.write_fake_lvis(r, num_images={"train": 2, "val": 2})
  path = w["val"]["annotation_file"]
  _edit(path, lambda d: d["categories"][1].update(frequency="x"))
  with pytest.raises(DataError, match=r"lvis_v1_val\.json.*'frequency'.*'x'"):
    PT.lvis_source(r, "val")
  _edit(path, lambda d: d["categories"][1].update(frequency="f"))
  _edit(path, lambda d: d["images"][0].update(neg_category_ids=[77777]))
  with pytest.raises(DataError, match=r"lvis_v1_val\.json.*'neg_category_ids'.*77777"):
    PT.lvis_source(r, "val")
  _edit(
    path, lambda d: (d["images"][0].update(neg_category_ids=[]), d["images"][1].pop("coco_url"))
  )
  with pytest.raises(DataError, match=r"lvis_v1_val\.json.*images\[1\].*coco_url"):
    PT.lvis_source(r, "val")


def test_visual_genome(root):
  r, written = root
  src = PT.visual_genome_source(r)
  # 'wind chimes' is forbidden, 'Sky' is case-folded, 'plant' is a second name.
  assert src.class_names == ["man", "plant", "shirt", "sky", "tree", "window"]
  objects = {e["image_id"]: e["objects"] for e in written["vg"]["objects"]}
  for i in range(len(src)):
    iid = src.image_ids[i]
    t = src.targets(i)
    kept = [o for o in objects[iid] if o["names"][0] != "wind chimes"]
    n_pairs = sum(len(o["names"]) for o in kept)
    assert len(t["labels"]) == n_pairs
    for o in kept:
      box = [o["x"], o["y"], o["x"] + o["w"], o["y"] + o["h"]]
      rows = np.nonzero((t["boxes"] == np.float32(box)).all(axis=1))[0]
      assert sorted(src.class_names[t["labels"][k]] for k in rows) == sorted(
        n.lower() for n in o["names"]
      )
  ex = src.load(src.image_ids.index(2))  # even id -> VG_100K_2/2.jpg
  im = written["vg"]["image_data"][1]
  assert ex["image"].shape == (im["height"], im["width"], 3)
  everything = PT.visual_genome_source(r, remove_forbidden=False)
  assert "wind chimes" in everything.class_names
  assert len(PT.visual_genome_source(r, image_ids=[1, 3])) == 2
  with pytest.raises(DataError, match=r"objects\.json.*'image_id'.*12345"):
    PT.visual_genome_to_coco([dict(image_id=12345, objects=[])], written["vg"]["image_data"])


def test_coco_source_extension_errors(root):
  r, written = root
  ann = written["o365"]["val"]["annotation_file"]
  img = written["o365"]["val"]["image_dir"]
  with pytest.raises(DataError, match=r"zhiyuan_objv2_val\.json.*exclude_category_ids.*4242"):
    CocoSource(ann, img, exclude_category_ids=[4242], file_name_fn=PT.objects365_relative_path)
  with pytest.raises(DataError, match=r"zhiyuan_objv2_val\.json.*image_ids.*31337"):
    CocoSource(ann, img, image_ids=[31337], file_name_fn=PT.objects365_relative_path)
  with pytest.raises(DataError, match=r"zhiyuan_objv2_val\.json.*image file not found"):
    CocoSource(ann, img + "/../train", file_name_fn=PT.objects365_relative_path)
  src = CocoSource(ann, img, file_name_fn=PT.objects365_relative_path)
  sub = src.subset(src.image_ids[1:3])
  assert sub.image_ids == src.image_ids[1:3] and not sub.federated
  np.testing.assert_array_equal(sub.load(0)["image"], src.load(1)["image"])
  assert "negative_labels" not in src.load(0)  # non-federated sources: unchanged keys

"""Dataset entries, the TFDS ArrayRecord reader and named suites, on data the tests write.

Fixtures: a COCO-format folder (json + PNGs) and the same dataset written as a TFDS
ArrayRecord dataset exactly as TFDS' `coco` builder writes it (boxes normalised
[ymin, xmin, ymax, xmax] = [y / H, x / W, (y + h) / H, (x + w) / W], labels = index of the
category in the json's `categories`), with the PNG bytes as the encoded image. Writing needs
no TensorFlow (the image feature takes encoded bytes).
"""

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
from PIL import Image
import pytest

from owl_cl.data import builtin
from owl_cl.data import entries
from owl_cl.data import input_pipeline
from owl_cl.data import odinw
from owl_cl.data import suites
from owl_cl.data import tfds_source
from owl_cl.data.coco import DataError
from owl_cl.eval import coco_eval
from owl_cl.testing import fake_data

tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is not installed")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Non-contiguous category ids (COCO-style) and unsorted json order: TFDS labels follow the
# json's `categories` order, so label 0 <-> id 3 'cat', label 1 <-> id 1 'dog' here.
CATEGORIES = [dict(id=3, name="cat"), dict(id=1, name="dog")]
TFDS_CATEGORY_IDS = (3, 1)
IMAGES = [
  dict(id=7, file_name="a.png", height=48, width=64),
  dict(id=2, file_name="b.png", height=50, width=50),
  dict(id=11, file_name="c.png", height=77, width=33),
  dict(id=5, file_name="d.png", height=20, width=20),  # no boxes
]
ANNOTATIONS = [
  # Dyadic values: x / W etc. are exact in float32, so TFDS stores them without rounding.
  dict(id=1, image_id=7, category_id=3, bbox=[10.5, 6.0, 20.25, 12.0], iscrowd=0),
  dict(id=2, image_id=7, category_id=1, bbox=[30.0, 20.0, 30.0, 25.0], iscrowd=0),
  dict(id=3, image_id=7, category_id=1, bbox=[0.0, 0.0, 64.0, 48.0], iscrowd=1),
  # Non-dyadic: float32 storage of x / W rounds (checked to tolerance).
  dict(id=4, image_id=2, category_id=3, bbox=[3.3, 7.1, 21.7, 13.9], iscrowd=0),
  dict(id=5, image_id=11, category_id=1, bbox=[1.7, 40.2, 30.1, 35.3], iscrowd=0),
  dict(id=6, image_id=11, category_id=3, bbox=[5.0, 5.0, 9.9, 11.1], iscrowd=0),
]
for _a in ANNOTATIONS:
  _a["area"] = float(round(_a["bbox"][2] * _a["bbox"][3]))  # integers: TFDS `area` is int64


def _png(image_id: int, h: int, w: int) -> bytes:
  rng = np.random.default_rng(image_id)
  buf = io.BytesIO()
  Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
  return buf.getvalue()


def write_coco_folder(root: str, images=IMAGES, annotations=ANNOTATIONS, categories=CATEGORIES):
  """COCO json + PNG folder; returns (json path, image dir)."""
  img_dir = os.path.join(root, "images")
  os.makedirs(img_dir, exist_ok=True)
  for im in images:
    with open(os.path.join(img_dir, im["file_name"]), "wb") as f:
      f.write(_png(im["id"], im["height"], im["width"]))
  path = os.path.join(root, "ann.json")
  with open(path, "w") as f:
    json.dump(dict(images=images, annotations=annotations, categories=categories), f)
  return path, img_dir


class OwnDataToy(tfds.core.GeneratorBasedBuilder):
  """A COCO json as a TFDS detection dataset with `coco/2017`'s features, or with
  `lvis=True` the TFDS `lvis` 1.2-1.4 features (no is_crowd / filename; per-image
  neg_category_ids / not_exhaustive_category_ids; per-object segmentation masks)."""

  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, coco: dict, lvis: bool = False, splits: dict | None = None, **kwargs):
    self._coco = coco
    self._lvis = lvis
    # {TFDS split: image ids of `coco` in it}; default one 'train' split with every image.
    self._splits = splits or {"train": [im["id"] for im in coco["images"]]}
    super().__init__(**kwargs)

  def _info(self):
    label = tfds.features.ClassLabel(names=[c["name"] for c in self._coco["categories"]])
    objects = {"id": np.int64, "area": np.int64, "bbox": tfds.features.BBoxFeature()}
    features = {"image": tfds.features.Image(encoding_format="png"), "image/id": np.int64}
    if self._lvis:  # TFDS datasets/lvis/lvis_dataset_builder.py
      features["neg_category_ids"] = tfds.features.Sequence(label)
      features["not_exhaustive_category_ids"] = tfds.features.Sequence(label)
      objects.update(label=label, segmentation=tfds.features.Image(shape=(None, None, 1)))
    else:  # TFDS object_detection/coco.py
      features["image/filename"] = tfds.features.Text()
      objects.update(label=label, is_crowd=np.bool_)
    features["objects"] = tfds.features.Sequence(objects)
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(ids) for split, ids in self._splits.items()}

  def _generate_examples(self, ids):
    cats = self._coco["categories"]
    label_of = {c["id"]: k for k, c in enumerate(cats)}
    for im in self._coco["images"]:
      if im["id"] not in ids:
        continue
      h, w = im["height"], im["width"]
      objects = []
      for a in self._coco["annotations"]:
        if a["image_id"] != im["id"]:
          continue
        x, y, bw, bh = a["bbox"]
        # TFDS coco builder: BBox(y / H, x / W, (y + h) / H, (x + w) / W).
        box = tfds.features.BBox(ymin=y / h, xmin=x / w, ymax=(y + bh) / h, xmax=(x + bw) / w)
        obj = dict(id=a["id"], area=int(a["area"]), bbox=box, label=label_of[a["category_id"]])
        if self._lvis:
          mask = io.BytesIO()  # PNG bytes: encoding an array would need TensorFlow
          Image.new("L", (w, h)).save(mask, format="PNG")
          obj["segmentation"] = mask.getvalue()  # never decoded by the reader
        else:
          obj["is_crowd"] = bool(a["iscrowd"])
        objects.append(obj)
      ex = {"image": _png(im["id"], h, w), "image/id": im["id"], "objects": objects}
      if not self._lvis:
        ex["image/filename"] = im["file_name"]
      else:
        ex["neg_category_ids"] = [label_of[c] for c in im.get("neg_category_ids", [])]
        ex["not_exhaustive_category_ids"] = [
          label_of[c] for c in im.get("not_exhaustive_category_ids", [])
        ]
      yield im["id"], ex


def write_tfds(data_dir: str, coco: dict, *, lvis: bool = False, splits=None) -> str:
  """Prepare `coco` as the ArrayRecord TFDS dataset 'own_data_toy:1.0.0'; returns its folder."""
  builder = OwnDataToy(
    coco=coco, lvis=lvis, splits=splits, data_dir=data_dir, file_format="array_record"
  )
  builder.download_and_prepare(file_format="array_record")
  return os.path.join(data_dir, "own_data_toy", "1.0.0")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(coco entry, tfds entry) of the same dataset."""
  root = str(tmp_path_factory.mktemp("own"))
  ann, img = write_coco_folder(os.path.join(root, "coco"))
  data_dir = os.path.join(root, "tfds")
  write_tfds(data_dir, dict(images=IMAGES, annotations=ANNOTATIONS, categories=CATEGORIES))
  coco = entries.entry_from_config(
    dict(name="toy", kind="coco", test=dict(annotation_file=ann, image_dir=img))
  )
  tf = entries.entry_from_config(
    dict(
      name="toy",
      kind="tfds",
      tfds="tfds:own_data_toy",
      data_dir=data_dir,
      category_ids=list(TFDS_CATEGORY_IDS),
      test="train",
    )
  )
  return coco, tf


def test_tfds_box_conversion_hand_worked(pair):
  _, tf = pair
  src = entries.load_split(tf, "test")
  anns = {a["id"]: a for a in src.coco.dataset["annotations"]}
  # Image 7 is 64 x 48: stored [ymin, xmin, ymax, xmax] = [6/48, 10.5/64, 18/48, 30.75/64]
  # = [0.125, 0.1640625, 0.375, 0.48046875] (exact in float32) -> x = 0.1640625 * 64 = 10.5,
  # y = 0.125 * 48 = 6, w = (0.48046875 - 0.1640625) * 64 = 20.25, h = 0.25 * 48 = 12.
  assert anns[1]["bbox"] == [10.5, 6.0, 20.25, 12.0]
  assert anns[1]["category_id"] == 3  # label 0 -> the first category of the json, id 3
  assert anns[2]["category_id"] == 1 and anns[3]["iscrowd"] == 1
  assert src.class_names == ["dog", "cat"]  # ascending id: 1 dog, 3 cat
  ex = src.load(src.image_ids.index(7))
  np.testing.assert_array_equal(ex["boxes"], [[10.5, 6.0, 30.75, 18.0], [30.0, 20.0, 60.0, 45.0]])
  np.testing.assert_array_equal(ex["labels"], [1, 0])  # crowd box excluded from targets
  info = src.image_info(src.image_ids.index(11))
  assert (info["height"], info["width"], info["file_name"]) == (77, 33, "c.png")


def test_tfds_default_category_ids(pair):
  _, tf = pair
  spec = tf.split("test")
  src = tfds_source.tfds_source(spec.tfds, spec.data_dir, "train")
  # No category_ids: label k -> id k + 1 (TFDS `lvis` stores category_id - 1); names are the
  # ClassLabel names in label order (the json's categories order: cat, dog).
  assert src.category_ids == [1, 2] and src.class_names == ["cat", "dog"]
  assert src.name == "own_data_toy/train"
  # coco/* with 80 classes: COCO 2017's ids (1..90 without the 10 unused ones).
  ids = tfds_source.COCO_2017_CATEGORY_IDS
  assert len(ids) == 80 and ids[:12] == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13) and ids[-1] == 90
  with pytest.raises(DataError, match="field 'category_ids' has value \\[1\\]"):
    tfds_source.tfds_source(spec.tfds, spec.data_dir, "train", category_ids=[1])


def test_coco_and_tfds_give_the_same_examples(pair):
  coco, tf = pair
  a, b = entries.load_split(coco, "test"), entries.load_split(tf, "test")
  assert a.image_ids == b.image_ids == [2, 5, 7, 11]
  assert a.class_names == b.class_names and a.category_ids == b.category_ids == [1, 3]
  for i in range(len(a)):
    ea, eb = a.load(i), b.load(i)
    assert ea["image_id"] == eb["image_id"]
    np.testing.assert_array_equal(ea["image"], eb["image"])  # PNG: lossless
    np.testing.assert_array_equal(ea["labels"], eb["labels"])
    # TFDS stores x / W as float32 (relative error <= 2^-24); coordinates here are < 80 px,
    # so |error| <= 80 * 2^-24 * 2 (two float32 roundings: storage, then xyxy) ~ 1e-5 px.
    np.testing.assert_allclose(ea["boxes"], eb["boxes"], rtol=0, atol=2e-5)
  ja = sorted(a.coco.dataset["annotations"], key=lambda x: x["id"])
  jb = sorted(b.coco.dataset["annotations"], key=lambda x: x["id"])
  assert [(x["id"], x["image_id"], x["category_id"], x["iscrowd"], x["area"]) for x in ja] == [
    (x["id"], x["image_id"], x["category_id"], x["iscrowd"], x["area"]) for x in jb
  ]
  np.testing.assert_allclose([x["bbox"] for x in ja], [x["bbox"] for x in jb], rtol=0, atol=2e-5)


def test_coco_and_tfds_give_the_same_ap(pair):
  coco, tf = pair
  a, b = entries.load_split(coco, "test"), entries.load_split(tf, "test")
  # Predictions: every non-crowd box shifted by 1-2 px (IoUs 0.6-0.9, far from the 0.05-spaced
  # thresholds relative to the 1e-5 px box differences), a wrong-class box and a false positive.
  rng = np.random.default_rng(0)
  dets = []
  for ann in a.coco.dataset["annotations"]:
    if ann["iscrowd"]:
      continue
    x, y, w, h = ann["bbox"]
    dx, dy = rng.uniform(1, 2, 2)
    dets.append(
      dict(
        image_id=ann["image_id"],
        category_id=ann["category_id"],
        bbox=[x + dx, y + dy, w, h],
        score=float(rng.uniform(0.3, 1)),
      )
    )
  dets.append(dict(image_id=7, category_id=3, bbox=[30.0, 20.0, 30.0, 25.0], score=0.95))
  dets.append(dict(image_id=5, category_id=1, bbox=[1.0, 1.0, 10.0, 10.0], score=0.9))
  ra = coco_eval.coco_evaluate(a.coco, dets, max_dets=100)
  rb = coco_eval.coco_evaluate(b.coco, dets, max_dets=100)
  assert 0.0 < ra["AP"] < 1.0
  for k in ("AP", "AP50", "AP75", "APs", "AR"):
    assert ra[k] == rb[k] or (np.isnan(ra[k]) and np.isnan(rb[k])), k


def test_tfds_source_pickles_and_decodes_lazily(pair):
  _, tf = pair
  src = entries.load_split(tf, "test")
  clone = pickle.loads(pickle.dumps(src))  # grain worker processes receive the source pickled
  i = src.image_ids.index(11)
  np.testing.assert_array_equal(clone.load(i)["image"], src.load(i)["image"])
  assert clone.load(i)["image"].shape == (77, 33, 3)


def test_tfds_source_feeds_the_eval_pipeline(pair):
  coco, tf = pair
  a, b = entries.load_split(coco, "test"), entries.load_split(tf, "test")
  kw = dict(image_size=32, batch_size=3, num_workers=0)
  for ba, bb in zip(
    input_pipeline.eval_dataset(a, **kw), input_pipeline.eval_dataset(b, **kw), strict=True
  ):
    assert ba.keys() == bb.keys()
    for k in ba:
      np.testing.assert_array_equal(ba[k], bb[k])  # same pixels: identical resize output


def test_building_a_split_reads_its_records_and_decodes_no_image(tmp_path, monkeypatch):
  """A split's annotations come from that split's records only, without decoding a pixel.

  TFDS `lvis` features (an image per example, a PNG mask per object): TFDS' image decoders
  are poisoned and PIL's pixel loading counted while the split is built; the image header
  alone gives the size. Pixels are decoded later, one image per example the pipeline loads.
  """
  from PIL import ImageFile

  data_dir = str(tmp_path / "tfds")
  coco = dict(images=IMAGES, annotations=ANNOTATIONS, categories=CATEGORIES)
  write_tfds(data_dir, coco, lvis=True, splits={"train": [7, 2, 5], "validation": [11, 5]})
  entry = entries.entry_from_config(
    dict(
      name="t",
      kind="tfds",
      tfds="tfds:own_data_toy",
      data_dir=data_dir,
      evaluation="coco",
      test="validation",
    )
  )
  reads, pixel_loads = [], []

  class CountingRecords(tfds_source._Records):  # pylint: disable=protected-access
    def __init__(self, path, split, fields=tfds_source._TOP_FIELDS):  # pylint: disable=protected-access
      super().__init__(path, split, fields)
      self.split = split

    def __getitem__(self, index):
      reads.append((self.split, index))
      return super().__getitem__(index)

  def poisoned(self, *args, **kwargs):
    raise AssertionError(f"{type(self).__name__} decoded while building annotations")

  load = ImageFile.ImageFile.load

  def counted_load(self):
    pixel_loads.append(self.size)
    return load(self)

  with monkeypatch.context() as m:
    m.setattr(tfds_source, "_Records", CountingRecords)
    m.setattr(tfds.features.Image, "decode_example_np", poisoned)
    m.setattr(tfds.features.Image, "decode_example", poisoned)
    m.setattr(ImageFile.ImageFile, "load", counted_load)
    source = entries.load_split(entry, "test")
    assert sorted(reads) == [("validation", 0), ("validation", 1)]  # 2 records, once each
    assert pixel_loads == []
    assert source.image_ids == [5, 11]
    # (height, width) from the PNG headers: image 5 is 20 x 20, image 11 is 77 x 33.
    sizes = {im["id"]: (im["height"], im["width"]) for im in source.coco.dataset["images"]}
    assert sizes == {5: (20, 20), 11: (77, 33)}
    assert sorted(a["id"] for a in source.coco.dataset["annotations"]) == [5, 6]
  # Loading an example decodes its image, and only it: the counter above would have seen it
  # (PIL's `load` runs again, as a no-op, when the decoded image is converted to RGB).
  with monkeypatch.context() as m:
    m.setattr(ImageFile.ImageFile, "load", counted_load)
    image = source.load(source.image_ids.index(11))["image"]
  assert image.shape == (77, 33, 3) and pixel_loads and set(pixel_loads) == {(33, 77)}
  np.testing.assert_array_equal(image, np.asarray(Image.open(io.BytesIO(_png(11, 77, 33)))))


@pytest.mark.slow
def test_reading_imports_no_tensorflow(pair):
  _, tf = pair
  spec = tf.split("test")
  code = (
    "import sys\n"
    "from owl_cl.data import entries\n"
    f"e = entries.entry_from_config(dict(name='toy', kind='tfds', tfds='tfds:own_data_toy', "
    f"data_dir={spec.data_dir!r}, test='train'))\n"
    "s = entries.load_split(e, 'test')\n"
    "assert s.load(0)['image'].ndim == 3\n"
    "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))\n"
  )
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_lvis_fields_and_protocol(tmp_path):
  images = [dict(im, neg_category_ids=[1], not_exhaustive_category_ids=[]) for im in IMAGES]
  images[0] = dict(images[0], neg_category_ids=[], not_exhaustive_category_ids=[3])
  cats = [dict(c, frequency=f) for c, f in zip(CATEGORIES, ("r", "f"))]
  ann, img = write_coco_folder(str(tmp_path / "lvis"), images=images, categories=cats)
  plain_ann, plain_img = write_coco_folder(str(tmp_path / "plain"))
  coco = ml_collections.ConfigDict(
    dict(name="l", kind="coco", test=dict(annotation_file=ann, image_dir=img))
  )
  lvis_entry = entries.entry_from_config(coco)
  assert entries.evaluation_protocol(lvis_entry) == "lvis"
  plain = entries.entry_from_config(
    dict(name="p", kind="coco", test=dict(annotation_file=plain_ann, image_dir=plain_img))
  )
  assert entries.evaluation_protocol(plain) == "coco"
  forced = entries.entry_from_config(
    dict(
      name="p",
      kind="coco",
      evaluation="lvis",
      test=dict(annotation_file=plain_ann, image_dir=plain_img),
    )
  )
  assert entries.evaluation_protocol(forced) == "lvis"
  src = entries.load_split(lvis_entry, "test")
  assert src.federated and [c["frequency"] for c in src.category_entries] == ["f", "r"]
  # Image 7 (index 2 of ids [2, 5, 7, 11]): not exhaustive for id 3 = class 1 ('cat').
  fl = src.federated_labels(src.image_ids.index(7))
  assert fl["not_exhaustive_labels"].tolist() == [1] and fl["negative_labels"].tolist() == []
  assert src.federated_labels(0)["negative_labels"].tolist() == [0]  # id 1 'dog'
  # The same fields through TFDS (`lvis` features: 0-based labels per image).
  data_dir = str(tmp_path / "tfds")
  write_tfds(
    data_dir, dict(images=images, annotations=ANNOTATIONS, categories=CATEGORIES), lvis=True
  )
  tf = entries.entry_from_config(
    dict(
      name="t",
      kind="tfds",
      tfds="tfds:own_data_toy:1.0.0",
      data_dir=data_dir,
      category_ids=list(TFDS_CATEGORY_IDS),
      test="train",
    )
  )
  assert entries.evaluation_protocol(tf) == "lvis"
  # TFDS has no category `frequency`: the check asks for a categories_file.
  (problem,) = entries.check_entry(tf)
  assert "dataset 't' field 'test'" in problem and "set 'categories_file'" in problem
  tf = dataclasses.replace(
    tf, splits=(("test", dataclasses.replace(tf.split("test"), categories_file=ann)),)
  )
  assert entries.check_entry(tf) == []
  tsrc = entries.load_split(tf, "test")
  assert tsrc.category_entries == src.category_entries  # ids, names, frequency
  assert tsrc.image_ids == src.image_ids
  for i in range(len(src)):
    for k, v in src.federated_labels(i).items():
      assert tsrc.federated_labels(i)[k].tolist() == v.tolist()
    # No is_crowd feature in TFDS lvis: the crowd box of image 7 is an ordinary box there.
    assert len(tsrc.targets(i)["labels"]) == len(src.targets(i)["labels"]) + (src.image_ids[i] == 7)
  with_version = tf.split("test").tfds
  assert tfds_source.parse_tfds_name(with_version) == ("own_data_toy", "1.0.0")


def test_check_entry_lists_every_problem(tmp_path, pair):
  _, tf = pair
  bad_cats = [dict(id=1, name="dog"), dict(id=2, name="Dog"), dict(id=3, name=" ")]
  ann, img = write_coco_folder(
    str(tmp_path / "bad"), images=[], annotations=[], categories=bad_cats
  )
  entry = entries.entry_from_config(
    dict(
      name="mine",
      kind="coco",
      train=dict(annotation_file=str(tmp_path / "nope.json"), image_dir=img),
      val=dict(annotation_file=ann, image_dir=str(tmp_path / "no_images")),
    )
  )
  problems = entries.check_entry(entry, required=("train", "test"))
  text = "\n".join(problems)
  assert "dataset 'mine': no 'test' split" in text
  assert (
    f"dataset 'mine' field 'train' 'annotation_file': file not found: '{tmp_path / 'nope.json'}'"
    in text
  )
  assert f"field 'val' 'image_dir': folder not found: '{tmp_path / 'no_images'}'" in text
  assert f"field 'val' 'annotation_file': {ann} has no images" in text
  assert "classes 0 and 1 share the name 'Dog'" in text
  assert "class 2 has an empty name ' '" in text
  assert len(problems) == 6, problems
  # TFDS: unknown split; a tfrecord-only copy gets the ArrayRecord recipe.
  data_dir = tf.split("test").data_dir
  rec = tmp_path / "rec"
  shutil.copytree(os.path.join(data_dir, "own_data_toy"), rec / "own_data_toy")
  info_path = rec / "own_data_toy" / "1.0.0" / "dataset_info.json"
  info = json.loads(info_path.read_text())
  info["fileFormat"] = "tfrecord"
  info_path.write_text(json.dumps(info))
  for f in (rec / "own_data_toy" / "1.0.0").glob("*.array_record-*"):
    f.rename(str(f).replace("array_record", "tfrecord"))
  bad_tf = entries.entry_from_config(
    dict(
      name="t",
      kind="tfds",
      tfds="tfds:own_data_toy",
      data_dir=str(rec),
      train="train",
      test=dict(split="validation", data_dir=data_dir),
    )
  )
  problems = entries.check_entry(bad_tf)
  assert len(problems) == 2, problems
  assert "dataset 't' field 'train'" in problems[0] and "'tfrecord'" in problems[0]
  assert "--file_format=array_record" in problems[0] and "file_format='array_record'" in problems[0]
  assert "dataset 't' field 'test': split 'validation' not in tfds:own_data_toy" in problems[1]
  with pytest.raises(DataError, match="field 'train'.*tfrecord"):
    entries.load_split(bad_tf, "train")
  # An unreadable TFDS folder (corrupt dataset_info.json).
  info_path.write_text("{not json")
  (unreadable,) = entries.check_entry(
    dataclasses.replace(bad_tf, splits=(("train", bad_tf.split("train")),))
  )
  assert (
    "dataset 't' field 'train'" in unreadable and "dataset_info.json is unreadable" in unreadable
  )
  # A missing TFDS folder.
  missing = entries.entry_from_config(
    dict(name="m", kind="tfds", tfds="tfds:nothing_here", data_dir=str(rec), test="test")
  )
  assert "no prepared version" in entries.check_entry(missing)[0]
  # The good pair passes.
  assert entries.check_entry(pair[0]) == [] and entries.check_entry(tf) == []
  # check_entries: one error with every entry's problems and duplicate names.
  with pytest.raises(DataError) as e:
    entries.check_entries([entry, bad_tf, pair[0], tf])
  assert "dataset 'toy': field 'name' is used by two entries" in str(e.value)
  assert "dataset 'mine'" in str(e.value) and "dataset 't'" in str(e.value)


def test_entry_from_config_lists_every_problem():
  with pytest.raises(DataError) as e:
    entries.entry_from_config(
      dict(
        name="x",
        kind="coco",
        evaluation="voc",
        colour="red",
        train=dict(image_dir="i"),
        test="validation",
      )
    )
  msg = str(e.value)
  assert "unknown field 'colour'" in msg
  assert "field 'evaluation' has value 'voc'" in msg
  assert "dataset 'x' field 'train': field 'annotation_file' is missing or empty" in msg
  assert "field 'test': a string ('validation') is a TFDS split name; kind is 'coco'" in msg
  with pytest.raises(DataError, match="field 'data_dir' \\('/d'\\) applies to kind \\('tfds',\\)"):
    entries.entry_from_config(
      dict(name="x", kind="coco", data_dir="/d", test=dict(annotation_file="a", image_dir="i"))
    )
  with pytest.raises(DataError, match="field 'kind' has value 'csv'"):
    entries.entry_from_config(dict(name="x", kind="csv"))
  split = dict(annotation_file="a", image_dir="i")
  for bad in (0, 2.5, "100", True):
    with pytest.raises(DataError, match=f"dataset 'x': field 'max_detections' has value {bad!r}"):
      entries.entry_from_config(dict(name="x", kind="coco", max_detections=bad, test=split))
  # max_detections: the entry's for every kind; unset, None (the config's) or ODinW's registry.
  assert entries.entry_from_config(dict(name="x", kind="coco", test=split)).max_detections is None
  coco = entries.entry_from_config(dict(name="x", kind="coco", max_detections=50, test=split))
  ego = dict(name="e", kind="odinw", member="EgoHands", root="/d")
  assert coco.max_detections == 50 and entries.entry_from_config(ego).max_detections == 100
  assert entries.entry_from_config(dict(ego, max_detections=20)).max_detections == 20
  with pytest.raises(DataError, match="field 'tfds' has value 'coco/2017'"):
    entries.entry_from_config(dict(name="x", kind="tfds", tfds="coco/2017", train="train"))
  tf = entries.entry_from_config(
    ml_collections.ConfigDict(dict(name="c", kind="tfds", tfds="tfds:coco/2017", val={}))
  )
  assert tf.split("val").split == "validation" and tf.split("val").tfds == "tfds:coco/2017"
  with pytest.raises(DataError, match="no split 'train'"):
    tf.split("train")


def test_paper_suite_is_todays_odinw(tmp_path):
  root = str(tmp_path)
  suite = suites.suite_entries("odinw_paper", root)
  assert [e.name for e in suite] == list(odinw.ODINW_NAMES)
  for e in suite:
    spec = odinw.ODINW_DATASETS[e.name]
    assert (e.kind, e.member, e.max_detections, e.subset_size) == (
      "odinw",
      e.name,
      spec.max_detections,
      spec.subset_size,
    )
    assert e.exclude_category_ids == spec.exclude_category_ids
    for split in odinw.SPLITS:
      s = e.split(split)
      assert (s.annotation_file, s.image_dir) == odinw.odinw_paths(root, e.name, split)
  assert [e.name for e in suites.suite_entries("odinw15", root)] == list(odinw.ODINW_NAMES)
  # Loaded: the same images, boxes and labels as odinw_source, balanced subset included.
  names = ["Pothole", "ChessPieces", "EgoHands"]
  fake_data.write_fake_odinw(root, names, num_images={"train": 12, "val": 3, "test": 4}, seed=3)
  picked = suites.entries_from_config([dict(suite="odinw_paper", root=root, names=names)])
  assert [e.name for e in picked] == names
  small = entries.entry_from_config(
    dict(name="EgoHands", kind="odinw", member="EgoHands", root=root, subset_size=5)
  )
  for e, kw in [(p, {}) for p in picked] + [(small, dict(subset_size=5))]:
    assert entries.check_entry(e, required=("train", "val", "test")) == []
    for split in odinw.SPLITS:
      got = entries.load_split(e, split)
      want = odinw.odinw_source(root, e.member, split, **kw)
      assert got.name == want.name and got.image_ids == want.image_ids
      assert got.class_names == want.class_names
      for i in range(len(want)):
        tg, tw = got.targets(i), want.targets(i)
        np.testing.assert_array_equal(tg["boxes"], tw["boxes"])
        np.testing.assert_array_equal(tg["labels"], tw["labels"])
  assert len(entries.load_split(small, "train")) == 5
  # A registry member whose json has other categories is reported (as odinw_source raises).
  ann = odinw.odinw_paths(root, "Pothole", "test")[0]
  with open(ann) as f:
    data = json.load(f)
  data["categories"][0]["name"] = "crater"
  with open(ann, "w") as f:
    json.dump(data, f)
  problem, differ = entries.check_entry(picked[0])
  assert "dataset 'Pothole' field 'test'" in problem and "['crater']" in problem
  assert "expected ['pothole'] for ODinW Pothole" in problem
  assert "field 'test' categories ['crater'] differ from field 'train'" in differ


def test_glip_suites():
  s13 = suites.suite_entries("odinw13", "/d")
  s35 = suites.suite_entries("odinw35", "/d")
  assert len(s13) == 13 and len(s35) == 35
  assert len({e.name for e in s35}) == 35 and {e.name for e in s13} <= {e.name for e in s35}
  by = {e.name: e for e in s35}
  # Hand-checked against GLIP configs/odinw_35/*.yaml DATASETS.REGISTER.
  voc = by["PascalVOC"]
  assert voc.split("test") == voc.split("val")
  assert voc.split("val").annotation_file == (
    "/d/odinw/PascalVOC/valid/annotations_without_background.json"
  )
  pistols = by["pistols_export"].split("train")
  assert (
    pistols.annotation_file == "/d/odinw/pistols/export/train_annotations_without_background.json"
  )
  assert pistols.image_dir == "/d/odinw/pistols/export"
  aq = by["Aquarium_Aquarium_Combined.v2-raw-1024.coco"].split("test")
  assert aq.image_dir == "/d/odinw/Aquarium/Aquarium Combined.v2-raw-1024.coco/test"
  assert by["ChessPieces_Chess_Pieces.v23-raw.coco"].exclude_category_ids == (1,)
  with pytest.raises(DataError, match="unknown value"):
    suites.suite_entries("odinw13", "/d", names=["Pothole"])
  with pytest.raises(DataError, match="field 'suite' has value 'odinw99'"):
    suites.entries_from_config(dict(suite="odinw99", root="/d"))


def test_builtin_suite(tmp_path):
  bench = builtin.ensure_benchmark(
    str(tmp_path),
    seed=1,
    progress=False,
    num_pretrain_train=4,
    num_pretrain_val=2,
    num_held_out_val=2,
    num_downstream_train=3,
    num_downstream_test=2,
    downstream=builtin.DOWNSTREAM_NAMES[:2],
  )
  roles = suites.builtin_entries(bench)
  seq = suites.suite_entries("builtin", benchmark=bench)
  assert (
    [e.name for e in seq] == [e.name for e in roles["sequence"]] == list(bench.downstream_names)
  )
  for e in seq + [roles["pretrain"], roles["held_out"]]:
    assert entries.check_entry(e) == []
    for split in e.split_names:
      got, want = entries.load_split(e, split), bench.source(e.name, split)
      assert got.image_ids == want.image_ids and got.class_names == want.class_names
      for i in range(len(want)):
        np.testing.assert_array_equal(got.targets(i)["boxes"], want.targets(i)["boxes"])
  assert roles["held_out"].split_names == ("val",)


def test_data_scan_decodes_coco_and_tfds_splits_once(pair, tmp_path):
  """The data scan (`owl_cl.data.scan`) reads a TFDS split's pixels through its record
  reader and a COCO folder's from files; a second scan of unchanged data decodes nothing."""
  from owl_cl.data import scan  # pylint: disable=g-import-not-at-top

  splits = [(e.kind, "test", entries.load_split(e, "test")) for e in pair]
  n = len(IMAGES)
  assert scan.scan_splits(splits, str(tmp_path)) == {"scanned": 2 * n, "cached": 0}
  assert scan.scan_splits(splits, str(tmp_path)) == {"scanned": 0, "cached": 2 * n}


def test_data_scan_names_a_truncated_tfds_image(tmp_path, monkeypatch):
  """A record whose PNG is cut short: its header (size) reads, its pixels do not."""
  from owl_cl.data import scan  # pylint: disable=g-import-not-at-top

  good = _png
  monkeypatch.setattr(
    sys.modules[__name__], "_png", lambda i, h, w: good(i, h, w)[:-40] if i == 11 else good(i, h, w)
  )
  data_dir = str(tmp_path / "tfds")
  write_tfds(data_dir, dict(images=IMAGES, annotations=ANNOTATIONS, categories=CATEGORIES))
  tf = entries.entry_from_config(
    dict(name="toy", kind="tfds", tfds="tfds:own_data_toy", data_dir=data_dir, test="train")
  )
  source = entries.load_split(tf, "test")
  with pytest.raises(DataError) as raised:
    scan.scan_splits([("toy", "test", source)], str(tmp_path / "cache"))
  message = str(raised.value)
  assert "the run's data failed the scan (1 problem)" in message
  assert "dataset 'toy' split 'test': tfds:own_data_toy:train" in message
  assert "(image id 11)" in message and "truncated" in message
  folder = tmp_path / "cache" / scan.SCAN_FOLDER
  assert not list(folder.glob("*.json"))  # nothing recorded (the split's lock file aside)

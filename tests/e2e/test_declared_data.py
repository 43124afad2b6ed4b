"""Datasets declared in the config (`data.sequence`, `data.pretrain`, `data.held_out`).

The paper's declaration (`:paper`, `benchmark.PAPER_DECLARATION`) is checked against the
hard-wired reader of the paper's data (`benchmark.load_real_benchmark`) on fake data in the
real layout (`owl_cl.testing.fake_data`): same datasets, image ids, boxes, labels, balanced
subsets, evaluation protocols and results-table roles.
"""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl.config_fields import MissingInputsError
from owl_cl.configs import base
from owl_cl.data import odinw
from owl_cl.testing import fake_data

# Two datasets with balanced training subsets in the paper's protocol, one without.
NAMES = ("EgoHands", "Pothole", "AmericanSignLanguageLetters")


def _sources(d: benchmark.Dataset):
  return {"train": d.train, "test": d.test, "valid": d.valid}


def _assert_same_source(got, want, where):
  if want is None:
    assert got is None, where
    return
  assert got.name == want.name, where
  assert got.image_ids == want.image_ids, where
  assert got.class_names == want.class_names, where
  assert got.image_dir == want.image_dir, where
  for i in range(len(want)):
    tg, tw = got.targets(i), want.targets(i)
    assert set(tg) == set(tw), where
    for k in tw:
      np.testing.assert_array_equal(np.asarray(tg[k]), np.asarray(tw[k]), err_msg=f"{where} {k}")
  assert got.coco.dataset["annotations"] == want.coco.dataset["annotations"], where


@pytest.fixture
def paper_config(tmp_path, monkeypatch):
  root = str(tmp_path / "data")
  fake_data.write_fake_odinw(root, NAMES, num_images=dict(train=12, val=3, test=4), seed=5)
  fake_data.write_fake_objects365(root, num_images=dict(train=8, val=4))
  fake_data.write_fake_lvis(root, num_images=dict(train=2, val=4))
  # Registry subsets small enough for the fake data: the balanced subset is really drawn.
  for name, size in (("EgoHands", 5), ("AmericanSignLanguageLetters", 7)):
    spec = dataclasses.replace(odinw.ODINW_DATASETS[name], subset_size=size)
    monkeypatch.setitem(odinw.ODINW_DATASETS, name, spec)
  c = base.get_config("paper")
  c.data.root = root
  c.data.odinw_datasets = NAMES
  c.data.subset_seed = 3
  c.sequence_seed = 1
  c.model.tokenizer = "word_hash"
  c.init_checkpoint = str(tmp_path / "init")
  os.makedirs(c.init_checkpoint)
  return c


def test_paper_declaration_gives_todays_datasets(paper_config):
  want = benchmark.load_real_benchmark(paper_config)
  got = benchmark.load_benchmark(paper_config)
  assert [d.name for d in got.sequence] == [d.name for d in want.sequence]
  assert sorted(d.name for d in got.sequence) == sorted(NAMES)
  assert (got.pretrain_eval, got.held_out_eval) == ("o365", "lvis")
  assert (got.pretrain_eval, got.held_out_eval) == (want.pretrain_eval, want.held_out_eval)
  assert got.roles == want.roles
  pairs = [(got.pretrain, want.pretrain), (got.held_out, want.held_out)]
  for g, w in pairs + list(zip(got.sequence, want.sequence)):
    assert (g.name, g.evaluation, g.max_detections) == (w.name, w.evaluation, w.max_detections)
    for split, source in _sources(w).items():
      _assert_same_source(_sources(g)[split], source, f"{w.name} {split}")
  # The subsets were drawn (12 train images -> 5 / 7), as the hard-wired reader draws them.
  by_name = {d.name: d for d in got.sequence}
  assert len(by_name["EgoHands"].train) == 5
  assert len(by_name["AmericanSignLanguageLetters"].train) == 7
  assert len(by_name["Pothole"].train) == 12
  # Objects365 train drops the forbidden categories (pretraining.objects365_source).
  assert len(got.pretrain.train.class_names) < len(got.pretrain.test.class_names)


def test_a_data_root_without_declaration_is_the_paper_declaration(paper_config):
  for field in benchmark.DECLARED_FIELDS:
    paper_config.data[field] = None
  decl = benchmark.declaration(paper_config)
  root = paper_config.data.root
  assert decl["pretrain"] == {"name": "o365", "kind": "objects365", "root": root}
  assert decl["held_out"] == {"name": "lvis", "kind": "lvis", "evaluation": "lvis", "root": root}
  assert decl["sequence"] == [
    {"suite": "odinw_paper", "root": root, "names": list(NAMES), "subset_seed": 3}
  ]
  # `data.odinw_datasets` is sugar for the suite's names; explicit names win.
  paper_config.data.sequence = [dict(suite="odinw_paper", names=["Pothole"])]
  assert benchmark.declaration(paper_config)["sequence"][0]["names"] == ["Pothole"]


# ----------------------------------------------------------------------------- validation


def test_declared_datasets_are_checked_before_any_work(tmp_path):
  """Every problem of every declared dataset in one error; the workdir is not created."""
  from owl_cl import experiment
  from owl_cl.testing.configs import tiny_config

  good = tmp_path / "good"
  (good / "images").mkdir(parents=True)
  cats = [dict(id=1, name="cup"), dict(id=2, name="Cup")]  # the same prompt twice
  ann = dict(images=[], annotations=[], categories=cats)  # and no images
  (good / "train.json").write_text(json.dumps(ann))
  (tmp_path / "tfds").mkdir()
  config = tiny_config("swil", str(tmp_path / "cache"))
  config.data.sequence = [
    dict(
      name="kitchen",
      kind="coco",
      train=dict(annotation_file=str(good / "train.json"), image_dir=str(good / "images")),
      test=dict(annotation_file=str(tmp_path / "missing.json"), image_dir=str(good / "images")),
    ),
    dict(name="a", kind="yaml"),
    dict(
      name="shelf",
      kind="tfds",
      tfds="tfds:nothing_here",
      data_dir=str(tmp_path / "tfds"),
      train="train",
      test="test",
    ),
    dict(
      name="kitchen",
      kind="coco",
      train=dict(annotation_file=str(good / "train.json"), image_dir=str(tmp_path / "nope")),
    ),
  ]
  config.data.held_out = dict(
    name="pretrain_val",
    kind="coco",
    val=dict(annotation_file=str(good / "train.json"), image_dir=str(good / "images")),
  )
  workdir = tmp_path / "run"
  with pytest.raises(MissingInputsError) as info:
    experiment.run(config, str(workdir))
  text = str(info.value)
  expected = [
    # kitchen: missing test json, empty train split, name clash between two categories.
    f"config.data.sequence: dataset 'kitchen' field 'test' 'annotation_file': file not found: "
    f"'{tmp_path / 'missing.json'}'",
    f"dataset 'kitchen' field 'train' 'annotation_file': {good / 'train.json'} has no images",
    "classes 0 and 1 share the name 'Cup'",
    "config.data.sequence[1]: dataset 'a': field 'kind' has value 'yaml'",
    # shelf: the TFDS folder holds no such dataset; the splits are missing.
    "dataset 'shelf'",
    "tfds:nothing_here",
    # the second 'kitchen': its name, its image folder and its missing test split.
    "config.data.sequence: dataset 'kitchen': field 'name' is also used by config.data.sequence",
    f"'image_dir': folder not found: '{tmp_path / 'nope'}'",
    "dataset 'kitchen': no 'test' split (declared: ['train'])",
    # held_out takes the built-in pre-training eval set's name.
    "config.data.held_out: dataset 'pretrain_val': field 'name' is also used by the built-in "
    "pretrain set",
  ]
  for e in expected:
    assert e in text, (e, text)
  assert not workdir.exists()
  assert not (tmp_path / "cache").exists()


def test_structural_problems_name_the_field():
  from owl_cl import validation
  from owl_cl.testing.configs import tiny_config

  config = tiny_config("swil", "/nonexistent")
  config.data.sequence = [dict(name="a", kind="yaml"), dict(suite="odinw99")]
  config.data.pretrain = [dict(name="b")]
  problems = validation.dataset_problems(config)
  text = "\n".join(problems)
  assert "config.data.sequence[0]: dataset 'a': field 'kind' has value 'yaml'" in text
  assert "config.data.sequence[1]: field 'suite' has value 'odinw99'" in text
  assert "config.data.pretrain: must be one dataset entry" in text


# ----------------------------------------------------------------------------- max_detections


def _one_box_folder(root) -> dict:
  """A COCO folder: one 32 x 32 image with one 'cup' box [8, 8, 16, 16]; its split spec."""
  from PIL import Image

  (root / "images").mkdir(parents=True)
  Image.new("RGB", (32, 32), (90, 90, 90)).save(root / "images" / "a.png")
  data = dict(
    images=[dict(id=1, file_name="a.png", height=32, width=32)],
    annotations=[dict(id=1, image_id=1, category_id=1, bbox=[8, 8, 16, 16], area=256, iscrowd=0)],
    categories=[dict(id=1, name="cup")],
  )
  (root / "ann.json").write_text(json.dumps(data))
  return dict(annotation_file=str(root / "ann.json"), image_dir=str(root / "images"))


def test_declared_max_detections_reach_the_dataset_and_the_evaluator(tmp_path, monkeypatch):
  """An entry's `max_detections` limits the detections kept and scored, for every kind.

  Hand-worked AP: one ground-truth box; the model's three candidates per image are two false
  positives (scores 0.9, 0.8) and the exact box (0.7). All three scored: the true positive is
  third, precision 1/3 at recall 1, so the interpolated precision is 1/3 at each of the 101
  recall points and every IoU threshold: AP = 1/3. At most two per image: only the false
  positives are left, AP = 0.
  """
  import jax.numpy as jnp

  from owl_cl.detector import Detector
  from owl_cl.testing.configs import tiny_detector_config

  spec = _one_box_folder(tmp_path / "d")
  config = tiny_detector_config()
  config.cache_dir = str(tmp_path / "cache")  # nothing built-in is needed: all declared
  config.data.sequence = [
    dict(name="limited", kind="coco", max_detections=2, train=spec, test=spec),
    dict(name="default", kind="coco", train=spec, test=spec),
  ]
  config.data.pretrain = dict(name="pre", kind="coco", max_detections=7, train=spec, test=spec)
  config.data.held_out = dict(name="held", kind="coco", max_detections=5, val=spec)
  assert config.eval.top_k == config.eval.max_dets == 100
  bench = benchmark.load_benchmark(config)
  by_name = {name: d for name, d in bench.eval_sets()}
  assert {n: d.max_detections for n, d in by_name.items()} == {
    "pre": 7,
    "held": 5,
    "limited": 2,
    "default": None,  # the config's eval.top_k / max_dets
  }
  assert not os.path.exists(config.cache_dir)

  # cxcywh relative to the (unpadded, square) image: two misses, then the box [8, 8, 16, 16].
  candidates = (
    jnp.array([0.9, 0.8, 0.7]),
    jnp.array([0, 0, 0]),
    jnp.array([[0.1, 0.1, 0.1, 0.1], [0.9, 0.9, 0.1, 0.1], [0.5, 0.5, 0.5, 0.5]]),
  )
  top_ks = []

  def fake_predict_step(*, templates, top_k, multi_label):
    del templates, multi_label
    top_ks.append(top_k)

    def predict(params, images, query_embeddings):
      del params, query_embeddings
      batch = images.shape[0]
      # All three whatever top_k is: the scorer's maxDets alone must then drop the third.
      return tuple(jnp.broadcast_to(c, (batch, *c.shape)) for c in candidates)

    return predict

  detector = Detector(config)
  monkeypatch.setattr(detector, "_predict_step", fake_predict_step)
  monkeypatch.setattr(detector, "eval_query_embeddings", lambda params, source: None)
  limited = detector.evaluate_dataset(None, by_name["limited"], "limited")
  default = detector.evaluate_dataset(None, by_name["default"], "default")
  assert top_ks == [2, 100]
  # AP is a mean of 101 * 10 equal precisions (1/3 in float64): exact to rounding.
  assert default["AP"] == pytest.approx(1 / 3, abs=1e-12)
  assert default["AP50"] == pytest.approx(1 / 3, abs=1e-12)
  assert limited["AP"] == 0.0 and limited["AP50"] == 0.0


# ----------------------------------------------------------------------------- GLIP suites

# One member of each GLIP layout: a folder per split, an 'export' folder, PascalVOC (its
# valid folder is also its test split).
GLIP_NAMES = ["pothole", "pistols_export", "PascalVOC"]


def test_odinw13_suite_end_to_end(tmp_path):
  """`data.sequence=[dict(suite='odinw13', ...)]` over a fake tree in GLIP's folder names:
  checked (a missing member folder is named with its paths) and loaded (names, categories,
  image counts). Its members are COCO-format sources like any declared dataset, whose run
  through the loop tests/e2e/test_own_data_run.py covers."""
  from owl_cl import validation
  from owl_cl.testing.configs import tiny_config

  root = str(tmp_path / "data")
  written = fake_data.write_fake_glip(
    root, "odinw13", GLIP_NAMES, num_images=dict(train=8, val=2, test=3), seed=2
  )
  # GLIP's folder names (microsoft/GLIP configs/odinw_13/*.yaml), written out by hand.
  odinw_dir = os.path.join(root, "odinw")
  for rel in (
    "pothole/train/annotations_without_background.json",
    "pothole/test/annotations_without_background.json",
    "pistols/export/train_annotations_without_background.json",
    "pistols/export/val_annotations_without_background.json",
    "PascalVOC/valid/annotations_without_background.json",
  ):
    assert os.path.isfile(os.path.join(odinw_dir, rel)), rel
  assert not os.path.exists(os.path.join(odinw_dir, "PascalVOC", "test"))

  config = tiny_config("swil", str(tmp_path / "cache"))
  config.data.sequence = [dict(suite="odinw13", root=root, names=GLIP_NAMES)]
  assert validation.dataset_problems(config) == []
  bench = benchmark.load_benchmark(config)
  assert sorted(d.name for d in bench.sequence) == sorted(GLIP_NAMES)
  for d in bench.sequence:
    names = fake_data.glip_category_names(d.name)
    assert d.train.class_names == d.test.class_names == d.valid.class_names == names, d.name
    # PascalVOC's test split is its valid folder (2 images); the others have 3 test images.
    num_test = 2 if d.name == "PascalVOC" else 3
    assert (len(d.train), len(d.valid), len(d.test)) == (8, 2, num_test), d.name
    assert d.test.annotation_file == written[d.name]["test"]["annotation_file"]
    assert (d.evaluation, d.max_detections) == ("coco", None)
  by_name = {d.name: d for d in bench.sequence}
  assert by_name["PascalVOC"].test.image_ids == by_name["PascalVOC"].valid.image_ids

  # A missing member folder: one error names the member, its split fields and paths.
  shutil.move(os.path.join(odinw_dir, "pistols"), str(tmp_path / "moved"))
  with pytest.raises(MissingInputsError) as info:
    validation.check_datasets(config)
  text = str(info.value)
  for split in ("train", "val", "test"):
    ann = os.path.join(
      odinw_dir, "pistols", "export", f"{split}_annotations_without_background.json"
    )
    assert (
      f"config.data.sequence: dataset 'pistols_export' field '{split}' 'annotation_file': "
      f"file not found: '{ann}'"
    ) in text
    assert (
      f"dataset 'pistols_export' field '{split}' 'image_dir': folder not found: "
      f"'{os.path.join(odinw_dir, 'pistols', 'export')}'"
    ) in text
  assert "pothole" not in text and "PascalVOC" not in text
  assert text.count("\n  - ") == 6, text
  shutil.move(str(tmp_path / "moved"), os.path.join(odinw_dir, "pistols"))

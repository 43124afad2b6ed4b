"""Built-in benchmark: determinism, caching, exact boxes, split requirements."""

import itertools
import json
import os

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils
import pytest

from owl_cl import integrity
from owl_cl.data import builtin as B
from owl_cl.data.builtin import benchmark as builtin_benchmark
from owl_cl.data.builtin import render
from owl_cl.data.builtin import vocabulary as builtin_vocabulary
from owl_cl.data.coco import CocoSource
from owl_cl.testing.configs import MINIMAL_BUILTIN

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools")

# Every downstream dataset (`BuiltinSpec`'s default sequence is 5 of the 7).
TINY = dict(MINIMAL_BUILTIN, downstream=B.DOWNSTREAM_NAMES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return B.ensure_benchmark(str(tmp_path_factory.mktemp("cache_a")), seed=7, progress=False, **TINY)


def _all_files(root):
  out = {}
  for dirpath, _, files in os.walk(root):
    for f in files:
      out[os.path.relpath(os.path.join(dirpath, f), root)] = os.path.join(dirpath, f)
  return out


def test_deterministic(tiny, tmp_path):
  other = B.ensure_benchmark(str(tmp_path), seed=7, progress=False, **TINY)
  assert os.path.basename(other.root) == os.path.basename(tiny.root)
  fa, fb = _all_files(tiny.root), _all_files(other.root)
  assert set(fa) == set(fb)
  for rel in fa:
    if rel in ("benchmark.json", integrity.MANIFEST_NAME):
      continue  # holds the generation wall time (and the manifest its digest)
    if rel.endswith(".json"):
      with open(fa[rel], "rb") as f1, open(fb[rel], "rb") as f2:
        assert f1.read() == f2.read(), rel
    else:
      np.testing.assert_array_equal(
        np.asarray(Image.open(fa[rel])), np.asarray(Image.open(fb[rel])), err_msg=rel
      )
  # Another seed gives other pixels.
  third = B.ensure_benchmark(str(tmp_path), **_tiny_kwargs(seed=8, downstream=("tiny",)))
  assert third.root != other.root
  a = np.asarray(Image.open(os.path.join(third.root, "pretrain", "images", "train_000000.png")))
  b = np.asarray(Image.open(os.path.join(tiny.root, "pretrain", "images", "train_000000.png")))
  assert a.shape != b.shape or not np.array_equal(a, b)


def _tiny_kwargs(seed: int, downstream: tuple[str, ...]) -> dict:
  """`ensure_benchmark`'s keywords for the smallest benchmark: 2 + 1 pre-training images, one
  held-out and one train / test image per downstream dataset, no progress bar."""
  return dict(
    seed=seed,
    progress=False,
    num_pretrain_train=2,
    num_pretrain_val=1,
    num_held_out_val=1,
    num_downstream_train=1,
    num_downstream_test=1,
    downstream=downstream,
  )


def test_cache_reused_and_incomplete_regenerated(tmp_path):
  kw = _tiny_kwargs(seed=1, downstream=("digits",))
  bm = B.ensure_benchmark(str(tmp_path), **kw)
  marker = os.path.join(bm.root, "benchmark.json")
  mtime = os.stat(marker).st_mtime_ns
  bm2 = B.ensure_benchmark(str(tmp_path), **kw)
  assert os.stat(marker).st_mtime_ns == mtime and bm2.counts == bm.counts
  # A missing image makes the cache incomplete: regenerated, not trusted; the damaged folder
  # set aside.
  os.remove(os.path.join(bm.root, "digits", "images", "train_000000.png"))
  bm3 = B.ensure_benchmark(str(tmp_path), **kw)
  assert os.path.isfile(os.path.join(bm3.root, "digits", "images", "train_000000.png"))
  assert len([d for d in os.listdir(tmp_path) if ".corrupt-" in d]) == 1
  # No temporary folders are left behind.
  assert [d for d in os.listdir(tmp_path) if d.startswith(".")] == []
  with pytest.raises(ValueError, match="unknown downstream"):
    B.ensure_benchmark(str(tmp_path), downstream=("nope",), progress=False)


def test_failed_generation_leaves_no_cache(tmp_path, monkeypatch):
  calls = []

  def boom(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("interrupted")
    return real(*args, **kwargs)

  real = builtin_benchmark._write_split
  monkeypatch.setattr(builtin_benchmark, "_write_split", boom)
  kw = dict(
    seed=2,
    progress=False,
    num_pretrain_train=1,
    num_pretrain_val=1,
    num_held_out_val=1,
    num_downstream_train=1,
    num_downstream_test=1,
    downstream=("tiny",),
  )
  with pytest.raises(RuntimeError, match="interrupted"):
    B.ensure_benchmark(str(tmp_path), **kw)
  assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == []
  monkeypatch.setattr(builtin_benchmark, "_write_split", real)
  bm = B.ensure_benchmark(str(tmp_path), **kw)
  assert bm.counts["tiny/test"]["images"] == 1


def test_boxes_exact_and_inside(tiny):
  for (ds, sp), files in tiny.splits.items():
    with open(files.annotation_file) as f:
      data = json.load(f)
    ims = {im["id"]: im for im in data["images"]}
    per_image = {}
    for a in data["annotations"]:
      im = ims[a["image_id"]]
      x, y, w, h = a["bbox"]
      assert 0 <= x and 0 <= y and x + w <= im["width"] and y + h <= im["height"]
      m = mask_utils.decode(
        dict(size=a["segmentation"]["size"], counts=a["segmentation"]["counts"].encode())
      )
      assert m.shape == (im["height"], im["width"]) and a["area"] == int(m.sum()) > 0
      ys, xs = np.nonzero(m)
      assert [xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()] == [x, y, w, h]
      per_image.setdefault(a["image_id"], []).append((a, m))
    for im_id, objs in per_image.items():
      assert 1 <= len(objs) <= 4, (ds, sp, im_id)
      for (a, ma), (b, mb) in itertools.combinations(objs, 2):
        assert not (ma & mb).any()
        assert mask_utils.iou([a["bbox"]], [b["bbox"]], [0])[0, 0] < 0.3
    assert set(per_image) == set(ims), (ds, sp)  # every image has an object


def test_object_pixels_carry_the_class_appearance(tiny):
  """Pixels under a pre-training object's mask show its class: the dominant palette colour
  is the class colour; 'plain' objects have (almost) no pattern ink, patterned ones do."""
  src = tiny.source("pretrain", "train")
  names = list(B.PRETRAIN_COLORS)
  palette = np.array([B.COLORS[c] for c in names] + [(247, 247, 242), (25, 25, 30)], np.float32)
  n = 0
  for i in range(len(src)):
    ex = src.load(i)
    anns = src.coco.loadAnns(src.coco.getAnnIds(imgIds=[ex["image_id"]]))
    for a in anns:
      m = mask_utils.decode(
        dict(size=a["segmentation"]["size"], counts=a["segmentation"]["counts"].encode())
      ).astype(bool)
      pix = ex["image"][m].astype(np.float32)
      nearest = np.argmin(((pix[:, None] - palette[None]) ** 2).sum(-1), axis=1)
      counts = np.bincount(nearest, minlength=len(palette))
      colour, pattern = src.coco.cats[a["category_id"]]["name"].split()
      assert names[int(np.argmax(counts[: len(names)]))] == colour, (i, colour, counts)
      ink = (
        counts[-2]
        if render._lum(np.array(B.COLORS[colour], np.float32) / 255) < 0.6
        else counts[-1]
      ) / len(pix)
      if pattern == "plain":
        assert ink < 0.05, (i, colour, pattern, ink)
      else:
        assert ink > 0.15, (i, colour, pattern, ink)
      n += 1
  assert n >= 10


def test_read_through_coco_source(tiny):
  for ds, sp in tiny.splits:
    src = tiny.source(ds, sp)
    assert isinstance(src, CocoSource) and len(src) == tiny.counts[f"{ds}/{sp}"]["images"]
    assert src.class_names == list(tiny.classes[ds])
    ex = src.load(0)
    assert ex["image"].dtype == np.uint8 and ex["image"].ndim == 3
    assert 96 <= max(ex["image"].shape[:2]) <= 128 and min(ex["image"].shape[:2]) >= 48
    assert len(ex["labels"]) >= 1


def test_every_split_decodes_each_image_once(tiny, monkeypatch):
  # The run's sources (`owl_cl.benchmark` reads the splits' `SplitFiles.source`) and the
  # benchmark's own `source` keep decoded images in memory: a second load of an image returns
  # the first's pixels without decoding again (pre-training reads each image ~10 times).
  decoded = []
  real = CocoSource.decode_image
  monkeypatch.setattr(
    CocoSource, "decode_image", lambda self, i: decoded.append(i) or real(self, i)
  )
  for split_files in (tiny.pretrain_train, tiny.downstream[0].train):
    src = split_files.source()
    first, again = src.load(1), src.load(1)
    assert again["image"] is first["image"] and not first["image"].flags.writeable
  src = tiny.source("pretrain", "val")
  assert src.load(0)["image"] is src.load(0)["image"]
  assert decoded == [1, 1, 0]
  uncached = tiny.pretrain_train.source(cache_images=False)
  uncached.load(1), uncached.load(1)
  assert decoded == [1, 1, 0, 1, 1]


def test_accessors(tiny):
  assert tiny.pretrain_train == tiny.split("pretrain", "train")
  assert tiny.pretrain_train.name == "pretrain/train"
  assert tiny.held_out_val.source().name == "held_out/val"
  assert [d.name for d in tiny.downstream] == list(B.DOWNSTREAM_NAMES)
  assert tiny.downstream[0].test == tiny.split(B.DOWNSTREAM_NAMES[0], "test")
  assert tiny.fingerprint.startswith(f"builtin_v{B.FORMAT_VERSION}_")
  assert tiny.pretrain_classes == tuple(B.pretrain_class_names())
  with pytest.raises(KeyError, match="available"):
    tiny.split("pretrain", "test")


def test_held_out_never_in_pretraining(tiny):
  held = set(B.held_out_class_names())
  for sp in ("train", "val"):
    with open(tiny.split("pretrain", sp).annotation_file) as f:
      names = {c["name"] for c in json.load(f)["categories"]}
    assert not names & held
  with open(tiny.split("held_out", "val").annotation_file) as f:
    data = json.load(f)
  assert {c["name"] for c in data["categories"]} == held
  assert len(data["annotations"]) > 0
  # Compositional: every held-out word occurs in pre-training class names.
  pre_words = {w for n in B.pretrain_class_names() for w in n.split()}
  assert all(w in pre_words for n in held for w in n.split())
  # Distractors (clutter) are pre-training classes only.
  assert not {f"{c} {p}" for c, p in builtin_vocabulary.PRETRAIN_PAIRS} & held


def test_requirements_at_default_sizes():
  cfg = B.BuiltinSpec()
  splits = {(d, s): (dom, n) for d, s, dom, n in cfg.splits()}
  pre_dom, n_pre = splits[("pretrain", "train")]
  assert len(pre_dom.classes) >= 20 and n_pre >= 1000
  assert splits[("pretrain", "val")][1] >= 150
  assert splits[("held_out", "val")][1] >= 100
  downstream = [d for d in cfg.downstream]
  assert len(downstream) >= 5
  all_names = [n for n, _ in pre_dom.classes] + [
    n for n, _ in splits[("held_out", "val")][0].classes
  ]
  for d in downstream:
    dom, n_train = splits[(d, "train")]
    assert 1 <= len(dom.classes) <= 6 and 100 <= n_train <= 400
    assert splits[(d, "test")][1] >= 50
    all_names += [n for n, _ in dom.classes]
    # Objects not too small at a 64 px input (scale-shift dataset may go to ~8 px).
    assert dom.size_frac[0] * 64 >= (8.5 if d == "tiny" else 12.5)
    assert dom.n_objects[0] >= 1 and dom.n_objects[1] <= 4
  assert len(all_names) == len(set(all_names))  # new class names per dataset
  total = sum(n for _, n in splits.values())
  assert total == 4000 + 200 + 100 + len(downstream) * 260


def test_object_sizes_after_resize(tiny):
  for (ds, _sp), files in tiny.splits.items():
    with open(files.annotation_file) as f:
      data = json.load(f)
    ims = {im["id"]: im for im in data["images"]}
    for a in data["annotations"]:
      im = ims[a["image_id"]]
      long_side = max(a["bbox"][2:]) * 64 / max(im["height"], im["width"])
      assert long_side >= (8.0 if ds == "tiny" else 11.0), (ds, a)


def test_describe_and_preview(tiny, tmp_path):
  text = tiny.describe()
  for ds in ["pretrain", "held_out"] + list(B.DOWNSTREAM_NAMES):
    assert f"| {ds} |" in text
  assert "red plain" in text and "train 10 /" in text
  p = B.render_preview(tiny, str(tmp_path / "grid.png"), per_dataset=2)
  assert Image.open(p).size[0] > 100


@pytest.mark.parametrize("damage", ["flip", "delete_manifest"])
def test_damaged_cache_is_set_aside_and_regenerated(tmp_path, caplog, damage):
  kw = _tiny_kwargs(seed=4, downstream=("digits",))
  bm = B.ensure_benchmark(str(tmp_path), **kw)
  assert integrity.has_manifest(bm.root)
  files = _all_files(bm.root)
  png = files[os.path.join("digits", "images", "train_000000.png")]
  with open(png, "rb") as f:
    original = f.read()
  if damage == "flip":  # 256 bytes in the PNG's data, size and mtime kept
    stat = os.stat(png)
    data = bytearray(original)
    middle = len(data) // 2
    data[middle - 128 : middle + 128] = bytes(b ^ 0xFF for b in data[middle - 128 : middle + 128])
    with open(png, "wb") as f:
      f.write(bytes(data))
    os.utime(png, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  else:  # as a generation of an earlier version: no manifest
    os.remove(os.path.join(bm.root, integrity.MANIFEST_NAME))
  with caplog.at_level("INFO"):
    again = B.ensure_benchmark(str(tmp_path), **kw)
  with open(png, "rb") as f:
    assert f.read() == original  # regenerated byte for byte
  assert integrity.has_manifest(again.root)
  aside = [d for d in os.listdir(tmp_path) if ".corrupt-" in d]
  if damage == "flip":
    assert f"{png}: SHA-256 differs" in caplog.text and len(aside) == 1
  else:
    assert "predates checksums" in caplog.text and aside == []

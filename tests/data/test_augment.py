"""Pipeline options for real data: negatives by frequency / annotated, IoU merge, flip, crop,
mosaics, squash-resize, worker processes, host sharding."""

import numpy as np
import pytest

from owl_cl.data import image_ops
from owl_cl.data import input_pipeline
from owl_cl.data import label_ops
from owl_cl.data import odinw
from owl_cl.data.spec import ExampleSpec
from owl_cl.testing import fake_data

L = 16


def tokens(num_classes):
  t = np.zeros((num_classes, L), np.int32)
  t[:, 0], t[:, 1], t[:, 2] = 49406, 1000 + np.arange(num_classes), 49407
  e = np.zeros((L,), np.int32)
  e[:2] = 49406, 49407
  return t, e


def example(h=100, w=100, boxes=(), labels=(), image_id=1):
  rng = np.random.default_rng(0)
  return dict(
    image=rng.integers(0, 256, (h, w, 3)).astype(np.uint8),
    boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
    labels=np.asarray(labels, np.int32),
    image_id=image_id,
  )


# ---------------------------------------------------------------------------------- negatives
def test_negatives_follow_label_frequency():
  # Candidates 1..4 (0 is positive), weights 1:2:3:4 -> one negative drawn ~ 0.1/.2/.3/.4.
  weights = np.array([50.0, 1, 2, 3, 4])
  n = 4000
  counts = np.zeros(5)
  rng = np.random.default_rng(0)
  for _ in range(n):
    qc = label_ops.sample_queries(
      [0], [0], 5, num_queries=3, num_negatives=1, rng=rng, negative_weights=weights
    )
    assert qc[1] == 0
    counts[qc[2]] += 1
  p = np.array([0, 0.1, 0.2, 0.3, 0.4])
  sigma = np.sqrt(n * p * (1 - p))
  assert counts[0] == 0
  assert np.all(np.abs(counts - n * p) <= 4 * sigma + 1e-9), counts
  # Zero-weight classes are never drawn, even when fewer negatives than requested result.
  qc = label_ops.sample_queries(
    [], [], 4, 8, 5, np.random.default_rng(1), negative_weights=np.array([0, 1.0, 0, 2.0])
  )
  assert sorted(qc[qc >= 0].tolist()) == [1, 3]


def test_class_frequencies_count_images(tmp_path):
  src = [
    dict(labels=np.array([0, 0, 2])),
    dict(labels=np.array([2])),
    dict(labels=np.array([], np.int32)),
  ]
  np.testing.assert_array_equal(label_ops.class_frequencies(src), [1, 0, 2])
  root = str(tmp_path)
  fake_data.write_fake_odinw(root, ["Dice"], num_images=5)
  dice = odinw.odinw_source(root, "Dice", "train")
  want = np.zeros(6)
  for i in range(len(dice)):
    want[np.unique(dice.targets(i)["labels"])] += 1
  np.testing.assert_array_equal(label_ops.class_frequencies(dice), want)


def test_annotated_negatives_come_first():
  rng = np.random.default_rng(0)
  # Positive 1, present-but-cut 2; annotated negatives 5, 6, 2 (2 is present: ignored), 1.
  qc = label_ops.sample_queries(
    [1], [1, 2], 10, num_queries=8, num_negatives=4, rng=rng, annotated_negatives=[5, 6, 2, 1]
  )
  assert qc[0] == -1 and qc[1] == 1
  assert sorted(qc[2:4].tolist()) == [5, 6]
  rest = qc[4:6].tolist()
  assert len(set(rest)) == 2 and not set(rest) & {1, 2, 5, 6} and (qc[6:] == -1).all()
  # Budget smaller than the annotated list: only annotated negatives.
  qc = label_ops.sample_queries(
    [1],
    [1],
    10,
    num_queries=4,
    num_negatives=2,
    rng=np.random.default_rng(0),
    annotated_negatives=[7, 8, 9],
  )
  assert set(qc[2:4].tolist()) <= {7, 8, 9} and len(set(qc[2:4].tolist())) == 2
  # preprocess_train_example takes them from the example (LVIS 'negative_labels').
  t, e = tokens(10)
  ex = dict(example(boxes=[[0, 0, 10, 10]], labels=[3]), negative_labels=np.array([8, 9]))
  out = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(
      class_tokens=t, empty_tokens=e, image_size=32, num_queries=6, max_instances=2, num_negatives=3
    ),
    rng=np.random.default_rng(0),
  )
  assert out["query_class"][1] == 3 and sorted(out["query_class"][2:4]) == [8, 9]
  off = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(
      class_tokens=t, empty_tokens=e, image_size=32, num_queries=6, max_instances=2, num_negatives=3
    ),
    rng=np.random.default_rng(0),
    annotated_negatives=False,
  )
  plain = input_pipeline.preprocess_train_example(
    example(boxes=[[0, 0, 10, 10]], labels=[3]),
    ExampleSpec(
      class_tokens=t, empty_tokens=e, image_size=32, num_queries=6, max_instances=2, num_negatives=3
    ),
    rng=np.random.default_rng(0),
  )
  np.testing.assert_array_equal(off["query_class"], plain["query_class"])


# ---------------------------------------------------------------------------------- IoU merge
def test_iou_merge_hand_worked():
  # A = [0,0,10,10] (area 100). B = [0,0,10,9]: IoU 90/100 = 0.9 -> merged with A.
  # C = [0,0,10,8.9]: IoU with A = 0.89 -> separate. D = [50,50,60,60] same class as A,
  # disjoint -> separate. E = D exactly (same class) -> merged into D.
  boxes = [[0, 0, 10, 10], [0, 0, 10, 9], [0, 0, 10, 8.9], [50, 50, 60, 60], [50, 50, 60, 60]]
  labels = [1, 2, 3, 1, 1]
  merged, merged_labels = label_ops.merge_duplicate_instances(boxes, labels, 0.9)
  np.testing.assert_array_equal(
    merged, np.float32([[0, 0, 10, 10], [0, 0, 10, 8.9], [50, 50, 60, 60]])
  )
  assert merged_labels == [[1, 2], [3], [1]]
  t, e = tokens(5)
  out = input_pipeline.preprocess_train_example(
    example(boxes=boxes, labels=labels),
    ExampleSpec(
      class_tokens=t,
      empty_tokens=e,
      image_size=100,
      num_queries=5,
      max_instances=4,
      num_negatives=0,
    ),
    rng=np.random.default_rng(0),
  )
  col = {int(c): j for j, c in enumerate(out["query_class"]) if c >= 0}
  assert out["labels"][0, [col[1], col[2]]].tolist() == [1, 1]
  assert out["labels"][0].sum() == 2 and out["labels"][1, col[3]] == 1
  assert out["labels"][3, 0] == 1  # 3 instances, one padding row
  np.testing.assert_allclose(out["boxes"][0], [0.05, 0.05, 0.1, 0.1])


# ---------------------------------------------------------------------------------- flip
def test_hflip_maps_boxes_exactly():
  ex = example(h=20, w=30, boxes=[[2, 3, 12, 8], [0, 0, 30, 20]], labels=[0, 1])
  f = image_ops.hflip_example(ex)
  np.testing.assert_array_equal(f["boxes"], [[18, 3, 28, 8], [0, 0, 30, 20]])
  np.testing.assert_array_equal(f["image"][:, 0], ex["image"][:, 29])
  ff = image_ops.hflip_example(f)
  np.testing.assert_array_equal(ff["image"], ex["image"])
  np.testing.assert_array_equal(ff["boxes"], ex["boxes"])
  # The pixels under a box move with it.
  np.testing.assert_array_equal(f["image"][3:8, 18:28], ex["image"][3:8, 2:12][:, ::-1])


# ---------------------------------------------------------------------------------- crop
def test_crop_drops_boxes_hand_worked():
  ex = example(
    boxes=[[0, 0, 50, 50], [0, 60, 40, 100], [30, 30, 60, 60], [0, 0, 10, 10]], labels=[0, 1, 2, 3]
  )
  # Window x in [20, 100), y in [0, 100).
  c = image_ops.crop_example(ex, top=0, left=20, height=100, width=80, min_area_fraction=0.6)
  # Box 0 keeps [20,50]x[0,50]: 1500 / 2500 = 0.6 -> kept as [0, 0, 30, 50].
  # Box 1 keeps [20,40]x[60,100]: 800 / 1600 = 0.5 -> dropped.
  # Box 2 inside -> [10, 30, 40, 60]. Box 3 entirely outside -> dropped.
  np.testing.assert_array_equal(c["boxes"], [[0, 0, 30, 50], [10, 30, 40, 60]])
  np.testing.assert_array_equal(c["labels"], [0, 2])
  np.testing.assert_array_equal(c["excluded_labels"], [1, 3])
  np.testing.assert_array_equal(c["image"], ex["image"][:, 20:])
  # Dropped classes are never negatives.
  t, e = tokens(6)
  out = input_pipeline.preprocess_train_example(
    c,
    ExampleSpec(
      class_tokens=t, empty_tokens=e, image_size=32, num_queries=6, max_instances=4, num_negatives=4
    ),
    rng=np.random.default_rng(0),
  )
  assert sorted(out["query_class"][out["query_class"] >= 0].tolist()) == [0, 2, 4, 5]


def test_random_crop_invariants():
  rng = np.random.default_rng(0)
  ex = example(
    h=60, w=90, boxes=[[5, 5, 40, 30], [50, 20, 88, 58], [10, 35, 30, 55]], labels=[0, 1, 2]
  )
  areas = (ex["boxes"][:, 2] - ex["boxes"][:, 0]) * (ex["boxes"][:, 3] - ex["boxes"][:, 1])
  for _ in range(200):
    top, left, h, w = image_ops.sample_crop_region(60, 90, rng)
    full = (top, left, h, w) == (0, 0, 60, 90)
    assert full or (0.3 * 5400 - 90 <= h * w <= 5400 and 0.7 <= w / h <= 1.4)
    assert 0 <= top and top + h <= 60 and 0 <= left and left + w <= 90
    c = image_ops.crop_example(ex, top, left, h, w)
    b = c["boxes"]
    assert c["image"].shape == (h, w, 3)
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all()
    assert (b[:, 2] <= w).all() and (b[:, 3] <= h).all()
    kept_area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    assert (kept_area >= 0.6 * areas[c["labels"]] - 1e-4).all()
    assert len(c["labels"]) + len(c["excluded_labels"]) == 3


# ---------------------------------------------------------------------------------- mosaic
def test_mosaic_places_tiles_exactly():
  exs = [
    example(h=40, w=20, boxes=[[2, 4, 10, 20]], labels=[0], image_id=10),
    example(h=30, w=60, boxes=[[0, 0, 60, 30], [30, 15, 45, 30]], labels=[1, 2], image_id=11),
    example(h=16, w=16, boxes=[], labels=[], image_id=12),
    example(h=50, w=50, boxes=[[25, 0, 50, 25]], labels=[3], image_id=13),
  ]
  exs[3]["negative_labels"] = np.array([0, 4, 5])
  m = image_ops.build_mosaic(exs, 2, 40)
  # Tile side 20. Tile 0 (row 0, col 0): scale 20/40 -> [1, 2, 5, 10].
  # Tile 1 (row 0, col 1): scale 20/60, offset x 20 -> [20, 0, 40, 10], [30, 5, 35, 10].
  # Tile 3 (row 1, col 1): scale 20/50 = 0.4, offset (20, 20) -> [30, 20, 40, 30].
  np.testing.assert_allclose(
    m["boxes"], [[1, 2, 5, 10], [20, 0, 40, 10], [30, 5, 35, 10], [30, 20, 40, 30]], atol=1e-5
  )
  np.testing.assert_array_equal(m["labels"], [0, 1, 2, 3])
  assert m["image"].shape == (40, 40, 3) and m["image_id"] == 10
  np.testing.assert_array_equal(
    m["image"][20:40, 0:20], image_ops.resize_with_pad(exs[2]["image"], 20, 0.5)
  )
  np.testing.assert_array_equal(
    m["image"][0:20, 20:40], image_ops.resize_with_pad(exs[1]["image"], 20, 0.5)
  )
  np.testing.assert_array_equal(m["negative_labels"], [4, 5])  # 0 is present in tile 0
  with pytest.raises(ValueError, match="divisible"):
    image_ops.build_mosaic(exs[:1] * 9, 3, 40)
  # Randomly augmented 3x3 mosaics keep every box inside the image, with positive area.
  rng = np.random.default_rng(1)
  for _ in range(20):
    m = image_ops.build_mosaic(
      [exs[i % 4] for i in range(9)], 3, 48, rng, hflip=True, random_crop=True
    )
    b = m["boxes"]
    assert ((b >= 0) & (b <= 48)).all() and (b[:, 2] > b[:, 0]).all()
    assert len(b) == len(m["labels"])


def test_mosaic_size_distribution():
  rng = np.random.default_rng(0)
  ks = np.array([image_ops.sample_mosaic_size(rng) for _ in range(3000)])
  freq = np.array([(ks == k).mean() for k in (1, 2, 3)])
  assert np.abs(freq - [0.4, 0.3, 0.3]).max() < 0.04, freq
  with pytest.raises(ValueError):
    image_ops.sample_mosaic_size(rng, (1, 2), (0.5, 0.6))


# ---------------------------------------------------------------------------------- squash
def test_squash_resize_scales_boxes_per_axis():
  t, e = tokens(3)
  ex = example(h=50, w=100, boxes=[[10, 5, 60, 45]], labels=[1])
  out = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(
      class_tokens=t, empty_tokens=e, image_size=64, num_queries=3, max_instances=2, num_negatives=0
    ),
    rng=np.random.default_rng(0),
    squash=True,
  )
  # sx = 0.64, sy = 1.28: [6.4, 6.4, 38.4, 57.6] -> cxcywh [22.4, 32, 32, 51.2] / 64.
  np.testing.assert_allclose(out["boxes"][0], np.array([22.4, 32, 32, 51.2]) / 64, rtol=1e-5)
  assert out["images"].shape == (64, 64, 3)
  assert not np.any(out["images"] == 0.5)  # no padding (random content: never exactly 0.5)
  ref = (
    np.asarray(
      __import__("PIL.Image", fromlist=["Image"]).fromarray(ex["image"]).resize((64, 64), 2),
      np.float32,
    )
    / 255
  )  # PIL bilinear, 64 x 64
  np.testing.assert_allclose(out["images"], ref, atol=1e-6)


# ---------------------------------------------------------------------------------- datasets
@pytest.fixture(scope="module")
def dice(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("odinw"))
  fake_data.write_fake_odinw(root, ["Dice"], num_images={"train": 9, "val": 1, "test": 1})
  return odinw.odinw_source(root, "Dice", "train")


SIZES = dict(image_size=48, num_queries=8, max_instances=6, num_negatives=4)
AUG = dict(
  batch_size=4,
  hflip=True,
  random_crop=True,
  mosaic_sizes=image_ops.MOSAIC_SIZES,
  mosaic_probs=image_ops.MOSAIC_PROBS,
)


@pytest.mark.slow
def test_workers_give_the_same_batches(dice):
  t, e = tokens(dice.num_classes)
  spec = ExampleSpec(class_tokens=t, empty_tokens=e, **SIZES)
  kw = dict(seed=4, epoch=1, negative_weights=label_ops.class_frequencies(dice), **AUG)
  a = list(input_pipeline.train_dataset(dice, spec, num_workers=0, **kw))
  b = list(input_pipeline.train_dataset(dice, spec, num_workers=2, **kw))
  assert len(a) == len(b) == 2
  for x, y in zip(a, b):
    assert set(x) == set(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  boxes = np.concatenate([x["boxes"] for x in a])
  real = np.concatenate([x["labels"][..., 0] == 0 for x in a])
  cx, cy, w, h = np.moveaxis(boxes[real], -1, 0)
  assert (w > 0).all() and (h > 0).all()
  assert (cx - w / 2 >= -1e-6).all() and (cx + w / 2 <= 1 + 1e-6).all()
  assert (cy - h / 2 >= -1e-6).all() and (cy + h / 2 <= 1 + 1e-6).all()
  # Evaluation: same batches, the padding examples only at the end (9 images, B = 4).
  ev0 = list(input_pipeline.eval_dataset(dice, image_size=32, batch_size=4, num_workers=0))
  ev2 = list(input_pipeline.eval_dataset(dice, image_size=32, batch_size=4, num_workers=2))
  assert len(ev0) == len(ev2) == 3
  for x, y in zip(ev0, ev2):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert np.concatenate([x["image_id"] for x in ev2]).tolist() == dice.image_ids + [-1] * 3


def test_host_sharding_is_disjoint(dice):
  t, e = tokens(dice.num_classes)
  spec = ExampleSpec(
    class_tokens=t, empty_tokens=e, image_size=32, num_queries=8, max_instances=6, num_negatives=2
  )
  kw = dict(seed=0, epoch=0)
  full = input_pipeline.train_map_dataset(dice, spec, **kw)
  parts = [input_pipeline.train_map_dataset(dice, spec, shard=(i, 3), **kw) for i in range(3)]
  ids = [[int(p[j]["image_id"]) for j in range(len(p))] for p in parts]
  assert [len(x) for x in ids] == [3, 3, 3]
  assert sorted(sum(ids, [])) == sorted(dice.image_ids)
  all_ids = [int(full[j]["image_id"]) for j in range(len(full))]
  assert ids[1] == all_ids[1::3]  # host i takes positions i, i + 3, ... of the global order
  two = [input_pipeline.train_map_dataset(dice, spec, shard=(i, 2), **kw) for i in range(2)]
  got = [{int(p[j]["image_id"]) for j in range(len(p))} for p in two]
  assert len(got[0]) == len(got[1]) == 4 and not got[0] & got[1]  # remainder dropped
  # 'jax' in a single process: one shard of one, i.e. everything.
  jax_ids = [
    int(x)
    for b in input_pipeline.train_dataset(dice, spec, shard="jax", batch_size=3, **kw)
    for x in b["image_id"]
  ]
  assert jax_ids == all_ids
  with pytest.raises(ValueError):
    input_pipeline.train_map_dataset(dice, spec, shard=(3, 3), **kw)

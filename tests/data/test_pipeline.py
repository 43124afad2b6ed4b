"""pipeline: resize-with-pad geometry, query/label construction, batched datasets."""

import numpy as np
from owl_data_helpers import write_coco
from PIL import Image
import pytest

from owl_cl.data import image_ops
from owl_cl.data import input_pipeline
from owl_cl.data.coco import CocoSource
from owl_cl.data.spec import ExampleSpec
from owl_cl.replay import build as build_lib

L = 16
C = 10


def fake_tokens(num_classes=C, prompts=None):
  """class c -> [SOT, 1000 + c (+ 100 * prompt), EOT, 0...]; '' -> [SOT, EOT, 0...]."""
  if prompts is None:
    t = np.zeros((num_classes, L), np.int32)
    t[:, 0], t[:, 1], t[:, 2] = 49406, 1000 + np.arange(num_classes), 49407
  else:
    t = np.zeros((num_classes, prompts, L), np.int32)
    t[..., 0], t[..., 2] = 49406, 49407
    t[..., 1] = 1000 + np.arange(num_classes)[:, None] + 100 * np.arange(prompts)[None]
  e = np.zeros((L,), np.int32)
  e[:2] = 49406, 49407
  return t, e


def make_example(
  h=50, w=100, boxes=((10, 5, 60, 45), (70, 10, 90, 30)), labels=(3, 7), image_id=11, value=200
):
  img = np.full((h, w, 3), value, np.uint8)
  return dict(
    image=img,
    boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
    labels=np.asarray(labels, np.int32),
    image_id=image_id,
  )


KW = dict(image_size=64, num_queries=8, max_instances=4, num_negatives=3)


# ---------------------------------------------------------------------------------- geometry
def test_resize_geometry_hand_computed():
  assert image_ops.resize_geometry(50, 100, 64) == (32, 64, 0.64, 0.64)
  assert image_ops.resize_geometry(100, 40, 64) == (64, 26, 0.64, 0.64)  # 25.6 -> 26
  assert image_ops.resize_geometry(64, 64, 64) == (64, 64, 1.0, 1.0)
  assert image_ops.resize_geometry(50, 100, 64, squash=True) == (64, 64, 1.28, 0.64)
  with pytest.raises(ValueError):
    image_ops.resize_geometry(0, 10, 64)


def test_resize_with_pad_values():
  img = np.zeros((50, 100, 3), np.uint8)
  img[..., 0] = 255
  img[..., 1] = 51
  out = image_ops.resize_with_pad(img, 64, 0.5)
  assert out.shape == (64, 64, 3) and out.dtype == np.float32
  np.testing.assert_allclose(out[:32, :, 0], 1.0, atol=1e-6)  # content, long side = 64
  np.testing.assert_allclose(out[:32, :, 1], 0.2, atol=1e-6)
  np.testing.assert_allclose(out[32:], 0.5)  # bottom padding
  out0 = image_ops.resize_with_pad(img, 64, 0.0)
  np.testing.assert_allclose(out0[32:], 0.0)
  # Portrait: pad on the right.
  out = image_ops.resize_with_pad(np.full((100, 40, 3), 255, np.uint8), 64, 0.5)
  np.testing.assert_allclose(out[:, :26], 1.0, atol=1e-6)
  np.testing.assert_allclose(out[:, 26:], 0.5)
  # Squash: no padding at all.
  out = image_ops.resize_with_pad(img, 64, 0.5, squash=True)
  np.testing.assert_allclose(out[..., 0], 1.0, atol=1e-6)
  # Same size: exact copy / 255.
  rnd = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
  np.testing.assert_allclose(image_ops.resize_with_pad(rnd, 64, 0.5), rnd / 255.0, atol=1e-6)


def test_resize_bilinear_and_float_input():
  # A horizontal ramp stays a monotone ramp; float input matches uint8 input.
  ramp = np.tile(np.linspace(0, 255, 128).astype(np.uint8)[None, :, None], (32, 1, 3))
  out = image_ops.resize_with_pad(ramp, 64, 0.5)
  row = out[0, :, 0]
  assert np.all(np.diff(row) > 0) and out[:16].std(axis=0).max() < 1e-6
  np.testing.assert_allclose(out[16:], 0.5)
  outf = image_ops.resize_with_pad(ramp.astype(np.float32) / 255, 64, 0.5)
  np.testing.assert_allclose(outf, out, atol=2.5 / 255)


def test_scale_boxes_hand_computed():
  b = image_ops.scale_boxes(np.array([[10, 5, 60, 45]]), 50, 100, 64)
  np.testing.assert_allclose(b, [[6.4, 3.2, 38.4, 28.8]], rtol=1e-6)
  b = image_ops.scale_boxes(np.array([[10, 5, 60, 45]]), 50, 100, 64, squash=True)
  np.testing.assert_allclose(b, [[6.4, 6.4, 38.4, 57.6]], rtol=1e-6)
  np.testing.assert_allclose(
    image_ops.xyxy_to_cxcywh(np.array([[6.4, 3.2, 38.4, 28.8]])),
    [[22.4, 16.0, 32.0, 25.6]],
    rtol=1e-6,
  )


# ---------------------------------------------------------------------- queries and labels
def test_train_example_queries_labels_boxes():
  tok, empty = fake_tokens()
  ex = make_example()
  out = input_pipeline.preprocess_train_example(
    ex, ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW), rng=np.random.default_rng(0)
  )
  qc = out["query_class"]
  assert qc.dtype == np.int32 and qc.shape == (8,)
  assert qc[0] == -1 and list(qc[1:3]) == [3, 7]  # '' then positives
  neg = qc[3:6]
  assert len(set(neg.tolist())) == 3 and not set(neg.tolist()) & {3, 7}
  assert np.all((neg >= 0) & (neg < C)) and list(qc[6:]) == [-1, -1]
  # Tokens follow the classes; '' rows carry the empty tokens.
  np.testing.assert_array_equal(out["queries"][0], empty)
  np.testing.assert_array_equal(out["queries"][6:], np.stack([empty, empty]))
  np.testing.assert_array_equal(out["queries"][1:6], tok[qc[1:6]])
  # Labels: instance 0 -> column of class 3, instance 1 -> class 7, rest padding (column 0).
  lab = out["labels"]
  assert lab.shape == (4, 8) and lab.dtype == np.float32
  expected = np.zeros((4, 8), np.float32)
  expected[0, 1] = expected[1, 2] = 1
  expected[2:, 0] = 1
  np.testing.assert_array_equal(lab, expected)
  # Boxes: cxcywh / 64 of the scaled boxes (scale 0.64).
  np.testing.assert_allclose(out["boxes"][0], np.array([22.4, 16.0, 32.0, 25.6]) / 64, rtol=1e-5)
  np.testing.assert_allclose(out["boxes"][1], np.array([51.2, 12.8, 12.8, 12.8]) / 64, rtol=1e-5)
  np.testing.assert_array_equal(out["boxes"][2:], 0)
  assert out["image_id"] == 11 and out["image_id"].dtype == np.int64
  np.testing.assert_array_equal(out["orig_size"], [50, 100])
  assert out["example_mask"] == True  # noqa: E712
  np.testing.assert_allclose(out["images"][40:], 0.5)  # training pad value


def test_negatives_never_positive_and_vary():
  tok, empty = fake_tokens()
  ex = make_example()
  seen = set()
  for index in range(30):
    out = input_pipeline.preprocess_train_example(
      ex,
      ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW),
      rng=input_pipeline.example_rng(0, 0, index),
    )
    neg = tuple(out["query_class"][3:6].tolist())
    assert not set(neg) & {3, 7}
    seen.add(neg)
  assert len(seen) > 10  # not the same negatives for all images (docs/reference.md §12)
  a = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW),
    rng=input_pipeline.example_rng(0, 0, 5),
  )
  b = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW),
    rng=input_pipeline.example_rng(0, 0, 5),
  )
  np.testing.assert_array_equal(a["query_class"], b["query_class"])


def test_negatives_limited_by_free_slots_and_classes():
  tok, empty = fake_tokens(num_classes=4)
  ex = make_example(labels=(0, 1))
  out = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(
      class_tokens=tok,
      empty_tokens=empty,
      image_size=64,
      num_queries=8,
      max_instances=4,
      num_negatives=50,
    ),
    rng=np.random.default_rng(1),
  )
  assert sorted(out["query_class"][3:5].tolist()) == [2, 3]  # only 2 candidates
  assert list(out["query_class"][5:]) == [-1, -1, -1]


def test_truncation_and_duplicate_merge():
  tok, empty = fake_tokens()
  boxes = [(0, 0, 10, 10), (20, 0, 30, 10), (40, 0, 50, 10), (60, 0, 70, 10), (80, 0, 90, 10)]
  ex = make_example(boxes=boxes, labels=(1, 2, 2, 4, 5))
  out = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(
      class_tokens=tok,
      empty_tokens=empty,
      image_size=64,
      num_queries=8,
      max_instances=3,
      num_negatives=3,
    ),
    rng=np.random.default_rng(0),
  )
  qc = out["query_class"].tolist()
  assert qc[:3] == [-1, 1, 2]
  # Class 4 (its instance truncated) and class 5 (too) are neither positives nor negatives.
  assert 4 not in qc and 5 not in qc
  np.testing.assert_array_equal(out["labels"][:, :3], [[0, 1, 0], [0, 0, 1], [0, 0, 1]])
  # Duplicate merge: IoU >= 0.9 boxes with different labels -> one multi-label instance.
  ex = make_example(boxes=[(10, 10, 40, 40), (10, 10, 40, 41), (50, 5, 90, 45)], labels=(1, 2, 3))
  out = input_pipeline.preprocess_train_example(
    ex, ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW), rng=np.random.default_rng(0)
  )
  assert out["query_class"][1:4].tolist() == [1, 2, 3]
  np.testing.assert_array_equal(
    out["labels"][:, :4], [[0, 1, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
  )
  out = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW),
    rng=np.random.default_rng(0),
    merge_iou=None,
  )
  np.testing.assert_array_equal(out["labels"][:3, 1:4], np.eye(3))


def test_too_many_positives_cut_to_q_minus_1():
  tok, empty = fake_tokens()
  boxes = [(10 * i, 0, 10 * i + 8, 8) for i in range(5)]
  ex = make_example(boxes=boxes, labels=(0, 1, 2, 3, 4))
  out = input_pipeline.preprocess_train_example(
    ex,
    ExampleSpec(
      class_tokens=tok,
      empty_tokens=empty,
      image_size=64,
      num_queries=4,
      max_instances=6,
      num_negatives=5,
    ),
    rng=np.random.default_rng(0),
  )
  assert out["query_class"].tolist() == [-1, 0, 1, 2]
  lab = out["labels"]
  np.testing.assert_array_equal(lab[:3, 1:], np.eye(3))
  np.testing.assert_array_equal(lab[3:, 0], 1)  # cut classes' instances become padding


def test_no_annotations_and_prompts_and_flip():
  tok, empty = fake_tokens(prompts=3)
  ex = make_example(boxes=np.zeros((0, 4)), labels=())
  out = input_pipeline.preprocess_train_example(
    ex, ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW), rng=np.random.default_rng(0)
  )
  np.testing.assert_array_equal(out["labels"][:, 0], 1)
  qc = out["query_class"]
  assert (qc[1:4] >= 0).all() and (qc[4:] == -1).all()
  for q in range(1, 4):  # a prompt variant of the right class
    assert (out["queries"][q, 1] - 1000 - qc[q]) in (0, 100, 200)
  # Horizontal flip mirrors the boxes (x -> W - x).
  tok, empty = fake_tokens()
  ex = make_example()
  flips = [
    input_pipeline.preprocess_train_example(
      ex,
      ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW),
      rng=np.random.default_rng(s),
      hflip=True,
    )
    for s in range(8)
  ]
  cx = {round(float(o["boxes"][0, 0] * 64), 3) for o in flips}
  assert cx == {22.4, round((100 - 35) * 0.64, 3)}


# --------------------------------------------------------------------------------- datasets
def _sequence_source(n=10):
  rng = np.random.default_rng(0)
  out = []
  for i in range(n):
    h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
    out.append(
      make_example(h=h, w=w, boxes=[(1, 1, 20, 30)], labels=(i % C,), image_id=100 + i, value=i)
    )
  return out


def test_train_dataset_shapes_and_determinism():
  tok, empty = fake_tokens()
  src = _sequence_source(10)
  spec = ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW)
  kw = dict(batch_size=4, seed=3)
  a = list(input_pipeline.train_dataset(src, spec, epoch=0, **kw))
  b = list(input_pipeline.train_dataset(src, spec, epoch=0, **kw))
  c = list(input_pipeline.train_dataset(src, spec, epoch=1, **kw))
  assert len(a) == 2  # floor(10 / 4), remainder dropped
  shapes = dict(
    images=((4, 64, 64, 3), np.float32),
    queries=((4, 8, L), np.int32),
    labels=((4, 4, 8), np.float32),
    boxes=((4, 4, 4), np.float32),
    query_class=((4, 8), np.int32),
    image_id=((4,), np.int64),
    orig_size=((4, 2), np.int32),
    example_mask=((4,), np.bool_),
  )
  for batch in a:
    assert set(batch) == set(shapes)
    for k, (shape, dtype) in shapes.items():
      assert batch[k].shape == shape and batch[k].dtype == dtype, k
    assert batch["example_mask"].all()
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  ids_a = np.concatenate([x["image_id"] for x in a])
  ids_c = np.concatenate([x["image_id"] for x in c])
  assert len(set(ids_a.tolist())) == 8 and not np.array_equal(ids_a, ids_c)
  # Each example equals the public per-example function with the derived rng.
  idx = int(a[0]["image_id"][0]) - 100
  ref = input_pipeline.preprocess_train_example(
    src[idx],
    ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW),
    rng=input_pipeline.example_rng(3, 0, idx),
  )
  for k in ref:
    np.testing.assert_array_equal(a[0][k][0], ref[k])


@pytest.mark.slow
def test_train_dataset_multiprocessing_matches():
  tok, empty = fake_tokens()
  src = _sequence_source(8)
  spec = ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW)
  kw = dict(batch_size=4, seed=0, epoch=0)
  a = list(input_pipeline.train_dataset(src, spec, **kw))
  b = list(input_pipeline.train_dataset(src, spec, num_workers=1, **kw))
  assert len(a) == len(b) == 2
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_eval_dataset_padding(tmp_path):
  images = [dict(id=10 + i, file_name=f"{i}.png", height=20 + i, width=30) for i in range(5)]
  cats = [dict(id=1, name="a")]
  ann, img_dir = write_coco(
    str(tmp_path), images, [], cats, colors={10 + i: (255, 255, 255) for i in range(5)}
  )
  src = CocoSource(ann, img_dir)
  batches = list(input_pipeline.eval_dataset(src, image_size=32, batch_size=2))
  assert len(batches) == 3
  assert set(batches[0]) == {"images", "image_id", "orig_size", "example_mask"}
  np.testing.assert_array_equal(
    np.concatenate([b["image_id"] for b in batches]), [10, 11, 12, 13, 14, -1]
  )
  np.testing.assert_array_equal(
    np.concatenate([b["example_mask"] for b in batches]), [True] * 5 + [False]
  )
  np.testing.assert_array_equal(batches[2]["orig_size"], [[24, 30], [0, 0]])
  last = batches[2]["images"]
  assert last.shape == (2, 32, 32, 3) and last.dtype == np.float32
  # Image 14: 24x30 -> 26x32 (scale 32/30, 25.6 -> 26); white content, pad 0.0 below.
  np.testing.assert_allclose(last[0, :26], 1.0, atol=1e-6)
  np.testing.assert_allclose(last[0, 26:], 0.0)
  np.testing.assert_allclose(last[1], 0.0)
  # max_images: the first 3 only, padded to 4.
  batches = list(input_pipeline.eval_dataset(src, image_size=32, batch_size=2, max_images=3))
  np.testing.assert_array_equal(np.concatenate([b["image_id"] for b in batches]), [10, 11, 12, -1])


def test_batch_rows_split_each_global_batch():
  # Two processes holding rows [0, 2) and [2, 4) of each global batch of 4 read, together,
  # exactly the batches of one process (same examples, same per-example randomness).
  tok, empty = fake_tokens()
  src = _sequence_source(10)
  spec = ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW)
  kw = dict(batch_size=4, seed=3, epoch=1)
  whole = list(input_pipeline.train_dataset(src, spec, **kw))
  parts = [
    list(input_pipeline.train_dataset(src, spec, batch_rows=rows, **kw))
    for rows in ((0, 2), (2, 4))
  ]
  assert len(whole) == len(parts[0]) == len(parts[1]) == 2
  for b, batch in enumerate(whole):
    assert parts[0][b]["images"].shape[0] == 2
    for k in batch:
      np.testing.assert_array_equal(
        np.concatenate([parts[0][b][k], parts[1][b][k]]), batch[k], err_msg=k
      )
  np.testing.assert_array_equal(input_pipeline.batch_row_positions(10, 4, (1, 3)), [1, 2, 5, 6])
  with pytest.raises(ValueError, match=r"batch_rows must satisfy 0 <= start < stop <= 4"):
    input_pipeline.batch_row_positions(10, 4, (2, 5))
  with pytest.raises(ValueError, match="shard or positions"):
    input_pipeline.train_map_dataset(
      src,
      spec,
      shard=(0, 2),
      positions=np.arange(2),
      **{k: v for k, v in kw.items() if k != "batch_size"},
    )


@pytest.mark.slow
def test_eval_batch_rows_cover_every_image_once():
  src = [dict(make_example(h=20, w=30, boxes=[], labels=(), image_id=10 + i)) for i in range(5)]
  whole = list(input_pipeline.eval_dataset(src, image_size=32, batch_size=4))
  parts = [
    list(input_pipeline.eval_dataset(src, image_size=32, batch_size=4, batch_rows=r))
    for r in ((0, 2), (2, 4))
  ]
  assert len(whole) == len(parts[0]) == len(parts[1]) == 2  # ceil(5 / 4), same on every process
  for b, batch in enumerate(whole):
    for k in batch:
      np.testing.assert_array_equal(np.concatenate([parts[0][b][k], parts[1][b][k]]), batch[k])
  ids = np.concatenate([p[k]["image_id"] for p in parts for k in range(2)])
  assert sorted(i for i in ids.tolist() if i >= 0) == [10, 11, 12, 13, 14]
  # The row selection pickles to grain worker processes.
  kw = dict(image_size=32, batch_size=4, batch_rows=(2, 4))
  for a, b in zip(input_pipeline.eval_dataset(src, num_workers=1, **kw), parts[1]):
    np.testing.assert_array_equal(a["images"], b["images"])


def test_bad_tokens_raise():
  with pytest.raises(ValueError, match="class_tokens"):
    input_pipeline.train_dataset(
      _sequence_source(2),
      ExampleSpec(
        class_tokens=np.zeros((3, 8), np.int32), empty_tokens=np.zeros(16, np.int32), **KW
      ),
      batch_size=1,
      seed=0,
      epoch=0,
    )


def _noisy_coco_source(tmp_path, cache_images):
  """6 random-pixel images (so a resize is not trivially exact) with one box each, 3 classes."""
  rng = np.random.default_rng(1)
  img_dir = tmp_path / "images"
  img_dir.mkdir(exist_ok=True)
  images, annotations = [], []
  for i in range(6):
    h, w = int(rng.integers(40, 100)), int(rng.integers(40, 100))
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(img_dir / f"{i}.png")
    images.append(dict(id=i + 1, file_name=f"{i}.png", height=h, width=w))
    box = [2, 3, 20, 15]
    annotations.append(dict(id=i + 1, image_id=i + 1, category_id=i % 3 + 1, bbox=box))
  cats = [dict(id=c + 1, name=f"c{c}") for c in range(3)]
  ann, _ = write_coco(str(tmp_path), images, annotations, cats, write_images=False)
  return CocoSource(ann, str(img_dir), cache_images=cache_images)


def test_kept_network_inputs_give_the_same_batches_and_are_computed_once(tmp_path, monkeypatch):
  # A source that keeps its images also keeps each image's network input (`CocoSource.derived`):
  # without augmentation it is the same in every epoch, so it is computed once per image and
  # padding value, and the batches equal those of a source that keeps nothing, bit for bit.
  calls = []
  real = input_pipeline.preprocess_image
  monkeypatch.setattr(
    input_pipeline, "preprocess_image", lambda *a, **k: calls.append(a[2]) or real(*a, **k)
  )
  tok, empty = fake_tokens(3)
  spec = ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW)
  batches = {}
  for keep in (False, True):
    src = _noisy_coco_source(tmp_path, keep)
    calls.clear()
    train = [
      b
      for e in (0, 1)
      for b in input_pipeline.train_dataset(src, spec, batch_size=3, seed=0, epoch=e)
    ]
    evals = [
      b for _ in range(2) for b in input_pipeline.eval_dataset(src, image_size=64, batch_size=3)
    ]
    # The replay buffer's examples of the same images (never augmented) reuse them too.
    buffer = [build_lib.BufferExample(src, 0, spec, {})(i) for i in range(6)]
    batches[keep] = train + evals + buffer
    # 6 images x (2 epochs + 2 evaluations + the buffer); kept: once per image and padding.
    assert sorted(calls) == sorted([0.0] * 6 * (1 if keep else 2) + [0.5] * 6 * (1 if keep else 3))
  for a, b in zip(batches[False], batches[True], strict=True):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  # With an augmentation the image changes before its network input: computed per example.
  src = _noisy_coco_source(tmp_path, True)
  calls.clear()
  for e in (0, 1):
    list(input_pipeline.train_dataset(src, spec, batch_size=3, seed=0, epoch=e, hflip=True))
  assert calls == [0.5] * 12


def test_network_image_is_refused_with_an_augmentation():
  tok, empty = fake_tokens()
  spec = ExampleSpec(class_tokens=tok, empty_tokens=empty, **KW)
  with pytest.raises(ValueError, match="before augmentation"):
    input_pipeline.preprocess_train_example(
      make_example(),
      spec,
      rng=np.random.default_rng(0),
      hflip=True,
      network_image=np.zeros((64, 64, 3), np.float32),
    )

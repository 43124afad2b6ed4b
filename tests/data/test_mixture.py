"""mixture: the joint plan (the sequence's examples shuffled together) and its dataset."""

import collections

import numpy as np
import pytest

from owl_cl.data import input_pipeline
from owl_cl.data import mixture
from owl_cl.data.spec import ExampleSpec

L = 16


def _tokens(num_classes, base):
  """class c -> [SOT, base + c, EOT, 0...]; '' -> [SOT, EOT, 0...]."""
  t = np.zeros((num_classes, L), np.int32)
  t[:, 0], t[:, 1], t[:, 2] = 49406, base + np.arange(num_classes), 49407
  e = np.zeros((L,), np.int32)
  e[:2] = 49406, 49407
  return ExampleSpec(t, e, image_size=32, num_queries=4, max_instances=3, num_negatives=2)


def _source(n, num_classes, offset):
  """n examples of 40 x 30 images; image i has value offset + i, one box of class i % C."""
  return [
    dict(
      image=np.full((30, 40, 3), offset + i, np.uint8),
      boxes=np.array([[2.0, 3.0, 20.0, 25.0]], np.float32),
      labels=np.array([i % num_classes], np.int64),
      image_id=offset + i,
    )
    for i in range(n)
  ]


def test_plan_is_the_sequences_examples_hand_worked():
  # Dataset 0: 3 images, batch 2 -> epochs of positions 0, 1 (the odd image is dropped, as
  # a sequence epoch drops its partial batch); 2 steps = 4 rows over epochs 0 and 1.
  # Dataset 1: 5 images -> epochs of positions 0..3; 1 step = positions 0, 1 of epoch 0.
  plan = mixture.joint_plan([3, 5], [2, 1], batch_size=2, seed=0)
  expected = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1)]
  assert plan.dtype == np.int64 and plan.shape == (6, 3)
  assert sorted(map(tuple, plan.tolist())) == expected


def test_plan_proportions_total_steps_and_seed():
  sizes, steps, batch = [40, 24, 17], [7, 3, 5], 4
  plan = mixture.joint_plan(sizes, steps, batch, seed=3)
  assert len(plan) == sum(steps) * batch  # the sequence's total steps
  counts = collections.Counter(plan[:, 0].tolist())
  # Each dataset's share of the examples is its share of the sequence's steps: 28 / 12 / 20.
  assert counts == {0: steps[0] * batch, 1: steps[1] * batch, 2: steps[2] * batch}
  # Dataset 2: 16 positions per epoch (17 // 4 * 4): 20 rows = epoch 0 whole, epoch 1's first 4.
  rows = plan[plan[:, 0] == 2]
  assert collections.Counter(rows[:, 1].tolist()) == {0: 16, 1: 4}
  assert set(rows[rows[:, 1] == 1, 2].tolist()) == {0, 1, 2, 3}
  # A pure function of the seed; another seed mixes in another order.
  np.testing.assert_array_equal(plan, mixture.joint_plan(sizes, steps, batch, seed=3))
  other = mixture.joint_plan(sizes, steps, batch, seed=4)
  assert not np.array_equal(plan, other)
  assert sorted(map(tuple, plan.tolist())) == sorted(map(tuple, other.tolist()))
  # Mixed: the first half of the steps holds images of every dataset.
  assert set(plan[: len(plan) // 2, 0].tolist()) == {0, 1, 2}


@pytest.mark.parametrize(
  "sizes, steps, batch, match",
  [
    ([3], [1, 2], 2, "1 dataset sizes but 2"),
    ([3, 1], [1, 1], 2, "dataset 1: 1 images, fewer than one batch of 2"),
    ([3], [-1], 2, "must be >= 0"),
    ([3], [1], 0, "batch_size must be >= 1"),
  ],
)
def test_plan_refuses_bad_arguments(sizes, steps, batch, match):
  with pytest.raises(ValueError, match=match):
    mixture.joint_plan(sizes, steps, batch, seed=0)


def test_joint_examples_equal_the_sequences_examples():
  """Element k of the joint dataset is, bit for bit, the example the sequence's pipeline
  makes at (dataset, epoch, position) of plan row k: each dataset's own queries, seed and
  options; and the batches hold every dataset's examples of the sequence once each."""
  sources = [_source(6, 3, 0), _source(5, 2, 100)]
  specs = [_tokens(3, 1000), _tokens(2, 2000)]
  options = [dict(hflip=True), dict(merge_iou=None)]
  seeds = [11, 12]
  # Dataset 0: 3 steps per epoch, 4 steps = epoch 0 and one step of epoch 1; dataset 1:
  # 2 steps per epoch (its odd image dropped), 2 steps = epoch 0.
  steps = [4, 2]
  batch = 2
  plan = mixture.joint_plan([6, 5], steps, batch, seed=5)
  parts = tuple(
    mixture.JointPart(f"d{d}", sources[d], seeds[d], steps[d]) for d in range(len(sources))
  )
  joint = mixture.JointSource(parts, plan, batch)
  assert joint.steps == 6 and len(joint) == 12
  ds = mixture.joint_map_dataset(joint, specs, options)
  for k, (d, e, p) in enumerate(plan.tolist()):
    reference = input_pipeline.train_map_dataset(
      sources[d], specs[d], seed=seeds[d], epoch=e, **options[d]
    )[p]
    got = ds[k]
    assert sorted(got) == sorted(reference)
    for key in reference:
      np.testing.assert_array_equal(got[key], reference[key], err_msg=f"row {k} {key}")
    # Its queries are its own dataset's class tokens (2000 + c for dataset 1).
    words = got["queries"][:, 1][got["query_class"] >= 0]
    assert np.all((words >= 1000 * (d + 1)) & (words < 1000 * (d + 1) + 3))
  batches = list(mixture.joint_train_dataset(joint, specs, options))
  assert len(batches) == joint.steps
  ids = collections.Counter(i for b in batches for i in b["image_id"].tolist())
  # The sequence's first steps[d] batches of dataset d: its examples, each once.
  seq_ids = collections.Counter()
  for d in range(2):
    taken = 0
    for e in range(2):
      epoch = input_pipeline.train_dataset(
        sources[d], specs[d], batch_size=batch, seed=seeds[d], epoch=e, **options[d]
      )
      for b in epoch:
        if taken < steps[d]:
          seq_ids.update(b["image_id"].tolist())
          taken += 1
  assert ids == seq_ids
  # From a start batch on: the tail of the same batches (a resumed joint run).
  tail = list(mixture.joint_train_dataset(joint, specs, options, start_batch=4))
  assert len(tail) == 2
  for a, b in zip(tail, batches[4:]):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])

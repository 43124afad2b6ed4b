"""The joint training set: every downstream dataset's training examples of the sequence, mixed.

The `joint` schedule (docs/baselines.md, configs/joint.py) trains on all downstream datasets
at once. Its data is defined by the sequence it bounds: `joint_plan` lists every example the
sequence's training reads (dataset d, epoch e, position p of that epoch's shuffled order, for
the sequence's steps of d) and shuffles the whole list together; the joint run's step s takes
rows [s * B, (s + 1) * B) of it. So the joint run sees the sequence's examples exactly (each
image as often, with the same per-example preprocessing: negatives, prompts, flips, crops,
mosaics are drawn from `input_pipeline.example_rng(seed_d, e, index)` as in the sequence) and
takes the same total number of steps; only the order differs: i.i.d. over the union instead
of one dataset after another. Dataset d's share of the examples, and of every long enough
window of steps, is its share of the sequence's steps, S_d / sum(S).

Each example keeps its own dataset's queries (`ExampleSpec.class_tokens` of its dataset:
OWL-ViT's queries are per image), so a batch may hold images of several datasets.

Source: the joint-training ("offline", "multi-task") upper bound of continual learning (De
Lange et al., TPAMI 2021, "A continual learning survey", §6: joint training on all tasks'
data as the upper bound; van de Ven et al., Nature MI 2022, "Three types of incremental
learning", "Joint").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
from typing import Any

import grain
import numpy as np

from owl_cl.data import input_pipeline
from owl_cl.data.spec import ExampleSpec

__all__ = ["JointPart", "JointSource", "joint_plan", "joint_map_dataset", "joint_train_dataset"]

# Mixed into the plan's shuffle seed so it differs from every epoch permutation's.
_PLAN_TAG = 0x701A7


@dataclasses.dataclass(frozen=True)
class JointPart:
  """One downstream dataset's part of the joint training set.

  Attributes:
    name: the dataset's name.
    source: its training source (`CocoSource` or any sequence of `CocoSource.load` dicts).
    seed: the data seed of its sequence stage (`trainer`: seeds.data + its 1-based index).
    steps: the optimiser steps the sequence trains it for (>= 0).
  """

  name: str
  source: Any
  seed: int
  steps: int


@dataclasses.dataclass(frozen=True, eq=False)
class JointSource:
  """The joint training set: its parts and the mixed plan (`joint_plan` over the parts).

  Attributes:
    parts: the datasets, in sequence order.
    plan: int64 [K, 3] (part index, epoch, position), K = sum(steps) * batch_size.
    batch_size: B, examples per step.
  """

  parts: tuple[JointPart, ...]
  plan: np.ndarray
  batch_size: int

  @property
  def steps(self) -> int:
    """The joint run's total steps: sum of the parts' steps (K / B)."""
    return len(self.plan) // self.batch_size

  def __len__(self) -> int:
    return len(self.plan)


def joint_plan(
  sizes: Sequence[int], steps: Sequence[int], batch_size: int, seed: int
) -> np.ndarray:
  """The sequence's training examples, shuffled together.

  Args:
    sizes: [D] training images of each dataset (N_d).
    steps: [D] steps the sequence trains dataset d for (S_d >= 0).
    batch_size: B >= 1, with N_d >= B wherever S_d > 0.
    seed: int >= 0, the shuffle's seed.

  Returns:
    int64 [sum(S) * B, 3]: rows (d, e, p). Before the shuffle, dataset d contributes its
    epochs e = 0, 1, ... in order, each the positions p = 0 .. floor(N_d / B) * B - 1 of that
    epoch's order (a sequence epoch drops its last partial batch), cut after S_d * B rows:
    exactly what the sequence's training of d reads. The rows are then permuted by
    `np.random.default_rng([seed, _PLAN_TAG])`, a pure function of the arguments.

  Raises:
    ValueError: lengths that differ, a negative count, B < 1, or N_d < B with S_d > 0.
  """
  if len(sizes) != len(steps):
    raise ValueError(f"{len(sizes)} dataset sizes but {len(steps)} step counts")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  rows = []
  for d, (size, count) in enumerate(zip(sizes, steps)):
    if size < 0 or count < 0:
      raise ValueError(f"dataset {d}: size {size} and steps {count} must be >= 0")
    if count == 0:
      continue
    per_epoch = (size // batch_size) * batch_size
    if per_epoch == 0:
      raise ValueError(f"dataset {d}: {size} images, fewer than one batch of {batch_size}")
    total = count * batch_size
    k = np.arange(total, dtype=np.int64)
    rows.append(np.stack([np.full(total, d, np.int64), k // per_epoch, k % per_epoch], axis=1))
  plan = np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)
  order = np.random.default_rng(np.random.SeedSequence([int(seed), _PLAN_TAG])).permutation(
    len(plan)
  )
  return plan[order]


class _PlanTransform:
  """Plan row -> the training example the sequence reads at (dataset, epoch, position): the
  position of that epoch's `train_map_dataset` (a picklable transform for grain workers)."""

  def __init__(self, plan: np.ndarray, epochs: dict[tuple[int, int], grain.MapDataset]):
    self.plan, self.epochs = plan, epochs

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    d, e, p = (int(v) for v in self.plan[int(row)])
    return self.epochs[(d, e)][p]


def joint_map_dataset(
  joint: JointSource,
  specs: Sequence[ExampleSpec],
  options: Sequence[dict[str, Any]],
  *,
  shard: Any = None,
  positions: np.ndarray | None = None,
) -> grain.MapDataset:
  """Unbatched `grain.MapDataset` of the joint plan: element k = plan row k's example.

  Args:
    joint: the parts and the plan.
    specs: [D] each part's `ExampleSpec` (its class tokens).
    options: [D] each part's `input_pipeline.train_map_dataset` options (preprocessing and
      augmentations, e.g. its own `negative_weights`).
    shard: host sharding of the rows (`input_pipeline.shard_options`).
    positions: int [K'] keep only these rows, in this order (instead of `shard`).

  Returns:
    a MapDataset of len K (or the kept rows); element k equals
    `train_map_dataset(source_d, spec_d, seed=seed_d, epoch=e, **options_d)[p]` for plan row
    k = (d, e, p), bit for bit.

  Raises:
    ValueError: specs / options not one per part, or both `shard` and `positions`.
  """
  if not len(specs) == len(options) == len(joint.parts):
    raise ValueError(
      f"{len(joint.parts)} parts but {len(specs)} specs and {len(options)} option sets"
    )
  epochs = {}
  for d, e in {(int(d), int(e)) for d, e, _ in joint.plan}:
    part = joint.parts[d]
    epochs[(d, e)] = input_pipeline.train_map_dataset(
      part.source, specs[d], seed=part.seed, epoch=e, **options[d]
    )
  if positions is not None:
    if shard is not None:
      raise ValueError(f"give shard or positions, not both (shard={shard!r})")
    ds = grain.MapDataset.source(np.asarray(positions, np.int64))
  else:
    ds = input_pipeline.apply_shard(grain.MapDataset.range(len(joint.plan)), shard)
  return ds.map(_PlanTransform(joint.plan, epochs))


def joint_train_dataset(
  joint: JointSource,
  specs: Sequence[ExampleSpec],
  options: Sequence[dict[str, Any]],
  *,
  num_workers: int = 0,
  shard: Any = None,
  batch_rows: tuple[int, int] | None = None,
  start_batch: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
  """Iterator over the joint run's batches (`joint.batch_size` rows each), from batch
  `start_batch` on (a resumed loop).

  Args, batches and errors as `input_pipeline.train_dataset` (one epoch: the whole plan),
  with `specs` / `options` per part (`joint_map_dataset`).
  """
  if start_batch < 0:
    raise ValueError(f"start_batch must be >= 0, got {start_batch}")
  batch_size = joint.batch_size
  positions = None
  if batch_rows is not None:
    positions = input_pipeline.batch_row_positions(len(joint.plan), batch_size, batch_rows)
  ds = joint_map_dataset(joint, specs, options, shard=shard, positions=positions)
  local_batch = batch_size if batch_rows is None else batch_rows[1] - batch_rows[0]
  return input_pipeline.iterate_batches(ds, local_batch, start_batch, num_workers)

"""The phases of continual fine-tuning: a dataset of the sequence, or the joint set, with its
optimiser settings and budget in steps (`Phase`), planned from the config before any training
(`trainer.train_phase` runs one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from owl_cl.benchmark import Dataset
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import check_per_dataset_fields
from owl_cl.data import mixture
from owl_cl.run_spec import RunSpec
from owl_cl.train.spec import TrainSpec

# The name of the joint phase (its stage, step checkpoints' desc, TensorBoard prefix, records).
JOINT = "joint"


def dataset_train_settings(train: TrainSpec, name: str, steps_per_epoch: int) -> dict:
  """The optimiser settings of one dataset: `train.*` with `train.per_dataset.<name>` applied.

  Args:
    train: the run's `train` section (`TrainSpec`).
    name: the dataset's name (a key of `train.per_dataset`, e.g. 'Pothole').
    steps_per_epoch: optimiser steps per epoch of this dataset (images // batch size).

  Returns:
    {'num_epochs', 'learning_rate', 'text_lr_multiplier', 'layerwise_decay',
     'warmup_steps'}; warmup_steps = warmup_epochs * steps_per_epoch when `warmup_epochs` is
    set (globally or for the dataset; the paper's table gives warmup in epochs), else
    `warmup_steps`. A dataset's `warmup_steps` override wins over a global `warmup_epochs`.
    With a budget in steps (`train.per_dataset.<name>.num_steps`, else
    `train.num_steps_by_dataset`'s entry for `name`, else `train.num_steps`) also
    'num_steps': the dataset's optimizer steps, which replace num_epochs (the IVLOD
    protocol, docs/ivlod.md).

  Raises:
    ConfigError: an unknown field in `train.per_dataset.<name>`.

  Source: the paper's per-dataset hyperparameter table (configs/base.py
  PAPER_HYPERPARAMETERS).
  """
  overrides = check_per_dataset_fields(train.per_dataset, name)
  value = lambda field: overrides.get(field, getattr(train, field))
  warmup_epochs = value("warmup_epochs")
  if "warmup_steps" in overrides or warmup_epochs is None:
    warmup_steps = int(value("warmup_steps"))
  else:
    warmup_steps = int(warmup_epochs) * steps_per_epoch
  table = dict(train.num_steps_by_dataset or ())
  num_steps = overrides.get("num_steps", table.get(name, train.num_steps))
  return {
    "num_epochs": int(value("num_epochs")),
    "learning_rate": float(value("learning_rate")),
    "text_lr_multiplier": float(value("text_lr_multiplier")),
    "layerwise_decay": float(value("layerwise_decay")),
    "warmup_steps": warmup_steps,
    **({"num_steps": int(num_steps)} if num_steps is not None else {}),
  }


@dataclasses.dataclass(frozen=True)
class Phase:
  """One downstream training phase: a dataset of the sequence, or the joint set.

  Attributes:
    name: the dataset's name, or 'joint'.
    index: the stage it ends (1-based): its step checkpoints' phase and its PRNG key's offset.
    source: what `Detector.train_batches` reads (`CocoSource`, or `mixture.JointSource`).
    data_seed: the input pipeline's seed (seeds.data + index).
    batch_size: new images per step.
    total: optimiser steps of the phase.
    num_epochs: epochs the loop reads (the joint set: 1, its plan holds every epoch; None: as
      many as a budget in steps takes, `train.num_steps`).
    settings: the optimiser settings (`dataset_train_settings`), for the summary.
    dataset: the `Dataset` (its valid split for `train.carry='best_validation'`); None: joint.
  """

  name: str
  index: int
  source: Any
  data_seed: int
  batch_size: int
  total: int
  num_epochs: int | None
  settings: dict
  dataset: Dataset | None = None


def dataset_phase(train: TrainSpec, run: RunSpec, dataset: Dataset, index: int) -> Phase:
  """The phase of `dataset`, the `index`-th (1-based) of the sequence: steps_per_epoch =
  images // train.batch_size, total = steps_per_epoch * num_epochs, capped by the run's
  `max_train_steps_per_dataset`; its data seed is the run's seeds.data + index.

  Raises:
    ConfigError: a dataset with fewer training images than one batch.
  """
  batch_size = train.batch_size
  steps_per_epoch = len(dataset.train) // batch_size
  if steps_per_epoch < 1:
    raise ConfigError(
      f"dataset {dataset.name} has {len(dataset.train)} training images, "
      f"fewer than config.train.batch_size={batch_size}"
    )
  settings = dataset_train_settings(train, dataset.name, steps_per_epoch)
  # A budget in steps (train.num_steps) runs as many epochs as it takes, the last one cut.
  num_epochs = None if "num_steps" in settings else settings["num_epochs"]
  total = settings.get("num_steps") or steps_per_epoch * settings["num_epochs"]
  if run.max_train_steps_per_dataset:
    total = min(total, run.max_train_steps_per_dataset)
  return Phase(
    name=dataset.name,
    index=index,
    source=dataset.train,
    data_seed=run.seed_of("data") + index,
    batch_size=batch_size,
    total=total,
    num_epochs=num_epochs,
    settings=settings,
    dataset=dataset,
  )


def joint_phase(train: TrainSpec, run: RunSpec, datasets, index: int = 1) -> Phase:
  """The joint phase over `datasets` (the sequence, in order): the examples every
  `dataset_phase` reads, shuffled together (`mixture.joint_plan`, seeded by seeds.data), and
  their total steps. The optimiser settings are `train.*` (no `train.per_dataset` entry
  applies); `warmup_epochs` counts passes over the union (sum of images // batch size).

  Raises:
    ConfigError: a dataset with fewer training images than one batch.
  """
  phases = [dataset_phase(train, run, d, i) for i, d in enumerate(datasets, start=1)]
  batch_size = train.batch_size
  data_seed = run.seed_of("data")
  plan = mixture.joint_plan(
    [len(d.train) for d in datasets], [p.total for p in phases], batch_size, data_seed
  )
  parts = tuple(mixture.JointPart(p.name, p.source, p.data_seed, p.total) for p in phases)
  source = mixture.JointSource(parts, plan, batch_size)
  one_pass = sum(len(d.train) // batch_size for d in datasets)
  settings = dataset_train_settings(train, JOINT, one_pass)
  settings["num_epochs"] = 1
  return Phase(JOINT, index, source, data_seed + index, batch_size, source.steps, 1, settings)

"""The datasets of a run: the pre-training set, the held-out classes and the downstream sequence.

Two sources: the built-in benchmark (generated under `cache_dir`, the default) and the
paper's real data (Objects365, LVIS val and ODinW below `data.root`). `stage_eval_names`
says which evaluation sets are evaluated after each stage of the sequence.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from owl_cl import validation
from owl_cl.data import builtin
from owl_cl.data import coco
from owl_cl.utils import digest
from owl_cl.utils import expand_path
from owl_cl.utils import shuffled
from owl_cl.validation import uses_real_data

PRETRAIN_EVAL = "pretrain_val"
HELD_OUT_EVAL = "held_out"
OBJECTS365_EVAL = "o365"
LVIS_EVAL = "lvis"
EVALUATION_PROTOCOLS = ("coco", "lvis")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One detection dataset of the run: its training and evaluation sources.

  `valid` is the validation split (used by `train.carry='best_validation'`), None when the
  dataset has none; `evaluation` is 'coco' (COCO AP, exclusive classes) or 'lvis' (LVIS AP
  and APr, federated); `max_detections` overrides the detections kept per image
  (`eval.top_k` and COCOeval's maxDets: 100 for EgoHands and BrackishUnderwater in the
  paper's protocol), None = the config's.
  """

  name: str
  train: coco.CocoSource | None
  test: coco.CocoSource
  valid: coco.CocoSource | None = None
  evaluation: str = "coco"
  max_detections: int | None = None


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """The data of a run: the pre-training set, the held-out classes and the sequence.

  `pretrain.test` and `held_out.test` are evaluated under the names `pretrain_eval` and
  `held_out_eval`; `roles` says which eval set fills which Table 3 column (results.json
  `roles`; None: the built-in benchmark's default roles).
  """

  pretrain: Dataset
  held_out: Dataset
  sequence: tuple[Dataset, ...]
  fingerprint: str
  pretrain_eval: str = PRETRAIN_EVAL
  held_out_eval: str = HELD_OUT_EVAL
  roles: dict | None = None

  def eval_sets(self) -> list[tuple[str, Dataset]]:
    """(eval-set name, dataset) of every eval set: pre-training, held-out, each dataset."""
    return [(self.pretrain_eval, self.pretrain), (self.held_out_eval, self.held_out)] + [
      (d.name, d) for d in self.sequence
    ]


def load_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The run's data: the built-in benchmark (config.data.root is None) or real data.

  With `data.root` set the paper's protocol's real data is loaded (`load_real_benchmark`);
  otherwise the built-in benchmark, sequence ordered by sequence_seed.

  Raises:
    MissingInputsError: real data with missing files (one error listing all of them).
  """
  if uses_real_data(config):
    return load_real_benchmark(config)
  settings = config.data.builtin
  bench = builtin.ensure_benchmark(
    os.path.join(expand_path(config.cache_dir), "builtin"),
    seed=settings.seed,
    num_pretrain_train=settings.num_pretrain_train,
    num_pretrain_val=settings.num_pretrain_val,
    num_held_out_val=settings.num_held_out_val,
    num_downstream_train=settings.num_downstream_train,
    num_downstream_test=settings.num_downstream_test,
    downstream=tuple(settings.downstream),
  )
  pretrain = Dataset("pretrain", bench.pretrain_train.source(), bench.pretrain_val.source())
  held_out = Dataset(HELD_OUT_EVAL, None, bench.held_out_val.source())
  sequence = [Dataset(d.name, d.train.source(), d.test.source()) for d in bench.downstream]
  sequence = shuffled(sequence, config.sequence_seed)
  return Benchmark(pretrain, held_out, tuple(sequence), fingerprint=bench.fingerprint)


def load_real_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The paper's data: Objects365, LVIS val and the ODinW sequence.

  pre-training set = Objects365 (train: the buffer's images; val: evaluated as 'o365'),
  held-out = LVIS val (evaluated as 'lvis': AP, and APr as the rare column), sequence = the
  `data.odinw_datasets` (train / valid / test splits) shuffled by `sequence_seed`.

  Raises:
    MissingInputsError: see `validation.check_inputs`.
  """
  from owl_cl.data import odinw  # pylint: disable=g-import-not-at-top
  from owl_cl.data import pretraining  # pylint: disable=g-import-not-at-top

  validation.check_inputs(config)
  root = expand_path(config.data.root)
  names = validation.odinw_names(config)
  subset_seed = config.data.get("subset_seed", 0)
  sequence = []
  for name in names:
    split = lambda s, name=name: odinw.odinw_source(root, name, s, subset_seed=subset_seed)
    sequence.append(
      Dataset(
        name,
        split("train"),
        split("test"),
        valid=split("val"),
        max_detections=odinw.ODINW_DATASETS[name].max_detections,
      )
    )
  sequence = shuffled(sequence, config.sequence_seed)
  pretrain = Dataset(
    OBJECTS365_EVAL,
    pretraining.objects365_source(root, "train"),
    pretraining.objects365_source(root, "val"),
  )
  held_out = Dataset(LVIS_EVAL, None, pretraining.lvis_source(root, "val"), evaluation="lvis")
  roles = {
    "pretrain": {"eval_set": OBJECTS365_EVAL, "label": "O365"},
    "open_vocab": {"eval_set": LVIS_EVAL, "label": "LVIS"},
    "held_out": {"eval_set": LVIS_EVAL, "AP": "APr", "AP50": None, "label": "LVIS rare"},
    "downstream": [d.name for d in sequence],
    "downstream_label": "ODinW mean",
  }
  fingerprint = digest({"root": root, "datasets": names, "subset_seed": subset_seed})
  return Benchmark(
    pretrain,
    held_out,
    tuple(sequence),
    fingerprint=fingerprint,
    pretrain_eval=OBJECTS365_EVAL,
    held_out_eval=LVIS_EVAL,
    roles=roles,
  )


def stage_eval_names(config: ml_collections.ConfigDict, bench: Benchmark, index: int) -> list[str]:
  """The eval sets evaluated after dataset `index` (1-based) of the sequence.

  The final stage evaluates every set; earlier stages the downstream sets per
  `eval.downstream_after_each_dataset` ('all' | 'seen': datasets 1..index) plus the
  pre-training and held-out sets if `eval.pretraining_sets_after_each_dataset`.
  Stage 0 (after pre-training) always evaluates everything (the "No fine-tuning" row).

  Raises:
    ConfigError: an unknown `eval.downstream_after_each_dataset`.
  """
  names = [d.name for d in bench.sequence]
  everything = [bench.pretrain_eval, bench.held_out_eval] + names
  if index >= len(bench.sequence):
    return everything
  mode = validation.check_downstream_eval_mode(config)
  out = []
  if config.eval.pretraining_sets_after_each_dataset:
    out += [bench.pretrain_eval, bench.held_out_eval]
  return out + (names if mode == "all" else names[:index])

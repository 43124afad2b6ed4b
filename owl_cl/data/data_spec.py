"""`DataSpec`: the `data` section of the config, each field written once (`owl_cl.config_spec`).

The section's fields with their defaults, rules, docs and cache-key roles; `configs/base.py`
builds `c.data` from it (`config_spec.defaults(DataSpec)`), `config_rules.FIELD_RULES` takes
its rules, docs/configs.md its rows. Nested: `AugmentSpec` (`data.augment`, scenic's training
augmentations, read by `input_pipeline.train_dataset`) and `BuiltinSpec` (`data.builtin`, defined
beside its generator, `builtin.ensure_benchmark`, which takes its fields).

Cache keys: `config_spec.key_material(settings, cache)` of the section is the `data` part of
the pre-trained model's and the buffer's keys (`owl_cl.cache_keys`); the fields the buffer's
builder does not read (augmentations, training prompts) say so (`key={'buffer': ...}`), so a
new keyed field enters both keys with no other edit.

Source: docs/reference.md §3 (queries and targets per image), §5 (preprocessing and
augmentation), §10 (the paper's datasets); docs/data.md (dataset entries).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from owl_cl import config_spec as cs
from owl_cl.config_fields import boolean
from owl_cl.config_fields import choice
from owl_cl.config_fields import declared
from owl_cl.config_fields import integer
from owl_cl.config_fields import integers
from owl_cl.config_fields import interval
from owl_cl.config_fields import names
from owl_cl.config_fields import probabilities
from owl_cl.config_fields import real
from owl_cl.config_fields import text
from owl_cl.data import coco
from owl_cl.data import odinw
from owl_cl.data import prompts
from owl_cl.data import suites
from owl_cl.data.builtin import BuiltinSpec

__all__ = [
  "AugmentSpec",
  "BuiltinSpec",
  "DataSpec",
  "settings",
]

# The reasons of the fields left out of cache keys.
_DATASETS = (
  "names datasets; a cached pre-trained model or buffer is keyed by the contents of the "
  "pre-training annotation file it read (pretrain_data), not by their declaration"
)
_DOWNSTREAM = "chooses downstream or evaluation sets, which no cached model or buffer reads"
_HOW = "how the data is read, not what: the same examples"
# The training example's fields the buffer's builder does not read (`buffer.BufferExample`).
_NOT_THE_BUFFERS = "the buffer's images are not augmented (they are re-made from the source)"
_BUFFER_PROMPTS = "the buffer's queries are the class names (`Detector.class_tokens`), not prompts"


@dataclasses.dataclass(frozen=True)
class AugmentSpec:
  """`data.augment`: scenic's training augmentations (docs/reference.md §5); all off by
  default. Neither the buffer's images nor evaluation images are augmented."""

  hflip: bool = cs.field(False, boolean, "Random horizontal flip with p = 0.5 (scenic).")
  random_crop: bool = cs.field(
    False, boolean, "scenic's random crop, sized by the three `crop_*` fields."
  )
  crop_area_range: tuple = cs.field(
    (0.3, 1.0), interval(0.0, 1.0), "The crop's area as a fraction of the image's (low, high)."
  )
  crop_aspect_ratio_range: tuple = cs.field(
    (0.75, 1.33), interval(0.0), "The crop's aspect ratio, width / height (low, high)."
  )
  crop_min_area_fraction: float = cs.field(
    0.6, real(0.0, 1.0), "A box keeping less than this fraction of its area is dropped."
  )
  mosaic_sizes: tuple | None = cs.field(
    None,
    integers(1, optional=True),
    "Mosaics of k x k images for each k here (scenic: (1, 2, 3)); None: no mosaics.",
    type_=tuple,
  )
  mosaic_probs: tuple = cs.field(
    (0.4, 0.3, 0.3), probabilities, "The probability of each of `mosaic_sizes` (scenic's)."
  )


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """`data`: the run's datasets, what a training example holds and how images are read."""

  root: str | None = cs.field(
    None,
    text(optional=True),
    "The data root of real data (docs/paper_protocol.md layout); None: the built-in benchmark.",
    type_=str,
    key=_DATASETS,
  )
  sequence: list | None = cs.field(
    None,
    declared(list),
    "The downstream sequence: a list of dataset entries or suites (docs/data.md); None: the "
    "built-in benchmark's, or with `root` the paper's.",
    type_=cs.UNTYPED,
    key=_DATASETS,
  )
  pretrain: dict | None = cs.field(
    None,
    declared(dict),
    "One entry, the pre-training and replay source (train split: the buffer's candidates; "
    "test, else val: the pre-training proxy eval); None as `sequence`.",
    type_=cs.UNTYPED,
    key=_DATASETS,
  )
  held_out: dict | None = cs.field(
    None,
    declared(dict),
    "One entry, the held-out (open-vocabulary) eval set (test, else val); None as `sequence`.",
    type_=cs.UNTYPED,
    key=_DATASETS,
  )
  zero_shot: list | None = cs.field(
    None,
    declared(list),
    "Further zero-shot eval sets evaluated with the pre-training sets, e.g. COCO val 2017 "
    "(docs/ivlod.md); None: none.",
    type_=cs.UNTYPED,
    key=_DOWNSTREAM,
  )
  odinw13_variant: str | None = cs.field(
    None,
    choice(list(suites.ODINW13_VARIANTS), optional=True),
    "The ODinW-13 an 'odinw13' suite item without `variant` reads: 'glip' or 'zira' "
    "(docs/ivlod.md); None: 'glip'.",
    type_=str,
    key=_DOWNSTREAM,
  )
  num_queries: int = cs.field(
    24,
    integer(1),
    "Q, queries per training image: '' + positives + negatives, padded with ''. 24 > the 20 "
    "pre-training classes of the built-in benchmark.",
  )
  num_negatives: int = cs.field(
    23, integer(0), "Random negative class names per training image, at most."
  )
  max_instances: int = cs.field(8, integer(1), "M, target boxes per image.")
  num_workers: int = cs.field(0, integer(0), "grain worker processes; 0: in process.", key=_HOW)
  prefetch_batches: int = cs.field(
    1,
    integer(0),
    "Training batches read ahead by a background thread (owl_cl.train.prefetch); 0: in the "
    "loop's thread. Same results.",
    key=_HOW,
  )
  validate_images: bool = cs.field(
    True,
    boolean,
    "Decode every image of every split before training, once per split and data version "
    "(owl_cl.data.scan); False checks only that no split is empty.",
    key="a check before the run; it changes no example",
  )
  exif_orientation: str = cs.field(
    "ignore",
    choice(coco.EXIF_ORIENTATIONS),
    "An image with an EXIF orientation tag: 'ignore' decodes the stored pixels (COCO's "
    "frame), 'apply' turns them as the tag says, 'refuse' names the file (reference §5).",
  )
  squash_resize: bool = cs.field(
    False, boolean, "Resize to S x S ignoring the aspect ratio (released code, HF)."
  )
  merge_iou: float | None = cs.field(
    0.9,
    real(0.0, 1.0, low_open=True, optional=True),
    "Boxes with IoU >= this become one multi-label instance (scenic); None: off.",
  )
  negatives_by_frequency: bool = cs.field(
    False,
    boolean,
    "Draw random negatives by label frequency (released code's add_negatives), not uniformly.",
  )
  host_sharding: bool = cs.field(
    False,
    boolean,
    "Each JAX process reads a disjoint part of every training set (grain "
    "ShardByJaxProcess); False: every process reads everything.",
    key="which process reads which part of a training set; one process reads it all",
  )
  augment: AugmentSpec = cs.section(
    AugmentSpec, "Training augmentations (scenic).", key={"buffer": _NOT_THE_BUFFERS}
  )
  eval_batch_size: int = cs.field(
    64,
    integer(1),
    "Images per evaluation batch, and per batch when the buffer scores its candidates.",
    key="per-image outputs do not depend on the batch they are computed in",
  )
  train_prompt_templates: str = cs.field(
    "none",
    choice(sorted(prompts.TRAIN_TEMPLATE_SETS)),
    "Training prompts (reference §2): 'none' the bare class name; 'clip_80' one template "
    "per label and image from ['{}'] + the 80 CLIP ImageNet templates.",
    key={"buffer": _BUFFER_PROMPTS},
  )
  builtin: BuiltinSpec = cs.section(BuiltinSpec, "The generated built-in benchmark.")
  odinw_datasets: tuple = cs.field(
    odinw.ODINW_NAMES,
    names(what="ODinW dataset"),
    "The paper's ODinW datasets, picked and ordered (the 'odinw_paper' suite).",
    key=_DOWNSTREAM,
    preset="paper",
  )
  subset_seed: int = cs.field(
    0,
    integer(0),
    "The seed of the balanced ODinW training subsets (EgoHands, Brackish, ASL).",
    key=_DOWNSTREAM,
    preset="paper",
  )


def settings(config: Any) -> DataSpec:
  """The typed `data` section of `config` (a run's ConfigDict), every field checked.

  Raises:
    ConfigError: a bad or unknown field, one line each ('config.data.<field>=<value> ...').
  """
  return cs.from_config(DataSpec, config.data, "data")

"""The `replay` section of the config, each field written once (`owl_cl.config_spec`).

`ReplaySpec` is `config.replay`: the retrieval algorithm and its hyperparameters
(`retrieval.spec.RetrievalSpec`, which it extends), the replay ratio, deduplication, DER++,
the loop's options, the store's, `loss_adaptivity` (`LossAdaptivitySpec`) and the one-off
buffer selection with its budget (`SelectionSpec`). `configs/base.py` builds the section's
defaults from it, `config_rules.FIELD_RULES` its rules, and `setup.make_algorithm`,
`setup.check_replay_config` and `setup.build_options` read the typed settings
(`settings(config)`). A field that enters the buffer's cache key is `key=True`; every other
field says why it does not (`config_spec.not_in_keys`). Sources: docs/reference.md §6-§9,
docs/released_code.md, docs/baselines.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from owl_cl import config_spec
from owl_cl.config_fields import FINITE
from owl_cl.config_fields import FRACTION
from owl_cl.config_fields import LOSS_ADAPTIVITY_MODES
from owl_cl.config_fields import NON_NEGATIVE
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import boolean
from owl_cl.config_fields import budget as budget_rule
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.config_fields import text
from owl_cl.replay import buffer_selection
from owl_cl.replay import store_cache
from owl_cl.replay.retrieval import dedup as dedup_lib
from owl_cl.replay.retrieval import registry
from owl_cl.replay.retrieval.spec import RETRIEVAL_ONLY
from owl_cl.replay.retrieval.spec import RetrievalSpec

# The value of `replay.algorithm` that turns replay off (fine-tuning on the new data alone).
NO_REPLAY = "none"
_IN_TRAINING = "how replays enter the loss in training; the buffer is selected before it"
_UNREAD = "read by no code: Visual Genome contributes no image to the paper's buffer"


def algorithm_names() -> list[str]:
  """The values of `replay.algorithm`: every registered algorithm (`registry.ALGORITHMS`, read
  when called, so an algorithm registered later is one) and 'none'."""
  return sorted(registry.ALGORITHMS) + [NO_REPLAY]


@dataclasses.dataclass(frozen=True)
class SelectionSpec:
  """`config.replay.selection`: the one-off buffer selection from the pre-training set (paper
  eq. 7, docs/reference.md §6; `buffer_selection.select_buffer`, `build.BufferSpec`)."""

  loss_threshold: float = config_spec.field(
    0.3, FINITE, "Eq. 7's t: images whose pre-trained detection loss is below it are kept."
  )
  min_per_class: int = config_spec.field(
    20, integer(0), "Each class is then topped up to this many images in ascending loss order."
  )
  fill_all_for_rare_classes: bool = config_spec.field(
    False, boolean, "True adds all images of a class that has fewer (released code)."
  )
  max_instances_per_prototype: int = config_spec.field(
    6, integer(1), "n_c's cap: a prototype averages an image's best min(n_c, #instances) tokens."
  )
  distance_max_instances: int | None = config_spec.field(
    None,
    integer(1, optional=True),
    "An image's prototype distance is the min over at most this many of its class-c tokens "
    "(None: all its instances, the paper; 6: the released code).",
    type_=int,
  )
  drop_images_without_class: bool = config_spec.field(
    False, boolean, "True drops images without an instance of a buffer class (released code)."
  )
  top_up_order: str = config_spec.field(
    "class_index",
    choice(buffer_selection.TOP_UP_ORDERS),
    "Order in which classes are topped up: 'class_index' or 'first_appearance' (released code).",
  )
  prototype_images: str = config_spec.field(
    "buffer",
    choice(buffer_selection.PROTOTYPE_IMAGES),
    "Images the class prototypes average: 'buffer' (the selected ones) or 'all' (every "
    "pre-training image, released code).",
  )
  objectness_in_loss: bool = config_spec.field(
    False,
    boolean,
    "OWLv2: whether eq. 7's loss includes the objectness term (docs/owlv2.md); False keeps the "
    "v1 detection loss, the units of loss_threshold.",
  )
  visual_genome_loss_threshold: float = config_spec.field(
    0.0,
    FINITE,
    "The paper's threshold for Visual Genome images (0.0 keeps none: losses are >= 0).",
    key=_UNREAD,
    preset="paper",
  )
  visual_genome_min_per_class: int = config_spec.field(
    0,
    integer(0),
    "The paper's top-up of Visual Genome classes (0: none, as in the released code).",
    key=_UNREAD,
    preset="paper",
  )


@dataclasses.dataclass(frozen=True)
class LossAdaptivitySpec:
  """`config.replay.loss_adaptivity`: replay only for new images not yet learned (paper §4
  eqs. 5-6, Table 4; docs/reference.md §9)."""

  mode: str = config_spec.field(
    "none",
    choice(LOSS_ADAPTIVITY_MODES),
    "'none' (1:1 replay, the paper's main results), 'paper' (replay for the new images whose "
    "pre-step loss exceeds the threshold; needs ratio 1) or 'released_gate' (released code: "
    "drop the replay loss on steps whose mean new loss is below it).",
    key=_IN_TRAINING,
  )
  threshold: float = config_spec.field(
    0.3,
    FINITE,
    "l, in detection-loss units; the paper gives no value, 0.3 is the buffer's loss threshold.",
    key=_IN_TRAINING,
  )
  gate_per_device: bool = config_spec.field(
    False,
    boolean,
    "'released_gate': each device gates its replay loss on its own new loss (released code).",
    key=_IN_TRAINING,
  )
  gate_feature_based_only: bool = config_spec.field(
    False,
    boolean,
    "'released_gate' only for the feature-based algorithms (released code); the others train "
    "with mode 'none'.",
    key=_IN_TRAINING,
  )


@dataclasses.dataclass(frozen=True)
class _ReplayHead:
  """The fields of `config.replay` before the retrieval hyperparameters (`ReplaySpec`)."""

  algorithm: str = config_spec.field(
    "swil",
    choice(algorithm_names),
    "The retrieval algorithm (paper Table 2): a name of `registry.ALGORITHMS`, or 'none' for "
    "no replay.",
    key="the buffer is the same for every algorithm (see aser.asv_features)",
  )
  ratio: float = config_spec.field(
    1.0, POSITIVE, "Replayed images per new image (paper: 1:1).", key=_IN_TRAINING
  )
  dedup: str = config_spec.field(
    "dataset",
    choice(dedup_lib.SCHEDULE_NAMES),
    "When replayed images may be replayed again: 'none', 'epoch', 'dataset' or 'fraction' "
    "(docs/reference.md §8).",
    key=RETRIEVAL_ONLY,
  )
  dedup_fraction: float = config_spec.field(
    1.0 / 3.0,
    FRACTION,
    "'fraction': the dedup mask resets after this fraction of the buffer is replayed.",
    key=RETRIEVAL_ONLY,
  )
  dedup_without_replacement: bool = config_spec.field(
    False,
    boolean,
    "dedup 'none': True samples each call without replacement (released code).",
    key=RETRIEVAL_ONLY,
  )
  dedup_fraction_reset: str = config_spec.field(
    "before",
    choice(dedup_lib.FRACTION_RESETS),
    "'fraction': reset inside the call that would pass the fraction ('before') or after the "
    "call that passed it ('after', released code).",
    key=RETRIEVAL_ONLY,
  )
  der_alpha: float = config_spec.field(
    2.0, NON_NEGATIVE, "DER++'s logit distillation weight alpha.", key=_IN_TRAINING
  )
  der_beta: float = config_spec.field(
    1.0, NON_NEGATIVE, "DER++'s replay detection-loss weight beta.", key=_IN_TRAINING
  )
  der_objectness_weight: float = config_spec.field(
    1.0,
    NON_NEGATIVE,
    "OWLv2: weight of the objectness logits' MSE in DER++'s distillation, relative to the "
    "class logits' (docs/owlv2.md); 0 distils the class logits only.",
    key=_IN_TRAINING,
  )


# The base class listed last gives the first fields: the section's fields keep the order of
# the config files (the algorithm, its ratio, dedup and DER++; the retrieval hyperparameters;
# the loop's and the store's options, loss adaptivity and the buffer selection).
@dataclasses.dataclass(frozen=True)
class ReplaySpec(RetrievalSpec, _ReplayHead):
  """`config.replay` (docs/reference.md §6-§9): `RetrievalSpec`'s hyperparameters and these."""

  records: bool = config_spec.field(
    True,
    boolean,
    "Write the retrieval's analysis records (paper Figs. 3-5) to <workdir>/records.",
    key="what the run writes about its retrievals, not what it computes",
  )
  lookahead: bool = config_spec.field(
    True,
    boolean,
    "Retrieve and gather step t+1's replays while step t trains (`setup.Replay.look_ahead`); "
    "exact: the same results bit for bit.",
    key="how the loop overlaps its steps, not what it computes",
  )
  stale_retrieval: bool = config_spec.field(
    False,
    boolean,
    "Feature-based retrievals read the parameters of one step before (an approximation, not "
    "in the paper, that lets them overlap the step too); needs lookahead.",
    key=_IN_TRAINING,
  )
  top_k: int = config_spec.field(
    8, integer(1), "k, the class embeddings per image the buffer stores and retrieval compares."
  )
  image_cache: str | None = config_spec.field(
    "replay_images",
    text(optional=True),
    "Folder where the buffer's decoded images are kept (relative: inside cache_dir); None "
    "decodes them at every replay.",
    key="where decoded images are kept; the store is the same",
  )
  store_verification: str = config_spec.field(
    "full",
    choice(store_cache.STORE_VERIFICATIONS),
    "How a cached store is checked when loaded: 'full' hashes every file first, 'lazy' each "
    "chunk when first read (docs/stored_state.md).",
    key="how the store is checked when read, not what it holds",
  )
  loss_adaptivity: LossAdaptivitySpec = config_spec.section(
    LossAdaptivitySpec, "Loss adaptivity (paper eqs. 5-6)."
  )
  budget: Any = config_spec.field(
    None,
    budget_rule,
    "The buffer's size (docs/baselines.md): None keeps eq. 7's; a float in (0, 1] a fraction "
    "of the pre-training set, an int an image count.",
    type_=object,
  )
  selection: SelectionSpec = config_spec.section(SelectionSpec, "The buffer selection (eq. 7).")


def settings(config: ml_collections.ConfigDict) -> ReplaySpec:
  """The typed `config.replay` (`config_spec.from_config`), every field checked.

  Raises:
    ConfigError: one line per bad field, naming it and its value.
  """
  return config_spec.from_config(ReplaySpec, config.replay, "replay")

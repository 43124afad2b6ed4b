"""The `eval` config section, written once (`config_spec`): how the detector is evaluated.

`Detector` converts `config.eval` to `EvalSpec` once and scores every evaluation with it;
the experiment reads which sets are evaluated after each dataset. Its module sits above
`data` and `train` (it names their prompt sets and ensemble modes) and below `configs`
(docs/architecture.md, "Layers").
"""

from __future__ import annotations

import dataclasses

from owl_cl import config_spec
from owl_cl.config_fields import boolean
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.data import prompts
from owl_cl.eval import category_shards
from owl_cl.eval import coco_eval
from owl_cl.train import step as step_lib

#: `eval.downstream_after_each_dataset`: after each dataset, every downstream set or those seen.
DOWNSTREAM_EVAL_MODES = ("all", "seen")

# Why no evaluation field enters a cache key: evaluations are computed anew by every run (the
# pre-trained model's entry stores its validation AP for information only, not as a result).
_SCORED_EACH_RUN = "how outputs are scored, anew by every run; no cache entry holds a result"


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """`config.eval`: detections per image, the protocols' settings, prompts and which sets are
  evaluated between datasets (docs/reference.md §4)."""

  top_k: int = config_spec.field(
    100, integer(1), "Detections kept per image (COCO protocol).", key=_SCORED_EACH_RUN
  )
  max_dets: int = config_spec.field(100, integer(1), "COCOeval's maxDets.", key=_SCORED_EACH_RUN)
  multi_label: bool = config_spec.field(
    False,
    boolean,
    "False: each token's detection takes its argmax class (exclusive datasets); True: "
    "every (token, class) pair competes for the top k.",
    key=_SCORED_EACH_RUN,
  )
  downstream_after_each_dataset: str = config_spec.field(
    "all",
    choice(DOWNSTREAM_EVAL_MODES),
    "After each dataset, evaluate all downstream sets or only those seen so far; the final "
    "stage and stage 0 always evaluate every set.",
    key=_SCORED_EACH_RUN,
  )
  pretraining_sets_after_each_dataset: bool = config_spec.field(
    True,
    boolean,
    "Whether the pre-training and held-out sets (O365, LVIS in the paper config) are "
    "evaluated after each dataset too.",
    key=_SCORED_EACH_RUN,
  )
  prompt_templates: str = config_spec.field(
    "none",
    choice(lambda: sorted(prompts.EVAL_TEMPLATE_SETS)),
    "Query prompts (docs/reference.md §2): `none`, the bare class name; `owl_vit_7`, the 7 "
    "OWL-ViT templates ensembled per `ensemble`.",
    key=_SCORED_EACH_RUN,
  )
  ensemble: str = config_spec.field(
    "logits",
    choice(step_lib.ENSEMBLE_MODES),
    "How the templates' class scores combine: `logits` (scenic) or `probabilities` (the "
    "released code).",
    key=_SCORED_EACH_RUN,
  )
  lvis_top_k: int = config_spec.field(
    300,
    integer(1),
    "LVIS protocol: the multi-label top (token, class) pairs kept per image.",
    key=_SCORED_EACH_RUN,
  )
  lvis_max_dets: int = config_spec.field(
    300,
    integer(1),
    "LVIS protocol: detections per image of the lvis API's federated AP.",
    key=_SCORED_EACH_RUN,
  )
  report_ivlod: bool = config_spec.field(
    False,
    boolean,
    "Adds the IVLOD metric block (docs/ivlod.md) to results.json and results.md.",
    key=_SCORED_EACH_RUN,
  )
  coco_backend: str = config_spec.field(
    "pycocotools",
    choice(coco_eval.COCO_BACKENDS),
    "The COCOeval implementation of the COCO-protocol sets (ODinW, Objects365): `pycocotools` "
    "(the reference) or `faster_coco_eval` (its C++ port, the `fast_coco` extra: the same 12 "
    "statistics and per-class AP to 1e-12 in tests/eval/test_coco_backends.py, about 10x "
    "faster; Objects365 val's 80,000 images are hours of pycocotools).",
    key=_SCORED_EACH_RUN,
  )
  scoring_processes: int = config_spec.field(
    1,
    integer(1),
    "Processes that score an evaluation set in category shards side by side (both "
    "protocols; spawned, each shard's ground truth and detections only): the same floats "
    "as one pass (`owl_cl.eval.category_shards`). A set of more detections than "
    f"{category_shards.SHARD_DETECTIONS:,} is scored in shards of about that many even at 1, "
    "one worker process each, so that Objects365 val fits in host memory. In a multi-process "
    "run the processes share the shards (each scores every P-th one, with this many workers).",
    key=_SCORED_EACH_RUN,
  )
  save_detections: bool = config_spec.field(
    False,
    boolean,
    "Also writes each stage's detections of every eval set (per image: class, box, score) to "
    "<workdir>/detections/<stage>/<eval set>.json.gz (`owl_cl.eval.detection_files`).",
    key=_SCORED_EACH_RUN,
  )

"""The retrieval algorithms' hyperparameters as config fields (`config.replay.<name>`,
`config.replay.aser.<name>`), each written once: its default, rule, doc and cache-key role.

`RetrievalSpec` holds the hyperparameters the Table 2 compositions share (SWIL's and GRASP's
weights, the balanced order, A-SW-GRASP's switch, the released code's options) and
`AserSpec` those of the ASV algorithms (paper suppl. Table 7, docs/reference.md §7).
`owl_cl.replay.spec.ReplaySpec` extends `RetrievalSpec` with the rest of the `replay`
section. A field of either is a hyperparameter of every algorithm whose steps take an argument
of its name (`compose.keyword_hyperparameters`): `setup.make_algorithm` passes it on, and
`registry.get_algorithm` checks a value against the field's rule (`hyperparameter_rules`).

None of these enters a cache key: the buffer is selected before any retrieval and is the same
for every algorithm (`owl_cl.cache_keys.buffer_key_material`); the one exception,
`aser.asv_features`, reaches the buffer's key through what the buffer then stores.
"""

from __future__ import annotations

import dataclasses

from owl_cl import config_spec
from owl_cl.config_fields import FINITE
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import Rule
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.config_fields import real
from owl_cl.replay.retrieval import adaptive
from owl_cl.replay.retrieval import asv
from owl_cl.replay.retrieval import class_selection
from owl_cl.replay.retrieval import compose
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import sample_selection
from owl_cl.replay.retrieval import steps

# Why a retrieval hyperparameter is not in the buffer's cache key.
RETRIEVAL_ONLY = "a retrieval setting: the buffer is selected before any retrieval"


@dataclasses.dataclass(frozen=True)
class AserSpec:
  """`config.replay.aser`: the ASV algorithms (ASER, ASER-PC, SW-ASER-PC; paper §3.3, suppl.
  Table 7, docs/reference.md §7)."""

  num_candidates: int | None = config_spec.field(
    None,
    integer(1, optional=True),
    "N_c, the candidates scored per retrieval call; None takes the algorithm's paper value "
    "(ASER 168, the -PC variants 352).",
    key=RETRIEVAL_ONLY,
    type_=int,
  )
  knn_k: int = config_spec.field(
    20, integer(1), "K of the KNN Shapley value recursion (paper eq. 3).", key=RETRIEVAL_ONLY
  )
  asv_c: float = config_spec.field(
    0.15, FINITE, "c of paper eq. 4, the dynamic weight of the ASV's two terms.", key=RETRIEVAL_ONLY
  )
  asv_token_matching: str = config_spec.field(
    "all_to_all",
    choice(knn_shapley.TOKEN_MATCHING),
    "Which tokens of two images the KNN distances compare: 'all_to_all' (paper) or "
    "'nearest_token' (released code).",
    key=RETRIEVAL_ONLY,
  )
  asv_distance: str = config_spec.field(
    "l2",
    choice(knn_shapley.DISTANCES),
    "Distance of the KNN Shapley values: 'l2' (released code) or 'cosine'.",
    key=RETRIEVAL_ONLY,
  )
  asv_weight_reduction: str = config_spec.field(
    "min",
    choice(sample_selection.WEIGHT_REDUCTIONS),
    "Reduction of eq. 4's per-token weights: 'min' (paper) or 'max' (released code).",
    key=RETRIEVAL_ONLY,
  )
  asv_chunk_size: int = config_spec.field(
    64,
    integer(1),
    "Images per chunk of ASER-PC's precomputed left term (rounded up to a multiple of the "
    "devices); memory per device is about 10 float32 [chunk / devices * k, N * k].",
    key="how the precomputation is chunked, not what it computes",
  )
  asv_left_term: bool = config_spec.field(
    True,
    choice((True, False)),
    "False drops the ASV's value-to-the-buffer term, ASV = -(right term) (released option "
    "no_buff=True).",
    key=RETRIEVAL_ONLY,
  )
  asv_shapley: str = config_spec.field(
    "knn",
    choice(knn_shapley.SHAPLEY),
    "Shapley value of both ASV terms: 'knn' (paper) or 'tknn', the thresholded KNN-SV of the "
    "released option SV_type='TKNN'.",
    key=RETRIEVAL_ONLY,
  )
  asv_distance_threshold: float | None = config_spec.field(
    None,
    real(0.0, low_open=True, optional=True),
    "'tknn': candidates at this distance or farther do not count (released l2_thresh); "
    "None: no threshold.",
    key=RETRIEVAL_ONLY,
    type_=float,
  )
  tknn_num_classes: float = config_spec.field(
    400.0, POSITIVE, "'tknn': C of its (u - 1/C) term (released code: 400).", key=RETRIEVAL_ONLY
  )
  candidate_subsets: str = config_spec.field(
    "shared",
    choice(asv.CANDIDATE_SUBSETS),
    "SW-ASER-PC's candidates: 'shared' (paper, the top of one set) or 'per_image' (released "
    "option caser.balanced=True: each new image draws N_c / B from its own SWIL class).",
    key=RETRIEVAL_ONLY,
  )
  asv_features: str = config_spec.field(
    "class_embeddings",
    choice(asv.ASV_FEATURES),
    "Tokens the ASV's distances compare: 'class_embeddings' (paper) or 'image_features' (the "
    "ViT's output tokens, released option cls_embeds=False; the buffer then stores them too).",
    key="enters the buffer's key as the image features it stores, with an ASV algorithm only",
  )


@dataclasses.dataclass(frozen=True)
class RetrievalSpec:
  """The hyperparameters the retrieval algorithms share (`config.replay.<name>`; paper
  Table 2, docs/reference.md §7, docs/released_code.md for the released code's options)."""

  swil_weight: float = config_spec.field(
    1.0, FINITE, "SWIL's similarity weighting exponent w (paper: 1.0).", key=RETRIEVAL_ONLY
  )
  swil_reduction: str = config_spec.field(
    "min",
    choice(class_selection.SWIL_REDUCTIONS),
    "SWIL's distance over an image's k top embeddings: 'min' (paper) or 'mean' (released "
    "option swil_reduce_type='avg').",
    key=RETRIEVAL_ONLY,
  )
  grasp_weight: float = config_spec.field(
    1.0,
    FINITE,
    "GRASP's prototype weighting exponent w (paper: 1.0; released code: 0.7).",
    key=RETRIEVAL_ONLY,
  )
  balanced_order: str = config_spec.field(
    "sequential",
    choice(steps.BALANCED_ORDERS),
    "Class order of the balanced step: 'sequential' (paper) or 'reshuffled' (released code: "
    "a random permutation, reshuffled after every pass).",
    key=RETRIEVAL_ONLY,
  )
  adaptive_entropy_threshold: float = config_spec.field(
    0.99,
    FINITE,
    "A-SW-GRASP's tau: GRASP for a new image whose SWIL distribution's normalised entropy "
    "exceeds it (the paper gives no value, only 'too close to 1.0').",
    key=RETRIEVAL_ONLY,
  )
  adaptive_entropy_classes: str = config_spec.field(
    "eligible",
    choice(adaptive.ADAPTIVE_ENTROPY_CLASSES),
    "A-SW-GRASP's entropy over the 'eligible' classes (still holding an unreplayed image) or "
    "'all' classes of the buffer (released code).",
    key=RETRIEVAL_ONLY,
  )
  exhausted_class: str = config_spec.field(
    "fallback",
    choice(compose.EXHAUSTED_CLASS),
    "A class out of unreplayed images within a call: 'fallback' (its slot draws among the "
    "remaining images) or 'redraw' (released code).",
    key=RETRIEVAL_ONLY,
  )
  within_class_weighting: str = config_spec.field(
    "uniform",
    choice(steps.WITHIN_CLASS_WEIGHTINGS),
    "Draw within a class where the paper draws uniformly (A-SW-GRASP's SWIL slots, the ASER "
    "candidates): 'uniform' (paper) or 'grasp' (released option bal_prob_type='GRASP').",
    key=RETRIEVAL_ONLY,
  )
  forgetting_temperature: float = config_spec.field(
    1.0,
    real(0.0, low_open=True),
    "Forgetting-aware retrieval's T: within a class, p_i follows softmax(rise_i / T), rise_i "
    "the rise of image i's training loss (loss units) since its reference "
    "(`retrieval.forgetting`).",
    key=RETRIEVAL_ONLY,
  )
  forgetting_exploration: float = config_spec.field(
    0.1,
    real(0.0, 1.0),
    "Forgetting-aware retrieval's eps: the share of each draw made uniformly within the class, "
    "so every eligible image stays drawable (unobserved images otherwise score the mean "
    "observed rise).",
    key=RETRIEVAL_ONLY,
  )
  aser: AserSpec = config_spec.section(AserSpec, "The ASV algorithms' hyperparameters.")


def hyperparameter_rules() -> dict[str, Rule]:
  """{hyperparameter name: its field's rule} over `RetrievalSpec` and its `aser` section
  (`registry.get_algorithm` checks a value passed by name with it)."""
  return {
    path.rsplit(".", 1)[-1]: rule for path, rule in config_spec.rules(RetrievalSpec, "").items()
  }

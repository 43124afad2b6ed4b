"""Retrieval algorithms by their paper Table 2 names: what configs and `replay.setup` call.

`ALGORITHMS` is the registry (`register` adds to it).
`get_algorithm(name, dedup=..., **hyperparameters)` looks a name up in `ALGORITHMS`, rejects
unknown hyperparameters and option values, and builds the algorithm. The call protocol of
what it returns: `owl_cl.replay.retrieval` (package docstring). Source: paper Table 2, suppl.
Table 7; docs/reference.md §7-§8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from owl_cl.replay.retrieval import adaptive
from owl_cl.replay.retrieval import asv
from owl_cl.replay.retrieval import dedup as dedup_lib
from owl_cl.replay.retrieval import forgetting
from owl_cl.replay.retrieval import spec
from owl_cl.replay.retrieval.compose import Composition
from owl_cl.replay.retrieval.steps import balanced_step
from owl_cl.replay.retrieval.steps import prototype_weighted_step
from owl_cl.replay.retrieval.steps import similarity_weighted_step
from owl_cl.replay.retrieval.steps import uniform_in_class_step
from owl_cl.replay.retrieval.steps import uniform_step

# The Table 2 compositions (hyperparameter defaults: paper suppl. Table 7 / docs/reference.md §7).
# The one list of retrieval algorithms: configs, validation, the sweep script, the docs' table
# and the tests iterate it; `register` adds one from another module.
ALGORITHMS: dict[str, Any] = {
  "uniform": Composition(None, uniform_step),
  "uniform_balanced": Composition(balanced_step, uniform_in_class_step),
  "grasp": Composition(balanced_step, prototype_weighted_step),
  "swil": Composition(similarity_weighted_step, uniform_in_class_step),
  "sw_grasp": Composition(similarity_weighted_step, prototype_weighted_step),
  "a_sw_grasp": adaptive.AdaptiveComposition(),
  "aser": asv.AsvComposition(balanced_step, precomputed=False, num_candidates=168),
  "aser_pc": asv.AsvComposition(balanced_step, precomputed=True, num_candidates=352),
  "sw_aser_pc": asv.AsvComposition(similarity_weighted_step, precomputed=True, num_candidates=352),
  # Beyond the paper: forgetting-aware sample selection (after mix-cd, arXiv 2402.08096),
  # named as Table 2 names GRASP's pair: the balanced class step unprefixed, 'sw_' with SWIL's.
  "forgetting_aware": forgetting.ForgettingComposition(balanced_step),
  "sw_forgetting_aware": forgetting.ForgettingComposition(similarity_weighted_step),
}


def register(name: str, entry: Any) -> Any:
  """Adds the retrieval algorithm `entry` to `ALGORITHMS` under `name` and returns it.

  `entry` is what `get_algorithm` builds from: a `compose.Composition` of a class step and a
  sample step (docs/extending.md, "A retrieval algorithm"), or an object with the same
  `hyperparameter_names` and `build(name, dedup, hyperparameters)`. Every hyperparameter of
  its steps must be a field of `spec.RetrievalSpec` (checked here), so the config passes it on
  and validates it. From then on `name` is a valid `replay.algorithm`.

  Raises:
    ValueError: `name` already registered or 'none', or a hyperparameter that
      `spec.RetrievalSpec` does not define (listing them).
  """
  if name in ALGORITHMS or name == "none":
    raise ValueError(f"retrieval algorithm {name!r} is already registered")
  unknown = sorted(set(entry.hyperparameter_names) - set(spec.hyperparameter_rules()))
  if unknown:
    raise ValueError(
      f"retrieval algorithm {name!r} takes hyperparameters {unknown} that are no field of "
      "replay.spec.RetrievalSpec: add them there (default, rule, doc)"
    )
  ALGORITHMS[name] = entry
  return entry


def get_algorithm(
  name: str, *, dedup: str | dedup_lib.DedupSchedule = "dataset", **hyperparameters
):
  """Looks up a retrieval algorithm by its Table 2 name and binds its hyperparameters.

  Args:
    name: one of `ALGORITHMS` ('uniform', 'uniform_balanced', 'grasp', 'swil', 'sw_grasp',
      'a_sw_grasp', 'aser', 'aser_pc', 'sw_aser_pc').
    dedup: dedup schedule name ('none' | 'epoch' | 'dataset' | 'fraction' (1/3)) or a
      DedupSchedule (e.g. `DedupSchedule('fraction', 0.25)`); default 'dataset' (docs/reference.md
      §8).
    **hyperparameters: the algorithm's hyperparameters (`ALGORITHMS[name].hyperparameter_names`),
      e.g. `swil_weight` (w of SWIL, 1.0), `grasp_weight` (w of GRASP, 1.0),
      `balanced_order` ('sequential' | 'reshuffled'), `adaptive_entropy_threshold` (tau),
      `num_candidates`, `knn_k` (20), `asv_c` (0.15), `asv_token_matching`, `asv_distance`,
      `asv_weight_reduction`, `asv_chunk_size`, and the released code's options
      `within_class_weighting` ('uniform' | 'grasp'), `asv_left_term`, `asv_shapley`
      ('knn' | 'tknn'), `asv_distance_threshold`, `tknn_num_classes`, `candidate_subsets`
      ('shared' | 'per_image'), `asv_features` ('class_embeddings' | 'image_features').
  Returns:
    a callable `(rstate, buffer, features, num_replay, active=None) -> (indices, valid, rstate)`.
  Raises:
    ValueError: unknown algorithm name (listing the known ones), unknown hyperparameter for
      that algorithm (listing the accepted ones), or unknown dedup schedule / option value.
  Source: paper Table 2, docs/reference.md §7-§8.
  """
  if name not in ALGORITHMS:
    raise ValueError(f"unknown retrieval algorithm {name!r}; known: {sorted(ALGORITHMS)}")
  entry = ALGORITHMS[name]
  accepted = tuple(entry.hyperparameter_names)
  unknown = sorted(set(hyperparameters) - set(accepted))
  if unknown:
    raise ValueError(
      f"retrieval algorithm {name!r} got unknown hyperparameters {unknown}; "
      f"accepted: {sorted(accepted)} (and dedup)"
    )
  _check_option_values(hyperparameters)
  return entry.build(name, dedup_lib.as_schedule(dedup), dict(hyperparameters))


def _check_option_values(hp: Mapping[str, Any]):
  """Each hyperparameter's value against the rule of its config field (`spec.RetrievalSpec`)."""
  rules = spec.hyperparameter_rules()
  for field, value in hp.items():
    if problem := rules[field](value):
      raise ValueError(f"retrieval hyperparameter {field}={value!r} {problem}")

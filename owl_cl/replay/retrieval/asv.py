"""The ASV algorithms: ASER, ASER-PC and SW-ASER-PC (adversarial Shapley value retrieval).

A candidate set is drawn by a class step and a within-class sample step, scored by the
adversarial Shapley value against the new batch (`knn_shapley`, `sample_selection`), and the
top-scoring candidates are replayed. Source: paper §4, eqs. (3)-(4), suppl. §C;
docs/reference.md §7.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from owl_cl.replay.retrieval import asv_left
from owl_cl.replay.retrieval import compose
from owl_cl.replay.retrieval import dedup as dedup_lib
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import sample_selection
from owl_cl.replay.retrieval import steps
from owl_cl.replay.state import ReplayBuffer
from owl_cl.replay.state import ReplayState
from owl_cl.train.sharding import fetch_replicated
from owl_cl.train.sharding import replicate

Array = jax.Array

# ASV candidate sets: 'shared' (one set for the batch, the top candidates replayed; paper) |
# 'per_image' (SW-ASER only: each new image draws N_c / B candidates from its own SWIL class
# and replays the best of its own subset; the released option `caser.balanced=True`).
CANDIDATE_SUBSETS = ("shared", "per_image")
# Tokens the ASV's KNN distances are measured between: the class embeddings (paper, released
# default) | the ViT's output image tokens of the same top-k tokens (released option
# cls_embeds=False). The utility stays the cosine of the query embeddings.
ASV_FEATURES = ("class_embeddings", "image_features")


def _distance_ranks(distances: Array) -> Array:
  """int32 ranks (1 = nearest, ties by index) along the last axis; +inf entries rank last."""
  order = jnp.argsort(distances, axis=-1, stable=True)
  return (jnp.argsort(order, axis=-1, stable=True) + 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AsvAlgorithm(compose.AlgorithmBase):
  """ASER / ASER-PC / SW-ASER-PC: a candidate set drawn by a class step + uniform sample
  step (N_c distinct eligible images, not marked), scored by the adversarial Shapley value
  against the new batch; the top-scoring candidates are replayed (one per active slot).

  Attributes:
    name, dedup: as `RetrievalAlgorithm`.
    candidate_class_step: `balanced_step` (ASER, ASER-PC) or `similarity_weighted_step`
      (SW-ASER-PC; candidate j serves new image j mod B).
    precomputed: ASER-PC: the left term is `ReplayState.asv_left` (whole buffer as candidate
      and evaluation set, `prepare`); else computed over the candidate set each call.
    num_candidates: N_c (paper 168 ASER, 352 ASER-PC).
    knn_k: K of the KNN-SV (paper 20).
    asv_c: c of eq. 4 (paper 0.15).
    asv_token_matching: 'all_to_all' (paper) | 'nearest_token' (released code).
    asv_distance: 'l2' (released code; the paper does not say) | 'cosine'.
    asv_weight_reduction: 'min' (paper eq. 4) | 'max' (released code).
    asv_chunk_size: evaluation images per chunk of the precomputation.
    within_class_weighting: candidates drawn within their class 'uniform' (paper) | 'grasp'
      (prototype-weighted with `grasp_weight`; released `bal_prob_type='GRASP'`).
    grasp_weight: w of the 'grasp' candidate draw (released `ub_coeff`).
    asv_left_term: True (eq. 3) | False: ASV = -(right term), the candidates' value to the
      buffer is ignored (released `no_buff=True`); the precomputation is then skipped.
    asv_shapley: 'knn' (paper) | 'tknn' (released `SV_type='TKNN'`,
      `knn_shapley.threshold_knn_shapley`) for both terms.
    asv_distance_threshold: TKNN's distance threshold (released `l2_thresh`; None: none).
    tknn_num_classes: C of TKNN's 1/C term (released 400).
    candidate_subsets: 'shared' (paper) | 'per_image' (similarity-weighted candidate step
      only; released `caser.balanced=True`): new image b draws one SWIL class and N_c / B
      candidates of that class (fewer if it runs out; no fallback to other classes); the
      ASV is computed as usual over all N_c candidates and slot j (new image b = j mod B)
      replays the (j div B)-th best candidate of image b's subset.
    asv_features: 'class_embeddings' (paper) | 'image_features' (released `cls_embeds=False`):
      the KNN distances are between `features[asv_features]` and `buffer.<asv_features>`.
    class_hyperparameters: (name, value) of the candidate class step.
  Source: paper §4, eqs. (3)-(4), suppl. §C; docs/reference.md §7.
  """

  name: str
  dedup: dedup_lib.DedupSchedule
  candidate_class_step: Callable
  precomputed: bool
  num_candidates: int = 168
  knn_k: int = 20
  asv_c: float = 0.15
  asv_token_matching: str = "all_to_all"
  asv_distance: str = "l2"
  asv_weight_reduction: str = "min"
  asv_chunk_size: int = 64
  within_class_weighting: str = "uniform"
  grasp_weight: float = 1.0
  asv_left_term: bool = True
  asv_shapley: str = "knn"
  asv_distance_threshold: float | None = None
  tknn_num_classes: float = knn_shapley.TKNN_NUM_CLASSES
  candidate_subsets: str = "shared"
  asv_features: str = "class_embeddings"
  class_hyperparameters: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if self.candidate_subsets == "per_image" and (
      self.candidate_class_step is not steps.similarity_weighted_step
    ):
      raise ValueError(
        f"{self.name}: candidate_subsets='per_image' needs the similarity-weighted candidate "
        "step (sw_aser_pc); the released code has per-image subsets for SW-ASER only"
      )

  needs_features = True

  def _distance_tokens(self, buffer: ReplayBuffer) -> Array:
    """The buffer's [N, k, D] tokens the KNN distances are measured between."""
    tokens = getattr(buffer, self.asv_features)
    if tokens is None:
      raise ValueError(
        f"{self.name}: asv_features={self.asv_features!r} needs a buffer with image_features "
        "(built with replay.aser.asv_features='image_features')"
      )
    return tokens

  def _shapley_options(self) -> dict[str, Any]:
    """Keyword arguments of `knn_shapley.image_knn_shapley` shared by both terms."""
    return dict(
      token_matching=self.asv_token_matching,
      distance=self.asv_distance,
      shapley=self.asv_shapley,
      threshold=self.asv_distance_threshold,
      num_classes=self.tknn_num_classes,
    )

  def left_term_options(self) -> dict:
    """What the precomputed left term depends on besides the buffer (its cache key's
    material, `asv_left.left_term_options`)."""
    return asv_left.left_term_options(
      self.knn_k, features=self.asv_features, **self._shapley_options()
    )

  def prepare(
    self, rstate: ReplayState, buffer: ReplayBuffer, *, mesh=None, cache_prefix=None
  ) -> ReplayState:
    """Fills `asv_left`/`asv_left_min` over the whole buffer once (precomputed variants).

    Host-side loop over jitted chunks sharded over `mesh` (`asv_left.compute_left_term`;
    None: the mesh the buffer is replicated on, else one device). With `cache_prefix` (the
    cached replay store's folder) the result is cached next to the store and the computation
    resumes after an interruption (`asv_left.cached_left_term`). A no-op when already
    `asv_left_ready` (e.g. restored from a checkpoint), for ASER, or without the left term
    (`asv_left_term=False`).
    """
    if (
      not self.precomputed
      or not self.asv_left_term
      or bool(fetch_replicated(rstate.asv_left_ready))
    ):
      return rstate
    tokens = self._distance_tokens(buffer)
    mesh = asv_left.mesh_of(tokens, mesh)
    arguments = (tokens, buffer.query_embeddings, self.left_term_options())
    settings = dict(mesh=mesh, chunk_size=self.asv_chunk_size)
    if cache_prefix is None:
      left, left_min = asv_left.compute_left_term(*arguments, **settings)
    else:
      left, left_min = asv_left.cached_left_term(cache_prefix, *arguments, **settings)
    # Replicated on the mesh as the buffer (global arrays in a multi-process run).
    left, left_min = replicate((jnp.asarray(left), jnp.asarray(left_min)), mesh)
    return rstate.replace(asv_left=left, asv_left_min=left_min, asv_left_ready=jnp.ones((), bool))

  def _select(
    self, class_key, sample_key, rstate, buffer, features, eligible, class_eligible, active, pool
  ):
    steps.require_features(
      features,
      ("class_embeddings", "query_embeddings", self.asv_features),
      f"retrieval {self.name!r}",
    )
    tokens = self._distance_tokens(buffer)
    num, n_c = active.shape[0], int(self.num_candidates)
    if n_c < num:
      raise ValueError(f"{self.name}: num_candidates={n_c} < num_replay={num}")
    classes, candidate_active, rstate, class_records = self._candidate_classes(
      class_key, rstate, buffer, features, class_eligible, active
    )
    candidates, candidate_valid = self._draw_candidates(
      sample_key, buffer, eligible, classes, candidate_active, pool
    )
    asv, right, distances = self._scores(
      rstate, buffer, features, tokens, candidates, candidate_valid
    )
    chosen, valid = self._choose(asv, candidate_valid, active, features)
    indices = candidates[chosen]
    # Records (paper Fig. 5): distance ranks of candidates per new image.
    ranks = _distance_ranks(distances)  # [B, N_c]
    lowest = jnp.argmin(jnp.where(candidate_valid[None, :], right, jnp.inf), axis=-1)
    min_sv_rank = jnp.take_along_axis(ranks, lowest[:, None], axis=-1)[:, 0]
    selected_rank = jnp.where(valid, jnp.min(ranks[:, chosen], axis=0), -1)
    records = {
      "sampled_classes": jnp.where(valid, classes[chosen], -1),
      "knn_sv": right,
      "knn_sv_valid": candidate_valid,
      "min_sv_rank": min_sv_rank,
      "selected_rank": selected_rank,
    }
    if "swil_entropy" in class_records:
      records["swil_entropy"] = class_records["swil_entropy"]
    return indices, valid, rstate, records

  def _subset_size(self, features) -> tuple[int, int]:
    """(B, N_c / B) of candidate_subsets='per_image'; ValueError if B does not divide N_c."""
    n_c = int(self.num_candidates)
    batch = features["class_embeddings"].shape[0]
    if n_c % batch:
      raise ValueError(
        f"{self.name}: candidate_subsets='per_image' needs num_candidates={n_c} divisible "
        f"by the new batch size {batch}"
      )
    return batch, n_c // batch

  def _candidate_classes(self, class_key, rstate, buffer, features, class_eligible, active):
    """The class of each of the N_c candidates: int32 [N_c] classes, bool [N_c] active
    candidates, the advanced rstate and the class step's records."""
    class_hp = dict(self.class_hyperparameters)
    if self.candidate_subsets == "per_image":
      batch, subset = self._subset_size(features)
      num = active.shape[0]
      # A new image draws its subset if any slot it serves (slot j -> image j mod B) is active.
      image_active = (
        jnp.zeros((batch,), jnp.int32).at[jnp.arange(num) % batch].max(active.astype(jnp.int32)) > 0
      )
      image_classes, rstate, class_records = self.candidate_class_step(
        class_key, rstate, buffer, features, class_eligible, image_active, **class_hp
      )
      # Candidate b * subset + r belongs to new image b.
      classes = jnp.repeat(image_classes, subset)
      candidate_active = jnp.repeat(image_active, subset)
    else:
      candidate_active = jnp.broadcast_to(jnp.any(active), (int(self.num_candidates),))
      classes, rstate, class_records = self.candidate_class_step(
        class_key, rstate, buffer, features, class_eligible, candidate_active, **class_hp
      )
    return classes, candidate_active, rstate, class_records

  def _draw_candidates(self, sample_key, buffer, eligible, classes, candidate_active, pool):
    """int32 [N_c] distinct eligible candidates of the given classes and bool [N_c] valid."""
    # Per-image subsets stop at an exhausted class (released): no fallback to other classes.
    fallback = self.candidate_subsets != "per_image"
    if self.within_class_weighting == "grasp":
      # Released bal_prob_type='GRASP': the candidates of a class are drawn prototype-weighted.
      return sample_selection.prototype_weighted_in_class(
        sample_key,
        steps.class_index_of(buffer),
        eligible,
        classes,
        self.grasp_weight,
        candidate_active,
        without_replacement=True,
        fallback=fallback,
        pool=pool,
      )
    return sample_selection.uniform_in_class_active(
      sample_key,
      steps.class_index_of(buffer),
      eligible,
      classes,
      candidate_active,
      without_replacement=True,
      fallback=fallback,
      pool=pool,
    )

  def _scores(self, rstate, buffer, features, tokens, candidates, candidate_valid):
    """The candidates' ASV float32 [N_c] (eq. 4), right-term KNN-SVs float32 [B, N_c] and
    the new images' distances to them float32 [B, N_c]."""
    options = self._shapley_options()
    right, distances = knn_shapley.image_knn_shapley(
      features[self.asv_features],
      features["query_embeddings"],
      tokens[candidates],
      buffer.query_embeddings[candidates],
      self.knn_k,
      candidate_valid,
      reduction="min",
      **options,
    )  # [B, N_c]
    n_c = candidates.shape[0]
    if not self.asv_left_term:
      # Released no_buff: ASV = -(right term), i.e. zero left term (w irrelevant).
      left_term, extreme = jnp.zeros((n_c,), jnp.float32), jnp.float32(0.0)
    elif self.precomputed:
      left_term = rstate.asv_left[candidates]
      if self.asv_weight_reduction == "min":
        extreme = jnp.min(jnp.where(candidate_valid, rstate.asv_left_min[candidates], jnp.inf))
      else:
        extreme = jnp.max(jnp.where(candidate_valid, left_term, -jnp.inf))
      extreme = jnp.where(jnp.isfinite(extreme), extreme, 0.0)
    else:
      cand_class = tokens[candidates]
      cand_query = buffer.query_embeddings[candidates]
      left, _ = knn_shapley.image_knn_shapley(
        cand_class,
        cand_query,
        cand_class,
        cand_query,
        self.knn_k,
        candidate_valid,
        reduction="max",
        **options,
      )  # [N_c, N_c]
      left_term, extreme = sample_selection.left_term_and_extreme(
        left, candidate_valid, self.asv_weight_reduction
      )
    asv, _ = sample_selection.asv_from_terms(
      left_term, extreme, right, candidate_valid, self.asv_c, self.asv_weight_reduction
    )
    return asv, right, distances

  def _choose(self, asv, candidate_valid, active, features):
    """The candidate each replay slot takes, int32 [num], and bool [num] valid slots."""
    num, n_c = active.shape[0], asv.shape[0]
    if self.candidate_subsets == "per_image":
      batch, subset = self._subset_size(features)
      # Slot j: the (j div B)-th best candidate of new image (j mod B)'s subset.
      image = jnp.arange(num) % batch
      rank = jnp.arange(num, dtype=jnp.int32) // batch
      own = jnp.argsort(-asv.reshape(batch, subset), axis=-1, stable=True)  # [B, subset]
      rank_c = jnp.clip(rank, 0, subset - 1)
      chosen = image * subset + own[image, rank_c]
      count = jnp.sum(candidate_valid.reshape(batch, subset), axis=-1, dtype=jnp.int32)
      return chosen, active & (rank < count[image])
    order = jnp.argsort(-asv, stable=True)  # best first
    rank = jnp.clip(jnp.cumsum(active, dtype=jnp.int32) - 1, 0, n_c - 1)
    return order[rank], active & (rank < jnp.sum(candidate_valid, dtype=jnp.int32))


_ASV_NAMES = (
  "num_candidates",
  "knn_k",
  "asv_c",
  "asv_token_matching",
  "asv_distance",
  "asv_weight_reduction",
  "within_class_weighting",
  "grasp_weight",
  "asv_left_term",
  "asv_shapley",
  "asv_distance_threshold",
  "tknn_num_classes",
  "candidate_subsets",
  "asv_features",
)


@dataclasses.dataclass(frozen=True)
class AsvComposition:
  """Registry entry of an ASV algorithm: candidate class step, precomputed left term or not,
  and the default candidate set size N_c."""

  candidate_class_step: Callable
  precomputed: bool
  num_candidates: int

  @property
  def hyperparameter_names(self) -> tuple[str, ...]:
    extra = ("asv_chunk_size",) if self.precomputed else ()
    return compose.keyword_hyperparameters(self.candidate_class_step) + _ASV_NAMES + extra

  def build(self, name, dedup, hyperparameters):
    class_names = compose.keyword_hyperparameters(self.candidate_class_step)
    own = {k: v for k, v in hyperparameters.items() if k not in class_names}
    own.setdefault("num_candidates", self.num_candidates)
    return AsvAlgorithm(
      name=name,
      dedup=dedup,
      candidate_class_step=self.candidate_class_step,
      precomputed=self.precomputed,
      class_hyperparameters=tuple(
        (k, v) for k, v in sorted(hyperparameters.items()) if k in class_names
      ),
      **own,
    )

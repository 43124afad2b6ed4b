"""Forgetting-aware retrieval: replay the buffer images whose loss rose most (after mix-cd).

mix-cd (Bai, Yeh, Hsieh and Taly, "Which Pretrain Samples to Rehearse when Finetuning
Pretrained Models?", arXiv 2402.08096) rehearses the pre-training samples that fine-tuning is
actually damaging ("collateral damage"), estimated without extra forward passes from the
outcomes of the samples it already rehearses. Here that is a sample step within each slot's
class, composable with the class steps (`steps.py`):

  rise_i  = L_latest(i) - L_ref(i)                        for an observed image,
          = mean of rise over the observed images          otherwise (0 when none is),
  p_i     = (1 - eps) softmax_i(rise / T) + eps / M        over the M eligible members of
                                                           the slot's class,

with T = `forgetting_temperature` (loss units) and eps = `forgetting_exploration`. The
unobserved images' prior is mix-cd's: its bins without an observed sample take the mean
estimate, so they are neither favoured nor starved; eps keeps every eligible image drawable.
With all rises equal the draw is uniform within the class (`uniform_in_class_step`'s
distribution).

State (`ForgettingReplayState`, a `ReplayState` with two more fields, made by
`ForgettingAlgorithm.prepare`; every other algorithm keeps the plain `ReplayState`, so its
checkpoints are unchanged: orbax records even a None field in a checkpoint's tree, and a tree
with one more node would not restore a checkpoint written without it): `forget_latest`
float32 [N], each image's latest observed training loss (NaN: never observed), and
`forget_reference` float32 [N], L_ref (NaN: none yet).

Schedule: the replayed images' own per-example losses from the train step (`observe_losses`,
free: the step computes them for DER++). L_ref is an image's first observed loss unless given
(`with_reference_losses`): the store keeps no pre-trained loss (pass 1 of the build computes
it and discards it), and the step's loss is the training loss, so the first observation
compares like with like; the rise it measures starts at the first replay, not at
pre-training (docs/reference.md "Forgetting-aware retrieval").
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from owl_cl.replay import class_index as class_index_lib
from owl_cl.replay.retrieval import compose
from owl_cl.replay.retrieval import steps
from owl_cl.replay.state import ReplayBuffer
from owl_cl.replay.state import ReplayState

Array = jax.Array


@flax.struct.dataclass
class ForgettingReplayState(ReplayState):
  """`ReplayState` plus the forgetting-aware retrieval's losses (module docstring).

  Attributes (beyond `ReplayState`'s):
    forget_latest: float32 [N]; each image's latest observed training loss (loss units; NaN:
      never observed).
    forget_reference: float32 [N]; each image's reference loss L_ref (NaN: none yet).
  """

  forget_latest: Array = None
  forget_reference: Array = None


def initial_state(rstate: ReplayState) -> ForgettingReplayState:
  """`rstate` as a `ForgettingReplayState` with nothing observed (all NaN); a
  `ForgettingReplayState` (a restored one) is returned as it is.

  Args:
    rstate: a `ReplayState` of N images.
  Returns:
    ForgettingReplayState with `forget_latest` and `forget_reference` float32 [N] NaN.
  """
  if isinstance(rstate, ForgettingReplayState):
    return rstate
  nan = jnp.full((rstate.num_images,), jnp.nan, jnp.float32)
  fields = {f.name: getattr(rstate, f.name) for f in dataclasses.fields(ReplayState)}
  # Two arrays, not one: a jit that donates the state rejects a buffer two leaves share.
  return ForgettingReplayState(**fields, forget_latest=nan, forget_reference=jnp.array(nan))


def _require_state(rstate: ReplayState) -> None:
  if not isinstance(rstate, ForgettingReplayState):
    raise ValueError(
      "ReplayState has no forgetting fields: call the forgetting algorithm's prepare(rstate, "
      "buffer) (or forgetting.initial_state) before its first retrieval"
    )


def observe_losses(rstate: ReplayState, indices, valid, losses) -> ReplayState:
  """Records a train step's per-example losses of its replayed images (jittable).

  Args:
    rstate: a `ForgettingReplayState` (`initial_state`).
    indices: int [R] buffer indices of the step's replay slots.
    valid: bool [R]; False slots (invalid replays, masked out of the loss) are ignored.
    losses: float [R] the step's per-example training losses of the slots
      (`der.der_replay_terms`' `per_example_replay`, loss units).
  Returns:
    ReplayState with `forget_latest[i] = loss` at every valid slot's image and
    `forget_reference[i]` set to it where it was NaN (an image's first observation). A slot
    with a non-finite loss is ignored. Two valid slots of one image: the last one wins.
  Raises:
    ValueError: `rstate` is no `ForgettingReplayState`.
  """
  _require_state(rstate)
  losses = jnp.asarray(losses, jnp.float32)
  valid = jnp.asarray(valid, bool) & jnp.isfinite(losses)
  n = rstate.num_images
  # Invalid slots scatter out of range (index N), which mode='drop' discards.
  target = jnp.where(valid, jnp.asarray(indices, jnp.int32), n)
  latest = rstate.forget_latest.at[target].set(losses, mode="drop")
  reference = rstate.forget_reference
  reference = jnp.where(jnp.isnan(reference), latest, reference)
  return rstate.replace(forget_latest=latest, forget_reference=reference)


def with_reference_losses(rstate: ReplayState, losses) -> ReplayState:
  """`rstate` with L_ref set to `losses` (float [N], loss units; NaN: first observation).

  For a caller that has each buffer image's pre-trained training loss (the store does not
  keep one). Raises ValueError for a shape other than [N] or a plain `ReplayState`.
  """
  _require_state(rstate)
  losses = jnp.asarray(losses, jnp.float32)
  if losses.shape != rstate.forget_reference.shape:
    raise ValueError(f"reference losses must be [{rstate.num_images}], got {losses.shape}")
  return rstate.replace(forget_reference=losses)


def forgetting_scores(latest, reference) -> Array:
  """float32 [N]: each image's rise L_latest - L_ref; the mean observed rise where either is
  NaN (never observed), 0 when no image is observed (the module docstring's rule).

  Args:
    latest: float [N] (`ForgettingReplayState.forget_latest`).
    reference: float [N] (`ForgettingReplayState.forget_reference`).
  """
  rise = jnp.asarray(latest, jnp.float32) - jnp.asarray(reference, jnp.float32)
  observed = jnp.isfinite(rise)
  count = jnp.sum(observed)
  prior = jnp.sum(jnp.where(observed, rise, 0.0)) / jnp.maximum(count, 1).astype(jnp.float32)
  return jnp.where(observed, rise, prior)


def forgetting_probs(scores, available, temperature, exploration) -> Array:
  """float32 [..., M]: p_i = (1 - eps) softmax_i(score / T) + eps / M over the available entries.

  Args:
    scores: float [..., M] forgetting scores (loss units; `forgetting_scores`).
    available: bool [..., M]; entries that may be drawn (M = their count).
    temperature: T > 0 (loss units).
    exploration: eps in [0, 1].
  Returns:
    probabilities summing to 1 over the last axis, all zeros where nothing is available.
  """
  available = jnp.asarray(available, bool)
  logits = jnp.where(available, jnp.asarray(scores, jnp.float32) / temperature, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  unnorm = jnp.where(available, jnp.exp(logits - top), 0.0)
  total = unnorm.sum(axis=-1, keepdims=True)
  softmax = unnorm / jnp.where(total > 0, total, 1.0)
  count = jnp.sum(available, axis=-1, keepdims=True).astype(jnp.float32)
  uniform = jnp.where(available, 1.0 / jnp.maximum(count, 1.0), 0.0)
  return (1.0 - exploration) * softmax + exploration * uniform


def _log_or_minus_inf(p: Array) -> Array:
  return jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)


def forgetting_in_class(
  key,
  index,
  eligible,
  classes,
  scores,
  active,
  temperature,
  exploration,
  *,
  without_replacement=True,
  pool=None,
):
  """One image per slot within its class by `forgetting_probs` (jittable).

  As `sample_selection.prototype_weighted_in_class` with forgetting scores instead of
  prototype distances: slots in sequence (lax.scan), a drawn image leaves the pool with
  `without_replacement`, a slot whose class has no eligible member left (or -1) draws
  uniformly among all eligible images, an inactive slot or an empty pool gives index 0,
  valid False. The draw reads the class's own blocks (`class_index.by_class_size`).

  Args:
    key: PRNG key.
    index: `class_index.ClassIndex` (`ReplayBuffer.class_index`).
    eligible: bool [N].
    classes: int [num]; -1 = no class.
    scores: float32 [N] (`forgetting_scores`).
    active: bool [num].
    temperature: T, as `forgetting_probs`.
    exploration: eps, as `forgetting_probs`.
    without_replacement: static.
    pool: optional `class_index.pools(index, eligible)`.
  Returns:
    indices int32 [num], valid bool [num].
  """
  classes = jnp.asarray(classes, jnp.int32)
  num = classes.shape[0]
  keys = jax.random.split(key, num)
  pool = class_index_lib.pools(index, eligible) if pool is None else pool
  # Padding positions hold N: read them as an (unavailable) score 0.
  padded = jnp.concatenate([jnp.asarray(scores, jnp.float32), jnp.zeros((1,), jnp.float32)])

  def step(pool, inputs):
    k, c, on = inputs
    k_weighted, k_uniform = jax.random.split(k)

    def weighted_draw(blocks):
      members, _, in_class = class_index_lib.class_slice(index, c, blocks)
      available = class_index_lib.slice_flags(index, pool, c, blocks) & in_class & on
      probs = forgetting_probs(padded[members], available, temperature, exploration)
      probs = probs.reshape(blocks, index.block)
      # Two-level draw, exactly p_i (as GRASP's): a block by its mass, then a member of it.
      k_block, k_member = jax.random.split(k_weighted)
      block = jax.random.categorical(k_block, _log_or_minus_inf(probs.sum(axis=1)))
      member = jax.random.categorical(k_member, _log_or_minus_inf(probs[block]))
      return members[block * index.block + member], jnp.any(probs > 0)

    weighted, has_member = class_index_lib.by_class_size(index, c, weighted_draw)
    count = jnp.where(on, class_index_lib.all_images_count(index, pool), 0)
    r = jax.random.randint(k_uniform, (), 0, jnp.maximum(count, 1))
    fallback = class_index_lib.rth_available(index, pool, c, jnp.zeros((), bool), r)
    found = has_member | (count > 0)
    chosen = jnp.where(found, jnp.where(has_member, weighted, fallback), 0)
    if without_replacement:
      pool = class_index_lib.remove_image(index, pool, chosen, found)
    return pool, (chosen, found)

  _, (indices, valid) = jax.lax.scan(step, pool, (keys, classes, jnp.asarray(active, bool)))
  return indices, valid


def forgetting_step(
  key,
  rstate,
  buffer,
  features,
  classes,
  eligible,
  active,
  without_replacement,
  pool=None,
  *,
  forgetting_temperature: float = 1.0,
  forgetting_exploration: float = 0.1,
):
  """Forgetting-aware sample step within each slot's class (the module docstring's rule).

  Hyperparameters: `forgetting_temperature` T (loss units, > 0) and `forgetting_exploration`
  eps (in [0, 1]). Records: `forgetting_rise` float32 [num], the drawn image's score (NaN for
  an invalid slot).

  Raises:
    ValueError: no class step (classes None) or a plain `ReplayState` (not prepared).
  """
  del features
  if classes is None:
    raise ValueError(
      "the forgetting sample step draws within a class: compose it with a class step"
    )
  _require_state(rstate)
  scores = forgetting_scores(rstate.forget_latest, rstate.forget_reference)
  indices, valid = forgetting_in_class(
    key,
    steps.class_index_of(buffer),
    eligible,
    classes,
    scores,
    active,
    forgetting_temperature,
    forgetting_exploration,
    without_replacement=without_replacement,
    pool=pool,
  )
  return indices, valid, {"forgetting_rise": jnp.where(valid, scores[indices], jnp.nan)}


@dataclasses.dataclass(frozen=True)
class ForgettingAlgorithm(compose.RetrievalAlgorithm):
  """A class step + `forgetting_step`: its `prepare` makes the forgetting state, and the
  training loop feeds it the replays' losses (`observes_losses`, `observe_losses`)."""

  observes_losses = True

  def prepare(
    self, rstate: ReplayState, buffer: ReplayBuffer, *, mesh=None, cache_prefix=None
  ) -> ReplayState:
    """`initial_state(rstate)`: NaN losses unless restored (`owl_cl.replay.state` rules)."""
    del buffer, mesh, cache_prefix
    return initial_state(rstate)

  def observe(self, rstate, indices, valid, losses) -> ReplayState:
    """`observe_losses` (the loop's write-back after each train step)."""
    return observe_losses(rstate, indices, valid, losses)


@dataclasses.dataclass(frozen=True)
class ForgettingComposition(compose.Composition):
  """Registry entry: a class step followed by `forgetting_step`, built as a
  `ForgettingAlgorithm`."""

  sample_step: object = forgetting_step

  def build(self, name, dedup, hyperparameters) -> ForgettingAlgorithm:
    algorithm = super().build(name, dedup, hyperparameters)
    return ForgettingAlgorithm(
      **{f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)}
    )

"""Retrieval: algorithms by name, composed of primitives (paper Table 2, docs/reference.md §7).

Every algorithm has the signature

    algorithm(rstate, buffer, features, num_replay, active=None) -> (indices, valid, rstate)

  rstate:     `ReplayState` (uses and advances `rstate.key`, the dedup mask and counters,
              the balanced class pointer/order);
  buffer:     `ReplayBuffer` (jnp arrays, passed as an argument, never closed over);
  features:   dict of the new batch: `class_embeddings` float [B, k, E] for algorithms with a
              similarity step, plus `query_embeddings` float [B, k, E] for the ASV algorithms
              (`train.step.make_embed_step`); may be empty for 'uniform', 'uniform_balanced',
              'grasp' (`algorithm.needs_features` tells);
  num_replay: static int, replays to retrieve (1:1 with the new batch: num_replay = B);
  active:     optional bool [num_replay] slot mask (traced; None = all active) for loss
              adaptivity (docs/reference.md §9). Inactive slots return valid False, are not marked
              by
              dedup, do not consume the balanced class pointer and do not count in the
              exhaustion check; the i-th active slot gets what slot i would get with all
              slots active (for balanced: the i-th class of the cycle);
  indices:    int32 [num_replay] buffer indices (0 where invalid); valid: bool [num_replay].

It is jittable with `jax.jit(algorithm, static_argnums=3)`. One call: (1) the in-call dedup
reset if the buffer is exhausted or a 'fraction' period ends (`dedup.auto_reset_if_exhausted`);
(2) eligible images from the dedup mask; (3) the class step (if any) on the classes that still
have an eligible image (others get probability 0 / are skipped); (4) the sample step;
(5) the replays are marked (`dedup.mark_replayed`). `algorithm.retrieve_with_records(...)`
returns, in addition, a dict of per-call analysis records (paper Figures 3-5; see
`RECORD_KEYS`), computed in the same jitted call. `algorithm.prepare(rstate, buffer)` fills
state that is computed once per buffer (ASER-PC's precomputed left term); call it before the
first retrieval (a no-op for the other algorithms).

A new composition is one registry line, e.g. `'grasp': Composition(balanced_step,
prototype_weighted_step)`. Step protocols (hyperparameters are keyword-only arguments with
defaults; `get_algorithm` discovers them by name and rejects unknown ones):

  class step:  step(key, rstate, buffer, features, class_eligible [C], active [num], **hp)
               -> (classes int32 [num] (-1 = no class), rstate, records dict)
  sample step: step(key, rstate, buffer, features, classes [num] | None, eligible [N],
               active [num], without_replacement, pool, **hp)
               -> (indices int32 [num], valid bool [num], records dict)

`pool` is `class_index.pools(buffer.class_index, eligible)`, the per-position availability
the call's class eligibility was computed from: one O(P) pass per call, handed to the sample
step instead of recomputed (XLA does not merge the two: at N = 1M, uniform_balanced took
13 ms with both, 3 ms with one).

Registry entries may also be any other builder object with `hyperparameter_names` and
`build(name, dedup, hyperparameters) -> algorithm`: A-SW-GRASP's per-image switch
(`AdaptiveComposition`) and the ASV algorithms (`AsvComposition`).

Modules (import the module, e.g. `from owl_cl.replay.retrieval import registry`):
  registry.py         the Table 2 names -> algorithms (`ALGORITHMS`, `get_algorithm`): what
                      configs and `replay.setup` call.
  compose.py          the call protocol (`AlgorithmBase`, `RECORD_KEYS`) and the class +
                      sample compositions (`Composition`, `RetrievalAlgorithm`).
  adaptive.py         A-SW-GRASP's per-image switch (`AdaptiveComposition`).
  asv.py              ASER / ASER-PC / SW-ASER-PC (`AsvComposition`, `AsvAlgorithm`).
  steps.py            the class steps and sample steps the compositions are made of.
  class_selection.py  class-level primitives (balanced cycle, SWIL probabilities).
  sample_selection.py sample-level primitives (uniform, GRASP, ASV terms) over the class index.
  dedup.py            the deduplication schedules (docs/reference.md §8).
"""

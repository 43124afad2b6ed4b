"""Jitted steps: training (detection loss + DER++ replay), embedding and prediction.

All steps take parameters and batches as arguments (nothing closed over but the static model
definition and constants) and are compiled with explicit shardings over the device mesh:
batches split along 'data', parameters and optimizer state replicated
(`owl_cl.train.sharding`).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any, NamedTuple

from flax import struct
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from owl_cl import config_fields
from owl_cl.eval import detection
from owl_cl.train import losses
from owl_cl.train import lwf as lwf_lib
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import top_k as top_k_lib
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import LwfSpec
from owl_cl.train.spec import TrainSpec

PyTree = Any
Batch = dict[str, jax.Array]


@struct.dataclass
class TrainState:
  """Parameters and optimizer state of one training stage.

  Attributes:
    step: int32 [] optimizer steps taken in this stage.
    params: the model parameters (scenic tree, float32).
    opt_state: optax state of `tx`.
  """

  step: jax.Array
  params: PyTree
  opt_state: PyTree


@dataclasses.dataclass(frozen=True)
class ReplayLoss:
  """The replay half's loss: DER++ (docs/reference.md §3) and loss adaptivity (§9).

  Attributes:
    alpha: weight of DER++'s logit distillation (`replay.der_alpha`; the paper: 2).
    beta: weight of the replays' detection loss (`replay.der_beta`; the paper: 1).
    objectness_distill_weight: OWLv2's objectness MSE relative to the class logits' in the
      distillation (`replay.der_objectness_weight`; `losses.der_distillation`).
    loss_adaptivity: 'none' L = L_B + L_R; 'paper' L = L_B + (r/|B|) L_R (eq. 6) with r =
      sum of `replay['replay_active']` and L_R over the active replays; 'released_gate' drops
      L_R when L_B < `loss_threshold`.
    loss_threshold: l of 'released_gate', in units of the detection loss.
    loss_gate_groups: G >= 1: 'released_gate' per device as in the released code's DDP
      (G = the device count; `_per_device_gate`).
    observe_losses: the metrics also hold `per_example_replay` float32 [B_r], each replay's
      detection loss (no gradient), for a retrieval that reads them (forgetting-aware:
      `owl_cl.replay.retrieval.forgetting`); the loop takes it out before logging.

  Raises:
    ValueError: an unknown `loss_adaptivity`, or `loss_gate_groups` < 1.
  """

  alpha: float = 2.0
  beta: float = 1.0
  objectness_distill_weight: float = 1.0
  loss_adaptivity: str = "none"
  loss_threshold: float = 0.0
  loss_gate_groups: int = 1
  observe_losses: bool = False

  def __post_init__(self):
    if self.loss_adaptivity not in config_fields.LOSS_ADAPTIVITY_MODES:
      raise ValueError(
        f"unknown loss_adaptivity {self.loss_adaptivity!r}; known: "
        f"{config_fields.LOSS_ADAPTIVITY_MODES}"
      )
    if int(self.loss_gate_groups) < 1:
      raise ValueError(f"loss_gate_groups must be >= 1, got {self.loss_gate_groups!r}")


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What a train step computes besides the model and optimizer (`make_train_step`); frozen
  and hashable, so it keys the process's step cache (`owl_cl.train.step_cache`).

  Attributes:
    loss: the detection loss's weights and options (`LossSpec`, `config.loss`; pre-training
      and the buffer use normalization 'per_image').
    replay: the replay half's loss; None: a step without replay (its `replay` argument is
      ignored).
    max_unique_queries: see `_forward` (the text tower embeds each distinct query once);
      None or 0: every query row.
    lwf: LwfSpec when LwF is on (`train.lwf`): the step takes the teacher (the pre-trained
      parameters) as its last argument and adds the LwF terms (`owl_cl.train.lwf`); None: off.
  """

  loss: LossSpec = LossSpec()
  replay: ReplayLoss | None = None
  max_unique_queries: int | None = None
  lwf: LwfSpec | None = None


def create_train_state(params: PyTree, tx: optax.GradientTransformation) -> TrainState:
  """A fresh optimizer over `params` (the paper starts a fresh optimizer per dataset)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def _forward(
  model: nn.Module,
  params: PyTree,
  images,
  queries,
  *,
  train: bool,
  key=None,
  max_unique_queries: int | None = None,
):
  """Model outputs for images [B,S,S,3] and queries [B,Q,L].

  With `max_unique_queries` = U, the text tower embeds only the distinct query rows of the
  batch (a batch draws its queries from a few class names, so B*Q rows hold few distinct ones)
  and the embeddings are gathered back to [B,Q,E]; gradients flow through the gather. If the
  batch has more than U distinct rows, `lax.cond` takes the plain path (same result). In
  training, stochastic depth of the text tower is then drawn per distinct query, not per
  (image, query) pair.
  """
  variables = {"params": params}
  if not max_unique_queries:
    rngs = {"dropout": key} if train else None
    return model.apply(variables, images, queries, train=train, rngs=rngs)
  text_key, image_key = jax.random.split(key) if train else (None, None)
  batch, num_queries, length = queries.shape
  flat = queries.reshape(batch * num_queries, length)
  unique, inverse = jnp.unique(flat, axis=0, size=flat.shape[0], fill_value=0, return_inverse=True)
  inverse = inverse.reshape(batch, num_queries)
  size = min(max_unique_queries, flat.shape[0])
  text_rngs = {"dropout": text_key} if train else None

  def embed_distinct():
    emb = model.apply(
      variables, unique[:size], train=train, rngs=text_rngs, method=type(model).text_embedder
    )
    return emb[jnp.minimum(inverse, size - 1)]

  def embed_all():
    return model.apply(
      variables, queries, train=train, rngs=text_rngs, method=type(model).text_embedder
    )

  query_embeddings = jax.lax.cond(jnp.max(inverse) < size, embed_distinct, embed_all)
  return model.apply(
    variables,
    images,
    None,
    query_embeddings=query_embeddings,
    query_mask=queries[..., 0] > 0,
    train=train,
    rngs={"dropout": image_key} if train else None,
  )


def _new_half(outputs, batch, spec: StepSpec) -> tuple[jax.Array, dict, dict]:
  """The new images' detection loss (`losses.detection_loss`, OWLv2's objectness term with
  its logits): (loss [], its metrics, the loss's dict)."""
  new = losses.detection_loss(
    outputs["pred_logits"],
    outputs["pred_boxes"],
    batch["labels"],
    batch["boxes"],
    objectness_logits=outputs.get("objectness_logits"),  # OWLv2 (docs/owlv2.md)
    **dataclasses.asdict(spec.loss),
  )
  metrics = {"loss": new["loss"], "new_loss": new["loss"]}
  metrics.update({k: v for k, v in new.items() if k not in ("loss", "per_example")})
  return new["loss"], metrics, new


class StepContext(NamedTuple):
  """What the train step's terms (`STEP_TERMS`) read besides their settings.

  Attributes:
    batch: the new images' batch. new: `losses.detection_loss` of the new half (its
      `per_example` float32 [B]). new_outputs: the model's outputs on the new images.
    replay: the replay batch (None: no replay this step); replay_mask: bool [B_r] the replays
      in the loss; replay_outputs: the outputs on them; stored_logits float32 [B_r, T, Q],
      stored_objectness float32 [B_r, T] or None (`_split_outputs`).
    teacher: LwF's pre-trained parameters or None. model, spec: the step's.
  """

  batch: Batch
  new: dict
  new_outputs: dict
  replay: Batch | None
  replay_mask: jax.Array | None
  replay_outputs: dict | None
  stored_logits: jax.Array | None
  stored_objectness: jax.Array | None
  teacher: PyTree
  model: nn.Module
  spec: StepSpec


def _add_lwf(loss, metrics, ctx: StepContext, options: LwfSpec):
  """(loss, metrics) with the LwF terms added (`owl_cl.train.lwf`). The teacher (the
  pre-trained parameters, an argument of the step) scores the new images in eval mode."""
  batch = ctx.batch
  teacher_outputs = jax.lax.stop_gradient(
    _forward(
      ctx.model,
      ctx.teacher,
      batch["images"],
      batch["queries"],
      train=False,
      max_unique_queries=ctx.spec.max_unique_queries,
    )
  )
  terms = lwf_lib.lwf_loss(ctx.new_outputs, teacher_outputs, dataclasses.asdict(options))
  loss = loss + terms["lwf_loss"]
  return loss, dict(metrics, **terms, loss=loss)


def _add_der(loss, metrics, ctx: StepContext, options: ReplayLoss):
  """(loss, metrics) with DER++'s replay terms added (`losses.der_replay_terms`) under
  `options.loss_adaptivity` (`_replay_weighting`); unchanged without a replay batch."""
  if ctx.replay is None:
    return loss, metrics
  # DER++'s distillation inputs (class and, OWLv2, objectness logits; docs/owlv2.md).
  distill_inputs = dict(
    replay_outputs=ctx.replay_outputs,
    stored_logits=ctx.stored_logits,
    stored_objectness=ctx.stored_objectness,
    objectness_distill_weight=options.objectness_distill_weight,
  )
  terms = losses.der_replay_terms(
    replay_targets={"labels": ctx.replay["labels"], "boxes": ctx.replay["boxes"]},
    replay_mask=ctx.replay_mask,
    **distill_inputs,
    **dataclasses.asdict(ctx.spec.loss),
  )
  metrics = dict(metrics, **{k: v for k, v in terms.items() if jnp.ndim(v) == 0})
  result = dict(terms, new_loss=ctx.new["loss"], per_example_new=ctx.new["per_example"])
  loss, weight, used = _replay_weighting(
    loss, result, distill_inputs, ctx.replay, ctx.replay_mask, metrics, options
  )
  metrics.update(loss=loss, replay_weight=weight, replays_in_loss=jnp.sum(used, dtype=jnp.int32))
  if options.observe_losses:
    metrics["per_example_replay"] = jax.lax.stop_gradient(terms["per_example_replay"])
  return loss, metrics


def _lwf_of(train: TrainSpec) -> LwfSpec | None:
  """LwF's settings in a fine-tuning step: `train.lwf` when on, else None (off)."""
  return train.lwf if train.lwf.on else None


@dataclasses.dataclass(frozen=True)
class StepTerm:
  """A term the train step adds to the new images' detection loss.

  Attributes:
    setting: the `StepSpec` field holding its settings (None there: off).
    add: `add(loss [], metrics, ctx: StepContext, settings) -> (loss, metrics)`.
    of_train: `of_train(train: TrainSpec) -> settings or None`, the field's value in a
      fine-tuning step (`trainer._step_spec` fills every term's from it); None: the trainer
      fills the field otherwise (the replay half's from `Replay.train_step_options`).
  """

  setting: str
  add: Callable
  of_train: Callable[[TrainSpec], Any] | None = None


# The train step's terms beyond the detection loss's own (`owl_cl.train.loss_terms`), added
# in this order (the order of the float additions): DER++'s replay half, then LwF.
STEP_TERMS = (StepTerm("replay", _add_der), StepTerm("lwf", _add_lwf, of_train=_lwf_of))


def _split_outputs(outputs, replay, num_new):
  """The forward's outputs over [new ; replay] split into the two halves' dicts
  (`pred_logits`, `pred_boxes`, and OWLv2's `objectness_logits`), and the replay half's stored
  logits float32 [B_r, T, Q] and (OWLv2 stores) stored objectness float32 [B_r, T] or None,
  gathered at the kept tokens when OWLv2's `objectness_top_k` kept only some
  (`keep_tokens`): DER++ distils at the tokens the heads saw."""
  new_outputs, replay_outputs = {}, {}
  for name in ("pred_logits", "pred_boxes", "objectness_logits"):
    if name in outputs:
      new_outputs[name], replay_outputs[name] = outputs[name][:num_new], outputs[name][num_new:]
  stored_logits = replay["stored_logits"].astype(jnp.float32)
  stored_objectness = replay.get("stored_objectness")
  if stored_objectness is not None:
    stored_objectness = jnp.asarray(stored_objectness, jnp.float32)
  if "keep_tokens" in outputs:
    keep = outputs["keep_tokens"][num_new:]
    stored_logits = jnp.take_along_axis(stored_logits, keep[..., None], axis=1)
    if stored_objectness is not None:
      stored_objectness = jnp.take_along_axis(stored_objectness, keep, axis=1)
  return new_outputs, replay_outputs, stored_logits, stored_objectness


def _per_device_gate(base, result, distill_inputs, replay, replay_mask, options: ReplayLoss):
  """'released_gate' per device (the released code's DDP): the new and replay halves split
  into G = `options.loss_gate_groups` contiguous groups, group g's replay term kept iff the
  mean of its per-image new losses is >= `options.loss_threshold`. `distill_inputs`:
  `losses.der_distillation`'s arguments but the example mask. Returns (loss [], weight [] =
  the fraction of open gates, bool [num_slots] whether each replay slot's gate is open);
  `base`: the loss the replay terms are added to."""
  alpha, beta, loss_threshold = options.alpha, options.beta, options.loss_threshold
  g = int(options.loss_gate_groups)
  num_slots = replay["images"].shape[0]
  new_per_group = jax.lax.stop_gradient(result["per_example_new"]).reshape(g, -1).mean(axis=1)
  gates = new_per_group >= loss_threshold  # [G]
  group = jnp.arange(num_slots) // (num_slots // g)  # replay slot -> its device
  mask = jnp.asarray(replay_mask, jnp.float32)
  terms = []
  for d in range(g):  # G is the device count (static, small)
    in_d = mask * (group == d)
    det_d = jnp.sum(in_d * result["per_example_replay"]) / jnp.maximum(jnp.sum(in_d), 1.0)
    mse_d, _ = losses.der_distillation(**distill_inputs, example_mask=in_d)
    terms.append(gates[d] * (alpha * mse_d + beta * det_d))
  weight = jnp.mean(gates.astype(jnp.float32))
  loss = base + jnp.sum(jnp.stack(terms)) / g
  return loss, weight, gates[group]


def _replay_weighting(
  base, result, distill_inputs, replay, replay_mask, metrics, options: ReplayLoss
):
  """(`base` + the weighted replay terms, replay weight, the replays used) under
  `options.loss_adaptivity` (docs/reference.md §9); the gates read the new images' loss
  `result['new_loss']`; `metrics` gains 'num_above_threshold' under 'paper'."""
  loss_adaptivity = options.loss_adaptivity
  replay_total = options.alpha * result["distill_loss"] + options.beta * result["replay_loss"]
  num_slots = replay["images"].shape[0]
  used = replay_mask
  if loss_adaptivity == "none":
    weight = jnp.ones((), jnp.float32)
    loss = base + options.alpha * result["distill_loss"] + options.beta * result["replay_loss"]
  elif loss_adaptivity == "paper":
    # r = replay slots made active by the pre-forward (new images whose loss exceeds l);
    # slot j serves new image j, so |B| = the number of slots (1:1, checked by the caller).
    active = jnp.asarray(replay["replay_active"], bool)
    r = jnp.sum(active, dtype=jnp.int32)
    loss = losses.loss_adaptive_combination(base, replay_total, r, num_slots)
    weight = r.astype(jnp.float32) / num_slots
    metrics["num_above_threshold"] = r
  elif loss_adaptivity == "released_gate" and options.loss_gate_groups > 1:
    loss, weight, gated = _per_device_gate(
      base, result, distill_inputs, replay, replay_mask, options
    )
    used = used & gated
  elif loss_adaptivity == "released_gate":
    gate = jax.lax.stop_gradient(result["new_loss"]) >= options.loss_threshold
    weight = gate.astype(jnp.float32)
    loss = base + weight * replay_total
    used = used & gate
  else:
    raise ValueError(
      f"unknown loss_adaptivity {loss_adaptivity!r}; known: {config_fields.LOSS_ADAPTIVITY_MODES}"
    )
  return loss, weight, used


def _loss_fn(
  params, batch: Batch, replay: Batch | None, key, teacher=None, *, model, spec: StepSpec
):
  """Detection loss of the new half plus DER++ on the replay half (docs/reference.md §3).

  L_T = L_B + weight * L_R with L_R = alpha * distillation + beta * replay detection loss
  (averaged over the replays with `replay_mask`; `spec.replay`: `ReplayLoss`); weight by
  `loss_adaptivity` (docs/reference.md §9):
  'none' 1; 'paper' r / |B| with r = sum(replay['replay_active']) (eq. 6); 'released_gate'
  1 if L_B >= loss_threshold else 0 (L_B of this forward, as the released code).
  With `loss_gate_groups` G > 1 ('released_gate' only) the gate is per device as in the
  released code (DDP): the new and replay halves are split into G contiguous groups (the data
  sharding), group g's gate reads the mean of its images' per-image new losses, and the replay
  term is (1/G) sum_g gate_g * L_R,g with L_R,g = alpha * MSE_g + beta * the mean of group g's
  per-image replay losses (its valid replays). With `spec.lwf` (`train.lwf`), the LwF terms
  of the new images against `teacher`'s outputs are added (`owl_cl.train.lwf.lwf_loss`).
  OWLv2 with `replay['stored_objectness']`: the distillation is MSE_class +
  `objectness_distill_weight` x MSE_objectness (`losses.der_distillation`, docs/owlv2.md).
  `replay` None (or `spec.replay` None): the new half alone.

  The detection loss of the new half is the sum of the registered terms
  (`owl_cl.train.loss_terms`); DER++ and LwF are `STEP_TERMS`, added to it in their order.
  """
  num_new = batch["images"].shape[0]
  if spec.replay is None:
    replay = None
  replay_mask = replay_outputs = stored_logits = stored_objectness = None
  if replay is None:
    new_outputs = _forward(
      model,
      params,
      batch["images"],
      batch["queries"],
      train=True,
      key=key,
      max_unique_queries=spec.max_unique_queries,
    )
  else:
    replay_mask = jnp.asarray(replay["replay_mask"], bool)
    if spec.replay.loss_adaptivity == "paper":  # L_R over the active replays only
      replay_mask = replay_mask & jnp.asarray(replay["replay_active"], bool)
    # One forward over [new ; replay] (docs/reference.md §3).
    outputs = _forward(
      model,
      params,
      jnp.concatenate([batch["images"], replay["images"]], axis=0),
      jnp.concatenate([batch["queries"], replay["queries"]], axis=0),
      train=True,
      key=key,
      max_unique_queries=spec.max_unique_queries,
    )
    new_outputs, replay_outputs, stored_logits, stored_objectness = _split_outputs(
      outputs, replay, num_new
    )
  loss, metrics, new = _new_half(new_outputs, batch, spec)
  ctx = StepContext(
    batch,
    new,
    new_outputs,
    replay,
    replay_mask,
    replay_outputs,
    stored_logits,
    stored_objectness,
    teacher,
    model,
    spec,
  )
  for term in STEP_TERMS:
    settings = getattr(spec, term.setting)
    if settings is not None:
      loss, metrics = term.add(loss, metrics, ctx, settings)
  return loss, metrics


def make_train_step(
  model: nn.Module, tx: optax.GradientTransformation, mesh, spec: StepSpec = StepSpec()
) -> Callable:
  """Builds the jitted, sharded train step.

  Args:
    model: the model the step applies (an `OwlViT`, or its LoRA version).
    tx: the optimizer (`optim.create_optimizer`).
    mesh: the device mesh: batches split along 'data', state replicated.
    spec: what the step computes (`StepSpec`: the loss, the replay half's DER++ and loss
      adaptivity, the distinct-query embedding, LwF).

  Returns:
    `train_step(state: TrainState, batch, replay, key, teacher=None) -> (state, metrics)`;
    `teacher` is the pre-trained parameters (replicated) when `spec.lwf` is set, whose LwF
    terms (`owl_cl.train.lwf`) are added to the loss and to the metrics (`lwf_loss`,
    `lwf_class`, `lwf_box`); `replay` is ignored (pass None) when `spec.replay` is None.
    `batch` holds `images` [B,S,S,3], `queries` [B,Q,L], `labels` [B,M,Q], `boxes` [B,M,4];
    `replay` the same for B_r replayed images plus `stored_logits` [B_r,T,Q] and
    `replay_mask` [B_r] bool, and for an OWLv2 store `stored_objectness` [B_r,T] (DER++
    distils it at `objectness_distill_weight` relative to the class logits:
    `losses.der_distillation`, docs/owlv2.md). Metrics are scalars (loss, its terms, grad
    norm). Loss adaptivity ('paper': B_r = B, r = sum of `replay['replay_active']` bool
    [B_r]): `_loss_fn`. With replay, metrics also hold `replay_weight` (the factor of L_R)
    and `replays_in_loss` (int32, replayed images that contribute to the loss).

  Source: docs/reference.md §3 (DER++ with alpha 2, beta 1; one forward over new and replay),
  docs/reference.md §9 (paper eqs. 5-6; the released code's gate).
  """
  loss_fn = functools.partial(_loss_fn, model=model, spec=spec)
  with_replay = spec.replay is not None
  lwf = spec.lwf is not None

  def step(state: TrainState, batch: Batch, replay: Batch | None, key, teacher=None):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(state.params, batch, replay, key, teacher=teacher)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  data = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)
  if not with_replay:
    fn = lambda state, batch, replay, key, teacher=None: step(state, batch, None, key, teacher)
  else:
    fn = step
  return jax.jit(
    fn,
    # The teacher (LwF only) is replicated like the parameters.
    in_shardings=(rep, data, data if with_replay else None, rep) + ((rep,) if lwf else ()),
    out_shardings=(rep, rep),
    donate_argnums=(0,),
  )


def make_forward_step(model: nn.Module, mesh) -> Callable:
  """Jitted eval-mode forward: `forward(params, images [B,S,S,3], queries [B,Q,L]) -> outputs`.

  Outputs as `OwlViT.__call__` (pred_logits [B,T,Q], pred_boxes [B,T,4], class_embeddings
  [B,T,E], query_embeddings [B,Q,E], feature_map). Used for buffer construction (per-image
  loss, stored logits, top-k embeddings, prototypes).
  """
  data = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)

  def forward(params, images, queries):
    return _forward(model, params, images, queries, train=False)

  return jax.jit(forward, in_shardings=(rep, data, data), out_shardings=data)


def make_text_embed_step(model: nn.Module) -> Callable:
  """Jitted text embedding: `embed(params, tokens [N,L]) -> query_embeddings [N,E]`.

  The text side of evaluation is embedded once per dataset (docs/architecture.md "Sharding").
  """

  def embed(params, tokens):
    out = model.apply(
      {"params": params}, tokens[None], train=False, method=type(model).text_embedder
    )
    return out[0]

  return jax.jit(embed)


def make_predict_step(model: nn.Module, mesh, *, top_k: int, multi_label: bool = False) -> Callable:
  """Jitted prediction for evaluation.

  Returns:
    `predict(params, images [B,S,S,3], query_embeddings [C,E]) -> (scores [B,K],
    labels [B,K] int32 contiguous class index, boxes [B,K,4] cxcywh relative to the padded
    square)` with K = min(top_k, T) (exclusive: argmax class per token then top-K tokens;
    multi-label: top-K (token, class) pairs). Source: docs/reference.md §4.
  """
  data = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)

  def predict(params, images, query_embeddings):
    batch = images.shape[0]
    q = jnp.broadcast_to(query_embeddings[None], (batch,) + query_embeddings.shape)
    mask = jnp.ones(q.shape[:2], bool)
    outputs = model.apply(
      {"params": params}, images, None, query_embeddings=q, query_mask=mask, train=False
    )
    scores = jax.nn.sigmoid(outputs["pred_logits"].astype(jnp.float32))
    return detection.top_predictions(
      scores, outputs["pred_boxes"].astype(jnp.float32), top_k=top_k, multi_label=multi_label
    )

  return jax.jit(predict, in_shardings=(rep, data, rep), out_shardings=data)


#: Prompt-template ensembling modes: scenic's mean of the logits (default) and the released
#: code's mean of the sigmoid probabilities (docs/reference.md §2).
ENSEMBLE_MODES = ("logits", "probabilities")


def template_ensemble_scores(
  model: nn.Module,
  params: PyTree,
  images: jax.Array,
  query_embeddings: jax.Array,
  *,
  ensemble: str = "logits",
) -> tuple[jax.Array, jax.Array]:
  """Class scores ensembled over prompt templates, and boxes (docs/reference.md §2, §4).

  The image is embedded once; the class head runs once per template (`lax.scan`, so memory
  stays at one [B, T, C] logit array per step) and its outputs are averaged:
  'logits' (scenic): scores = sigmoid(mean_p logits_p); 'probabilities' (as in the released
  code): scores = mean_p sigmoid(logits_p). The class head is (sim + shift) * scale per image
  token, so neither equals scoring the mean query embedding; the averaging is on its outputs.

  Args:
    model: an `OwlViT`. params: its parameters.
    images: float [B, S, S, 3] in [0, 1].
    query_embeddings: float [P, C, E]: text embeddings of the C classes under P templates
      (every query real, no mask).
    ensemble: one of `ENSEMBLE_MODES`.

  Returns:
    (scores float32 [B, T, C] in [0, 1], boxes float32 [B, T, 4] cxcywh relative to the
    padded square).

  Raises:
    ValueError: unknown `ensemble`, or query_embeddings not [P, C, E] with P >= 1.

  Source: docs/reference.md §2 (template ensembling), §4; scenic `owl_vit/evaluator.py`
  (`get_predict_fn`:
  class predictor vmapped over templates, outputs averaged, then sigmoid).
  """
  if ensemble not in ENSEMBLE_MODES:
    raise ValueError(f"ensemble must be one of {ENSEMBLE_MODES}, got {ensemble!r}")
  if query_embeddings.ndim != 3 or query_embeddings.shape[0] < 1:
    raise ValueError(
      f"query_embeddings must be [P, C, E] with P >= 1, got {query_embeddings.shape}"
    )
  variables = {"params": params}
  cls = type(model)
  feature_map = model.apply(variables, images, train=False, method=cls.image_embedder)
  batch, h, w, width = feature_map.shape
  features = feature_map.reshape(batch, h * w, width)
  num_templates, num_classes = query_embeddings.shape[:2]
  mask = jnp.ones((batch, num_classes), bool)

  def add_template(total, queries):
    queries = jnp.broadcast_to(queries[None], (batch,) + queries.shape)
    logits = model.apply(variables, features, queries, mask, method=cls.class_predictor)[
      "pred_logits"
    ].astype(jnp.float32)
    return total + (logits if ensemble == "logits" else jax.nn.sigmoid(logits)), None

  total, _ = jax.lax.scan(
    add_template,
    jnp.zeros((batch, h * w, num_classes), jnp.float32),
    jnp.asarray(query_embeddings, jnp.float32),
  )
  mean = total / num_templates
  scores = jax.nn.sigmoid(mean) if ensemble == "logits" else mean
  boxes = model.apply(variables, features, feature_map, method=cls.box_predictor)[
    "pred_boxes"
  ].astype(jnp.float32)
  return scores, boxes


def make_template_predict_step(
  model: nn.Module, mesh, *, top_k: int, multi_label: bool = False, ensemble: str = "logits"
) -> Callable:
  """Jitted prediction with prompt-template ensembling (docs/reference.md §2, §4).

  Returns:
    `predict(params, images [B,S,S,3], query_embeddings [P,C,E]) -> (scores [B,K],
    labels [B,K] int32 contiguous class index, boxes [B,K,4])`, as `make_predict_step` but
    scoring with `template_ensemble_scores` (top-K (token, class) pairs if `multi_label`,
    else argmax class per token then top-K tokens).

  Raises:
    ValueError: unknown `ensemble`.
  """
  if ensemble not in ENSEMBLE_MODES:
    raise ValueError(f"ensemble must be one of {ENSEMBLE_MODES}, got {ensemble!r}")
  data = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)

  def predict(params, images, query_embeddings):
    scores, boxes = template_ensemble_scores(
      model, params, images, query_embeddings, ensemble=ensemble
    )
    return detection.top_predictions(scores, boxes, top_k=top_k, multi_label=multi_label)

  return jax.jit(predict, in_shardings=(rep, data, rep), out_shardings=data)


def make_embed_step(model: nn.Module, mesh, *, k: int, image_features: bool = False) -> Callable:
  """Jitted features for retrieval: the top-k class and query embeddings of new images.

  Returns:
    `embed(params, images [B,S,S,3], queries [B,Q,L]) -> dict(class_embeddings [B,k,E],
    query_embeddings [B,k,E])`, tokens ranked by max over valid queries of the sigmoid logit
    (docs/reference.md §6-§7), computed with the current parameters in eval mode; with
    `image_features` also image_features [B,k,D] (the same tokens' ViT features, for ASER on
    image features).
  """
  data = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)

  def embed(params, images, queries):
    outputs = _forward(model, params, images, queries, train=False)
    query_mask = queries[..., 0] > 0
    class_emb, query_emb = top_k_lib.top_k_embeddings(
      outputs["pred_logits"],
      outputs["class_embeddings"],
      outputs["query_embeddings"],
      query_mask,
      k,
    )
    result = {"class_embeddings": class_emb, "query_embeddings": query_emb}
    if image_features:
      result["image_features"] = _top_image_features(outputs, query_mask, k)
    return result

  return jax.jit(embed, in_shardings=(rep, data, data), out_shardings=rep)


def _top_image_features(outputs, query_mask, k: int):
  """[B, k, D]: the ViT features (`feature_map` flattened) of the retrieval's top-k tokens."""
  feature_map = outputs["feature_map"]
  tokens = feature_map.reshape(feature_map.shape[0], -1, feature_map.shape[-1])
  return top_k_lib.top_k_token_features(outputs["pred_logits"], tokens, query_mask, k)


def make_new_loss_step(
  model: nn.Module, mesh, *, loss_config: dict, k: int | None = None, image_features: bool = False
) -> Callable:
  """Jitted eval-mode pre-forward of the new batch: per-example losses (+ retrieval features).

  Loss adaptivity (docs/reference.md §9) needs each new sample's loss before retrieval (r decides
  how
  many, and which, replays to retrieve); with `k` the same forward also gives the top-k
  features of `make_embed_step`, so a feature-based algorithm costs no extra forward.

  Returns:
    `new_losses(params, images [B,S,S,3], queries [B,Q,L], labels [B,M,Q], boxes [B,M,4])
    -> dict(per_example float32 [B] (`losses.detection_loss`), and with k:
    class_embeddings [B,k,E], query_embeddings [B,k,E], + image_features [B,k,D] with
    `image_features`)`, replicated (retrieval runs on replicated state).
  Source: docs/reference.md §9 (paper §4 "Loss Adaptivity": "we begin by computing each sample's
  loss").
  """
  data = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)

  def new_losses(params, images, queries, labels, boxes):
    outputs = _forward(model, params, images, queries, train=False)
    result = {
      "per_example": losses.detection_loss(
        outputs["pred_logits"], outputs["pred_boxes"], labels, boxes, **loss_config
      )["per_example"]
    }
    if k:
      class_emb, query_emb = top_k_lib.top_k_embeddings(
        outputs["pred_logits"],
        outputs["class_embeddings"],
        outputs["query_embeddings"],
        queries[..., 0] > 0,
        k,
      )
      result.update(class_embeddings=class_emb, query_embeddings=query_emb)
      if image_features:
        result["image_features"] = _top_image_features(outputs, queries[..., 0] > 0, k)
    return result

  return jax.jit(new_losses, in_shardings=(rep, data, data, data, data), out_shardings=rep)

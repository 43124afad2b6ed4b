"""Loss adaptivity (paper eqs. 5-6, docs/reference.md §9): the formula, the train step, the
retrieval mask."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from owl_cl import model as model_lib
from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import registry
from owl_cl.testing.batches import detection_batch
from owl_cl.train import losses
from owl_cl.train import sharding
from owl_cl.train import step as step_lib
from owl_cl.train.spec import LossSpec

ALPHA, BETA = 2.0, 1.0
LOSS_CONFIG = dict(focal_alpha=0.3, focal_gamma=2.0)


# ------------------------------------------------------------------- loss_adaptive_total


def test_loss_adaptive_total_hand_worked():
  new = np.array([0.1, 0.5, 0.9, 0.3], np.float32)
  # l = 0.4: samples 0.5 and 0.9 exceed it -> r = 2; L_B = 0.45; L_T = 0.45 + 2/4 * 2.0.
  total, r = losses.loss_adaptive_total(new, 2.0, 0.4)
  assert int(r) == 2
  np.testing.assert_allclose(float(total), 1.45, rtol=1e-6)
  # r = 0: nothing exceeds l, the replay loss is dropped entirely.
  total, r = losses.loss_adaptive_total(new, 2.0, 5.0)
  assert int(r) == 0
  np.testing.assert_allclose(float(total), 0.45, rtol=1e-6)
  # r = |B|: the plain 1:1 objective L_B + L_R.
  total, r = losses.loss_adaptive_total(new, 2.0, 0.0)
  assert int(r) == 4
  np.testing.assert_allclose(float(total), 2.45, rtol=1e-6)


def test_loss_adaptive_total_ties_do_not_count():
  # eq. 5 is strict: loss(s) > l. Two samples sit exactly on l = 0.5.
  new = np.array([0.5, 0.5, 0.75, 0.25], np.float32)
  total, r = losses.loss_adaptive_total(new, 4.0, 0.5)
  assert int(r) == 1
  np.testing.assert_allclose(float(total), 0.5 + 1 / 4 * 4.0, rtol=1e-6)


def test_loss_adaptive_total_gradients():
  new = jnp.array([0.1, 0.5, 0.9, 0.3])
  g_new, g_replay = jax.grad(lambda a, b: losses.loss_adaptive_total(a, b, 0.4)[0], argnums=(0, 1))(
    new, jnp.float32(2.0)
  )
  np.testing.assert_allclose(np.asarray(g_new), np.full(4, 0.25), rtol=1e-6)  # d mean
  np.testing.assert_allclose(float(g_replay), 0.5, rtol=1e-6)  # r / |B|


def test_loss_adaptive_total_rejects_bad_shapes():
  with pytest.raises(ValueError, match="new_losses"):
    losses.loss_adaptive_total(np.zeros((2, 2), np.float32), 1.0, 0.5)
  with pytest.raises(ValueError, match="new_losses"):
    losses.loss_adaptive_total(np.zeros((0,), np.float32), 1.0, 0.5)


# ------------------------------------------------------------------------- the train step


@functools.cache
def _setup_cached():
  model = model_lib.create_model(
    "tiny",
    vision_layers=1,
    text_layers=1,
    vocab_size=64,
    image_size=32,
    vision_width=32,
    vision_heads=1,
    vision_mlp_dim=64,
    text_width=32,
    text_heads=1,
    text_mlp_dim=64,
    embed_dim=32,
  )
  rng = np.random.default_rng(0)
  B, Q, M, L = 4, 4, 3, 16
  T = (32 // 8) ** 2

  batch = lambda: detection_batch(rng, B, num_queries=Q, max_boxes=M, query_length=L)

  new, replay = batch(), batch()
  replay["stored_logits"] = rng.normal(size=(B, T, Q)).astype(np.float32)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), new["images"], new["queries"])["params"]
  # A non-trivial class head (initialised near 0), so per-image losses differ clearly.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: (
      np.asarray(x) + 0.05 * rng.normal(size=x.shape).astype(np.float32)
      if "class_head" in str(p)
      else np.asarray(x)
    ),
    jax.device_get(params),
  )
  return model, params, new, replay


def _setup():
  model, params, new, replay = _setup_cached()
  return model, params, dict(new), dict(replay)


def _reference_losses(model, params, new, replay, replay_mask):
  """Separately computed L_B per example and L_R = alpha * MSE + beta * L_det(replay)."""
  images = jnp.concatenate([new["images"], replay["images"]])
  queries = jnp.concatenate([new["queries"], replay["queries"]])
  out = model.apply({"params": params}, images, queries, train=False)
  b = new["images"].shape[0]
  new_loss = losses.detection_loss(
    out["pred_logits"][:b], out["pred_boxes"][:b], new["labels"], new["boxes"], **LOSS_CONFIG
  )
  replay_det = losses.detection_loss(
    out["pred_logits"][b:],
    out["pred_boxes"][b:],
    replay["labels"],
    replay["boxes"],
    example_mask=replay_mask,
    **LOSS_CONFIG,
  )
  distill = losses.distillation_mse(
    out["pred_logits"][b:], replay["stored_logits"], example_mask=replay_mask
  )
  return new_loss["per_example"], ALPHA * distill + BETA * replay_det["loss"]


def _gradient_recorder() -> optax.GradientTransformation:
  """An "optimizer" whose state after a step is that step's gradient, bit for bit.

  Reading the gradient back as `params_before - params_after` of an SGD step would subtract
  parameters of magnitude up to ~9, whose float32 spacing (~1e-6) is as large as the smallest
  gradients compared; keeping the gradient itself avoids that cancellation.
  """

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, grads), grads

  return optax.GradientTransformation(init, update)


def _run_step(model, params, new, replay, **kwargs):
  """One train step; returns (its gradient w.r.t. params, its metrics)."""
  mesh = sharding.create_mesh()
  tx = _gradient_recorder()
  spec = step_lib.StepSpec(
    loss=LossSpec(**LOSS_CONFIG), replay=step_lib.ReplayLoss(alpha=ALPHA, beta=BETA, **kwargs)
  )
  train_step = step_lib.make_train_step(model, tx, mesh, spec)
  state = sharding.replicate(step_lib.create_train_state(params, tx), mesh)
  state, metrics = train_step(
    state,
    sharding.shard_batch(new, mesh),
    sharding.shard_batch(replay, mesh),
    jax.random.PRNGKey(0),
  )
  return jax.device_get(state.opt_state), jax.device_get(metrics)


@pytest.mark.slow
def test_paper_train_step_equals_reference_combination():
  model, params, new, replay = _setup()
  # The pre-forward decides the active slots: new images whose loss exceeds l (eq. 5).
  pre_forward = step_lib.make_new_loss_step(model, sharding.create_mesh(), loss_config=LOSS_CONFIG)
  per_example = np.asarray(
    pre_forward(params, new["images"], new["queries"], new["labels"], new["boxes"])["per_example"]
  )
  order = np.sort(per_example)
  assert order[1] < order[2], per_example  # distinct losses, so r = 2 below
  threshold = float((order[1] + order[2]) / 2)
  active = per_example > threshold
  valid = np.array([True, True, True, False])  # one slot found nothing to replay
  # The step itself restricts L_R to the active slots (replay_mask & replay_active).
  replay = dict(replay, replay_mask=valid, replay_active=active)

  def reference(p):
    pe, replay_loss = _reference_losses(model, p, new, replay, valid & active)
    total, r = losses.loss_adaptive_total(pe, replay_loss, threshold)
    return total, (r, jnp.mean(pe) + replay_loss)

  (ref_total, (ref_r, unweighted)), ref_grads = jax.jit(
    jax.value_and_grad(reference, has_aux=True)
  )(params)
  assert int(ref_r) == 2 == active.sum()
  step_grads, metrics = _run_step(
    model, params, new, replay, loss_adaptivity="paper", loss_threshold=threshold
  )
  np.testing.assert_allclose(metrics["loss"], float(ref_total), rtol=1e-5)
  np.testing.assert_allclose(metrics["replay_weight"], 0.5)
  assert int(metrics["num_above_threshold"]) == 2
  assert int(metrics["replays_in_loss"]) == int((valid & active).sum())
  # The step's gradient is that of the reference combination. Both are float32 sums of the
  # same terms in another order (other fusion, the step's sharded batch); an element's rounding
  # error is a few float32 epsilons (1.2e-7) of the largest terms that flow into it, which are
  # bounded by the largest gradient anywhere in the tree (~70 here; analytically zero leaves
  # such as the key biases carry pure rounding noise). Measured: at most ~1.1e-7 of that
  # maximum. A tolerance of 1e-5 of it leaves ~100x headroom and is still orders of magnitude
  # below what a wrong weighting of L_R changes (checked just below with the unweighted
  # objective).
  grad_max = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
  atol = 1e-5 * grad_max
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ref_grads)]
  for name, g, ref in zip(paths, jax.tree.leaves(step_grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=atol, err_msg=name)
  # The same comparison rejects the gradient of the unweighted 1:1 objective L_B + L_R.
  unweighted_grads = jax.jit(jax.grad(lambda p: reference(p)[1][1]))(params)
  worst = max(
    float(np.max(np.abs(g - u)))
    for g, u in zip(jax.tree.leaves(step_grads), jax.tree.leaves(unweighted_grads))
  )
  assert worst > 100 * atol, (worst, atol)
  # ...which differs from the unweighted 1:1 objective (the test can fail).
  assert float(ref_total) + 1e-3 < float(unweighted)


@pytest.mark.slow
def test_released_gate_drops_replay_loss_below_threshold():
  model, params, new, replay = _setup()
  valid = np.array([True, True, False, True])
  replay = dict(replay, replay_mask=valid)

  def reference(p):
    per_example, replay_loss = _reference_losses(model, p, new, replay, valid)
    return jnp.mean(per_example), replay_loss

  (new_loss, replay_loss), new_loss_grads = jax.jit(
    lambda p: (reference(p), jax.grad(lambda q: reference(q)[0])(p))
  )(params)
  new_loss, replay_loss = float(new_loss), float(replay_loss)

  # One compiled step for both thresholds (traced l).
  @jax.jit
  def gated(p, threshold):
    grad_fn = jax.value_and_grad(step_lib._loss_fn, has_aux=True)
    return grad_fn(
      p,
      new,
      replay,
      jax.random.PRNGKey(0),
      model=model,
      spec=step_lib.StepSpec(
        loss=LossSpec(**LOSS_CONFIG),
        replay=step_lib.ReplayLoss(
          alpha=ALPHA, beta=BETA, loss_adaptivity="released_gate", loss_threshold=threshold
        ),
      ),
    )

  # Mean new loss above l: the gate is open, the step is the plain DER++ objective.
  (_, open_gate), _ = jax.device_get(gated(params, new_loss - 0.01))
  np.testing.assert_allclose(open_gate["loss"], new_loss + replay_loss, rtol=1e-5)
  assert float(open_gate["replay_weight"]) == 1.0 and int(open_gate["replays_in_loss"]) == 3
  # Mean new loss below l: only L_B remains (the replay terms are still reported)...
  (_, closed), closed_grads = jax.device_get(gated(params, new_loss + 0.01))
  np.testing.assert_allclose(closed["loss"], new_loss, rtol=1e-5)
  np.testing.assert_allclose(closed["replay_loss"], open_gate["replay_loss"], rtol=1e-6)
  assert float(closed["replay_weight"]) == 0.0 and int(closed["replays_in_loss"]) == 0
  # ...and its gradient is that of L_B alone. Same float32 summation-order argument as in
  # test_paper_train_step_equals_reference_combination: tolerance 1e-5 of the largest gradient.
  atol = 1e-5 * max(float(np.max(np.abs(g))) for g in jax.tree.leaves(new_loss_grads))
  for g, ref in zip(jax.tree.leaves(closed_grads), jax.tree.leaves(new_loss_grads)):
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=atol)


def test_unknown_mode_is_rejected():
  model = _setup()[0]
  with pytest.raises(ValueError, match="loss_adaptivity"):
    step_lib.make_train_step(
      model,
      optax.sgd(1.0),
      sharding.create_mesh(),
      step_lib.StepSpec(
        loss=LossSpec(**LOSS_CONFIG), replay=step_lib.ReplayLoss(loss_adaptivity="sometimes")
      ),
    )


@pytest.mark.slow
def test_new_loss_step_matches_detection_loss():
  model, params, new, replay = _setup()
  step = step_lib.make_new_loss_step(model, sharding.create_mesh(), loss_config=LOSS_CONFIG, k=2)
  out = jax.device_get(step(params, new["images"], new["queries"], new["labels"], new["boxes"]))
  reference = jax.jit(lambda p: _reference_losses(model, p, new, replay, None)[0])(params)
  np.testing.assert_allclose(out["per_example"], np.asarray(reference), rtol=1e-5)
  assert out["class_embeddings"].shape[:2] == (4, 2)


# ------------------------------------------------------- retrieval with inactive slots


@pytest.mark.slow
def test_inactive_slots_are_invalid_and_not_marked():
  rng = np.random.default_rng(1)
  n, c = 40, 5
  membership = rng.random((n, c)) < 0.4
  membership[np.arange(n), rng.integers(0, c, n)] = True
  buffer = state_lib.make_replay_buffer(
    membership,
    rng.normal(size=(c, 8)).astype(np.float32),
    np.where(membership, rng.random((n, c)), np.inf).astype(np.float32),
    rng.normal(size=(n, 3, 8)).astype(np.float32),
    rng.normal(size=(n, 3, 8)).astype(np.float32),
  )
  features = {"class_embeddings": jnp.asarray(rng.normal(size=(4, 3, 8)), jnp.float32)}
  active = jnp.array([True, False, True, False])
  for name in ("uniform", "uniform_balanced", "swil"):
    algorithm = jax.jit(registry.get_algorithm(name, dedup="dataset"), static_argnums=3)
    rstate = state_lib.init_replay_state(n, jax.random.PRNGKey(0))
    indices, valid, new_state = algorithm(rstate, buffer, features, 4, active)
    valid, indices = np.asarray(valid), np.asarray(indices)
    np.testing.assert_array_equal(valid, [True, False, True, False], err_msg=name)
    marked = np.flatnonzero(np.asarray(new_state.dedup_mask))
    np.testing.assert_array_equal(marked, np.sort(indices[valid]), err_msg=name)
    assert int(new_state.total_replayed) == 2


@pytest.mark.slow
def test_released_gate_per_device():
  """The released gate per device (DDP): 2 groups of 2 images (the data sharding).

  Group g's gate reads the mean per-image new loss of its images; the loss is
  L_B + (1/2) sum_g gate_g * L_R,g with L_R,g over group g's valid replays, computed here
  from separately computed losses (`_reference_losses` restricted to each group).
  """
  model, params, new, replay = _setup()
  valid = np.array([True, False, True, True])
  replay = dict(replay, replay_mask=valid)
  groups = np.array([0, 0, 1, 1])
  per_example, _ = _reference_losses(model, params, new, replay, valid)
  per_example = np.asarray(per_example)
  means = [per_example[groups == g].mean() for g in range(2)]
  assert abs(means[0] - means[1]) > 1e-3, means
  threshold = float(np.mean(means))  # exactly one gate is open
  open_group = int(np.argmax(means))
  _, replay_open = _reference_losses(model, params, new, replay, valid & (groups == open_group))
  want = per_example.mean() + 0.5 * float(replay_open)

  grad_fn = jax.jit(
    lambda p: step_lib._loss_fn(
      p,
      new,
      replay,
      jax.random.PRNGKey(0),
      model=model,
      spec=step_lib.StepSpec(
        loss=LossSpec(**LOSS_CONFIG),
        replay=step_lib.ReplayLoss(
          alpha=ALPHA,
          beta=BETA,
          loss_adaptivity="released_gate",
          loss_threshold=threshold,
          loss_gate_groups=2,
        ),
      ),
    )
  )
  loss, metrics = jax.device_get(grad_fn(params))
  # Same float32 sums in another order; values O(1): 1e-5 relative.
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert float(metrics["replay_weight"]) == 0.5
  assert int(metrics["replays_in_loss"]) == int((valid & (groups == open_group)).sum())

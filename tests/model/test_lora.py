"""LoRA (owl_cl.model.lora, docs/lora.md): the adapted model at initialisation, adapter shapes,
the merge, training of the adapters alone, and the config's checks."""

import re

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from owl_cl import model as model_lib
from owl_cl import validation
from owl_cl.config_fields import ConfigError
from owl_cl.configs import base
from owl_cl.model import lora
from owl_cl.testing.batches import detection_batch
from owl_cl.testing.configs import tiny_detector_config
from owl_cl.train import optim
from owl_cl.train import sharding
from owl_cl.train import step as step_lib
from owl_cl.train.spec import LossSpec

OPTIONS = lora.LoraOptions(rank=2, alpha=4.0)


@pytest.fixture(scope="module")
def setup():
  """A 1-block tiny model (both towers), its parameters and one batch of 2 images."""
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32
  )
  batch = detection_batch(np.random.default_rng(0), 2, num_queries=4, max_boxes=3)
  params = jax.jit(model.init)(
    jax.random.PRNGKey(0), jnp.asarray(batch["images"]), jnp.asarray(batch["queries"])
  )["params"]
  return model, jax.device_get(params), batch


def _outputs(model, params, batch, **kwargs):
  return model.apply(
    {"params": params}, jnp.asarray(batch["images"]), jnp.asarray(batch["queries"]), **kwargs
  )


def test_default_targets_are_the_configs():
  assert tuple(base.get_config("").train.lora.targets) == lora.DEFAULT_TARGETS
  assert base.get_config("").train.lora.rank == 0  # off by default
  assert base.get_config("lora").train.lora.rank == base.LORA_RANK


@pytest.mark.slow
def test_lora_model_equals_its_base_at_initialisation(setup):
  model, params, batch = setup
  adapters = lora.init_adapters(model, OPTIONS, jax.random.PRNGKey(1))
  full = jax.tree.map(jnp.asarray, lora.combine(params, adapters))
  adapted = lora.lora_model(model, OPTIONS, train=False)
  expected, got = _outputs(model, params, batch), _outputs(adapted, full, batch)
  # B = 0: every adapter adds exactly 0 to its layer's output.
  for name in ("pred_logits", "pred_boxes", "query_embeddings"):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]))
  # The merge of B = 0 is the base, bit for bit.
  for a, b in zip(jax.tree.leaves(lora.merge(full, OPTIONS)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_equal_lora_models_are_one_object(setup):
  # What lets a later run's jitted steps be shared (`owl_cl.train.step_cache` keys on the
  # model): qwix would otherwise make a new, unequal subclass on every call.
  model = setup[0]
  again = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32
  )
  assert again == model
  train = lora.lora_model(model, OPTIONS, train=True)
  assert lora.lora_model(again, OPTIONS, train=True) is train
  assert lora.lora_model(model, OPTIONS, train=False) != train
  assert lora.lora_model(model, lora.LoraOptions(rank=4, alpha=4.0), train=True) != train


def test_adapter_shapes_are_rank_by_the_layers_dims(setup):
  model, params, _ = setup
  config = model.config
  adapters = traverse_util.flatten_dict(lora.init_adapters(model, OPTIONS, jax.random.PRNGKey(1)))
  r, dv, dt = OPTIONS.rank, config.vision_width, config.text_width
  expected = {}
  for tower, d, mlp in (("visual", dv, config.vision_mlp_dim), ("text", dt, config.text_mlp_dim)):
    block = ("backbone", "clip", tower, "transformer", "resblocks_0")
    # query / key / value kernels [D, H, D/H] and out [H, D/H, D]: A [D, r], B [r, D].
    for name in ("query", "key", "value", "out"):
      expected[block + ("attn", name, "kernel_lora_a")] = (d, r)
      expected[block + ("attn", name, "kernel_lora_b")] = (r, d)
    expected[block + ("mlp", "c_fc", "kernel_lora_a")] = (d, r)
    expected[block + ("mlp", "c_fc", "kernel_lora_b")] = (r, mlp)
    expected[block + ("mlp", "c_proj", "kernel_lora_a")] = (mlp, r)
    expected[block + ("mlp", "c_proj", "kernel_lora_b")] = (r, d)
  assert {k: v.shape for k, v in adapters.items()} == expected
  for path, value in adapters.items():
    if path[-1].endswith("_b"):
      assert not np.any(np.asarray(value))  # B = 0
    else:  # He-uniform A: nonzero, within sqrt(6 / fan_in)
      assert np.any(np.asarray(value))
      assert np.max(np.abs(np.asarray(value))) <= np.sqrt(6.0 / value.shape[0])


def test_merge_hand_worked():
  # 2-D kernel: W + (alpha / r) A B = [[1, 2], [3, 4]] + 2 * [[1], [2]] @ [[3, 4]].
  params = {
    "d": {
      "kernel": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
      "kernel_lora_a": np.array([[1.0], [2.0]], np.float32),
      "kernel_lora_b": np.array([[3.0, 4.0]], np.float32),
    },
    # A DenseGeneral kernel [D=1, H=2, D/H=2]: B's columns are the (head, dim) pairs.
    "g": {
      "kernel": np.zeros((1, 2, 2), np.float32),
      "kernel_lora_a": np.array([[0.5]], np.float32),
      "kernel_lora_b": np.array([[1.0, 2.0, 3.0, 4.0]], np.float32),
    },
  }
  merged = lora.merge(params, lora.LoraOptions(rank=1, alpha=2.0))
  assert set(merged["d"]) == {"kernel"} and set(merged["g"]) == {"kernel"}
  np.testing.assert_array_equal(merged["d"]["kernel"], [[7.0, 10.0], [15.0, 20.0]])
  np.testing.assert_array_equal(merged["g"]["kernel"], [[[1.0, 2.0], [3.0, 4.0]]])
  bad = {"d": dict(params["d"], kernel_lora_b=np.ones((1, 3), np.float32))}
  with pytest.raises(ValueError, match="do not fit the kernel"):
    lora.merge(bad, lora.LoraOptions(rank=1, alpha=2.0))


def test_combine_and_split_round_trip(setup):
  model, params, _ = setup
  adapters = lora.init_adapters(model, OPTIONS, jax.random.PRNGKey(1))
  full = lora.combine(params, adapters)
  assert jax.tree.structure(lora.base_of(full)) == jax.tree.structure(params)
  assert jax.tree.structure(lora.adapters_of(full)) == jax.tree.structure(adapters)
  with pytest.raises(ValueError, match="already hold adapters"):
    lora.combine(full, adapters)
  with pytest.raises(ValueError, match="has no kernel"):
    lora.combine(params, {"nowhere": {"kernel_lora_a": np.zeros((1, 1))}})


def test_adapters_take_their_kernels_lr_multiplier(setup):
  model, params, _ = setup
  full = lora.combine(params, lora.init_adapters(model, OPTIONS, jax.random.PRNGKey(1)))
  for granularity in optim.GRANULARITIES:
    multipliers = optim.multipliers_summary(
      full, text_lr_multiplier=0.1, layerwise_decay=0.5, layerwise_granularity=granularity
    )
    adapted = [k for k in multipliers if k.endswith(("_lora_a", "_lora_b"))]
    assert len(adapted) == 24  # 6 layers x 2 towers x (A, B)
    for name in adapted:
      assert multipliers[name] == multipliers[re.sub(r"_lora_[ab]$", "", name)]


@pytest.mark.slow
def test_training_moves_only_the_adapters_and_the_merge_equals_the_lora_model(setup):
  """Three real train steps (dropout on): the base is bit-identical and has no Adam state,
  every adapter's B moved, and the base model on the merged kernels equals the LoRA model."""
  model, params, batch = setup
  options = lora.LoraOptions(rank=2, alpha=4.0, dropout=0.1)
  full = jax.device_get(
    lora.combine(params, lora.init_adapters(model, options, jax.random.PRNGKey(1)))
  )
  mesh = sharding.create_mesh(jax.devices()[:1])
  tx, _ = optim.create_optimizer(
    full, learning_rate=1e-2, total_steps=10, warmup_steps=0, frozen=(lora.FROZEN_BASE,)
  )
  state = step_lib.create_train_state(full, tx)
  adam = [
    s
    for s in jax.tree.leaves(
      state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ]
  # Adam's moments hold the adapters' arrays only (the base: MaskedNode, no array).
  assert len(jax.tree.leaves(adam[0].mu)) == len(jax.tree.leaves(lora.adapters_of(full)))
  train_step = step_lib.make_train_step(
    lora.lora_model(model, options, train=True),
    tx,
    mesh,
    step_lib.StepSpec(LossSpec(focal_alpha=0.3, focal_gamma=2.0)),
  )
  state = sharding.replicate(state, mesh)
  for i in range(3):
    state, metrics = train_step(
      state, sharding.shard_batch(batch, mesh), None, jax.random.PRNGKey(i)
    )
    assert np.isfinite(float(metrics["loss"]))
  after = jax.device_get(state.params)
  for a, b in zip(jax.tree.leaves(lora.base_of(after)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  moved = traverse_util.flatten_dict(lora.adapters_of(after))
  assert all(np.any(v) for k, v in moved.items() if k[-1].endswith("_b"))

  merged = lora.merge(after, options)
  got = _outputs(model, merged, batch)
  # jax Arrays: qwix finds a layer's kernel among its jax.Array parameters (NumPy ones would
  # be passed over, lora.lora_model).
  after = jax.tree.map(jnp.asarray, after)
  expected = _outputs(lora.lora_model(model, options, train=False), after, batch)
  # The two sum W x + s (x A) B and (W + s A B) x in another order: float32 rounding of sums
  # over D = 64..256 terms of logits |z| <~ 20 (checked: max |z| below) is ~1e-5 relative;
  # 1e-4 absolute on logits and 1e-5 on boxes in [0, 1] leaves a margin of a few ulps x 10.
  assert np.max(np.abs(np.asarray(expected["pred_logits"]))) < 50.0
  np.testing.assert_allclose(got["pred_logits"], expected["pred_logits"], atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(got["pred_boxes"], expected["pred_boxes"], atol=1e-5)
  # The adapters did change the model: the merge is not the base.
  base_logits = np.asarray(_outputs(model, params, batch)["pred_logits"])
  assert np.max(np.abs(base_logits - np.asarray(got["pred_logits"]))) > 1e-3


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("rank", -1, "train.lora.rank"),
    ("alpha", 0.0, "train.lora.alpha"),
    ("dropout", 1.0, "train.lora.dropout"),
    ("targets", ("([",), "not a valid regex"),
    ("targets", (r"backbone/nowhere/.*",), "matches no Dense layer"),
  ],
)
def test_bad_lora_fields_are_refused_naming_them(field, value, message):
  config = base.apply_lora(tiny_detector_config())
  config.train.lora[field] = value
  with pytest.raises(ConfigError, match=re.escape(message)):
    validation.validate(config, None)


def test_lora_with_lwf_is_refused():
  config = base.apply_lora(tiny_detector_config())
  config.train.lwf.weight = 1.0
  with pytest.raises(ConfigError, match="LoRA and LwF do not combine"):
    validation.validate(config, None)


def test_lora_to_owl_cl_merges_a_runs_stage_adapters_into_its_base(setup, tmp_path):
  """`python -m owl_cl.model.convert lora-to-owl_cl BASE WORKDIR OUT`: the stage checkpoint's
  adapters (verified) merged with the run's rank and alpha, written in the owl_cl format."""
  from owl_cl.model.convert import cli  # noqa: PLC0415
  from owl_cl.model.convert import tree  # noqa: PLC0415
  from owl_cl.train import checkpointing  # noqa: PLC0415

  model, params, _ = setup
  options = lora.LoraOptions(rank=2, alpha=4.0)
  adapters = lora.init_adapters(model, options, jax.random.PRNGKey(1))
  # Trained-looking adapters: B != 0.
  adapters = jax.tree.map(
    lambda v: v + 0.01 * (1 + np.arange(v.size).reshape(v.shape) % 7), adapters
  )
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(
    base_dir, params, {"model_config": tree.model_config_to_dict(model.config)}
  )
  workdir = tmp_path / "run"
  stages = checkpointing.StageCheckpointer(str(workdir / "checkpoints"))
  stages.save(1, jax.device_get(adapters), None, {"stages": []})
  stages.close()
  config = base.get_config("lora")
  config.train.lora.rank, config.train.lora.alpha = options.rank, options.alpha
  (workdir / "run.json").write_text(
    '{"run_id": "x", "config": ' + config.to_json_best_effort() + "}"
  )
  out = str(tmp_path / "merged")
  cli.main(["lora-to-owl_cl", base_dir, str(workdir), out])
  merged, meta = checkpointing.load_params(out)
  expected = lora.merge(lora.combine(params, jax.device_get(adapters)), options)
  assert jax.tree.structure(merged) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert meta["lora"]["stage"] == 1 and meta["lora"]["rank"] == 2
  # A run without LoRA is refused, naming the field.
  config.train.lora.rank = 0
  (workdir / "run.json").write_text(
    '{"run_id": "x", "config": ' + config.to_json_best_effort() + "}"
  )
  with pytest.raises(SystemExit):
    cli.main(["lora-to-owl_cl", base_dir, str(workdir), str(tmp_path / "other")])


def test_step_checkpoint_holds_the_adapters_and_restores_onto_the_fresh_base(setup, tmp_path):
  """`trainer.LORA_ADAPTERS` through a step checkpoint: the saved parameters (train state and
  best-epoch copy) are the adapters alone; restored into a fresh loop they are joined with that
  loop's base, bit for bit, and the adapters come back as saved (not the fresh ones)."""
  from owl_cl import trainer  # pylint: disable=g-import-not-at-top
  from owl_cl.replay import setup as replay_setup  # pylint: disable=g-import-not-at-top
  from owl_cl.train import checkpointing  # pylint: disable=g-import-not-at-top

  model, params, _ = setup
  trained = lora.init_adapters(model, OPTIONS, jax.random.PRNGKey(1))
  trained = jax.tree.map(lambda x: np.asarray(x) + 0.5, trained)  # B != 0: trained adapters
  full = lora.combine(params, trained)
  tx = optax.sgd(0.1)
  loop = trainer.LoopState(
    train_state=step_lib.create_train_state(full, tx),
    replay_state=None,
    key=jax.random.PRNGKey(3),
    step=2,
    history={},
    best_params=full,
  )
  items, meta = trainer.loop_checkpoint(loop, replay_setup.NoReplay(), trainer.LORA_ADAPTERS)
  saved = jax.tree.structure(items["train_state"].params)
  assert saved == jax.tree.structure(trained)
  assert jax.tree.structure(items["best_params"]) == jax.tree.structure(trained)
  steps = checkpointing.StepCheckpointer(str(tmp_path / "steps"), every_steps=1)
  steps.save(1, loop.step, items, meta)
  steps.wait()
  # A fresh phase: the same base with fresh adapters (B = 0).
  fresh_full = lora.combine(params, lora.init_adapters(model, OPTIONS, jax.random.PRNGKey(1)))
  fresh = trainer.LoopState(
    train_state=step_lib.create_train_state(fresh_full, tx),
    replay_state=None,
    key=jax.random.PRNGKey(0),
  )
  got = trainer.restore_loop(
    steps, 1, fresh, replay_setup.NoReplay(), fresh_full, params_part=trainer.LORA_ADAPTERS
  )
  steps.close()
  assert got.step == 2
  for tree in (got.train_state.params, got.best_params):
    assert jax.tree.structure(tree) == jax.tree.structure(full)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(full)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit-exact

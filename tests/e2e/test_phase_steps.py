"""The fine-tuning phases and runs of a process share their jitted steps when, and only when,
every static setting the steps are built from is equal (`owl_cl.train.step_cache`,
`trainer._phase_train_step`)."""

import types

import jax
import pytest

from owl_cl import phases
from owl_cl import trainer
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_detector_config

SETTINGS = dict(
  num_epochs=1, learning_rate=1e-4, text_lr_multiplier=0.1, layerwise_decay=1.0, warmup_steps=1
)
NO_REPLAY = types.SimpleNamespace(train_step_options={"with_replay": False})
REPLAY = types.SimpleNamespace(
  train_step_options={
    "alpha": 2.0,
    "beta": 1.0,
    "objectness_distill_weight": 1.0,
    "with_replay": True,
    "loss_adaptivity": "none",
    "loss_threshold": 0.0,
    "loss_gate_groups": 1,
  }
)


def _phase(name, index, total=4, **settings):
  return phases.Phase(
    name=name,
    index=index,
    source=None,
    data_seed=index,
    batch_size=2,
    total=total,
    num_epochs=1,
    settings=dict(SETTINGS, **settings),
  )


@pytest.fixture(scope="module")
def detector_and_params():
  detector = Detector(tiny_detector_config())
  return detector, detector.init_params(0)


def test_a_later_phase_with_equal_settings_gets_the_same_steps(detector_and_params):
  detector, params = detector_and_params
  first = trainer._phase_train_step(detector, _phase("a", 1), params, NO_REPLAY, None)
  # Another dataset (name, index, source, seed): nothing the step is built from.
  second = trainer._phase_train_step(detector, _phase("b", 2), params, NO_REPLAY, None)
  assert all(x is y for x, y in zip(first, second, strict=True))


@pytest.mark.parametrize(
  "change",
  [
    dict(total=6),
    dict(learning_rate=2e-4),
    dict(warmup_steps=2),
    dict(text_lr_multiplier=0.5),
    dict(layerwise_decay=0.9),
    dict(replay=REPLAY),
  ],
  ids=lambda change: next(iter(change)),
)
def test_a_phase_with_another_setting_gets_its_own_steps(detector_and_params, change):
  detector, params = detector_and_params
  base = trainer._phase_train_step(detector, _phase("a", 1), params, NO_REPLAY, None)
  change = dict(change)
  replay = change.pop("replay", NO_REPLAY)
  total = change.pop("total", 4)
  other = trainer._phase_train_step(
    detector, _phase("b", 2, total=total, **change), params, replay, None
  )
  assert all(x is not y for x, y in zip(base, other, strict=True))
  # The schedule is the phase's own: warmup to its learning rate, cosine over its total.
  tx, schedule, _ = other
  settings = dict(SETTINGS, **change)
  warmup = settings["warmup_steps"]
  assert float(schedule(warmup)) == pytest.approx(settings["learning_rate"], rel=1e-6)
  assert float(schedule(total)) == pytest.approx(0.0, abs=1e-12)
  del tx


def test_another_parameter_tree_gets_its_own_steps(detector_and_params):
  detector, params = detector_and_params
  base = trainer._phase_train_step(detector, _phase("a", 1), params, NO_REPLAY, None)
  # One more leaf (as LoRA's adapters add): the optimizer's LR groups are another tree.
  grown = dict(params, extra={"kernel": jax.numpy.zeros((2, 2))})
  other = trainer._phase_train_step(detector, _phase("a", 1), grown, NO_REPLAY, None)
  assert other[0] is not base[0] and other[2] is not base[2]


def test_another_run_of_the_same_model_gets_the_same_steps(detector_and_params):
  detector, params = detector_and_params
  base = trainer._phase_train_step(detector, _phase("a", 1), params, NO_REPLAY, None)
  # Two more runs' detectors (built in this test: each test starts with an empty cache).
  one, two = Detector(tiny_detector_config()), Detector(tiny_detector_config())
  same = trainer._phase_train_step(one, _phase("a", 1), params, NO_REPLAY, None)
  assert all(x is y for x, y in zip(base, same, strict=True))
  assert one._text_embed is two._text_embed


@pytest.mark.parametrize(
  "changes",
  [{"loss.focal_alpha": 0.5}, {"loss.normalization": "per_batch"}, {"train.b2": 0.99}],
  ids=lambda changes: next(iter(changes)),
)
def test_another_run_with_other_options_gets_its_own_steps(detector_and_params, changes):
  detector, params = detector_and_params
  base = trainer._phase_train_step(detector, _phase("a", 1), params, NO_REPLAY, None)
  config = tiny_detector_config(**changes)
  assert config != detector.config
  other = trainer._phase_train_step(Detector(config), _phase("a", 1), params, NO_REPLAY, None)
  assert other[2] is not base[2]


def test_another_model_gets_its_own_steps(detector_and_params):
  detector, params = detector_and_params
  base = trainer._phase_train_step(detector, _phase("a", 1), params, NO_REPLAY, None)
  wider = Detector(tiny_detector_config(**{"model.overrides": {"vision_mlp_dim": 96}}))
  assert wider.model != detector.model
  other = trainer._phase_train_step(wider, _phase("a", 1), params, NO_REPLAY, None)
  assert other[2] is not base[2]
  assert wider._text_embed is not Detector(tiny_detector_config())._text_embed

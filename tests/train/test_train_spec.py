"""owl_cl.train.spec: the `train` and `loss` sections written once (hand-worked values)."""

from __future__ import annotations

import pytest

from owl_cl import cache_keys
from owl_cl import config_rules
from owl_cl import config_spec
from owl_cl.config_fields import PER_DATASET_FIELDS
from owl_cl.config_fields import ConfigError
from owl_cl.configs import base
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import LwfSpec
from owl_cl.train.spec import TrainSpec


def test_the_paper_config_converts_to_its_typed_settings():
  settings = config_spec.from_config(TrainSpec, base.get_config("paper").train, "train")
  assert settings.text_lr_multiplier == 0.1 and settings.warmup_epochs == 1
  # The supplementary table's row for ChessPieces (configs/base.py PAPER_HYPERPARAMETERS).
  assert settings.per_dataset["ChessPieces"] == {
    "num_epochs": 7,
    "warmup_epochs": 2,
    "learning_rate": 6.4e-4,
    "layerwise_decay": 0.94,
  }
  assert settings.lora.targets == base.get_config("").train.lora.targets
  assert not settings.lwf.on and LwfSpec(box_weight=0.5).on


def test_a_bad_field_is_one_line_naming_it():
  c = base.get_config("")
  c.train.lwf.temperature, c.loss.matcher = 0.0, "greedy"
  with pytest.raises(ConfigError) as e:
    config_spec.from_config(TrainSpec, c.train, "train")
  assert str(e.value) == "config.train.lwf.temperature=0.0 must be > 0"
  with pytest.raises(
    ConfigError,
    match=r"^config.loss.matcher='greedy' is unknown; known: \['auto', 'scipy', 'jax'\]$",
  ):
    config_spec.from_config(LossSpec, c.loss, "loss")


def test_the_per_dataset_rules_are_the_train_fields_rules():
  for name in PER_DATASET_FIELDS:
    assert config_rules.TRAIN_FIELD_RULES[name] is config_rules.FIELD_RULES[f"train.{name}"]
  assert config_rules.SECTION_SPECS["train"] is TrainSpec


def test_fields_left_out_of_keys_are_the_ones_the_caches_leave_out():
  # The caches' keys leave out exactly these loss fields (their `key=` reasons).
  assert set(config_spec.not_in_keys(LossSpec, "loss")) == {"loss.matcher", "loss.normalization"}
  # Fine-tuning settings feed no stored cache but the optimiser's Adam settings and clipping,
  # which pre-training reads (`trainer.make_optimizer`): its key holds them alone.
  assert cache_keys.key_material(_pretrained_key_spec(), cache_keys.PRETRAINED)["train"] == {
    "lwf": {},
    "lora": {},
    "wise_ft": {},
    "b1": 0.9,
    "b2": 0.999,
    "eps": 1e-8,
    "grad_clip_norm": 1.0,
  }


def _pretrained_key_spec():
  from owl_cl.model.spec import ModelSpec  # noqa: PLC0415

  c = base.get_config("builtin1")
  model = config_spec.from_config(ModelSpec, c.model, "model")
  return cache_keys.pretrained_key_spec(c, model, resize_method="resize_with_pad", pretrain_data="")


def test_the_fine_tuning_step_spec_is_the_step_caches_key():
  """Equal settings give equal, hashable step specs (a later phase reuses the step's trace);
  LwF off and retrieval 'none' leave no LwF and no replay half."""
  from owl_cl import trainer  # noqa: PLC0415

  c = base.get_config("")
  settings = lambda c: (
    config_spec.from_config(TrainSpec, c.train, "train"),
    config_spec.from_config(LossSpec, c.loss, "loss"),
  )
  train, loss = settings(c)
  options = {
    "alpha": 2.0,
    "beta": 1.0,
    "objectness_distill_weight": 1,
    "with_replay": True,
    "loss_adaptivity": "released_gate",
    "loss_threshold": 0.3,
    "loss_gate_groups": 2,
  }
  spec = trainer._step_spec(train, loss, options)
  assert hash(spec) == hash(trainer._step_spec(*settings(c), dict(options)))
  assert spec.replay.objectness_distill_weight == 1.0 and spec.lwf is None
  assert spec.loss.normalization == "per_image" and spec.max_unique_queries == 64
  c.train.lwf.box_weight, c.loss.normalization = 0.5, "per_batch"
  off = trainer._step_spec(*settings(c), {"with_replay": False})
  assert off.replay is None and off.lwf == LwfSpec(box_weight=0.5)
  assert off.loss.normalization == "per_batch" and off != spec


def test_a_step_term_fills_its_step_spec_field_from_the_train_section(monkeypatch):
  """docs/extending.md, "A loss term": a train-step term declares how its settings come from
  `train` (`StepTerm.of_train`), so the trainer fills its `StepSpec` field with no edit. The
  throwaway term: a `count` section (a subclass of `TrainSpec`, as the field added to
  `owl_cl/train/spec.py` would be) and a `StepSpec` field of that name."""
  import dataclasses  # noqa: PLC0415

  from owl_cl import trainer  # noqa: PLC0415
  from owl_cl.train import step as step_lib  # noqa: PLC0415

  @dataclasses.dataclass(frozen=True)
  class CountSpec:
    weight: float = 0.0

  train_cls = dataclasses.make_dataclass(
    "CountTrainSpec", [("count", CountSpec, CountSpec())], bases=(TrainSpec,), frozen=True
  )
  spec_cls = dataclasses.make_dataclass(
    "CountStepSpec", [("count", object, None)], bases=(step_lib.StepSpec,), frozen=True
  )
  term = step_lib.StepTerm(
    "count",
    lambda loss, metrics, ctx, settings: (loss, metrics),
    of_train=lambda train: train.count if train.count.weight else None,  # off at weight 0
  )
  monkeypatch.setattr(step_lib, "StepSpec", spec_cls)
  monkeypatch.setattr(step_lib, "STEP_TERMS", step_lib.STEP_TERMS + (term,))
  on = trainer._step_spec(train_cls(count=CountSpec(0.5)), LossSpec(), {})
  assert on.count == CountSpec(0.5) and on.lwf is None and on.replay is None
  assert trainer._step_spec(train_cls(), LossSpec(), {}).count is None
  # LwF, the built-in term, fills its field the same way.
  assert trainer._step_spec(train_cls(lwf=LwfSpec(weight=1.0)), LossSpec(), {}).lwf.weight == 1.0

"""The `released` preset (`--config=configs/<algorithm>.py:released`): every paper/released-code
switch at once, and each switch reaching the function it feeds."""

import importlib
import os

import pytest

from owl_cl import cache_keys
from owl_cl import config_spec
from owl_cl import run_spec
from owl_cl.config_fields import ConfigError
from owl_cl.data.data_spec import DataSpec
from owl_cl.replay import setup as replay_setup
from owl_cl.replay import spec as replay_spec
from owl_cl.train.spec import TrainSpec

# configs/ivlod_odinw13.py is a protocol on real data (its args: parse_arg's), not an
# algorithm with the built-in / 'paper' / 'released' args (tests/data/test_ivlod_data.py).
ALGORITHM_FILES = sorted(
  f[:-3]
  for f in os.listdir(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
  if f.endswith(".py") and f not in ("__init__.py", "base.py", "ivlod_odinw13.py")
)

# field path -> (default, released value); docs/released_code.md.
SWITCHES = {
  "loss.normalization": ("per_image", "per_batch"),
  "replay.grasp_weight": (1.0, 0.7),
  "replay.swil_reduction": ("min", "min"),
  "replay.balanced_order": ("sequential", "reshuffled"),
  "replay.adaptive_entropy_classes": ("eligible", "all"),
  "replay.exhausted_class": ("fallback", "redraw"),
  "replay.dedup_without_replacement": (False, True),
  "replay.dedup_fraction_reset": ("before", "after"),
  "replay.aser.asv_token_matching": ("all_to_all", "nearest_token"),
  "replay.aser.asv_distance": ("l2", "l2"),
  "replay.aser.asv_weight_reduction": ("min", "max"),
  # Released options whose released default is the paper's (issue 18 item 9).
  "replay.within_class_weighting": ("uniform", "uniform"),
  "replay.aser.asv_left_term": (True, True),
  "replay.aser.asv_shapley": ("knn", "knn"),
  "replay.aser.asv_distance_threshold": (None, None),
  "replay.aser.tknn_num_classes": (400.0, 400.0),
  "replay.aser.candidate_subsets": ("shared", "shared"),
  "replay.loss_adaptivity.gate_per_device": (False, True),
  "replay.loss_adaptivity.gate_feature_based_only": (False, True),
  "replay.selection.fill_all_for_rare_classes": (False, True),
  "replay.selection.distance_max_instances": (None, 6),
  "replay.selection.drop_images_without_class": (False, True),
  "replay.selection.top_up_order": ("class_index", "first_appearance"),
  "replay.selection.prototype_images": ("buffer", "all"),
  "train.layerwise_granularity": ("layer", "tensor"),
  "data.squash_resize": (False, True),
  "data.negatives_by_frequency": (False, True),
  "eval.ensemble": ("logits", "probabilities"),
}


def _get(c, path):
  for part in path.split("."):
    c = c[part]
  return c


def _config(name, arg):
  return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", ALGORITHM_FILES)
def test_released_preset_sets_every_switch(name):
  default, released = _config(name, ""), _config(name, "released")
  for path, (want_default, want_released) in SWITCHES.items():
    assert _get(default, path) == want_default, path
    assert _get(released, path) == want_released, path
  # Nothing else changes (same algorithm, same protocol).
  flat_default = default.to_dict()
  flat_released = released.to_dict()
  assert flat_released["replay"]["algorithm"] == flat_default["replay"]["algorithm"]
  assert released.train.carry == "last"  # the built-in benchmark has no validation splits
  assert released.replay.loss_adaptivity.mode == default.replay.loss_adaptivity.mode
  both = _config(name, "paper,released")
  assert both.model.variant == "vit_l14" and both.train.carry == "best_validation"
  for path, (_, want_released) in SWITCHES.items():
    assert _get(both, path) == want_released, path
  with pytest.raises(ValueError, match="unknown config argument"):
    _config(name, "paper,releasd")


def test_released_switches_reach_the_retrieval_functions():
  c = _config("a_sw_grasp", "released")
  algorithm = replay_setup.make_algorithm(c)
  assert algorithm.adaptive_entropy_classes == "all" and algorithm.exhausted_class == "redraw"
  assert replay_setup.make_algorithm(_config("a_sw_grasp", "")).exhausted_class == "fallback"
  assert algorithm.balanced_order == "reshuffled" and algorithm.grasp_weight == 0.7
  c.replay.dedup = "fraction"
  schedule = replay_setup.make_algorithm(c).dedup
  assert (schedule.name, schedule.fraction_reset) == ("fraction", "after")
  c.replay.dedup = "none"
  schedule = replay_setup.make_algorithm(c).dedup
  assert schedule.samples_without_replacement
  aser = replay_setup.make_algorithm(_config("aser", "released"))
  assert (aser.asv_token_matching, aser.asv_weight_reduction) == ("nearest_token", "max")
  c = _config("a_sw_grasp", "released")
  c.replay.within_class_weighting = "grasp"
  assert replay_setup.make_algorithm(c).within_class_weighting == "grasp"
  c = _config("sw_aser_pc", "released")
  c.replay.within_class_weighting = "grasp"
  c.replay.aser.asv_left_term = False
  c.replay.aser.asv_shapley = "tknn"
  c.replay.aser.asv_distance_threshold = 2.5
  c.replay.aser.tknn_num_classes = 20.0
  aser = replay_setup.make_algorithm(c)
  assert (aser.within_class_weighting, aser.grasp_weight, aser.asv_left_term) == (
    "grasp",
    0.7,
    False,
  )
  assert (aser.asv_shapley, aser.asv_distance_threshold, aser.tknn_num_classes) == (
    "tknn",
    2.5,
    20.0,
  )
  c.replay.aser.candidate_subsets = "per_image"
  assert replay_setup.make_algorithm(c).candidate_subsets == "per_image"
  c.replay.algorithm = "aser_pc"
  with pytest.raises(ConfigError, match="candidate_subsets='per_image' needs the similarity"):
    replay_setup.make_algorithm(c)
  c.replay.aser.asv_shapley = "tnn"
  with pytest.raises(ConfigError, match="asv_shapley='tnn'"):
    replay_setup.make_algorithm(c)
  c = _config("a_sw_grasp", "")
  c.replay.adaptive_entropy_classes = "most"
  with pytest.raises(ConfigError, match="adaptive_entropy_classes='most'"):
    replay_setup.make_algorithm(c)
  c = _config("uniform", "")
  c.replay.dedup_fraction_reset = "later"
  with pytest.raises(ConfigError, match="fraction_reset='later'"):
    replay_setup.make_algorithm(c)


def test_released_option_values_are_checked_before_any_work():
  """The item-9 options are named with their value by the config checks (owl_cl.validation)."""
  from owl_cl import validation

  c = _config("aser", "")
  c.replay.within_class_weighting = "GRASP"
  c.replay.aser.asv_shapley = "TKNN"
  assert validation.option_problems(c) == [
    "config.replay.within_class_weighting='GRASP' is unknown; known: ['uniform', 'grasp']",
    "config.replay.aser.asv_shapley='TKNN' is unknown; known: ['knn', 'tknn']",
  ]
  c = _config("aser", "")
  c.replay.aser.asv_distance_threshold = 0.0
  c.replay.aser.tknn_num_classes = -1.0
  assert validation.range_problems(c) == [
    "config.replay.aser.asv_distance_threshold=0.0 must be > 0",
    "config.replay.aser.tknn_num_classes=-1.0 must be > 0",
  ]


@pytest.mark.parametrize("arg, want", [("", "buffer"), ("released", "all")])
def test_prototype_images_reaches_the_buffer_build(monkeypatch, tmp_path, arg, want):
  """replay.selection.prototype_images is passed to `build.build_store` and enters the
  buffer cache key (from the replay spec)."""
  import types

  from owl_cl.replay import build as buffer_build
  from owl_cl.replay import store_cache

  c = _config("grasp", arg)
  c.cache_dir = str(tmp_path)
  annotations = tmp_path / "train.json"
  annotations.write_text("{}")
  source = types.SimpleNamespace(annotation_file=str(annotations), class_names=["a"])
  # The settings `replay.setup` reads, converted as `Detector` converts them.
  detector = types.SimpleNamespace(
    run=run_spec.run_settings(c),
    replay_spec=replay_spec.settings(c),
    data_spec=config_spec.from_config(DataSpec, c.data, "data"),
    train_spec=config_spec.from_config(TrainSpec, c.train, "train"),
    model=None,
    class_tokens=lambda s: None,
    example_spec=lambda tokens: None,
    loss_options={},
    example_options=lambda s: {},
    mesh=None,
  )
  seen = {}
  monkeypatch.setattr(buffer_build, "build_store", lambda *a, **kw: seen.update(kw))
  monkeypatch.setattr(
    store_cache,
    "cached_store",
    lambda folder, key, build, **kw: (build("store", "store.build", "key"), key),
  )
  benchmark = types.SimpleNamespace(pretrain=types.SimpleNamespace(train=source))
  material = cache_keys.buffer_key_material(c, source, {})
  _, key = replay_setup.build_store(detector, benchmark, None, key_material=material)
  assert seen["buffer_spec"].prototype_images == want
  assert key["replay"]["selection"]["prototype_images"] == want

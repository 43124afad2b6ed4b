"""owl_cl.data.data_spec: the `data` section written once; its config, rules and cache keys."""

from __future__ import annotations

import dataclasses

import ml_collections
import pytest

from owl_cl import cache_keys
from owl_cl import config_spec as cs
from owl_cl import validation
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import real
from owl_cl.config_fields import uses_real_data
from owl_cl.config_rules import FIELD_RULES
from owl_cl.configs import base
from owl_cl.data import data_spec
from owl_cl.data.data_spec import DataSpec

# A valid value other than the default for every leaf of `DataSpec` (a new field needs one
# here: `test_every_field_is_keyed_or_says_why` checks the table is complete).
_OTHER = {
  "root": "/data",
  "sequence": ({"suite": "odinw_paper"},),
  "pretrain": {"name": "o365", "kind": "objects365"},
  "held_out": {"name": "lvis", "kind": "lvis"},
  "zero_shot": ({"name": "coco", "kind": "coco2017"},),
  "odinw13_variant": "zira",
  "num_queries": 30,
  "num_negatives": 5,
  "max_instances": 4,
  "num_workers": 2,
  "prefetch_batches": 0,
  "validate_images": False,
  "exif_orientation": "apply",
  "squash_resize": True,
  "merge_iou": None,
  "negatives_by_frequency": True,
  "host_sharding": True,
  "augment.hflip": True,
  "augment.random_crop": True,
  "augment.crop_area_range": (0.5, 1.0),
  "augment.crop_aspect_ratio_range": (0.5, 2.0),
  "augment.crop_min_area_fraction": 0.3,
  "augment.mosaic_sizes": (1, 2),
  "augment.mosaic_probs": (0.5, 0.5),
  "eval_batch_size": 8,
  "train_prompt_templates": "clip_80",
  "builtin.version": 2,
  "builtin.seed": 1,
  "builtin.num_pretrain_train": 10,
  "builtin.num_pretrain_val": 3,
  "builtin.num_held_out_val": 4,
  "builtin.num_downstream_train": 4,
  "builtin.num_downstream_test": 2,
  "builtin.num_tail_val": 5,
  "builtin.downstream": ("digits",),
  "odinw_datasets": ("Pothole", "Dice"),
  "subset_seed": 3,
}


def _changed(path: str, value) -> DataSpec:
  """`DataSpec` with the field at `path` set to `value`, through a config (so checked)."""
  section = cs.defaults(DataSpec, presets=("paper",))
  *parents, name = path.split(".")
  node = section
  for p in parents:
    node = node[p]
  node[name] = value
  return cs.from_config(DataSpec, section, "data")


def test_the_config_section_is_the_specs_with_the_papers_fields_only_under_paper():
  builtin1, paper = base.get_config("builtin1").data, base.get_config("paper").data
  assert builtin1.num_queries == 24 and builtin1.augment.mosaic_probs == (0.4, 0.3, 0.3)
  assert builtin1.builtin.downstream == ("thermal", "negative", "clutter", "textured", "tiny")
  # 'odinw_datasets' present is what marks real data (`uses_real_data`): only under 'paper'.
  assert "odinw_datasets" not in builtin1 and "subset_seed" not in builtin1
  assert not uses_real_data(base.get_config(""))
  assert paper.odinw_datasets[:2] == ("Pothole", "WildfireSmoke") and paper.subset_seed == 0
  assert uses_real_data(base.get_config("paper"))
  # Every leaf has its rule in FIELD_RULES.
  assert all(FIELD_RULES[path] is rule for path, rule in cs.rules(DataSpec, "data").items())


def test_untyped_fields_stay_a_plain_none_that_takes_entries():
  c = base.get_config("").data
  assert c.sequence is None and c.pretrain is None
  c.pretrain = dict(name="mine", kind="coco")  # as a config file sets it: a ConfigDict
  c.sequence = [dict(suite="odinw13")]
  assert isinstance(c.pretrain, ml_collections.ConfigDict)
  assert c.pretrain.name == "mine" and c.sequence[0]["suite"] == "odinw13"
  c.num_queries = 12  # a typed field still refuses another type
  with pytest.raises(TypeError):
    c.num_queries = "twelve"


def test_every_field_is_keyed_or_says_why():
  leaves = dict(cs.leaves(DataSpec))
  assert set(_OTHER) == set(leaves)
  default = DataSpec()
  for path, value in _OTHER.items():
    settings = _changed(path, value)
    assert settings != default, path
    role = cs.key_roles(DataSpec, "")[path]
    for cache in cs.CACHES:
      keyed = role is True or (isinstance(role, dict) and cache not in role)
      moved = cs.key_material(settings, cache) != cs.key_material(default, cache)
      assert moved == keyed, (path, cache)


def test_data_key_material_hand_worked():
  settings = _changed("augment.hflip", True)
  augment = {
    "hflip": True,
    "random_crop": False,
    "crop_area_range": [0.3, 1.0],
    "crop_aspect_ratio_range": [0.75, 1.33],
    "crop_min_area_fraction": 0.6,
    "mosaic_sizes": None,
    "mosaic_probs": [0.4, 0.3, 0.3],
  }
  example = {"num_queries": 24, "num_negatives": 23, "max_instances": 8}
  options = {
    "exif_orientation": "ignore",
    "squash_resize": False,
    "merge_iou": 0.9,
    "negatives_by_frequency": False,
  }
  assert cs.key_material(settings, "pretrained") == {
    **example,
    **options,
    "augment": augment,
    "train_prompt_templates": "none",
    "builtin": {"version": 1},
  }
  # The buffer's images are neither augmented nor prompted: its key leaves both out.
  buffer = {**example, **options, "builtin": {"version": 1}}
  assert cs.key_material(settings, "buffer") == buffer
  config = base.get_config("builtin1")
  config.data.merge_iou = None
  config.data.exif_orientation = "refuse"
  source = ml_collections.ConfigDict({"annotation_file": __file__})
  assert cache_keys.buffer_key_material(config, source, {})["data"] == dict(
    buffer, merge_iou=None, exif_orientation="refuse"
  )


def test_a_field_the_data_section_lacks_is_refused_before_any_work():
  # A typo in a config file was silently ignored (the default used instead).
  config = base.get_config("builtin1")
  config.data.num_querys = 30
  config.data.augment.hflp = True
  problems = validation.range_problems(config, num_devices=1)
  assert any(p.startswith("config.data has unknown fields ['num_querys']") for p in problems)
  assert any(p.startswith("config.data.augment has unknown fields ['hflp']") for p in problems)
  with pytest.raises(ConfigError, match="num_querys"):
    data_spec.settings(config)


def test_a_bad_value_is_one_line_once():
  config = base.get_config("builtin1")
  config.data.num_queries = 0
  problems = validation.range_problems(config, num_devices=1)
  assert problems == ["config.data.num_queries=0 must be >= 1"]


def test_a_field_added_to_the_spec_reaches_config_rules_docs_and_keys():
  # A spec with one more field (as an edit of DataSpec would add it): no other edit needed.
  field = cs.field(0.5, real(0.0, 1.0), "A new pipeline option.")
  extended = dataclasses.make_dataclass(
    "Extended", [("jitter", float, field)], bases=(DataSpec,), frozen=True
  )
  assert cs.defaults(extended).jitter == 0.5
  assert cs.rules(extended, "data")["data.jitter"](2.0) == "must be in [0, 1]"
  assert ("data.jitter", "0.5", "A new pipeline option.") in cs.doc_rows(extended, "data")
  changed = cs.from_config(extended, dict(cs.defaults(extended).to_dict(), jitter=0.25), "data")
  for cache in cs.CACHES:  # in both caches' keys
    assert cs.key_material(changed, cache) == dict(cs.key_material(extended(), cache), jitter=0.25)

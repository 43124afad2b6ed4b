"""owl_cl.replay.spec: the `replay` section written once; validation, the registry's checks and
the docs read it."""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
import types

import pytest

from owl_cl import cache_keys
from owl_cl import config_rules
from owl_cl import config_spec
from owl_cl.config_fields import ConfigError
from owl_cl.configs import base
from owl_cl.replay import setup as replay_setup
from owl_cl.replay import spec as replay_spec
from owl_cl.replay.retrieval import registry
from owl_cl.replay.retrieval import spec as retrieval_spec
from owl_cl.utils import digest

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")


def test_the_registry_hyperparameters_are_the_spec_fields():
  """Every hyperparameter an algorithm's steps take is a field of the spec, and every field
  of `RetrievalSpec` is one that some algorithm takes (none is dead)."""
  taken = set().union(*(a.hyperparameter_names for a in registry.ALGORITHMS.values()))
  assert taken == set(retrieval_spec.hyperparameter_rules())


def test_get_algorithm_checks_every_hyperparameter_with_its_field_rule():
  """The rules are the config's: main's hand-kept list had no rule for the weights, so a NaN
  weight reached the jitted retrieval (probabilities of NaN)."""
  with pytest.raises(ValueError, match=r"grasp_weight=nan must be a finite number"):
    registry.get_algorithm("grasp", grasp_weight=math.nan)
  with pytest.raises(ValueError, match=r"swil_weight=inf must be a finite number"):
    registry.get_algorithm("swil", swil_weight=math.inf)
  with pytest.raises(ValueError, match=r"knn_k=0 must be >= 1"):
    registry.get_algorithm("aser", knn_k=0)


def test_settings_are_the_config_typed_and_checked():
  c = base.get_config("released")
  settings = replay_spec.settings(c)
  assert settings.aser.asv_token_matching == "nearest_token"  # the preset's value
  assert settings.selection.distance_max_instances == 6
  assert settings.budget == base.BUILTIN_V2_BUFFER  # 'builtin2', the default benchmark
  # Every field as configured; the paper's Visual Genome fields keep their defaults here.
  typed = dataclasses.asdict(settings)
  assert typed.pop("selection") == {
    **c.replay.selection.to_dict(),
    "visual_genome_loss_threshold": 0.0,
    "visual_genome_min_per_class": 0,
  }
  assert typed == {k: v for k, v in c.replay.to_dict().items() if k != "selection"}
  c.replay.swil_weight, c.replay.aser.knn_k = math.nan, 0
  with pytest.raises(ConfigError) as e:
    replay_setup.make_algorithm(c)
  assert str(e.value).splitlines() == [
    "config.replay.swil_weight=nan must be a finite number",
    "config.replay.aser.knn_k=0 must be >= 1",
  ]


def test_field_rules_of_the_section_are_the_spec_rules():
  rules = config_spec.rules(replay_spec.ReplaySpec, "replay")
  assert {k: v for k, v in config_rules.FIELD_RULES.items() if k.startswith("replay.")} == rules
  assert config_rules.SECTION_SPECS["replay"] is replay_spec.ReplaySpec
  # A registered algorithm is a valid value the moment it exists: the option list is read
  # when checking (the throwaway one: tests/replay/test_extending.py).
  assert rules["replay.algorithm"]("sw_grasp") == "" and rules["replay.algorithm"]("none") == ""
  assert "known: ['a_sw_grasp'" in rules["replay.algorithm"]("sweel")


def _another_value(rule, default):
  """A valid value of a field other than its default: the other bool, another option of a
  choice (as its message lists them), else the first candidate the rule accepts."""
  if isinstance(default, bool):
    return not default
  message = rule(object())
  if "known: [" in message:
    options = ast.literal_eval(message.split("known: ")[1].removesuffix(" or None"))
    return next(o for o in options if o != default)
  numeric = isinstance(default, (int, float))
  for candidate in ((default + 1,) if numeric else ()) + (1, 0.5, "another_folder"):
    if candidate != default and not rule(candidate):
      return candidate
  raise AssertionError(f"no other value for {rule}")


def test_each_replay_field_changes_the_buffer_key_or_says_why(tmp_path):
  """Every leaf of ReplaySpec, set to another valid value: the buffer's key changes exactly
  for the fields that declare `key=True` (a field added to the spec is covered unedited)."""
  annotations = tmp_path / "instances.json"
  annotations.write_text("{}")
  source = types.SimpleNamespace(annotation_file=str(annotations))
  why = config_spec.not_in_keys(replay_spec.ReplaySpec, "replay")
  baseline = digest(cache_keys.buffer_key_material(base.get_config(""), source, {}))
  changed = []
  for path, field in config_spec.leaves(replay_spec.ReplaySpec, "replay"):
    config = base.get_config("")
    *parents, name = path.split(".")
    section = config
    for parent in parents:
      section = section[parent]
    default = section.get(name, field.default)
    section[name] = _another_value(field.metadata["rule"], default)
    key = digest(cache_keys.buffer_key_material(config, source, {}))
    assert (key != baseline) == (path not in why), (path, section[name])
    changed += [path] * (key != baseline)
  # What the buffer is made of (docs/reference.md §6): its size, k and eq. 7's selection.
  selection = (
    "loss_threshold min_per_class fill_all_for_rare_classes max_instances_per_prototype "
    "distance_max_instances drop_images_without_class top_up_order prototype_images "
    "objectness_in_loss"
  )
  assert sorted(changed) == sorted(
    ["replay.budget", "replay.top_k"] + [f"replay.selection.{n}" for n in selection.split()]
  )


# The field tables of docs/configs.md are checked for every section spec, this one included, by
# tests/test_config_rules.py (`config_rules.fields_markdown`).


def test_docs_algorithm_table_lists_the_registry():
  with open(os.path.join(DOCS, "configs.md")) as f:
    section = f.read().split("## Retrieval algorithms")[1].split("\n## ")[0]
  names = re.findall(r"^\| `(\w+)` \|", section, re.M)
  assert sorted(names) == sorted(registry.ALGORITHMS)

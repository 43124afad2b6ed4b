"""owl_cl.config_spec: a section written once, everything derived from it (hand-worked specs)."""

from __future__ import annotations

import dataclasses

from flax.core import FrozenDict
import ml_collections
import pytest

from owl_cl import config_spec as cs
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer
from owl_cl.config_fields import mapping


@dataclasses.dataclass(frozen=True)
class _Inner:
  k: int = cs.field(20, integer(1), "neighbours.")
  distance: str = cs.field("l2", choice(("l2", "cosine")), "metric.", key="how, not what")


@dataclasses.dataclass(frozen=True)
class _Outer:
  ratio: float = cs.field(1.0, POSITIVE, "replays per new image.")
  budget: int | None = cs.field(None, integer(1, optional=True), "images.", type_=int)
  names: tuple = cs.field(("a", "b"), lambda v: "", "names.")
  extra: str = cs.field("x", choice(("x", "y")), "only with :paper.", preset="paper")
  inner: _Inner = cs.section(_Inner, "the inner section.")


def test_defaults_are_the_fields_defaults_with_typed_placeholders():
  c = cs.defaults(_Outer)
  assert c.to_dict() == {
    "ratio": 1.0,
    "budget": None,
    "names": ("a", "b"),
    "inner": {"k": 20, "distance": "l2"},
  }
  c.budget = 5  # a placeholder of type int takes an int (a command-line override)
  with pytest.raises(TypeError):
    c.budget = "five"
  assert cs.defaults(_Outer, presets=("paper",)).extra == "x"


def test_rules_flatten_nested_sections():
  assert sorted(cs.rules(_Outer, "replay")) == [
    "replay.budget",
    "replay.extra",
    "replay.inner.distance",
    "replay.inner.k",
    "replay.names",
    "replay.ratio",
  ]


def test_from_config_freezes_and_checks_every_field_once():
  c = cs.defaults(_Outer)
  c.names = ["p", "q"]
  settings = cs.from_config(_Outer, c, "replay")
  assert settings == _Outer(names=("p", "q"))
  assert settings.inner == _Inner()
  c.ratio, c.inner.k = -1.0, 0
  with pytest.raises(ConfigError) as e:
    cs.from_config(_Outer, c, "replay")
  assert str(e.value).splitlines() == [
    "config.replay.ratio=-1.0 must be > 0",
    "config.replay.inner.k=0 must be >= 1",
  ]


def test_from_config_refuses_a_field_the_spec_lacks():
  c = cs.defaults(_Outer)
  c.ratoi = 2.0
  with pytest.raises(ConfigError, match=r"config.replay has unknown fields \['ratoi'\]"):
    cs.from_config(_Outer, c, "replay")


def test_key_material_keeps_only_fields_that_change_results():
  assert cs.key_material(_Outer()) == {
    "ratio": 1.0,
    "budget": None,
    "names": ["a", "b"],
    "extra": "x",
    "inner": {"k": 20},
  }
  assert cs.not_in_keys(_Outer, "replay") == {"replay.inner.distance": "how, not what"}


@dataclasses.dataclass(frozen=True)
class _PerCache:
  seed: int = cs.field(0, integer(0), "seed.")
  prompts: str = cs.field("none", choice(("none", "all")), "prompts.", key={"buffer": "not read"})
  inner: _Inner = cs.section(_Inner, "augmentations.", key={"buffer": "not augmented"})


def test_a_field_left_out_of_one_caches_key():
  """`key={cache: reason}`: in the other caches' keys, out of that one's (a nested section's
  mapping reaching its leaves, whose own reasons win)."""
  settings = _PerCache()
  assert cs.key_material(settings, "pretrained") == {
    "seed": 0,
    "prompts": "none",
    "inner": {"k": 20},
  }
  assert cs.key_material(settings, "buffer") == {"seed": 0}
  assert cs.key_roles(_PerCache, "data") == {
    "data.seed": True,
    "data.prompts": {"buffer": "not read"},
    "data.inner.k": {"buffer": "not augmented"},
    "data.inner.distance": "how, not what",
  }
  assert cs.not_in_keys(_PerCache, "data") == {"data.inner.distance": "how, not what"}
  with pytest.raises(ValueError, match=r"unknown caches \['bufer'\]"):
    cs.field(0, integer(0), "doc", key={"bufer": "a typo"})


def test_a_field_must_say_what_it_is():
  with pytest.raises(ValueError, match="type_"):
    cs.field(None, POSITIVE, "doc")
  with pytest.raises(ValueError, match="why"):
    cs.field(1, POSITIVE, "doc", key="")
  with pytest.raises(ValueError, match="tuple"):
    cs.field([1], POSITIVE, "doc")


def test_doc_rows():
  assert cs.doc_rows(_Outer, "r")[0] == ("r.ratio", "1.0", "replays per new image.")
  assert ("r.budget", "None", "images.") in cs.doc_rows(_Outer, "r")
  assert isinstance(cs.defaults(_Inner), ml_collections.ConfigDict)


@dataclasses.dataclass(frozen=True)
class _Top:
  seed: int = cs.field(0, integer(0), "seed.")
  overrides: FrozenDict = cs.field(FrozenDict({"k": 8}), mapping, "overrides.")
  inner: _Inner = cs.section(_Inner, "the inner section.")


def test_top_level_fields_and_a_frozen_mapping_default():
  """Prefix '' (the config's top-level fields): paths and messages without a leading dot; a
  frozen mapping default becomes the config's own ConfigDict and a dict in the keys."""
  c = cs.defaults(_Top)
  assert isinstance(c.overrides, ml_collections.ConfigDict)
  assert c.to_dict() == {"seed": 0, "overrides": {"k": 8}, "inner": {"k": 20, "distance": "l2"}}
  assert sorted(cs.rules(_Top, "")) == ["inner.distance", "inner.k", "overrides", "seed"]
  c.seed, c.inner.k = -1, 0
  with pytest.raises(ConfigError) as e:
    cs.from_config(_Top, c, "")
  assert str(e.value).splitlines() == [
    "config.seed=-1 must be >= 0",
    "config.inner.k=0 must be >= 1",
  ]
  c = cs.defaults(_Top)
  c.sede = 1
  with pytest.raises(ConfigError, match=r"^config has unknown fields \['sede'\]"):
    cs.from_config(_Top, c, "")
  assert cs.key_material(_Top()) == {"seed": 0, "overrides": {"k": 8}, "inner": {"k": 20}}
  assert cs.doc_rows(_Top, "")[1] == ("overrides", "{'k': 8}", "overrides.")

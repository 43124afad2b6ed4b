"""owl_cl.config_spec: a section written once, everything derived from it (hand-worked specs)."""

from __future__ import annotations

import dataclasses

import ml_collections
import pytest

from owl_cl import config_spec as cs
from owl_cl.config_fields import POSITIVE
from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import choice
from owl_cl.config_fields import integer


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


def test_a_mapping_default_is_a_config_dict_users_extend():
  import types  # noqa: PLC0415

  @dataclasses.dataclass(frozen=True)
  class _WithMapping:
    per_name: types.MappingProxyType = cs.field(
      types.MappingProxyType({}), lambda v: "", "overrides by name."
    )

  c = cs.defaults(_WithMapping)
  assert isinstance(c.per_name, ml_collections.ConfigDict) and c.per_name.to_dict() == {}
  c.per_name.a = {"x": 1}  # a user's override of one name
  assert cs.from_config(_WithMapping, c, "s").per_name == {"a": {"x": 1}}
  assert cs.doc_rows(_WithMapping, "s") == [
    ("s.per_name", "mappingproxy({})", "overrides by name.")
  ]
  assert _WithMapping().per_name == {}

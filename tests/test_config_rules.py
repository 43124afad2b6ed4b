"""config_rules.SECTION_SPECS: every field of every section spec changes the cache key of what
it feeds, or says why not and leaves every key unchanged (issue 47, "Done when" items 2-3)."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest

from owl_cl import cache_keys
from owl_cl import config_rules
from owl_cl import config_spec
from owl_cl import pretrained
from owl_cl.model.spec import ModelSpec
from owl_cl.utils import digest

# The pre-training annotations' digest stands for a benchmark's (no benchmark is built).
_PRETRAIN_DATA = "0123456789abcdef"


def _set(config, path: str, value) -> None:
  """`config.<path> = value`, past ml_collections' type check of a None placeholder."""
  *parents, name = path.split(".")
  for part in parents:
    config = config[part]
  with config.ignore_type():
    config[name] = value


# Values the generic candidates below cannot make: dataset entries, ranges, distributions, a
# file that exists (the model read from `init_checkpoint` is named by its contents), a model
# override.
_GIVEN = {
  "init_checkpoint": __file__,
  "model.overrides": {"context_length": 8, "vision_layers": 2},
  "data.sequence": ({"suite": "odinw_paper"},),
  "data.pretrain": {"name": "o365", "kind": "objects365"},
  "data.held_out": {"name": "lvis", "kind": "lvis"},
  "data.zero_shot": ({"name": "coco", "kind": "coco2017"},),
  "data.augment.crop_area_range": (0.5, 1.0),
  "data.augment.crop_aspect_ratio_range": (0.5, 2.0),
  "data.augment.mosaic_sizes": (1, 2),
  "data.augment.mosaic_probs": (0.5, 0.5),
}


def _other_value(path: str, f: dataclasses.Field):
  """A value of the field `path` other than its default that its rule takes."""
  rule, default = f.metadata["rule"], f.default
  if path in _GIVEN:
    assert _GIVEN[path] != default and not rule(_GIVEN[path]), path
    return _GIVEN[path]
  if hasattr(rule, "options"):
    options = rule.options() if callable(rule.options) else rule.options
    candidates = [o for o in options if o != default]
  elif isinstance(default, bool):
    candidates = [not default]
  elif f.metadata["type"] is str or isinstance(default, str):
    candidates = [f"{default or 'x'}_other", "0"]  # '0': the first stored task order
  elif isinstance(default, tuple) or f.metadata["type"] is tuple:
    # a shorter tuple, a step table, a preset name
    candidates = [(default or ())[:1], (("a", 1),), ("text_tower",)]
  elif hasattr(default, "keys"):
    candidates = [{**default, "x": {"y": 1}}]
  else:  # a number or None: the nearest values above and below its bounds' inside
    base = 1 if default is None else default
    candidates = [base + 1, base / 2, base - 1, 2, 0.5]
  return next(v for v in candidates if v != default and not rule(v))


def _keys(config) -> dict[str, str]:
  """The cache keys the section specs feed, by cache (`config_spec.CACHES`), computed from
  the config as their builders do: the pre-trained model's (`pretrained.cache_key`) and the
  replay buffer's (`cache_keys.buffer_key_material`) on a fixed pre-trained model (its key
  holds the pre-trained model's; with an init checkpoint, that model's contents and fields)."""
  model = config_spec.from_config(ModelSpec, config.model, "model")
  pretrained_key = pretrained.cache_key(
    config, model, resize_method="resize_with_pad", pretrain_data=_PRETRAIN_DATA
  )
  # This file stands for the pre-training annotations, whose digest the key takes.
  source = types.SimpleNamespace(annotation_file=__file__)
  material = cache_keys.buffer_key_material(config, source, {"cache_key": "a fixed model"})
  return {"pretrained": pretrained_key, "buffer": digest(material)}


def _fields():
  for prefix, spec in config_rules.SECTION_SPECS.items():
    yield from config_spec.leaves(spec, prefix)


def _roles():
  for prefix, spec in config_rules.SECTION_SPECS.items():
    yield from config_spec.key_roles(spec, prefix).items()


@pytest.mark.parametrize("path", [path for path, _ in _fields()])
def test_each_field_changes_a_cache_key_or_says_why_not(path):
  """A field in keys (`key=True`) set to another valid value changes a key; a field left out
  names its reason, and that value changes no key; a field left out of some caches' keys
  (`key={cache: reason}`) changes another's and none of theirs (a wrong reason fails here)."""
  from owl_cl.configs import base  # pylint: disable=g-import-not-at-top

  f, role = dict(_fields())[path], dict(_roles())[path]
  config = base.get_config("builtin1")
  before = _keys(config)
  value = _other_value(path, f)
  _set(config, path, value)
  assert config_rules.FIELD_RULES[path](value) == ""
  after = _keys(config)
  changed = {cache for cache in before if after[cache] != before[cache]}
  if role is True:
    assert changed, f"config.{path}={value!r} changes no cache key"
  elif isinstance(role, str):
    assert len(role.split()) >= 3, "a field left out of keys says why"
    assert not changed, f"config.{path}={value!r} changes a key: {role!r}"
  else:
    assert all(len(why.split()) >= 3 for why in role.values()), "each cache says why"
    assert changed and not changed & set(role), f"config.{path}={value!r}: {changed}, {role}"


def test_a_changed_init_checkpoint_file_at_the_same_path_changes_the_model_key(tmp_path):
  """The model read from `init_checkpoint` is named by its contents, not its path."""
  from owl_cl.configs import base  # pylint: disable=g-import-not-at-top

  path = tmp_path / "ckpt.msgpack"
  path.write_bytes(b"parameters")
  config = base.get_config("builtin1")
  config.init_checkpoint = str(path)
  before = _keys(config)
  path.write_bytes(b"parameterz")
  assert os.path.getsize(path) == 10 and _keys(config)["buffer"] != before["buffer"]


def test_docs_list_every_spec_field_as_the_specs_say():
  """docs/configs.md's tables of the spec sections are `config_rules.fields_markdown()`: a
  field added to a spec, or a changed default or doc, shows here until the docs say it (the
  assertion prints the tables to paste)."""
  path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "configs.md")
  with open(path) as f:
    docs = f.read()
  start, end = "<!-- fields: begin -->\n", "<!-- fields: end -->"
  written = docs[docs.index(start) + len(start) : docs.index(end)]
  expected = config_rules.fields_markdown()
  assert written.strip() == expected.strip(), expected


def _section_paths(prefix: str, spec: type, paths) -> set[str]:
  """The paths of `paths` in the section `prefix` ('' the top-level fields of `spec`)."""
  if prefix:
    return {p for p in paths if p.startswith(prefix + ".")}
  top = {f.name for f in dataclasses.fields(spec)}
  return {p for p in paths if p.split(".")[0] in top}


@pytest.mark.parametrize("arg", ["", "paper"])
def test_each_spec_section_is_its_spec_in_the_rules_and_the_config(arg):
  """For each section of SECTION_SPECS, `FIELD_RULES` holds exactly the spec's rules (no rule
  of a removed field, none copied) and the base config exactly its fields and defaults."""
  from owl_cl.configs import base  # pylint: disable=g-import-not-at-top

  config = base.get_config(arg)
  for prefix, spec in config_rules.SECTION_SPECS.items():
    rules = config_spec.rules(spec, prefix)
    paths = _section_paths(prefix, spec, config_rules.FIELD_RULES)
    assert {p: config_rules.FIELD_RULES[p] for p in paths} == rules, prefix
    section = config[prefix] if prefix else config
    # A field of a preset (`preset='paper'`) is in the config of that preset only.
    presets = (None, *arg.split(","))
    leaves = [p for p, f in config_spec.leaves(spec) if f.metadata["preset"] in presets]
    flat = _flat(section, leaves={p for p, _ in config_spec.leaves(spec)})
    assert sorted(_section_paths("", spec, flat)) == sorted(leaves), prefix
  # The presets leave defaults to the specs; with '' the sections equal their defaults.
  if arg == "":
    for prefix in ("model", "pretrain", "checkpoint"):
      spec = config_rules.SECTION_SPECS[prefix]
      assert config[prefix].to_dict() == config_spec.defaults(spec).to_dict(), prefix


def _flat(section, prefix: str = "", *, leaves: set[str]) -> list[str]:
  """The leaf paths of a ConfigDict section: a field of the spec (`leaves`) is one leaf even
  when its value is a dict (`model.overrides`, `train.per_dataset`, `data.held_out`), as in
  `FIELD_RULES`."""
  out = []
  for name in section.keys():
    path = f"{prefix}.{name}" if prefix else name
    value = section[name]
    if hasattr(value, "keys") and path not in leaves:
      out += _flat(value, path, leaves=leaves)
    else:
      out.append(path)
  return out


def test_a_field_added_to_a_spec_reaches_rules_docs_and_the_cache_key(monkeypatch):
  """A throwaway field on `PretrainSpec` (a subclass standing in for the edited class): its
  rule, its docs row and the pre-trained model's key follow with no other edit."""
  from owl_cl.config_fields import integer  # pylint: disable=g-import-not-at-top
  from owl_cl.configs import base  # pylint: disable=g-import-not-at-top
  from owl_cl.train.pretrain_spec import PretrainSpec  # pylint: disable=g-import-not-at-top

  probe = config_spec.field(3, integer(0), "A probe field.")
  extended = dataclasses.make_dataclass(
    "Extended", [("probe", int, probe)], bases=(PretrainSpec,), frozen=True
  )
  monkeypatch.setattr(cache_keys, "PretrainSpec", extended)
  monkeypatch.setitem(config_rules.SECTION_SPECS, "pretrain", extended)
  assert config_spec.rules(extended, "pretrain")["pretrain.probe"](-1) == "must be >= 0"
  assert "| `pretrain.probe` | `3` | A probe field. | yes |" in config_rules.fields_markdown()
  config = base.get_config("builtin1")
  config.pretrain = config_spec.defaults(extended)
  before = _keys(config)
  config.pretrain.probe = 4
  assert _keys(config) != before

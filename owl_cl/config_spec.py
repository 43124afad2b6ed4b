"""Section specs: each config field written once, with its default, rule, doc and cache-key role.

A config section (`model`, `loss`, `replay`, `data`, `train`, `eval`, `checkpoint`, ...) is a
frozen dataclass defined beside the code that consumes it, in the way of big_vision's
`Model(**config.model)`: the dataclass's fields are the section's schema. Everything else
derives from it by iterating the fields:

* `defaults(Spec)`: the section's ConfigDict of defaults, which `owl_cl/configs/base.py`
  assigns (`c.replay = defaults(ReplaySpec)`), so the config files stay ml_collections
  ConfigDicts as users write them;
* `rules(Spec, 'replay')`: {'replay.<field>': rule} for `validation.range_problems` (through
  `config_rules.FIELD_RULES`), which checks every field before any work;
* `from_config(Spec, config.replay, 'replay')`: the typed, frozen settings the consumer passes
  on, checked once at that boundary with the same one-line messages;
* `key_material(spec, cache)`: the fields that change what a cache entry holds, for the cache
  keys; a field that does not says why (`key='...'`), a field that one cache's builder does
  not read says so for that cache (`key={'buffer': '...'}`), and a test walks every field of
  every spec;
* `doc_rows(Spec, 'replay')`: the rows of the field tables of docs/configs.md.

A field whose value is itself a section (`replay.aser`) is a nested spec (`section(AserSpec)`).
This module imports only `config_fields` (a leaf), so every layer may define its specs here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import dataclasses
import math
from typing import Any

import ml_collections

from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import Rule

# The metadata keys of a spec field.
_RULE, _DOC, _KEY, _TYPE, _PRESET = "rule", "doc", "key", "type", "preset"

# The stored caches whose keys the specs feed (`owl_cl.cache_keys`): the pre-trained model's
# and the replay buffer's. A field's `key={cache: reason}` names some of them.
CACHES = ("pretrained", "buffer")

# `type_` of a None default that any value replaces (a plain None in the ConfigDict, not a
# typed placeholder): fields holding structures, e.g. `data.sequence`'s list of dataset
# entries, whose dicts ml_collections then turns into ConfigDicts as users write them.
UNTYPED = type(None)


def field(
  default: Any,
  rule: Rule,
  doc: str,
  *,
  key: bool | str | Mapping[str, str] = True,
  type_: type | None = None,
  preset: str | None = None,
) -> Any:
  """One config field of a section spec (a `dataclasses.field`).

  Args:
    default: its value in the base config (a tuple for a sequence, a hashable mapping such
      as flax's `FrozenDict` for a mapping: specs are frozen).
    rule: the `config_fields.Rule` its value must pass ('' when fine).
    doc: one or two sentences for docs/configs.md: what it does, its unit, its source.
    key: True when the field changes what a cache entry built from the section holds (it
      enters that entry's key); otherwise the reason it does not, e.g. 'how a step executes,
      not what it computes'; or {cache: reason} (caches of `CACHES`): it enters the keys of
      every other cache, and those named say why their builder does not read it.
    type_: the type of a field whose default is None (ml_collections' placeholder, so that
      `--config.<field>=<value>` is parsed to it); `UNTYPED` keeps a plain None.
    preset: the config argument that adds the field (e.g. 'paper'); such a field is absent
      from the base config and checked only when present.

  Raises:
    ValueError: a None default without `type_`, an empty `doc` / `key` reason, or a cache
      in `key` that `CACHES` lacks.
  """
  if default is None and type_ is None:
    raise ValueError("a field whose default is None needs type_ (the placeholder's type)")
  _check_key(key)
  if not doc.strip():
    raise ValueError("a field needs a doc")
  metadata = {_RULE: rule, _DOC: doc, _KEY: key, _TYPE: type_, _PRESET: preset}
  if isinstance(default, (list, dict, set)):
    raise ValueError("a spec is frozen: give a sequence default as a tuple")
  return dataclasses.field(default=default, metadata=metadata)


def _check_key(key: bool | str | Mapping[str, str]) -> None:
  """Raises ValueError for a `key` reason that is empty or names a cache `CACHES` lacks."""
  reasons = dict(key) if isinstance(key, Mapping) else {"": key}
  if any(isinstance(r, str) and not r.strip() for r in reasons.values()):
    raise ValueError("a field needs a doc, and a key=False reason must say why")
  unknown = sorted(set(reasons) - {"", *CACHES})
  if unknown:
    raise ValueError(f"key names unknown caches {unknown}; known: {list(CACHES)}")


def section(spec: type, doc: str, *, key: bool | Mapping[str, str] = True) -> Any:
  """A field holding a nested section (`replay.aser`), its defaults those of `spec`; `key`
  {cache: reason} leaves the whole section out of those caches' keys (as `field`'s)."""
  _check_key(key)
  return dataclasses.field(
    default_factory=spec, metadata={_DOC: doc, _KEY: key, _RULE: None, _TYPE: spec}
  )


def is_spec(value: Any) -> bool:
  """True for a spec class or instance (a dataclass made with `field` / `section`)."""
  return dataclasses.is_dataclass(value)


def _nested(f: dataclasses.Field) -> type | None:
  return f.metadata.get(_TYPE) if f.metadata.get(_RULE) is None else None


def _join(prefix: str, name: str) -> str:
  """'<prefix>.<name>', or `prefix` / `name` when the other is '' (the top level)."""
  return ".".join(part for part in (prefix, name) if part)


def leaves(spec: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
  """('<prefix>.<field>', field) for every leaf field of `spec`, nested sections flattened."""
  for f in dataclasses.fields(spec):
    path = _join(prefix, f.name)
    if (nested := _nested(f)) is not None:
      yield from leaves(nested, path)
    else:
      yield path, f


def defaults(spec: type, *, presets: tuple[str, ...] = ()) -> ml_collections.ConfigDict:
  """The section's base-config ConfigDict: each field's default (a None default as a typed
  placeholder); fields of a `preset` only when it is in `presets`."""
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(spec):
    if (nested := _nested(f)) is not None:
      out[f.name] = defaults(nested, presets=presets)
    elif f.metadata[_PRESET] is None or f.metadata[_PRESET] in presets:
      if f.default is None and f.metadata[_TYPE] is not UNTYPED:
        out[f.name] = ml_collections.config_dict.placeholder(f.metadata[_TYPE])
      elif isinstance(f.default, Mapping):  # a frozen mapping: the config's own ConfigDict
        out[f.name] = ml_collections.ConfigDict(dict(f.default))
      else:
        out[f.name] = f.default
  return out


def rules(spec: type, prefix: str) -> dict[str, Rule]:
  """{'<prefix>.<field>': rule} for every leaf of `spec` (`config_rules.FIELD_RULES`)."""
  return {path: f.metadata[_RULE] for path, f in leaves(spec, prefix)}


def _frozen(value: Any) -> Any:
  """`value` with lists as tuples and ConfigDicts / dicts as dicts of frozen values."""
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  if hasattr(value, "keys") and hasattr(value, "items"):
    return {k: _frozen(v) for k, v in value.items()}
  return value


def from_config(spec: type, config_section: Any, prefix: str) -> Any:
  """The frozen settings of `config_section` (`config.<prefix>`), every field checked.

  Args:
    spec: the section's spec class.
    config_section: the ConfigDict (or dict) of the section.
    prefix: its path in the config, e.g. 'replay' (named in the messages); '' for the
      top-level fields.

  Returns:
    An instance of `spec`: sequences as tuples, nested sections as their specs; a field of a
    preset that the section lacks keeps its default.

  Raises:
    ConfigError: one line per bad field, 'config.<prefix>.<field>=<value> <what it must be>'
      (`validation.range_problems`' format), or a field the spec does not define.
  """
  values, problems = {}, []
  known = {f.name for f in dataclasses.fields(spec)}
  unknown = sorted(set(config_section.keys()) - known)
  if unknown:
    problems.append(
      f"{_join('config', prefix)} has unknown fields {unknown}; known: {sorted(known)}"
    )
  for f in dataclasses.fields(spec):
    if f.name not in config_section:
      continue
    value = config_section[f.name]
    if (nested := _nested(f)) is not None:
      try:
        values[f.name] = from_config(nested, value, _join(prefix, f.name))
      except ConfigError as e:
        problems.append(str(e))
      continue
    if problem := f.metadata[_RULE](value):
      problems.append(f"config.{_join(prefix, f.name)}={value!r} {problem}")
    values[f.name] = _frozen(value)
  if problems:
    raise ConfigError("\n".join(problems))
  return spec(**values)


def _jsonable(value: Any) -> Any:
  if isinstance(value, tuple):
    return [_jsonable(v) for v in value]
  if isinstance(value, Mapping):
    return {k: _jsonable(v) for k, v in sorted(value.items())}
  if isinstance(value, float) and not math.isfinite(value):
    return repr(value)
  return value


def _keyed(key: bool | str | Mapping[str, str], cache: str | None) -> bool:
  """Whether a field of `key` enters the key of `cache` (None: any cache's)."""
  if isinstance(key, Mapping):
    return cache not in key
  return key is True


def key_material(settings: Any, cache: str | None = None) -> dict[str, Any]:
  """{field: value} of the fields of `settings` (a spec instance) that enter cache keys
  (`key=True`, or a `key` mapping that does not name `cache`), nested sections as nested
  dicts, JSON-serialisable (tuples as lists).

  Args:
    settings: a spec instance.
    cache: the cache of `CACHES` whose key is made; None: the fields that enter any key.
  """
  out = {}
  for f in dataclasses.fields(settings):
    value = getattr(settings, f.name)
    if not _keyed(f.metadata[_KEY], cache):
      continue
    out[f.name] = key_material(value, cache) if _nested(f) is not None else _jsonable(value)
  return out


def key_roles(spec: type, prefix: str) -> dict[str, bool | str | dict[str, str]]:
  """{'<prefix>.<field>': role} per leaf: True (in every key of its section's caches), the
  reason it is in none, or {cache: reason} of the caches whose keys leave it out (a nested
  section's own `key` mapping included)."""
  out = {}
  for f in dataclasses.fields(spec):
    path, key = _join(prefix, f.name), f.metadata[_KEY]
    if (nested := _nested(f)) is None:
      out[path] = dict(key) if isinstance(key, Mapping) else key
      continue
    for inner, role in key_roles(nested, path).items():
      if isinstance(key, Mapping) and not isinstance(role, str):
        role = {**key, **(role if isinstance(role, dict) else {})}
      out[inner] = role
  return out


def not_in_keys(spec: type, prefix: str) -> dict[str, str]:
  """{'<prefix>.<field>': reason} of the leaves left out of every cache key, with why."""
  return {path: role for path, role in key_roles(spec, prefix).items() if isinstance(role, str)}


def doc_rows(spec: type, prefix: str) -> list[tuple[str, str, str]]:
  """(`'<prefix>.<field>'`, default as written in Python, doc) per leaf, for docs/configs.md."""
  return [
    (path, _written(f.default), " ".join(f.metadata[_DOC].split()))
    for path, f in leaves(spec, prefix)
  ]


def _written(default: Any) -> str:
  """`default` as a config file writes it (a frozen mapping as a dict)."""
  return repr(dict(default) if isinstance(default, Mapping) else default)

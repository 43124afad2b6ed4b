"""`replay.budget` enters the replay store's cache key only when set (docs/baselines.md)."""

import types

import pytest

from owl_cl import cache_keys
from owl_cl.testing.configs import tiny_config
from owl_cl.utils import digest


@pytest.fixture
def key(tmp_path):
  annotations = tmp_path / "instances.json"
  annotations.write_text('{"images": []}')
  source = types.SimpleNamespace(annotation_file=str(annotations))
  config = tiny_config("uniform", str(tmp_path / "cache"))

  def material(budget):
    config.replay.budget = budget
    return cache_keys.buffer_key_material(config, source, {"cache_key": "m"})

  return material


def test_budget_changes_the_buffer_key(key):
  unset = key(None)
  assert "budget" not in unset  # stores built before the field existed keep their key
  keys = [key(b) for b in (0.01, 0.1, 500, 1, 1.0)]
  assert [k["budget"] for k in keys] == [0.01, 0.1, 500, 1, 1.0]
  assert all({**k, "budget": None} == {**unset, "budget": None} for k in keys)
  # The store cache's digest (sorted-key JSON): a count of 1 and the whole set (1.0) differ.
  assert len({digest(k) for k in [unset, *keys]}) == 6

"""`replay.budget` enters the replay store's cache key (docs/baselines.md)."""

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
  assert unset["replay"]["budget"] is None
  keys = [key(b) for b in (0.01, 0.1, 500, 1, 1.0)]
  assert [k["replay"]["budget"] for k in keys] == [0.01, 0.1, 500, 1, 1.0]
  # Nothing else changes, and the store cache's digest (sorted-key JSON) tells a count of 1
  # from the whole set (1.0).
  assert all({**k, "replay": {**k["replay"], "budget": None}} == unset for k in keys)
  assert len({digest(k) for k in [unset, *keys]}) == 6

"""The run's seeds: `seed` and its parts `seeds.model` / `seeds.data` / `seeds.retrieval`."""

import pytest

from owl_cl import benchmark
from owl_cl import pretrained
from owl_cl import trainer
from owl_cl import validation
from owl_cl.config_fields import seed_of
from owl_cl.detector import Detector
from owl_cl.testing.configs import load_config
from owl_cl.testing.configs import tiny_config


def test_each_part_defaults_to_seed_and_varies_alone():
  config = load_config("swil")
  assert [seed_of(config, p) for p in ("model", "data", "retrieval")] == [0, 0, 0]
  config.seed = 4
  assert [seed_of(config, p) for p in ("model", "data", "retrieval")] == [4, 4, 4]
  config.seeds.retrieval = 9
  assert [seed_of(config, p) for p in ("model", "data", "retrieval")] == [4, 4, 9]
  config.seeds.data = 0  # 0 is a value, not "unset"
  assert [seed_of(config, p) for p in ("model", "data", "retrieval")] == [4, 0, 9]
  with pytest.raises(ValueError, match="unknown seed part 'buffer'"):
    seed_of(config, "buffer")


def test_seed_rules():
  config = load_config("swil")
  config.seeds.data = -1
  config.seed = -2
  problems = "\n".join(validation.range_problems(config, num_devices=1))
  assert "config.seeds.data=-1 must be >= 0 or None" in problems
  assert "config.seed=-2 must be >= 0" in problems


def test_runs_that_share_the_model_seed_share_the_cached_model(pretrained_cache_dir, monkeypatch):
  """The session's cached model was pre-trained with seed 0: a run with seed 5 and
  seeds.model 0 loads it (pre-training would raise here); one with seed 5 alone would not."""

  def no_pretraining(*args, **kwargs):
    raise AssertionError("pre-trained again: the model seed did not key the cache alone")

  monkeypatch.setattr(trainer, "pretrain", no_pretraining)
  config = tiny_config("swil", pretrained_cache_dir)
  config.seed = 5
  config.seeds.model = 0
  bench = benchmark.load_benchmark(config)
  _, meta = pretrained.pretrained_params(Detector(config), bench, None)
  assert meta["cache_key"]
  config.seeds.model = None
  with pytest.raises(AssertionError, match="pre-trained again"):
    pretrained.pretrained_params(Detector(config), bench, None)

"""Session fixtures shared by the end-to-end tests (what is expensive to build, built once)."""

import pytest

from owl_cl import benchmark
from owl_cl import pretrained
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_config


@pytest.fixture(scope="session")
def pretrained_cache_dir(tmp_path_factory) -> str:
  """A cache folder holding the built-in benchmark and the tiny configs' pre-trained model.

  Every `tiny_config` (whatever the retrieval) shares the pre-training settings, so runs with
  this cache load the model instead of pre-training it; tests never depend on one another
  to have filled it.
  """
  cache_dir = str(tmp_path_factory.mktemp("cache"))
  config = tiny_config("swil", cache_dir)
  pretrained.pretrained_params(Detector(config), benchmark.load_benchmark(config), None)
  return cache_dir

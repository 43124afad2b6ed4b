"""The input-pipeline options of the config (docs/reference.md §3, §5) reach the pipeline, the
buffer and
the cache keys: `data.squash_resize`, `merge_iou`, `negatives_by_frequency`, `host_sharding`
and `data.augment.*`."""

import os
import sys

import numpy as np
import pytest

from owl_cl import cache_keys
from owl_cl import config_spec
from owl_cl.config_fields import ConfigError
from owl_cl.configs import base
from owl_cl.data import coco
from owl_cl.data import data_spec
from owl_cl.data import input_pipeline
from owl_cl.data import label_ops
from owl_cl.data.spec import ExampleSpec
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "data"))
from owl_data_helpers import basic_dataset  # noqa: E402  pylint: disable=g-import-not-at-top
from owl_data_helpers import write_coco  # noqa: E402  pylint: disable=g-import-not-at-top


@pytest.fixture
def source(tmp_path):
  images, anns, cats = basic_dataset()
  path, image_dir = write_coco(str(tmp_path / "coco"), images, anns, cats)
  return coco.CocoSource(path, image_dir)


def _batches_equal(a, b):
  a, b = list(a), list(b)
  assert len(a) == len(b) and a
  for x, y in zip(a, b):
    assert set(x) == set(y)
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def _explicit(detector, source, **options):
  c = detector.config
  return input_pipeline.train_dataset(
    source,
    ExampleSpec(
      class_tokens=detector.train_class_tokens(source),
      empty_tokens=detector.empty_tokens,
      image_size=detector.image_size,
      num_queries=c.data.num_queries,
      max_instances=c.data.max_instances,
      num_negatives=c.data.num_negatives,
    ),
    batch_size=1,
    seed=3,
    epoch=1,
    **options,
  )


def test_defaults_give_the_plain_pipeline(tmp_path, source):
  detector = Detector(tiny_config("swil", str(tmp_path / "cache")))
  _batches_equal(
    detector.train_batches(source, batch_size=1, seed=3, epoch=1), _explicit(detector, source)
  )
  assert _differing(detector.config) == {}


def test_every_option_reaches_the_pipeline(tmp_path, source):
  c = tiny_config("swil", str(tmp_path / "cache"))
  c.data.squash_resize = True
  c.data.merge_iou = None
  c.data.negatives_by_frequency = True
  c.data.augment.hflip = True
  c.data.augment.random_crop = True
  c.data.augment.crop_area_range = (0.5, 1.0)
  c.data.augment.mosaic_sizes = (1, 2)
  c.data.augment.mosaic_probs = (0.5, 0.5)
  detector = Detector(c)
  frequencies = label_ops.class_frequencies(source)
  np.testing.assert_array_equal(frequencies, [1, 1, 1])  # dog, cat: image 5; bird: image 2
  expected = _explicit(
    detector,
    source,
    squash=True,
    merge_iou=None,
    negative_weights=frequencies,
    hflip=True,
    random_crop=True,
    crop_area_range=(0.5, 1.0),
    crop_aspect_ratio_range=(0.75, 1.33),
    crop_min_area_fraction=0.6,
    mosaic_sizes=(1, 2),
    mosaic_probs=(0.5, 0.5),
  )
  _batches_equal(detector.train_batches(source, batch_size=1, seed=3, epoch=1), expected)
  # ... and they change the batches (the options are not silently ignored).
  with pytest.raises(AssertionError):
    _batches_equal(
      detector.train_batches(source, batch_size=1, seed=3, epoch=1), _explicit(detector, source)
    )
  # The buffer gets the preprocessing options but no augmentation.
  assert set(detector.example_options(source)) == {"squash", "merge_iou", "negative_weights"}
  key = _differing(c, cache_keys.PRETRAINED)
  assert key["squash_resize"] is True and key["merge_iou"] is None
  assert key["negatives_by_frequency"] is True and key["augment"]["hflip"] is True
  assert "augment" not in _differing(c, cache_keys.BUFFER)


def test_mosaic_lengths_must_match(tmp_path):
  c = tiny_config("swil", str(tmp_path / "cache"))
  c.data.augment.mosaic_sizes = (1, 2, 3)
  c.data.augment.mosaic_probs = (0.5, 0.5)
  with pytest.raises(ConfigError, match="mosaic_sizes"):
    Detector(c).augment_options()


def test_defaults_key_nothing_and_the_paper_weights_negatives_by_frequency():
  # The options' defaults are the config's (both are `DataSpec`'s): a default config keys
  # the defaults (version 2 of the built-in benchmark aside); the paper's protocol
  # (released-code options) its own.
  assert _differing(base.get_config("builtin1")) == {}
  assert _differing(base.get_config("")) == {"builtin": {"version": 2}}
  paper = base.get_config("paper")
  assert paper.data.negatives_by_frequency
  # The paper's examples (configs/base.py): its query and instance counts and prompts.
  example = {
    "num_queries": 126,
    "num_negatives": 50,
    "max_instances": 100,
    "train_prompt_templates": "clip_80",
  }
  assert _differing(paper) == {**example, "negatives_by_frequency": True}
  assert _differing(base.get_config("paper,released")) == {
    **example,
    "negatives_by_frequency": True,
    "squash_resize": True,
  }


def _differing(config, cache=None) -> dict:
  """The `data` fields of `config` in the cache keys (`cache`'s) that differ from DataSpec's
  defaults."""
  material = config_spec.key_material(data_spec.settings(config), cache)
  default = config_spec.key_material(data_spec.DataSpec(), cache)
  return {k: v for k, v in material.items() if v != default[k]}

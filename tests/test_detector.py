"""`detector.Detector`'s settings: the sections it reads, converted and checked once at
construction (`config_spec.from_config`)."""

from __future__ import annotations

import numpy as np
import pytest

from owl_cl.config_fields import ConfigError
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_detector_config


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("data.num_queries", 0, "config.data.num_queries=0 must be >= 1"),
    ("train.log_every_steps", 0, "config.train.log_every_steps=0"),
    ("loss.focal_alpha", 2.0, "config.loss.focal_alpha=2.0"),
    ("pretrain.batch_size", 0, "config.pretrain.batch_size=0 must be >= 1"),
  ],
)
def test_a_bad_field_of_a_section_it_reads_is_one_line_at_construction(field, value, message):
  with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
    Detector(tiny_detector_config(**{field: value}))


def test_the_detector_reads_its_settings_as_converted_at_construction():
  config = tiny_detector_config(**{"data.num_queries": 5, "data.squash_resize": True})
  detector = Detector(config)
  tokens = np.zeros((2, detector.tokenizer.context_length), np.int32)
  # A later change of the ConfigDict does not reach the detector: what it reads is the
  # typed settings taken once (the example, the preprocessing, the loop's logging interval).
  config.data.num_queries, config.data.squash_resize = 9, False
  config.train.log_every_steps = 7
  assert detector.example_spec(tokens).num_queries == 5
  assert detector.example_options(None)["squash"] is True
  assert detector.train_spec.log_every_steps == 20 and detector.data_spec.num_queries == 5

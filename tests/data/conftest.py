"""Fixtures for tests/data."""

import pytest

from owl_data_helpers import basic_dataset, write_coco


@pytest.fixture
def coco_files(tmp_path):
  images, anns, cats = basic_dataset()
  return write_coco(str(tmp_path), images, anns, cats)

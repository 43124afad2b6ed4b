"""Fixtures for tests/data."""

from owl_data_helpers import basic_dataset
from owl_data_helpers import write_coco
import pytest


@pytest.fixture
def coco_files(tmp_path):
  images, anns, cats = basic_dataset()
  return write_coco(str(tmp_path), images, anns, cats)

"""Per-image detections on disk (`eval.save_detections`, issue 49 item 2): the file format, and
a stage's evaluation writing them only when the switch is on."""

import os
import types

import numpy as np
import pytest

from owl_cl import experiment
from owl_cl.eval import detection_files

DETECTIONS = [
  {
    "image_id": np.int64(3),
    "category_id": 7,
    "bbox": np.array([1.5, 2.0, 10.0, 4.25]),
    "score": 0.5,
  },
  {
    "image_id": 4,
    "category_id": np.int32(2),
    "bbox": [0.0, 0.0, 1.0, 1.0],
    "score": np.float32(0.25),
  },
]
PLAIN = [
  {"image_id": 3, "category_id": 7, "bbox": [1.5, 2.0, 10.0, 4.25], "score": 0.5},
  {"image_id": 4, "category_id": 2, "bbox": [0.0, 0.0, 1.0, 1.0], "score": 0.25},
]


def test_round_trip_same_bytes_and_bad_files(tmp_path):
  path = detection_files.detections_path(str(tmp_path), "thermal", "pretrain_val")
  assert path == str(tmp_path / "detections" / "thermal" / "pretrain_val.json.gz")
  detection_files.write_detections(path, DETECTIONS)
  # NumPy scalars and arrays become plain JSON numbers (0.25 and 4.25 are exact in float32).
  assert detection_files.read_detections(path) == PLAIN
  first = open(path, "rb").read()
  detection_files.write_detections(path, PLAIN)
  assert open(path, "rb").read() == first  # no timestamp in the gzip header
  assert os.listdir(os.path.dirname(path)) == ["pretrain_val.json.gz"]  # no temporary left
  bad = tmp_path / "bad.json.gz"
  bad.write_bytes(b"not gzip")
  with pytest.raises(ValueError, match="bad.json.gz: not a detections file"):
    detection_files.read_detections(str(bad))
  with pytest.raises(FileNotFoundError):
    detection_files.read_detections(str(tmp_path / "missing.json.gz"))


class _Detector:
  """`evaluate_dataset` returning fixed metrics, per-class AP and (when asked) detections."""

  def __init__(self, save_detections: bool):
    self.asked = []
    self.eval_spec = types.SimpleNamespace(save_detections=save_detections)

  def evaluate_dataset(self, params, dataset, desc, per_class, return_detections):
    self.asked.append((dataset, per_class, return_detections))
    out = {"AP": 0.5, "per_class": {"a": {"category_id": 1, "AP": 0.5}}}
    return dict(out, detections=list(PLAIN)) if return_detections else out


@pytest.mark.parametrize("save", [False, True])
def test_stage_evaluation_writes_detections_only_when_asked(tmp_path, save):
  session = types.SimpleNamespace(
    bench=types.SimpleNamespace(eval_sets=lambda: [("pretrain_val", "P"), ("thermal", "T")]),
    detector=_Detector(save),
    workdir=str(tmp_path),
    run_id="run",
  )
  out = experiment._Session.evaluate(session, None, "digits", names=["thermal"])
  assert out == {
    "metrics": {"thermal": {"AP": 0.5}},
    "per_class": {"thermal": {"a": {"category_id": 1, "AP": 0.5}}},
  }
  assert session.detector.asked == [("T", True, save)]
  path = detection_files.detections_path(str(tmp_path), "digits", "thermal")
  assert os.path.exists(path) is save
  if save:
    assert detection_files.read_detections(path) == PLAIN
    assert os.listdir(tmp_path / "detections") == ["digits"]

"""WiSE-FT end to end at tiny size (configs/wise_ft.py, docs/baselines.md "WiSE-FT"): each
stage's evaluation is the blended parameters', and the next dataset trains from the blend."""

import jax
import numpy as np
import pytest

from owl_cl import benchmark as benchmark_lib
from owl_cl import experiment
from owl_cl import trainer
from owl_cl.detector import Detector
from owl_cl.eval import detection_files
from owl_cl.testing.configs import tiny_config
from owl_cl.train import wise_ft


def _rows(detections):
  """Detections as `detection_files.write_detections` stores them (plain ints and floats)."""
  return [
    {
      "image_id": int(d["image_id"]),
      "category_id": int(d["category_id"]),
      "bbox": [float(v) for v in d["bbox"]],
      "score": float(d["score"]),
    }
    for d in detections
  ]


def _equal_trees(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# One tiny run (two datasets) and three evaluations of 16 images.
@pytest.mark.slow
def test_each_stage_evaluates_and_carries_the_blend(pretrained_cache_dir, tmp_path, monkeypatch):
  config = tiny_config("wise_ft", pretrained_cache_dir)
  config.eval.save_detections = True  # the per-image scores: the tiny model's AP is 0
  blends, starts = [], []
  blend, train = wise_ft.blend, trainer.train_on_dataset

  def spy_blend(theta_0, theta_ft, alpha):
    out = blend(theta_0, theta_ft, alpha)
    blends.append((alpha, *jax.device_get((theta_0, theta_ft, out))))
    return out

  def spy_train(detector, dataset, params, *args, **kwargs):
    starts.append(jax.device_get(params))
    return train(detector, dataset, params, *args, **kwargs)

  monkeypatch.setattr(wise_ft, "blend", spy_blend)
  monkeypatch.setattr(trainer, "train_on_dataset", spy_train)
  workdir = str(tmp_path / "run")
  results = experiment.run(config, workdir)
  assert results["status"] == "complete"

  # 'each': one blend per dataset, at alpha 0.5, with the pre-trained parameters (stage 1's
  # start); each is the mean of the two trees, computed here in NumPy float32.
  assert [b[0] for b in blends] == [0.5, 0.5] and len(starts) == 2
  for _, theta_0, theta_ft, out in blends:
    assert _equal_trees(theta_0, starts[0])
    assert not _equal_trees(theta_ft, theta_0)  # training moved the parameters
    mean = jax.tree.map(lambda a, b: np.float32(0.5) * a + np.float32(0.5) * b, theta_0, theta_ft)
    assert _equal_trees(out, mean)
  assert _equal_trees(starts[1], blends[0][3])  # dataset 2 trains from stage 1's blend

  # Each stage's stored evaluation (metrics, and the detections of its own dataset) is the
  # blend's; the fine-tuned parameters' detections differ.
  detector, bench = Detector(config), benchmark_lib.load_benchmark(config)
  for (_, _, theta_ft, out), stage in zip(blends, results["stages"][1:]):
    dataset = dict(bench.eval_sets())[stage["name"]]

    def evaluate(params, dataset=dataset, stage=stage):
      found = detector.evaluate_dataset(
        params, dataset, stage["name"], per_class=True, return_detections=True
      )
      return found.pop("per_class"), _rows(found.pop("detections")), found

    per_class, detections, metrics = evaluate(out)
    # assert_equal: NaN (a COCO area with no box) equals NaN.
    np.testing.assert_equal(metrics, stage["metrics"][stage["name"]])
    np.testing.assert_equal(per_class, stage["per_class"][stage["name"]])
    path = detection_files.detections_path(workdir, stage["name"], stage["name"])
    assert detection_files.read_detections(path) == detections
    if stage is results["stages"][-1]:
      assert evaluate(theta_ft)[1] != detections

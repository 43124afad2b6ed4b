"""Tests of owl_cl.analysis on a fake workdir written by the project's own writers."""

import math
import os

from matplotlib.figure import Figure
import numpy as np
import pytest

from owl_cl import analysis
from owl_cl.eval import results as rl
from owl_cl.replay import records as records_lib


def metrics(ap, ap50):
  return {"AP": ap, "AP50": ap50, "AP75": ap / 2}


def make_results(run_id="run-a", algorithm="swil", o365_final=0.225):
  """Same shape as tests/eval/test_results.py make_results; D2 not evaluated at stage 1."""
  stages = [
    {
      "name": "pretrained",
      "metrics": {
        "o365": metrics(0.242, 0.35),
        "lvis": {**metrics(0.290, 0.40), "APr": 0.238},
        "D1": metrics(0.10, 0.20),
        "D2": metrics(0.14, 0.30),
      },
    },
    {
      "name": "D1",
      "metrics": {
        "o365": metrics(0.230, 0.33),
        "lvis": {**metrics(0.270, 0.38), "APr": 0.220},
        "D1": metrics(0.60, 0.80),
      },
    },
    {
      "name": "D2",
      "metrics": {
        "o365": metrics(o365_final, 0.32),
        "lvis": {**metrics(0.249, 0.36), "APr": 0.216},
        "D1": metrics(0.40, 0.70),
        "D2": metrics(0.71, 0.90),
      },
    },
  ]
  return {
    "run_id": run_id,
    "algorithm": algorithm,
    "seed": 0,
    "sequence": ["D1", "D2"],
    "roles": {
      "pretrain": "o365",
      "open_vocab": "lvis",
      "held_out": {"eval_set": "lvis", "AP": "APr", "AP50": None},
      "downstream": ["D1", "D2"],
    },
    "stages": stages,
  }


def write_records(path, num_classes=5, num_candidates=4):
  """Two retrieval calls of 3 replay slots (the last slot invalid) through RetrievalRecords."""
  rec = records_lib.RetrievalRecords(num_classes, num_candidates)
  valid = np.array([True, True, False])
  rec.add(
    {
      "sampled_classes": np.array([1, 1, 3]),
      "swil_entropy": np.array([0.105, 0.995]),
      "grasp_entropy": np.array([0.5, 0.51, 0.9]),
      "used_grasp": np.array([1, 0, 1]),
      "knn_sv": np.array([[0.00025, 0.05], [-0.2, 0.01]]),
      "knn_sv_valid": np.array([1, 0]),
      "min_sv_rank": np.array([1, 4]),
      "selected_rank": np.array([2, 9, 1]),
    },
    valid,
  )
  rec.add(
    {
      "sampled_classes": np.array([4, 0, 0]),
      "swil_entropy": np.array([0.31]),
      "grasp_entropy": np.array([0.5, 0.5, 0.5]),
      "used_grasp": np.array([0, 0, 0]),
      "knn_sv": np.array([[0.00025]]),
      "knn_sv_valid": np.array([1]),
      "min_sv_rank": np.array([2]),
      "selected_rank": np.array([1, 1, 1]),
    },
    valid,
  )
  rec.save(path)
  return rec


@pytest.fixture
def workdir(tmp_path):
  d = str(tmp_path / "swil_seed0")
  rl.write_results(d, make_results())
  write_records(os.path.join(d, "records", "D2.npz"))
  write_records(os.path.join(d, "records", "D1.npz"), num_classes=3)
  return d


def test_load_run(workdir):
  run = analysis.load_run(workdir)
  assert run.results["run_id"] == "run-a" and run.results["algorithm"] == "swil"
  assert list(run.records) == ["D1", "D2"]  # training order, not file order
  r = run.records["D2"]
  assert set(r) == set(analysis.runs.RECORD_KEYS)
  assert r["sampled_class_counts"].tolist() == [
    1,
    2,
    0,
    0,
    1,
  ]  # classes 1, 1 then 4, 0 (valid slots)
  assert r["calls"] == 2
  assert r["used_grasp"].tolist() == [3, 1]
  assert r["selected_rank_counts"].tolist() == [0, 2, 1, 0, 1]  # ranks 2, 9 -> 4 (clipped), 1, 1
  assert run.records["D1"]["sampled_class_counts"].shape == (3,)
  assert run.label == "swil (swil_seed0)"
  with pytest.raises(FileNotFoundError, match="results.json"):
    analysis.load_run(os.path.join(workdir, "missing"))
  np.savez(os.path.join(workdir, "records", "bad.npz"), calls=np.int64(1))
  with pytest.raises(ValueError, match="bad.npz.*sampled_class_counts"):
    analysis.load_run(workdir)


def test_stage_matrix_by_hand(workdir):
  results = analysis.load_run(workdir).results
  rows, columns, values = analysis.stage_matrix(results)  # AP50
  assert rows == ["0: pretrained", "1: D1", "2: D2"]
  assert columns == ["o365", "lvis", "D1", "D2"]
  expected = np.array(
    [[0.35, 0.40, 0.20, 0.30], [0.33, 0.38, 0.80, np.nan], [0.32, 0.36, 0.70, 0.90]]
  )
  np.testing.assert_allclose(values, expected)  # NaNs in the same place
  _, _, ap = analysis.stage_matrix(results, metric="AP")
  assert ap[2, 0] == pytest.approx(0.225) and ap[1, 2] == pytest.approx(0.60)
  _, cols, apr = analysis.stage_matrix(results, metric="APr")
  assert apr[:, cols.index("lvis")].tolist() == pytest.approx([0.238, 0.220, 0.216])
  assert np.isnan(apr[:, cols.index("o365")]).all()
  _, cols, sub = analysis.stage_matrix(results, eval_sets=["D2", "o365"])
  assert cols == ["D2", "o365"] and sub[0].tolist() == pytest.approx([0.30, 0.35])


def test_forgetting_curve(workdir):
  results = analysis.load_run(workdir).results
  stages, values = analysis.forgetting_curve(results)  # pre-training set o365, AP
  assert stages.tolist() == [0, 1, 2]
  assert values.tolist() == pytest.approx([0.242, 0.230, 0.225])
  # Agrees with the forgetting summary of owl_cl.eval.results: max before final - final.
  f = results["forgetting"]["AP"]["per_set"]["o365"]["forgetting"]
  assert values[:-1].max() - values[-1] == pytest.approx(f)
  _, d2 = analysis.forgetting_curve(results, "D2", metric="AP50")
  assert d2[0] == pytest.approx(0.30) and math.isnan(d2[1]) and d2[2] == pytest.approx(0.90)
  with pytest.raises(KeyError, match="nope.*o365"):
    analysis.forgetting_curve(results, "nope")
  no_pretrain = dict(results, roles=dict(results["roles"], pretrain={"eval_set": None}))
  with pytest.raises(ValueError, match="pre-training"):
    analysis.forgetting_curve(no_pretrain)


def _bars(ax):
  return len(ax.patches)


@pytest.mark.slow
def test_figures(workdir, tmp_path):
  run = analysis.load_run(workdir)
  other = str(tmp_path / "no_replay_seed0")
  rl.write_results(other, make_results(run_id="run-b", algorithm="no_replay", o365_final=0.1))
  figures = {}

  fig = analysis.plot_stage_heatmap(run.results, metric="AP")
  assert isinstance(fig, Figure) and len(fig.axes) == 2  # matrix + colour bar
  image = fig.axes[0].images[0].get_array()
  assert image.shape == (3, 4) and image[1, 3] is np.ma.masked
  assert image[2, 0] == pytest.approx(22.5)
  texts = [t.get_text() for t in fig.axes[0].texts]
  assert texts[:4] == ["24.2", "29.0", "10.0", "14.0"] and texts[7] == "-"
  figures["heatmap"] = fig

  fig = analysis.plot_forgetting_curves([run, analysis.load_run(other)])
  assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 2
  np.testing.assert_allclose(fig.axes[0].lines[1].get_ydata(), [24.2, 23.0, 10.0])
  assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
    "swil (swil_seed0)",
    "no_replay (no_replay_seed0)",
  ]
  with pytest.raises(ValueError):
    analysis.plot_forgetting_curves([run], labels=["a", "b"])
  figures["forgetting"] = fig

  records = run.records["D2"]
  fig = analysis.plot_sampled_classes(records, class_names=list("abcde"))
  assert len(fig.axes) == 1 and _bars(fig.axes[0]) == 5
  assert [p.get_height() for p in fig.axes[0].patches] == [1, 2, 0, 0, 1]
  with pytest.raises(ValueError, match="2 class names for 5"):
    analysis.plot_sampled_classes(records, class_names=["a", "b"])
  figures["classes"] = fig

  fig = analysis.plot_entropy_histograms(records)
  assert len(fig.axes) == 2 and [_bars(ax) for ax in fig.axes] == [50, 50]
  swil = [p.get_height() for p in fig.axes[0].patches]
  assert swil[5] == 1 and swil[15] == 1 and swil[49] == 1 and sum(swil) == 3
  assert sum(p.get_height() for p in fig.axes[1].patches) == 4  # 2 valid slots x 2 calls
  figures["entropy"] = fig

  fig = analysis.plot_knn_sv_histogram(records)
  assert len(fig.axes) == 1 and _bars(fig.axes[0]) == 400
  heights = [p.get_height() for p in fig.axes[0].patches]
  assert sum(heights) == 3 and heights[0] == 1 and heights[200] == 2  # -0.2 in the first bin
  figures["knn_sv"] = fig

  fig = analysis.plot_distance_ranks(records)
  assert len(fig.axes) == 2 and [_bars(ax) for ax in fig.axes] == [4, 4]
  assert [p.get_height() for p in fig.axes[0].patches] == [1, 1, 0, 1]
  assert [p.get_height() for p in fig.axes[1].patches] == [2, 1, 0, 1]
  figures["ranks"] = fig

  for name, fig in figures.items():
    path = tmp_path / f"{name}.png"
    fig.savefig(path, dpi=40)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  assert set(analysis.records_figures(records)) == {
    "sampled_classes",
    "entropy",
    "knn_sv",
    "distance_ranks",
  }
  empty = records_lib.RetrievalRecords(3).as_dict()
  empty["sampled_class_counts"][1] = 2  # e.g. uniform_balanced: classes only
  assert set(analysis.records_figures(empty)) == {"sampled_classes"}

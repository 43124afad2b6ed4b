"""owl_cl.analysis.stats and owl_cl.report: hand-worked statistics, pairing, Holm, refusals."""

import json
import math
import os

import numpy as np
import pytest

from owl_cl.analysis import claims
from owl_cl.analysis import power
from owl_cl.analysis import report as report_lib
from owl_cl.analysis import stats
from owl_cl.eval import results as results_lib

# Student-t quantiles t_{0.975, df} from a printed table (4 significant digits): the
# intervals below are compared to the table's values with a tolerance of 1e-3 relative.
T975 = {3: 3.182, 4: 2.776}


def test_summarize_hand_worked():
  r = stats.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
  # mean 3; sample variance (4 + 1 + 0 + 1 + 4) / 4 = 2.5; sem = sqrt(2.5 / 5) = sqrt(0.5).
  assert r["n"] == 5 and r["mean"] == 3.0
  assert r["std"] == pytest.approx(math.sqrt(2.5), rel=1e-12)
  assert r["sem"] == pytest.approx(math.sqrt(0.5), rel=1e-12)
  assert r["half_width"] == pytest.approx(T975[4] * math.sqrt(0.5), rel=1e-3)
  assert r["low"] == pytest.approx(3.0 - r["half_width"], abs=1e-12)
  assert r["high"] == pytest.approx(3.0 + r["half_width"], abs=1e-12)
  one = stats.summarize([7.0])
  assert one["n"] == 1 and one["mean"] == 7.0 and math.isnan(one["half_width"])
  assert stats.describe(r) == f"3.00 ± {r['half_width']:.2f} (n = 5)"
  assert stats.describe(one) == "7.00 (n = 1)"
  with pytest.raises(ValueError, match="NaN"):
    stats.summarize([1.0, float("nan")])


def test_paired_difference_hand_worked():
  a, b = [3.0, 5.0, 4.0, 6.0], [1.0, 2.0, 2.0, 3.0]
  r = stats.paired_difference(a, b)
  # d = [2, 3, 2, 3]: mean 2.5, variance (4 * 0.25) / 3 = 1/3, sem = sqrt(1/12), t = 2.5 / sem.
  assert r["n"] == 4 and r["mean"] == 2.5
  sem = math.sqrt(1.0 / 12.0)
  assert r["sem"] == pytest.approx(sem, rel=1e-12)
  assert r["t"] == pytest.approx(2.5 / sem, rel=1e-12)
  assert r["half_width"] == pytest.approx(T975[3] * sem, rel=1e-3)
  # p = 2 P(T_3 > 8.660): from the t density integrated by the trapezoid rule (an independent
  # route to the same number), to 1e-6 absolute.
  x = np.linspace(2.5 / sem, 400.0, 2_000_001)
  density = (2 / (math.pi * math.sqrt(3))) / (1 + x**2 / 3) ** 2  # Student t, 3 d.o.f.
  assert r["p"] == pytest.approx(2 * np.trapezoid(density, x), abs=1e-6)
  # The pairing matters: unpaired, the same numbers would not be this sure.
  assert r["p"] < 0.01
  shift = stats.paired_difference([1.0, 2.0], [0.0, 1.0])  # a constant shift: sure
  assert shift["p"] == 0.0 and shift["t"] == math.inf and shift["half_width"] == 0.0
  assert stats.paired_difference([1.0, 2.0], [1.0, 2.0])["p"] == 1.0
  with pytest.raises(ValueError, match="pairs must match"):
    stats.paired_difference([1.0, 2.0], [1.0])


def test_holm_hand_worked():
  # Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> 0.06
  # (monotone); back in input order.
  got = stats.holm([0.01, 0.04, 0.03, 0.005])
  np.testing.assert_allclose(got, [0.03, 0.06, 0.06, 0.02], rtol=1e-12)
  # NaN stays NaN and does not count: m = 2.
  got = stats.holm([float("nan"), 0.2, 0.6])
  assert math.isnan(got[0])
  np.testing.assert_allclose(got[1:], [0.4, 0.6], rtol=1e-12)
  np.testing.assert_allclose(stats.holm([0.5, 0.6]), [1.0, 1.0])  # capped at 1, monotone
  with pytest.raises(ValueError, match="must be in"):
    stats.holm([1.5])


# -------------------------------------------------------------------------- fake sweep

BASE_CONFIG = {"train": {"learning_rate": 1e-4}, "replay": {"dedup": "dataset"}, "seed": 0}


def write_run(
  root, algorithm, seed, order, pre_final, down_final, *, status="complete", tail=None, **cfg
):
  """A workdir written by the project's writer: stage 0 and two datasets in `order`; `tail`:
  the final AP of built-in version 2's tail-classes set `pretrain_tail` (None: no such set)."""

  def m(ap):
    return {"AP": ap, "AP50": min(1.0, 1.5 * ap)}

  first, second = order
  stages = [
    {"name": "pretrained", "metrics": {"o365": m(0.30), "D1": m(0.0), "D2": m(0.0)}},
    {
      "name": first,
      "metrics": {"o365": m(0.25), first: m(0.5), second: m(0.0)},
      "train": {"replay_samples_fraction": 0.5},
    },
    {
      "name": second,
      "metrics": {"o365": m(pre_final), first: m(down_final), second: m(down_final)},
      "train": {"replay_samples_fraction": 0.25},
    },
  ]
  if tail is not None:
    stages[-1]["metrics"]["pretrain_tail"] = m(tail)
  config = json.loads(json.dumps(BASE_CONFIG))
  config["seed"] = seed
  for key, value in cfg.items():  # 'section__field' (or deeper: 'data__builtin__version')
    *path, field = key.split("__")
    node = config
    for part in path:
      node = node.setdefault(part, {})
    node[field] = value
  workdir = os.path.join(root, f"{algorithm}_{''.join(order)}_seed{seed}")
  results_lib.write_results(
    workdir,
    {
      "run_id": f"{algorithm}-{seed}-{first}",
      "algorithm": algorithm,
      "status": status,
      "seed": seed,
      "seeds": {"model": 0, "data": seed, "retrieval": seed},
      "sequence": list(order),
      "roles": {"pretrain": "o365", "downstream": ["D1", "D2"]},
      "stages": stages,
      "config": config,
      "timings": {"wall_seconds": 120.0},
    },
  )
  return workdir


def fake_sweep(root):
  """uniform and swil, seeds 0-2, two orders; swil = uniform + 2 points on the pre-training set
  plus a per-run wobble, so the paired difference is known exactly."""
  uniform_pre = {0: 0.20, 1: 0.22, 2: 0.18}
  wobble = {0: 0.001, 1: -0.002, 2: 0.001}
  for order in (("D1", "D2"), ("D2", "D1")):
    for seed in (0, 1, 2):
      extra = 0.01 if order[0] == "D2" else 0.0
      write_run(root, "uniform", seed, order, uniform_pre[seed] + extra, 0.4)
      write_run(root, "swil", seed, order, uniform_pre[seed] + extra + 0.02 + wobble[seed], 0.4)


def test_report_statistics_and_pairing(tmp_path):
  fake_sweep(str(tmp_path))
  points = report_lib.load_points(report_lib.find_runs([str(tmp_path)]))
  assert len(points) == 12
  rep = report_lib.build_report(points)
  assert rep["reference"] == "uniform" and rep["algorithms"] == ["swil", "uniform"]
  u = rep["summary"]["uniform"]["pretrain_AP"]
  # Points: (20 + 22 + 18 + 21 + 23 + 19) / 6 = 20.5.
  assert u["n"] == 6 and u["mean"] == pytest.approx(20.5, abs=1e-9)
  d = rep["versus_reference"]["swil"]["pretrain_AP"]
  # Differences (points): 2 + 100 * wobble = [2.1, 1.8, 2.1] for each order: mean 2.0.
  assert d["n"] == 6 and d["mean"] == pytest.approx(2.0, abs=1e-9)
  diffs = np.array([2.1, 1.8, 2.1, 2.1, 1.8, 2.1])
  half = 2.571 * diffs.std(ddof=1) / math.sqrt(6)  # t_{0.975, 5} = 2.571 (table)
  assert d["half_width"] == pytest.approx(half, rel=1e-3)
  # One comparison: Holm leaves its p as is; the noise floor is its half-width.
  assert d["p_holm"] == d["p"] < 1e-4
  assert rep["noise_floor"]["pretrain_AP"]["median"] == d["half_width"]
  # No downstream difference at all: p 1, zero interval.
  assert rep["versus_reference"]["swil"]["downstream_mean_AP"]["p"] == 1.0
  # Other columns: forgetting of the first-trained set 50 -> 40 = 10 points on average of D1,
  # D2 (each trained first in one order: 10, last: 0); replayed = mean(50, 25) %; 2 minutes.
  s = rep["summary"]["uniform"]
  assert s["replayed"]["mean"] == pytest.approx(37.5)
  assert s["wall_minutes"]["mean"] == pytest.approx(2.0)
  assert s["kept_AP50"]["n"] == 6
  # Mid-sequence on request: after the first dataset, o365 AP is 25 for every run.
  mid = report_lib.build_report(
    report_lib.load_points(report_lib.find_runs([str(tmp_path)]), stage=1), stage=1
  )
  assert mid["summary"]["swil"]["pretrain_AP"]["mean"] == pytest.approx(25.0)
  assert math.isnan(mid["summary"]["swil"]["wall_minutes"]["mean"])
  # Curves: stage 0 is 30 points for everyone (zero-width band).
  assert rep["curves"]["swil"]["mean"][0] == pytest.approx(30.0)
  md = report_lib.render_markdown(rep)
  assert md.splitlines()[2].startswith("**Noise floor**")
  assert "- pre-training set AP: retrieval pairs: swil - uniform (2.00 ± " in md


def test_summary_table_hand_worked(tmp_path):
  fake_sweep(str(tmp_path))
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  cols = ("pretrain_AP", "downstream_mean_AP", "bwt_AP")
  table = report_lib.render_summary_table(rep, order=["uniform"], columns=cols).splitlines()
  assert table[0] == (
    "| algorithm | n | pre-training set AP | downstream mean AP | backward transfer (AP) |"
  )
  # Stage 0: o365 AP 30 and D1, D2 at 0 in all 12 runs, which share one pre-trained model
  # (seeds.model 0): one evaluation, n = 1, no interval; BWT exists only at the end.
  assert table[2] == "| No fine-tuning | 1 | 30.0 | 0.0 | - |"
  # uniform: pre-training AP 20.5 ± 2.571 * s / sqrt(6), s of (20, 22, 18, 21, 23, 19) points;
  # downstream 40 everywhere; BWT (Lopez-Paz & Ranzato 2017) averages R_T,i - R_i,i over the
  # T - 1 = 1 earlier task: the first-trained set, 50 -> 40: -10.
  half = 2.571 * np.std([20, 22, 18, 21, 23, 19], ddof=1) / math.sqrt(6)
  assert table[3] == f"| uniform | 6 | 20.5 ± {half:.1f} | 40.0 ± 0.0 | -10.0 ± 0.0 |"
  assert table[4].startswith("| swil | 6 | 22.5 ± ")  # the unnamed algorithm follows
  md = report_lib.render_markdown(rep, order=["uniform"])
  assert "## Summary" in md
  # AP per eval set at the end: o365 as above, D1 and D2 40 in every run.
  per_set = rep["per_set"]["uniform"]
  assert per_set["o365"]["mean"] == pytest.approx(20.5) and per_set["o365"]["n"] == 6
  assert per_set["D1"]["mean"] == pytest.approx(40.0) and per_set["D2"]["half_width"] == 0.0
  assert "| uniform | 20.5 ± " in md.split("## AP per eval set")[1]
  with pytest.raises(report_lib.ReportError, match=r"without runs \['lwf'\]"):
    report_lib.render_summary_table(rep, order=["lwf"])


def test_pairs_follow_seeds_and_order_not_file_order(tmp_path):
  """A missing swil run leaves its uniform partner unpaired (not paired with another)."""
  write_run(str(tmp_path), "uniform", 0, ("D1", "D2"), 0.20, 0.4)
  write_run(str(tmp_path), "uniform", 1, ("D1", "D2"), 0.30, 0.4)
  write_run(str(tmp_path), "swil", 1, ("D1", "D2"), 0.31, 0.4)
  write_run(str(tmp_path), "swil", 1, ("D2", "D1"), 0.50, 0.4)
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  d = rep["versus_reference"]["swil"]["pretrain_AP"]
  assert d["n"] == 1 and d["mean"] == pytest.approx(1.0) and d["unpaired_runs"] == 2


def test_refusals_name_the_run(tmp_path):
  root = str(tmp_path / "a")
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4)
  bad = write_run(root, "uniform", 1, ("D1", "D2"), 0.2, 0.4, status="running")
  with pytest.raises(report_lib.ReportError, match=f"{bad}: run 'uniform-1-D1' is incomplete"):
    report_lib.load_points(report_lib.find_runs([root]))
  root = str(tmp_path / "b")
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4)
  bad = write_run(root, "swil", 0, ("D1", "D2"), 0.2, 0.4, train__learning_rate=2e-4)
  # Runs are read in sorted order: swil first, so the uniform run is the one named as odd.
  with pytest.raises(report_lib.ReportError, match=r"uniform_D1D2_seed0: its config differs") as e:
    report_lib.load_points(report_lib.find_runs([root]))
  assert "train.learning_rate=0.0002 vs 0.0001" in str(e.value) and f"from {bad}'s" in str(e.value)
  # Passing the field as ignorable accepts them.
  report_lib.load_points(report_lib.find_runs([root]), ignore_fields=["train.learning_rate"])
  root = str(tmp_path / "c")
  write_run(root, "swil", 0, ("D1", "D2"), 0.2, 0.4)
  write_run(root, "swil", 1, ("D1", "D2"), 0.2, 0.4, replay__dedup="epoch")
  with pytest.raises(report_lib.ReportError, match="'swil' with other replay settings"):
    report_lib.load_points(report_lib.find_runs([root]))
  # Replay settings may differ between algorithms (that is what an algorithm is).
  root = str(tmp_path / "d")
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4)
  write_run(root, "swil", 0, ("D1", "D2"), 0.2, 0.4, replay__dedup="epoch")
  assert len(report_lib.load_points(report_lib.find_runs([root]))) == 2
  (tmp_path / "empty").mkdir()
  with pytest.raises(report_lib.ReportError, match="no results.json below"):
    report_lib.find_runs([str(tmp_path / "empty")])
  with pytest.raises(report_lib.ReportError, match="missing: no such folder"):
    report_lib.find_runs([str(tmp_path / "missing")])


def test_cli_writes_the_report(tmp_path, capsys):
  fake_sweep(str(tmp_path / "sweep"))
  out = tmp_path / "out"
  assert report_lib.main([str(tmp_path / "sweep"), "--out", str(out)]) == 0
  assert sorted(os.listdir(out)) == sorted(
    ["report.md", "report.json", "forgetting_curves.png", "forest_plot.png"]
  )
  with open(out / "report.json") as f:
    data = json.load(f)  # strict JSON: NaN written as null
  assert data["versus_reference"]["swil"]["pretrain_AP"]["mean"] == pytest.approx(2.0)
  assert (out / "report.md").read_text().startswith("# Sweep report")
  # A plan whose comparisons the runs lack: one line, exit 2, nothing written.
  planned = tmp_path / "planned"
  assert report_lib.main([str(tmp_path / "sweep"), "--plan", "round2", "--out", str(planned)]) == 2
  assert "plan 'round2': no runs of 'sw_grasp'" in capsys.readouterr().err
  assert not planned.exists()
  write_run(str(tmp_path / "sweep"), "swil", 9, ("D1", "D2"), 0.2, 0.4, status="running")
  assert report_lib.main([str(tmp_path / "sweep"), "--out", str(out)]) == 2
  assert "is incomplete" in capsys.readouterr().err


def test_refuses_mixed_builtin_versions(tmp_path):
  # A run without data.builtin.version predates version 2: it ran version 1, comparable with
  # a run that records version 1.
  root = str(tmp_path / "same")
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4, data__builtin__seed=0)
  write_run(
    root, "swil", 0, ("D1", "D2"), 0.2, 0.4, data__builtin__seed=0, data__builtin__version=1
  )
  assert len(report_lib.load_points(report_lib.find_runs([root]))) == 2
  root = str(tmp_path / "mixed")
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4, data__builtin__seed=0)
  v2 = write_run(
    root, "swil", 0, ("D1", "D2"), 0.2, 0.4, data__builtin__seed=0, data__builtin__version=2
  )
  # Sorted order: swil (version 2) first, the uniform run (version 1) is named as the odd one.
  with pytest.raises(report_lib.ReportError, match="built-in benchmark version 1") as e:
    report_lib.load_points(report_lib.find_runs([root]))
  assert f"{v2}: version 2" in str(e.value) and "uniform_D1D2_seed0" in str(e.value)
  # --ignore-field does not make versions comparable: the check reads the recorded version.
  with pytest.raises(report_lib.ReportError, match="not comparable"):
    report_lib.load_points(report_lib.find_runs([root]), ignore_fields=["data.builtin"])


def test_tail_classes_ap_reported_for_version_2(tmp_path):
  root = str(tmp_path / "v2")
  for seed, (u, s) in enumerate(((0.10, 0.13), (0.12, 0.14), (0.08, 0.12))):
    write_run(root, "uniform", seed, ("D1", "D2"), 0.2, 0.4, tail=u, data__builtin__version=2)
    write_run(root, "swil", seed, ("D1", "D2"), 0.2, 0.4, tail=s, data__builtin__version=2)
  report = report_lib.build_report(report_lib.load_points(report_lib.find_runs([root])))
  # Hand-worked: uniform's tail AP 10 / 12 / 8 points, mean 10; differences swil - uniform
  # 3, 2, 4 points: mean 3.
  assert report["summary"]["uniform"]["tail_AP"]["mean"] == pytest.approx(10.0)
  assert report["versus_reference"]["swil"]["tail_AP"]["mean"] == pytest.approx(3.0)
  # A version-1 run has no tail set: NaN, n = 0.
  root = str(tmp_path / "v1")
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4)
  points = report_lib.load_points(report_lib.find_runs([root]))
  assert math.isnan(points[0].values["tail_AP"])


def test_baselines_may_differ_in_their_own_fields_only(tmp_path):
  """LoRA's adapters (`train.lora`) are the `lora` baseline's own settings, like LwF's, WiSE-FT's
  and the frozen parts'; one algorithm's runs must still agree on them."""
  root = str(tmp_path)
  write_run(root, "uniform", 0, ("D1", "D2"), 0.2, 0.4)
  write_run(root, "lora", 0, ("D1", "D2"), 0.1, 0.3, train__lora__rank=8)
  write_run(root, "lwf", 0, ("D1", "D2"), 0.1, 0.3, train__lwf__weight=1.0)
  write_run(root, "wise_ft", 0, ("D1", "D2"), 0.1, 0.3, train__wise_ft__alpha=0.5)
  assert len(report_lib.load_points(report_lib.find_runs([root]))) == 4
  bad = write_run(root, "lora", 1, ("D1", "D2"), 0.1, 0.3, train__lora__rank=4)
  with pytest.raises(report_lib.ReportError, match=f"{bad}: algorithm 'lora' with other"):
    report_lib.load_points(report_lib.find_runs([root]))
  root = str(tmp_path / "wise_ft")
  write_run(root, "wise_ft", 0, ("D1", "D2"), 0.1, 0.3, train__wise_ft__alpha=0.5)
  bad = write_run(root, "wise_ft", 1, ("D1", "D2"), 0.1, 0.3, train__wise_ft__alpha=0.3)
  with pytest.raises(report_lib.ReportError, match=f"{bad}: algorithm 'wise_ft' with other"):
    report_lib.load_points(report_lib.find_runs([root]))


def _write_baseline(root, algorithm, seed, schedule, stages):
  """A joint or per_task run (config differs from BASE_CONFIG by train.schedule)."""
  config = json.loads(json.dumps(BASE_CONFIG))
  config["seed"], config["train"]["schedule"] = seed, schedule
  results_lib.write_results(
    os.path.join(root, f"{algorithm}_seed{seed}"),
    {
      "run_id": f"{algorithm}-{seed}",
      "algorithm": algorithm,
      "schedule": schedule,
      "status": "complete",
      "seed": seed,
      "seeds": {"model": 0, "data": seed, "retrieval": seed},
      "sequence": ["D1", "D2"],
      "roles": {"pretrain": "o365", "downstream": ["D1", "D2"]},
      "stages": stages,
      "config": config,
      "timings": {"wall_seconds": 60.0},
    },
  )


def test_joint_and_per_task_are_their_own_rows_beside_the_sequences_min_own(tmp_path):
  root = str(tmp_path)

  def m(ap):
    return {"AP": ap, "AP50": min(1.0, 1.5 * ap)}

  zero = {"name": "pretrained", "metrics": {"o365": m(0.30), "D1": m(0.0), "D2": m(0.0)}}
  for seed in (0, 1):
    write_run(root, "uniform", seed, ("D1", "D2"), 0.20, 0.4)
    joint = {"o365": m(0.26), "D1": m(0.50 + 0.01 * seed), "D2": m(0.60)}
    _write_baseline(root, "joint", seed, "joint", [zero, {"name": "joint", "metrics": joint}])
    tasks = [
      {"name": "D1", "metrics": {"o365": m(0.10), "D1": m(0.6)}},
      {"name": "D2", "metrics": {"o365": m(0.14), "D2": m(0.4 + 0.02 * seed)}},
    ]
    _write_baseline(root, "per_task", seed, "per_task", [zero, *tasks])
  points = report_lib.load_points(report_lib.find_runs([root]))
  rep = report_lib.build_report(points)
  assert rep["algorithms"] == ["joint", "per_task", "uniform"] and rep["reference"] == "uniform"
  s = rep["summary"]
  # joint: the one stage's values; own-task AP = that stage's AP on each set.
  assert s["joint"]["downstream_mean_AP"]["mean"] == pytest.approx((50.5 + 60.0) / 2)
  assert s["joint"]["own_mean_AP"]["mean"] == pytest.approx((50.5 + 60.0) / 2)
  assert math.isnan(s["joint"]["forgetting_AP"]["mean"])  # one stage: no forgetting
  # per_task: each set by its own model, the pre-training set the models' mean (12 points);
  # min own AP50 = 1.5 x min(60, 41) = 61.5 (mean over seeds 0 and 1: 60 and 63).
  assert s["per_task"]["pretrain_AP"]["mean"] == pytest.approx(12.0)
  assert s["per_task"]["downstream_mean_AP"]["mean"] == pytest.approx((60.0 + 41.0) / 2)
  assert s["per_task"]["own_min_AP50"]["mean"] == pytest.approx(61.5)
  # The sequence's own-task AP: D1 after stage 1 (50), D2 after stage 2 (40); min AP50 60.
  assert s["uniform"]["own_mean_AP"]["mean"] == pytest.approx(45.0)
  assert s["uniform"]["own_min_AP50"]["mean"] == pytest.approx(60.0)
  md = report_lib.render_markdown(rep)
  rows = [line.split(" | ")[0] for line in md.split("## Per algorithm")[1].splitlines()[4:7]]
  assert rows == ["| joint", "| per_task", "| uniform"]
  assert "own-task AP50 (min own)" in md


def test_pairs_that_differ_cover_every_metric(tmp_path):
  # swil and uniform equal on the pre-training set, swil 3 points (+- a wobble) ahead on the
  # tail set only: a metric outside the report's two headline metrics.
  wobble = {0: 0.001, 1: -0.002, 2: 0.001}
  for order in (("D1", "D2"), ("D2", "D1")):
    for seed in (0, 1, 2):
      write_run(str(tmp_path), "uniform", seed, order, 0.2, 0.4, tail=0.10)
      write_run(str(tmp_path), "swil", seed, order, 0.2, 0.4, tail=0.13 + wobble[seed])
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  md = report_lib.render_markdown(rep)
  assert "- pre-training tail classes AP: retrieval pairs: swil - uniform (3.00 ± " in md
  assert "- pre-training set AP: retrieval pairs: none; pairs with a baseline: 0 of 0" in md


def test_power_beside_the_noise_floor_leaves_the_baselines_out(tmp_path):
  fake_sweep(str(tmp_path))
  for order in (("D1", "D2"), ("D2", "D1")):  # a baseline, far below: not a retrieval claim
    for seed in (0, 1, 2):
      write_run(str(tmp_path), "no_replay", seed, order, 0.01 + 0.01 * seed, 0.4)
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  got = rep["power"]["pretrain_AP"]
  d = rep["versus_reference"]["swil"]["pretrain_AP"]
  # The correction used: Holm over the 2 comparisons with uniform, level 0.05 / 2 at its
  # first step; only swil's comparison is a retrieval one.
  assert (got["m"], got["comparisons"], got["n"]) == (2, 1, 6)
  assert got["median"] == pytest.approx(power.detectable_difference(d["std"], 6, 2), rel=1e-12)
  md = report_lib.render_markdown(rep).splitlines()
  assert md[4].startswith("**Detectable at 80% power**") and "m = 2, n = 6" in md[4]


def test_plan_labels_confirmatory_and_exploratory_claims(tmp_path):
  fake_sweep(str(tmp_path))
  points = report_lib.load_points(report_lib.find_runs([str(tmp_path)]))
  plan = claims.Plan(
    "test",
    "uniform",
    (
      claims.Comparison("1", "swil", "pretrain_AP"),
      claims.Comparison("2", "swil", "downstream_mean_AP"),
    ),
  )
  rep = report_lib.build_report(points, plan=plan)
  rows = rep["confirmatory"]
  p = rep["versus_reference"]["swil"]["pretrain_AP"]["p"]
  # Holm across the plan's two comparisons (across metrics): the smaller p doubled; the
  # downstream difference is exactly 0 (p 1).
  assert rows[0]["p_holm_plan"] == pytest.approx(min(1.0, 2 * p), rel=1e-12)
  assert rows[1]["p_holm_plan"] == 1.0
  assert rows[0]["detectable"] == pytest.approx(
    power.detectable_difference(rows[0]["std"], 6, 2), rel=1e-12
  )
  md = report_lib.render_markdown(rep)
  assert "its 2 comparisons are **confirmatory**" in md and "**exploratory**" in md
  assert "| 1 | swil - uniform | pre-training set AP | 2.00 ± " in md
  with pytest.raises(report_lib.ReportError, match="--reference uniform"):
    report_lib.build_report(points, "swil", plan=plan)


def test_variance_components_in_the_report(tmp_path):
  fake_sweep(str(tmp_path))
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  got = rep["variance"]["pretrain_AP"]
  # One model seed, two orders: the model component is not estimable; order D2-first adds 1
  # point to every run, so the order component is positive.
  assert (got["n"], got["models"], got["orders"]) == (12, 1, 2)
  assert math.isnan(got["variance"]["model"]) and got["variance"]["order"] > 0
  md = report_lib.render_markdown(rep)
  assert "| pre-training set AP | 12 | n/a | " in md
  # No plan: every claim is labelled exploratory.
  assert "every comparison in this report is exploratory" in md


def test_variance_table_notes_a_fit_to_read_with_care():
  variance = {
    "pretrain_AP": dict(n=90, models=1, orders=2, converged=False, method="REML"),
    "tail_AP": dict(n=90, models=1, orders=2, converged=True, method="REML"),
    "downstream_mean_AP": dict(n=9, models=3, orders=3, converged=True, method="REML; x"),
  }
  for r in variance.values():
    r.update(variance=dict(model=math.nan, order=1.0, residual=3.0))
    r.update(fraction=dict(model=math.nan, order=0.25, residual=0.75))
  metrics = {"pretrain_AP": "pre-training set AP", "tail_AP": "tail AP", "downstream_mean_AP": "d"}
  lines = claims._variance_lines({"variance": variance, "metrics": metrics})
  assert "| tail AP | 90 | n/a | 1.00 (25%) | 3.00 (75%) |" in lines
  notes = [line for line in lines if line.startswith("- ")]
  assert notes == [
    "- pre-training set AP: the REML fit did not converge (its last iterate is shown)",
    "- d: REML; x",
  ]


def test_design_page_states_the_plan_the_report_applies():
  # docs/design_round2.md's confirmatory table is claims.ROUND2, row for row.
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(root, "docs", "design_round2.md"), encoding="utf-8") as f:
    text = f.read()
  block = text.split("<!-- round2 plan: owl_cl/analysis/claims.py ROUND2 -->\n")[1]
  rows = [r.split("|")[1:-1] for r in block.split("<!-- /round2 plan -->")[0].splitlines()[2:]]
  want = [
    [c.factor, c.algorithm, c.metric, f"{c.algorithm} - {claims.ROUND2.reference} > 0"]
    for c in claims.ROUND2.confirmatory
  ]
  assert [[cell.strip() for cell in r] for r in rows] == want
  assert f"m = {len(claims.ROUND2.confirmatory)}" in text
  assert all(c.metric in dict(report_lib.METRICS) for c in claims.ROUND2.confirmatory)

"""owl_cl.analysis.wise_ft_curve in the report: WiSE-FT's retention / plasticity over alpha,
hand-worked on synthetic runs written by the project's writer."""

import math
import os

import pytest

from owl_cl.analysis import claims
from owl_cl.analysis import report as report_lib
from owl_cl.analysis import stats
from owl_cl.analysis import wise_ft_curve
from owl_cl.eval import results as results_lib

# t_{0.975, 2} from a printed table (4 significant digits; compared to 1e-3 relative).
T975_2 = 4.303


def write_run(root, name, seed, pre, down, alpha=None, replay="none"):
  """A complete run: stage 0 (o365 AP 30, D1 and D2 0) then D1 and D2; the final o365 AP is
  `pre` and both downstream sets' AP `down` (fractions); `alpha`: train.wise_ft.alpha (None:
  no wise_ft section, as a run that predates it)."""
  m = lambda ap: {"AP": ap, "AP50": ap}  # noqa: E731
  train = {"learning_rate": 1e-4}
  if alpha is not None:
    train["wise_ft"] = {"alpha": alpha, "when": "each"}
  stages = [
    {"name": "pretrained", "metrics": {"o365": m(0.30), "D1": m(0.0), "D2": m(0.0)}},
    {"name": "D1", "metrics": {"o365": m(0.25), "D1": m(0.5), "D2": m(0.0)}},
    {"name": "D2", "metrics": {"o365": m(pre), "D1": m(down), "D2": m(down)}},
  ]
  workdir = os.path.join(root, f"{name}_seed{seed}")
  results_lib.write_results(
    workdir,
    {
      "run_id": f"{name}-{seed}",
      "algorithm": name,
      "status": "complete",
      "seed": seed,
      "seeds": {"model": seed, "data": seed, "retrieval": seed},
      "sequence": ["D1", "D2"],
      "roles": {"pretrain": "o365", "downstream": ["D1", "D2"]},
      "stages": stages,
      "config": {"train": train, "replay": {"algorithm": replay}, "seed": seed},
    },
  )


# Per seed 0, 1, 2 (the pairs): final pre-training AP and downstream AP, in points.
RUNS = {
  ("no_replay", None, "none"): ([10, 12, 14], [50, 52, 54]),
  ("wise_ft(0.5)", 0.5, "none"): ([15, 18, 21], [45, 46, 47]),
  ("wise_ft(0.25)", 0.25, "none"): ([20, 20, 20], [40, 40, 40]),
  ("swil", 1.0, "swil"): ([30, 30, 30], [50, 50, 50]),
  ("swil+wise_ft(0.5)", 0.5, "swil"): ([31, 32, 33], [48, 48, 48]),
}


@pytest.fixture
def points(tmp_path):
  for (name, alpha, replay), (pre, down) in RUNS.items():
    for seed in range(3):
      write_run(str(tmp_path), name, seed, pre[seed] / 100, down[seed] / 100, alpha, replay)
  return report_lib.load_points(report_lib.find_runs([str(tmp_path)]))


def test_curves_group_rows_by_settings_and_pair_with_alpha_1(points):
  curves = wise_ft_curve.section(points)
  # Two curves, in the order of their first blended row (the runs sorted by workdir: swil's
  # first): swil's, and the rows without replay (no_replay its alpha-1 end: a run without
  # the section has alpha 1); rows by alpha.
  assert [(c["label"], c["end"], c["when"]) for c in curves] == [
    ("swil", "swil", "each"),
    ("no_replay", "no_replay", "each"),
  ]
  curves = curves[::-1]
  rows = {r["algorithm"]: r for c in curves for r in c["rows"]}
  assert [r["algorithm"] for r in curves[0]["rows"]] == [
    "wise_ft(0.25)",
    "wise_ft(0.5)",
    "no_replay",
  ]
  assert [r["alpha"] for r in curves[0]["rows"]] == [0.25, 0.5, 1.0]
  # wise_ft(0.5): retention (15 + 18 + 21) / 3 = 18, s = 3: half-width 4.303 * 3 / sqrt(3);
  # minus no_replay, pair by pair: 5, 6, 7: mean 6, s = 1.
  r = rows["wise_ft(0.5)"]
  assert r["retention"]["n"] == 3 and r["retention"]["mean"] == pytest.approx(18.0)
  assert r["retention"]["half_width"] == pytest.approx(T975_2 * 3 / math.sqrt(3), rel=1e-3)
  d = r["retention_difference"]
  assert d["n"] == 3 and d["mean"] == pytest.approx(6.0)
  assert d["half_width"] == pytest.approx(T975_2 * 1 / math.sqrt(3), rel=1e-3)
  # Plasticity: 45 - 50, 46 - 52, 47 - 54 = -5, -6, -7: the cost of the blend.
  assert r["plasticity_difference"]["mean"] == pytest.approx(-6.0)
  # wise_ft(0.25): 20 - (10, 12, 14) = 10, 8, 6 (mean 8, s 2); 40 - (50, 52, 54): mean -12.
  r = rows["wise_ft(0.25)"]
  assert r["retention"]["half_width"] == pytest.approx(0.0, abs=1e-9)  # 20 in every run
  assert r["retention_difference"]["mean"] == pytest.approx(8.0)
  assert r["retention_difference"]["half_width"] == pytest.approx(
    T975_2 * 2 / math.sqrt(3), rel=1e-3
  )
  assert r["plasticity_difference"]["mean"] == pytest.approx(-12.0)
  # The end itself has no difference; swil+wise_ft(0.5) - swil = 1, 2, 3 and -2, -2, -2.
  assert "retention_difference" not in rows["no_replay"]
  r = rows["swil+wise_ft(0.5)"]
  assert r["retention_difference"]["mean"] == pytest.approx(2.0)
  assert r["plasticity_difference"]["mean"] == pytest.approx(-2.0)


def test_curve_section_table(points):
  lines = wise_ft_curve.render_lines(
    {"confidence": stats.CONFIDENCE, "wise_ft_curve": wise_ft_curve.section(points)}
  )
  assert lines[0] == "## WiSE-FT: retention and plasticity over alpha (exploratory)"
  # The hand-worked row above: 6 ± 4.303 / sqrt(3) = 2.48 -> '6.0 ± 2.5'; 18 ± 7.45 -> 7.5.
  assert (
    "| no_replay | wise_ft(0.5) | 0.5 | 3 | 18.0 ± 7.5 | 46.0 ± 2.5 | 6.0 ± 2.5 | -6.0 ± 2.5 |"
    in lines
  )
  assert "| swil | swil | 1 | 3 | 30.0 ± 0.0 | 50.0 ± 0.0 | - | - |" in lines
  assert wise_ft_curve.render_lines({"confidence": 0.95}) == []


# build_report's statistics of 15 runs and three figures: about 3 s on 2 loaded cores.
@pytest.mark.slow
def test_report_has_the_section_and_figure_only_with_blended_rows(points, tmp_path):
  report = report_lib.build_report(points, "no_replay")
  assert report["wise_ft_curve"] == wise_ft_curve.section(points)
  md = report_lib.render_markdown(report)
  assert "\n".join(wise_ft_curve.render_lines(report)) in md
  paths = report_lib.write_report(report, str(tmp_path / "out"))
  assert os.path.basename(paths["wise_ft_curve"]) == report_lib.FIGURE_WISE_FT
  assert os.path.getsize(paths["wise_ft_curve"]) > 0
  # Without a blended row (the rows at alpha 1 only): no section, no figure, and report.md
  # and report.json as before the section existed.
  plain = [p for p in points if p.algorithm in ("no_replay", "swil")]
  report = report_lib.build_report(plain, "no_replay")
  assert "wise_ft_curve" not in report
  assert "WiSE-FT" not in report_lib.render_markdown(report)
  assert "wise_ft" not in report_lib.write_report(report, str(tmp_path / "plain"))


def test_rows_of_a_baseline_are_not_retrieval_algorithms():
  # WiSE-FT alone at any alpha is the baseline wise_ft's row (power, variance components and
  # 'Pairs that differ' leave it out with the baselines); a composed row is its config's.
  names = ["uniform", "wise_ft(0.25)", "wise_ft", "swil+wise_ft(0.5)", "no_replay", "joint"]
  assert claims.retrieval_algorithms(names) == ["uniform", "swil+wise_ft(0.5)"]

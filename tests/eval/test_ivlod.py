"""The IVLOD metric block (owl_cl.eval.ivlod) on hand-worked per-dataset APs: results.json,
results.md and the sweep report."""

import json
import math
import os

import pytest

from owl_cl.analysis import ivlod_orders
from owl_cl.analysis import report as report_lib
from owl_cl.eval import ivlod
from owl_cl.eval import results as results_lib

# ODinW-13-shaped: 13 datasets whose final APs are k / 100, k = 1..13: Avg = 7 / 100 exactly
# in decimal (mean of 1..13 is 7); float32/64 rounding of the sum of 13 two-digit fractions
# stays below 1e-15.
DATASETS = [f"D{k:02d}" for k in range(1, 14)]


def _stages(final_aps, *, zcoco=(0.48, 0.41), apr=(0.30, 0.25)):
  def m(ap, **extra):
    return {"AP": ap, "AP50": min(1.0, 1.5 * ap), **extra}

  pretrained = {d: m(0.05) for d in DATASETS}
  pretrained.update(coco_val2017=m(zcoco[0]), lvis=m(0.35, APr=apr[0]))
  last = {d: m(a) for d, a in zip(DATASETS, final_aps, strict=True) if a is not None}
  last.update(coco_val2017=m(zcoco[1]), lvis=m(0.33, APr=apr[1]))
  middle = {"name": DATASETS[0], "metrics": {DATASETS[0]: m(0.5)}}
  return [{"name": "pretrained", "metrics": pretrained}, middle, {"name": "D13", "metrics": last}]


def _results(stages, **extra):
  return {
    "run_id": "r1",
    "algorithm": "no_replay",
    "sequence": DATASETS,
    "stages": stages,
    "roles": {"pretrain": "o365", "open_vocab": "lvis", "downstream": DATASETS},
    "ivlod": {"zero_shot_set": "coco_val2017", "lvis_set": "lvis", "datasets": DATASETS},
    **extra,
  }


def test_row_hand_worked():
  stages = _stages([k / 100 for k in range(1, 14)])
  row = ivlod.ivlod_row(stages[-1], DATASETS, "coco_val2017", "lvis")
  assert row["Avg"] == pytest.approx(0.07, abs=1e-15)
  assert row["ZCOCO"] == 0.41 and row["LVIS_APr"] == 0.25 and row["stage"] == "D13"
  assert row["per_dataset"]["D05"] == 0.05 and list(row["per_dataset"]) == DATASETS
  first = ivlod.ivlod_row(stages[0], DATASETS, "coco_val2017", "lvis")
  assert first["Avg"] == pytest.approx(0.05, abs=1e-15) and first["ZCOCO"] == 0.48
  # Three datasets by hand: (0.2 + 0.5 + 0.8) / 3 = 0.5.
  stage = {"name": "s", "metrics": {"a": {"AP": 0.2}, "b": {"AP": 0.5}, "c": {"AP": 0.8}}}
  assert ivlod.ivlod_row(stage, ["a", "b", "c"], None, None)["Avg"] == pytest.approx(0.5)
  # A missing dataset: no partial average; no zero-shot / LVIS set: NaN.
  partial = ivlod.ivlod_row(stage, ["a", "b", "missing"], None, None)
  assert math.isnan(partial["Avg"]) and math.isnan(partial["ZCOCO"])
  assert math.isnan(partial["LVIS_APr"]) and math.isnan(partial["per_dataset"]["missing"])
  with pytest.raises(ValueError, match="at least stage 0"):
    ivlod.ivlod_block([], DATASETS, None, None)


def test_results_json_and_md_carry_the_block(tmp_path):
  aps = [k / 100 for k in range(1, 14)]
  aps[12] = None  # D13 not evaluated: Avg is null, its cell '-'
  written = results_lib.write_results(str(tmp_path), _results(_stages(aps), task_order="canonical"))
  block = written["ivlod"]
  assert block["zero_shot_set"] == "coco_val2017" and block["datasets"] == DATASETS
  assert block["rows"]["final"]["Avg"] is None  # NaN stored as null
  assert block["rows"]["final"]["per_dataset"]["D13"] is None
  assert block["rows"]["no_finetuning"]["Avg"] == pytest.approx(0.05, abs=1e-15)
  with open(tmp_path / "results.json") as f:
    on_disk = json.load(f)
  assert on_disk["ivlod"] == block
  # Reloading recomputes the same block from the stages.
  assert results_lib.load_results(str(tmp_path))["ivlod"] == block
  with open(tmp_path / "results.md") as f:
    md = f.read()
  section = md.split("## IVLOD (ZiRa, DitHub): AP (%) after stage `D13`")[1].split("\n## ")[0]
  # One run is one order: the section says so and where the IVLOD result comes from.
  assert "One task order (`canonical`): an IVLOD result is the mean and spread" in section
  lines = [line for line in section.splitlines() if line.startswith("| ")]
  assert lines[0].startswith("| Algorithm | ZCOCO | Avg (13) | LVIS APr | `D01` |")
  # No fine-tuning: ZCOCO 48.0, Avg 5.0, APr 30.0, every dataset 5.0.
  assert lines[1] == "| No fine-tuning | 48.0 | 5.0 | 30.0 | " + " | ".join(["5.0"] * 13) + " |"
  cells = [f"{k:.1f}" for k in range(1, 13)] + ["-"]
  assert lines[2] == "| no_replay | 41.0 | - | 25.0 | " + " | ".join(cells) + " |"
  # A run without the block has no such section and no key.
  plain = _results(_stages([k / 100 for k in range(1, 14)]))
  del plain["ivlod"]
  assert "ivlod" not in results_lib.finalize_results(plain)


def test_report_adds_the_ivlod_metrics_when_runs_have_them(tmp_path):
  for seed, shift in ((0, 0.0), (1, 0.02)):
    aps = [k / 100 + shift for k in range(1, 14)]
    r = _results(
      _stages(aps, zcoco=(0.48, 0.41 + shift)),
      run_id=f"r{seed}",
      seed=seed,
      seeds={"model": 0, "data": seed, "retrieval": seed},
      config={"seed": seed},
      status="complete",
    )
    results_lib.write_results(os.path.join(tmp_path, f"run{seed}"), r)
  points = report_lib.load_points(report_lib.find_runs([str(tmp_path)]))
  rep = report_lib.build_report(points)
  s = rep["summary"]["no_replay"]
  # Points: Avg 7 and 9, ZCOCO 41 and 43, APr 25 and 25.
  assert s["ivlod_Avg"]["mean"] == pytest.approx(8.0) and s["ivlod_Avg"]["n"] == 2
  assert s["ivlod_ZCOCO"]["mean"] == pytest.approx(42.0)
  assert s["ivlod_LVIS_APr"]["mean"] == pytest.approx(25.0)
  assert rep["metrics"]["ivlod_ZCOCO"] == "ZCOCO (COCO val AP)"
  md = report_lib.render_markdown(rep)
  assert "ZCOCO (COCO val AP)" in md
  # Both runs share one order: no spread over orders, and the report says it is no result.
  (row,) = [line for line in md.splitlines() if line.startswith("| no_replay | 1 (2) |")]
  assert row.split(" | ")[2] == "8.00 (1 order: not an IVLOD result)"
  # Runs without the block: the report's metrics are the usual ones.
  for seed in (0, 1):
    path = os.path.join(tmp_path, f"run{seed}", "results.json")
    with open(path) as f:
      r = json.load(f)
    del r["ivlod"]
    os.remove(path)
    os.remove(os.path.join(tmp_path, f"run{seed}", "results.md"))
    results_lib.write_results(os.path.join(tmp_path, f"run{seed}"), r)
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  assert list(rep["metrics"]) == [k for k, _ in report_lib.METRICS]
  assert "ivlod_orders" not in rep and "IVLOD over task orders" not in report_lib.render_markdown(
    rep
  )


def test_over_orders_hand_worked():
  # Order A: runs 7 and 9 (two seeds) -> 8; B: 10; C: 12 (and a run without the metric).
  values = [("A", 7.0), ("A", 9.0), ("B", 10.0), ("C", 12.0), ("C", math.nan)]
  s = ivlod_orders.over_orders(values)
  # Per-order means 8, 10, 12: mean 10, sd sqrt(((-2)^2 + 0 + 2^2) / 2) = 2.
  assert (s["orders"], s["runs"]) == (3, 4)
  assert s["mean"] == pytest.approx(10.0) and s["std"] == pytest.approx(2.0)
  assert (s["min"], s["max"]) == (8.0, 12.0) and s["per_order"] == {"A": 8.0, "B": 10.0, "C": 12.0}
  one = ivlod_orders.over_orders([("A", 7.0), ("A", 9.0)])
  assert one["orders"] == 1 and one["mean"] == 8.0 and math.isnan(one["std"])
  none = ivlod_orders.over_orders([("A", math.nan)])
  assert none["orders"] == 0 and math.isnan(none["mean"])


def test_report_gives_ivlod_as_mean_and_spread_over_orders(tmp_path):
  # Order A (the listing) with seeds 0 and 1, order B (reversed) with seed 0; Avg points 7, 9
  # and 11 (shifts 0, 2, 4 points on every dataset).
  for name, order, seed, shift in (
    ("a0", DATASETS, 0, 0.0),
    ("a1", DATASETS, 1, 0.02),
    ("b0", DATASETS[::-1], 0, 0.04),
  ):
    r = _results(
      _stages([k / 100 + shift for k in range(1, 14)]),
      run_id=name,
      sequence=order,
      seed=seed,
      seeds={"model": 0, "data": seed, "retrieval": seed},
      config={"seed": seed},
      status="complete",
    )
    results_lib.write_results(os.path.join(tmp_path, name), r)
  rep = report_lib.build_report(report_lib.load_points(report_lib.find_runs([str(tmp_path)])))
  avg = rep["ivlod_orders"]["no_replay"]["ivlod_Avg"]
  # Per-order means A (7 + 9) / 2 = 8 and B 11: mean 9.5, sd |11 - 8| / sqrt(2), min 8, max 11.
  assert (avg["orders"], avg["runs"]) == (2, 3)
  assert avg["mean"] == pytest.approx(9.5) and avg["std"] == pytest.approx(3 / math.sqrt(2))
  assert (avg["min"], avg["max"]) == pytest.approx((8.0, 11.0))
  # The pooled summary weighs order A twice: (7 + 9 + 11) / 3 = 9, not the IVLOD result.
  assert rep["summary"]["no_replay"]["ivlod_Avg"]["mean"] == pytest.approx(9.0)
  md = report_lib.render_markdown(rep)
  (row,) = [line for line in md.splitlines() if line.startswith("| no_replay | 2 (3) |")]
  assert row.split(" | ")[2] == "9.50 ± 2.12 [8.00, 11.00]"

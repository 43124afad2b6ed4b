"""Tests of owl_cl.eval.results: schema, Table-3 markdown, merge, ownership and atomicity."""

import json
import math
import os

import numpy as np
import pytest

from owl_cl.eval import results as rl
from owl_cl.eval import results_markdown
from owl_cl.eval import table3


def metrics(ap, ap50, **extra):
  return {"AP": ap, "AP50": ap50, "AP75": ap / 2, **extra}


def make_results(run_id="run-a", algorithm="swil", final_shift=0.0, n_stages=3):
  stages = [
    {
      "name": "pretrained",
      "metrics": {
        "o365": metrics(0.242, 0.35),
        "lvis": metrics(0.290, 0.40, APr=0.238),
        "D1": metrics(0.10, 0.20),
        "D2": metrics(0.14, 0.30),
      },
    },
    {
      "name": "D1",
      "wall_time_s": 60.0,
      "metrics": {
        "o365": metrics(0.230, 0.33),
        "lvis": metrics(0.270, 0.38, APr=0.220),
        "D1": metrics(0.60, 0.80),
        "D2": metrics(0.20, 0.32),
      },
    },
    {
      "name": "D2",
      "wall_time_s": 70.0,
      "metrics": {
        "o365": metrics(0.225 + final_shift, 0.32),
        "lvis": metrics(0.249, 0.36, APr=0.216),
        "D1": metrics(0.40, 0.70),
        "D2": metrics(0.71, 0.90),
      },
    },
  ][:n_stages]
  return {
    "run_id": run_id,
    "algorithm": algorithm,
    "config": {"lr": 1e-5, "arr": np.arange(2)},
    "seed": 3,
    "sequence": ["D1", "D2"],
    "wall_times": {"total": 7200.0},
    "roles": {
      "pretrain": "o365",
      "open_vocab": "lvis",
      "held_out": {"eval_set": "lvis", "AP": "APr", "AP50": None},
      "downstream": ["D1", "D2"],
    },
    "stages": stages,
  }


def test_finalize_summary_and_forgetting():
  r = rl.finalize_results(make_results())
  assert r["schema"] == rl.SCHEMA and r["schema_version"] == rl.SCHEMA_VERSION
  nf, final = r["summary"]["no_finetuning"], r["summary"]["final"]
  assert nf["pretrain_AP"] == pytest.approx(0.242)
  assert nf["held_out_AP"] == pytest.approx(0.238)
  assert nf["held_out_AP50"] is None  # NaN stored as null
  assert nf["downstream_mean_AP"] == pytest.approx(0.12)
  assert final["stage"] == "D2"
  assert final["downstream_mean_AP"] == pytest.approx((0.40 + 0.71) / 2)
  assert final["downstream_mean_AP50"] == pytest.approx(0.8)
  f = r["forgetting"]["AP"]
  assert f["per_set"]["o365"]["forgetting"] == pytest.approx(0.242 - 0.225)
  assert f["per_set"]["D1"]["forgetting"] == pytest.approx(0.2)
  assert f["bwt"] == pytest.approx(-0.2)
  assert f["fwt"] == pytest.approx(0.20 - 0.14)
  assert r["config"]["arr"] == [0, 1]
  assert r["stages"][2]["index"] == 2 and r["stages"][2]["trained_on"] == "D2"
  json.dumps(r, allow_nan=False)  # strict JSON
  with pytest.raises(ValueError):
    rl.finalize_results({**make_results(), "run_id": ""})
  with pytest.raises(ValueError):
    rl.finalize_results({**make_results(), "stages": []})


def test_own_task_ap_of_a_sequence_is_the_diagonal():
  own = rl.finalize_results(make_results())["summary"]["own"]
  # D1 right after stage 1 (AP .60, AP50 .80), D2 right after stage 2 (.71, .90).
  assert own["per_set"] == {"D1": {"AP": 0.60, "AP50": 0.80}, "D2": {"AP": 0.71, "AP50": 0.90}}
  assert own["mean_AP"] == pytest.approx(0.655) and own["min_AP"] == pytest.approx(0.60)
  assert own["mean_AP50"] == pytest.approx(0.85) and own["min_AP50"] == pytest.approx(0.80)
  # A run that has not trained D2 yet: no mean over part of the datasets.
  partial = rl.finalize_results(make_results(n_stages=2))["summary"]["own"]
  assert partial["per_set"]["D2"] == {"AP": None, "AP50": None}
  assert partial["mean_AP"] is None and partial["min_AP50"] is None


def _per_task_results(n_stages=3):
  r = make_results(algorithm="per_task", n_stages=n_stages)
  r["schedule"] = "per_task"
  # Each task's model on its own set and on the pre-training / open-vocabulary sets only.
  r["stages"][1:] = [
    {
      "name": "D1",
      "metrics": {
        "o365": metrics(0.20, 0.30),
        "lvis": metrics(0.26, 0.36, APr=0.21),
        "D1": metrics(0.65, 0.85),
      },
    },
    {
      "name": "D2",
      "metrics": {
        "o365": metrics(0.22, 0.34),
        "lvis": metrics(0.28, 0.40, APr=0.23),
        "D2": metrics(0.75, 0.92),
      },
    },
  ][: n_stages - 1]
  return r


def test_per_task_row_is_each_set_by_its_own_model_and_the_models_mean():
  r = rl.finalize_results(_per_task_results())
  final = r["summary"]["final"]
  assert final["stage"] == "per_task"
  assert final["pretrain_AP"] == pytest.approx((0.20 + 0.22) / 2)
  assert final["pretrain_AP50"] == pytest.approx((0.30 + 0.34) / 2)
  assert final["open_vocab_AP"] == pytest.approx((0.26 + 0.28) / 2)
  assert final["held_out_AP"] == pytest.approx((0.21 + 0.23) / 2)  # APr
  assert final["downstream_mean_AP"] == pytest.approx((0.65 + 0.75) / 2)
  assert final["downstream_mean_AP50"] == pytest.approx((0.85 + 0.92) / 2)
  own = r["summary"]["own"]
  assert own["min_AP50"] == pytest.approx(0.85) and own["mean_AP"] == pytest.approx(0.70)
  # No model learns two tasks: no forgetting, no BWT; kept = the models' mean / pre-trained.
  f = r["forgetting"]["AP"]
  assert f["average_forgetting"] is None and f["bwt"] is None
  assert f["per_set"]["o365"]["retained_fraction"] == pytest.approx(0.21 / 0.242)
  assert r["summary"]["stages_expected"] == 3
  md = results_markdown.render_results_markdown(r)
  assert "- schedule: per_task" in md
  assert "| AP | 65.0 | 75.0 | 70.0 | 65.0 |" in md  # own-task AP: D1, D2, mean, min
  # Only D1's model so far: the downstream mean waits for D2.
  partial = rl.finalize_results(_per_task_results(n_stages=2))["summary"]["final"]
  assert partial["downstream_mean_AP"] is None
  assert partial["pretrain_AP"] == pytest.approx(0.20)


def test_joint_run_has_one_stage_and_its_own_task_ap():
  r = make_results(algorithm="joint", n_stages=3)
  r["schedule"] = "joint"
  r["stages"] = [r["stages"][0], dict(r["stages"][2], name="joint")]
  r = rl.finalize_results(r)
  assert r["summary"]["stages_expected"] == 2 and r["summary"]["stages_completed"] == 2
  assert r["summary"]["final"]["stage"] == "joint"
  assert r["summary"]["final"]["downstream_mean_AP"] == pytest.approx((0.40 + 0.71) / 2)
  # Every set was trained in the one stage: own-task AP = the joint stage's.
  assert r["summary"]["own"]["per_set"]["D1"] == {"AP": 0.40, "AP50": 0.70}
  assert r["summary"]["own"]["min_AP50"] == pytest.approx(0.70)
  assert r["forgetting"]["AP"]["average_forgetting"] is None
  assert r["forgetting"]["AP"]["per_set"]["o365"]["retained_fraction"] == pytest.approx(
    0.225 / 0.242
  )
  with pytest.raises(ValueError, match="schedule"):
    rl.finalize_results({**make_results(), "schedule": "parallel"})


def test_write_results_files_and_markdown_numbers(tmp_path):
  workdir = str(tmp_path / "run")
  written = rl.write_results(workdir, make_results())
  with open(os.path.join(workdir, "results.json")) as f:
    data = json.load(f)
  assert data["run_id"] == "run-a" and data["summary"] == written["summary"]
  md = open(os.path.join(workdir, "results.md")).read()
  assert md.startswith('<!-- owl_cl-results run_id="run-a"')
  # (a) Table 3 layout: No fine-tuning = stage 0, algorithm = final stage, % one decimal.
  assert "| No fine-tuning | 24.2 | 29.0 | 23.8 | 12.0 |" in md
  assert "| swil | 22.5 | 24.9 | 21.6 | 55.5 |" in md
  assert "| No fine-tuning | 35.0 | 40.0 | - | 25.0 |" in md  # AP50 table
  assert "| swil | 32.0 | 36.0 | - | 80.0 |" in md
  assert "O365 stand-in (`o365`)" in md and "held-out (rare) (`lvis` APr)" in md
  assert "ODinW stand-in mean (2 sets)" in md
  # (b) per-dataset matrices.
  assert "| 1: D1 | 23.0 | 27.0 | 60.0 | 20.0 | 40.0 |" in md  # AP
  assert "| 2: D2 | 32.0 | 36.0 | 70.0 | 90.0 | 80.0 |" in md  # AP50
  # (c) forgetting / BWT.
  assert "| `D1` | D1 | 10.0 | 60.0 | 40.0 | 20.0 | 400.0 |" in md
  assert "- BWT: -20.0" in md and "- average forgetting: 20.0" in md
  assert "- FWT: +6.0" in md
  assert not [p for p in os.listdir(workdir) if p.endswith(".tmp")]


def test_rewrite_own_run_keeps_created_at(tmp_path):
  workdir = str(tmp_path)
  first = rl.write_results(workdir, make_results(n_stages=2))
  assert "(partial: 1/2 datasets)" in open(os.path.join(workdir, "results.md")).read()
  second = rl.write_results(workdir, make_results(n_stages=3))
  assert second["created_at"] == first["created_at"]
  assert len(rl.load_results(workdir)["stages"]) == 3


def test_refuses_to_overwrite_another_run(tmp_path):
  workdir = str(tmp_path)
  rl.write_results(workdir, make_results(run_id="run-a"))
  before = {n: open(os.path.join(workdir, n)).read() for n in ("results.json", "results.md")}
  with pytest.raises(rl.ResultsConflictError):
    rl.write_results(workdir, make_results(run_id="run-b"))
  with pytest.raises(FileExistsError):  # ResultsConflictError is a FileExistsError
    rl.write_results(workdir, make_results(run_id="run-b"))
  after = {n: open(os.path.join(workdir, n)).read() for n in ("results.json", "results.md")}
  assert before == after
  # A results.md of another run alone also blocks, and so does an unattributable file.
  other = tmp_path / "other"
  other.mkdir()
  (other / "results.md").write_text("# hand-written notes\n")
  with pytest.raises(rl.ResultsConflictError):
    rl.write_results(str(other), make_results())
  assert (other / "results.md").read_text() == "# hand-written notes\n"
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "results.json").write_text("{not json")
  with pytest.raises(rl.ResultsConflictError):
    rl.write_results(str(broken), make_results())


def test_write_is_atomic(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  rl.write_results(workdir, make_results())
  before = open(os.path.join(workdir, "results.json")).read()

  def failing_fsync(fd):
    raise OSError("disk full")

  monkeypatch.setattr(rl.os, "fsync", failing_fsync)
  with pytest.raises(OSError):
    rl.write_results(workdir, make_results(final_shift=0.01))
  monkeypatch.undo()
  assert open(os.path.join(workdir, "results.json")).read() == before
  assert json.loads(before)["run_id"] == "run-a"
  assert not [p for p in os.listdir(workdir) if p.endswith(".tmp")]


def test_merge_results_tables(tmp_path):
  paths = []
  for n, (run_id, algo, shift) in enumerate(
    [("a1", "no_replay", -0.2), ("b1", "swil", 0.0), ("b2", "swil", 0.01)]
  ):
    workdir = str(tmp_path / run_id)
    rl.write_results(workdir, make_results(run_id=run_id, algorithm=algo, final_shift=shift))
    paths.append(workdir if n % 2 else os.path.join(workdir, "results.json"))
  md = rl.merge_results_tables(paths)
  assert "| No fine-tuning | 3 | 24.2 | 29.0 | 23.8 | 12.0 |" in md
  assert "| no_replay | 1 | 2.5 | 24.9 | 21.6 | 55.5 |" in md
  assert "| swil | 2 | 23.0 | 24.9 | 21.6 | 55.5 |" in md  # mean of 22.5 and 23.5
  per_run = rl.merge_results_tables(paths, group_by_algorithm=False)
  assert "| swil (b2) | 1 | 23.5 |" in per_run
  bad = make_results(run_id="c1")
  bad["roles"]["pretrain"] = "lvis"
  rl.write_results(str(tmp_path / "c1"), bad)
  with pytest.raises(ValueError):
    rl.merge_results_tables(paths + [str(tmp_path / "c1")])
  with pytest.raises(ValueError):
    rl.merge_results_tables([])


def test_merge_command_line(tmp_path, capsys):
  paths = []
  for run_id, algo in (("a1", "no_replay"), ("b1", "swil")):
    rl.write_results(str(tmp_path / run_id), make_results(run_id=run_id, algorithm=algo))
    paths.append(str(tmp_path / run_id))
  assert rl.main(paths) == 0
  assert capsys.readouterr().out.strip() == rl.merge_results_tables(paths).strip()
  assert rl.main(paths + ["--per-run"]) == 0
  assert "| swil (b1) | 1 |" in capsys.readouterr().out


def test_missing_values_render_as_dash(tmp_path):
  r = make_results()
  del r["stages"][2]["metrics"]["D2"]
  r["stages"][2]["metrics"]["o365"]["AP"] = float("nan")
  final = rl.write_results(str(tmp_path), r)
  assert final["summary"]["final"]["downstream_mean_AP"] is None
  assert final["summary"]["final"]["pretrain_AP"] is None
  md = open(os.path.join(tmp_path, "results.md")).read()
  assert "| swil | - | 24.9 | 21.6 | - |" in md
  assert math.isnan(
    table3.table3_row(r["stages"][2], rl.finalize_results(r)["roles"])["downstream_mean_AP"]
  )


def test_eval_sets_alias_extra_keys_and_hidden_columns(tmp_path):
  """The form written by owl_cl.experiment: `eval_sets` roles, extra keys, no LVIS column."""
  r = make_results()
  del r["roles"]
  r["eval_sets"] = {"pretrain": "o365", "held_out": "lvis", "downstream": ["D1", "D2"]}
  del r["wall_times"]
  r.update(status="complete", timings={"wall_seconds": 3600.0}, retrieval="swil")
  r["stages"][1]["train"] = {"loss": np.float32(0.5)}
  final = rl.write_results(str(tmp_path), r)
  assert final["status"] == "complete" and final["retrieval"] == "swil"
  assert final["timings"] == {"wall_seconds": 3600.0}
  assert final["stages"][1]["train"] == {"loss": 0.5}
  assert final["roles"]["open_vocab"]["eval_set"] is None
  assert final["summary"]["final"]["held_out_AP"] == pytest.approx(0.249)
  md = open(os.path.join(tmp_path, "results.md")).read()
  assert (
    "| Algorithm | O365 stand-in (`o365`) | LVIS stand-in / held-out (rare) (`lvis`) | "
    "ODinW stand-in mean (2 sets) |"
  ) in md
  assert "| swil | 22.5 | 24.9 | 55.5 |" in md
  assert "- wall time: 1.00 h" in md and "- status: complete" in md
  merged = rl.merge_results_tables([str(tmp_path)])
  assert "| swil | 1 | 22.5 | 24.9 | 55.5 |" in merged


def test_provenance_and_per_class_are_kept_and_old_files_still_load(tmp_path):
  """Issue 49: `commit` / `dirty` / `commit_source` and each stage's `per_class` and
  `provenance` are written as given; a file written before them (none of these keys) loads,
  with `commit`, `dirty` and `commit_source` null and the same summary."""
  code = {"commit": "f" * 40, "dirty": True, "commit_source": "git"}
  new = make_results(run_id="new")
  new.update(code)
  new["stages"][0]["per_class"] = {"o365": {"person": {"category_id": 1, "AP": 0.25}}}
  new["stages"][0]["provenance"] = code
  written = rl.write_results(str(tmp_path / "new"), new)
  loaded = rl.load_results(str(tmp_path / "new"))
  assert {k: loaded[k] for k in code} == code == {k: written[k] for k in code}
  assert loaded["stages"][0]["per_class"] == new["stages"][0]["per_class"]
  assert loaded["stages"][0]["provenance"] == code
  old = rl.finalize_results(make_results(run_id="old"))
  for key in code:
    del old[key]
  os.makedirs(tmp_path / "old")
  with open(tmp_path / "old" / "results.json", "w") as f:
    json.dump(old, f)
  reloaded = rl.load_results(str(tmp_path / "old"))
  assert {k: reloaded[k] for k in code} == {"commit": None, "dirty": None, "commit_source": None}
  assert "per_class" not in reloaded["stages"][0]
  assert reloaded["summary"] == loaded["summary"]

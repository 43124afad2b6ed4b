"""launch/designs.py and launch/sweep_design.py: the committed sweeps' table, run order,
estimate, and the one command (its smoke run at tiny size)."""

import importlib.util
import json
import os
import sys

import pytest

from owl_cl import configs
from owl_cl.replay.retrieval import registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(REPO, "launch")
sys.path.insert(0, LAUNCH)  # sweep_design imports `designs` and `sweep` as the command does
_spec = importlib.util.spec_from_file_location(
  "sweep_design", os.path.join(LAUNCH, "sweep_design.py")
)
sweep_design = importlib.util.module_from_spec(_spec)
sys.modules["sweep_design"] = sweep_design  # dataclasses look the module up
_spec.loader.exec_module(sweep_design)
designs = sweep_design.designs
COMMITTED_RUNS = os.path.join(REPO, "benchmarks", "results", "sweep_builtin", "runs")


def test_round2_rows_are_the_registries_and_the_new_methods(monkeypatch):
  rows = designs.ROUND2.rows
  names = [r.name for r in rows]
  assert len(names) == len(set(names))
  # Every retrieval algorithm and every baseline but wise_ft as itself, no overrides.
  plain = [r for r in rows if not r.overrides]
  assert {r.name for r in plain} == set(registry.ALGORITHMS) | set(configs.BASELINES) - {"wise_ft"}
  assert all(r.name == r.config for r in plain)
  # WiSE-FT alone at three alphas (configs/wise_ft.py's 0.5 among them) and with swil.
  blended = {r.name: (r.config, r.overrides) for r in rows if r.overrides}
  alpha = "train.wise_ft.alpha"
  assert blended == {
    "wise_ft(0.25)": ("wise_ft", ((alpha, "0.25"),)),
    "wise_ft(0.5)": ("wise_ft", ((alpha, "0.5"),)),
    "wise_ft(0.75)": ("wise_ft", ((alpha, "0.75"),)),
    "swil+wise_ft(0.5)": ("swil", ((alpha, "0.5"),)),
  }
  # Report order: sequential baselines, WiSE-FT, retrieval, composed, the other schedules.
  assert names[0] == "no_replay" and names[-2:] == ["joint", "per_task"]
  assert names.index("wise_ft(0.75)") < names.index("uniform") < names.index("swil+wise_ft(0.5)")
  # A retrieval algorithm registered later is a row with no edit of the table.
  monkeypatch.setitem(registry.ALGORITHMS, "forgetful", registry.ALGORITHMS["uniform"])
  assert "forgetful" in [r.name for r in designs.round2_rows()]


def test_cell_order_spreads_every_prefix():
  # 3 seeds x 4 orders (coprime): cell i = (i mod 3, i mod 4).
  assert designs.cell_order(3, 4) == [
    (0, 0), (1, 1), (2, 2), (0, 3), (1, 0), (2, 1), (0, 2), (1, 3), (2, 0), (0, 1), (1, 2),
    (2, 3),
  ]  # fmt: skip
  # 2 x 2 (lcm 2): the second pass shifts the order by one, so the 4 cells each come once.
  assert designs.cell_order(2, 2) == [(0, 0), (1, 1), (0, 1), (1, 0)]
  for s, o in [(3, 6), (4, 4), (1, 5)]:
    assert sorted(designs.cell_order(s, o)) == [(i, j) for i in range(s) for j in range(o)]


def test_round2_run_order_and_estimate():
  design = designs.ROUND2
  runs = designs.run_order(design)
  n = len(design.rows)
  assert len(runs) == n * 12 == len({(r.name, s, o) for r, s, o in runs})
  # Cell after cell, every row in each, the reference first (it fills the seed's cache).
  assert [(s, o) for _, s, o in runs[::n]][:3] == [
    (0, "random_0"),
    (1, "random_1"),
    (2, "random_2"),
  ]
  assert runs[0][0].name == "uniform"
  assert {r.name for r, _, _ in runs[:n]} == {r.name for r in design.rows}
  # 3 pre-trainings x 5 min + 12 n runs x 65 s (docs/design_round2.md, "Cost").
  assert designs.estimate_seconds(design) == 3 * 300 + 12 * n * 65
  assert f"= {12 * n} runs" in designs.summary(design)


def test_round2_commands_name_and_group_the_runs():
  planned = sweep_design.plan_runs(designs.ROUND2, "w", python="python")
  by_name = {p.name: p.task for p in planned}
  assert len(by_name) == len(planned)
  task = by_name["swil+wise_ft_0.5_random_1_seed2"]
  assert task.argv[3:] == (
    "--config=configs/swil.py:builtin2",
    "--workdir=w/swil+wise_ft_0.5_random_1_seed2",
    "--config.task_order=random_1",
    "--config.seed=2",
    "--config.train.wise_ft.alpha=0.5",
    "--config.experiment_name=swil+wise_ft(0.5)",
  )
  assert task.cache_group == 2  # the model seed: the runs that share a pre-trained model
  assert by_name["uniform_random_0_seed0"].argv[-1] == "--config.seed=0"


def test_command_line_refusals(capsys, tmp_path):
  # Each refused before anything is written: one line naming the option, status 2.
  for argv, message in [
    (["nope"], "invalid choice: 'nope'"),
    (["round2", "--processes=0"], "--processes must be >= 1, got 0"),
    (["round2", "--cache-dir=x"], "--cache-dir is for --smoke"),
    (["round2", "--run", "--report-only"], "not allowed with argument"),
  ]:
    with pytest.raises(SystemExit) as e:
      sweep_design.main([*argv, f"--root={tmp_path / 'root'}"])
    assert e.value.code == 2 and message in capsys.readouterr().err
  assert not os.listdir(tmp_path)
  # Without --run: the design's line and its commands, nothing run or written.
  assert sweep_design.main(["round2", f"--root={tmp_path / 'root'}"]) == 0
  captured = capsys.readouterr()
  assert "design round2" in captured.err and len(captured.out.splitlines()) == 12 * len(
    designs.ROUND2.rows
  )
  assert not os.listdir(tmp_path)


def test_builtin_design_is_the_committed_sweep():
  # The first design's runs are exactly the committed sweep's 150 runs, with its seeds.
  planned = sweep_design.plan_runs(designs.BUILTIN, "workdirs/sweep_builtin2", python="python")
  assert sorted(p.name for p in planned) == sorted(os.listdir(COMMITTED_RUNS))
  task = next(p.task for p in planned if p.name == "swil_random_1_seed3")
  assert task.argv[3:] == (
    "--config=configs/swil.py:builtin2",
    "--workdir=workdirs/sweep_builtin2/swil_random_1_seed3",
    "--config.task_order=random_1",
    "--config.seeds.data=3",
    "--config.seeds.retrieval=3",
  )
  assert {p.task.cache_group for p in planned} == {None}  # one pre-trained model
  # Every row and seed of random_0 (no_replay and retrieval first) before random_1.
  orders = [p.task.order for p in planned]
  assert orders == sorted(orders) and planned[0].name == "no_replay_random_0_seed0"
  with open(os.path.join(COMMITTED_RUNS, "lwf_random_0_seed0", "results.json")) as f:
    assert json.load(f)["algorithm"] == "lwf"
  # Its rows' order is the README table's (the report's --order), the pre-trained row first.
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  table = readme.split("<!-- sweep_builtin summary: benchmarks/sweep_builtin.sh -->\n")[1]
  table = table.split("<!-- /sweep_builtin summary -->")[0]
  rows = [line.split("|")[1].strip() for line in table.splitlines()[3:]]
  assert rows == [r.name for r in designs.BUILTIN.rows]


# The whole command at tiny size: 2 tiny runs on the session's pre-trained model (the first
# alone: it fills the cache), the copy, the report, and a second invocation that runs nothing.
@pytest.mark.slow
def test_smoke_runs_copies_reports_and_skips_complete_runs(pretrained_cache_dir, tmp_path, capsys):
  root, out = str(tmp_path / "root"), str(tmp_path / "out")
  argv = ["round2", "--smoke", "--run", f"--root={root}", f"--out={out}"]
  argv.append(f"--cache-dir={pretrained_cache_dir}")
  assert sweep_design.main(argv) == 0, capsys.readouterr().err[-3000:]
  err = capsys.readouterr().err
  names = ["uniform_reversed_seed0", "swil+wise_ft_0.5_reversed_seed0"]
  assert "= 2 runs" in err and "2/2 ended (0 failed)" in err
  for name in names:
    with open(os.path.join(out, "runs", name, "results.json")) as f:
      copied = json.load(f)
    with open(os.path.join(root, name, "results.json")) as f:
      assert json.load(f) == copied and copied["status"] == "complete"
  assert copied["algorithm"] == "swil+wise_ft(0.5)"
  assert copied["config"]["train"]["wise_ft"]["alpha"] == 0.5
  with open(os.path.join(out, "report.md")) as f:
    report = f.read()
  assert "| swil+wise_ft(0.5) | 1 |" in report and "## WiSE-FT" in report
  assert not os.path.exists(os.path.join(out, "by_order"))  # one order: the report itself
  # Again: every run complete, none started; the report is written again.
  os.remove(os.path.join(out, "report.md"))
  assert sweep_design.main(argv) == 0
  err = capsys.readouterr().err
  assert err.count("# complete, skipped") == 2 and "[1/" not in err
  assert os.path.isfile(os.path.join(out, "report.md"))

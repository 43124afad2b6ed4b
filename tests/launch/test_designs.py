"""launch/designs.py and launch/sweep_design.py: the committed sweeps' table, run order,
estimate, and the one command (its smoke run at tiny size)."""

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
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
  # 3 pre-trainings x 400 s + 12 n runs x 41 s (docs/design_round2.md, "Cost").
  assert designs.estimate_seconds(design) == 3 * 400 + 12 * n * 41
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
  # Its rows' order is its table's (the report's --order), the pre-trained row first.
  assert _table_rows("docs/experiments.md", "sweep_builtin") == designs.row_names(
    designs.BUILTIN.rows
  )


def _table_rows(page: str, sweep: str) -> list[str]:
  """The algorithms of the `<!-- <sweep> summary ... -->` table of `page`, "No fine-tuning"
  dropped."""
  with open(os.path.join(REPO, page), encoding="utf-8") as f:
    text = f.read()
  table = text.split(f"<!-- {sweep} summary: benchmarks/{sweep}.sh -->\n")[1]
  table = table.split(f"<!-- /{sweep} summary -->")[0]
  return [line.split("|")[1].strip() for line in table.splitlines()[3:]]


def test_round2_design_is_the_committed_sweep():
  # The second design's 252 runs are the committed ones, its rows in the README table's order,
  # and the commits its runs record (two sittings) hold one run code (`run_code_paths`), as
  # the command checked before it went on from the first sitting's runs.
  planned = sweep_design.plan_runs(designs.ROUND2, "workdirs/sweep_round2", python="python")
  runs = os.path.join(REPO, designs.ROUND2.out, sweep_design.RUNS)
  assert sorted(p.name for p in planned) == sorted(os.listdir(runs))
  assert _table_rows("README.md", "sweep_round2") == designs.row_names(designs.ROUND2.rows)
  commits = set()
  for name in os.listdir(runs):
    with open(os.path.join(runs, name, "results.json"), encoding="utf-8") as f:
      commits.add(json.load(f)["commit"])
  first, *others = sorted(commits)
  for commit in others:
    changes = sweep_design.code_changes(first, other=commit)
    if isinstance(changes, str):  # e.g. a clone without that history
      pytest.skip(f"{first} and {commit} cannot be compared here: {changes}")
    assert changes == [], (first, commit)


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
  # Again: every run copied, none started; the report is written again.
  os.remove(os.path.join(out, "report.md"))
  assert sweep_design.main(argv) == 0
  err = capsys.readouterr().err
  assert "2 of 2 runs already copied" in err and "[1/" not in err
  assert os.path.isfile(os.path.join(out, "report.md"))
  # On a fresh machine (no workdirs, no cache): the committed copies alone; nothing runs.
  for name in names:
    shutil.rmtree(os.path.join(root, name))
  assert sweep_design.main(argv) == 0
  err = capsys.readouterr().err
  assert "2 of 2 runs already copied" in err and "[1/" not in err
  for name in names:
    with open(os.path.join(out, "runs", name, sweep_design.ENVIRONMENT)) as f:
      assert json.load(f)["jax"] == importlib.metadata.version("jax")


# A stand-in run: fails (status 3) when its stage-0 AP is 'fail' or a path after it is
# missing, else writes a complete results.json with that stage 0 into its workdir.
STAND_IN_RUN = r"""
import json, os, sys
if sys.argv[2] == "fail" or not all(os.path.exists(p) for p in sys.argv[3:]):
  sys.exit(3)
os.makedirs(sys.argv[1], exist_ok=True)
stages = [{"name": "pretrained", "metrics": {"pretrain_val": {"AP": float(sys.argv[2])}}}]
with open(os.path.join(sys.argv[1], "results.json"), "w") as f:
  json.dump({"status": "complete", "run": os.path.basename(sys.argv[1]), "stages": stages}, f)
"""


def stand_in(root, name, *needs, ap=0.25, group=None):
  workdir = os.path.join(root, name)
  argv = (sys.executable, "-c", STAND_IN_RUN, workdir, str(ap), *needs)
  task = sweep_design.sweep.Task("uniform", 0, (), workdir, argv, cache_group=group)
  return sweep_design.Planned(designs.Row("uniform", "uniform"), task)


def write_copy(out, name, record, environment=None):
  folder = os.path.join(out, "runs", name)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "results.json"), "w") as f:
    json.dump(record, f)
  if environment is not None:
    with open(os.path.join(folder, sweep_design.ENVIRONMENT), "w") as f:
      json.dump(environment, f)


def test_run_design_skips_copied_runs_and_copies_each_cell_once_it_is_whole(tmp_path, capsys):
  root, out = str(tmp_path / "root"), str(tmp_path / "out")
  a_copy = os.path.join(out, "runs", "a", "results.json")
  # Cells (model seeds): {a, b}, {c, d}, {e}. b is committed; c runs after a (one process)
  # and fails unless a's cell was copied when a ended; d fails, so c's cell stays uncopied.
  planned = [
    stand_in(root, "a", group=0),
    stand_in(root, "b", group=0),
    stand_in(root, "c", a_copy, group=1),
    stand_in(root, "d", group=1, ap="fail"),
    stand_in(root, "e", group=2),
  ]
  write_copy(out, "b", {"status": "complete", "run": "b (committed)"})
  write_copy(out, "x", {"status": "running"})  # not a run of the design: ignored
  assert sweep_design.run_design(designs.ROUND2, planned, out, processes=1) == 3
  assert "1 of 5 runs already copied" in capsys.readouterr().err
  assert not os.path.exists(os.path.join(root, "b"))  # committed: not run again
  assert sweep_design.sweep.is_complete(os.path.join(root, "c"))
  assert sorted(os.listdir(os.path.join(out, "runs"))) == ["a", "b", "e", "x"]  # no part of c's
  for name in ("a", "e"):
    with open(os.path.join(root, name, "results.json"), "rb") as f:
      ran = f.read()
    with open(os.path.join(out, "runs", name, "results.json"), "rb") as f:
      assert f.read() == ran
    with open(os.path.join(out, "runs", name, sweep_design.ENVIRONMENT)) as f:
      env = json.load(f)
    fingerprint = sweep_design.reproduction.fingerprint()  # CPU model and flags, XLA_FLAGS...
    assert {k: env[k] for k in fingerprint} == fingerprint and env["cpu_count"] == os.cpu_count()
    assert env["packages"]["scipy"] == importlib.metadata.version("scipy")
  # A copy equal to its workdir's is left as it is, with the environment of its first copy.
  env_path = os.path.join(out, "runs", "a", sweep_design.ENVIRONMENT)
  with open(env_path, "w") as f:
    json.dump({"cpu": "the machine that ran it"}, f)
  assert sweep_design.copy_results(planned, out) == 3
  with open(env_path) as f:
    assert json.load(f) == {"cpu": "the machine that ran it"}
  with open(os.path.join(out, "runs", "b", "results.json")) as f:
    assert json.load(f)["run"] == "b (committed)"


def git(repo, *args):
  command = ["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t", *args]
  return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def test_check_committed_refuses_other_code_and_warns_of_another_machine(tmp_path):
  repo, out = str(tmp_path / "repo"), str(tmp_path / "out")
  os.makedirs(os.path.join(repo, "owl_cl", "analysis"))
  for path in ("owl_cl/a.py", "owl_cl/analysis/report_part.py", "README.md"):
    with open(os.path.join(repo, path), "w") as f:
      f.write("x = 1\n")
  git(repo, "init", "-q")
  git(repo, "add", ".")
  git(repo, "commit", "-q", "-m", "one")
  commit = git(repo, "rev-parse", "HEAD")
  planned = [stand_in(str(tmp_path), "a"), stand_in(str(tmp_path), "b")]
  here = sweep_design.environment()

  def check(a, b=None, env_b=here):
    write_copy(out, "a", {"status": "complete", **a}, here)
    if b is not None:
      write_copy(out, "b", {"status": "complete", **b}, env_b)
    return sweep_design.check_committed(planned, out, repo)

  assert check({"commit": commit, "dirty": False}) == ([], [])
  # b copied on another CPU: a warning naming it, no refusal.
  refusals, warnings = check({"commit": commit}, {"commit": commit}, {**here, "cpu": "Z80"})
  assert refusals == [] and warnings == [
    f'1 copied run(s) (e.g. b) ran with another cpu: {{"cpu": "Z80"}} (here: {{"cpu": '
    f"{json.dumps(here['cpu'])}}})"
  ]
  # The same CPU model with other instruction-set flags (this project's machines differ so):
  # XLA's CPU code, and so a run's last bits, can differ.
  _, warnings = check({"commit": commit}, {"commit": commit}, {**here, "cpu_flags": "0" * 16})
  assert len(warnings) == 1 and "(e.g. b) ran with another cpu_flags" in warnings[0]
  # Outside the package, or in the analysis (above main's layer), a change is not a change
  # of the code a run executes.
  for path in ("README.md", "owl_cl/analysis/report_part.py"):
    with open(os.path.join(repo, path), "w") as f:
      f.write("x = 2\n")
  assert check({"commit": commit}, {"commit": commit}) == ([], [])
  with open(os.path.join(repo, "owl_cl", "a.py"), "w") as f:
    f.write("x = 2\n")
  refusals, _ = check({"commit": commit}, {"commit": commit})
  assert len(refusals) == 1 and "2 copied run(s)" in refusals[0]
  assert refusals[0].endswith("the package code differs here: owl_cl/a.py")
  git(repo, "checkout", "-q", "--", "owl_cl")
  refusals, warnings = check({"commit": commit, "dirty": True})
  assert refusals == [] and warnings == [
    f"1 copied run(s) (e.g. a) of commit {commit} recorded a dirty tree: its code may differ "
    "from the commit's"
  ]
  for record, message in [
    ({"commit": None}, "its commit is not recorded"),
    ({"commit": "f" * 40}, "the code cannot be compared (git diff failed"),
  ]:
    refusals, _ = check(record, {"commit": commit})
    assert len(refusals) == 1 and message in refusals[0], refusals


def test_run_refuses_to_go_on_from_copied_runs_of_other_code(tmp_path, capsys):
  root, out = tmp_path / "root", str(tmp_path / "out")
  write_copy(out, "uniform_reversed_seed0", {"status": "complete", "commit": "f" * 40})
  argv = ["round2", "--smoke", "--run", f"--root={root}", f"--out={out}"]
  assert sweep_design.main(argv) == 2
  err = capsys.readouterr().err
  assert f"(e.g. uniform_reversed_seed0) of commit {'f' * 40}" in err and "nothing run" in err
  assert sorted(os.listdir(root)) == ["configs"]  # no run started, no log


def test_run_code_paths_leave_out_what_main_never_imports(tmp_path):
  # The committed import layers: report above main; analysis and testing beside it.
  assert sweep_design.run_code_paths() == (
    "owl_cl",
    "setup.py",
    ":(exclude)owl_cl/report.py",
    ":(exclude)owl_cl/analysis",
    ":(exclude)owl_cl/testing",
  )
  layers = tmp_path / "layers"
  contract = "[importlinter:contract:layers]\nname = x\nlayers =\n  report\n  {}\n  experiment\n"
  layers.write_text(contract.format("main | analysis"))
  assert sweep_design.run_code_paths(str(layers))[2:] == (
    ":(exclude)owl_cl/report.py",
    ":(exclude)owl_cl/analysis",
  )
  layers.write_text(contract.format("analysis"))
  with pytest.raises(ValueError, match="no layer holds main"):
    sweep_design.run_code_paths(str(layers))


def test_a_planned_design_reports_only_when_every_run_is_copied(tmp_path, capsys, monkeypatch):
  root, out = str(tmp_path / "root"), str(tmp_path / "out")
  write_copy(out, "uniform_random_0_seed0", {"status": "complete"})
  write_copy(out, "swil_random_1_seed1", {"status": "complete"})
  argv = ["round2", "--report-only", f"--root={root}", f"--out={out}"]
  calls = []
  monkeypatch.setattr(sweep_design.report_lib, "main", lambda a: calls.append(a) or 0)
  monkeypatch.setattr(sweep_design.protection, "main", lambda a: calls.append(a) or 0)
  assert sweep_design.main(argv) == 0
  runs = 12 * len(designs.ROUND2.rows)
  assert f"{runs - 2} of {runs} runs not copied yet" in capsys.readouterr().err
  assert calls == [] and sorted(os.listdir(out)) == ["runs"]  # no report of part of the runs
  # --interim: the report without the plan, in <out>/interim; each order's report names the
  # rows with runs in that order only.
  assert sweep_design.main([*argv, "--interim"]) == 0
  interim, copies = os.path.join(out, "interim"), os.path.join(out, "runs")
  by_order = os.path.join(interim, "by_order")
  assert calls == [
    [copies, "--reference", "uniform", "--order", "uniform,swil", "--out", interim],
    [
      os.path.join(copies, "uniform_random_0_seed0"),
      "--reference",
      "uniform",
      "--order",
      "uniform",
      "--out",
      os.path.join(by_order, "random_0"),
    ],
    [
      os.path.join(copies, "swil_random_1_seed1"),
      "--reference",
      "uniform",
      "--order",
      "swil",
      "--out",
      os.path.join(by_order, "random_1"),
    ],
    [copies, "--out", os.path.join(interim, "protection.md")],
  ]


def test_a_model_seed_whose_runs_hold_two_pretrained_models_is_named(tmp_path, capsys):
  root, out = str(tmp_path / "root"), str(tmp_path / "out")
  stage0 = lambda ap: [{"name": "pretrained", "metrics": {"pretrain_val": {"AP": ap}}}]
  record = lambda ap, later: {"status": "complete", "stages": [*stage0(ap), {"later": later}]}
  # The fingerprint is the stage-0 metrics' alone: later stages (the algorithm) do not count.
  digest = sweep_design.pretrained_fingerprint
  assert digest(record(0.25, 1)) == digest(record(0.25, 2)) != digest(record(0.26, 1))
  assert digest({"status": "complete"}) is None
  # Seed 0's two committed runs share one model, seed 1's one another; two runs of seed 0
  # rebuilt elsewhere (stage-0 AP 0.26): named once, as soon as the first ends.
  planned = [
    stand_in(root, "a", group=0),
    stand_in(root, "b", group=0),
    stand_in(root, "c", group=1, ap=0.5),
    stand_in(root, "d", group=0, ap=0.26),
    stand_in(root, "e", group=0, ap=0.26),
    stand_in(root, "f", group=1, ap=0.5),
  ]
  write_copy(out, "a", record(0.25, 1))
  write_copy(out, "b", record(0.25, 2))
  write_copy(out, "c", record(0.5, 3))
  assert sweep_design.model_mismatches(planned, out) == []
  assert sweep_design.run_design(designs.ROUND2, planned, out, processes=1) == 0
  err = capsys.readouterr().err
  line = (
    "# warning: d's pre-trained model differs from the copied runs' of model seed 0 (their "
    "stage-0 metrics differ: rebuilt on another machine); each cell stays on one model, the "
    "model seed now names two"
  )
  assert err.count("pre-trained model differs") == 1 and line in err
  # Once copied, the start of the next sweep names them too.
  assert sweep_design.model_mismatches(planned, out) == [
    "the copied runs of model seed 0 hold 2 different pre-trained models (their stage-0 "
    "metrics differ): 2 like a; 2 like d"
  ]

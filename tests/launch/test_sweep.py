"""Tests of launch/: sweep command lines, task file, and the cluster scripts (syntax, dry runs)."""

import dataclasses
import importlib.util
import math
import os
import shlex
import subprocess
import sys

import pytest

from owl_cl import configs
from owl_cl.replay.retrieval import registry
from owl_cl.testing.configs import load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(REPO, "launch")
_spec = importlib.util.spec_from_file_location("launch_sweep", os.path.join(LAUNCH, "sweep.py"))
sweep = importlib.util.module_from_spec(_spec)
sys.modules["launch_sweep"] = sweep  # dataclasses look the module up
_spec.loader.exec_module(sweep)

# The registries: every retrieval algorithm and every baseline is an algorithm of a sweep.
ALGORITHMS = sorted(set(registry.ALGORITHMS) | set(configs.BASELINES))


def test_known_algorithms_are_the_registries_and_each_has_its_config():
  assert sweep.known_algorithms() == ALGORITHMS
  files = {os.path.splitext(f)[0] for f in os.listdir(os.path.dirname(configs.__file__))}
  files -= {"base", "__init__", "__pycache__", "examples"}
  # Every config file is an algorithm or a protocol, and every algorithm has its file.
  assert files == set(ALGORITHMS) | set(configs.PROTOCOLS)
  for name in registry.ALGORITHMS:  # a retrieval algorithm's config sets it
    assert load_config(name).replay.algorithm == name
  assert sweep.known_algorithms(os.path.dirname(configs.__file__)) == sorted(
    set(ALGORITHMS) | set(configs.PROTOCOLS)
  )


def test_exact_commands_small_grid(capsys):
  assert (
    sweep.main(
      [
        "--algorithms=swil,no_replay",
        "--seeds=0,2",
        "--root=/w",
        "--set",
        "replay.dedup=epoch,dataset",
      ]
    )
    == 0
  )
  lines = capsys.readouterr().out.splitlines()
  expected = []
  for algorithm in ("swil", "no_replay"):
    for seed in (0, 2):
      for dedup in ("epoch", "dataset"):
        expected.append(
          f"python -m owl_cl.main --config=configs/{algorithm}.py "
          f"--workdir=/w/{algorithm}_seed{seed}_replay.dedup={dedup} "
          f"--config.sequence_seed={seed} --config.replay.dedup={dedup}"
        )
  assert lines == expected
  # Deterministic, and the argv round-trips through the shell quoting.
  tasks = sweep.build_sweep(
    ["swil", "no_replay"], [0, 2], root="/w", grid=[("replay.dedup", ["epoch", "dataset"])]
  )
  assert [t.command for t in tasks] == expected
  assert all(shlex.split(t.command) == list(t.argv) for t in tasks)


def test_paper_fixed_and_bracket_values():
  tasks = sweep.build_sweep(
    ["aser"],
    [1],
    root="runs",
    paper=True,
    grid=[
      sweep.parse_assignment("data.augment.mosaic_sizes=(1,),(1,2,3)", multiple=True),
      sweep.parse_assignment("config.replay.aser.knn_k=10,20", multiple=True),
    ],
    fixed=[("data.root", "/my data")],
  )
  assert len(tasks) == 4
  assert tasks[1].argv == (
    "python",
    "-m",
    "owl_cl.main",
    "--config=configs/aser.py:paper",
    "--workdir=runs/aser_seed1_data.augment.mosaic_sizes=-1,-_replay.aser.knn_k=20",
    "--config.sequence_seed=1",
    "--config.data.augment.mosaic_sizes=(1,)",
    "--config.replay.aser.knn_k=20",
    "--config.data.root=/my data",
  )
  assert "'--config.data.root=/my data'" in tasks[1].command
  workdirs = [t.workdir for t in tasks]
  assert len(set(workdirs)) == len(workdirs)
  assert sweep.split_values("a, b,[1,2],{x:(3,4)}") == ["a", "b", "[1,2]", "{x:(3,4)}"]
  for bad in ("a,,b", "(1,2", "1)"):
    with pytest.raises(ValueError):
      sweep.split_values(bad)


def test_config_arg_selects_builtin_v2(capsys):
  tasks = sweep.build_sweep(["uniform", "swil"], [0], root="runs", config_arg="builtin2")
  assert [t.argv[3] for t in tasks] == [
    "--config=configs/uniform.py:builtin2",
    "--config=configs/swil.py:builtin2",
  ]
  # Fields are checked against the builtin2 config; an unknown argument is refused.
  with pytest.raises(ValueError, match="--config-arg='bogus': unknown config argument"):
    sweep.build_sweep(["uniform"], [0], config_arg="bogus")
  assert sweep.main(["--algorithms=uniform", "--config-arg=builtin2", "--seeds=1"]) == 0
  assert "--config=configs/uniform.py:builtin2 " in capsys.readouterr().out


def test_workdirs_unique_and_refusals():
  tasks = sweep.build_sweep(
    ALGORITHMS, [0, 1, 2], grid=[("replay.ratio", ["0.5", "1.0"])], check_fields=False
  )
  assert len(tasks) == len(ALGORITHMS) * 3 * 2 == len({t.workdir for t in tasks})
  with pytest.raises(ValueError) as e:
    sweep.build_sweep(["swil", "sweel"], [0])
  assert "sweel" in str(e.value) and ", ".join(ALGORITHMS) in str(e.value)
  with pytest.raises(ValueError, match="replay.dedupe"):  # typo in a field
    sweep.build_sweep(["swil"], [0], grid=[("replay.dedupe", ["epoch"])])
  with pytest.raises(ValueError, match="more than once"):
    sweep.build_sweep(["swil"], [0], grid=[("sequence_seed", ["1"])])
  with pytest.raises(ValueError, match="share the workdir"):  # '(1,)' and '[1,]' both -> -1,-
    sweep.build_sweep(["swil"], [0], grid=[("data.augment.mosaic_sizes", ["(1,)", "[1,]"])])
  with pytest.raises(ValueError, match="share the workdir"):
    sweep.build_sweep(["swil", "swil"], [0])


def test_command_line_errors(capsys):
  with pytest.raises(SystemExit):
    sweep.main(["--algorithms=nope"])
  assert "known: a_sw_grasp, aser" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep.main(["--algorithms=swil", "--seeds=x"])


def test_task_file_and_sbatch_reads_its_line(tmp_path, capsys):
  path = str(tmp_path / "sweep.tasks")
  assert sweep.main(["--algorithms=uniform", "--seeds=0,1,2", "--task-file", path]) == 0
  lines = open(path).read().splitlines()
  captured = capsys.readouterr()
  assert lines == captured.out.splitlines() and len(lines) == 3
  assert "sbatch --array=0-2 launch/slurm_gpu.sbatch" in captured.err
  assert sweep.main(["--algorithms=uniform", "--seeds=0,1,2", "--task-file", path]) == 0
  with pytest.raises(FileExistsError):  # other contents: never overwritten
    sweep.main(["--algorithms=swil", "--task-file", path])
  assert open(path).read().splitlines() == lines
  # The array script runs line TASK_ID + 1 of the task file (here harmless echo commands).
  tasks = tmp_path / "echo.tasks"
  tasks.write_text("echo first\necho 'second task' $XLA_PYTHON_CLIENT_MEM_FRACTION\n")
  env = dict(
    os.environ,
    SLURM_ARRAY_TASK_ID="1",
    OWL_CL_REPO=str(tmp_path),
    OWL_CL_VENV=str(tmp_path / "no_venv"),
    PATH="/usr/bin:/bin",
  )
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  out = subprocess.run(
    ["bash", os.path.join(LAUNCH, "slurm_gpu.sbatch"), str(tasks)],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert out.splitlines()[-1] == "second task 0.90"
  env["SLURM_ARRAY_TASK_ID"] = "5"
  bad = subprocess.run(
    ["bash", os.path.join(LAUNCH, "slurm_gpu.sbatch"), str(tasks)],
    env=env,
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 2 and "no line 6" in bad.stderr


@pytest.mark.parametrize("script", ["slurm_gpu.sbatch", "tpu_vm.sh"])
def test_scripts_syntax(script):
  subprocess.run(["bash", "-n", os.path.join(LAUNCH, script)], check=True)


def test_tpu_vm_dry_run_adds_distributed():
  env = dict(os.environ, DRY_RUN="1", TPU_PROJECT="proj")
  cmd = [
    os.path.join(LAUNCH, "tpu_vm.sh"),
    "my-tpu",
    "us-central2-b",
    "--",
    "python",
    "-m",
    "owl_cl.main",
    "--config=configs/swil.py:paper",
    "--workdir=/mnt/w s",
  ]
  out = subprocess.run(["bash"] + cmd, env=env, capture_output=True, text=True, check=True).stdout
  argv = shlex.split(out)
  assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu"]
  assert "--zone=us-central2-b" in argv and "--worker=all" in argv
  assert "--project=proj" in argv
  remote = [a for a in argv if a.startswith("--command=")][0][len("--command=") :]
  assert remote.startswith("cd ~/owl_cl && python -m owl_cl.main")
  assert shlex.split(remote.split("&& ", 1)[1])[-2:] == ["--workdir=/mnt/w s", "--distributed"]
  with_flag = subprocess.run(
    ["bash"] + cmd + ["--distributed"], env=env, capture_output=True, text=True, check=True
  ).stdout
  assert with_flag.count("--distributed") == 1
  usage = subprocess.run(["bash", cmd[0], "my-tpu"], env=env, capture_output=True, text=True)
  assert usage.returncode == 2 and "usage" in usage.stderr


def _fake_slurm_bin(tmp_path):
  """`scontrol show hostnames` of a 2-node job, and an `srun` that runs its command once per
  task with that task's SLURM_PROCID (as SLURM does, one task per node)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a17\\ngpu-a18\\n'\n")
  (bin_dir / "srun").write_text(
    "#!/bin/bash\n"
    'echo "srun $*" >&2\n'
    'while [[ "$1" == --* ]]; do shift; done\n'
    'for i in 0 1; do SLURM_PROCID=$i SLURM_NTASKS=2 "$@" || exit $?; done\n'
  )
  for name in ("scontrol", "srun"):
    os.chmod(bin_dir / name, 0o755)
  return str(bin_dir)


def _multinode_env(tmp_path, **extra):
  env = dict(
    os.environ,
    SLURM_ARRAY_TASK_ID="0",
    SLURM_JOB_ID="1234",
    SLURM_JOB_NUM_NODES="2",
    SLURM_JOB_NODELIST="gpu-a[17-18]",
    OWL_CL_REPO=str(tmp_path),
    OWL_CL_VENV=str(tmp_path / "no_venv"),
    PATH=_fake_slurm_bin(tmp_path) + ":/usr/bin:/bin",
    **extra,
  )
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_PROCID"):
    env.pop(k, None)
  return env


def test_slurm_multinode_dry_run(tmp_path):
  tasks = tmp_path / "main.tasks"
  tasks.write_text("python -m owl_cl.main --config=configs/swil.py '--workdir=/shared/w s'\n")
  env = _multinode_env(tmp_path, DRY_RUN="1")
  script = os.path.join(LAUNCH, "slurm_gpu.sbatch")
  out = subprocess.run(
    ["bash", script, str(tasks)], env=env, capture_output=True, text=True, check=True
  ).stdout.splitlines()
  port = 61440 + 1234 % 4096
  assert f"on 2 nodes, coordinator gpu-a17:{port}" in out[0]
  assert out[1] == f"JAX_COORDINATOR_ADDRESS=gpu-a17:{port} JAX_NUM_PROCESSES=2"
  argv = shlex.split(out[2])
  assert argv[:6] == [
    "srun",
    "--nodes=2",
    "--ntasks=2",
    "--ntasks-per-node=1",
    "--kill-on-bad-exit=1",
    "bash",
  ]
  assert shlex.split(argv[7]) == [
    "python",
    "-m",
    "owl_cl.main",
    "--config=configs/swil.py",
    "--workdir=/shared/w s",
    "--distributed",
  ]
  # An explicit port, and --distributed is never doubled.
  tasks.write_text("python -m owl_cl.main --config=configs/swil.py --distributed\n")
  env["OWL_CL_COORDINATOR_PORT"] = "7000"
  out = subprocess.run(
    ["bash", script, str(tasks)], env=env, capture_output=True, text=True, check=True
  ).stdout
  assert "JAX_COORDINATOR_ADDRESS=gpu-a17:7000" in out
  assert out.splitlines()[-1].count("--distributed") == 1
  # One node: no srun, no coordinator (the single-process path of before).
  env["SLURM_JOB_NUM_NODES"] = "1"
  out = subprocess.run(
    ["bash", script, str(tasks)], env=env, capture_output=True, text=True, check=True
  ).stdout.splitlines()
  assert out[1] == "JAX_COORDINATOR_ADDRESS= JAX_NUM_PROCESSES="
  assert shlex.split(out[2])[:2] == ["bash", "-c"]


def test_slurm_multinode_tasks_get_the_cluster_spec(tmp_path):
  # Each srun task (a fake srun runs them one after the other) resolves the same coordinator
  # and count and its own index, exactly as owl_cl.main --distributed does.
  tasks = tmp_path / "spec.tasks"
  tasks.write_text(
    f"{sys.executable} -c 'from owl_cl import distributed as d; print(d.cluster_spec())'\n"
  )
  env = _multinode_env(tmp_path, PYTHONPATH=REPO)
  proc = subprocess.run(
    ["bash", os.path.join(LAUNCH, "slurm_gpu.sbatch"), str(tasks)],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  port = 61440 + 1234 % 4096
  assert proc.stdout.splitlines()[-2:] == [
    f"ClusterSpec(coordinator_address='gpu-a17:{port}', num_processes=2, process_id={i})"
    for i in (0, 1)
  ]
  assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c" in (
    proc.stderr
  )


def test_orders_axis_and_seed_fields():
  tasks = sweep.build_sweep(["swil"], [0, 1], root="/w", orders=["random_0", "odinw13/reversed"])
  assert [t.command for t in tasks] == [
    f"python -m owl_cl.main --config=configs/swil.py --workdir=/w/swil_{name}_seed{seed} "
    f"--config.task_order={order} --config.seeds.data={seed} --config.seeds.retrieval={seed}"
    for order, name in (("random_0", "random_0"), ("odinw13/reversed", "odinw13-reversed"))
    for seed in (0, 1)
  ]
  assert [t.order for t in tasks] == ["random_0"] * 2 + ["odinw13/reversed"] * 2
  # Each seed part can be varied alone; `seed` varies everything (the model too).
  (task,) = sweep.build_sweep(["swil"], [3], orders=["1"], seed_fields=["seeds.retrieval"])
  assert task.argv[-2:] == ("--config.task_order=1", "--config.seeds.retrieval=3")
  (task,) = sweep.build_sweep(["swil"], [3], seed_fields=["seed"])
  assert task.argv[-1] == "--config.seed=3"
  with pytest.raises(ValueError, match="'random_99' is no stored order"):
    sweep.build_sweep(["swil"], [0], orders=["random_99"])
  with pytest.raises(ValueError, match=r"\['task_order'\] given more than once"):
    sweep.build_sweep(["swil"], [0], orders=["random_0"], grid=[("task_order", ["random_1"])])
  with pytest.raises(ValueError, match="seeds.dta"):
    sweep.build_sweep(["swil"], [0], seed_fields=["seeds.dta"])


FAKE_RUN = r"""
import json, os, sys, time
workdir, fail = sys.argv[1], sys.argv[2] == "fail"
with open(os.path.join(os.path.dirname(workdir), "times.txt"), "a") as f:
  f.write(f"start {os.path.basename(workdir)} {time.time()}\n")
time.sleep(0.3)
if fail:
  sys.exit(3)
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(workdir, "results.json"), "w") as f:
  json.dump({"status": "complete"}, f)
with open(os.path.join(os.path.dirname(workdir), "times.txt"), "a") as f:
  f.write(f"end {os.path.basename(workdir)} {time.time()}\n")
"""


def fake_tasks(root, names, fail=()):
  return [
    sweep.Task(
      "uniform",
      0,
      (),
      os.path.join(root, n),
      (sys.executable, "-c", FAKE_RUN, os.path.join(root, n), "fail" if n in fail else "ok"),
    )
    for n in names
  ]


def read_times(root):
  times = {}
  for line in open(os.path.join(root, "times.txt")).read().splitlines():
    event, name, t = line.split()
    times.setdefault(name, {})[event] = float(t)
  return times


def test_run_tasks_skips_complete_first_alone_and_caps(tmp_path):
  root = str(tmp_path)
  tasks = fake_tasks(root, ["a", "b", "c", "d", "e"])
  os.makedirs(tasks[1].workdir)
  with open(os.path.join(tasks[1].workdir, "results.json"), "w") as f:
    f.write('{"status": "complete"}')
  os.makedirs(tasks[2].workdir)  # a killed run: no complete results, run (resumed) again
  with open(os.path.join(tasks[2].workdir, "results.json"), "w") as f:
    f.write('{"status": "running"}')
  assert sweep.run_tasks(tasks, processes=2, poll_seconds=0.05) == 0
  times = read_times(root)
  assert sorted(times) == ["a", "c", "d", "e"]  # b was complete: skipped
  assert all(sweep.is_complete(t.workdir) for t in tasks)
  # a ran alone: every other began after it ended.
  assert all(times[n]["start"] >= times["a"]["end"] for n in ("c", "d", "e"))
  # Never more than 2 at once: at every start, at most one other run is in progress.
  for n in ("c", "d", "e"):
    others = [m for m in ("c", "d", "e") if m != n]
    inside = [m for m in others if times[m]["start"] <= times[n]["start"] < times[m]["end"]]
    assert len(inside) <= 1
  assert os.path.isfile(os.path.join(root, "logs", "c.log"))


def test_run_tasks_stops_at_the_first_failure(tmp_path):
  root = str(tmp_path)
  tasks = fake_tasks(root, ["a", "b", "c"], fail=("b",))
  assert sweep.run_tasks(tasks, processes=1, poll_seconds=0.05) == 3
  assert sorted(read_times(root)) == ["a", "b"]  # c never started
  with pytest.raises(ValueError, match="--processes must be >= 1"):
    sweep.run_tasks(tasks, processes=0)


def test_run_tasks_fills_each_cache_group_first_and_keeps_going(tmp_path, capsys):
  root = str(tmp_path)
  # Model seeds 0 and 1 (cache groups): a0 and b0 fill their groups' caches; a1 and b1 wait
  # for their own group's first task only; f fails, and with keep_going the rest still run.
  tasks = fake_tasks(root, ["a0", "b0", "a1", "f", "b1"], fail=("f",))
  groups = {"a0": 0, "a1": 0, "f": 0, "b0": 1, "b1": 1}
  tasks = [dataclasses.replace(t, cache_group=groups[os.path.basename(t.workdir)]) for t in tasks]
  assert sweep.run_tasks(tasks, processes=2, poll_seconds=0.05, keep_going=True) == 3
  times = read_times(root)
  assert sorted(times) == ["a0", "a1", "b0", "b1", "f"]  # f's failure stopped nothing
  # The two groups' first tasks started together (before any task ended); each group's
  # others after its first.
  lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("# fail")]
  assert lines[0].endswith("a0") and lines[1].endswith("b0") and "ended" in lines[2]
  assert all(times[n]["start"] >= times["a0"]["end"] for n in ("a1", "f"))
  assert times["b1"]["start"] >= times["b0"]["end"]


def test_progress_line_hand_worked():
  # 3 ended in 1800 s: 6 runs/h; 9 left at that rate: 1.5 h.
  assert (
    sweep.progress_line(3, 12, 1, 1800.0) == "3/12 ended (1 failed), 6.0 runs/h, about 1.5 h left"
  )
  assert sweep.progress_line(12, 12, 0, 7200.0) == "12/12 ended (0 failed), 6.0 runs/h, done"
  assert sweep.progress_line(1, 4, 0, 60.0).endswith("about 3 min left")  # 60 runs/h
  assert sweep.format_duration(45.0) == "45 s" and sweep.format_duration(math.inf) == "unknown time"


def test_run_tasks_calls_on_end_once_per_task_as_it_ends(tmp_path):
  root = str(tmp_path)
  tasks = fake_tasks(root, ["a", "f", "b"], fail=("f",))
  ended = []

  def on_end(task, status):
    # Called after the task ended (its results are written) and before the next one starts.
    name = os.path.basename(task.workdir)
    started = [n for n in read_times(root) if "start" in read_times(root)[n]]
    ended.append((name, status, sweep.is_complete(task.workdir), sorted(started)))

  status = sweep.run_tasks(tasks, processes=1, poll_seconds=0.05, keep_going=True, on_end=on_end)
  assert status == 3
  assert ended == [
    ("a", 0, True, ["a"]),
    ("f", 3, False, ["a", "f"]),
    ("b", 0, True, ["a", "b", "f"]),
  ]

"""Multi-process runs: 2 JAX processes x 4 CPU devices against 1 process x 8 devices.

The processes join one runtime through `jax.distributed.initialize` on a localhost coordinator
(free port) with Gloo CPU collectives; each runs tests/multihost_worker.py. Subprocesses are
killed on every exit path.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from owl_cl import distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "multihost_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(jobs: list[tuple[str, int, str]], timeout: float) -> list[list[tuple[int, str]]]:
  """Runs jobs (MODE, NPROC, OUT) side by side, NPROC workers of 8 // NPROC devices each.

  Returns, per job, [(exit status, output)] per process; a process still running at the
  timeout is killed (status None). Every process is killed on any exit path.
  """
  handles = []  # (job index, Popen, log file)
  try:
    for j, (mode, nproc, out) in enumerate(jobs):
      port = str(_free_port())
      env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // nproc}",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
      )
      for pid in range(nproc):
        log = open(os.path.join(out, f"{mode}{nproc}_{pid}.log"), "w+")
        handles.append((j, None, log))
        proc = subprocess.Popen(
          [sys.executable, WORKER, mode, port, str(nproc), str(pid), out],
          env=env,
          stdout=log,
          stderr=subprocess.STDOUT,
          start_new_session=True,  # its own process group: killed as a whole below
        )
        handles[-1] = (j, proc, log)
    deadline = time.monotonic() + timeout
    for _, proc, _ in handles:
      try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        break
  finally:
    for _, proc, _ in handles:
      if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.returncode = None  # reported as a timeout
  results = [[] for _ in jobs]
  for j, proc, log in handles:
    log.seek(0)
    results[j].append((proc.returncode, log.read()))
    log.close()
  return results


def _check(results):
  for pid, (rc, output) in enumerate(results):
    if rc and "COLLECTIVES_UNAVAILABLE" in output:
      line = [x for x in output.splitlines() if "COLLECTIVES_UNAVAILABLE" in x][0]
      pytest.skip(f"this JAX cannot run CPU multi-process collectives: {line}")
    status = "timed out" if rc is None else f"exited with {rc}"
    assert rc == 0, f"process {pid} {status}:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Outputs of the 1 x 8 reference and of both processes of the 2 x 4 run (run side by side:
  the processes' serial phases, start-up and waits, overlap)."""
  single = str(tmp_path_factory.mktemp("single"))
  multi = str(tmp_path_factory.mktemp("multi"))
  single_run, multi_run = _spawn([("run", 1, single), ("run", 2, multi)], timeout=400)
  _check(multi_run)
  _check(single_run)
  load = lambda d, pid: dict(np.load(os.path.join(d, f"process{pid}.npz")))
  return load(single, 0), [load(multi, 0), load(multi, 1)]


def test_collectives_across_processes(runs):
  single, multi = runs
  for r in [single] + multi:
    assert float(r["psum"]) == 28.0  # sum of 0..7, exact in float32


def test_train_step_matches_single_process(runs):
  single, multi = runs
  metric_keys = [k for k in single if k.startswith("metric/")]
  param_keys = [k for k in single if k.startswith("param/")]
  assert "metric/loss" in metric_keys and len(param_keys) > 10
  for r in multi:
    # The losses are O(1) sums whose cross-device reduction runs through Gloo instead of
    # in-process: they agree to float32 reduction-order noise.
    for k in metric_keys:
      np.testing.assert_allclose(r[k], single[k], rtol=2e-4, atol=1e-5, err_msg=k)
    # Adam makes every update ~LR (1e-3) whatever the gradient's size, so leaves with tiny
    # gradients amplify reduction-order noise: parameters agree to 5% of one LR-sized update.
    for k in param_keys:
      np.testing.assert_allclose(r[k], single[k], rtol=2e-4, atol=5e-5, err_msg=k)
  # Both processes hold the same replicated parameters, bit for bit.
  for k in param_keys:
    np.testing.assert_array_equal(multi[0][k], multi[1][k], err_msg=k)


def test_dataset_shards_cover_once(runs):
  single, multi = runs
  ids = list(range(1000, 1037))
  assert single["shard"].tolist() == ids
  shards = [r["shard"].tolist() for r in multi]
  assert shards[0] + shards[1] == ids  # disjoint, complete, in order
  assert [len(s) for s in shards] == [19, 18]


def test_gathered_predictions_equal_single_process(runs):
  single, multi = runs
  assert single["pred_ids"].tolist() == list(range(1000, 1037))
  for r in multi:
    np.testing.assert_array_equal(r["pred_ids"], single["pred_ids"])
    # Per-image values computed on different devices by the same XLA kernels: identical up to
    # the last bit of float32 values of magnitude <= 1.
    np.testing.assert_allclose(r["pred_scores"], single["pred_scores"], rtol=0, atol=1e-6)


def test_replay_slots_are_local(runs):
  single, multi = runs
  np.testing.assert_array_equal(single["replay_rows"], np.arange(8))
  for pid, r in enumerate(multi):
    np.testing.assert_array_equal(r["replay_rows"], np.arange(4 * pid, 4 * pid + 4))
    # This process gathered exactly the retrieval slots of its rows, and the assembled global
    # batch equals the whole replicated gather (exact: copies of stored values).
    full = single["replay_local_indices"]
    np.testing.assert_array_equal(r["replay_local_indices"], full[4 * pid : 4 * pid + 4])
    np.testing.assert_array_equal(r["replay_global"], r["replay_expected"])
  np.testing.assert_array_equal(single["replay_global"], single["replay_expected"])


def test_orbax_stage_checkpoint_roundtrip(runs):
  # Both processes save stage 0 into one shared folder and restore it bit for bit.
  single, multi = runs
  assert [bool(r["checkpoint_roundtrip"]) for r in [single] + multi] == [True, True, True]


def test_writer_and_log_prefix(runs):
  single, multi = runs
  assert bool(single["is_writer"]) and str(single["log_prefix"]) == ""
  assert [bool(r["is_writer"]) for r in multi] == [True, False]
  assert [str(r["log_prefix"]) for r in multi] == ["[process 0/2] ", "[process 1/2] "]


def test_one_failure_ends_the_run_naming_it(tmp_path):
  start = time.monotonic()
  [(rc0, out0), (rc1, out1)] = _spawn([("fail", 2, str(tmp_path))], timeout=120)[0]
  assert rc1 == 1 and "process 1 of 2 failed: RuntimeError: injected failure" in out1, out1
  assert rc0 != 0, out0[-3000:]
  assert "passed the barrier" not in out0
  # Process 0 ends either through `barrier` (our message, with the failed process's own) or
  # through JAX's coordination service once process 1's heartbeats stop (naming task 1).
  ours = "failed processes: process 1: RuntimeError: injected failure" in out0
  jax_s = "stopped sending heartbeats" in out0 and "\n1\n" in out0
  assert ours or jax_s, out0[-3000:]
  assert time.monotonic() - start < 100  # the heartbeat timeout is 5 s, not the default 100 s


def test_cluster_spec_from_arguments_and_environment():
  assert distributed.cluster_spec(environ={}) is None
  spec = distributed.cluster_spec("h:1234", 2, 1, environ={})
  assert spec == distributed.ClusterSpec("h:1234", 2, 1)
  slurm = {"JAX_COORDINATOR_ADDRESS": "node1:5000", "SLURM_NTASKS": "4", "SLURM_PROCID": "3"}
  assert distributed.cluster_spec(environ=slurm) == distributed.ClusterSpec("node1:5000", 4, 3)
  jax_env = dict(slurm, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
  assert distributed.cluster_spec(environ=jax_env) == distributed.ClusterSpec("node1:5000", 2, 0)
  with pytest.raises(ValueError, match="num_processes is unset"):
    distributed.cluster_spec("h:1", environ={})
  with pytest.raises(ValueError, match="process_id must lie in \\[0, 2\\), got 2"):
    distributed.cluster_spec("h:1", 2, 2, environ={})
  with pytest.raises(ValueError, match="num_processes must be an integer, got 'x'"):
    distributed.cluster_spec("h:1", environ={"JAX_NUM_PROCESSES": "x", "JAX_PROCESS_ID": "0"})
  with pytest.raises(ValueError, match="'host:port', got 'nohost'"):
    distributed.cluster_spec("nohost", 1, 0, environ={})


def test_process_shard_blocks():
  ids = list(range(10))
  for count in (1, 3, 4, 10, 12):
    shards = [distributed.process_shard(ids, i, count) for i in range(count)]
    assert sum(shards, []) == ids
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
  with pytest.raises(ValueError, match="process_index must lie in \\[0, 3\\), got 3"):
    distributed.process_shard(ids, 3, 3)


def test_single_process_helpers():
  tree = {"a": np.arange(6).reshape(3, 2), "b": np.ones(3)}
  out = distributed.gather_rows(tree)
  np.testing.assert_array_equal(out["a"], tree["a"])
  with pytest.raises(ValueError, match="common leading size"):
    distributed.gather_rows({"a": np.ones(3), "b": np.ones(2)})
  distributed.barrier("noop", timeout_s=1)  # a no-op with one process
  assert distributed.failed_processes() == {}
  with pytest.raises(ZeroDivisionError):  # single process: the exception propagates
    with distributed.fail_fast():
      raise ZeroDivisionError


def test_single_process_sharding_is_device_put():
  # In this (1-process) pytest process the new assembly equals the plain device_put of before.
  import jax  # pylint: disable=g-import-not-at-top

  from owl_cl.train import sharding  # pylint: disable=g-import-not-at-top

  mesh = sharding.create_mesh()
  n = mesh.shape[sharding.DATA_AXIS]
  assert sharding.process_rows(4 * n, mesh) == slice(0, 4 * n)
  batch = {"x": np.arange(4 * n * 3, dtype=np.float32).reshape(4 * n, 3)}
  assert sharding.local_rows(batch, mesh)["x"] is not batch["x"]
  np.testing.assert_array_equal(sharding.local_rows(batch, mesh)["x"], batch["x"])
  global_batch = sharding.shard_batch(batch, mesh)
  reference = jax.device_put(batch["x"], sharding.batch_sharding(mesh))
  assert global_batch["x"].sharding == reference.sharding
  np.testing.assert_array_equal(np.asarray(global_batch["x"]), batch["x"])
  # jax.Array values are taken as global arrays.
  again = sharding.shard_batch({"x": global_batch["x"]}, mesh)["x"]
  np.testing.assert_array_equal(sharding.host_local_rows(again), batch["x"])
  fetched = sharding.fetch_replicated({"p": sharding.replicate(np.ones(3), mesh), "s": 2})
  np.testing.assert_array_equal(fetched["p"], np.ones(3))
  assert fetched["s"] == 2
  with pytest.raises(ValueError, match="batch\\['y'\\] has local leading size"):
    sharding.shard_batch({"y": np.float32(1.0)}, mesh)
  with pytest.raises(ValueError, match="different leading sizes"):
    sharding.local_rows({"a": np.ones(n), "b": np.ones(2 * n)}, mesh)


def test_main_rejects_cluster_flags_without_distributed():
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-m", "owl_cl.main", "--config=configs/swil.py", "--num_processes=2"],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
  )
  assert proc.returncode != 0
  assert "--coordinator_address/--num_processes/--process_id need --distributed" in proc.stderr


# ----------------------------------------------------------------------------- the main job

_MAIN_CONFIG = """
from owl_cl.testing.configs import tiny_config


def get_config():
  c = tiny_config("swil", {cache_dir!r})
  # One downstream dataset (stages: pre-trained, thermal): every stage still trains and
  # evaluates, and a second dataset would only repeat the compilation for its class count.
  c.data.builtin.downstream = ("thermal",)
  return c
"""


def _main_job(config: str, workdir: str, nproc: int, timeout: float) -> list[tuple[int, str]]:
  """Runs `python -m owl_cl.main` as NPROC processes of 8 // NPROC CPU devices each (NPROC > 1:
  `--distributed` on a localhost coordinator). Returns [(exit status, output)] per process;
  every process is killed on any exit path (status None: timed out)."""
  port = str(_free_port())
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // nproc}",
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    PYTHONUNBUFFERED="1",
  )
  procs = []
  try:
    for pid in range(nproc):
      cmd = [sys.executable, "-m", "owl_cl.main", f"--config={config}", f"--workdir={workdir}"]
      if nproc > 1:
        cmd += [
          "--distributed",
          f"--coordinator_address=127.0.0.1:{port}",
          f"--num_processes={nproc}",
          f"--process_id={pid}",
        ]
      log = open(f"{workdir}.{pid}.log", "w+")
      procs.append(
        (
          subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
          ),
          log,
        )
      )
    deadline = time.monotonic() + timeout
    for proc, _ in procs:
      try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        break
  finally:
    for proc, _ in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.returncode = None
  out = []
  for proc, log in procs:
    log.seek(0)
    out.append((proc.returncode, log.read()))
    log.close()
  return out


def _stage_figures(results: dict) -> dict:
  """The metrics of every stage and the training figures of every dataset, by stage name."""
  out = {}
  for stage in results["stages"]:
    train = stage.get("train") or {}
    out[stage["name"]] = {
      "metrics": stage["metrics"],
      "train": {
        k: train.get(k) for k in ("steps", "replayed_images", "replays_in_loss", "final_loss")
      },
    }
  return out


def test_main_job_two_processes_matches_one(tmp_path, pretrained_cache_dir):
  # The whole run (`owl_cl.main`, built-in benchmark, tiny budget: 2 steps on one downstream
  # dataset, the 3 eval sets after both stages) as 2 processes x 4 devices and as
  # 1 process x 8 devices. Both load the session's cached pre-trained model; the 1-process
  # run builds the replay buffer and caches it for the 2-process run.
  config = tmp_path / "tiny_swil.py"
  config.write_text(_MAIN_CONFIG.format(cache_dir=pretrained_cache_dir))
  single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
  _check(_main_job(str(config), single, 1, timeout=300))
  multi_run = _main_job(str(config), multi, 2, timeout=300)
  _check(multi_run)
  for pid, (_, output) in enumerate(multi_run):
    assert f"[process {pid}/2]" in output
  # One writer: process 0 wrote results.json, results.md, the records and TensorBoard.
  with open(os.path.join(single, "results.json")) as f:
    want = _stage_figures(json.load(f))
  with open(os.path.join(multi, "results.json")) as f:
    results = json.load(f)
  assert results["status"] == "complete"
  got = _stage_figures(results)
  assert list(got) == list(want) == ["pretrained", "thermal"]
  for name in want:
    w, g = want[name], got[name]
    assert g["train"]["steps"] == w["train"]["steps"]
    assert g["train"]["replayed_images"] == w["train"]["replayed_images"]
    assert g["train"]["replays_in_loss"] == w["train"]["replays_in_loss"]
    if w["train"]["final_loss"] is not None:
      # A loss of O(1-10) whose cross-device sums run through Gloo instead of in-process:
      # float32 reduction-order noise, ~1e-6 relative per step over a few steps.
      np.testing.assert_allclose(g["train"]["final_loss"], w["train"]["final_loss"], rtol=1e-4)
    for eval_set, metrics in w["metrics"].items():
      assert set(g["metrics"][eval_set]) == set(metrics)
      for key, value in metrics.items():
        if value is None:  # NaN in results.json (e.g. APl: no large object)
          assert g["metrics"][eval_set][key] is None, (name, eval_set, key)
          continue
        # AP-type figures are ratios of detection counts on 16 images: parameters that
        # differ by float32 noise leave the ranking of the detections, hence the figures,
        # unchanged up to rare ties; 1e-6 absolute is below the 1 / (101 * 16) grid.
        np.testing.assert_allclose(
          g["metrics"][eval_set][key], value, atol=1e-6, err_msg=f"{name}/{eval_set}/{key}"
        )
  # The retrieval records (replicated retrieval, written by process 0 only): the same histograms
  # of the replayed classes and of SWIL's entropies, which needs the same features of the new
  # images on both layouts.
  for dataset in ("thermal",):
    want_rec = np.load(os.path.join(single, "records", f"{dataset}.npz"))
    got_rec = np.load(os.path.join(multi, "records", f"{dataset}.npz"))
    assert sorted(got_rec.files) == sorted(want_rec.files)
    for key in want_rec.files:
      if want_rec[key].dtype.kind in "iub":
        np.testing.assert_array_equal(got_rec[key], want_rec[key], err_msg=f"{dataset}/{key}")
      else:  # fixed bin edges: computed from constants, equal up to float rounding
        np.testing.assert_allclose(
          got_rec[key], want_rec[key], rtol=1e-4, atol=1e-5, err_msg=f"{dataset}/{key}"
        )
  # Nothing but the writer's outputs: no second results file or temporary left behind.
  assert not [f for f in os.listdir(multi) if f.startswith(".tmp")]

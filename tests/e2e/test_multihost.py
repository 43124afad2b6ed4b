"""Multi-process runs: 2 JAX processes x 4 CPU devices against 1 process x 8 devices.

The processes join one runtime through `jax.distributed.initialize` on a localhost coordinator
(free port) with Gloo CPU collectives; each runs tests/e2e/multihost_worker.py. Subprocesses are
killed on every exit path.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import scipy.optimize

from owl_cl import distributed
from owl_cl import preemption
from owl_cl.detector import DETECTIONS_HOOK_ENV
from owl_cl.eval import coco_eval
from owl_cl.eval import lvis_eval
from owl_cl.testing import detections as synthetic
from owl_cl.testing import devices

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "e2e", "multihost_worker.py")


def _wait_all(procs, timeout: float) -> None:
  """Waits for every process until `timeout` seconds from now have passed in all."""
  deadline = time.monotonic() + timeout
  for proc in procs:
    try:
      proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      break


def _kill_left(procs) -> None:
  """Kills the process group of every process still running (None: never started); its
  returncode becomes None, which the callers report as a timeout."""
  for proc in procs:
    if proc is not None and proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      proc.returncode = None


def _process_env(nproc: int) -> dict:
  """The environment of one of `nproc` processes: CPU only, 8 devices over all of them."""
  return devices.cpu_devices_env(
    8 // nproc,
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    PYTHONUNBUFFERED="1",
  )


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
      env = _process_env(nproc)
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
    _wait_all([proc for _, proc, _ in handles], timeout)
  finally:
    _kill_left(proc for _, proc, _ in handles)
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


@pytest.mark.slow
def test_two_process_run_matches_one_process_run(tmp_path):
  # The 1 x 8 reference and both processes of the 2 x 4 run, side by side (the processes'
  # serial phases, start-up and waits, overlap). One test for every check of their outputs:
  # under `pytest -n 2` a module fixture shared by several tests is built once per worker
  # that runs one of them (70 s of processes each time).
  single_dir, multi_dir = str(tmp_path / "single"), str(tmp_path / "multi")
  os.makedirs(single_dir)
  os.makedirs(multi_dir)
  single_run, multi_run = _spawn([("run", 1, single_dir), ("run", 2, multi_dir)], timeout=400)
  _check(multi_run)
  _check(single_run)
  load = lambda d, pid: dict(np.load(os.path.join(d, f"process{pid}.npz")))
  single, multi = load(single_dir, 0), [load(multi_dir, 0), load(multi_dir, 1)]
  _collectives_across_processes(single, multi)
  _train_step_matches_single_process(single, multi)
  _dataset_shards_cover_once(single, multi)
  _gathered_predictions_equal_single_process(single, multi)
  _replay_slots_are_local(single, multi)
  _host_callback_result_reaches_every_process(single, multi)
  _orbax_stage_checkpoint_roundtrip(single, multi)
  _writer_and_log_prefix(single, multi)
  _shared_scoring_equals_one_pass(single, multi)


def _collectives_across_processes(single, multi):
  for r in [single] + multi:
    assert float(r["psum"]) == 28.0  # sum of 0..7, exact in float32


def _train_step_matches_single_process(single, multi):
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


def _dataset_shards_cover_once(single, multi):
  ids = list(range(1000, 1037))
  assert single["shard"].tolist() == ids
  shards = [r["shard"].tolist() for r in multi]
  assert shards[0] + shards[1] == ids  # disjoint, complete, in order
  assert [len(s) for s in shards] == [19, 18]


def _gathered_predictions_equal_single_process(single, multi):
  assert single["pred_ids"].tolist() == list(range(1000, 1037))
  for r in multi:
    np.testing.assert_array_equal(r["pred_ids"], single["pred_ids"])
    # Per-image values computed on different devices by the same XLA kernels: identical up to
    # the last bit of float32 values of magnitude <= 1.
    np.testing.assert_allclose(r["pred_scores"], single["pred_scores"], rtol=0, atol=1e-6)


def _replay_slots_are_local(single, multi):
  np.testing.assert_array_equal(single["replay_rows"], np.arange(8))
  for pid, r in enumerate(multi):
    np.testing.assert_array_equal(r["replay_rows"], np.arange(4 * pid, 4 * pid + 4))
    # This process gathered exactly the retrieval slots of its rows, and the assembled global
    # batch equals the whole replicated gather (exact: copies of stored values).
    full = single["replay_local_indices"]
    np.testing.assert_array_equal(r["replay_local_indices"], full[4 * pid : 4 * pid + 4])
    np.testing.assert_array_equal(r["replay_global"], r["replay_expected"])
  np.testing.assert_array_equal(single["replay_global"], single["replay_expected"])


def _host_callback_result_reaches_every_process(single, multi):
  # The same values on every device of every process, bit for bit (one callback's result,
  # broadcast), equal to the 1-process run's; checked against the efficiency of the Shapley
  # values: row j sums to U_j = (1/K) * the sum of the utilities of its K = 5 nearest
  # candidates (sums of 40 values of magnitude <= 1: float32 error well below 1e-5).
  for r in [single] + multi:
    np.testing.assert_array_equal(r["knn_values_last_device"], r["knn_values"])
    np.testing.assert_array_equal(r["knn_values"], single["knn_values"])
  d, u = single["knn_distances"], single["knn_utilities"]
  nearest = np.argsort(d, axis=1, kind="stable")[:, :5]
  utility = np.take_along_axis(u, nearest, axis=1).sum(axis=1) / 5
  np.testing.assert_allclose(single["knn_values"].sum(axis=1), utility, atol=1e-5)


def _orbax_stage_checkpoint_roundtrip(single, multi):
  # Both processes save stage 0 into one shared folder and restore it bit for bit.
  assert [bool(r["checkpoint_roundtrip"]) for r in [single] + multi] == [True, True, True]


def _writer_and_log_prefix(single, multi):
  assert bool(single["is_writer"]) and str(single["log_prefix"]) == ""
  assert [bool(r["is_writer"]) for r in multi] == [True, False]
  assert [str(r["log_prefix"]) for r in multi] == ["[process 0/2] ", "[process 1/2] "]


def _shared_scoring_equals_one_pass(single, multi):
  # The worker's `_shared_scoring`: every metric and per-category AP of the processes' shared
  # shards equals one pass in this process, to the bit (the JSON text of floats is exact), and
  # each process scored only its shards: 4 (2 processes x 2 hosts: 2 each), 3 asked for
  # (2 + 1), LVIS's 2 (1 + 1), and none for a set one process scores in one pass. The
  # 1-process run scores the same shards alone: 2, 3 and 2.
  gt, dets = synthetic.coco_set(3, images=30, classes=9, id_step=3, tie_rate=0.2)
  lvis_gt, lvis_dets = synthetic.lvis_set(0)
  one_pass = coco_eval.coco_evaluate(synthetic.as_coco(gt), dets, shards=1)
  want = {
    "coco": coco_eval.coco_evaluate(synthetic.as_coco(gt), dets, per_category=True, shards=1),
    "coco_3_shards": one_pass,
    "lvis": lvis_eval.lvis_evaluate(lvis_gt, lvis_dets, max_dets=20, per_category=True, shards=1),
    "coco_one_pass": one_pass,
  }
  text = lambda value: json.dumps(json.loads(json.dumps(value)), sort_keys=True)
  for r in [single] + multi:
    got = json.loads(str(r["scoring"]))
    for key, value in want.items():
      assert text(got[key]) == text(value), key
  assert json.loads(str(single["scoring"]))["scored"] == [2, 3, 2]
  assert [json.loads(str(r["scoring"]))["scored"] for r in multi] == [[2, 2, 1], [2, 1, 1]]


@pytest.mark.slow
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
  value = {"precision": np.ones((2, 3)), 4: [1, 2]}
  got = distributed.gather_objects(value)
  assert len(got) == 1 and got[0] is value  # the object itself with one process
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


@pytest.mark.slow
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
  # A step checkpoint after each of thermal's 2 steps (results are the same either way).
  c.checkpoint.every_steps = {every_steps!r}
  return c
"""


def _main_jobs(jobs: list[dict], timeout: float) -> list[list[tuple[int, str]]]:
  """Runs `python -m owl_cl.main` jobs side by side. Each job is a dict: config, workdir, nproc
  (NPROC processes of 8 // NPROC CPU devices; NPROC > 1: `--distributed` on a localhost
  coordinator), and optionally kill_at (process index -> its `OWL_CL_TEST_KILL_AT`),
  detections_dir (`OWL_CL_TEST_DETECTIONS_DIR`; both test-only hooks are unset otherwise) and
  log_suffix. Returns, per job, [(exit status, output)] per process; every process is killed
  on any exit path (status None: timed out)."""
  procs = []  # (job index, Popen, log file)
  try:
    for j, job in enumerate(jobs):
      nproc, workdir = job["nproc"], job["workdir"]
      port = str(_free_port())
      env = _process_env(nproc)
      env.pop(preemption.KILL_HOOK_ENV, None)
      env.pop(DETECTIONS_HOOK_ENV, None)
      if job.get("detections_dir"):
        env[DETECTIONS_HOOK_ENV] = job["detections_dir"]
      for pid in range(nproc):
        cmd = [
          sys.executable,
          "-m",
          "owl_cl.main",
          f"--config={job['config']}",
          f"--workdir={workdir}",
        ]
        if nproc > 1:
          cmd += [
            "--distributed",
            f"--coordinator_address=127.0.0.1:{port}",
            f"--num_processes={nproc}",
            f"--process_id={pid}",
          ]
        process_env = dict(env)
        if pid in job.get("kill_at", {}):
          process_env[preemption.KILL_HOOK_ENV] = job["kill_at"][pid]
        log = open(f"{workdir}{job.get('log_suffix', '')}.{pid}.log", "w+")
        procs.append((j, None, log))
        proc = subprocess.Popen(
          cmd,
          env=process_env,
          stdout=log,
          stderr=subprocess.STDOUT,
          cwd=REPO,
          start_new_session=True,  # its own process group: killed as a whole below
        )
        procs[-1] = (j, proc, log)
    _wait_all([proc for _, proc, _ in procs], timeout)
  finally:
    _kill_left(proc for _, proc, _ in procs)
  out = [[] for _ in jobs]
  for j, proc, log in procs:
    log.seek(0)
    out[j].append((proc.returncode, log.read()))
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


def _read_checkpoint_item(path: str) -> dict:
  """An orbax item (a stage checkpoint's 'params' / 'replay_state') as NumPy arrays, read on
  this process's first device whatever mesh saved it."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  checkpointer = ocp.StandardCheckpointer()
  metadata = checkpointer.metadata(path)
  tree = getattr(metadata, "item_metadata", metadata)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
  restored = jax.tree.map(np.asarray, checkpointer.restore(path, like))
  checkpointer.close()
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(restored)}


def _compare_detections(want_dir: str, got_dir: str) -> int:
  """Asserts that every evaluation's detections (`OWL_CL_TEST_DETECTIONS_DIR` files) of one
  run match the other's, image by image. Returns the number of detections compared."""
  names = sorted(os.listdir(want_dir))
  assert names == sorted(os.listdir(got_dir)), (names, os.listdir(got_dir))
  by_image = {}
  for run, folder in (("want", want_dir), ("got", got_dir)):
    for name in names:
      with open(os.path.join(folder, name)) as f:
        for d in json.load(f):
          row = by_image.setdefault((name, run, d["image_id"]), ([], [], []))
          row[0].append(d["bbox"])
          row[1].append(d["score"])
          row[2].append(d["category_id"])
  keys = {run: {(k[0], k[2]) for k in by_image if k[1] == run} for run in ("want", "got")}
  assert keys["got"] == keys["want"]  # the same images of every evaluation
  count = 0
  for (name, run, image_id), (boxes, scores, cats) in sorted(by_image.items()):
    if run != "want":
      continue
    got = by_image.get((name, "got", image_id))
    assert got is not None, f"{name}: no detection of image {image_id}"
    assert len(got[0]) == len(boxes), (name, image_id)
    # One detection per token (top_k 100 >= 64 tokens), in descending score: near-tied scores
    # may swap ranks between the layouts, so detections are paired first (optimal assignment
    # on box distance in pixels, plus score and class differences, which separate tokens whose
    # boxes clip to the same one), then compared.
    want_boxes, got_boxes = np.asarray(boxes), np.asarray(got[0])
    want_scores, got_scores = np.asarray(scores), np.asarray(got[1])
    want_cats, got_cats = np.asarray(cats), np.asarray(got[2])
    cost = (
      np.abs(want_boxes[:, None, :] - got_boxes[None, :, :]).max(axis=-1)
      + 100.0 * np.abs(want_scores[:, None] - got_scores[None, :])
      + 1000.0 * (want_cats[:, None] != got_cats[None, :])
    )
    rows, cols = scipy.optimize.linear_sum_assignment(cost)
    where = f"{name} image {image_id}"
    # Boxes in pixels of images of ~120 px: float32 noise of parameters that agree to ~1e-7
    # moves them by ~1e-5 px.
    np.testing.assert_allclose(got_boxes[cols], want_boxes[rows], rtol=0, atol=1e-3, err_msg=where)
    np.testing.assert_array_equal(got_cats[cols], want_cats[rows], err_msg=where)
    # Scores in [0, 1] (sigmoids): the same noise moves them by ~1e-7.
    np.testing.assert_allclose(
      got_scores[cols], want_scores[rows], rtol=0, atol=1e-5, err_msg=where
    )
    count += len(boxes)
  return count


def _only_store(cache_dir: str) -> str:
  """The one replay store cached under `cache_dir` (its folder)."""
  root = os.path.join(cache_dir, "buffers")
  stores = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
  assert len(stores) == 1, stores  # no build folder or second store left behind
  return os.path.join(root, stores[0])


@pytest.mark.slow
def test_main_job_two_processes_matches_one(tmp_path, pretrained_cache_dir):
  # The whole run (`owl_cl.main`, built-in benchmark, tiny budget: 2 steps on one downstream
  # dataset, the 3 eval sets after both stages) as 1 process x 8 devices and as 2 processes x
  # 4 devices. Each layout has its own cache holding copies of the session's built-in
  # benchmark and pre-trained model only, so each builds its own replay buffer. The 2-process
  # run is killed mid-dataset (process 0 SIGKILLs itself while writing the step checkpoint of
  # thermal's step 2; the coordination service then aborts process 1) and resumed by the
  # same command: it must resume from step 1's checkpoint and end as the 1-process run.
  start = time.monotonic()
  configs = {}
  for name in ("single", "multi"):
    cache = tmp_path / f"cache_{name}"
    for folder in ("builtin", "pretrained"):
      shutil.copytree(os.path.join(pretrained_cache_dir, folder), cache / folder)
    configs[name] = tmp_path / f"{name}.py"
    configs[name].write_text(
      _MAIN_CONFIG.format(
        cache_dir=str(cache),
        # Step checkpoints only where the test kills. Both layouts compile into the session's
        # compilation cache (tiny_config leaves `compilation_cache_dir` empty: JAX takes the
        # folder from the environment, tests/conftest.py), so the resumed 2-process run
        # skips the compilations of the killed one.
        every_steps=1 if name == "multi" else None,
      )
    )
  single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
  detections = {name: str(tmp_path / f"detections_{name}") for name in ("single", "multi")}
  for folder in detections.values():
    os.makedirs(folder)
  # The 1-process run and the killed 2-process run side by side (their serial phases overlap).
  # Killed: 'save' events of this run are thermal's step checkpoints (the pre-trained model
  # comes from the cache); orbax starts the write of step 2 only once step 1's is committed.
  single_run, killed = _main_jobs(
    [
      dict(config=configs["single"], workdir=single, nproc=1, detections_dir=detections["single"]),
      dict(
        config=configs["multi"],
        workdir=multi,
        nproc=2,
        kill_at={0: "save:2"},
        detections_dir=detections["multi"],
      ),
    ],
    timeout=400,
  )
  _check(single_run)
  (rc0, out0), (rc1, out1) = killed
  assert rc0 == -signal.SIGKILL, f"process 0 exited with {rc0}:\n{out0[-4000:]}"
  # Process 1 is ended by JAX's coordination service once the leader is gone (SIGABRT).
  assert rc1 not in (0, None), f"process 1 exited with {rc1}:\n{out1[-4000:]}"
  assert "test hook OWL_CL_TEST_KILL_AT=save:2" in out0
  assert not os.path.exists(os.path.join(multi, "checkpoints", "1"))
  with open(os.path.join(multi, "results.json")) as f:
    assert json.load(f)["status"] == "running"
  first_seconds = time.monotonic() - start

  [resumed] = _main_jobs(
    [
      dict(
        config=configs["multi"],
        workdir=multi,
        nproc=2,
        log_suffix=".resumed",
        detections_dir=detections["multi"],
      )
    ],
    timeout=300,
  )
  _check(resumed)
  for pid, (_, output) in enumerate(resumed):
    assert f"[process {pid}/2]" in output
    # Both processes restore stage 0 and thermal's step 1, and rebuild nothing.
    assert "resuming phase 1 at step 1 (epoch 0, batch 1)" in output, output[-4000:]
    assert "re-using the cached replay buffer" in output, output[-4000:]
  print(
    f"wall seconds: 1-process run and killed 2-process run side by side {first_seconds:.1f}, "
    f"resumed 2-process run {time.monotonic() - start - first_seconds:.1f}"
  )

  # 1. The replay buffer built by 2 processes (each reading its rows of every batch, process 0
  # writing) equals the one built by 1 process.
  want_store, got_store = (
    _only_store(str(tmp_path / "cache_single")),
    _only_store(str(tmp_path / "cache_multi")),
  )
  assert os.path.basename(got_store) == os.path.basename(want_store)  # the same cache key
  assert sorted(os.listdir(got_store)) == sorted(os.listdir(want_store))
  with open(os.path.join(want_store, "meta.json")) as f:
    want_meta = json.load(f)
  with open(os.path.join(got_store, "meta.json")) as f:
    assert json.load(f) == want_meta
  arrays = {}
  for name in sorted(os.listdir(want_store)):
    if name.endswith(".npy"):
      key = name[: -len(".npy")]
      want = np.load(os.path.join(want_store, name))
      got = np.load(os.path.join(got_store, name))
      assert got.dtype == want.dtype and got.shape == want.shape, key
      arrays[key] = (want, got)
  assert len(arrays["examples.image_id"][0]) == 19  # 19 of the 48 pre-training images kept
  exact = ("examples.", "buffer.class_membership")
  for key, (want, got) in arrays.items():
    if key.startswith(exact):
      # The kept images (ids in the same order), their examples and class membership: copies.
      np.testing.assert_array_equal(got, want, err_msg=key)
    elif key == "stored_logits":
      # Logits of magnitude <= ~16 stored as float16: equal up to one float16 rounding step
      # (2^-11 relative) of float32 values that agree to float32 noise.
      assert want.dtype == np.float16
      np.testing.assert_allclose(
        got.astype(np.float32), want.astype(np.float32), rtol=2**-10, atol=0, err_msg=key
      )
    else:
      # Embeddings (|x| <= ~3), prototypes (means over <= 19 images, summed across devices and
      # processes in another order) and their distances (<= 2; +inf where the image is not of
      # the class, compared as equal): float32 reduction noise.
      assert want.dtype == np.float32, key
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)

  # 2. results.json (written by process 0 only): the same stages, replay counters, losses, and
  # metrics (the tiny model's AP is 0 on every set, so these alone prove little).
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

  # 3. Every parameter after thermal (stage 1's orbax checkpoint, saved by both processes) and
  # the replay state. Parameters agree within 1% of the largest change the 2 Adam steps made
  # (Adam turns float32 noise in near-zero gradients, e.g. of the attention keys' biases
  # whose gradient is zero in exact arithmetic, into LR-sized steps).
  before = _read_checkpoint_item(os.path.join(single, "checkpoints", "0", "params"))
  want_params = _read_checkpoint_item(os.path.join(single, "checkpoints", "1", "params"))
  got_params = _read_checkpoint_item(os.path.join(multi, "checkpoints", "1", "params"))
  assert list(got_params) == list(want_params) and len(want_params) > 50
  change = max(float(np.abs(want_params[k] - before[k]).max()) for k in want_params)
  assert change > 1e-5  # training moved the parameters
  for key, value in want_params.items():
    np.testing.assert_allclose(got_params[key], value, rtol=0, atol=0.01 * change, err_msg=key)
  want_state = _read_checkpoint_item(os.path.join(single, "checkpoints", "1", "replay_state"))
  got_state = _read_checkpoint_item(os.path.join(multi, "checkpoints", "1", "replay_state"))
  assert list(got_state) == list(want_state)
  for key, value in want_state.items():
    # Retrieval counters and keys (exact); SWIL's running figures to float32 noise.
    if value.dtype.kind in "iub":
      np.testing.assert_array_equal(got_state[key], value, err_msg=key)
    else:
      np.testing.assert_allclose(got_state[key], value, rtol=1e-5, atol=1e-6, err_msg=key)

  # 4. The detections of every eval set after each stage (3 sets x 16 images x 64 tokens x 2
  # stages; the pre-trained stage's from the killed run, the last stage's from the resumed
  # one), image by image: they depend on every parameter and every eval image, and on the
  # 2-process evaluation gathering each process's rows back in order.
  assert _compare_detections(detections["single"], detections["multi"]) == 6144
  # The check can fail: the 2 steps on thermal move each set's scores by far more than the
  # tolerance (0.03 to 0.14 here against 1e-5).
  for eval_set in ("pretrain_val", "held_out", "thermal"):
    scores = []
    for stage in ("pretrained", "thermal"):
      with open(os.path.join(detections["single"], f"eval_{eval_set}_@_{stage}.json")) as f:
        scores.append(np.sort([d["score"] for d in json.load(f)]))
    assert np.abs(scores[1] - scores[0]).max() > 1e-3, eval_set

  # 5. The retrieval records (replicated retrieval, written by process 0 only): the same
  # histograms of the replayed classes and of SWIL's entropies, which needs the same features
  # of the new images on both layouts.
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
  # Nothing but the writer's outputs: no second results file or temporary left behind, and
  # the stage checkpoint superseded the step checkpoints.
  assert not [f for f in os.listdir(multi) if f.startswith(".tmp")]
  assert os.listdir(os.path.join(multi, "step_checkpoints")) == []

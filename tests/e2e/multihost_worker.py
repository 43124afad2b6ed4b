"""One process of tests/e2e/test_multihost.py: `python multihost_worker.py MODE PORT NPROC PID OUT`.

MODE 'run': the sharded train step, dataset shards, gathered predictions, replay slots, a stage
checkpoint, a host callback and scoring shared by the processes; the outputs go to
OUT/process<PID>.npz. NPROC=1 (no jax.distributed) is the single-process reference. MODE
'fail': process 1 raises inside `fail_fast`, process 0 waits at a barrier. Not a test module
(no test_ prefix): it runs only as a subprocess.
"""

import json
import os
import sys

import numpy as np


def main(mode: str, port: str, nproc: int, pid: int, out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  from owl_cl import distributed  # pylint: disable=g-import-not-at-top

  if nproc > 1:
    spec = distributed.cluster_spec(f"127.0.0.1:{port}", nproc, pid)
    # A short heartbeat timeout makes the failure test quick; the run itself keeps a margin
    # for a machine busy with other tests (heartbeats are sent by a background thread).
    heartbeat = 5 if mode == "fail" else 60
    distributed.initialize(spec, initialization_timeout_s=120, heartbeat_timeout_s=heartbeat)
  distributed.install_log_prefix()
  if mode == "fail":
    return fail(pid)
  with distributed.fail_fast():
    run(jax, distributed, pid, out)


def fail(pid: int) -> None:
  from owl_cl import distributed  # pylint: disable=g-import-not-at-top

  with distributed.fail_fast():
    if pid == 1:
      raise RuntimeError("injected failure")
    distributed.barrier("after-injected-failure", timeout_s=60)
  print("process 0 passed the barrier (unexpected)", flush=True)


def run(jax, distributed, pid: int, out: str) -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from owl_cl import model as model_lib  # pylint: disable=g-import-not-at-top
  from owl_cl.testing.batches import detection_batch
  from owl_cl.train import optim  # pylint: disable=g-import-not-at-top
  from owl_cl.train import sharding
  from owl_cl.train import step as step_lib
  from owl_cl.train.spec import LossSpec

  assert jax.device_count() == 8, jax.devices()
  mesh = sharding.create_mesh()
  result = {}

  # 1. Collectives across processes: a global array and a jitted sum / all-gather.
  try:
    x = sharding.shard_batch(
      {"x": np.arange(8, dtype=np.float32)[sharding.process_rows(8, mesh)]}, mesh
    )["x"]
    total = jax.jit(jnp.sum, out_shardings=sharding.replicated(mesh))(x)
    result["psum"] = np.asarray(total.addressable_data(0))
  except Exception as e:  # reported to the test, which skips with it
    print(f"COLLECTIVES_UNAVAILABLE: {type(e).__name__}: {e}", flush=True)
    raise

  # 2. The sharded train step (as tests/train/test_sharded_step.py): every process builds the
  # same global batch from the same seed and passes only its rows.
  model = model_lib.create_model(
    "tiny", vision_layers=1, text_layers=1, vocab_size=64, image_size=32
  )
  rng = np.random.default_rng(0)
  B, Q, M, L = 8, 4, 3, 16
  T = (32 // 8) ** 2

  batch = lambda: detection_batch(rng, B, num_queries=Q, max_boxes=M, query_length=L)

  new, replay = batch(), batch()
  replay["stored_logits"] = rng.normal(size=(B, T, Q)).astype(np.float32)
  replay["replay_mask"] = np.array([True] * 7 + [False])
  params = jax.jit(model.init)(
    jax.random.PRNGKey(0), jnp.asarray(new["images"][:1]), jnp.asarray(new["queries"][:1])
  )["params"]
  params = jax.device_get(params)
  tx, _ = optim.create_optimizer(params, learning_rate=1e-3, total_steps=10, warmup_steps=0)
  train_step = step_lib.make_train_step(
    model,
    tx,
    mesh,
    step_lib.StepSpec(LossSpec(focal_alpha=0.3, focal_gamma=2.0), step_lib.ReplayLoss()),
  )
  state = sharding.replicate(step_lib.create_train_state(params, tx), mesh)
  for i in range(2):
    state, metrics = train_step(
      state,
      sharding.shard_batch(sharding.local_rows(new, mesh), mesh),
      sharding.shard_batch(sharding.local_rows(replay, mesh), mesh),
      jax.random.PRNGKey(i),
    )
  # Parameters and metrics are replicated: every process holds a full copy.
  for k, v in sharding.fetch_replicated(metrics).items():
    result[f"metric/{k}"] = v
  for j, leaf in enumerate(jax.tree.leaves(sharding.fetch_replicated(state.params))):
    result[f"param/{j}"] = leaf

  # 3. Dataset shards: this process's block of an eval set's image ids (37: uneven).
  ids = list(range(1000, 1037))
  shard = distributed.process_shard(ids)
  result["shard"] = np.asarray(shard)

  # 4. Eval predictions: a jitted per-image function over global batches of 8 built from each
  # process's shard (padded to a common number of batches), this process's output rows kept,
  # then gathered from every process.
  local_bs = 8 * jax.local_device_count() // jax.device_count()
  longest = -(-len(ids) // jax.process_count())
  w = np.linspace(-1, 1, 3 * 5, dtype=np.float32).reshape(3, 5)
  predict = jax.jit(lambda im: jnp.tanh(im.mean(axis=(1, 2)) @ w))
  preds, kept = [], []
  for start in range(0, longest, local_bs):
    chunk = shard[start : start + local_bs]
    images = np.zeros((local_bs, 4, 4, 3), np.float32)
    for r, image_id in enumerate(chunk):
      images[r] = np.random.default_rng(image_id).uniform(size=(4, 4, 3))
    outputs = predict(sharding.shard_batch({"images": images}, mesh)["images"])
    preds.append(sharding.host_local_rows(outputs)[: len(chunk)])
    kept.append(np.asarray(chunk, np.int64))
  gathered = distributed.gather_rows(
    {"image_id": np.concatenate(kept), "scores": np.concatenate(preds)}
  )
  result["pred_ids"] = gathered["image_id"]
  result["pred_scores"] = gathered["scores"]

  # 5. Replay: replicated retrieval indices into a host-side store; this process gathers only
  # the slots that land on its devices, and the assembled global batch is the full gather.
  store = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
  indices = np.random.default_rng(7).integers(0, 50, 8)
  local_indices = sharding.local_rows(indices, mesh)
  slots = sharding.shard_batch({"x": store[local_indices]}, mesh)["x"]
  everything = jax.jit(lambda a: a, out_shardings=sharding.replicated(mesh))(slots)
  result["replay_local_indices"] = local_indices
  result["replay_rows"] = np.arange(8)[sharding.process_rows(8, mesh)]
  result["replay_global"] = np.asarray(everything.addressable_data(0))
  result["replay_expected"] = store[indices]
  # 6. Orbax stage checkpoint in a folder both processes see (a shared workdir): every process
  # saves and restores the replicated parameters (orbax coordinates the processes).
  from owl_cl.train import checkpointing  # pylint: disable=g-import-not-at-top

  ckpt = checkpointing.StageCheckpointer(os.path.join(out, "checkpoints"))
  ckpt.save(0, state.params, None, {"stage": 0})
  restored, _, meta = ckpt.restore(0, state.params, None)
  ckpt.close()
  same = jax.tree.map(
    lambda a, b: bool(np.array_equal(a, b)),
    sharding.fetch_replicated(restored),
    sharding.fetch_replicated(state.params),
  )
  result["checkpoint_roundtrip"] = np.asarray(all(jax.tree.leaves(same)) and meta == {"stage": 0})
  # 7. A host callback in a replicated computation: `knn_shapley` sorts through NumPy on CPU
  # (`jax.pure_callback`), which runs once, on the first device, in process 0; every device of
  # every process must receive its result.
  from owl_cl.replay.retrieval import knn_shapley  # pylint: disable=g-import-not-at-top

  knn_rng = np.random.default_rng(11)
  distances = knn_rng.random((12, 40), dtype=np.float32)
  utilities = knn_rng.uniform(-1, 1, (12, 40)).astype(np.float32)
  values = jax.jit(
    lambda d, u: knn_shapley.knn_shapley(d, u, 5), out_shardings=sharding.replicated(mesh)
  )(sharding.replicate(distances, mesh), sharding.replicate(utilities, mesh))
  result["knn_distances"], result["knn_utilities"] = distances, utilities
  result["knn_values"] = np.asarray(values.addressable_data(0))
  result["knn_values_last_device"] = np.asarray(values.addressable_data(-1))
  result["scoring"] = np.asarray(json.dumps(_shared_scoring()))
  result["is_writer"] = np.asarray(distributed.is_writer())
  result["log_prefix"] = np.asarray(distributed.log_prefix())
  distributed.barrier("worker-done", timeout_s=120)
  np.savez(os.path.join(out, f"process{pid}.npz"), **result)
  print(json.dumps({"process": pid, "done": True}), flush=True)


def _shared_scoring() -> dict:
  """8. COCO and LVIS AP scored in category shards shared by the processes (`peers`):
  every process holds the same detections, scores every P-th shard in a spawned worker and
  receives the others' arrays. Returns the metrics and how many shards this process scored."""
  from owl_cl.eval import category_shards  # pylint: disable=g-import-not-at-top
  from owl_cl.eval import coco_eval
  from owl_cl.eval import lvis_eval
  from owl_cl.eval import peers as peers_lib
  from owl_cl.testing import detections as synthetic

  scored = []
  run_here = category_shards._run_here  # pylint: disable=protected-access

  def counting(fn, payloads, *args):
    scored.append(len(payloads))
    return run_here(fn, payloads, *args)

  category_shards._run_here = counting  # pylint: disable=protected-access
  try:
    gt, dets = synthetic.coco_set(3, images=30, classes=9, id_step=3, tie_rate=0.2)
    coco_gt = synthetic.as_coco(gt)
    out = {
      # processes x hosts shards (2 x 2), then 3 asked for (2 + 1).
      "coco": coco_eval.coco_evaluate(
        coco_gt, dets, per_category=True, processes=2, peers=peers_lib.jax_peers()
      ),
      "coco_3_shards": coco_eval.coco_evaluate(
        coco_gt, dets, shards=3, peers=peers_lib.jax_peers()
      ),
    }
    lvis_gt, lvis_dets = synthetic.lvis_set(0)
    out["lvis"] = lvis_eval.lvis_evaluate(
      lvis_gt, lvis_dets, max_dets=20, per_category=True, shards=2, peers=peers_lib.jax_peers()
    )
    # A set one process scores in one pass: scored so on every process, nothing spawned.
    out["coco_one_pass"] = coco_eval.coco_evaluate(coco_gt, dets, peers=peers_lib.jax_peers())
  finally:
    category_shards._run_here = run_here  # pylint: disable=protected-access
  return {**out, "scored": scored}


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

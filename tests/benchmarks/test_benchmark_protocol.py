"""Issue 48's protocol benchmarks: the ':rehearsal' preset, benchmarks/protocol_gpu.py's
per-phase rows, benchmarks/protocol_host.py's parts and the prepared GPU session's smoke run."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest

from owl_cl.configs import base

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
  spec = importlib.util.spec_from_file_location(
    f"benchmark_{name}", os.path.join(_ROOT, "benchmarks", f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


protocol_gpu = _load("protocol_gpu")
protocol_host = _load("protocol_host")


def test_rehearsal_is_the_paper_step_on_the_builtin_benchmark():
  c = base.get_config("rehearsal")
  paper = base.get_config("paper")
  # The paper's model and step (configs/base.py apply_paper_protocol) ...
  for field in ("variant", "dtype", "remat"):
    assert c.model[field] == paper.model[field]
  for field in ("num_queries", "max_instances", "eval_batch_size"):
    assert c.data[field] == paper.data[field]
  assert (c.train.batch_size, c.replay.ratio) == (16, 1.0)  # 16 + 16 images per step
  assert c.model.overrides.to_dict() == {}  # L/14's own context length, not the tiny one's 8
  # ... on the built-in benchmark (no data.root, no download), 2 datasets of 1 epoch each.
  assert c.data.root is None and c.data.builtin.downstream == ("thermal", "clutter")
  assert c.train.num_epochs == 1 and c.replay.image_cache is None
  assert {k: c.data.builtin[k] for k in base.REHEARSAL_SIZES} == base.REHEARSAL_SIZES
  # Every other argument is left as it was.
  assert base.get_config("").model.variant == "tiny"


def test_synthetic_detections_score_as_their_construction_says():
  # Independent check of the scoring part's inputs: the ground truth given back as detections
  # scores AP 1 with pycocotools; the part's jittered copies + random boxes score below it.
  from pycocotools import coco as pycoco

  from owl_cl.eval import coco_eval

  rng = protocol_host.np.random.default_rng(0)
  gt, detections = protocol_host.synthetic_eval("o365_val", 12, 5, 20, rng)
  assert len(detections) == 12 * 20  # `dets` per image
  ground = pycoco.COCO()
  ground.dataset = gt
  ground.createIndex()
  perfect = [
    {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
    for a in gt["annotations"]
  ]
  assert coco_eval.coco_evaluate(ground, perfect)["AP"] == pytest.approx(1.0)
  assert 0.0 < coco_eval.coco_evaluate(ground, detections, max_dets=20)["AP"] < 1.0


def test_protocol_rows_join_the_records_with_the_step_timings():
  config = base.get_config("rehearsal")
  records = [
    {"kind": "buffer", "name": "buffer build", "wall_s": 20.0, "compile_s": 5.0, "scoring_s": 0},
    {"kind": "train", "name": "train thermal", "wall_s": 90.0, "compile_s": 70.0, "scoring_s": 0},
    {
      "kind": "eval",
      "name": "eval thermal @ thermal",
      "wall_s": 10.0,
      "compile_s": 4.0,
      "scoring_s": 2.5,
      "images": 250,
    },
  ]
  timings = {
    "thermal": {
      "steps": 19,
      "mean": {"step_seconds": 1.25, "input": 0.05},
      "median": {"step_seconds": 1.2},
      "host_idle_fraction": 0.08,
    }
  }
  rows = protocol_gpu.summarize(records, {"timings": {"step_timings": timings}}, config)
  buffer, train, evaluation = rows
  # The pool: 1,000 images in 20 s.
  assert buffer["images"] == 1000 and buffer["images_per_s"] == pytest.approx(50.0)
  # 16 + 16 images per 1.2 s median step; the input wait is 0.05 / 1.25 of the mean step.
  assert train["images_per_s"] == pytest.approx(32 / 1.2)
  assert train["input_fraction"] == pytest.approx(0.04)
  assert train["host_idle_fraction"] == 0.08 and train["steps"] == 19
  # Evaluation: 250 images in 10 s, of which 2.5 s scoring and 7.5 s the rest.
  assert evaluation["images_per_s"] == pytest.approx(25.0)
  assert evaluation["model_s"] == pytest.approx(7.5)
  table = protocol_gpu.render(
    {
      "mode": "test",
      "device": {"device_kind": "cpu", "device_count": 1, "nvidia_smi": "not a GPU"},
      "date": "d",
      "commit": "c",
      "main_argv": ["--config=configs/swil.py:rehearsal"],
      "exit_status": 0,
      "run_wall_s": 130.0,
      "init_checkpoint": {"write_s": 1.0, "bytes": 2e9},
      "phases": rows,
    }
  )
  assert "| train thermal | 90.0 | 70.0 |" in table and "| 8.0% / 4.0% |" in table


HOST_RESULTS = os.path.join(_ROOT, "benchmarks", "results")


def test_protocol_host_combine_keeps_each_record_and_names_a_part_without_one(tmp_path):
  with open(os.path.join(HOST_RESULTS, "protocol_host", "buffer", "protocol_host.json")) as f:
    record = json.load(f)
  (tmp_path / "buffer").mkdir()
  (tmp_path / "buffer" / "protocol_host.json").write_text(json.dumps(record))
  (tmp_path / "killed").mkdir()
  (tmp_path / "killed" / "killed_out_of_memory.txt").write_text("oom")
  (tmp_path / "notes.txt").write_text("not a part")
  combined = protocol_host.combine(str(tmp_path))
  assert combined["records"] == {"buffer": record}  # unchanged
  assert combined["without_record"] == {"killed": ["killed_out_of_memory.txt"]}
  page = protocol_host.render_combined(combined)
  commit = record["code"]["commit"][:10]
  assert f"| buffer | buffer | 2 logical CPUs, {record['cpu']} | 1.04 / 1.16 |" in page
  assert f"| {commit} |" in page and "| killed | no record: killed_out_of_memory.txt |" in page
  # The record's own page, one level down: its title is the folder's heading.
  assert "\n## buffer\n" in page and "\n### Buffer build\n" in page
  assert "The protocol's host side (full)" not in page
  (tmp_path / "buffer" / "protocol_host.json").unlink()
  (tmp_path / "killed" / "killed_out_of_memory.txt").unlink()
  with pytest.raises(FileNotFoundError, match="no subfolder holds a protocol_host.json"):
    protocol_host.combine(str(tmp_path))


def test_committed_protocol_host_is_the_combined_records(tmp_path):
  # benchmarks/results/protocol_host.{json,md} is `--combine` of the committed part folders.
  protocol_host.main(
    ["--combine", os.path.join(HOST_RESULTS, "protocol_host"), f"--out={tmp_path}"]
  )
  for name in ("protocol_host.json", "protocol_host.md"):
    with open(os.path.join(HOST_RESULTS, name)) as f:
      assert (tmp_path / name).read_text() == f.read(), name


def test_committed_shard_records_equal_their_one_pass_records():
  # The measured sharded rows of docs/benchmarks.md ("Scoring in category shards") score the
  # same synthetic sets as their one-pass rows, each in its own process: every statistic is
  # the same float, and the rows were scored as their folders say.
  def row(folder):
    with open(os.path.join(HOST_RESULTS, "protocol_host", folder, "protocol_host.json")) as f:
      record = json.load(f)
    assert not record["code"]["dirty"] and len(record["code"]["commit"]) == 40
    (name,) = [k for k in record["parts"]["scoring"] if k != "peak_rss_gb"]
    return record["parts"]["scoring"][name]

  for one_pass, sharded in [
    ("scoring_lvis_10000_one_pass", "scoring_lvis_10000_1_process_shards"),
    ("scoring_lvis_10000_one_pass", "scoring_lvis_10000_2_processes"),
    (
      "scoring_o365_20000_faster_coco_eval_one_pass",
      "scoring_o365_20000_faster_coco_eval_2_processes",
    ),
  ]:
    want, got = row(one_pass), row(sharded)
    assert (want["processes"], want["shards"]) == (1, 1) and got["shards"] > 1
    assert got["metrics"] == want["metrics"] and got["detections"] == want["detections"]


@pytest.mark.slow
def test_protocol_host_smoke(tmp_path):
  report = protocol_host.main(
    ["--smoke", f"--out={tmp_path}", "--parts=input,scoring,checkpoint", f"--tmp={tmp_path}"]
  )
  sizes = protocol_host.SMOKE
  parts = report["parts"]
  for label in ("paper preset (no augmentation)", "scenic augmentations"):
    row = parts["input"][label]
    assert row["images"] == sizes.input_batches * sizes.batch_size and row["images_per_s"] > 0
  for name, images, _, dets, protocol in sizes.eval_sets:
    row = parts["scoring"][name]
    assert (row["protocol"], row["detections"]) == (protocol, images * dets)
    assert 0.0 <= row["AP"] <= 1.0
  state = parts["checkpoint"]["train_state"]
  # Parameters + two Adam moments: 12 bytes per parameter in float32. Orbax's compression can
  # shrink N(0, 1) draws only in their sign and exponent bits: their 23 random mantissa bits
  # (72% of each value) stay, and the whole is more than the moments alone (8 bytes).
  assert 0.72 * 12 * state["parameters"] <= state["bytes"] <= 12 * state["parameters"] + 1e6
  store = parts["checkpoint"]["buffer_store"]
  assert store["bytes"] == sizes.buffer_images * store["bytes_per_image"]
  assert json.loads((tmp_path / "protocol_host_smoke.json").read_text())["mode"] == "smoke"
  assert os.listdir(tmp_path) == sorted(["protocol_host_smoke.json", "protocol_host_smoke.md"])


@pytest.mark.slow
def test_gpu_session_smoke(tmp_path):
  # The prepared session at its smoke size on CPU, its rehearsal part (PARTS): it ends on its
  # own, writes its own folder, and the rehearsal ran the main job through every phase.
  out = tmp_path / "out"
  # The script runs `python3`: this interpreter's, also where pytest runs without the venv's
  # bin on PATH.
  path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
  env = dict(os.environ, OUT=str(out), PARTS="rehearsal", PATH=path)  # HF: test_benchmark_step
  script = os.path.join(_ROOT, "benchmarks", "gpu_session.sh")
  subprocess.run([script, "--smoke"], check=True, env=env, timeout=1800, capture_output=True)
  session = (out / "session.txt").read_text()
  lines = [line.split()[:3] for line in session.splitlines() if " exit " in line]
  assert lines == [["rehearsal", "exit", "0"]]
  for name in ("hf_model", "hf_step", "remat_block", "remat_selective", "retrieval", "owlv2"):
    assert f"{name} not in PARTS" in session, name
  assert '"device_kind": "cpu"' in session  # the device record comes first
  # At most 8 files come back from the device machine: one archive per part and session.txt.
  files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
  assert files == ["rehearsal.tgz", "session.txt"]
  with tarfile.open(out / "rehearsal.tgz") as archive:
    assert sorted(archive.getnames()) == [
      "rehearsal",
      "rehearsal/log.txt",
      "rehearsal/protocol_gpu_smoke.json",
    ]
    raw = archive.extractfile("rehearsal/protocol_gpu_smoke.json").read()
  rehearsal = json.loads(raw)
  assert rehearsal["exit_status"] == 0
  kinds = [r["kind"] for r in rehearsal["phases"]]
  for kind in ("init", "buffer", "eval", "train", "stage_checkpoint", "step_checkpoint"):
    assert kind in kinds, kind
  assert kinds.count("train") == 2  # the two downstream datasets
  for r in rehearsal["phases"]:
    if r["kind"] == "train":
      assert r["images_per_s"] > 0 and 0 <= r["host_idle_fraction"] <= 1
    if r["kind"].endswith("checkpoint"):
      assert r["restore_s"] > 0 and r["bytes"] > 0


def test_step_sides_of_the_like_for_like_parts():
  # The GPU session's two HF parts: the model alone (no full-step sides) and the full step
  # alone (no model-only sides); both flags together leave nothing and are refused.
  step = _load("step")
  model_only = step.parse_args(["--smoke", "--skip-step"])
  assert step.timed_sides(model_only) == ["ours_model", "hf_model"]
  full = step.parse_args(["--smoke", "--skip-model-only", "--matchers=jax"])
  assert step.timed_sides(full) == ["ours_step:jax", "hf_step"]
  with pytest.raises(ValueError, match="leave nothing to time"):
    step.timed_sides(step.parse_args(["--smoke", "--skip-step", "--skip-model-only"]))


@pytest.mark.slow
def test_scoring_hosts_smoke_shares_the_shards_with_the_same_metrics(tmp_path):
  # benchmarks/scoring_hosts.py --smoke: 2 JAX processes per side on a localhost coordinator;
  # the script itself fails when a metric differs between the sides or the processes.
  subprocess.run(
    [sys.executable, os.path.join(_ROOT, "benchmarks", "scoring_hosts.py"), "--smoke"]
    + [f"--out={tmp_path}"],
    check=True,
    timeout=300,
  )
  with open(tmp_path / "scoring_hosts_smoke.json") as f:
    report = json.load(f)
  assert report["metrics_equal"] and 0 < report["AP"] < 1
  # 2 workers per process: 2 shards scored whole by each process, 2 x 2 shared.
  assert [report["sides"][s]["shards"] for s in ("each_scores_all", "shared")] == [2, 4]
  assert all(len(report["sides"][s]["seconds"]) == 2 for s in report["sides"])

"""benchmarks/gpu_report.py: each goal of issue 48 item 4 read off a session's raw outputs,
on a hand-built session whose figures are worked out below."""

import importlib.util
import io
import json
import os
import sys
import tarfile

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
  "benchmark_gpu_report", os.path.join(_ROOT, "benchmarks", "gpu_report.py")
)
gpu_report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_report
_spec.loader.exec_module(gpu_report)

_DEVICE = {"device_kind": "NVIDIA H200", "spec_peak_bf16_flops": 989.4e12}


def _step(side, step_s, batch=32, **fields):
  return {"side": side, "batch": batch, "step_s": step_s, "images_per_s": batch / step_s, **fields}


def _archive(folder, part, name, result):
  # As gpu_session.sh packs a part: <part>.tgz holding <part>/<name> (and its log).
  data = json.dumps(result).encode()
  with tarfile.open(folder / f"{part}.tgz", "w:gz") as tar:
    for member, payload in ((f"{part}/{name}", data), (f"{part}/log.txt", b"log")):
      info = tarfile.TarInfo(member)
      info.size = len(payload)
      tar.addfile(info, io.BytesIO(payload))


def _timing(rows, ratios=()):
  return {"timing": {"device": _DEVICE, "rows": rows, "ratios": list(ratios)}}


def _session(folder, hf_remat="none"):
  block = _step("ours_step:jax", 1.0, remat="block", mfu=0.38, peak_bytes=20e9)
  selective = _step("ours_step:jax", 0.9, remat="dots_saveable", mfu=0.42, peak_bytes=30e9)
  _archive(folder, "remat_block", "step.json", _timing([block]))
  _archive(folder, "remat_selective", "step.json", _timing([selective]))
  model_rows = [
    _step("ours_model", 0.5, 8, remat="none"),
    _step("hf_model", 0.65, 8, remat=hf_remat),
  ]
  _archive(folder, "hf_model", "step.json", _timing(model_rows, [{"batch": 8, "model_only": 1.3}]))
  step_ratio = {"batch": 8, "full_step": 1.1, "full_step_ours": "ours_step:jax"}
  _archive(folder, "hf_step", "step.json", _timing([], [step_ratio]))
  owlv2 = _step("ours_step:jax", 2.0, remat="block", mfu=0.31, peak_bytes=38e9)
  _archive(folder, "owlv2", "step.json", dict(_timing([owlv2]), arithmetic={"image_size": 1008}))
  rows = [
    {"kind": "algorithm", "name": "uniform", "jax_s": {"median_s": 0.001}},
    {"kind": "algorithm", "name": "aser_pc", "jax_s": {"median_s": 0.012}},
    {"kind": "build", "name": "class_index", "jax_s": {"median_s": 3.0}},
  ]
  small = {"sizes": {"num_images": 54226}, "rows": [dict(rows[1], jax_s={"median_s": 0.5})]}
  retrieval = {"runs": [small, {"sizes": {"num_images": 1_000_000}, "rows": rows}]}
  _archive(folder, "retrieval", "retrieval.json", retrieval)


def test_goals_from_a_hand_built_session(tmp_path):
  _session(tmp_path)
  result = gpu_report.main([str(tmp_path)])
  goals = {g["goal"].split(" ")[0] + g["goal"].split(" ")[1]: g for g in result["goals"]}
  assert result["device_kind"] == "NVIDIA H200"
  # MFU: the better of the two remat parts, 42% (>= 40%, < 45%).
  assert goals["MFUat"]["verdict"] == "met"
  assert goals["MFUat"]["figure"].startswith("42.0% (remat dots_saveable, 35.56 images/s")
  assert goals["MFUat"]["source"] == "remat_selective.tgz:remat_selective/step.json"
  # Selective against block: (32 / 0.9) / (32 / 1.0) = 1.111x images/s, 30 GB against 20.
  assert goals["selectiveremat"]["figure"] == (
    "dots_saveable: 1.111x block's images/s, peak 30.00 GB against 20.00 GB"
  )
  assert goals["modelalone"]["verdict"] == "met (ambitious too)"  # 1.3 >= 1.25
  assert goals["fullstep"]["verdict"] == "not met"  # 1.1 < 1.2
  assert goals["OWLv2L/14"]["verdict"] == "met"  # 38 GB < 40, 31% >= 30%
  assert goals["OWLv2L/14"]["figure"] == "38.00 GB, 31.0% MFU (batch 32, 1008 px)"
  # The slowest algorithm at 1M (the 54k run's 0.5 s is not read): 12 ms of the fastest
  # 16 + 16 step, 0.9 s: 1.33% >= 1%.
  assert goals["slowestretrieval"]["verdict"] == "not met"
  assert goals["slowestretrieval"]["figure"].startswith("aser_pc: 12.00 ms, 1.33% of the 0.900 s")
  page = (tmp_path / "report.md").read_text()
  assert page.count("| met") == 3 and page.count("| not met") == 2
  assert json.loads((tmp_path / "report.json").read_text()) == result


def test_a_remat_side_or_a_missing_part_is_not_measured(tmp_path):
  # HF's side with gradient checkpointing on is no like-for-like model-alone ratio; the
  # retrieval part missing (killed before it wrote) leaves its goal unmeasured.
  _session(tmp_path, hf_remat="block")
  (tmp_path / "retrieval.tgz").unlink()
  goals = {g["goal"][:12]: g for g in gpu_report.report(str(tmp_path))["goals"]}
  assert goals["model alone "]["verdict"] == "not measured"
  assert "remat not none on both sides" in goals["model alone "]["figure"]
  assert goals["slowest retr"]["verdict"] == "not measured"
  assert goals["MFU at 16 + "]["verdict"] == "met"  # the rest is still read

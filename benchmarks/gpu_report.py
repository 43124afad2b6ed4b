"""Reads one prepared GPU session's raw outputs and states each goal of issue 48 item 4.

`benchmarks/gpu_session.sh` leaves in its $OUT folder `session.txt` and one archive per part
(`<part>.tgz`, holding `<part>/` with the part's JSON and log; an unpacked `<part>/` folder is
read too). This script writes a Markdown page (and its JSON) that gives, per goal, met / not
met / not measured with the figure and the raw file it comes from:

* MFU of our 16 + 16 step (L/14 at 840 px) against the device's spec bf16 peak: at least 40%
  (ambitious 45%), the better of `remat_block` and `remat_selective`;
* the model alone (forward + backward, no remat on either side, the same batch): at least
  1.1x HF's images/s (ambitious 1.25x), `hf_model`;
* the full step: at least 1.2x HF's, `hf_step`;
* OWLv2 L/14 at 1008 px, 16 + 16: under 40 GB peak at 30% MFU or better, `owlv2`;
* the slowest registered retrieval algorithm at N = 1M buffer images: under 1% of the
  fastest 16 + 16 step measured in the same session, `retrieval`;

and, beside them, the selective remat policy against block remat (images/s, peak memory).
The goals hold "on an H100/H200": the device kind is stated, and a part run on another device
(the CPU smoke) gives its figures with "not measured" where the goal needs a spec peak.

Usage:
  python benchmarks/gpu_report.py SESSION_FOLDER [--out PAGE.md]   (default SESSION/report.md)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tarfile
from typing import Any

GB = 1e9
#: (goal, threshold, ambitious threshold): the figures of issue 48 item 4.
MFU_16 = (0.40, 0.45)
MODEL_ALONE = (1.1, 1.25)
FULL_STEP = (1.2, None)
OWLV2_GB, OWLV2_MFU = 40.0, 0.30
RETRIEVAL_SHARE = 0.01
MILLION = 1_000_000


def read_part(session: str, part: str) -> tuple[dict | None, str | None]:
  """(the part's JSON result, its path inside the session) or (None, None) when absent.

  The result is the part folder's one `*.json` (step.py's `step[_smoke].json`,
  retrieval.py's `retrieval[_smoke].json`), from `<part>.tgz` or an unpacked `<part>/`."""
  archive = os.path.join(session, f"{part}.tgz")
  if os.path.exists(archive):
    with tarfile.open(archive) as tar:
      names = sorted(n for n in tar.getnames() if n.endswith(".json"))
      if names:
        return json.loads(tar.extractfile(names[0]).read()), f"{part}.tgz:{names[0]}"
    return None, None
  names = sorted(glob.glob(os.path.join(session, part, "*.json")))
  if not names:
    return None, None
  with open(names[0]) as f:
    return json.load(f), os.path.relpath(names[0], session)


def _rows(result: dict | None, prefix: str) -> list[dict]:
  rows = ((result or {}).get("timing") or {}).get("rows") or []
  return [r for r in rows if r["side"].startswith(prefix) and "error" not in r]


def _verdict(value: float | None, goal: float, ambitious: float | None, above: bool) -> str:
  if value is None:
    return "not measured"
  met = value >= goal if above else value < goal
  if not met:
    return "not met"
  if ambitious is not None and value >= ambitious:
    return "met (ambitious too)"
  return "met"


def _goal(name: str, verdict: str, figure: str, source: str | None) -> dict[str, Any]:
  return {"goal": name, "verdict": verdict, "figure": figure, "source": source or "-"}


def step_goals(parts: dict) -> tuple[list[dict], dict | None]:
  """The MFU goal and the selective-vs-block line; returns them and the fastest step row."""
  steps = []
  for part in ("remat_block", "remat_selective"):
    result, path = parts[part]
    for row in _rows(result, "ours_step"):
      steps.append((row, path))
  goals = []
  # The goal is at 16 + 16 (32 images per step): a smoke's tiny batch does not count.
  with_mfu = [(r, p) for r, p in steps if "mfu" in r and r["batch"] == 32]
  best = max(with_mfu, key=lambda rp: rp[0]["mfu"], default=(None, None))
  row, path = best
  goals.append(
    _goal(
      f"MFU at 16 + 16 >= {MFU_16[0]:.0%} (ambitious {MFU_16[1]:.0%})",
      _verdict(row and row["mfu"], *MFU_16, above=True),
      f"{row['mfu']:.1%} (remat {row['remat']}, {row['images_per_s']:.2f} images/s, batch "
      f"{row['batch']})"
      if row
      else "no MFU: no 16 + 16 step timed against a spec peak",
      path,
    )
  )
  by_remat = {r["remat"]: (r, p) for r, p in steps}
  block = by_remat.pop("block", (None, None))[0]
  other = next(iter(by_remat.values()), (None, None))[0]
  if block and other:
    figure = (
      f"{other['remat']}: {other['images_per_s'] / block['images_per_s']:.3f}x block's "
      f"images/s, peak {_gb(other)} against {_gb(block)}"
    )
  else:
    figure = "needs both remat parts"
  goals.append(_goal("selective remat against block (no threshold)", "-", figure, None))
  fastest = min(steps, key=lambda rp: rp[0]["step_s"], default=(None, None))[0]
  return goals, fastest


def _gb(row: dict) -> str:
  b = row.get("peak_bytes")
  return "-" if b is None else f"{b / GB:.2f} GB"


def hf_goals(parts: dict) -> list[dict]:
  """The two like-for-like ratios (HF step time / ours), each side in its own process."""
  goals = []
  result, path = parts["hf_model"]
  ratio = next((r for r in ((result or {}).get("timing") or {}).get("ratios", [])), {})
  sides = {r["side"]: r for r in _rows(result, "")}
  remats = {s: sides[s].get("remat") for s in ("ours_model", "hf_model") if s in sides}
  value = ratio.get("model_only")
  if value is None:
    note = "not timed"
  elif set(remats.values()) != {"none"}:
    value, note = None, f"remat not none on both sides: {remats}"
  else:
    note = f"batch {ratio.get('batch')}, remat {remats}"
  goals.append(
    _goal(
      f"model alone >= {MODEL_ALONE[0]}x HF's images/s (ambitious {MODEL_ALONE[1]}x)",
      _verdict(value, *MODEL_ALONE, above=True),
      f"{value:.2f}x ({note})" if value is not None else note,
      path,
    )
  )
  result, path = parts["hf_step"]
  ratio = next((r for r in ((result or {}).get("timing") or {}).get("ratios", [])), {})
  value = ratio.get("full_step")
  goals.append(
    _goal(
      f"full step >= {FULL_STEP[0]}x HF's",
      _verdict(value, *FULL_STEP, above=True),
      f"{value:.2f}x (batch {ratio.get('batch')}, ours {ratio.get('full_step_ours')})"
      if value is not None
      else "not timed",
      path,
    )
  )
  return goals


def owlv2_goal(parts: dict) -> dict:
  """OWLv2 L/14 at 1008 px, 16 + 16: under 40 GB peak and at 30% MFU or better."""
  result, path = parts["owlv2"]
  row = next((r for r in _rows(result, "ours_step") if r["batch"] == 32), None)
  name = f"OWLv2 L/14 1008 px, 16 + 16: < {OWLV2_GB:.0f} GB at >= {OWLV2_MFU:.0%} MFU"
  if row is None or row.get("peak_bytes") is None or "mfu" not in row:
    return _goal(name, "not measured", "no step with peak memory and MFU", path)
  gb = row["peak_bytes"] / GB
  met = gb < OWLV2_GB and row["mfu"] >= OWLV2_MFU
  size = (result.get("arithmetic") or {}).get("image_size")
  figure = f"{gb:.2f} GB, {row['mfu']:.1%} MFU (batch {row['batch']}, {size} px)"
  return _goal(name, "met" if met else "not met", figure, path)


def retrieval_goal(parts: dict, step: dict | None) -> dict:
  """The slowest algorithm at N = 1M as a fraction of the fastest 16 + 16 step timed."""
  result, path = parts["retrieval"]
  runs = [r for r in (result or {}).get("runs", []) if r["sizes"]["num_images"] >= MILLION]
  rows = [r for run in runs for r in run["rows"] if r["kind"] == "algorithm" and r["jax_s"]]
  name = f"slowest retrieval at a 1M-image buffer < {RETRIEVAL_SHARE:.0%} of a 16 + 16 step"
  if not rows or step is None:
    return _goal(name, "not measured", "needs the 1M run and a 16 + 16 step", path)
  slowest = max(rows, key=lambda r: r["jax_s"]["median_s"])
  share = slowest["jax_s"]["median_s"] / step["step_s"]
  figure = (
    f"{slowest['name']}: {slowest['jax_s']['median_s'] * 1e3:.2f} ms, {share:.2%} of the "
    f"{step['step_s']:.3f} s step (remat {step['remat']})"
  )
  return _goal(name, _verdict(share, RETRIEVAL_SHARE, None, above=False), figure, path)


def device_kind(parts: dict) -> str:
  for result, _ in parts.values():
    device = ((result or {}).get("timing") or {}).get("device") or {}
    if device.get("device_kind"):
      return device["device_kind"]
    if (result or {}).get("device"):
      return result["device"]
  return "unknown"


def report(session: str) -> dict:
  """Every goal's verdict from the session folder: {'device_kind', 'parts', 'goals'}."""
  names = ("hf_model", "hf_step", "remat_block", "remat_selective", "retrieval", "owlv2")
  parts = {name: read_part(session, name) for name in names}
  goals, fastest = step_goals(parts)
  goals[1:1] = hf_goals(parts)
  goals += [owlv2_goal(parts), retrieval_goal(parts, fastest)]
  ran = {n: p for n, (r, p) in parts.items() if r is not None}
  return {"device_kind": device_kind(parts), "parts": ran, "goals": goals}


def render(result: dict) -> str:
  lines = [
    "# Issue 48 item 4: the goals, from one GPU session",
    "",
    f"Device kind: {result['device_kind']!r}. Read by `benchmarks/gpu_report.py` from the "
    "session's raw files (each figure's source beside it).",
    "",
    "| goal | verdict | figure | source |",
    "|---|---|---|---|",
  ]
  for g in result["goals"]:
    lines.append(f"| {g['goal']} | {g['verdict']} | {g['figure']} | `{g['source']}` |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("session", help="the session's $OUT folder")
  parser.add_argument("--out", default=None, help="the page (default SESSION/report.md)")
  args = parser.parse_args(argv)
  result = report(args.session)
  out = args.out or os.path.join(args.session, "report.md")
  with open(out, "w") as f:
    f.write(render(result))
  with open(os.path.splitext(out)[0] + ".json", "w") as f:
    json.dump(result, f, indent=2)
  print(render(result), flush=True)
  return result


if __name__ == "__main__":
  main()

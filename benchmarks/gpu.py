"""One command that measures owl_cl on a GPU: the L/14 840 px train step and everything beside it.

Writes `<out>/gpu.json` and `<out>/gpu.md`, both naming the device (`device_info.describe()`:
JAX's device kind, nvidia-smi's name, memory, driver and clocks). Every section runs in its
own fresh subprocess, so a failure in one (out of memory at 16 + 16, cuDNN unavailable, a
time-out) is recorded as such in the table and the others still run. A step section alone
takes about 160 s on an H200 (74 s of it XLA's compilation of the L/14 step), so the full set
needs about 15 minutes: `--sections`, `--batches` and `--retrieval-sizes` choose what one call
measures (module `BUDGETS` gives each section's seconds). Sections, in the order they run:

* `roofline`: the measured bf16 matmul roofline at 8192 and 16384 (`step.measure_roofline`:
  random scaled inputs, a chain of matmuls per timed call), reported beside the MFU; the MFU
  and HFU are against the device's *spec* peak (`device_info.SPEC_PEAKS`), never this;
* `flops`: the model FLOPs per image of the `:paper` step (XLA's cost analysis of the float32
  no-remat step, lowered, not compiled), the MFU's numerator, and the hardware FLOPs of the
  timed step's remat (the recomputed forward passes counted), the HFU's;
* `params`: the step's parameters initialised once (from a 1-image batch) and written to the
  run's cache folder; every step section restores them (each used to initialise its own at
  its batch size: about 100 s of every L/14 step section on the H100);
* `step:4+4`, `step:8+8`, `step:16+16`: the train step at `:paper` settings (bf16, remat per
  block, attention 'auto': cuDNN on a GPU; DER++ over [new ; replay], JAX Hungarian
  matching, detection loss, AdamW) - step time (median of `--repeats` after two warm-up
  steps), images/s, MFU, HFU, peak device memory (`device.memory_stats()`), via `step.time_side`;
* `hf:4+4`, ...: HF transformers' `OwlViTForObjectDetection` forward + backward of a plain
  loss (mean squared logits + sum of boxes) at the same sizes, bf16 autocast, its default
  attention, in its own process (`step.prepare_hf`), right after our step at the same size;
  the ratio of images/s is ours (full step) over HF's (model only: HF does less work);
* `attention`: `SelfAttention` forward + backward at 3,601 tokens (the vision tower at
  840 px), bf16, XLA against cuDNN (`jax.nn.dot_product_attention(implementation='cudnn')`,
  which the model pads to an even length for its backward pass: the padded fallback),
  with a check that cuDNN's gradients are finite and equal XLA's within bf16 tolerance
  (`grad_agreement`; the key bias's gradient, zero in exact arithmetic, is compared against
  the key kernel's magnitude); and
  whether cuDNN takes the odd length unpadded;
* `matcher`: the JAX Hungarian matcher (`losses.hungarian_matching(matcher='jax')`, jitted)
  against SciPy's `linear_sum_assignment` per image on the step's cost shapes;
* `retrieval:N=54226`, `retrieval:N=1000000`: every retrieval algorithm against its NumPy
  reference (`retrieval.bench_size`), each call drawing the replays of the largest step this
  call times (16 at 16 + 16), and each one's time as a % of that step of the same run;
* `compile`: the smallest step's compile time in a fresh process with an empty persistent
  compilation cache, then in another sharing it (`step.compile_cache`).

Time budget: each section has a share of `--budget`; a section may use its own share plus
whatever the sections before it left unused, but never the shares of the sections after it,
so the whole stays within `--budget` (a section past its time is killed and recorded).

Usage:
  python benchmarks/gpu.py                  # on the GPU machine: results/gpu.{json,md}
  python benchmarks/gpu.py --batches=8,32 --sections=roofline,flops,params,step,hf \\
      --budget=540                          # what fits one 10-minute device call
  python benchmarks/gpu.py --smoke --out D  # every section at a tiny size on CPU (CI)

Needs only what `pip install -e ".[cuda12,hf]"` installs (HF sections are recorded as skipped
without transformers). Nothing here is asserted: targets (issue 48: >= 40% of spec MFU at
16 + 16, every retrieval algorithm < 1% of the step) are read off the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))


def _load(name: str) -> types.ModuleType:
  """A sibling benchmark script as a module (benchmarks/ is not a package)."""
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", f"{BENCHMARKS}/{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up by name
  spec.loader.exec_module(module)
  return module


step_bench = _load("step")  # also puts the repository on sys.path
device_info = _load("device_info")
retrieval_bench = _load("retrieval")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from owl_cl import utils  # noqa: E402
from owl_cl.model import clip as clip_lib  # noqa: E402
from owl_cl.testing.gradients import grad_agreement  # noqa: E402
from owl_cl.train import checkpointing  # noqa: E402
from owl_cl.train import losses  # noqa: E402

# The paper's step (configs :paper): 126 queries, 100 instances, L/14 at 840 px.
FULL = dict(variant="vit_l14", image_size=840, num_queries=126, max_instances=100)
SMOKE = dict(variant="tiny", image_size=32, num_queries=4, max_instances=2)
RETRIEVAL_SIZES = (54_226, 1_000_000)
STEP_BATCHES = (8, 16, 32)  # 4 + 4, 8 + 8, 16 + 16 images
# Seconds per section, from the first run on a GPU (an H200, 2026-11-26, jax 0.11.2; wall
# seconds measured there in brackets): a step section compiles the L/14 step (74 s) and
# builds its state before the first step ([4+4] ~160 s in all); the others as measured with
# some margin. The full set (about 15 minutes) does not fit in one 10-minute device call:
# `--sections` / `--batches` / `--retrieval-sizes` choose what a call measures.
BUDGETS = {
  "roofline": 20,  # two sizes, ~0.1 s per call [the single 8192^3 reading took 5]
  "flops": 40,  # CPU lowering of the float32 step, without and with remat [11 for one]
  "params": 60,  # L/14 init from 1 image + writing 1.7 GB (not measured yet on a GPU)
  "step": 170,  # per batch [4+4: 81 s to the end of the first step, ~160 s in all]
  "hf": 25,  # per batch [23]
  "attention": 35,  # [26]
  "matcher": 10,  # [3]
  "retrieval": 70,  # per size, 1M: + 30 [54k: 64]
  "compile": 120,  # cold + warm compile of the smallest step [cold ~74]
}
# The order sections run in: the cheap and the most asked-for first, so that a budget cut
# short loses the least.
ORDER = (
  "roofline",
  "flops",
  "params",
  "step",
  "hf",
  "attention",
  "matcher",
  "retrieval",
  "compile",
)


def _sizes(args) -> dict:
  return dict(SMOKE if args.smoke else FULL)


def step_args(args, batch: int, attention: str = "auto") -> argparse.Namespace:
  """`step.py`'s settings for a `:paper` step of `batch` images (half new, half replayed)."""
  s = _sizes(args)
  argv = [
    f"--variant={s['variant']}",
    f"--image-size={s['image_size']}",
    f"--num-queries={s['num_queries']}",
    f"--max-instances={s['max_instances']}",
    f"--time-batches={batch}",
    f"--dtype={'float32' if args.smoke else 'bfloat16'}",
    f"--remat={'none' if args.smoke else 'block'}",
    f"--attention={attention}",
    f"--repeats={args.repeats}",
    f"--peak-matmul={256 if args.smoke else 8192}",
  ]
  out = step_bench.parse_args(argv)
  path = params_path(args)
  out.params_file = path if path and os.path.isdir(path) else None
  return out


def params_path(args) -> str | None:
  """Where the `params` section writes the step's parameters once per run (None: no cache
  folder, every step section initialises its own)."""
  if not args.cache_dir:
    return None
  s = _sizes(args)
  return os.path.join(args.cache_dir, f"params_{s['variant']}_{s['image_size']}")


# ------------------------------------------------------------------------------ sections


ROOFLINE_SIZES = (8192, 16384)


def section_roofline(args) -> dict:
  """The measured bf16 matmul roofline (`step.measure_roofline`) at each size: reported
  beside the MFU, never its denominator (that is the spec peak, `device_info`)."""
  sizes = (128, 256) if args.smoke else ROOFLINE_SIZES
  return {"sizes": [step_bench.measure_roofline(n, args.repeats) for n in sizes]}


def _step_flops(args, remat: str) -> float:
  """FLOPs per image of the float32 step at `remat`, lowered (not compiled) on the CPU."""
  a = step_args(args, 2)
  model = step_bench.model_lib.create_model(
    a.variant, image_size=a.image_size, dtype=jnp.float32, remat=remat, attention="xla"
  )
  new, replay = step_bench._inputs(model, 2, a.num_queries, a.max_instances, abstract=True)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), new["images"], new["queries"])
  loss = step_bench._loss(model, "jax")

  def grad(p, b, r, k):
    return jax.grad(lambda q: loss(q, b, r, k)[0])(p)

  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  return step_bench._flops(grad, params["params"], new, replay, key) / 2


def section_flops(args) -> dict:
  """Model FLOPs per image (no remat: MFU's numerator) and hardware FLOPs per image (remat
  per block as the timed step: the recomputed forward passes counted, HFU's numerator)."""
  return {
    "model_flops_per_image": _step_flops(args, "none"),
    "hardware_flops_per_image": _step_flops(args, step_args(args, 2).remat),
  }


def section_params(args) -> dict:
  """The step's parameters initialised once for the whole run (from a 1-image batch) and
  written to `params_path`; every step section restores them instead of initialising."""
  a = step_args(args, 2)
  model = step_bench.timed_model(a)
  t0 = time.perf_counter()
  params = jax.block_until_ready(step_bench.init_params(model, a.num_queries, a.max_instances))
  init_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  checkpointing.save_params(params_path(args), jax.device_get(params), overwrite=True)
  return {
    "init_s": init_s,
    "write_s": time.perf_counter() - t0,
    "bytes": checkpointing.tree_bytes(params),
  }


def section_step(args) -> dict:
  return step_bench.time_side(step_args(args, args.batch), "ours_step:jax", args.batch)


def section_hf(args) -> dict:
  try:
    import transformers  # noqa: F401, PLC0415
  except ImportError:
    return {"skipped": "transformers is not installed (the hf extra)"}
  return step_bench.time_side(step_args(args, args.batch), "hf_model", args.batch)


def _attention_grads(module, x, dy):
  """Forward + backward of `module` at x: (output, (parameter grads, input grads))."""
  params = module.init(jax.random.PRNGKey(0), x)

  @jax.jit
  def fwd_bwd(p, x):
    y, vjp = jax.vjp(lambda p, x: module.apply(p, x), p, x)
    return y, vjp(dy)

  return params, fwd_bwd


# bf16 keeps 8 significant bits: each product carries a relative error of 2^-8 ~ 0.004, and
# sums over 64 (head) to 1,024 (width) terms, compared as the largest difference over the
# largest magnitude of an array; XLA bf16 against float32 gives up to 0.014 (CPU, 17 tokens).
BF16_TOLERANCE = 2e-2


def section_attention(args) -> dict:
  """XLA against cuDNN attention, forward + backward, at the vision tower's token count."""
  s = _sizes(args)
  cfg = step_bench.model_lib.get_variant_config(s["variant"])
  patches = s["image_size"] // cfg.patch_size
  tokens = patches * patches + 1  # 3,601 at 840 px / 14
  batch, dtype = (2, jnp.float32) if args.smoke else (4, jnp.bfloat16)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, tokens, cfg.vision_width)), dtype)
  dy = jnp.asarray(rng.normal(size=(batch, tokens, cfg.vision_width)), dtype)
  out: dict[str, Any] = {"tokens": tokens, "batch": batch, "dtype": jnp.dtype(dtype).name}
  results = {}
  for impl in ("xla", "cudnn"):
    module = clip_lib.SelfAttention(num_heads=cfg.vision_heads, dtype=dtype, attention=impl)
    try:
      params, fwd_bwd = _attention_grads(module, x, dy)
      t0 = time.perf_counter()
      jax.block_until_ready(fwd_bwd(params, x))
      compile_s = time.perf_counter() - t0
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fwd_bwd(params, x))
        times.append(time.perf_counter() - t0)
      results[impl] = result
      out[impl] = {"fwd_bwd_s": statistics.median(times), "first_call_s": compile_s}
    except Exception as e:  # noqa: BLE001 (cuDNN unavailable: recorded, not fatal)
      out[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  out["cudnn_padded"] = tokens % 2 == 1  # SelfAttention pads odd lengths for cuDNN
  if "xla" in results and "cudnn" in results:
    diffs = grad_agreement(results["xla"], results["cudnn"])
    worst = max(diffs, key=diffs.get)
    finite = all(
      bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in jax.tree.leaves(results["cudnn"])
    )
    out["cudnn_grads_finite"] = finite
    out["cudnn_rel_diff"] = diffs
    out["cudnn_max_rel_diff"] = diffs[worst]
    out["cudnn_worst_array"] = worst
    out["cudnn_matches_xla"] = finite and diffs[worst] < BF16_TOLERANCE
  # Does cuDNN take the odd length without the padding? (recorded, not used by the model)
  try:
    q = jnp.asarray(rng.normal(size=(batch, tokens, cfg.vision_heads, 64)), jnp.bfloat16)
    jax.block_until_ready(
      jax.jit(
        jax.grad(
          lambda q: jnp.sum(
            jax.nn.dot_product_attention(q, q, q, implementation="cudnn").astype(jnp.float32)
          )
        )
      )(q)
    )
    out["cudnn_unpadded_odd_length"] = "ran"
  except Exception as e:  # noqa: BLE001
    out["cudnn_unpadded_odd_length"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return out


def section_matcher(args) -> dict:
  """The JAX Hungarian matcher against SciPy per image on the step's [B, T, M + 1] costs."""
  from scipy import optimize  # noqa: PLC0415

  s = _sizes(args)
  cfg = step_bench.model_lib.get_variant_config(s["variant"])
  tokens = (s["image_size"] // cfg.patch_size) ** 2
  images = 2 if args.smoke else 16  # one half of the 16 + 16 step
  k = s["max_instances"] + 1  # + the appended padding instance
  rng = np.random.default_rng(0)
  cost = rng.uniform(size=(images, tokens, k)).astype(np.float32)
  mask = np.ones((images, k), bool)
  mask[:, k // 2 :] = False  # half the instances padding, as the benchmark's batches
  match = jax.jit(lambda c, m: losses.hungarian_matching(c, m, "jax"))
  c, m = jnp.asarray(cost), jnp.asarray(mask)
  jax.block_until_ready(match(c, m))

  def scipy_match():
    for b in range(images):
      optimize.linear_sum_assignment(cost[b][:, mask[b]])

  jax_s = retrieval_bench.median_seconds(lambda: jax.block_until_ready(match(c, m)), args.repeats)
  scipy_s = retrieval_bench.median_seconds(scipy_match, args.repeats)
  return {
    "shape": [images, tokens, k],
    "jax_s": jax_s["median_s"],
    "scipy_s": scipy_s["median_s"],
  }


def section_retrieval(args) -> dict:
  """Every algorithm at N = `args.batch` buffer images (the smoke sizes with `--smoke`)
  against NumPy (`retrieval.bench_size`, algorithms only), each call drawing `args.replays`
  images: the replays of the step its time is divided by."""
  size = retrieval_bench.SMOKE if args.smoke else retrieval_bench.sizes_for(args.batch)
  size = dataclasses.replace(size, batch=args.replays)
  options = types.SimpleNamespace(
    skip_kernels=True, skip_floors=True, skip_precompute=True, repeats=args.repeats
  )
  run = retrieval_bench.bench_size(size, list(retrieval_bench.registry.ALGORITHMS), options)
  algorithms = {
    # numpy_s None: the algorithm has no NumPy reference (retrieval.NUMPY_REFERENCES).
    r["name"]: {"jax_s": r["jax_s"]["median_s"], "numpy_s": (r["numpy_s"] or {}).get("median_s")}
    for r in run["rows"]
    if r["kind"] == "algorithm"
  }
  return {"num_images": size.num_images, "replays_per_call": size.batch, "algorithms": algorithms}


def section_compile(args) -> dict:
  a = step_args(args, args.batch)
  a.cache_dir = args.cache_dir
  return step_bench.compile_cache(a)


SECTIONS = {
  "roofline": section_roofline,
  "flops": section_flops,
  "params": section_params,
  "step": section_step,
  "hf": section_hf,
  "attention": section_attention,
  "matcher": section_matcher,
  "retrieval": section_retrieval,
  "compile": section_compile,
}


# ------------------------------------------------------------------------------ driver


def plan(args, scale: bool = True) -> list[tuple[str, int | None, float]]:
  """The sections in order as (name, batch or None, budget seconds); a retrieval section's
  'batch' is its buffer size N. Only `args.sections` run (all by default); a step and its HF
  counterpart run one after the other for each batch. With `scale`, the shares are scaled to
  add up to `args.budget`; without, they are `BUDGETS`' seconds."""
  batches = [2] if args.smoke else list(args.batches)
  sizes = [retrieval_bench.SMOKE.num_images] if args.smoke else list(args.retrieval_sizes)
  out: list[tuple[str, int | None, float]] = []
  for name in ORDER:
    if name not in args.sections or (name == "hf" and "step" in args.sections):
      continue  # hf runs beside step below when both are asked for
    if name == "params" and "step" not in args.sections:
      continue  # only the step sections read them
    if name == "step":
      for b in batches:
        out.append(("step", b, BUDGETS["step"]))
        if "hf" in args.sections:
          out.append(("hf", b, BUDGETS["hf"]))
    elif name == "hf":
      out += [("hf", b, BUDGETS["hf"]) for b in batches]
    elif name == "retrieval":
      out += [("retrieval", n, BUDGETS["retrieval"] + 30 * i) for i, n in enumerate(sizes)]
    elif name == "compile":
      out.append(("compile", batches[0], BUDGETS["compile"]))
    else:
      out.append((name, None, BUDGETS[name]))
  factor = args.budget / sum(b for _, _, b in out) if scale else 1.0
  return [(name, batch, budget * factor) for name, batch, budget in out]


def _last_lines(output: str, count: int = 3) -> str:
  """The last `count` lines of a section's output on one line, ' | '-separated."""
  return " | ".join(output.strip().splitlines()[-count:])


def replays_per_step(args) -> int:
  """Replayed images per step of the largest step this call times (half its batch): the
  retrieval sections draw this many per call, so their share divides a step of the same run
  at the same replays."""
  batches = [2] if args.smoke else list(args.batches)
  return max(batches) // 2


def run_section(args, name: str, batch: int | None, timeout: float) -> dict:
  """One section in a fresh process (its own process group, killed whole on time-out).

  Returns the section's result, or {'error': ...} with the last lines of its output."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    f"--section={name}",
    f"--repeats={args.repeats}",
  ]
  cmd += ["--smoke"] if args.smoke else []
  cmd += [f"--batch={batch}"] if batch else []
  cmd += [f"--replays={replays_per_step(args)}"]
  cmd += [f"--cache-dir={args.cache_dir}"] if args.cache_dir else []
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
  )
  try:
    output, _ = proc.communicate(timeout=max(timeout, 1.0))
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the section and any process it started
    output, _ = proc.communicate()
    # The last lines it printed say how far it got (the second GPU run lost them).
    tail = _last_lines(output or "")
    error = f"over its time budget ({timeout:.0f} s): killed" + (f"; last: {tail}" if tail else "")
    return {"error": error, "wall_s": timeout}
  wall = time.perf_counter() - t0
  lines = output.strip().splitlines()
  if proc.returncode or not lines:
    return {"error": f"exit {proc.returncode}: {_last_lines(output)}", "wall_s": wall}
  result = json.loads(lines[-1])
  result["wall_s"] = wall
  return result


def summarize(results: dict, images: dict, device: dict) -> dict:
  """Derived figures: images/s, MFU and HFU against the device's spec peak, ours / HF, and
  retrieval as a % of the step of this run with the same replays per step.

  Args:
    results: {section label: its result}; images: {'8+8': 16, ...} of the step sections;
    device: `device_info.describe()` of this run.
  """
  peak = device.get("spec_peak_bf16_flops")
  flops = results.get("flops", {})
  summary: dict[str, Any] = {
    "spec_peak_bf16_flops": peak,
    "spec_peak_source": device.get("spec_peak_source"),
    "steps": [],
    "retrieval_percent_of_step": {},
  }
  step_by_replays = {}
  for key, batch in images.items():
    ours, hf = results.get(f"step:{key}", {}), results.get(f"hf:{key}", {})
    row: dict[str, Any] = {"images": key, "batch": batch}
    if "step_s_all" in ours:
      step_s = statistics.median(ours["step_s_all"])
      row.update(step_s=step_s, images_per_s=batch / step_s, peak_bytes=ours.get("peak_bytes"))
      if "model_flops_per_image" in flops:
        row.update(
          device_info.utilization(
            batch / step_s,
            flops["model_flops_per_image"],
            flops.get("hardware_flops_per_image"),
            peak,
          )
        )
      step_by_replays[batch // 2] = step_s
    else:
      row["step_error"] = ours.get("error", ours.get("skipped", "not run"))
    if "step_s_all" in hf:
      hf_s = statistics.median(hf["step_s_all"])
      row.update(hf_step_s=hf_s, hf_images_per_s=batch / hf_s, hf_peak_bytes=hf.get("peak_bytes"))
      if "step_s" in row:
        row["ours_over_hf_images_per_s"] = hf_s / row["step_s"]
    else:
      row["hf_error"] = hf.get("error", hf.get("skipped", "not run"))
    summary["steps"].append(row)
  runs = [v for k, v in results.items() if k.startswith("retrieval") and "algorithms" in v]
  for run in runs:
    # Only the step of this run that draws as many replays as each retrieval call did.
    step_s = step_by_replays.get(run["replays_per_call"])
    summary["retrieval_percent_of_step"][run["num_images"]] = {
      "replays_per_call": run["replays_per_call"],
      "step_s": step_s,
      "percent": {
        name: (100 * t["jax_s"] / step_s if step_s else None)
        for name, t in run["algorithms"].items()
      },
    }
  return summary


def _fmt(x, spec=".3f", scale=1.0):
  return "-" if x is None else format(x * scale, spec)


def render_markdown(report: dict) -> str:
  env, r, s = report["environment"], report["sections"], report["summary"]
  dev = report["device"]
  lines = [
    f"# GPU benchmark ({report['mode']})",
    "",
    f"Device kind: {dev['device_kind']!r} ({dev['platform']}, {dev['device_count']} devices);"
    f" nvidia-smi: {dev['nvidia_smi']}.",
    "",
    f"Devices: {env['devices']}; jax {env['jax']}, torch {env.get('torch')}, transformers "
    f"{env.get('transformers')}; {env['date']}. Budget {report['budget_s']:.0f} s, "
    f"took {report['wall_s']:.0f} s.",
    "",
    "## Sections",
    "",
    "| section | status | wall s |",
    "|---|---|---|",
  ]
  for name, res in r.items():
    status = res.get("error") or res.get("skipped") or "ok"
    lines.append(f"| {name} | {status} | {_fmt(res.get('wall_s'), '.0f')} |")
  peak = s["spec_peak_bf16_flops"]
  flops = r.get("flops", {})
  roof = r.get("roofline", {}).get("sizes", [])
  roofline = ", ".join(
    f"{x['flops_per_s'] / 1e12:.1f} at {x['n']} ({x['chain']} matmuls per call)" for x in roof
  )
  lines += [
    "",
    f"## Train step ({report['step_settings']})",
    "",
    f"MFU and HFU against the spec bf16 peak: {_fmt(peak, '.1f', 1e-12)} TFLOP/s "
    f"({s['spec_peak_source']}). Measured matmul roofline (TFLOP/s, not the denominator): "
    f"{roofline or '-'}. Model FLOPs per image (float32 no-remat step, XLA's cost analysis): "
    f"{_fmt(flops.get('model_flops_per_image'), '.2f', 1e-12)} TFLOP; hardware FLOPs "
    f"(the timed step's remat, recomputation counted): "
    f"{_fmt(flops.get('hardware_flops_per_image'), '.2f', 1e-12)} TFLOP. "
    "HF: forward + backward of a plain loss (bf16 autocast on CUDA), its default attention; "
    "ours: the full step. Medians after two warm-up steps.",
    "",
    "| images | ours step s | ours images/s | MFU | HFU | ours peak GB | HF step s | HF images/s "
    "| HF peak GB | ours / HF images/s |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in s["steps"]:
    ours = (
      f"{_fmt(row.get('step_s'))} | {_fmt(row.get('images_per_s'), '.2f')} | "
      f"{_fmt(row.get('mfu'), '.1%')} | {_fmt(row.get('hfu'), '.1%')} | "
      f"{_fmt(row.get('peak_bytes'), '.2f', 1e-9)}"
      if "step_s" in row
      else f"{row['step_error']} | - | - | - | -"
    )
    hf = (
      f"{_fmt(row.get('hf_step_s'))} | {_fmt(row.get('hf_images_per_s'), '.2f')} | "
      f"{_fmt(row.get('hf_peak_bytes'), '.2f', 1e-9)}"
      if "hf_step_s" in row
      else f"{row['hf_error']} | - | -"
    )
    ratio = _fmt(row.get("ours_over_hf_images_per_s"), ".2f")
    lines.append(f"| {row['images']} | {ours} | {hf} | {ratio} |")
  a = r.get("attention", {})
  if "tokens" in a:
    lines += [
      "",
      f"## Attention at {a['tokens']} tokens ({a['dtype']}, batch {a['batch']}, forward + "
      "backward of `SelfAttention`)",
      "",
      "| implementation | fwd+bwd ms | first call s |",
      "|---|---|---|",
    ]
    for impl in ("xla", "cudnn"):
      t = a.get(impl, {})
      if "error" in t:
        lines.append(f"| {impl} | {t['error']} | - |")
      else:
        lines.append(f"| {impl} | {_fmt(t['fwd_bwd_s'], '.2f', 1e3)} | {t['first_call_s']:.1f} |")
    lines += [
      "",
      f"cuDNN padded to an even length: {a['cudnn_padded']}; gradients finite: "
      f"{a.get('cudnn_grads_finite', '-')}, largest difference to XLA's / largest magnitude: "
      f"{_fmt(a.get('cudnn_max_rel_diff'), '.2e')} in `{a.get('cudnn_worst_array', '-')}` "
      "(the key bias's gradient, zero in exact arithmetic, scaled by the key kernel's; "
      f"bf16 tolerance {BF16_TOLERANCE:g}: "
      f"{a.get('cudnn_matches_xla', '-')}); cuDNN at the odd length unpadded: "
      f"{a['cudnn_unpadded_odd_length']}.",
    ]
  m = r.get("matcher", {})
  if "jax_s" in m:
    lines += [
      "",
      f"## Hungarian matcher, cost {m['shape']} (images, tokens, instances + padding)",
      "",
      f"JAX (jitted) {m['jax_s'] * 1e3:.2f} ms; SciPy `linear_sum_assignment` per image "
      f"{m['scipy_s'] * 1e3:.2f} ms; SciPy / JAX {m['scipy_s'] / m['jax_s']:.2f}x.",
    ]
  runs = [v for k, v in r.items() if k.startswith("retrieval") and "algorithms" in v]
  if runs:
    lines += [
      "",
      "## Retrieval (one call = one step's replays), % of this run's step with as many replays",
      "",
      "| N | algorithm | JAX ms | NumPy ms | NumPy / JAX | % of step |",
      "|---|---|---|---|---|---|",
    ]
    for run in runs:
      n = run["num_images"]
      for name, t in run["algorithms"].items():
        pct = s["retrieval_percent_of_step"].get(n, {}).get("percent", {}).get(name)
        numpy = (
          f"{t['numpy_s'] * 1e3:.2f} | {t['numpy_s'] / t['jax_s']:.1f}x"
          if t["numpy_s"] is not None
          else f"{retrieval_bench.NO_REFERENCE} | -"
        )
        lines.append(f"| {n} | `{name}` | {t['jax_s'] * 1e3:.2f} | {numpy} | {_fmt(pct, '.2f')} |")
  c = r.get("compile", {})
  if "cold" in c:
    lines += [
      "",
      f"## Compilation (the step at batch {c['batch']}, fresh processes)",
      "",
      "| | lower s | compile s |",
      "|---|---|---|",
      f"| cold (empty persistent cache) | {c['cold']['lower_s']:.1f} | "
      f"{c['cold']['compile_s']:.1f} |",
      f"| warm (cache hit) | {c['warm']['lower_s']:.1f} | {c['warm']['compile_s']:.1f} |",
    ]
  return "\n".join(lines) + "\n"


def _names(text: str) -> tuple[str, ...]:
  return tuple(n for n in text.split(",") if n)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.split(",") if n)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="every section at a tiny size on CPU")
  p.add_argument("--out", default=os.path.join(BENCHMARKS, "results"))
  p.add_argument(
    "--budget", type=float, default=None, help="seconds in all (default: the sections' shares)"
  )
  p.add_argument(
    "--sections",
    type=_names,
    default=ORDER,
    help=f"comma-separated sections to run, in the fixed order {','.join(ORDER)} (default all)",
  )
  p.add_argument(
    "--batches",
    type=_ints,
    default=STEP_BATCHES,
    help="images per step (half new, half replayed), comma-separated (default 8,16,32)",
  )
  p.add_argument(
    "--retrieval-sizes",
    type=_ints,
    default=RETRIEVAL_SIZES,
    help="buffer sizes N of the retrieval sections (default 54226,1000000)",
  )
  p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement")
  p.add_argument("--cache-dir", default=None, help="persistent compilation cache parent")
  p.add_argument("--section", default=None, choices=sorted(SECTIONS), help=argparse.SUPPRESS)
  p.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--replays", type=int, default=1, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.repeats = args.repeats or (2 if args.smoke else 5)
  if args.repeats < 1 or (args.budget is not None and args.budget <= 0):
    p.error(f"--repeats must be >= 1 and --budget > 0, got {args.repeats} and {args.budget}")
  unknown = sorted(set(args.sections) - set(ORDER))
  if unknown or not args.sections:
    p.error(f"--sections: unknown {unknown} or none given; known: {','.join(ORDER)}")
  if any(b < 2 or b % 2 for b in args.batches):
    p.error(f"--batches must be even numbers >= 2 (half new, half replayed), got {args.batches}")
  if args.budget is None:
    args.budget = 900.0 if args.smoke else sum(b for _, _, b in plan(args, scale=False))
  if args.section:
    result = SECTIONS[args.section](args)
    print(json.dumps(result, default=float), flush=True)
    return result
  if not args.smoke and jax.default_backend() == "cpu":
    print("no accelerator: the full sizes need a GPU (--smoke runs every section here)")
  environment = step_bench._environment()
  device = device_info.describe()
  start = time.perf_counter()
  sections: dict[str, dict] = {}
  images: dict[str, int] = {}
  steps = plan(args)
  owned = tempfile.mkdtemp(prefix="gpu_bench_cache_") if not args.cache_dir else None
  args.cache_dir = args.cache_dir or owned
  for i, (name, batch, _) in enumerate(steps):
    if name == "retrieval":
      label = f"retrieval:N={batch}"
    else:
      label = name if batch is None else f"{name}:{batch // 2}+{batch // 2}"
    if batch and name in ("step", "hf"):
      images[f"{batch // 2}+{batch // 2}"] = batch
    later = sum(b for _, _, b in steps[i + 1 :])
    timeout = args.budget - (time.perf_counter() - start) - later
    print(f"[{time.perf_counter() - start:5.0f} s] {label} (up to {timeout:.0f} s)", flush=True)
    sections[label] = run_section(args, name, batch, timeout)
    print(f"  -> {sections[label].get('error', 'ok')}", flush=True)
  s = _sizes(args)
  report = {
    "mode": "smoke" if args.smoke else "full",
    "environment": environment,
    "device": device,
    "step_settings": f"{s['variant']} at {s['image_size']} px, {s['num_queries']} queries, "
    f"{s['max_instances']} instances, "
    + ("float32" if args.smoke else "bf16, remat per block")
    + ", attention auto, JAX matcher",
    "budget_s": args.budget,
    "wall_s": time.perf_counter() - start,
    "sections": sections,
    "summary": summarize(sections, images, device),
  }
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "gpu_smoke" if args.smoke else "gpu")
  utils.write_report(stem, report, render_markdown(report), indent=2)
  if owned:
    import shutil  # noqa: PLC0415

    shutil.rmtree(owned, ignore_errors=True)
  return report


if __name__ == "__main__":
  main()

"""Train-step benchmark: FLOPs, saved activations, memory fit, speed, and HF side by side.

Two parts, one JSON and one Markdown file:

1. **Arithmetic** (any machine, no real-size memory needed): for the `:paper` train step
   (DER++ over [new ; replay], Hungarian matching, detection loss) of a variant at an image
   size, with abstract inputs (`jax.ShapeDtypeStruct`), per configuration dtype x remat x
   attention:
   * model FLOPs per image: XLA's cost analysis of the lowered, *no-remat* float32 step
     (`jax.jit(grad).lower(...).cost_analysis()`, no compilation), and of the eval forward;
     the same for the configuration itself (remat adds the recomputation);
   * activation bytes saved for the backward pass per image: the residuals JAX keeps
     (`jax._src.ad_checkpoint.saved_residuals`), summed, arguments (parameters, inputs)
     excluded; the step is traced with 1 new + 1 replayed image and divided by 2;
   * parameter + gradient + Adam state bytes (float32), and for every per-device batch
     (1, 2, 4, 8, 16, 32 images) the total and whether it fits an 80 GB device; the largest
     batch that fits.
   cuDNN's fused attention cannot be traced without a GPU; off-GPU its residuals are
   *modelled* by an attention with a custom VJP that saves exactly what a flash-attention
   kernel saves (q, k, v, the output and the per-row log-sum-exp) and recomputes the
   probabilities in the backward pass (marked `modelled` in the results).
2. **Timing** on the device the script runs on, four sides, **each in its own fresh process**
   (`time_in_fresh_process`) with the same number of compute threads (`--threads`, default
   the CPUs this process may use: the child is pinned to those CPUs, torch gets
   `torch.set_num_threads` and `OMP_NUM_THREADS`, XLA:CPU `intra_op_parallelism_threads`),
   the same model sizes and the same batch, warm-up steps (compilation) excluded:
   * `ours_model`: our model's forward + backward of a plain loss (mean of the squared
     logits + sum of the boxes), no optimizer; `hf_model`: the same for HF transformers'
     `OwlViTForObjectDetection` (random weights of the same architecture, bf16 autocast on
     CUDA, float32 on CPU, its default attention implementation);
   * `ours_step:<matcher>`: our full `:paper` step (forward, DER++ over [new ; replay],
     Hungarian matching, detection loss, backward, AdamW); `hf_step`: HF's forward, SciPy
     matching and the same detection loss in PyTorch (`hf_detection_loss`), backward,
     `torch.optim.AdamW` (our step's DER++ distillation term is the only extra work).
   The ratios HF time / ours are reported for the model alone and for the full step. HF was
   once timed in the process that had just run our steps: there XLA:CPU's thread pool
   competed with torch's threads (`--diagnose` times that condition as
   `hf_model_after_jax`). `--rounds R` runs every side in R processes, one after the other;
   each row is the median over all timed steps with their min-max. The MFU is against the
   device's spec bf16 peak (`device_info.SPEC_PEAKS`, by `device_kind`; none on a CPU); on
   accelerators a measured matmul roofline (`measure_roofline`) is recorded beside it.
3. **Compilation** (`--compile-cache`, any backend): the step is traced, lowered and compiled
   from abstract inputs (no parameters allocated, nothing executed, so L/14 at 840 px
   compiles on a small host) in a fresh process with an empty persistent compilation cache,
   then in a second fresh process sharing it: cold vs warm compile time, what a resumed or
   repeated run pays.
4. **LoRA** (`lora_arithmetic`, with the arithmetic; `--lora-only` alone): adapter sizes,
   Adam state and saved activations of LoRA (docs/lora.md) against full fine-tuning.

Usage:
  python benchmarks/step.py --quick        # CPU-sized: vit_b32 at 384 px, batch 4
  python benchmarks/step.py --smoke        # every path at a tiny size in seconds (CI)
  python benchmarks/step.py                # L/14 at 840 px: arithmetic; timing on a GPU
  python benchmarks/step.py --variant owlv2_l14 --skip-timing   # OWLv2 L/14 at 1008 px
  options: --variant, --image-size, --num-queries, --batches 1,2,4, --time-batches,
  --skip-arithmetic, --skip-timing, --skip-hf, --skip-model-only, --skip-step, --repeats, --rounds,
  --threads, --diagnose, --out, --lora-ranks 8,16, --skip-lora
  python benchmarks/step.py --lora-only    # LoRA vs full fine-tuning memory at L/14 840 px

Writes `<out>/step[_quick|_smoke].json` and `.md`. Nothing here is asserted: targets
(activations <= 2 GB per image at 840 px with the paper's defaults; on CPU at least parity
on the model alone, ahead on the full step) are read off the results.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPUS_VARIABLE = "OWL_CL_BENCHMARK_CPUS"
if os.environ.get(CPUS_VARIABLE) and hasattr(os, "sched_setaffinity"):
  # A timed side's process (`time_in_fresh_process`): pinned to its CPUs before XLA or torch
  # size their thread pools (set here, not by the parent between fork and exec: the parent
  # runs JAX's threads).
  os.sched_setaffinity(0, [int(c) for c in os.environ[CPUS_VARIABLE].split(",")])
# JAX and PyTorch share the accelerator in one process: no up-front reservation by JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from owl_cl import model as model_lib  # noqa: E402
from owl_cl import utils  # noqa: E402
from owl_cl.model import clip as clip_lib  # noqa: E402
from owl_cl.model import convert  # noqa: E402
from owl_cl.model import lora as lora_lib  # noqa: E402
from owl_cl.train import checkpointing  # noqa: E402
from owl_cl.train import losses  # noqa: E402
from owl_cl.train import sharding as sharding_lib  # noqa: E402
from owl_cl.train import step as step_lib  # noqa: E402
from owl_cl.train.spec import LossSpec  # noqa: E402

_spec = importlib.util.spec_from_file_location(
  "benchmark_device_info",
  os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_info.py"),
)
device_info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_info)

GB = 1e9
DEVICE_BYTES = 80 * GB  # the paper's A100/H100 80 GB
BATCHES = (1, 2, 4, 8, 16, 32)
LOSS_CONFIG = dict(
  focal_alpha=0.3, focal_gamma=2.0, class_weight=1.0, bbox_weight=1.0, giou_weight=1.0
)


# ------------------------------------------------------------------------------- inputs


def _inputs(model, batch: int, num_queries: int, max_instances: int, abstract: bool):
  """(new, replay) batches of batch // 2 images each (at least 1), abstract or concrete."""
  half = max(batch // 2, 1)
  s, length, t = model.image_size, model.context_length, model.num_tokens
  shapes = {
    "images": ((half, s, s, 3), jnp.float32),
    "queries": ((half, num_queries, length), jnp.int32),
    "labels": ((half, max_instances, num_queries), jnp.float32),
    "boxes": ((half, max_instances, 4), jnp.float32),
  }
  extra = {"stored_logits": ((half, t, num_queries), jnp.bfloat16), "replay_mask": ((half,), bool)}
  if abstract:
    new = {k: jax.ShapeDtypeStruct(*v) for k, v in shapes.items()}
    replay = dict(new, **{k: jax.ShapeDtypeStruct(*v) for k, v in extra.items()})
    return new, replay
  rng = np.random.default_rng(0)
  new, replay = (
    {
      k: jnp.asarray(v)
      for k, v in numpy_batch(rng, half, s, num_queries, length, max_instances).items()
    }
    for _ in range(2)
  )
  replay["stored_logits"] = jnp.asarray(rng.normal(size=extra["stored_logits"][0]), jnp.bfloat16)
  replay["replay_mask"] = jnp.ones((half,), bool)
  return new, replay


def numpy_batch(
  rng: np.random.Generator,
  images: int,
  image_size: int,
  num_queries: int,
  context_length: int,
  max_instances: int,
) -> dict[str, np.ndarray]:
  """A synthetic detection batch in NumPy (no JAX: the HF process must not start XLA).

  Returns images float32 [B, S, S, 3] uniform in [0, 1]; queries int32 [B, Q, L] (start
  token 1, a random id in [3, 400), end token 2); labels float32 [B, M, Q] (the first
  max(M // 2, 1) instances real, one-hot at a column >= 1, the rest padding at column 0);
  boxes float32 [B, M, 4] cxcywh with centres in [0.2, 0.8] and sides in [0.05, 0.3].
  """
  queries = np.zeros((images, num_queries, context_length), np.int32)
  queries[..., 0] = 1
  queries[..., 1] = rng.integers(3, 400, queries.shape[:2])
  queries[..., 2] = 2
  labels = np.zeros((images, max_instances, num_queries), np.float32)
  labels[..., 0] = 1
  for i in range(max(max_instances // 2, 1)):
    labels[:, i, 0] = 0
    labels[:, i, 1 + i % (num_queries - 1)] = 1
  cxcy = rng.uniform(0.2, 0.8, (images, max_instances, 2))
  wh = rng.uniform(0.05, 0.3, (images, max_instances, 2))
  return {
    "images": rng.uniform(size=(images, image_size, image_size, 3)).astype(np.float32),
    "queries": queries,
    "labels": labels,
    "boxes": np.concatenate([cxcy, wh], -1).astype(np.float32),
  }


def _loss(model, matcher: str):
  """The `:paper` step's loss (DER++ over [new ; replay]) as a function of the parameters;
  for an OWLv2 variant with the objectness term at the `:owlv2` config's weight (its head's
  activations are then saved too; docs/owlv2.md)."""
  loss_config = dict(LOSS_CONFIG, matcher=matcher)
  if model.version == "owlv2":
    loss_config["objectness_weight"] = 0.5
  spec = step_lib.StepSpec(
    loss=LossSpec(**loss_config), replay=step_lib.ReplayLoss(alpha=2.0, beta=1.0)
  )
  return functools.partial(step_lib._loss_fn, model=model, spec=spec)


# ------------------------------------------------------------------ modelled flash attention


def _attention_reference(q, k, v, key_bias):
  """softmax(q k^T / sqrt(d) + key_bias) v; q/k/v [B, S, H, D], key_bias float32 [B, S]."""
  scale = q.shape[-1] ** -0.5
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  logits = logits + key_bias[:, None, None, :]
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - lse[..., None]).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v), lse


@jax.custom_vjp
def _flash_like(q, k, v, key_bias):
  return _attention_reference(q, k, v, key_bias)[0]


def _flash_like_fwd(q, k, v, key_bias):
  # What a flash-attention kernel keeps for its backward pass: inputs, output and the
  # per-row log-sum-exp of the logits (float32) - not the [H, S, S] probabilities, which
  # the backward pass recomputes.
  out, lse = _attention_reference(q, k, v, key_bias)
  return out, (q, k, v, key_bias, out, lse)


def _flash_like_bwd(res, g):
  q, k, v, key_bias, _, _ = res
  _, vjp = jax.vjp(lambda a, b, c: _attention_reference(a, b, c, key_bias)[0], q, k, v)
  return (*vjp(g), jnp.zeros_like(key_bias))


_flash_like.defvjp(_flash_like_fwd, _flash_like_bwd)


def _modelled_cudnn_attention(real):
  """`jax.nn.dot_product_attention` stand-in: implementation='cudnn' -> `_flash_like`."""

  def attention(q, k, v, bias=None, mask=None, *, implementation=None, **kwargs):
    if implementation != "cudnn":
      return real(q, k, v, bias=bias, mask=mask, implementation=implementation, **kwargs)
    if mask is not None or bias is not None:
      # The text tower (16 tokens, masked): its attention residuals are negligible; the
      # XLA path keeps them (a slight overestimate).
      return real(q, k, v, bias=bias, mask=mask, implementation="xla")
    lengths = kwargs.get("key_value_seq_lengths")
    s = k.shape[1]
    if lengths is None:
      key_bias = jnp.zeros((k.shape[0], s), jnp.float32)
    else:  # padded keys (the odd-length fallback) are excluded
      key_bias = jnp.where(jnp.arange(s)[None, :] < lengths[:, None], 0.0, -1e30)
    return _flash_like(q, k, v, key_bias.astype(jnp.float32))

  return attention


# ---------------------------------------------------------------------------- arithmetic


def _residual_bytes(fn, *args) -> int:
  from jax._src import ad_checkpoint  # noqa: PLC0415 (private API, only here)

  total = 0
  for aval, source in ad_checkpoint.saved_residuals(fn, *args):
    if source.startswith("from the argument") or not hasattr(aval, "shape"):
      continue  # parameters and inputs are counted separately
    total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
  return total


def _flops(fn, *args) -> float:
  """FLOPs of fn at args (abstract or concrete) by XLA's cost analysis of the CPU lowering.

  Counted on the CPU whatever the default backend: the FLOPs of the unoptimised HLO do not
  depend on the platform, and a lowering for CUDA returns no cost analysis. The arguments are
  placed on the CPU device (their shardings) so that the lowering's backend is the CPU's too:
  `lowering_platforms=("cpu",)` alone keeps the default backend for the analysis (None on an
  H200 with jax 0.11.2, 2026-11-26). Raises RuntimeError when no count comes back.
  """
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), args)
  lowered = jax.jit(fn).trace(*args).lower()
  analysis = lowered.cost_analysis()
  if isinstance(analysis, list | tuple):
    analysis = analysis[0] if analysis else None
  if not analysis or "flops" not in analysis:
    raise RuntimeError(f"no FLOP count from XLA's cost analysis of the CPU lowering: {analysis!r}")
  return float(analysis["flops"])


def arithmetic(args, dtypes, remats, attentions) -> dict:
  """FLOPs, saved residuals and the 80 GB fit, from abstract shapes (module docstring)."""
  base = model_lib.create_model(args.variant, image_size=args.image_size, dtype=jnp.float32)
  new, replay = _inputs(base, 2, args.num_queries, args.max_instances, abstract=True)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  params = jax.eval_shape(base.init, jax.random.PRNGKey(0), new["images"], new["queries"])["params"]
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  param_bytes = 4 * num_params
  fixed = {
    "parameters": param_bytes,
    "gradients": param_bytes,
    "adam_moments": 2 * param_bytes,
  }
  fixed_total = sum(fixed.values())
  images_traced = 2 * new["images"].shape[0]

  def grad_fn(model):
    loss = _loss(model, "jax")
    return lambda p, b, r, k: jax.grad(lambda q: loss(q, b, r, k)[0])(p)

  t0 = time.time()
  train_flops = _flops(grad_fn(base), params, new, replay, key) / images_traced
  eval_model = base
  eval_flops = (
    _flops(
      lambda p, i, q: eval_model.apply({"params": p}, i, q), params, new["images"], new["queries"]
    )
    / (new["images"].shape[0])
  )
  print(
    f"model FLOPs/image: train {train_flops / 1e12:.2f} T, eval {eval_flops / 1e12:.2f} T "
    f"({time.time() - t0:.0f} s)",
    flush=True,
  )
  rows = []
  real_attention = jax.nn.dot_product_attention
  for dtype in dtypes:
    for remat in remats:
      for attention in attentions:
        model = model_lib.create_model(
          args.variant,
          image_size=args.image_size,
          dtype=getattr(jnp, dtype),
          remat=remat,
          attention=attention,
        )
        modelled = attention == "cudnn" and jax.default_backend() != "gpu"
        t0 = time.time()
        if modelled:
          jax.nn.dot_product_attention = _modelled_cudnn_attention(real_attention)
        try:
          loss = _loss(model, "jax")
          fn = lambda p, b, r, k, loss=loss: loss(p, b, r, k)[0]  # noqa: E731
          act = _residual_bytes(fn, params, new, replay, key) / images_traced
          step_flops = _flops(grad_fn(model), params, new, replay, key) / images_traced
        finally:
          jax.nn.dot_product_attention = real_attention
        max_batch = int((DEVICE_BYTES - fixed_total) // act) if act else None
        row = {
          "dtype": dtype,
          "remat": remat,
          "attention": attention,
          "attention_modelled": modelled,
          "activation_bytes_per_image": act,
          "step_flops_per_image": step_flops,
          "max_batch_80gb": max_batch,
          "total_bytes_by_batch": {b: fixed_total + b * act for b in args.batches},
        }
        rows.append(row)
        print(
          f"{dtype:9s} remat={remat:33s} attention={attention:5s}"
          f"{' (modelled)' if modelled else ''}: {act / GB:7.2f} GB/image, "
          f"{step_flops / 1e12:.2f} TFLOP/image, max batch {max_batch} "
          f"({time.time() - t0:.0f} s)",
          flush=True,
        )
  return {
    "variant": args.variant,
    "image_size": args.image_size,
    "num_tokens": base.num_tokens,
    "num_queries": args.num_queries,
    "max_instances": args.max_instances,
    "num_parameters": num_params,
    "fixed_bytes": fixed,
    "fixed_bytes_total": fixed_total,
    "device_bytes": DEVICE_BYTES,
    "model_flops_per_image_train": train_flops,
    "model_flops_per_image_eval": eval_flops,
    "configs": rows,
  }


def lora_arithmetic(args) -> dict:
  """Memory of LoRA against full fine-tuning (docs/lora.md), from abstract shapes.

  Per rank of `args.lora_ranks` (alpha = 2 x rank; the default targets: attention q/k/v/out
  and MLP Dense of both towers): the adapters' parameter count and bytes (float32), and the
  resident training state: full fine-tuning holds parameters + gradients + Adam's two moments
  of every parameter (16 B each); LoRA the frozen parameters (4 B each) + the adapters with
  their gradients and moments (16 B each). Per dtype x remat (attention `args.attentions[0]`):
  the activations saved for the backward pass per image (`_residual_bytes`, as `arithmetic`)
  of full fine-tuning and of LoRA. LoRA's are traced with the gradient of the base too (a
  `stop_gradient` would turn the base's weights into saved intermediates): the base's weight
  gradient needs the layer input x, which the adapter's gradient (x^T (dy B^T)) needs as well,
  so the count is what LoRA saves. The adapters' dropout is left out (its masks would add one
  saved input per adapted layer). The largest batch in 80 GB of each.
  """
  base = model_lib.create_model(args.variant, image_size=args.image_size, dtype=jnp.float32)
  new, replay = _inputs(base, 2, args.num_queries, args.max_instances, abstract=True)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  params = jax.eval_shape(base.init, jax.random.PRNGKey(0), new["images"], new["queries"])["params"]
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  images_traced = 2 * new["images"].shape[0]
  full_state = 16 * num_params
  ranks = []
  for rank in args.lora_ranks:
    options = lora_lib.LoraOptions(rank=rank, alpha=2.0 * rank)
    adapters = lora_lib.abstract_adapters(base, options)
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(adapters))
    ranks.append(
      {
        "rank": rank,
        "adapter_parameters": count,
        "adapter_bytes": lora_lib.adapter_bytes(adapters),
        # frozen parameters + adapters, their gradients and Adam moments
        "state_bytes": 4 * num_params + 16 * count,
        "adam_bytes": 8 * count,
      }
    )
    print(
      f"LoRA rank {rank}: {count:,} adapter parameters ({count / num_params:.2%}), "
      f"{lora_lib.adapter_bytes(adapters) / 1e6:.1f} MB",
      flush=True,
    )
  rows = []
  attention = args.attentions[0]
  for dtype in args.dtypes:
    for remat in args.remats:
      model = model_lib.create_model(
        args.variant,
        image_size=args.image_size,
        dtype=getattr(jnp, dtype),
        remat=remat,
        attention=attention,
      )
      t0 = time.time()
      loss = _loss(model, "jax")
      full_act = (
        _residual_bytes(lambda p, b, r, k: loss(p, b, r, k)[0], params, new, replay, key)
        / images_traced
      )
      row = {
        "dtype": dtype,
        "remat": remat,
        "attention": attention,
        "full_activation_bytes_per_image": full_act,
        "full_max_batch_80gb": int((DEVICE_BYTES - full_state) // full_act),
        "lora": [],
      }
      for r in ranks:
        options = lora_lib.LoraOptions(rank=r["rank"], alpha=2.0 * r["rank"])
        adapters = lora_lib.abstract_adapters(base, options)
        lora_loss = _loss(lora_lib.lora_model(model, options, train=False), "jax")

        def fn(a, p, b, rep, k, lora_loss=lora_loss):
          return lora_loss(lora_lib.combine(p, a), b, rep, k)[0]

        act = _residual_bytes(fn, adapters, params, new, replay, key) / images_traced
        row["lora"].append(
          {
            "rank": r["rank"],
            "activation_bytes_per_image": act,
            "max_batch_80gb": int((DEVICE_BYTES - r["state_bytes"]) // act),
          }
        )
      rows.append(row)
      print(
        f"{dtype:9s} remat={remat:33s}: full {full_act / GB:.2f} GB/image, LoRA "
        + ", ".join(f"r{x['rank']} {x['activation_bytes_per_image'] / GB:.2f}" for x in row["lora"])
        + f" GB/image ({time.time() - t0:.0f} s)",
        flush=True,
      )
  return {
    "variant": args.variant,
    "image_size": args.image_size,
    "num_tokens": base.num_tokens,
    "num_queries": args.num_queries,
    "max_instances": args.max_instances,
    "num_parameters": num_params,
    "full_state_bytes": full_state,
    "full_adam_bytes": 8 * num_params,
    "device_bytes": DEVICE_BYTES,
    "ranks": ranks,
    "configs": rows,
  }


# -------------------------------------------------------------------------------- timing


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _peak_memory(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def roofline_chain(n: int) -> int:
  """Matmuls per timed call of `measure_roofline` at size n: about 4e13 FLOPs per call (about
  50 ms at 800 TFLOP/s: far above the launch and timer overheads), between 2 and 64."""
  return min(64, max(2, int(4e13 // (2 * n**3))))


def measure_roofline(n: int = 8192, repeats: int = 5) -> dict:
  """The measured bf16 matmul roofline of the default device (not its spec peak).

  Each timed call runs a chain of `roofline_chain(n)` dependent [n, n] x [n, n] products,
  x <- x @ w, in one jitted `fori_loop`, from random normal inputs with w scaled by 1/sqrt(n)
  (x stays O(1): no overflow, and no constant inputs a kernel could shortcut); bf16 inputs,
  float32 accumulation (the model's matmuls). FLOPs per call: chain * 2 n^3.

  Returns:
    {'n', 'chain', 'flops_per_s' (median over `repeats` calls after one warm-up),
    'flops_per_s_min', 'flops_per_s_max'}.
  """
  chain = roofline_chain(n)
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (n, n), jnp.bfloat16)
  w = (jax.random.normal(kw, (n, n), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)

  def product(_, x):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

  f = jax.jit(lambda x: jax.lax.fori_loop(0, chain, product, x))
  f(x).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  flops = chain * 2 * n**3
  return {
    "n": n,
    "chain": chain,
    "flops_per_s": flops / statistics.median(times),
    "flops_per_s_min": flops / max(times),
    "flops_per_s_max": flops / min(times),
  }


def timed_model(args, dtype=None, remat=None, attention=None):
  """The model at `args`' variant and image size; dtype / remat / attention default to the
  timed ones (`args.dtype`, `args.remat`, `args.attention`)."""
  return model_lib.create_model(
    args.variant,
    image_size=args.image_size,
    dtype=getattr(jnp, dtype or args.dtype),
    remat=remat or args.remat,
    attention=attention or args.attention,
  )


def init_params(model, num_queries: int, max_instances: int):
  """The model's parameters (seed 0) initialised from a 1-image batch: the parameters do not
  depend on the batch, and the init's forward pass then costs least."""
  new, _ = _inputs(model, 2, num_queries, max_instances, abstract=False)
  return jax.jit(model.init)(jax.random.PRNGKey(0), new["images"], new["queries"])["params"]


def init_or_load_params(model, args, new):
  """`args.params_file` (a `checkpointing.save_params` folder written once per run, e.g. by
  benchmarks/gpu.py's `params` section) when set, else `init_params`; `new` gives the shapes."""
  path = getattr(args, "params_file", None)
  if not path:
    return init_params(model, args.num_queries, args.max_instances)
  like = jax.eval_shape(model.init, jax.random.PRNGKey(0), new["images"], new["queries"])
  return checkpointing.load_params(path, like["params"])[0]


def prepare_ours(args, batch: int, matcher: str, dtype: str, remat: str, attention: str):
  """Builds, compiles and warms our train step; returns (run, record) with run() one step."""
  t0 = time.perf_counter()
  model = timed_model(args, dtype, remat, attention)
  new, replay = _inputs(model, batch, args.num_queries, args.max_instances, abstract=False)
  params = init_or_load_params(model, args, new)
  # Progress on stdout (the last line stays the result): a section killed at its time limit
  # then says how far it got.
  print(f"inputs and parameters ready ({time.perf_counter() - t0:.0f} s)", flush=True)
  tx = optax.adamw(1e-4)
  mesh = sharding_lib.create_mesh()
  train_step = step_lib.make_train_step(
    model,
    tx,
    mesh,
    step_lib.StepSpec(loss=LossSpec(**LOSS_CONFIG, matcher=matcher), replay=step_lib.ReplayLoss()),
  )
  # Placed as the trainer places it (replicated, committed): an uncommitted first state would
  # make the second call compile the step again, for the committed outputs of the first.
  holder = {"state": sharding_lib.replicate(step_lib.create_train_state(params, tx), mesh)}
  key = jax.random.PRNGKey(1)

  def run():
    holder["state"], m = train_step(holder["state"], new, replay, key)
    jax.block_until_ready(m)

  t0 = time.perf_counter()
  run()
  first = time.perf_counter() - t0
  print(f"first step (compilation included) {first:.0f} s", flush=True)
  # The first call compiles; the second is a plain step (the same compiled executable), and
  # the timed steps start after it.
  t0 = time.perf_counter()
  run()
  second = time.perf_counter() - t0
  record = {
    "batch": 2 * new["images"].shape[0],
    "matcher": matcher,
    "dtype": dtype,
    "remat": remat,
    "attention": clip_lib.resolve_attention(attention, getattr(jnp, dtype), 64),
    "first_step_s": first,
    "second_step_s": second,
    # Compiled executables of the step after two calls: 1 when the second call reused the
    # first's (jit's private cache counter; the public API has no equivalent).
    "compilations": train_step._cache_size(),  # pylint: disable=protected-access
    # Restored from the run's one initialisation (gpu.py's `params` section), or None.
    "params_file": getattr(args, "params_file", None),
  }
  return run, record


def side_batch(args, batch: int, context_length: int) -> dict[str, np.ndarray]:
  """The one batch both sides of the model-only and HF comparisons use (`numpy_batch`,
  seed 0): `batch` images at `args`' sizes."""
  rng = np.random.default_rng(0)
  return numpy_batch(
    rng, batch, args.image_size, args.num_queries, context_length, args.max_instances
  )


def prepare_ours_model(args, batch: int):
  """Our model's forward + backward of a plain loss, compiled and warmed; (run, record).

  The loss is HF's in `prepare_hf(full=False)`: mean of the squared logits + sum of the
  boxes, over `batch` images with `num_queries` queries each; the forward is the evaluation
  one (no stochastic depth: HF's model has none) and no optimizer update follows.
  """
  model = timed_model(args)
  data = side_batch(args, batch, model.context_length)
  images, queries = jnp.asarray(data["images"]), jnp.asarray(data["queries"])
  params = init_params(model, args.num_queries, args.max_instances)

  def loss(p, x, q):
    out = model.apply({"params": p}, x, q)
    return jnp.mean(jnp.square(out["pred_logits"])) + jnp.sum(out["pred_boxes"])

  grad = jax.jit(jax.value_and_grad(loss))

  def run():
    jax.block_until_ready(grad(params, images, queries))

  record = {
    "batch": batch,
    "dtype": args.dtype,
    "remat": args.remat,
    "attention": clip_lib.resolve_attention(args.attention, getattr(jnp, args.dtype), 64),
  }
  return run, record


def _box_xyxy(torch, b):
  cx, cy, w, h = b.unbind(-1)
  return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def _giou(torch, a, b):
  """Generalised IoU of every box of a [N, 4] with every box of b [M, 4] (xyxy): [N, M]."""
  area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
  area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
  lt, rb = torch.max(a[:, None, :2], b[None, :, :2]), torch.min(a[:, None, 2:], b[None, :, 2:])
  inter = (rb - lt).clamp(min=0).prod(-1)
  union = area_a[:, None] + area_b[None, :] - inter
  lt_c, rb_c = torch.min(a[:, None, :2], b[None, :, :2]), torch.max(a[:, None, 2:], b[None, :, 2:])
  hull = (rb_c - lt_c).clamp(min=0).prod(-1)
  return inter / union - (hull - union) / hull


def hf_detection_loss(torch, logits, pred_boxes, labels, boxes):
  """The detection loss of our step (focal + L1 + GIoU after Hungarian matching, per image,
  all weights 1, focal alpha 0.3 / gamma 2) in PyTorch, matched with SciPy per image as HF's
  DETR-family losses do; logits [B, T, Q], pred_boxes [B, T, 4] cxcywh, labels [B, M, Q]
  (column 0 = padding instance), boxes [B, M, 4]. Returns the mean over images (a scalar)."""
  from scipy import optimize  # noqa: PLC0415

  alpha, gamma = LOSS_CONFIG["focal_alpha"], LOSS_CONFIG["focal_gamma"]
  total = 0.0
  for b in range(logits.shape[0]):
    real = labels[b, :, 1:].sum(-1) > 0
    tgt_labels, tgt_boxes = labels[b, real, 1:], _box_xyxy(torch, boxes[b, real])
    x = logits[b, :, 1:].float()
    prob = x.sigmoid()
    pos = alpha * (1 - prob) ** gamma * -torch.nn.functional.logsigmoid(x)
    neg = (1 - alpha) * prob**gamma * -torch.nn.functional.logsigmoid(-x)
    src = _box_xyxy(torch, pred_boxes[b].float())
    # scenic's cost (losses.matching_cost): focal pos - neg summed over the target's labels,
    # L1 between cxcywh boxes, minus the GIoU.
    cost = (pos - neg) @ tgt_labels.T + torch.cdist(pred_boxes[b].float(), boxes[b, real], p=1)
    cost = cost - _giou(torch, src, tgt_boxes)
    rows, cols = optimize.linear_sum_assignment(cost.detach().cpu().numpy())
    rows, cols = torch.as_tensor(rows), torch.as_tensor(cols)
    target = torch.zeros_like(x)
    target[rows] = tgt_labels[cols]
    focal = torch.where(target > 0, pos, neg).sum() / target.sum().clamp(min=1)
    num_boxes = max(len(cols), 1)
    l1 = (src[rows] - tgt_boxes[cols]).abs().sum() / num_boxes
    giou = (1 - torch.diagonal(_giou(torch, src[rows], tgt_boxes[cols]))).sum() / num_boxes
    total = total + focal + l1 + giou
  return total / logits.shape[0]


def _hf_checkpointing(model) -> bool:
  """Whether HF's activation checkpointing is on (transformers 5 renamed the property;
  the old name warns)."""
  on = getattr(model, "is_activation_checkpointing", None)
  return bool(model.is_gradient_checkpointing if on is None else on)


def prepare_hf(args, batch: int, full: bool):
  """HF OwlViT's forward + backward, warmed up; returns (run, record).

  `full=False`: the plain loss of `prepare_ours_model` (mean squared logits + sum of boxes).
  `full=True`: the full step, `hf_detection_loss` (SciPy matching, focal + L1 + GIoU) and
  a `torch.optim.AdamW` update. bf16 autocast on CUDA, float32 on CPU; HF's default
  attention implementation (recorded). Imports no JAX array code: XLA is never started here.
  """
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  torch.set_num_threads(args.threads)
  cfg = model_lib.get_variant_config(args.variant).replace(image_size=args.image_size)
  hf_config = convert.model_config_to_hf_config(cfg)
  torch.manual_seed(0)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.OwlViTForObjectDetection(hf_config).to(device).train()
  data = side_batch(args, batch, cfg.context_length)
  images = torch.as_tensor(data["images"]).permute(0, 3, 1, 2).contiguous().to(device)
  # The same B * Q query rows as ours; HF finds each row's end at its largest id.
  ids = torch.randint(3, 400, (batch * args.num_queries, cfg.context_length), device=device)
  ids[:, -1] = cfg.vocab_size - 1
  mask = torch.ones_like(ids)
  labels = torch.as_tensor(data["labels"], device=device)
  boxes = torch.as_tensor(data["boxes"], device=device)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if full else None
  autocast = (
    torch.autocast("cuda", dtype=torch.bfloat16)
    if device == "cuda"
    else torch.autocast("cpu", enabled=False)
  )

  def run():
    model.zero_grad(set_to_none=True)
    with autocast:
      out = model(input_ids=ids, pixel_values=images, attention_mask=mask)
      if full:
        loss = hf_detection_loss(torch, out.logits, out.pred_boxes, labels, boxes)
      else:
        loss = out.logits.float().square().mean() + out.pred_boxes.float().sum()
    loss.backward()
    if optimizer is not None:
      optimizer.step()
    if device == "cuda":
      torch.cuda.synchronize()

  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  record = {
    "batch": batch,
    "dtype": "bf16 autocast" if device == "cuda" else "float32",
    "attention": getattr(model.config, "_attn_implementation", None),
    # HF's gradient checkpointing (its remat) stays off: the like-for-like model-alone
    # comparison has no remat on either side (issue 48 item 4).
    "remat": "block" if _hf_checkpointing(model) else "none",
    "torch_threads": torch.get_num_threads(),
  }

  def peak():
    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None

  return run, record, peak


# The timed sides: who, what work, and whether its loss / update are the full step's.
SIDES = {
  "ours_model": "owl_cl model: forward + backward, plain loss",
  "ours_step": "owl_cl step: forward, DER++ over [new ; replay], matching, loss, backward, AdamW",
  "hf_model": "HF OwlViT: forward + backward, plain loss",
  "hf_step": "HF OwlViT step: forward, SciPy matching, focal + L1 + GIoU, backward, AdamW",
  "hf_model_after_jax": "HF OwlViT: forward + backward, plain loss, after our model ran in "
  "the same process (the old method)",
}


def time_side(args, side: str, batch: int) -> dict:
  """One side of the comparison timed in this process (`--time-one`): warm-up calls
  (compilation included) excluded, then `args.repeats` timed steps (seconds)."""
  peak = None
  if side == "ours_model":
    run, record = prepare_ours_model(args, batch)
  elif side.startswith("ours_step"):
    run, record = prepare_ours(
      args, batch, side.split(":")[1], args.dtype, args.remat, args.attention
    )
  elif side in ("hf_model", "hf_step"):
    run, record, peak = prepare_hf(args, batch, full=side == "hf_step")
  elif side == "hf_model_after_jax":
    # The old method's condition: HF timed in a process where XLA:CPU has already run our
    # model (its thread pool alive beside torch's).
    run_ours, _ = prepare_ours_model(args, batch)
    run_ours()
    run, record, peak = prepare_hf(args, batch, full=False)
  elif side == "roofline":
    return {"side": side, **measure_roofline(args.peak_matmul)}
  else:
    raise ValueError(f"unknown side {side!r}; known: {sorted(SIDES)} (ours_step:<matcher>)")
  t0 = time.perf_counter()
  if "first_step_s" not in record:  # prepare_ours already ran its two warm-up steps
    run()
    record["first_step_s"] = time.perf_counter() - t0
    run()
  times = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  record.update(side=side, step_s_all=times, process_threads=len(os.listdir("/proc/self/task")))
  if side.startswith("ours"):
    record["peak_bytes"] = _peak_memory(jax.devices()[0])
  else:
    record["peak_bytes"] = peak()
  return record


def thread_settings(threads: int) -> dict:
  """The environment and CPU set that give a fresh process `threads` compute threads.

  Both frameworks size their pools from the CPUs the process may run on, so the child is
  pinned to the first `threads` of this process's CPUs (`OWL_CL_BENCHMARK_CPUS`, applied by
  `os.sched_setaffinity` when this script starts); on top,
  torch gets `OMP_NUM_THREADS` / `MKL_NUM_THREADS` (and `torch.set_num_threads` in the child)
  and XLA:CPU `--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=T`.
  """
  cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
  flags = f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={threads}"
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
  if cpus:
    env[CPUS_VARIABLE] = ",".join(map(str, cpus[:threads]))
  return env


def _side_argv(args) -> list[str]:
  """The command-line settings a `--time-one` child needs to rebuild `args`."""
  return [
    f"--variant={args.variant}",
    f"--image-size={args.image_size}",
    f"--num-queries={args.num_queries}",
    f"--max-instances={args.max_instances}",
    f"--dtype={args.dtype}",
    f"--remat={args.remat}",
    f"--attention={args.attention}",
    f"--repeats={args.repeats}",
    f"--threads={args.threads}",
    f"--peak-matmul={args.peak_matmul}",
  ]


def time_in_fresh_process(args, side: str, batch: int, timeout: float | None = None) -> dict:
  """`time_side` in a new Python process with `args.threads` threads (`thread_settings`).

  Returns its record, or {'side', 'batch', 'error'} when the child failed (the last lines of
  its output, e.g. an out-of-memory) or ran past `timeout` seconds.
  """
  env = thread_settings(args.threads)
  cmd = [sys.executable, os.path.abspath(__file__), f"--time-one={side}"]
  cmd += _side_argv(args) + [f"--time-batches={batch}"]
  try:
    proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      env=env,
      timeout=timeout,
    )
  except subprocess.TimeoutExpired:
    return {"side": side, "batch": batch, "error": f"timed out after {timeout:.0f} s"}
  if proc.returncode:
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return {"side": side, "batch": batch, "error": f"exit {proc.returncode}: {tail}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(records: list[dict]) -> dict:
  """One side's records from several processes pooled: the median step and its min-max."""
  times = [t for r in records for t in r["step_s_all"]]
  out = dict(records[0])
  out.update(
    step_s_all=times,
    step_s=statistics.median(times),
    step_s_min=min(times),
    step_s_max=max(times),
    processes=len(records),
    images_per_s=out["batch"] / statistics.median(times),
  )
  return out


def compile_step(args, batch: int) -> dict:
  """Traces, lowers and compiles our train step from abstract inputs (nothing executes).

  Returns {'lower_s', 'compile_s'} in seconds: tracing + lowering to StableHLO, then XLA's
  compilation, which the persistent compilation cache (`--cache-dir`) replaces by a read.
  No parameters are allocated, so this runs at L/14 840 px on any host.
  """
  model = timed_model(args)
  new, replay = _inputs(model, batch, args.num_queries, args.max_instances, abstract=True)
  tx = optax.adamw(1e-4)
  train_step = step_lib.make_train_step(
    model,
    tx,
    sharding_lib.create_mesh(),
    step_lib.StepSpec(loss=LossSpec(**LOSS_CONFIG, matcher="jax"), replay=step_lib.ReplayLoss()),
  )
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), new["images"], new["queries"])
  state = jax.eval_shape(lambda p: step_lib.create_train_state(p, tx), params["params"])
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  t0 = time.perf_counter()
  lowered = train_step.lower(state, new, replay, key)
  t1 = time.perf_counter()
  lowered.compile()
  return {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}


def compile_in_fresh_process(args, batch: int, cache_dir: str) -> dict:
  """`compile_step` in a new Python process with the persistent compilation cache at
  `cache_dir` (a new process has no in-memory cache: only the persistent one can help)."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--compile-only",
    f"--variant={args.variant}",
    f"--image-size={args.image_size}",
    f"--num-queries={args.num_queries}",
    f"--max-instances={args.max_instances}",
    f"--time-batches={batch}",
    f"--cache-dir={cache_dir}",
    f"--dtype={args.dtype}",
    f"--remat={args.remat}",
    f"--attention={args.attention}",
  ]
  out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def compile_cache(args) -> dict:
  """Compile time of the step in a fresh process with an empty persistent cache (cold), then
  in a second fresh process sharing it (warm): what a resumed or repeated run pays."""
  batch = args.time_batches[-1]
  # A new empty folder (inside --cache-dir when given): the cold compile must find nothing.
  if args.cache_dir:
    os.makedirs(args.cache_dir, exist_ok=True)
  cache_dir = tempfile.mkdtemp(prefix="compile_cache_", dir=args.cache_dir)
  cold = compile_in_fresh_process(args, batch, cache_dir)
  warm = compile_in_fresh_process(args, batch, cache_dir)
  out = {
    "backend": jax.default_backend(),
    "batch": batch,
    "dtype": args.dtype,
    "remat": args.remat,
    "attention": args.attention,
    "cold": cold,
    "warm": warm,
    "cache_files": len(os.listdir(cache_dir)),
  }
  print(f"compile cache: {out}", flush=True)
  return out


def step_flops_of(args, row: dict) -> float | None:
  """FLOPs per image our step executes at `row`'s dtype and remat (recomputation included),
  from the arithmetic's config rows (`args.step_flops`, None without them); XLA-attention
  rows preferred: cuDNN's are modelled off a GPU and its kernel's FLOPs are not in the HLO."""
  rows = [
    r
    for r in getattr(args, "step_flops", None) or []
    if r["dtype"] == row.get("dtype") and r["remat"] == row.get("remat")
  ]
  rows.sort(key=lambda r: r["attention"] != "xla")
  return rows[0]["step_flops_per_image"] if rows else None


def timing(args) -> dict:
  """Every side of `args.sides` at every `args.time_batches`, each in its own fresh process
  (`time_in_fresh_process`), the sides one after the other, `args.rounds` times; the ratios
  HF step time / ours of the model alone and of the full step."""
  result = {"backend": args.backend, "threads": args.threads, "rows": [], "ratios": []}
  # MFU is against the device's spec peak (device_info.SPEC_PEAKS); the measured matmul
  # roofline is recorded beside it, never used as the denominator.
  result["device"] = device_info.describe()
  peak = result["device"]["spec_peak_bf16_flops"]
  if args.backend != "cpu":
    result["roofline"] = time_in_fresh_process(args, "roofline", 0)
  for batch in args.time_batches:
    records = {side: [] for side in args.sides}
    for r in range(args.rounds):
      for side in args.sides:
        print(f"batch {batch}, round {r + 1}/{args.rounds}: {side}", flush=True)
        records[side].append(time_in_fresh_process(args, side, batch))
    rows = {}
    for side, recs in records.items():
      failed = [r for r in recs if "error" in r]
      if failed:
        rows[side] = failed[0]
        print(f"  {side} failed: {failed[0]['error']}", flush=True)
        continue
      rows[side] = summarize(recs)
      if peak and args.model_flops_per_image and side != "hf_step":
        rows[side]["mfu"] = rows[side]["images_per_s"] * args.model_flops_per_image / peak
      hardware = step_flops_of(args, rows[side]) if side.startswith("ours_step") else None
      if peak and hardware:
        # HFU: the FLOPs the configuration executes (remat's recomputation included).
        rows[side]["hfu"] = rows[side]["images_per_s"] * hardware / peak
        rows[side]["step_flops_per_image"] = hardware
      print(f"  {side}: {rows[side]['step_s']:.3f} s", flush=True)
    result["rows"] += list(rows.values())
    ok = {k: v for k, v in rows.items() if "error" not in v}
    ours_steps = [v for k, v in ok.items() if k.startswith("ours_step")]
    ratio = {"batch": batch}
    if "ours_model" in ok and "hf_model" in ok:
      ratio["model_only"] = ok["hf_model"]["step_s"] / ok["ours_model"]["step_s"]
    if ours_steps and "hf_step" in ok:
      best = min(ours_steps, key=lambda v: v["step_s"])
      ratio["full_step"] = ok["hf_step"]["step_s"] / best["step_s"]
      ratio["full_step_ours"] = best["side"]
    if ours_steps and "hf_model" in ok:
      best = min(ours_steps, key=lambda v: v["step_s"])
      ratio["ours_step_over_hf_model"] = ok["hf_model"]["step_s"] / best["step_s"]
    result["ratios"].append(ratio)
  return result


# -------------------------------------------------------------------------------- output


def _fmt_gb(x):
  return "-" if x is None else f"{x / GB:.2f}"


def render_lora(a: dict) -> list[str]:
  """The LoRA arithmetic as Markdown lines (`lora_arithmetic`)."""
  n = a["num_parameters"]
  lines = [
    f"## LoRA vs full fine-tuning: {a['variant']} at {a['image_size']} px ({a['num_tokens']} "
    f"tokens, {a['num_queries']} queries, {a['max_instances']} instances per image)",
    "",
    "Adapters on attention q/k/v/out and MLP Dense of both towers, alpha = 2 x rank; "
    "float32 parameters, gradients and Adam moments.",
    "",
    "| | trained parameters | checkpoint MB | Adam moments GB | resident state GB |",
    "|---|---|---|---|---|",
    f"| full fine-tuning | {n:,} | {4 * n / 1e6:,.0f} (whole model) | "
    f"{_fmt_gb(a['full_adam_bytes'])} | {_fmt_gb(a['full_state_bytes'])} |",
  ]
  for r in a["ranks"]:
    lines.append(
      f"| LoRA rank {r['rank']} | {r['adapter_parameters']:,} "
      f"({r['adapter_parameters'] / n:.2%}) | {r['adapter_bytes'] / 1e6:.1f} (adapters) | "
      f"{_fmt_gb(r['adam_bytes'])} | {_fmt_gb(r['state_bytes'])} |"
    )
  head = " | ".join(f"LoRA r{r['rank']} GB/image (batch in 80 GB)" for r in a["ranks"])
  lines += [
    "",
    "Saved activations per image ([new ; replay] step, DER++):",
    "",
    f"| dtype | remat | attention | full FT GB/image (batch in 80 GB) | {head} |",
    "|---|---|---|---|" + "---|" * len(a["ranks"]),
  ]
  for row in a["configs"]:
    cells = " | ".join(
      f"{_fmt_gb(x['activation_bytes_per_image'])} ({x['max_batch_80gb']})" for x in row["lora"]
    )
    lines.append(
      f"| {row['dtype']} | {row['remat']} | {row['attention']} | "
      f"{_fmt_gb(row['full_activation_bytes_per_image'])} ({row['full_max_batch_80gb']}) | "
      f"{cells} |"
    )
  lines.append("")
  return lines


def render_markdown(results: dict) -> str:
  lines = [f"# Train-step benchmark ({results['mode']})", ""]
  env = results["environment"]
  lines += [
    f"Machine: {env['machine']}; devices: {env['devices']}; jax {env['jax']}, "
    f"torch {env.get('torch')}, transformers {env.get('transformers')}; {env['date']}.",
    "",
  ]
  if results.get("note"):
    lines += [results["note"], ""]
  a = results.get("arithmetic")
  if a:
    lines += [
      f"## Arithmetic: {a['variant']} at {a['image_size']} px ({a['num_tokens']} tokens, "
      f"{a['num_queries']} queries, {a['max_instances']} instances per image)",
      "",
      f"Parameters {a['num_parameters']:,}; parameters + gradients + Adam moments "
      f"(float32) {_fmt_gb(a['fixed_bytes_total'])} GB. Model FLOPs per image (no remat): "
      f"train step {a['model_flops_per_image_train'] / 1e12:.2f} TFLOP, eval forward "
      f"{a['model_flops_per_image_eval'] / 1e12:.2f} TFLOP.",
      "",
      "| dtype | remat | attention | saved activations GB/image | step TFLOP/image | "
      + " | ".join(f"GB at batch {b}" for b in results["batches"])
      + " | largest batch in 80 GB |",
      "|---|---|---|---|---|" + "---|" * len(results["batches"]) + "---|",
    ]
    for r in a["configs"]:
      att = r["attention"] + (" (modelled)" if r["attention_modelled"] else "")
      totals = " | ".join(_fmt_gb(r["total_bytes_by_batch"][b]) for b in results["batches"])
      lines.append(
        f"| {r['dtype']} | {r['remat']} | {att} | {_fmt_gb(r['activation_bytes_per_image'])} "
        f"| {r['step_flops_per_image'] / 1e12:.2f} | {totals} | {r['max_batch_80gb']} |"
      )
    lines.append("")
  if results.get("lora"):
    lines += render_lora(results["lora"])
  t = results.get("timing")
  if t:
    lines += render_timing(t)
  c = results.get("compile_cache")
  if c:
    lines += [
      f"## Compilation on {c['backend']} (persistent cache)",
      "",
      f"The train step ({c['dtype']}, remat {c['remat']}, attention {c['attention']}, "
      f"batch {c['batch']}) traced, lowered and compiled from abstract inputs in a fresh "
      "process with an empty persistent compilation cache (cold), then in a second fresh "
      f"process sharing it (warm; {c['cache_files']} cache entries).",
      "",
      "| | lower s | compile s |",
      "|---|---|---|",
      f"| cold | {c['cold']['lower_s']:.1f} | {c['cold']['compile_s']:.1f} |",
      f"| warm | {c['warm']['lower_s']:.1f} | {c['warm']['compile_s']:.1f} |",
      "",
      f"Warm / cold compile time: **{c['warm']['compile_s'] / c['cold']['compile_s']:.3f}**.",
      "",
    ]
  return "\n".join(lines)


def render_timing(t: dict) -> list[str]:
  """The timing table and the ratios (Markdown lines)."""
  device = t.get("device") or {}
  peak = device.get("spec_peak_bf16_flops")
  roof = (t.get("roofline") or {}).get("flops_per_s")
  lines = [
    f"## Timing on {t['backend']} ({t['threads']} threads per process)",
    "",
    f"Device kind {device.get('device_kind', '-')!r}; MFU against its spec bf16 peak "
    + (f"{peak / 1e12:.1f} TFLOP/s ({device['spec_peak_source']})" if peak else "(none known)")
    + (
      f"; measured matmul roofline {roof / 1e12:.1f} TFLOP/s (not the MFU's denominator)"
      if roof
      else ""
    )
    + ".",
    "",
    "Each row is one side in its own fresh process(es) (`processes`), warm-up steps excluded; "
    "step s is the median over all timed steps, min-max beside it.",
    "",
    "| side | work | batch | matcher | dtype | remat | attention | step s | min-max s | images/s "
    "| first step s | peak GB | MFU | HFU | processes |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in t["rows"]:
    side = r["side"]
    work = SIDES[side.split(":")[0]]
    if "error" in r:
      lines.append(f"| {side} | {work} | {r['batch']} | failed: {r['error']} |" + " |" * 11)
      continue
    mfu, hfu = (f"{r[k]:.1%}" if k in r else "-" for k in ("mfu", "hfu"))
    lines.append(
      f"| {side} | {work} | {r['batch']} | {r.get('matcher', '-')} | {r['dtype']} | "
      f"{r.get('remat', '-')} | {r.get('attention') or '-'} | {r['step_s']:.3f} | "
      f"{r['step_s_min']:.3f}-{r['step_s_max']:.3f} | {r['images_per_s']:.2f} | "
      f"{r['first_step_s']:.1f} | {_fmt_gb(r['peak_bytes'])} | {mfu} | {hfu} | "
      f"{r['processes']} |"
    )
  lines.append("")
  for r in t["ratios"]:
    parts = []
    if "model_only" in r:
      parts.append(f"model only (forward + backward) **{r['model_only']:.2f}x**")
    if "full_step" in r:
      parts.append(f"full step **{r['full_step']:.2f}x** ({r['full_step_ours']})")
    if "ours_step_over_hf_model" in r:
      parts.append(
        f"our full step against HF's forward + backward {r['ours_step_over_hf_model']:.2f}x"
      )
    if parts:
      lines.append(f"Batch {r['batch']}, HF step time / ours: " + "; ".join(parts) + ".")
  lines.append("")
  return lines


def _environment() -> dict:
  env = {
    "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
    + f", {os.cpu_count()} logical CPUs",
    "devices": [str(d) for d in jax.devices()],
    "jax": jax.__version__,
    "python": platform.python_version(),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
  }
  # The installed versions from the packages' metadata (the same strings as `__version__`,
  # local tags such as '+cu130' included), without importing torch (2 s or more).
  try:
    env.update({name: importlib.metadata.version(name) for name in ("torch", "transformers")})
  except importlib.metadata.PackageNotFoundError:
    pass  # the HF sides are skipped: no versions to report
  return env


def default_threads() -> int:
  """The CPUs this process may run on (its affinity), else `os.cpu_count()`."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def parse_args(argv=None) -> argparse.Namespace:
  """The command line with every mode's defaults filled in (the module docstring)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="vit_b32 at 384 px, batch 4, on CPU")
  p.add_argument(
    "--smoke", action="store_true", help="every path at a tiny size in seconds (tests, CI)"
  )
  p.add_argument("--variant", default=None, help="default vit_l14 (quick vit_b32, smoke tiny)")
  p.add_argument("--image-size", type=int, default=None)
  p.add_argument("--num-queries", type=int, default=None)
  p.add_argument("--max-instances", type=int, default=None)
  p.add_argument("--batches", default=None)
  p.add_argument("--time-batches", default=None, help="batches to time (default: see --quick)")
  p.add_argument("--dtypes", default=None)
  p.add_argument("--remats", default=None)
  p.add_argument("--attentions", default=None)
  p.add_argument("--dtype", default=None, help="timed dtype (default bfloat16; quick float32)")
  p.add_argument("--remat", default=None, help="timed remat (default block; quick none)")
  p.add_argument("--attention", default="auto")
  p.add_argument("--matchers", default=None, help="timed matchers (default scipy,jax)")
  p.add_argument("--repeats", type=int, default=None, help="timed steps per process")
  p.add_argument("--rounds", type=int, default=1, help="fresh processes per side")
  p.add_argument("--threads", type=int, default=None, help="compute threads per side")
  p.add_argument("--peak-matmul", type=int, default=8192, help=argparse.SUPPRESS)
  p.add_argument("--params-file", default=None, help=argparse.SUPPRESS)
  p.add_argument("--skip-arithmetic", action="store_true")
  p.add_argument("--skip-timing", action="store_true")
  p.add_argument(
    "--lora-ranks", default=None, help="LoRA ranks of the LoRA arithmetic (default 8,16; smoke 2)"
  )
  p.add_argument("--skip-lora", action="store_true", help="no LoRA arithmetic")
  p.add_argument(
    "--lora-only",
    action="store_true",
    help="only the LoRA arithmetic, written to step_lora[_<mode>].json/.md",
  )
  p.add_argument("--skip-hf", action="store_true")
  p.add_argument("--skip-model-only", action="store_true")
  p.add_argument(
    "--skip-step", action="store_true", help="time the model alone only (no full-step sides)"
  )
  p.add_argument(
    "--diagnose",
    action="store_true",
    help="also time HF in a process where our model ran first (the old, shared-process method)",
  )
  p.add_argument("--cache-dir", default=None, help="persistent compilation cache")
  p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--time-one", default=None, help=argparse.SUPPRESS)
  p.add_argument(
    "--compile-cache",
    action="store_true",
    help="compile the step (largest --time-batches) in two fresh processes sharing a new "
    "persistent cache folder (under --cache-dir, else the system's temp): cold vs warm",
  )
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  p.add_argument("--note", default=None, help="conditions of the run, written under the machine")
  args = p.parse_args(argv)
  quick, smoke = args.quick, args.smoke
  args.variant = args.variant or ("tiny" if smoke else "vit_b32" if quick else "vit_l14")
  # The variant's own size: 840 for vit_l14 (the paper), 1008 for owlv2_l14 (5,185 tokens).
  args.image_size = args.image_size or (
    32 if smoke else 384 if quick else model_lib.get_variant_config(args.variant).image_size
  )
  args.num_queries = args.num_queries or (4 if smoke else 8 if quick else 126)
  args.max_instances = args.max_instances or (2 if smoke else 8 if quick else 100)
  args.batches = [
    int(b) for b in (args.batches or ("1,2" if smoke else "1,2,4,8,16,32")).split(",")
  ]
  args.time_batches = [
    int(b)
    for b in (args.time_batches or ("2" if smoke else "4" if quick else "4,8,16,32")).split(",")
  ]
  args.dtypes = (args.dtypes or ("float32" if smoke else "float32,bfloat16")).split(",")
  args.remats = (
    args.remats or ("none" if smoke else "none,block,dots_with_no_batch_dims_saveable")
  ).split(",")
  args.attentions = (args.attentions or ("xla" if smoke else "xla,cudnn")).split(",")
  args.dtype = args.dtype or ("float32" if quick or smoke else "bfloat16")
  args.remat = args.remat or ("none" if quick or smoke else "block")
  args.matchers = (args.matchers or ("jax" if smoke else "scipy,jax")).split(",")
  args.repeats = args.repeats or (1 if smoke else 3 if quick else 10)
  args.lora_ranks = [int(r) for r in (args.lora_ranks or ("2" if smoke else "8,16")).split(",")]
  args.threads = args.threads or default_threads()
  return args


def timed_sides(args) -> list[str]:
  """The sides `timing` runs: the model alone (ours, HF) unless --skip-model-only, the full
  step (ours per matcher, HF) unless --skip-step, HF's only without --skip-hf.

  Raises:
    ValueError: --skip-model-only with --skip-step (nothing left to time).
  """
  if args.skip_model_only and args.skip_step:
    raise ValueError("--skip-model-only and --skip-step leave nothing to time")
  sides = [] if args.skip_model_only else ["ours_model"]
  sides += [] if args.skip_step else [f"ours_step:{m}" for m in args.matchers]
  if not args.skip_hf:
    sides += [] if args.skip_model_only else ["hf_model"]
    sides += [] if args.skip_step else ["hf_step"]
    sides += ["hf_model_after_jax"] if args.diagnose else []
  return sides


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  if args.compile_only:
    r = compile_step(args, args.time_batches[0])
    print(json.dumps(r), flush=True)
    return r
  if args.time_one:
    r = time_side(args, args.time_one, args.time_batches[0])
    print(json.dumps(r), flush=True)
    return r
  # Bad settings fail here, before any work.
  model_lib.create_model(
    args.variant, dtype=getattr(jnp, args.dtype), remat=args.remat, attention=args.attention
  )
  for m in args.matchers:
    losses.resolve_matcher(m)
  if args.rounds < 1 or args.repeats < 1 or args.threads < 1:
    raise ValueError(
      f"--rounds, --repeats and --threads must be >= 1, got {args.rounds}, {args.repeats}, "
      f"{args.threads}"
    )
  args.sides = timed_sides(args)
  args.backend = jax.default_backend()
  mode = "smoke" if args.smoke else "quick" if args.quick else "full"
  results: dict[str, Any] = {
    "mode": mode,
    "environment": _environment(),
    "batches": args.batches,
  }
  if args.note:
    results["note"] = args.note
  if args.lora_only:
    results["lora"] = lora_arithmetic(args)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "step_lora" if mode == "full" else f"step_lora_{mode}")
    utils.write_report(stem, results, render_markdown(results))
    print(f"wrote {stem}.json and {stem}.md", flush=True)
    return results
  if not args.skip_arithmetic:
    results["arithmetic"] = arithmetic(args, args.dtypes, args.remats, args.attentions)
  if not args.skip_arithmetic and not args.skip_lora:
    results["lora"] = lora_arithmetic(args)
  args.model_flops_per_image = (results.get("arithmetic") or {}).get("model_flops_per_image_train")
  args.step_flops = (results.get("arithmetic") or {}).get("configs")
  on_accelerator = args.backend != "cpu"
  if not args.skip_timing and (mode != "full" or on_accelerator):
    results["timing"] = timing(args)
  elif not args.skip_timing:
    results["timing_skipped"] = "no accelerator: real-size timing needs a GPU (--quick times here)"
  if args.compile_cache:
    results["compile_cache"] = compile_cache(args)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "step" if mode == "full" else f"step_{mode}")
  if set(results) <= {"mode", "environment", "batches", "timing_skipped", "compile_cache"}:
    # Only the compilation was measured: its own files, the full results stay as they are.
    stem += "_compile"
  utils.write_report(stem, results, render_markdown(results))
  print(f"wrote {stem}.json and {stem}.md", flush=True)
  return results


if __name__ == "__main__":
  main()

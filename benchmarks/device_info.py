"""What a GPU result file must say about its device, and MFU / HFU against the spec peak.

* `describe()`: the device a result was measured on: JAX's `device_kind` and platform, and on
  an NVIDIA GPU `nvidia-smi`'s name, memory, driver and clocks (current and maximum SM and
  memory clocks: a card held at lower clocks gives a lower figure).
* `spec_peak(kind)`: the dense bf16 matmul peak of a device kind from its vendor's published
  figures (`SPEC_PEAKS`, each row with its source), the MFU / HFU denominator. A measured
  roofline (`benchmarks/gpu.py`'s `roofline` section) is reported beside it, never instead.
* `utilization(...)`: MFU (model FLOPs: the no-remat step's) and HFU (hardware FLOPs: with
  the recomputation of rematerialised blocks) per second over that peak (Chowdhery et al.
  2022, "PaLM", appendix B: MFU counts only the model's FLOPs, HFU also the recomputed ones).

Imports no JAX at module level: the tables and arithmetic are testable without a device.
"""

from __future__ import annotations

import subprocess

# Dense (no structured sparsity) bf16 tensor-core / MXU peaks in FLOP/s, keyed by a substring
# of JAX's `device_kind`; the first matching row wins, so the more specific names come first.
# NVIDIA's datasheets list bf16 "with sparsity": the dense figure is half of it.
SPEC_PEAKS: tuple[tuple[str, float, str], ...] = (
  (
    "H100 PCIe",
    756e12,
    "NVIDIA H100 datasheet (H100 PCIe: BF16 Tensor Core 1,513 TFLOPS with sparsity)",
  ),
  (
    "H100 NVL",
    835e12,
    "NVIDIA H100 datasheet (H100 NVL: BF16 Tensor Core 1,671 TFLOPS with sparsity)",
  ),
  (
    "H100",
    989.4e12,
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'H100 SXM5': peak BF16 "
    "Tensor TFLOPS 989.4 (1,978.9 with sparsity)",
  ),
  (
    "H200",
    989.4e12,
    "NVIDIA H200 datasheet (H200 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity; the "
    "H100 SXM5's tensor cores and clocks)",
  ),
  (
    "A100",
    312e12,
    "NVIDIA A100 datasheet (BF16 Tensor Core 312 TFLOPS, 624 with sparsity)",
  ),
  ("TPU v4", 275e12, "Google Cloud TPU v4 documentation (275 TFLOPS bf16 per chip)"),
  ("TPU v5 lite", 197e12, "Google Cloud TPU v5e documentation (197 TFLOPS bf16 per chip)"),
  ("TPU v5", 459e12, "Google Cloud TPU v5p documentation (459 TFLOPS bf16 per chip)"),
  ("TPU v6 lite", 918e12, "Google Cloud TPU v6e documentation (918 TFLOPS bf16 per chip)"),
)

NVIDIA_SMI_FIELDS = (
  "name",
  "memory.total",
  "driver_version",
  "clocks.sm",
  "clocks.max.sm",
  "clocks.mem",
  "clocks.max.mem",
  "power.limit",
)


def spec_peak(kind: str) -> tuple[float, str] | None:
  """The dense bf16 peak of a device kind and its source, or None when the table has none.

  Args:
    kind: `jax.devices()[0].device_kind`, e.g. 'NVIDIA H100 80GB HBM3', 'NVIDIA H200',
      'TPU v5 lite'.

  Returns:
    (FLOP/s, source sentence) of the first `SPEC_PEAKS` row whose key `kind` contains
    (case-sensitive: device kinds are spelled by their drivers), else None (a CPU, or a card
    not in the table: MFU is then not reported rather than guessed).
  """
  for key, flops, source in SPEC_PEAKS:
    if key in kind:
      return flops, source
  return None


def utilization(
  images_per_s: float, model_flops: float, hardware_flops: float | None, peak: float | None
) -> dict[str, float | None]:
  """MFU and HFU of a step.

  Args:
    images_per_s: images (new + replayed) per second of the timed step.
    model_flops: FLOPs per image of the step without rematerialisation (forward + backward).
    hardware_flops: FLOPs per image the configured step executes (with remat's recomputed
      forward passes), or None when not counted.
    peak: the device's spec peak in FLOP/s (`spec_peak`), or None.

  Returns:
    {'mfu': images/s x model FLOPs / peak, 'hfu': images/s x hardware FLOPs / peak}, as
    fractions; None where an input is missing.
  """
  if not peak:
    return {"mfu": None, "hfu": None}
  return {
    "mfu": images_per_s * model_flops / peak,
    "hfu": None if hardware_flops is None else images_per_s * hardware_flops / peak,
  }


def parse_nvidia_smi(text: str) -> list[dict[str, str]]:
  """`nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader` output, one dict per
  GPU line ({field: value as printed, e.g. '81559 MiB', '1980 MHz'}).

  Raises:
    ValueError: a line without one value per field.
  """
  rows = []
  for line in text.strip().splitlines():
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(NVIDIA_SMI_FIELDS):
      raise ValueError(
        f"nvidia-smi line {line!r}: {len(values)} values for {len(NVIDIA_SMI_FIELDS)} fields"
      )
    rows.append(dict(zip(NVIDIA_SMI_FIELDS, values)))
  return rows


def nvidia_smi() -> list[dict[str, str]] | str:
  """Each GPU's `NVIDIA_SMI_FIELDS` from `nvidia-smi`, or why there are none (a string)."""
  cmd = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
  except (OSError, subprocess.SubprocessError) as e:
    return f"nvidia-smi unavailable: {type(e).__name__}"
  return parse_nvidia_smi(out.stdout)


def describe() -> dict:
  """The device of this process: JAX's view and nvidia-smi's, with the spec peak if known.

  Returns:
    {'device_kind', 'platform', 'device_count', 'nvidia_smi' (list of dicts, or a string
    saying why not), 'spec_peak_bf16_flops' (FLOP/s or None), 'spec_peak_source'}.
  """
  import jax  # noqa: PLC0415 (the tables above need no JAX)

  device = jax.devices()[0]
  peak = spec_peak(device.device_kind)
  return {
    "device_kind": device.device_kind,
    "platform": device.platform,
    "device_count": jax.device_count(),
    "nvidia_smi": nvidia_smi() if device.platform == "gpu" else "not a GPU",
    "spec_peak_bf16_flops": peak[0] if peak else None,
    "spec_peak_source": peak[1] if peak else f"no spec peak for {device.device_kind!r}",
  }


if __name__ == "__main__":
  import json

  print(json.dumps(describe(), indent=2))

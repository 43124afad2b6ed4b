"""The environment of a subprocess that runs JAX on CPU devices, for tests of sharded code."""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_devices_env(count: int, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
  """`base` (default `os.environ`) for a process with `count` CPU devices and no accelerator.

  Keeps every XLA flag of `base` but a device count (a test session's compile options change
  the rounding, so the processes of one test must share them) and appends
  `--xla_force_host_platform_device_count=count`; sets `JAX_PLATFORMS=cpu`.

  Args:
    count: CPU devices of the process (>= 1).
    base: the environment to start from.
    **extra: further variables (strings), set last.
  Returns:
    a new dict; `base` is not changed.
  Raises:
    ValueError: count < 1.
  Source: JAX's documentation of multi-device CPU testing (`XLA_FLAGS`).
  """
  if count < 1:
    raise ValueError(f"count must be >= 1, got {count}")
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={count}"])
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env

"""The committed reference run that today's code must reproduce (issue 49 item 1).

The committed sweep's runs take about a minute each on 2 cores, too long for CI; the
reference is a tiny run instead: `reference_config` (the `swil` tiny config, 8 evaluated
images per set, the pre-training sets evaluated after pre-training and at the end), committed
as `tests/reference_runs/tiny_swil/results.json` with the machine it ran on
(`machine.json`, `fingerprint()`). tests/e2e/test_reproducible.py runs the same config at HEAD and
compares `compared(...)` of both:

* **on the same machine** (equal fingerprints: CPU model, features and count, device platform
  and kind,
  jax / jaxlib / NumPy versions, XLA_FLAGS) with no tolerance: the same XLA programs on the
  same device and the same data order give the same bits (tests/e2e/test_reproducible.py shows it
  for two runs of one session), so any difference is a change of what the code computes;
* elsewhere only the structure (stages, eval sets, classes, configs, step and replay counts):
  another CPU, library version or device compiles other programs whose rounding differs, and
  the differences grow through training by an amount no bound is known for.

The reference is written by that test itself when `WRITE_ENV` names a folder
(`OWL_CL_WRITE_REFERENCE=tests/reference_runs/tiny_swil python -m pytest -n 0
tests/e2e/test_reproducible.py`): its run then has the test session's conditions exactly (the
session's pre-trained model and buffer, `pretrained_cache_dir`, and its XLA flags,
tests/conftest.py). Regenerate it only when a change of the computed values is intended, and
say so in the commit.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import os
import platform
from typing import Any

import jax
import ml_collections
import numpy as np

from owl_cl import utils
from owl_cl.configs import base
from owl_cl.testing import configs
from owl_cl.testing import results as results_testing
from owl_cl.utils import atomic_write_json

# The committed reference, relative to the repository root.
REFERENCE_DIR = os.path.join("tests", "reference_runs", "tiny_swil")
MACHINE_JSON = "machine.json"
# Set to a folder: the reproduction test writes a new reference there instead of comparing.
WRITE_ENV = "OWL_CL_WRITE_REFERENCE"
# Config fields that name this machine's folders, not the computation.
PATH_FIELDS = ("cache_dir", "compilation_cache_dir")
# results.json fields that name the code, not what it computed (`owl_cl.eval.provenance`).
PROVENANCE_FIELDS = ("commit", "dirty", "commit_source", "provenance")


def reference_config(cache_dir: str, compilation_cache_dir: str = "") -> ml_collections.ConfigDict:
  """The reference run's config: `configs.tiny_config('swil', cache_dir)`, 8 evaluated images
  per set, the datasets seen so far evaluated between stages and the pre-training sets only
  after pre-training and at the end (every set is still evaluated then)."""
  config = configs.tiny_config("swil", cache_dir)
  config.max_eval_images = 8
  config.eval.downstream_after_each_dataset = "seen"
  config.eval.pretraining_sets_after_each_dataset = False
  config.compilation_cache_dir = compilation_cache_dir
  return config


def _cpu() -> tuple[str, str]:
  """(the CPU's model name, a digest of its feature flags) from /proc/cpuinfo on Linux, else
  (`platform.processor()`, ''). XLA:CPU compiles for the host's features (AVX-512 or not,
  ...), and a virtual machine's model name may not tell them apart."""
  model, flags = platform.processor(), ""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          model = value.strip()
        elif key.strip() == "flags" and not flags:
          flags = utils.digest(sorted(value.split()))
  except OSError:
    pass
  return model, flags


def xla_flags(value: str) -> str:
  """XLA_FLAGS as a set of flags (sorted, each once): tests/conftest.py appends the suite's
  flags to those a process inherits, so an xdist worker holds them twice, to the same effect."""
  return " ".join(sorted(set(value.split())))


def fingerprint() -> dict[str, Any]:
  """What decides the bits of a run besides the code and the config: {'machine', 'cpu',
  'cpu_flags' (a digest), 'cpu_count', 'device' (platform and kind of device 0), 'jax',
  'jaxlib', 'numpy', 'xla_flags'} (all str, cpu_count int)."""
  import jaxlib  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  model, flags = _cpu()
  return {
    "machine": platform.machine(),
    "cpu": model,
    "cpu_flags": flags,
    "cpu_count": os.cpu_count(),
    "device": f"{device.platform} {device.device_kind}",
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "numpy": np.__version__,
    "xla_flags": xla_flags(os.environ.get("XLA_FLAGS", "")),
  }


def compared(results: Mapping[str, Any]) -> dict[str, Any]:
  """What two runs of the reference config must share: results.json (as written, NaN as null)
  without its wall-clock and identity fields (`results_testing.comparable`), the code's
  provenance (`PROVENANCE_FIELDS`) and the config's folders (`PATH_FIELDS`)."""
  out = {k: v for k, v in results.items() if k not in PROVENANCE_FIELDS}
  out["config"] = {k: v for k, v in (results.get("config") or {}).items() if k not in PATH_FIELDS}
  out["stages"] = [
    {k: v for k, v in s.items() if k not in PROVENANCE_FIELDS} for s in results["stages"]
  ]
  # `timings` holds only wall-clock figures; the buffer's seconds are dropped by `comparable`.
  out.pop("timings", None)
  return results_testing.comparable(out)


def structure(results: Mapping[str, Any]) -> dict[str, Any]:
  """The machine-independent part of `compared`: the config, the stages' names, eval sets and
  classes, and each stage's step and replay counts."""
  stages = []
  for s in results["stages"]:
    train = s.get("train") or {}
    stages.append(
      {
        "name": s["name"],
        "eval_sets": sorted(s.get("metrics") or {}),
        "classes": {k: sorted(v) for k, v in (s.get("per_class") or {}).items()},
        "counts": {k: train.get(k) for k in ("steps", "replayed_images", "replay_steps")},
      }
    )
  return {"config": compared(results)["config"], "stages": stages}


def with_added_fields(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
  """`config` (a config as JSON) with each field of `defaults` it lacks, at that default;
  what it holds is kept as it is (a dict-valued field it holds is not filled further)."""
  out = dict(config)
  for key, default in defaults.items():
    if key not in out:
      out[key] = default
    elif isinstance(default, dict) and default and isinstance(out[key], dict):
      out[key] = with_added_fields(out[key], default)
  return out


def load_reference(root: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """(results.json, machine.json) of the reference below the repository root `root`.

  Raises:
    FileNotFoundError: the reference is missing (names the folder).
  """
  folder = os.path.join(root, REFERENCE_DIR)
  with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  # A config field added after the reference was written is absent from it: it was added at a
  # default that keeps earlier results (as `experiment.existing_run` accepts on a resume).
  defaults = json.loads(base.get_config(configs.TINY_ARG).to_json_best_effort())
  results["config"] = with_added_fields(results["config"], defaults)
  with open(os.path.join(folder, MACHINE_JSON), encoding="utf-8") as f:
    machine = json.load(f)
  machine["xla_flags"] = xla_flags(machine.get("xla_flags", ""))
  return results, machine


def write_reference(folder: str, results: Mapping[str, Any]) -> None:
  """Writes a new reference into `folder`: `results` as results.json and this machine's
  `fingerprint()` as machine.json."""
  os.makedirs(folder, exist_ok=True)
  atomic_write_json(os.path.join(folder, "results.json"), dict(results), indent=2)
  atomic_write_json(os.path.join(folder, MACHINE_JSON), fingerprint(), indent=2)

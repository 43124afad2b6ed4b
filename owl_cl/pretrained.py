"""The model a run starts from: `config.init_checkpoint`, or pre-trained here and cached.

`pretrained_params` loads the configured checkpoint (owl_cl parameters, an HF folder or a
scenic msgpack), or the cached pre-trained model of the built-in benchmark, or pre-trains it
(`trainer.pretrain`) and caches it under `cache_dir/pretrained/<digest of its settings>`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
import jax
import ml_collections

from owl_cl import distributed
from owl_cl import trainer
from owl_cl.benchmark import Benchmark
from owl_cl.detector import Detector
from owl_cl.train import checkpointing
from owl_cl.utils import digest
from owl_cl.utils import expand_path
from owl_cl.utils import file_digest
from owl_cl.validation import ConfigError
from owl_cl.validation import uses_real_data


def load_init_checkpoint(path: str, like) -> tuple[Any, dict]:
  """Parameters of `config.init_checkpoint`. Returns (params, meta).

  Formats, recognised by what `path` holds: an owl_cl parameter checkpoint (a folder with
  `params/`, `owl_cl.train.checkpointing.save_params`); an HF `OwlViTForObjectDetection`
  folder (`config.json` + weights); otherwise a scenic msgpack file (or a folder of
  `checkpoint_<step>` files). Scenic and HF go through owl_cl.model.convert.

  Args:
    path: the checkpoint (expanded).
    like: ShapeDtypeStruct tree of the model's parameters.

  Raises:
    owl_cl.model.convert.CheckpointMismatchError: listing every missing, unexpected or
      wrongly shaped parameter against the configured model (e.g. a B/32 checkpoint for the
      L/14 config).
    FileNotFoundError: nothing readable at `path`.
  """
  if os.path.isdir(os.path.join(path, "params")):
    return checkpointing.load_params(path, like)
  from owl_cl.model import convert as checkpoints  # pylint: disable=g-import-not-at-top

  if os.path.isfile(os.path.join(path, "config.json")):
    params, hf_config = checkpoints.load_hf_checkpoint(path)
    params = checkpoints.check_params(params, like, path)
    return params, {"source": path, "format": "hf", "hf_model_config": str(hf_config)}
  params = checkpoints.load_scenic_checkpoint(path, like)
  return params, {"source": path, "format": "scenic"}


def pretrained_params(
  detector: Detector, bench: Benchmark, writer, step_checkpoints=None
) -> tuple[Any, dict]:
  """Loads `init_checkpoint`, or the cached pre-trained model, or pre-trains and caches it.

  The cache key covers everything pre-training depends on (model, data, pre-training
  config, seed), so a changed setting never reuses a stale model. `step_checkpoints`
  (`checkpointing.StepCheckpointer` of the run's workdir, phase 0; None: none): a killed
  pre-training resumes from its newest step checkpoint there; they are deleted once the
  finished model is in the cache (written atomically, as before).

  Raises:
    owl_cl.preemption.Preempted: SIGTERM during pre-training (after its step checkpoint).
  """
  config = detector.config
  like = jax.eval_shape(lambda: detector.init_params(config.seed))
  if config.init_checkpoint:
    return load_init_checkpoint(expand_path(config.init_checkpoint), like)
  if uses_real_data(config):
    raise ConfigError("config.init_checkpoint is required with real data (config.data.root)")
  key = digest(
    {
      "model": cache_key_fields(config, "model"),
      "pretrain": config.pretrain.to_dict(),
      "data": {
        k: v
        for k, v in config.data.to_dict().items()
        if k in ("num_queries", "num_negatives", "max_instances", "train_prompt_templates")
      },
      **non_default_data_options(config),
      "loss": cache_key_fields(config, "loss"),
      "seed": config.seed,
      "pretrain_data": file_digest(bench.pretrain.train.annotation_file),
      "train_opt": [
        config.train.b1,
        config.train.b2,
        config.train.eps,
        config.train.grad_clip_norm,
      ],
    }
  )
  path = os.path.join(expand_path(config.cache_dir), "pretrained", key)
  if os.path.isdir(path):
    logging.info("re-using the cached pre-trained model %s", path)
    return checkpointing.load_params(path, like)
  logging.info("no cached pre-trained model: pre-training (cache %s)", path)
  start = time.time()
  # Looked up on the module at call time, so a test can replace it.
  params, curve = trainer.pretrain(detector, bench, writer, step_checkpoints)
  meta = {"seconds": round(time.time() - start, 1), "curve": curve, "cache_key": key}
  meta["validation"] = detector.evaluate(params, bench.pretrain.test, "pre-training val")
  # One writer: the temporary folder and the rename are not safe to run on several hosts
  # sharing the cache; the others wait until the model is on disk.
  if distributed.is_writer():
    checkpointing.save_params(path, params, meta)
  distributed.barrier("pretrained-saved", timeout_s=600.0)
  if step_checkpoints is not None:
    step_checkpoints.discard(0)
  return params, meta


def _as_tuples(options: dict) -> dict:
  """`options` with list values as tuples (a config read from JSON or flags holds lists)."""
  return {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in options.items()}


def _default_data_options() -> dict[str, Any]:
  """The input-pipeline options of configs/base.py, where their defaults are defined."""
  from configs import base  # pylint: disable=g-import-not-at-top

  data = base.get_config("").data
  return {
    "squash_resize": data.squash_resize,
    "merge_iou": data.merge_iou,
    "negatives_by_frequency": data.negatives_by_frequency,
    "augment": _as_tuples(data.augment.to_dict()),
  }


# The input-pipeline options' defaults. Cache keys list only the options that differ from
# them, so caches made before an option existed stay valid.
DEFAULT_DATA_OPTIONS = _default_data_options()


# Fields left out of the cache keys of pre-training and of the buffer, so that caches written
# before they existed stay valid: those that choose how a step executes, not what it computes
# (attention, remat, matcher: the same values up to rounding), and the loss normalisation, which
# applies to continual fine-tuning only (pre-training and the buffer's losses are per image).
_NOT_IN_CACHE_KEYS = {"model": ("attention", "remat"), "loss": ("matcher", "normalization")}


def cache_key_fields(config: ml_collections.ConfigDict, section: str) -> dict:
  """`config.<section>` ('model' | 'loss') as it enters the cache keys.

  Leaves out `_NOT_IN_CACHE_KEYS` and an unset (None) `model.dtype` (the variant's own).
  """
  out = config[section].to_dict()
  for field in _NOT_IN_CACHE_KEYS.get(section, ()):
    out.pop(field, None)
  if section == "model" and out.get("dtype") is None:
    out.pop("dtype", None)
  return out


def non_default_data_options(
  config: ml_collections.ConfigDict, buffer: bool = False
) -> dict[str, Any]:
  """{'data_options': {...}} with the `config.data` pipeline options that differ from
  `DEFAULT_DATA_OPTIONS` ({} when none do), for the cache keys of the pre-trained model and
  (buffer=True: augmentations excluded, the buffer's images are not augmented) the buffer."""
  data = config.data
  differing = {}
  for name, default in DEFAULT_DATA_OPTIONS.items():
    if name == "augment":
      if buffer:
        continue
      value = _as_tuples(data.augment.to_dict())
      default = _as_tuples(default)
    else:
      value = data.get(name, default)
    if value != default:
      differing[name] = value
  return {"data_options": differing} if differing else {}

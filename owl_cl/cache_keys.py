"""What enters the cache keys of the pre-trained model and of the replay buffer.

`cache_key_fields(config, section)` and `non_default_data_options(config)` are shared by
`owl_cl.pretrained` (the pre-training cache) and `owl_cl.replay.setup` (the buffer cache); a
leaf module, so neither imports the other (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from typing import Any

import ml_collections

from configs import base


def _as_tuples(options: dict) -> dict:
  """`options` with list values as tuples (a config read from JSON or flags holds lists)."""
  return {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in options.items()}


def _default_data_options() -> dict[str, Any]:
  """The input-pipeline options of configs/base.py, where their defaults are defined."""
  data = base.get_config("").data
  return {
    "squash_resize": data.squash_resize,
    "merge_iou": data.merge_iou,
    "negatives_by_frequency": data.negatives_by_frequency,
    # Decoded pixels: 'apply' turns EXIF-tagged photos (`CocoSource.decode_image`).
    "exif_orientation": data.exif_orientation,
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
  if section == "loss" and not out.get("objectness_weight"):
    out.pop("objectness_weight", None)  # OWLv2's term off: the v1 keys of before it existed
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


def builtin_version_key(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{'builtin_version': v} for a built-in benchmark version other than 1, else {} (version 1's
  keys stay those of before the field existed), for the cache keys of the pre-trained model
  and the buffer. Their keys also hash the pre-training annotation file, which differs between
  versions; this names the version explicitly."""
  version = config.data.get("builtin", {}).get("version", 1)
  return {"builtin_version": version} if version != 1 else {}

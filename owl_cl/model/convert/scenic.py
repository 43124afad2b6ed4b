"""scenic's OWL-ViT checkpoints: legacy Flax msgpack files (docs/reference.md §2).

:func:`load_scenic_checkpoint` reads a file such as ``clip_vit_l14_d83d374`` (the parameters
nested under ``optimizer/target`` in v1 releases, or ``params``), makes old names current with
:func:`fix_scenic_names` and checks the tree against the module's.
Source: scenic `scenic/projects/owl_vit/models.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import re
from typing import Any

import flax
import numpy as np

from owl_cl.model.convert import tree


def _fix_block(block: Mapping[str, Any], where: str) -> dict[str, Any]:
  block = dict(block)
  if "ln_2" in block:
    if "ln_0" in block:
      raise ValueError(f"{where} has both ln_0 and ln_2: neither the old nor the new naming")
    block["ln_0"] = block.pop("ln_1")
    block["ln_1"] = block.pop("ln_2")
  return block


def fix_scenic_names(params: tree.PyTree, where: str = "checkpoint") -> dict[str, Any]:
  """Makes old scenic parameter names current; an already-current tree is unchanged.

  In every mapping, each key ``resblocks.N`` / ``resblocks_N`` (a transformer block) whose
  block holds ``ln_2`` is renamed per block ``ln_1 -> ln_0``, ``ln_2 -> ln_1``; then ``.``
  becomes ``_`` in block names (``resblocks.N -> resblocks_N``). ``class_head/padding*``
  leaves are dropped. Idempotent.

  Args:
    params: nested mapping (leaves untouched, not copied). where: name for errors.

  Returns:
    A new nested ``dict``.

  Raises:
    ValueError: a block with both ``ln_0`` and ``ln_2``, or ``resblocks.N`` and
      ``resblocks_N`` side by side.

  Source: docs/reference.md §2; scenic `scenic/projects/owl_vit/models.py`
  (``_fix_old_checkpoints``, ``TextZeroShotDetectionModule.load``).
  """

  # Renaming per block, and only where `ln_2` exists, makes this idempotent: scenic's own
  # `_fix_old_layernorm` renames every tree and breaks an already (or half) converted one.
  def walk(node, path):
    if not isinstance(node, Mapping):
      return node
    out = {}
    for key, value in node.items():
      sub = f"{path}/{key}" if path else str(key)
      if (
        isinstance(key, str)
        and re.fullmatch(r"resblocks[._]\d+", key)
        and isinstance(value, Mapping)
      ):
        value = _fix_block(value, f"{where}: {sub}")
        key = key.replace(".", "_")
        if key in out:
          raise ValueError(f"{where}: {path}/{key} occurs in both old and new naming")
      if path == "class_head" and isinstance(key, str) and key.startswith("padding"):
        continue
      out[key] = walk(value, sub)
    return out

  return walk(flax.core.unfreeze(params), "")


def _resolve_flax_checkpoint_file(path: str) -> str:
  if os.path.isdir(path):
    steps = []
    for name in os.listdir(path):
      m = re.fullmatch(r"checkpoint_(\d+)", name)
      if m and os.path.isfile(os.path.join(path, name)):
        steps.append((int(m.group(1)), name))
    if not steps:
      raise FileNotFoundError(f"no msgpack checkpoint (checkpoint_<step> file) in folder {path}")
    return os.path.join(path, max(steps)[1])
  if not os.path.isfile(path):
    raise FileNotFoundError(f"scenic checkpoint {path} does not exist")
  return path


def read_scenic_checkpoint(path: str) -> dict[str, Any]:
  """Reads a scenic (legacy Flax msgpack) checkpoint's parameters, names fixed, unchecked.

  Args:
    path: a msgpack file (e.g. ``clip_vit_l14_d83d374``) or a folder of
      ``checkpoint_<step>`` files (the newest is read).

  Returns:
    Nested ``dict`` of ``np.ndarray`` (as stored, usually float32): the tree under
    ``optimizer/target`` (v1 releases, pre-optax) or ``params``, or the whole file when
    it is a bare parameter tree (top level holds ``backbone``); then
    :func:`fix_scenic_names`.

  Raises:
    FileNotFoundError: no such file.
    ValueError: not msgpack, or none of the known nestings (the message names the file and
      its top-level keys).

  Source: docs/reference.md §2; scenic `scenic/projects/owl_vit/models.py` (``load_variables``).
  """
  path = _resolve_flax_checkpoint_file(os.path.abspath(path))
  with open(path, "rb") as f:
    data = f.read()
  try:
    restored = flax.serialization.msgpack_restore(data)
  except Exception as e:  # msgpack raises several unrelated types
    raise ValueError(f"{path} is not a Flax msgpack checkpoint: {e}") from e
  if not isinstance(restored, Mapping):
    raise ValueError(f"{path}: top level is a {type(restored).__name__}, not a mapping")
  if isinstance(restored.get("optimizer"), Mapping) and "target" in restored["optimizer"]:
    params = restored["optimizer"]["target"]
  elif "params" in restored:
    params = restored["params"]
  elif "backbone" in restored:
    params = restored
  else:
    raise ValueError(
      f"{path}: no parameters under 'optimizer/target' or 'params' "
      f"(top-level keys: {sorted(map(str, restored))})"
    )
  return fix_scenic_names(params, where=path)


def load_scenic_checkpoint(path: str, target: tree.Target) -> dict[str, np.ndarray]:
  """Loads a scenic OWL-ViT checkpoint into our parameter tree.

  Args:
    path: see :func:`read_scenic_checkpoint`.
    target: ``ModelConfig`` of the module, or its (abstract) parameter tree.

  Returns:
    Nested ``dict`` of float32 ``np.ndarray``, paths and shapes = the target's.

  Raises:
    FileNotFoundError, ValueError: see :func:`read_scenic_checkpoint`.
    CheckpointMismatchError: names/shapes differ (all offending paths listed, file named).

  Source: docs/reference.md §2; scenic `scenic/projects/owl_vit/models.py`.
  """
  params = read_scenic_checkpoint(path)
  return tree.check_params(params, target, os.path.abspath(path))

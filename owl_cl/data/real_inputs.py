"""The inputs of the paper's protocol (real data below `data.root`), checked before any work.

`check_inputs(config)` raises one `MissingInputsError` listing every missing file, folder and
unset field of the paper's protocol, with the expected layout; `odinw_names(config)` the
run's ODinW datasets, validated. Called by `owl_cl.validation.validate` and, before it reads
anything, by `owl_cl.benchmark.load_real_benchmark`; in the data layer so that the benchmark
does not import `validation` (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import os

import ml_collections

from owl_cl.config_fields import ConfigError
from owl_cl.config_fields import MissingInputsError
from owl_cl.config_fields import clip_vocabulary_problem
from owl_cl.config_fields import uses_real_data
from owl_cl.data import odinw
from owl_cl.data import pretraining
from owl_cl.utils import expand_path


def pretraining_input_paths(root: str) -> list[str]:
  """Files / folders of Objects365 (train: buffer candidates, val: evaluation) and LVIS val
  (json + the COCO 2017 image folders its images live in) below `root`.

  Source: owl_cl.data.pretraining (layout); docs/reference.md (the paper's data).
  """
  paths = [p for split in ("train", "val") for p in pretraining.objects365_paths(root, split)]
  lvis_json, coco_dir = pretraining.lvis_paths(root, "val")
  paths += [lvis_json] + [os.path.join(coco_dir, f) for f in ("train2017", "val2017")]
  return paths


def real_data_layout(names: tuple[str, ...]) -> str:
  """The folder tree the paper's protocol expects below `data.root` (for error messages)."""
  root = "<root>"
  pretraining_paths = "\n".join(f"  {p}" for p in pretraining_input_paths(root))
  return (
    odinw.layout_description(names) + "\n<root>/  Objects365 v2 and LVIS v1 val "
    "(owl_cl.data.pretraining):\n" + pretraining_paths
  )


def odinw_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The ODinW datasets of the run (`data.odinw_datasets`), validated, in the table's order.

  Raises:
    ConfigError: an empty list, a duplicate, or a name outside the ODinW registry.
  """
  names = tuple(config.data.odinw_datasets)
  if not names:
    raise ConfigError("config.data.odinw_datasets is empty; name at least one ODinW dataset")
  if len(set(names)) != len(names):
    raise ConfigError(f"config.data.odinw_datasets={names} lists a dataset twice")
  known = tuple(odinw.ODINW_DATASETS)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ConfigError(
      f"config.data.odinw_datasets names unknown datasets {unknown}; known: {list(known)}"
    )
  return names


def uses_paper_odinw(config: ml_collections.ConfigDict) -> bool:
  """True when the run's sequence holds the paper's ODinW datasets: `data.sequence` unset, or
  holding an 'odinw_paper' / 'odinw15' suite item or a kind 'odinw' entry. Another declared
  sequence (e.g. the 'odinw13' suite of configs/ivlod_odinw13.py) is checked by
  `validation.check_datasets` alone, without the paper's 15 datasets."""
  sequence = config.data.get("sequence")
  if sequence is None:
    return True
  items = sequence if isinstance(sequence, (list, tuple)) else [sequence]
  for item in items:
    item = item.to_dict() if hasattr(item, "to_dict") else item
    if isinstance(item, dict) and (
      item.get("suite") in ("odinw_paper", "odinw15") or item.get("kind") == "odinw"
    ):
      return True
  return False


def check_visual_genome(config: ml_collections.ConfigDict) -> None:
  """Refuses settings that would take buffer images from Visual Genome.

  A loss threshold <= 0 keeps no image (losses are >= 0), and with no per-class minimum
  nothing tops it up: the paper's setting (t = 0.0) takes nothing from Visual Genome, so
  Visual Genome is neither loaded nor required.

  Raises:
    ConfigError: a setting that would take Visual Genome images: a buffer over two
      pre-training sets (two class vocabularies) is not implemented.
  """
  selection = config.replay.selection
  threshold = selection.get("visual_genome_loss_threshold", 0.0)
  minimum = selection.get("visual_genome_min_per_class", 0)
  if threshold > 0.0 or minimum > 0:
    raise ConfigError(
      f"config.replay.selection.visual_genome_loss_threshold={threshold} / "
      f"visual_genome_min_per_class={minimum} would add Visual Genome images to the "
      "Objects365 buffer; a buffer over two pre-training sets is not implemented (the "
      "paper's protocol uses 0.0 / 0, which selects no Visual Genome image)"
    )


def input_problems(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
  """Everything the paper's protocol lacks before it can start (nothing is read but stats).

  Returns:
    (missing, problems): paths of missing files / folders, and config fields that must be
    set (e.g. `config.data.root is not set`). Both empty = ready.
  """
  missing, problems = [], []
  if config.init_checkpoint is None:
    problems.append(
      "config.init_checkpoint is not set (a scenic msgpack, an HF folder or an "
      "owl_cl parameter checkpoint of the pre-trained OWL-ViT)"
    )
  elif not os.path.exists(expand_path(config.init_checkpoint)):
    missing.append(f"{expand_path(config.init_checkpoint)} (config.init_checkpoint)")
  vocabulary = config.model.get("tokenizer_vocab_path")
  problem = clip_vocabulary_problem(config)
  if problem:
    problems.append(problem)
  elif vocabulary and not os.path.exists(expand_path(vocabulary)):
    missing.append(f"{expand_path(vocabulary)} (config.model.tokenizer_vocab_path)")
  if config.data.root is None:
    problems.append("config.data.root is not set (the folder holding odinw/, objects365/, lvis/)")
    return missing, problems
  root = expand_path(config.data.root)
  if not os.path.isdir(root):
    missing.append(f"{root} (config.data.root)")
    return missing, problems
  if uses_paper_odinw(config):
    missing += [str(m) for m in odinw.missing_files(root, odinw_names(config))]
  missing += [p for p in pretraining_input_paths(root) if not os.path.exists(p)]
  return missing, problems


def check_inputs(config: ml_collections.ConfigDict) -> None:
  """Raises one MissingInputsError listing every missing input of the paper's protocol.

  No-op for the built-in benchmark.

  Raises:
    MissingInputsError: with every missing file / folder, every unset field and the
      expected data layout.
    ConfigError: an invalid `data.odinw_datasets` or buffer setting.
  """
  if not uses_real_data(config):
    return
  check_visual_genome(config)
  missing, problems = input_problems(config)
  if not missing and not problems:
    return
  lines = ["the paper's protocol cannot start:"]
  lines += [f"  - {p}" for p in problems]
  if missing:
    lines.append(f"  missing ({len(missing)}):")
    lines += [f"    {m}" for m in missing]
  names = odinw_names(config) if uses_paper_odinw(config) else ()
  lines += ["expected layout below config.data.root:", real_data_layout(names)]
  raise MissingInputsError("\n".join(lines))

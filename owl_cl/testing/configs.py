"""Tiny configs shared by the tests: the whole pipeline, or the detector alone, in seconds on CPU.

`tiny_config(name, cache_dir)` is the config `configs/<name>.py:builtin1` (version 1 of the
built-in benchmark with the fields' own defaults; the default job runs version 2) with a 1-layer,
64-wide OWL-ViT, 4 pre-training steps, 2 steps per downstream dataset and a two-dataset built-in
benchmark of 16 images per split: the end-to-end tests run the whole pipeline with it in
well under a minute on 2 CPU cores. `tiny_detector_config(**changes)` is the base config
with a 32-wide model on 32-pixel images, for tests that build a `Detector` without running.
"""

from __future__ import annotations

import importlib

import ml_collections


def load_config(name: str, arg: str = "") -> ml_collections.ConfigDict:
  """`configs/<name>.py`'s `get_config(arg)` ('': the default job's, built-in version 2)."""
  return importlib.import_module(f"configs.{name}").get_config(arg)


# The config argument of the tiny configs: version 1 of the built-in benchmark, the default
# until version 2 became it. `tiny_budget` shrinks version 1's sizes and keeps its training
# and evaluation settings (8 epochs, eq. 7's buffer, every set evaluated after each dataset),
# so the tests run what they ran before the default changed.
TINY_ARG = "builtin1"


# The built-in benchmark of `tiny_budget`: images per split and downstream datasets.
TINY_BUILTIN = dict(
  num_pretrain_train=48,
  num_pretrain_val=16,
  num_held_out_val=16,
  num_downstream_train=16,
  num_downstream_test=16,
  downstream=("thermal", "digits"),
)


# The smallest built-in benchmark the data tests generate
# (`ensure_benchmark(..., **MINIMAL_BUILTIN)`:
# about a second), for tests of the benchmark's files rather than of training.
MINIMAL_BUILTIN = dict(
  num_pretrain_train=10,
  num_pretrain_val=3,
  num_held_out_val=4,
  num_downstream_train=4,
  num_downstream_test=2,
)


def tiny_budget(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`c` (changed in place and returned) with the budget of `tiny_config`: a 1-layer, 64-wide
  OWL-ViT, 4 pre-training steps, 2 steps per downstream dataset, the `TINY_BUILTIN` benchmark.
  `c.cache_dir` and `c.compilation_cache_dir` are left as they are.

  Also the quick try of the "Your own data" example (docs/data.md)
  (`configs/examples/own_data.py:<dir>,quick`).
  """
  o = c.model.overrides
  o.vision_layers = 1
  o.text_layers = 1
  o.vision_width = 64
  o.vision_heads = 1
  o.vision_mlp_dim = 128
  o.text_width = 64
  o.text_heads = 1
  o.text_mlp_dim = 128
  o.embed_dim = 64
  o.vocab_size = 1024
  c.pretrain.num_steps = 4
  c.pretrain.batch_size = 8
  c.train.batch_size = 8
  c.train.num_epochs = 1
  c.max_train_steps_per_dataset = 2
  c.data.eval_batch_size = 16
  for key, value in TINY_BUILTIN.items():
    c.data.builtin[key] = value
  c.replay.selection.min_per_class = 2
  return c


def tiny_config(name: str, cache_dir: str) -> ml_collections.ConfigDict:
  """A config that runs the whole pipeline in well under a minute on 2 CPU cores.

  Args:
    name: a module of configs/ ('swil', 'no_replay', ...).
    cache_dir: where the built-in benchmark, the pre-trained model and the buffer are cached.

  Returns:
    `configs/<name>.py`'s config of `TINY_ARG` with `tiny_budget`, `cache_dir` and no XLA
    compilation cache (a test that wants one sets `compilation_cache_dir`).
  """
  c = load_config(name, TINY_ARG)
  c.cache_dir = cache_dir
  c.compilation_cache_dir = ""
  return tiny_budget(c)


def tiny_detector_config(**changes) -> ml_collections.ConfigDict:
  """configs/base.py (`TINY_ARG`) with a 32-wide, 1-layer model on 32-pixel images (nothing is
  trained).

  `changes` maps '<section>.<field>' to a value, e.g. `**{"eval.ensemble": "max"}`.
  """
  c = load_config("base", TINY_ARG)
  c.compilation_cache_dir = ""
  o = c.model.overrides
  o.vision_layers = o.text_layers = 1
  o.vision_width = o.text_width = o.embed_dim = 32
  o.vision_heads = o.text_heads = 1
  o.vision_mlp_dim = o.text_mlp_dim = 64
  o.vocab_size = 1024
  o.image_size = 32
  c.data.eval_batch_size = 2
  for key, value in changes.items():
    section, field = key.split(".")
    c[section][field] = value
  return c

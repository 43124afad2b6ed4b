"""The cache keys of the pre-trained model and of the replay buffer, derived from the specs.

Each key is the digest of a frozen record of what its builder consumes: `PretrainedKeySpec`
(pre-training: the model, `pretrain`, the train fields pre-training reads, data, loss, seed,
the pre-training annotations) and `BufferKeySpec` (the buffer's selection: the model it scores
with, by content, its replay fields, data, loss, seed, the annotations). `key_material` walks
such a record's fields: a section spec gives its `config_spec.key_material` for that cache (a
field left out says why in its spec, `key=`), any other field its value, so a field added to a
record or a spec enters the key with no other edit. Shared by `owl_cl.pretrained` and
`owl_cl.experiment`; below both (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from owl_cl import config_spec
from owl_cl.config_fields import seed_of
from owl_cl.data import data_spec
from owl_cl.data.data_spec import DataSpec
from owl_cl.model.spec import ModelSpec
from owl_cl.replay import setup as replay_setup
from owl_cl.replay import spec as replay_spec
from owl_cl.replay.spec import ReplaySpec
from owl_cl.train.pretrain_spec import PretrainSpec
from owl_cl.train.spec import LossSpec
from owl_cl.train.spec import TrainSpec
from owl_cl.utils import digest
from owl_cl.utils import expand_path
from owl_cl.utils import file_digest

PRETRAINED, BUFFER = config_spec.CACHES


@dataclasses.dataclass(frozen=True)
class PretrainedKeySpec:
  """What the pre-trained model is made of (`trainer.pretrain` on the pre-training set).

  Attributes:
    model: `config.model` (ModelSpec). pretrain: `config.pretrain` (PretrainSpec).
    train: `config.train` (TrainSpec): pre-training reads its Adam settings and clipping,
      the fields keyed there; the others are fine-tuning's and say so.
    data: `config.data` (DataSpec). loss: `config.loss` (LossSpec; pre-training's
      normalisation is per image whatever `loss.normalization`, which says so).
    seed: the model's seed (`seed_of(config, 'model')`).
    resize: the detector's preprocessing ('resize_with_pad' v1, 'pad_then_resize' OWLv2).
    pretrain_data: the digest of the pre-training annotation file (`utils.file_digest`).
  """

  model: ModelSpec
  pretrain: PretrainSpec
  train: TrainSpec
  data: DataSpec
  loss: LossSpec
  seed: int
  resize: str
  pretrain_data: str


@dataclasses.dataclass(frozen=True)
class BufferKeySpec:
  """What a replay store is made of (`replay.build.build_store`'s `BufferSpec` and model).

  Attributes:
    model: the model it scores the candidates with: the cached pre-trained model's key
      (str; None when unknown), or an init checkpoint's contents and model fields
      (`init_checkpoint_model_key`, a dict).
    pretrain_data: the digest of the pre-training annotation file (the candidates).
    replay: `config.replay` (ReplaySpec: `top_k`, `budget`, the selection's fields).
    data: `config.data` (DataSpec; the buffer's images are neither augmented nor prompted).
    loss: `config.loss` (LossSpec): the selection's per-image loss.
    seed: the model's seed, which draws each image's queries and the budget.
    image_features: the store also keeps the top-k tokens' ViT features.
    objectness: an OWLv2 store keeps the objectness logits for DER++ (docs/owlv2.md).
    format: the store's layout (4: keys from the specs; 3 named fields by hand).
  """

  model: Any
  pretrain_data: str
  replay: ReplaySpec
  data: DataSpec
  loss: LossSpec
  seed: int
  image_features: bool
  objectness: bool
  format: int = 4


def key_material(record: Any, cache: str) -> dict[str, Any]:
  """{field: material} of a key record (`PretrainedKeySpec`, `BufferKeySpec`): a section
  spec's `config_spec.key_material` for `cache` (of `config_spec.CACHES`), any other value as
  it is (JSON-serialisable for `utils.digest`)."""
  return {
    f.name: (config_spec.key_material(value, cache) if config_spec.is_spec(value) else value)
    for f in dataclasses.fields(record)
    for value in (getattr(record, f.name),)
  }


def pretrained_key_spec(
  config: ml_collections.ConfigDict, model: ModelSpec, *, resize_method: str, pretrain_data: str
) -> PretrainedKeySpec:
  """The pre-trained model's `PretrainedKeySpec` from the run's config.

  Raises:
    ConfigError: a `pretrain`, `train`, `data` or `loss` field that breaks its rule.
  """
  return PretrainedKeySpec(
    model=model,
    pretrain=config_spec.from_config(PretrainSpec, config.pretrain, "pretrain"),
    train=config_spec.from_config(TrainSpec, config.train, "train"),
    data=data_spec.settings(config),
    loss=config_spec.from_config(LossSpec, config.loss, "loss"),
    seed=seed_of(config, "model"),
    resize=resize_method,
    pretrain_data=pretrain_data,
  )


def checkpoint_digest(path: str) -> str:
  """A 16-hex-character SHA-256 naming the contents of the checkpoint at `path`.

  A file (a scenic msgpack): its `file_digest`. A folder (an owl_cl parameter checkpoint, an
  HF folder, scenic `checkpoint_<step>` files): the digest of every regular file below it,
  each named by its '/'-separated relative path and its `file_digest`, so a file changed,
  added, removed or renamed changes it. Every byte is read once per call (0.6 s for 500 MB
  on a loaded 2-core machine); no digest is kept between runs, since a file replaced at the
  same path may keep its size and modification time (`cp -p`, `rsync -a`).

  Raises:
    FileNotFoundError: nothing at `path`.
  """
  if not os.path.isdir(path):
    return file_digest(path)
  files = {}
  for root, dirs, names in os.walk(path):
    dirs.sort()
    for name in names:
      full = os.path.join(root, name)
      if os.path.isfile(full):
        files[os.path.relpath(full, path).replace(os.sep, "/")] = file_digest(full)
  return digest(files)


# The files a CLIP vocabulary path may name or hold (`clip_tokenizer.load_vocabulary`).
_VOCABULARY_FILES = (
  "vocab.json",
  "merges.txt",
  "bpe_simple_vocab_16e6.txt.gz",
  "bpe_simple_vocab_16e6.txt",
)


def vocabulary_digest(path: str) -> str:
  """A 16-hex-character SHA-256 of the tokenizer vocabulary files at `path`: a folder's
  `_VOCABULARY_FILES` that exist (not the rest of an HF checkpoint folder), or the file itself
  with, for a `vocab.json`, the `merges.txt` beside it.

  Raises:
    FileNotFoundError: nothing at `path`.
  """
  if os.path.isdir(path):
    folder, names = path, _VOCABULARY_FILES
  elif os.path.isfile(path):
    folder, names = os.path.dirname(path), (os.path.basename(path),)
    if path.endswith(".json"):
      names += ("merges.txt",)
  else:
    raise FileNotFoundError(f"no tokenizer vocabulary at {path}")
  files = {name: os.path.join(folder, name) for name in names}
  return digest({name: file_digest(f) for name, f in files.items() if os.path.isfile(f)})


def init_checkpoint_model_key(config: ml_collections.ConfigDict) -> dict:
  """How the buffer's cache key names a model read from `config.init_checkpoint`: the
  checkpoint's contents (`checkpoint_digest`), the model fields that change its outputs
  (`config_spec.key_material` of `ModelSpec`: variant, tokenizer, vocabulary path,
  overrides, dtype) and, when a vocabulary path is set, its files' contents
  (`vocabulary_digest`).

  Raises:
    FileNotFoundError: nothing at `config.init_checkpoint` or `model.tokenizer_vocab_path`.
    ConfigError: a `model` field that breaks its rule.
  """
  model = config_spec.from_config(ModelSpec, config.model, "model")
  vocabulary = model.tokenizer_vocab_path
  return {
    "checkpoint": checkpoint_digest(expand_path(config.init_checkpoint)),
    **config_spec.key_material(model, BUFFER),
    **({"vocabulary": vocabulary_digest(expand_path(vocabulary))} if vocabulary else {}),
  }


def buffer_key_spec(
  config: ml_collections.ConfigDict, source, pretrain_meta: dict
) -> BufferKeySpec:
  """The replay store's `BufferKeySpec` from the run's config, the pre-training set `source`
  (its `annotation_file`) and the pre-trained model's meta (`pretrain_meta['cache_key']`;
  unused with an init checkpoint).

  Raises:
    FileNotFoundError: nothing at `config.init_checkpoint` or at `source.annotation_file`.
    ConfigError: a bad `config.replay`, `data`, `loss` or `model` field.
  """
  # An init checkpoint is named by its contents and the config's model fields, not its path
  # (whose file may change) nor the key in its meta.json (a pre-trained model given as
  # init_checkpoint names the config it was trained with, not this run's dtype or overrides).
  if config.init_checkpoint:
    model = init_checkpoint_model_key(config)
  else:
    model = pretrain_meta.get("cache_key")
  return BufferKeySpec(
    model=model,
    pretrain_data=file_digest(source.annotation_file),
    replay=replay_spec.settings(config),
    data=data_spec.settings(config),
    loss=config_spec.from_config(LossSpec, config.loss, "loss"),
    seed=seed_of(config, "model"),
    image_features=replay_setup.stores_image_features(config),
    objectness=replay_setup.model_version(config) == "owlv2",
  )


def buffer_key_material(config: ml_collections.ConfigDict, source, pretrain_meta: dict) -> dict:
  """What the replay store's cache key covers: `key_material` of its `BufferKeySpec`
  (`buffer_key_spec`), the digest of which names the store (`store_cache.cached_store`).

  Raises:
    FileNotFoundError: nothing at `config.init_checkpoint` or at `source.annotation_file`.
    ConfigError: a bad `config.replay`, `data`, `loss` or `model` field.
  """
  return key_material(buffer_key_spec(config, source, pretrain_meta), BUFFER)

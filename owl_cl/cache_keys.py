"""What enters the cache keys of the pre-trained model and of the replay buffer.

`cache_key_fields(config, section)` and `non_default_data_options(config)` are shared by
`owl_cl.pretrained` (the pre-training cache) and `owl_cl.replay.setup` (the buffer cache); a
leaf module, so neither imports the other (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from owl_cl import config_spec
from owl_cl.config_fields import seed_of
from owl_cl.data import data_spec
from owl_cl.model import spec as model_spec
from owl_cl.model.spec import ModelSpec
from owl_cl.replay import setup as replay_setup
from owl_cl.replay import spec as replay_spec
from owl_cl.utils import digest
from owl_cl.utils import expand_path
from owl_cl.utils import file_digest

# Fields left out of the cache keys of pre-training and of the buffer, so that caches written
# before they existed stay valid: those that choose how a step executes, not what it computes
# (matcher: the same values up to rounding), and the loss normalisation, which applies to
# continual fine-tuning only (pre-training and the buffer's losses are per image). The model's
# are its spec's (`model.spec.ModelSpec`: attention, remat).
_NOT_IN_CACHE_KEYS = {"loss": ("matcher", "normalization")}


def cache_key_fields(config: ml_collections.ConfigDict, section: str) -> dict:
  """`config.<section>` ('model' | 'loss') as it enters the cache keys.

  'model': `model.spec.cache_key_material` of its spec (an unset dtype left out). 'loss':
  without `_NOT_IN_CACHE_KEYS` and an unset objectness weight.

  Raises:
    ConfigError: a `model` field that breaks its rule.
  """
  if section == "model":
    settings = config_spec.from_config(ModelSpec, config.model, "model")
    return model_spec.cache_key_material(settings)
  out = config[section].to_dict()
  for field in _NOT_IN_CACHE_KEYS.get(section, ()):
    out.pop(field, None)
  if section == "loss" and not out.get("objectness_weight"):
    out.pop("objectness_weight", None)  # OWLv2's term off: the v1 keys of before it existed
  return out


def non_default_data_options(
  config: ml_collections.ConfigDict, buffer: bool = False
) -> dict[str, Any]:
  """{'data_options': {...}}: the keyed `config.data` fields (the input-pipeline options) that
  differ from their defaults ({} when none do), for the cache keys of the pre-trained model
  and (buffer=True: augmentations excluded, the buffer's images are not augmented) the buffer;
  `data_spec.data_options_key` of the section's settings.

  Raises:
    ConfigError: a bad or unknown `config.data` field (`config_spec.from_config`).
  """
  return data_spec.data_options_key(data_spec.settings(config), buffer=buffer)


def builtin_version_key(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{'builtin_version': v} for a built-in benchmark version other than 1, else {} (version 1's
  keys stay those of before the field existed), for the cache keys of the pre-trained model
  and the buffer (`data_spec.builtin_version_key`). Their keys also hash the pre-training
  annotation file, which differs between versions; this names the version explicitly.

  Raises:
    ConfigError: a bad or unknown `config.data` field (`config_spec.from_config`).
  """
  return data_spec.builtin_version_key(data_spec.settings(config))


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
  (`cache_key_fields(config, 'model')`: variant, tokenizer, vocabulary path, overrides, dtype)
  and, when a vocabulary path is set, its files' contents (`vocabulary_digest`).

  Raises:
    FileNotFoundError: nothing at `config.init_checkpoint` or `model.tokenizer_vocab_path`.
  """
  vocabulary = config.model.get("tokenizer_vocab_path")
  return {
    "checkpoint": checkpoint_digest(expand_path(config.init_checkpoint)),
    **cache_key_fields(config, "model"),
    **({"vocabulary": vocabulary_digest(expand_path(vocabulary))} if vocabulary else {}),
  }


def buffer_key_material(config: ml_collections.ConfigDict, source, pretrain_meta: dict) -> dict:
  """What the replay store's cache key covers: the model (the cached pre-trained model's key
  `pretrain_meta['cache_key']`, or the init checkpoint's contents and the model fields,
  `init_checkpoint_model_key`), the pre-training annotations of `source`, the replay fields
  the buffer is made of (`config_spec.key_material` of `replay.spec.ReplaySpec`: `top_k`,
  `budget` and `selection`; a field left out says why), the input options, the loss and the
  seed. A store that keeps the ViT image features (`image_features`) or an OWLv2 model's
  objectness logits (`objectness`, DER++) says so.

  Raises:
    FileNotFoundError: nothing at `config.init_checkpoint` or at `source.annotation_file`.
    ConfigError: a bad `config.replay` field (`replay.spec.settings`).
  """
  data = config.data
  # An init checkpoint is named by its contents and the config's model fields, not its path
  # (whose file may change) nor the key in its meta.json (a pre-trained model given as
  # init_checkpoint names the config it was trained with, not this run's dtype or overrides).
  if config.init_checkpoint:
    model = init_checkpoint_model_key(config)
  else:
    model = pretrain_meta.get("cache_key")
  return {
    "model": model,
    "pretrain_data": file_digest(source.annotation_file),
    "replay": config_spec.key_material(replay_spec.settings(config)),
    # The store then also holds the top-k tokens' ViT features.
    **({"image_features": True} if replay_setup.stores_image_features(config) else {}),
    # OWLv2: the store keeps the objectness logits for DER++ (docs/owlv2.md).
    **({"objectness": True} if replay_setup.model_version(config) == "owlv2" else {}),
    "data": [data.num_queries, data.num_negatives, data.max_instances],
    "loss": cache_key_fields(config, "loss"),
    "seed": seed_of(config, "model"),
    # 3: the replay fields from their spec (2 named them by hand; 1 stored raw class
    # embeddings, 2 normalised as scenic's class head returns them).
    "format": 3,
    **non_default_data_options(config, buffer=True),
    **builtin_version_key(config),
  }

"""The replay buffer's cache key names a model read from `init_checkpoint` by the checkpoint's
contents and the model fields that change its outputs, not by its path (issue 45 item 7)."""

import os
import shutil
import types

import pytest

from owl_cl import cache_keys
from owl_cl.testing.configs import tiny_config
from owl_cl.utils import digest
from owl_cl.utils import file_digest

# One value per field of `config.model` that changes the model's outputs, each unlike the
# tiny config's; `attention` and `remat` choose how a step executes (the same values up to
# rounding) and stay out of every cache key (their `key=` reasons, `model.spec.ModelSpec`).
MODEL_CHANGES = {
  "variant": "vit_b32",
  "tokenizer": "clip",
  "tokenizer_vocab_path": "vocab",  # a folder below tmp_path (the test writes it)
  "overrides": {"context_length": 16},
  "dtype": "bfloat16",
}
NOT_IN_KEY = {"attention": "cudnn", "remat": "block"}


@pytest.fixture
def source(tmp_path):
  annotations = tmp_path / "instances.json"
  annotations.write_text('{"images": []}')
  return types.SimpleNamespace(annotation_file=str(annotations))


def _write_same_size(path, data: bytes):
  """Rewrites `path` with `data` keeping its size and modification time (`cp -p` would)."""
  st = os.stat(path)
  assert len(data) == st.st_size
  with open(path, "wb") as f:
    f.write(data)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_another_checkpoint_file_at_the_same_path_changes_the_key(tmp_path, source):
  config = tiny_config("uniform", str(tmp_path / "cache"))
  # A scenic msgpack file, with the meta `load_init_checkpoint` returns for it.
  config.init_checkpoint = str(tmp_path / "weights.msgpack")
  (tmp_path / "weights.msgpack").write_bytes(b"model A")
  meta = {"source": config.init_checkpoint, "format": "scenic"}
  first = cache_keys.buffer_key_material(config, source, meta)
  _write_same_size(config.init_checkpoint, b"model B")
  second = cache_keys.buffer_key_material(config, source, meta)
  assert digest(first) != digest(second)
  # An owl_cl parameter folder (a cached pre-trained model given as init_checkpoint): its
  # meta.json's key names the config it was trained with, the same for both files.
  folder = tmp_path / "pretrained"
  (folder / "params").mkdir(parents=True)
  (folder / "params" / "data").write_bytes(b"weights A")
  meta = {"cache_key": "0123456789abcdef"}
  config.init_checkpoint = str(folder)
  first = cache_keys.buffer_key_material(config, source, meta)
  _write_same_size(folder / "params" / "data", b"weights B")
  second = cache_keys.buffer_key_material(config, source, meta)
  assert digest(first) != digest(second)
  # The same contents elsewhere select the same buffer: the path is not in the key.
  shutil.copytree(folder, tmp_path / "copy")
  config.init_checkpoint = str(tmp_path / "copy")
  assert cache_keys.buffer_key_material(config, source, meta) == second


@pytest.mark.parametrize("field", sorted(MODEL_CHANGES))
def test_each_model_field_that_changes_outputs_changes_the_key(tmp_path, source, field):
  config = tiny_config("uniform", str(tmp_path / "cache"))
  config.init_checkpoint = str(tmp_path / "weights.msgpack")
  (tmp_path / "weights.msgpack").write_bytes(b"model A")
  meta = {"cache_key": "0123456789abcdef"}
  (tmp_path / "vocab").mkdir()
  (tmp_path / "vocab" / "vocab.json").write_text('{"a</w>": 0}')
  before = cache_keys.buffer_key_material(config, source, meta)
  change = MODEL_CHANGES[field]
  if field == "tokenizer_vocab_path":
    change = str(tmp_path / change)
  config.model[field] = change
  after = cache_keys.buffer_key_material(config, source, meta)
  assert after["model"] != before["model"]
  assert after["model"][field] == change


def test_another_vocabulary_at_the_same_path_changes_the_key(tmp_path, source):
  """The vocabulary's files enter the key, not the rest of its folder (an HF checkpoint
  folder holds the weights too)."""
  config = tiny_config("uniform", str(tmp_path / "cache"))
  config.init_checkpoint = str(tmp_path / "weights.msgpack")
  (tmp_path / "weights.msgpack").write_bytes(b"model A")
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "vocab.json").write_text('{"a</w>": 0}')
  (folder / "merges.txt").write_text("#version: 0.2\n")
  config.model.tokenizer_vocab_path = str(folder)
  keys = [cache_keys.buffer_key_material(config, source, {})["model"]]
  (folder / "model.safetensors").write_bytes(b"weights")  # not a vocabulary file
  keys.append(cache_keys.buffer_key_material(config, source, {})["model"])
  (folder / "merges.txt").write_text("#version: 0.2\na b\n")
  keys.append(cache_keys.buffer_key_material(config, source, {})["model"])
  config.model.tokenizer_vocab_path = str(folder / "vocab.json")  # the file, merges beside it
  keys.append(cache_keys.buffer_key_material(config, source, {})["model"])
  assert keys[0] == keys[1] != keys[2]
  assert keys[3]["vocabulary"] == keys[2]["vocabulary"]


def test_the_fields_listed_are_every_model_field(tmp_path, source):
  config = tiny_config("uniform", str(tmp_path / "cache"))
  # A model field added later must be placed in one of the two tables.
  assert set(config.model) == set(MODEL_CHANGES) | set(NOT_IN_KEY)
  config.init_checkpoint = str(tmp_path / "weights.msgpack")
  (tmp_path / "weights.msgpack").write_bytes(b"model A")
  before = cache_keys.buffer_key_material(config, source, {})
  config.model.update(NOT_IN_KEY)
  assert cache_keys.buffer_key_material(config, source, {}) == before


def test_without_init_checkpoint_the_key_is_the_pretrained_models(tmp_path, source):
  """The cached pre-trained model's key already covers the model fields: a buffer built on
  it keeps the key it had before init checkpoints were digested."""
  config = tiny_config("uniform", str(tmp_path / "cache"))
  assert cache_keys.buffer_key_material(config, source, {"cache_key": "m"})["model"] == "m"


def test_checkpoint_digest_names_each_file_by_path_and_contents(tmp_path):
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text("{}")
  (folder / "model.safetensors").write_bytes(b"w")
  original = cache_keys.checkpoint_digest(str(folder))
  (folder / "model.safetensors").rename(folder / "other.safetensors")
  renamed = cache_keys.checkpoint_digest(str(folder))
  (folder / "extra").write_bytes(b"")
  added = cache_keys.checkpoint_digest(str(folder))
  assert len({original, renamed, added}) == 3
  # A file's digest is its `file_digest` (its bytes only).
  assert cache_keys.checkpoint_digest(str(folder / "extra")) == file_digest(str(folder / "extra"))

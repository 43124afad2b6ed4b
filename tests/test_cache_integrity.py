"""Damaged cache entries are set aside (never deleted) with a warning naming the file, rebuilt,
and the rebuilt result equals the undamaged one bit for bit (issue 33, items 1 and 6)."""

import glob
import os
import shutil

import jax
import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl import integrity
from owl_cl import pretrained
from owl_cl import trainer
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_config


def damage_in_place(path, kind, nbytes=256):
  """Damages the file `path` as a silent disk error would: its mtime kept, its size kept by a
  flip of `nbytes` bytes (in its middle, past any header); 'truncate' halves it."""
  stat = os.stat(path)
  if kind == "flip":
    offset = max(0, stat.st_size // 2 - nbytes // 2)
    with open(path, "r+b") as f:
      f.seek(offset)
      old = f.read(nbytes)
      f.seek(offset)
      f.write(bytes(b ^ 0xFF for b in old))
    assert os.path.getsize(path) == stat.st_size
  elif kind == "truncate":
    os.truncate(path, stat.st_size // 2)
  else:
    raise ValueError(kind)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def set_aside_copies(path):
  return sorted(glob.glob(glob.escape(path) + ".corrupt-*"))


# ----------------------------------------------------------------------------- pre-trained model


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory):
  """A cache folder holding only the tiny configs' built-in benchmark (generated once)."""
  cache = str(tmp_path_factory.mktemp("builtin"))
  benchmark.load_benchmark(tiny_config("swil", cache))
  return cache


@pytest.fixture
def fake_pretraining(monkeypatch):
  """Pre-training replaced by a deterministic function of the seed (the real one is tested
  elsewhere; here what matters is what the cache stores and returns), counted per call."""
  calls = []

  def pretrain(detector, bench, writer, step_checkpoints):
    del bench, writer, step_checkpoints
    calls.append(1)
    # Random values of the parameters' shapes (init_params would compile for seconds).
    like = jax.eval_shape(lambda: detector.init_params(detector.config.seed))
    rng = np.random.default_rng(detector.config.seed)
    return jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), like), [1.0, 0.5]

  monkeypatch.setattr(trainer, "pretrain", pretrain)
  monkeypatch.setattr(Detector, "evaluate", lambda self, params, source, name: {"ap": 0.5})
  return calls


def _pretrained_setup(builtin_cache, tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  for name in os.listdir(builtin_cache):
    os.symlink(os.path.join(builtin_cache, name), cache / name)
  config = tiny_config("swil", str(cache))
  detector, bench = Detector(config), benchmark.load_benchmark(config)
  return detector, bench, str(cache)


def _largest_file(folder, name=None):
  files = [
    os.path.join(root, f)
    for root, _, names in os.walk(folder)
    for f in names
    if f != integrity.MANIFEST_NAME and (name is None or f == name)
  ]
  return max(files, key=os.path.getsize)


def _equal_trees(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
    np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
    for x, y in zip(leaves_a, leaves_b)
  )


@pytest.mark.parametrize(
  "damage",
  ["flip", "truncate", "delete_metadata", "delete_manifest", "delete_meta_json"],
)
def test_damaged_pretrained_model_is_set_aside_and_rebuilt(
  builtin_cache, tmp_path, fake_pretraining, caplog, damage
):
  detector, bench, cache = _pretrained_setup(builtin_cache, tmp_path)
  params, meta = pretrained.pretrained_params(detector, bench, None)
  (entry,) = glob.glob(os.path.join(cache, "pretrained", "*[0-9a-f]"))
  assert integrity.has_manifest(entry)
  reused, reused_meta = pretrained.pretrained_params(detector, bench, None)
  assert len(fake_pretraining) == 1 and _equal_trees(reused, params)  # an intact entry: reused
  assert reused_meta == meta
  if damage in ("flip", "truncate"):
    target = _largest_file(os.path.join(entry, "params"))  # the arrays' data
    damage_in_place(target, damage)
  else:
    name = {
      "delete_metadata": "_METADATA",
      "delete_manifest": integrity.MANIFEST_NAME,
      "delete_meta_json": "meta.json",
    }[damage]
    target = glob.glob(os.path.join(entry, "**", name), recursive=True)[0]
    os.remove(target)
  with caplog.at_level("WARNING"):
    rebuilt, rebuilt_meta = pretrained.pretrained_params(detector, bench, None)
  assert len(fake_pretraining) == 2  # pre-trained again
  assert _equal_trees(rebuilt, params)
  assert rebuilt_meta["curve"] == meta["curve"]
  (aside,) = set_aside_copies(entry)  # the damaged entry kept for inspection
  assert f"{target}: " in caplog.text  # the warning names the damaged file
  assert f"moved to {aside}" in caplog.text
  assert "pre-training it again" in caplog.text
  # The rebuilt entry is verified and loads as the original.
  integrity.verify_directory(entry)
  again, _ = pretrained.pretrained_params(detector, bench, None)
  assert len(fake_pretraining) == 2 and _equal_trees(again, params)


def test_pretrained_model_cached_before_checksums_loads_with_a_warning(
  builtin_cache, tmp_path, fake_pretraining, caplog
):
  detector, bench, cache = _pretrained_setup(builtin_cache, tmp_path)
  params, _ = pretrained.pretrained_params(detector, bench, None)
  (entry,) = glob.glob(os.path.join(cache, "pretrained", "*[0-9a-f]"))
  # As an earlier version wrote it: no manifest, no checksums field in meta.json.
  os.remove(os.path.join(entry, integrity.MANIFEST_NAME))
  meta_path = os.path.join(entry, "meta.json")
  with open(meta_path) as f:
    text = f.read()
  with open(meta_path, "w") as f:
    f.write(text.replace(f'"{pretrained.CHECKSUMS_FIELD}": true', '"legacy": true'))
  with caplog.at_level("WARNING"):
    loaded, _ = pretrained.pretrained_params(detector, bench, None)
  assert len(fake_pretraining) == 1 and _equal_trees(loaded, params)
  assert "predates checksums: loaded unverified" in caplog.text
  # Damaged so that it no longer loads: set aside and rebuilt, no raw traceback.
  shutil.rmtree(os.path.join(entry, "params"))
  with caplog.at_level("WARNING"):
    rebuilt, _ = pretrained.pretrained_params(detector, bench, None)
  assert len(fake_pretraining) == 2 and _equal_trees(rebuilt, params)
  assert len(set_aside_copies(entry)) == 1

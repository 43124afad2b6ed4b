"""Damaged cache entries are set aside (never deleted) with a warning naming the file, rebuilt,
and the rebuilt result equals the undamaged one bit for bit (issue 33, items 1 and 6)."""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl import integrity
from owl_cl import pretrained
from owl_cl import trainer
from owl_cl import validation
from owl_cl.data import builtin
from owl_cl.data import scan
from owl_cl.detector import Detector
from owl_cl.replay import store as store_lib
from owl_cl.replay import store_cache as store_cache_lib
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- replay store


def _tiny_store(seed=0, n=16, t=8, q=8, m=8, c=4, e=32):
  """A pixel store whose arrays are large enough for 256 flipped bytes past their headers."""
  rng = np.random.default_rng(seed)
  queries = rng.integers(1, 100, size=(n, q, 4)).astype(np.int32)
  examples = dict(
    images=rng.integers(0, 256, size=(n, 4, 4, 3)).astype(np.uint8),
    queries=queries,
    labels=rng.integers(0, 2, size=(n, m, q)).astype(np.float32),
    boxes=rng.random((n, m, 4)).astype(np.float32),
    query_class=rng.integers(-1, c, size=(n, q)).astype(np.int32),
  )
  membership = rng.random((n, c)) < 0.5
  buffer = dict(
    class_membership=membership,
    prototypes=rng.normal(size=(c, e)).astype(np.float32),
    prototype_distances=np.where(membership, 0.3, np.inf).astype(np.float32),
    class_embeddings=rng.normal(size=(n, 2, e)).astype(np.float32),
    query_embeddings=rng.normal(size=(n, 2, e)).astype(np.float32),
  )
  logits = (rng.normal(size=(n, t, q)) * 5).astype(np.float32)
  return store_lib.ReplayStore(examples, logits, buffer, [f"c{i}" for i in range(c)])


def _store_arrays(store):
  return {name: np.array(a) for name, a in store._arrays().items()}  # pylint: disable=protected-access


@pytest.fixture
def store_cache(tmp_path):
  """(cache root, key material, build function, builds so far) of a tiny cached store."""
  builds = []

  def build(path, build_dir, key):
    del build_dir, key
    builds.append(path)
    _tiny_store().save(path)
    return {"images_kept": 16, "images_considered": 32}

  return str(tmp_path / "buffers"), {"test": 1}, build, builds


@pytest.mark.parametrize(
  "damage, name",
  [
    ("flip", "stored_logits.npy"),
    ("flip", "examples.boxes.npy"),
    ("flip", "buffer.prototypes.npy"),
    ("header", "stored_logits.npy"),
    ("truncate", "stored_logits.npy"),
    ("delete", "examples.queries.npy"),
    ("delete", integrity.MANIFEST_NAME),
    ("delete", "meta.json"),
  ],
)
def test_damaged_replay_store_is_set_aside_and_rebuilt(store_cache, caplog, damage, name):
  root, material, build, builds = store_cache
  store, stats = store_cache_lib.cached_store(root, material, build)
  expected = _store_arrays(store)
  path = store.path
  reused, _ = store_cache_lib.cached_store(root, material, build)
  assert len(builds) == 1 and _store_arrays(reused).keys() == expected.keys()
  target = os.path.join(path, name)
  if damage == "delete":
    os.remove(target)
  elif damage == "header":  # the .npy header: dtype and shape ('pickled data', wrong mmap)
    stat = os.stat(target)
    with open(target, "r+b") as f:
      f.seek(12)
      f.write(b"'O','fortran_order': True")
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  else:
    damage_in_place(target, damage)
  with caplog.at_level("WARNING"):
    rebuilt, rebuilt_stats = store_cache_lib.cached_store(root, material, build)
  assert len(builds) == 2
  got = _store_arrays(rebuilt)
  assert got.keys() == expected.keys()
  for key, array in expected.items():  # bit for bit
    assert got[key].dtype == array.dtype and np.array_equal(got[key], array), key
  assert rebuilt_stats["images_kept"] == stats["images_kept"]
  assert f"{target}: " in caplog.text  # the warning names the damaged file
  (aside,) = set_aside_copies(path)
  assert os.path.isdir(aside) and len(set_aside_copies(path + ".stats.json")) == 1
  assert "building it again" in caplog.text
  integrity.verify_directory(path)


def test_replay_store_cached_before_checksums_loads_with_a_warning(store_cache, caplog):
  root, material, build, builds = store_cache
  store, _ = store_cache_lib.cached_store(root, material, build)
  expected = _store_arrays(store)
  path = store.path
  os.remove(os.path.join(path, integrity.MANIFEST_NAME))
  meta_path = os.path.join(path, "meta.json")
  with open(meta_path) as f:
    meta = json.load(f)
  del meta[store_lib.CHECKSUMS_FIELD]
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  with caplog.at_level("WARNING"):
    loaded, _ = store_cache_lib.cached_store(root, material, build)
  assert len(builds) == 1 and "predates checksums: loaded unverified" in caplog.text
  assert all(np.array_equal(_store_arrays(loaded)[k], v) for k, v in expected.items())
  # Cut so that it no longer loads ('mmap length is greater than file size'): set aside and
  # rebuilt, no raw traceback.
  os.truncate(os.path.join(path, "stored_logits.npy"), 100)
  rebuilt, _ = store_cache_lib.cached_store(root, material, build)
  assert len(builds) == 2 and len(set_aside_copies(path)) == 1
  assert all(np.array_equal(_store_arrays(rebuilt)[k], v) for k, v in expected.items())


# ----------------------------------------------------------------------------- data scan


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_split"])
def test_damaged_scan_record_is_set_aside_and_the_split_scanned_again(tmp_path, caplog, damage):
  bench = builtin.ensure_benchmark(
    str(tmp_path / "data"),
    seed=3,
    progress=False,
    num_pretrain_train=2,
    num_pretrain_val=1,
    num_held_out_val=1,
    num_downstream_train=3,
    num_downstream_test=1,
    downstream=("digits",),
  )
  splits = [("digits", "train", bench.source("digits", "train"))]
  cache = str(tmp_path / "cache")
  assert scan.scan_splits(splits, cache) == {"scanned": 3, "cached": 0}
  assert scan.scan_splits(splits, cache) == {"scanned": 0, "cached": 3}
  (record,) = glob.glob(os.path.join(cache, scan.SCAN_FOLDER, "*.json"))
  if damage == "other_split":  # valid JSON, but not this split's record
    with open(record) as f:
      data = json.load(f)
    with open(record, "w") as f:
      json.dump(dict(data, images=99), f)
  else:
    damage_in_place(record, damage, nbytes=8)
  with caplog.at_level("WARNING"):
    assert scan.scan_splits(splits, cache) == {"scanned": 3, "cached": 0}
  assert f"data scan record {record} was damaged" in caplog.text
  assert len(set_aside_copies(record)) == 1
  with open(record) as f:
    assert json.load(f)["images"] == 3  # rewritten
  assert scan.scan_splits(splits, cache) == {"scanned": 0, "cached": 3}


def test_lazy_verification_checks_rows_when_gathered(store_cache, monkeypatch, caplog):
  root, material, build, builds = store_cache
  monkeypatch.setattr(integrity, "_CHUNK_BYTES", 256)  # tiny chunks: the logits span several
  store, _ = store_cache_lib.cached_store(root, material, build, verification="lazy")
  expected = _store_arrays(store)
  path = store.path
  logits = os.path.join(path, "stored_logits.npy")
  offset = store.stored_logits.offset
  row_bytes = store.stored_logits[0].nbytes  # 8 x 8 float16 = 128 bytes: 2 rows per chunk
  damaged_row = 10
  stat = os.stat(logits)
  with open(logits, "r+b") as f:
    f.seek(offset + damaged_row * row_bytes + 5)
    f.write(b"\xff\xfe")
  os.utime(logits, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  # Loaded without hashing the rows: the damage is not found before they are read.
  lazy, _ = store_cache_lib.cached_store(root, material, build, verification="lazy")
  assert len(builds) == 1
  batch = lazy.gather([0, 1, 15])  # rows in intact chunks
  np.testing.assert_array_equal(batch["stored_logits"], store.gather([0, 1, 15])["stored_logits"])
  with pytest.raises(integrity.IntegrityError, match="run again to rebuild it") as info:
    lazy.gather([3, damaged_row])
  assert info.value.path == logits and "differs from the manifest" in str(info.value)
  assert len(set_aside_copies(path)) == 1  # set aside: the next run rebuilds it
  rebuilt, _ = store_cache_lib.cached_store(root, material, build, verification="lazy")
  assert len(builds) == 2
  for key, array in expected.items():
    assert np.array_equal(_store_arrays(rebuilt)[key], array), key
  # 'full' finds the same damage before any row is used.
  damaged = os.path.join(rebuilt.path, "stored_logits.npy")
  with open(damaged, "r+b") as f:
    f.seek(offset + damaged_row * row_bytes + 5)
    f.write(b"\xff\xfe")
  with caplog.at_level("WARNING"):
    store_cache_lib.cached_store(root, material, build, verification="full")
  assert len(builds) == 3 and f"{damaged}: SHA-256 differs" in caplog.text


def test_unknown_store_verification_is_refused():
  config = tiny_config("swil", "/nonexistent")
  config.replay.store_verification = "sometimes"
  problems = validation.range_problems(config)
  assert any("replay.store_verification" in p and "sometimes" in p for p in problems), problems

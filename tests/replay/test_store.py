"""Tests of owl_cl.replay.store (gather, save/load)."""

import os

import numpy as np
import pytest

from owl_cl import integrity
from owl_cl.replay import store as store_lib
from owl_cl.replay.state import ReplayBuffer

N, S, Q, L, M, T, C, K, E = 5, 8, 3, 4, 2, 4, 3, 2, 6


def _store(logits_dtype="float16", uint8_images=False):
  rng = np.random.default_rng(0)
  queries = rng.integers(1, 100, size=(N, Q, L)).astype(np.int32)
  queries[:, 2] = 0  # padded query slot
  queries[1, 1] = 0
  logits = (rng.normal(size=(N, T, Q)) * 5).astype(np.float32)
  logits = np.where((queries[..., 0] == 0)[:, None, :], -1e6, logits).astype(np.float32)
  images = rng.random((N, S, S, 3)).astype(np.float32)
  if uint8_images:
    images = (images * 255).astype(np.uint8)
  examples = dict(
    images=images,
    queries=queries,
    labels=rng.integers(0, 2, size=(N, M, Q)).astype(np.float32),
    boxes=rng.random((N, M, 4)).astype(np.float32),
    query_class=rng.integers(-1, C, size=(N, Q)).astype(np.int32),
    image_id=np.arange(N, dtype=np.int64) + 100,
    orig_size=np.full((N, 2), 480, np.int32),
  )
  membership = rng.random((N, C)) < 0.5
  membership[:, 0] = True
  buffer = dict(
    class_membership=membership,
    prototypes=rng.normal(size=(C, E)),
    prototype_distances=np.where(membership, 0.3, np.inf),
    class_embeddings=rng.normal(size=(N, K, E)),
    query_embeddings=rng.normal(size=(N, K, E)),
  )
  store = store_lib.ReplayStore(
    examples, logits, buffer, ["cat", "dog", "fish"], logits_dtype=logits_dtype
  )
  return store, examples, logits


@pytest.mark.parametrize("dtype,atol", [("float32", 0.0), ("float16", 2e-2), ("bfloat16", 0.15)])
def test_gather(dtype, atol):
  store, examples, logits = _store(dtype)
  assert store.num_images == N and store.num_classes == C
  assert store.class_names == ("cat", "dog", "fish")
  idx = np.array([3, 0, 3, 1])
  batch = store.gather(idx, valid=np.array([True, True, False, True]))
  for k, v in examples.items():
    np.testing.assert_array_equal(batch[k], v[idx])
  assert batch["stored_logits"].dtype == np.float32
  np.testing.assert_allclose(batch["stored_logits"], logits[idx], atol=atol, rtol=0)
  pad = batch["stored_logits"] == -1e6
  np.testing.assert_array_equal(pad, logits[idx] == -1e6)  # padded slots exact
  assert batch["example_mask"].tolist() == [True, True, False, True]
  assert batch["buffer_index"].tolist() == [3, 0, 3, 1]
  with pytest.raises(IndexError):
    store.gather([N])
  with pytest.raises(IndexError):
    store.gather([-1])


def test_uint8_images_and_replay_buffer():
  store, examples, _ = _store(uint8_images=True)
  batch = store.gather([2])
  assert batch["images"].dtype == np.float32
  np.testing.assert_allclose(batch["images"], examples["images"][[2]] / 255.0, atol=1e-7)
  buf = store.replay_buffer()
  assert isinstance(buf, ReplayBuffer) and buf.num_images == N and buf.num_classes == C
  assert np.asarray(buf.class_valid)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mmap", [True, False])
def test_save_load_round_trip(tmp_path, dtype, mmap):
  store, _, _ = _store(dtype)
  path = os.path.join(tmp_path, "buffer")
  store.save(path)
  store.save(path)  # overwrite in place
  assert sorted(p for p in os.listdir(tmp_path)) == ["buffer"]  # no temporaries left
  loaded = store_lib.ReplayStore.load(path, mmap=mmap)
  assert loaded.class_names == store.class_names and loaded.logits_dtype == dtype
  # The folder it came from (ASER-PC's left term is cached next to it); None in memory.
  assert loaded.path == os.path.abspath(path) and store.path is None
  idx = [4, 1, 1]
  a, b = store.gather(idx), loaded.gather(idx)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  for k in store_lib.BUFFER_KEYS:
    np.testing.assert_array_equal(loaded.buffer_arrays[k], store.buffer_arrays[k])


def test_constructor_errors():
  store, examples, logits = _store()
  with pytest.raises(ValueError, match="missing"):
    store_lib.ReplayStore(
      {k: v for k, v in examples.items() if k != "boxes"},
      logits,
      store.buffer_arrays,
      store.class_names,
    )
  with pytest.raises(ValueError, match="class names"):
    store_lib.ReplayStore(examples, logits, store.buffer_arrays, ["a"])
  with pytest.raises(ValueError, match="dtype"):
    store_lib.ReplayStore(
      examples, logits, store.buffer_arrays, store.class_names, logits_dtype="int8"
    )


def _owlv2_store(dtype):
  """`_store`'s examples with OWLv2's objectness logits [N, T] (values O(5))."""
  store, examples, logits = _store(dtype)
  objectness = (np.random.default_rng(1).normal(size=(N, T)) * 5).astype(np.float32)
  owlv2 = store_lib.ReplayStore(
    examples,
    logits,
    store.buffer_arrays,
    store.class_names,
    logits_dtype=dtype,
    stored_objectness=objectness,
  )
  return owlv2, store, objectness


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_objectness_stored_gathered_saved_and_verified(tmp_path, dtype):
  """OWLv2's objectness logits: gathered float32 within the storage dtype's relative rounding
  (2^-11 float16, 2^-8 bfloat16, exact float32), saved and loaded bit for bit, covered by the
  manifest; a v1 store (no objectness) gathers and saves exactly as before."""
  owlv2, v1, objectness = _owlv2_store(dtype)
  idx = np.array([4, 0, 4])
  batch = owlv2.gather(idx)
  rtol = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype]
  assert batch["stored_objectness"].dtype == np.float32
  np.testing.assert_allclose(batch["stored_objectness"], objectness[idx], rtol=rtol, atol=0)
  v1_batch = v1.gather(idx)
  assert batch.keys() - v1_batch.keys() == {"stored_objectness"}
  for k in v1_batch:
    np.testing.assert_array_equal(batch[k], v1_batch[k], err_msg=k)

  path = str(tmp_path / "owlv2")
  owlv2.save(path)
  v1.save(str(tmp_path / "v1"))
  assert "stored_objectness.npy" in os.listdir(path)
  assert "stored_objectness.npy" not in os.listdir(tmp_path / "v1")
  assert "stored_objectness.npy" in integrity.verify_directory(path)["files"]
  assert store_lib.is_row_file("stored_objectness.npy")  # checked chunk by chunk when lazy
  loaded = store_lib.ReplayStore.load(path)
  np.testing.assert_array_equal(loaded.gather(idx)["stored_objectness"], batch["stored_objectness"])
  assert store_lib.ReplayStore.load(str(tmp_path / "v1")).stored_objectness is None
  # A flipped byte in the objectness file is found by the manifest.
  with open(os.path.join(path, "stored_objectness.npy"), "r+b") as f:
    f.seek(-2, os.SEEK_END)
    last = f.read(1)
    f.seek(-2, os.SEEK_END)
    f.write(bytes([last[0] ^ 0xFF]))
  with pytest.raises(integrity.IntegrityError, match="stored_objectness"):
    integrity.verify_directory(path)


def test_objectness_shape_refused():
  store, examples, logits = _store()
  with pytest.raises(ValueError, match=r"stored_objectness \(5, 3\) is not \[N, T\] = \(5, 4\)"):
    store_lib.ReplayStore(
      examples,
      logits,
      store.buffer_arrays,
      store.class_names,
      stored_objectness=np.zeros((N, T - 1), np.float32),
    )
  with pytest.raises(ValueError, match="must be \\[n, T\\]"):
    store_lib.encode_objectness(np.zeros((N, T, 1)))

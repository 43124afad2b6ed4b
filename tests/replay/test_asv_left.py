"""ASER-PC's left term at scale (`owl_cl/replay/retrieval/asv_left.py`): the chunked, sharded
computation against the single-jit `knn_shapley.precompute_left_term`, on 8 host devices, killed and
resumed bit for bit, and cached next to the replay store."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from owl_cl import preemption
from owl_cl.replay import state as state_lib
from owl_cl.replay.retrieval import asv_left
from owl_cl.replay.retrieval import knn_shapley
from owl_cl.replay.retrieval import registry
from owl_cl.testing import devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Values are KNN-SVs of cosine utilities in [-1, 1] divided by K or N*t (|s| <= 1, here
# <= 0.5); the two computations add the same <= 13 per-row values in another order (float32
# chunks + float64 host sums against one float32 scan), a difference of a few float32 ulps
# of the sum (~1e-7); the min is over the same values, up to the distance matmul's rounding
# in other shapes. 1e-6 covers both with margin and catches any wrong row, mask or scale.
ATOL = 1e-6


def _tokens(seed=0, n=13, t=3, e=4):
  rng = np.random.default_rng(seed)
  return (
    rng.normal(size=(n, t, e)).astype(np.float32),
    rng.normal(size=(n, t, e)).astype(np.float32),
  )


@pytest.mark.parametrize(
  "options",
  [
    dict(),  # the paper: KNN-SV, all-to-all, L2
    dict(token_matching="nearest_token", distance="cosine"),
    dict(shapley="tknn", threshold=2.5),
  ],
)
def test_equals_precompute_left_term(options):
  """Chunks of 5 over 13 images (the last one padded and masked) against the single-jit scan."""
  ce, qe = _tokens()
  left, left_min = asv_left.compute_left_term(
    ce, qe, asv_left.left_term_options(3, **options), chunk_size=5, progress=False
  )
  ref_left, ref_min = knn_shapley.precompute_left_term(ce, qe, 3, chunk_size=4, **options)
  assert left.dtype == left_min.dtype == np.float32 and left.shape == (13,)
  assert np.abs(np.asarray(ref_left)).max() > 1e-2  # not all zero: the check has teeth
  np.testing.assert_allclose(left, np.asarray(ref_left), rtol=0, atol=ATOL)
  np.testing.assert_allclose(left_min, np.asarray(ref_min), rtol=0, atol=ATOL)


def test_bad_input_named_before_any_work(tmp_path):
  ce, qe = _tokens()
  options = asv_left.left_term_options(3)
  with pytest.raises(ValueError, match=r"\[N, t, D\].*\(13, 3, 4\) and \(12, 3, 4\)"):
    asv_left.compute_left_term(ce, qe[:12], options, folder=str(tmp_path / "f"))
  with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
    asv_left.compute_left_term(ce, qe, options, chunk_size=0, folder=str(tmp_path / "f"))
  assert not os.path.exists(tmp_path / "f")
  with pytest.raises(ValueError, match="token_matching"):
    asv_left.left_term_options(3, token_matching="mean")
  with pytest.raises(ValueError, match="K must be >= 1, got 0"):
    asv_left.left_term_options(0)


SHARDED = textwrap.dedent("""
    import jax, numpy as np
    assert len(jax.devices()) == 8, jax.devices()
    from owl_cl.replay.retrieval import asv_left
    from owl_cl.replay.retrieval import knn_shapley
    from owl_cl.train import sharding
    rng = np.random.default_rng(0)
    ce, qe = (rng.normal(size=(13, 3, 4)).astype(np.float32) for _ in range(2))
    options = asv_left.left_term_options(3)
    ref_left, ref_min = (np.asarray(a) for a in knn_shapley.precompute_left_term(ce, qe, 3))
    mesh = sharding.create_mesh()
    # chunk 8: one row per device (2 chunks, the second 3 real rows); chunk 5 is rounded up to
    # 8; chunk 16: two rows per device, one chunk.
    for chunk in (8, 5, 16):
      left, left_min = asv_left.compute_left_term(
          ce, qe, options, mesh=mesh, chunk_size=chunk, progress=False)
      np.testing.assert_allclose(left, ref_left, rtol=0, atol=1e-6)
      np.testing.assert_allclose(left_min, ref_min, rtol=0, atol=1e-6)
    # jit's own cache: one compilation per chunk size (8, 5 -> 8, 16), reused by every chunk.
    assert asv_left._chunk_sums._cache_size() == 2, asv_left._chunk_sums._cache_size()
    print('OK')
""")


@pytest.mark.slow
def test_sharded_over_8_devices_equals_one_device():
  """Each device takes its own rows: were they all to take every row, psum would multiply the
  sum by 8; were rows dropped, the masked tail would be wrong."""
  env = devices.cpu_devices_env(8)
  proc = subprocess.run(
    [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  assert "OK" in proc.stdout


KILLED = textwrap.dedent("""
    import sys
    import numpy as np
    from owl_cl.replay.retrieval import asv_left
    rng = np.random.default_rng(0)
    ce, qe = (rng.normal(size=(13, 3, 4)).astype(np.float32) for _ in range(2))
    asv_left.compute_left_term(ce, qe, asv_left.left_term_options(3), chunk_size=4,
                               folder=sys.argv[1], key='k', progress=False)
    print('not killed')
""")


def test_killed_computation_resumes_bit_for_bit(tmp_path):
  """SIGKILL (the repo's OWL_CL_TEST_KILL_AT hook) after chunk 3 of 4 is computed but before
  it commits; the resumed call computes chunks 3 and 4 only and equals an uninterrupted one."""
  folder = str(tmp_path / "left.build")
  # One device, as this process (the session's other XLA flags kept).
  env = devices.cpu_devices_env(1, **{preemption.KILL_HOOK_ENV: "asv_left_chunk:3"})
  proc = subprocess.run(
    [sys.executable, "-c", KILLED, folder],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-5000:]
  with np.load(os.path.join(folder, "state.npz")) as z:
    assert int(z["chunks"]) == 2
  ce, qe = _tokens()
  options = asv_left.left_term_options(3)
  assert jax.device_count() == 1
  done = []
  resumed = asv_left.compute_left_term(
    ce, qe, options, chunk_size=4, folder=folder, key="k", progress=False, chunk_hook=done.append
  )
  assert done == [3, 4]
  whole = asv_left.compute_left_term(ce, qe, options, chunk_size=4, progress=False)
  for a, b in zip(resumed, whole):
    np.testing.assert_array_equal(a, b)
  # Another chunk size (or key) does not resume that folder: it starts afresh.
  done.clear()
  asv_left.compute_left_term(
    ce, qe, options, chunk_size=5, folder=folder, key="k", progress=False, chunk_hook=done.append
  )
  assert done == [1, 2, 3]


def test_cached_next_to_the_store_and_keyed_by_the_options(tmp_path):
  ce, qe = _tokens()
  prefix = str(tmp_path / "0123456789abcdef")  # a cached store's folder
  options = asv_left.left_term_options(3)
  calls = []
  first = asv_left.cached_left_term(
    prefix, ce, qe, options, chunk_size=4, progress=False, chunk_hook=calls.append
  )
  path = asv_left.cache_path(prefix, options)
  assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(
    "0123456789abcdef.asv_left-"
  )
  assert calls == [1, 2, 3, 4] and os.path.exists(path) and not os.path.exists(path + ".build")
  # Loaded, not recomputed (another chunk size gives the same values up to rounding).
  again = asv_left.cached_left_term(
    prefix, ce, qe, options, chunk_size=8, progress=False, chunk_hook=calls.append
  )
  assert calls == [1, 2, 3, 4]
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  # Options that change the values change the file; unused ones (K under 'tknn') do not.
  assert asv_left.cache_path(prefix, asv_left.left_term_options(4)) != path
  assert (
    asv_left.cache_path(prefix, asv_left.left_term_options(3, features="image_features")) != path
  )
  tknn = lambda k: asv_left.cache_path(prefix, asv_left.left_term_options(k, shapley="tknn"))
  assert tknn(3) == tknn(20) != path


def test_algorithm_prepare_caches_and_reloads(tmp_path):
  """ASER-PC's `prepare` with a cache prefix fills the state as without one and leaves the
  cached file; a second prepare (fresh state) reads that file (its values replaced by a
  marker here, to tell a load from a recomputation)."""
  rng = np.random.default_rng(1)
  n = 9
  membership = rng.random((n, 3)) < 0.5
  membership[:, 0] = True
  ce, qe = _tokens(seed=1, n=n)
  buffer = state_lib.make_replay_buffer(
    membership,
    rng.normal(size=(3, 4)).astype(np.float32),
    np.where(membership, 0.5, np.inf).astype(np.float32),
    ce,
    qe,
  )
  algorithm = registry.get_algorithm("aser_pc", num_candidates=4, knn_k=3, asv_chunk_size=4)
  fresh = lambda: state_lib.init_replay_state(n, jax.random.PRNGKey(0), num_classes=3)
  plain = algorithm.prepare(fresh(), buffer)
  prefix = str(tmp_path / "store")
  cached = algorithm.prepare(fresh(), buffer, cache_prefix=prefix)
  assert bool(cached.asv_left_ready)
  np.testing.assert_array_equal(np.asarray(cached.asv_left), np.asarray(plain.asv_left))
  np.testing.assert_array_equal(np.asarray(cached.asv_left_min), np.asarray(plain.asv_left_min))
  path = asv_left.cache_path(prefix, algorithm.left_term_options())
  with np.load(path) as z:
    key = z["key"]
  marker = np.arange(n, dtype=np.float32)
  np.savez(path, left=marker, left_min=-marker, key=key)
  loaded = algorithm.prepare(fresh(), buffer, cache_prefix=prefix)
  np.testing.assert_array_equal(np.asarray(loaded.asv_left), marker)
  np.testing.assert_array_equal(np.asarray(loaded.asv_left_min), -marker)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_cached_left_term_is_set_aside_and_recomputed(tmp_path, caplog, damage):
  ce, qe = _tokens()
  prefix = str(tmp_path / "0123456789abcdef")
  options = asv_left.left_term_options(3)
  calls = []
  first = asv_left.cached_left_term(
    prefix, ce, qe, options, chunk_size=4, progress=False, chunk_hook=calls.append
  )
  path = asv_left.cache_path(prefix, options)
  stat = os.stat(path)
  with open(path, "r+b") as f:
    data = bytearray(f.read())
  # The left term's values (a member's data, not the zip directory): found by their bytes.
  start = bytes(data).index(np.asarray(first[0]).tobytes())
  if damage == "flip":
    data[start : start + 16] = bytes(b ^ 0xFF for b in data[start : start + 16])
  else:
    data = data[: start + 8]
  with open(path, "wb") as f:
    f.write(bytes(data))
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  with caplog.at_level("WARNING"):
    again = asv_left.cached_left_term(
      prefix, ce, qe, options, chunk_size=4, progress=False, chunk_hook=calls.append
    )
  assert calls == [1, 2, 3, 4] * 2  # recomputed
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  assert f"{path}: unreadable" in caplog.text and "recomputing it" in caplog.text
  assert len([n for n in os.listdir(tmp_path) if ".corrupt-" in n]) == 1

"""The NumPy references of benchmarks/retrieval.py (the benchmark's independent check)."""

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "benchmarks",
  "retrieval.py",
)
_spec = importlib.util.spec_from_file_location("benchmark_retrieval", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up by name
_spec.loader.exec_module(bench)


def _knn_utility(subset, distances, utilities, k):
  """U(S) = (1/K) * sum of u over the min(K, |S|) members of S nearest to the point."""
  nearest = sorted(subset, key=lambda i: (distances[i], i))[:k]
  return sum(utilities[i] for i in nearest) / k


def _brute_force_shapley(distances, utilities, k, candidates):
  values = np.zeros(len(distances))
  perms = list(itertools.permutations(candidates))
  for perm in perms:
    seen = []
    for i in perm:
      before = _knn_utility(seen, distances, utilities, k)
      seen.append(i)
      values[i] += _knn_utility(seen, distances, utilities, k) - before
  return values / len(perms)


def test_numpy_knn_shapley_is_the_exact_shapley_value():
  rng = np.random.default_rng(0)
  for n_c, k in ((5, 2), (4, 6), (6, 3)):  # N_c >= K and N_c < K
    distances = rng.random((2, n_c)).astype(np.float32)
    utilities = rng.uniform(-1, 1, (2, n_c)).astype(np.float32)
    valid = np.ones(n_c, bool)
    valid[1] = False  # an invalid candidate does not count
    got = bench.np_knn_shapley(distances, utilities, k, valid)
    for row in range(2):
      want = _brute_force_shapley(distances[row], utilities[row], k, np.flatnonzero(valid))
      np.testing.assert_allclose(got[row], want, atol=1e-6, err_msg=f"N_c={n_c} K={k}")
    assert np.all(got[:, 1] == 0)


def test_numpy_asv_hand_worked():
  left = np.array([[0.2, 0.4], [0.0, 0.2]], np.float32)  # min S_l = 0.0 -> w = c
  right = np.array([[-0.1, 0.3], [0.1, -0.2]], np.float32)
  asv = bench.np_asv(left, right, 0.5)
  # column means of left: [0.1, 0.3]; minima of right: [-0.1, -0.2]; w = 0.5.
  np.testing.assert_allclose(asv, [0.05 + 0.1, 0.15 + 0.2], rtol=1e-6)
  left[1, 0] = 0.1  # min S_l = 0.1 -> w = 0.5*0.2/0.1
  np.testing.assert_allclose(
    bench.np_asv(left, right, 0.5), [1.0 * 0.15 + 0.1, 1.0 * 0.3 + 0.2], rtol=1e-6
  )


def test_numpy_probabilities_and_entropy():
  p = bench.np_prototype_probs(
    np.array([[0.5, 1.0, np.inf, 0.25]]), np.array([[True, True, True, False]]), 1.0
  )
  np.testing.assert_allclose(p, [[2 / 3, 1 / 3, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(bench.np_normalized_entropy(np.full((1, 4), 0.25)), [1.0])
  np.testing.assert_allclose(
    bench.np_normalized_entropy(np.array([[0.5, 0.5, 0, 0]])), [math.log(2) / math.log(4)]
  )


def test_synthetic_buffer_membership():
  sizes = bench.Sizes(num_images=300, num_classes=20, top_k=2, embed_dim=4)
  buf = bench.synthetic_buffer(sizes)
  per_image = buf["class_membership"].sum(1)
  assert per_image.min() >= 1 and per_image.max() <= 5  # 1-4 drawn (+1 coverage)
  assert buf["class_membership"].any(0).all()  # every class has members
  assert np.isinf(buf["prototype_distances"][~buf["class_membership"]]).all()


def test_sizes_and_markdown_one_table_per_size():
  assert bench.sizes_for(54_226) == bench.FULL
  million = bench.sizes_for(1_000_000)
  assert million.num_images == 1_000_000 and million.embed_dim == bench.MILLION.embed_dim
  timing = {"median_s": 0.002, "min_s": 0.002, "repeats": 1}
  runs = [
    {
      "sizes": dict(bench.dataclasses.asdict(sizes)),
      "repeats": 3,
      "rows": [bench._row("algorithm", "grasp", timing, dict(timing, median_s=0.004), "B=16")],
    }
    for sizes in (bench.FULL, million)
  ]
  report = dict(
    runs=runs,
    device="cpu",
    backend="cpu",
    jax_version="x",
    numpy_version="y",
    train_step_seconds=0.25,
    not_measured=[],
  )
  text = bench.render_markdown(report)
  assert text.count("| algorithm: `grasp` | B=16 | 2.00 ms | 4.00 ms | 2.0x | - | 0.8% |") == 2
  assert "N=54226" in text and "N=1000000" in text and f"E={million.embed_dim} (buffer" in text


def test_algorithms_get_the_sizes_of_the_numpy_references():
  # --quick shrinks N_c and K; the timed algorithms must do the same work as the references
  # (they once ran the registry's paper defaults, N_c 168 / 352 and K 20, against N_c 32 / 48
  # and K 5 in NumPy). At the paper's sizes the values are the registry's defaults.
  for sizes in (bench.QUICK, bench.FULL):
    for name, n_c in (("aser", sizes.candidates_aser), ("sw_aser_pc", sizes.candidates_pc)):
      algorithm = bench.registry.get_algorithm(name, **bench.algorithm_hyperparameters(name, sizes))
      assert (algorithm.num_candidates, algorithm.knn_k) == (n_c, sizes.knn_k)
  assert bench.algorithm_hyperparameters("grasp", bench.QUICK) == {}
  default = bench.registry.get_algorithm("aser_pc")
  assert (default.num_candidates, default.knn_k) == (bench.FULL.candidates_pc, bench.FULL.knn_k)


def test_markdown_of_the_algorithms_in_fresh_processes():
  # Hand-worked: JAX medians 0.30, 0.50, 0.40 ms -> median 0.40 (0.30-0.50); NumPy 0.44, 0.45,
  # 0.43 -> 0.44 (0.43-0.45); ratio 0.44 / 0.40 = 1.1x; JAX <= NumPy in processes 1 and 3.
  processes = {"uniform_balanced": {"jax_ms": [0.30, 0.50, 0.40], "numpy_ms": [0.44, 0.45, 0.43]}}
  timing = {"median_s": 0.002, "min_s": 0.002, "repeats": 1}
  run = {
    "sizes": dict(bench.dataclasses.asdict(bench.FULL)),
    "repeats": 3,
    "rows": [bench._row("algorithm", "uniform_balanced", timing, timing, "B=16")],
    "processes": processes,
  }
  report = dict(
    runs=[run], device="cpu", backend="cpu", jax_version="x", numpy_version="y", not_measured=[]
  )
  text = bench.render_markdown(report)
  assert "The algorithms again in 3 fresh processes" in text
  assert (
    "| `uniform_balanced` | 0.40 ms (0.30-0.50) | 0.44 ms (0.43-0.45) | 1.1x | 2 of 3 |" in text
  )


def test_floor_rows_time_the_fixed_parts_against_numpys_whole_calls():
  sizes = bench.Sizes(num_images=200, num_classes=12, top_k=2, embed_dim=4, batch=4)
  buf = bench.synthetic_buffer(sizes)
  buffer = bench.state_lib.make_replay_buffer(
    buf["class_membership"],
    buf["prototypes"],
    buf["prototype_distances"],
    buf["class_embeddings"],
    buf["query_embeddings"],
  )
  rows = bench.bench_floors(sizes, buf, buffer, bench.synthetic_features(sizes), repeats=2)
  assert [(r["kind"], r["name"]) for r in rows] == [
    ("floor", "state round trip"),
    ("floor", "class_index.block_pool"),
    ("floor", "class_index.pools"),
  ]
  index = buffer.class_index
  assert [r["shape"] for r in rows] == ["B=4", "[200]", f"P={index.members.shape[0]}"]
  for row in rows:
    assert row["jax_s"]["repeats"] == 2 and row["jax_s"]["median_s"] > 0
    assert row["ratio_numpy_over_jax"] == row["numpy_s"]["median_s"] / row["jax_s"]["median_s"]
  # The NumPy column is the whole uniform call for the first two, uniform_balanced's for the
  # class pass.
  assert rows[0]["numpy_s"] is rows[1]["numpy_s"]
  assert rows[2]["numpy_s"] is not rows[0]["numpy_s"]


@pytest.mark.slow
def test_smoke_runs_every_row_in_fresh_processes(tmp_path):
  # The whole script as a user runs it at the smoke sizes, with the algorithms again in 2
  # fresh processes: every kind of row is written, one per algorithm.
  argv = [sys.executable, _PATH, "--smoke", "--processes=2", f"--out={tmp_path}"]
  subprocess.run(argv, check=True, cwd=tmp_path, capture_output=True, timeout=900)
  report = json.loads((tmp_path / "retrieval_smoke.json").read_text())
  (run,) = report["runs"]
  assert run["sizes"]["num_images"] == bench.SMOKE.num_images and report["smoke"]
  kinds = [r["kind"] for r in run["rows"]]
  assert kinds.count("algorithm") == len(bench.registry.ALGORITHMS)
  assert {"build", "kernel", "floor", "precompute"} <= set(kinds)
  for name in bench.registry.ALGORITHMS:
    assert len(run["processes"][name]["jax_ms"]) == 2
  md = (tmp_path / "retrieval_smoke.md").read_text()
  assert "The algorithms again in 2 fresh processes" in md


def test_numpy_references_pair_registry_names_with_their_methods():
  # The one table that names algorithms here: each key a registry algorithm, each value the
  # method of the same name (a swapped pair would time one algorithm against another's maths).
  assert set(bench.NUMPY_REFERENCES) <= set(bench.registry.ALGORITHMS)
  assert {name: fn.__name__ for name, fn in bench.NUMPY_REFERENCES.items()} == {
    name: name for name in bench.NUMPY_REFERENCES
  }


def test_numpy_references_draw_distinct_unreplayed_images():
  # Invariants of every reference at the smoke sizes: B distinct indices in [0, N), each call's
  # images disjoint from the previous call's (dedup 'dataset': N = 200 >> 2 B = 8).
  sizes = bench.SMOKE
  buf, feats = bench.synthetic_buffer(sizes), bench.synthetic_features(sizes)
  for name in bench.NUMPY_REFERENCES:
    ref = bench.NumpyRetrieval(buf, sizes)
    ref.left = np.linspace(-0.01, 0.05, sizes.num_images, dtype=np.float32)
    ref.left_min = ref.left - 0.02
    first, second = ref(name, feats), ref(name, feats)
    for indices in (first, second):
      assert len(set(indices.tolist())) == sizes.batch, name
      assert 0 <= indices.min() and indices.max() < sizes.num_images, name
    assert not set(first.tolist()) & set(second.tolist()), name
    assert ref.replayed.sum() == 2 * sizes.batch, name


def test_an_algorithm_without_a_numpy_reference_is_timed_and_said(monkeypatch):
  # A registry algorithm the benchmark has no NumPy maths for (another branch's new one) is
  # picked up from the registry, timed in JAX, and its rows say it has no reference.
  monkeypatch.setitem(
    bench.registry.ALGORITHMS, "copy_of_uniform", bench.registry.ALGORITHMS["uniform"]
  )
  sizes = bench.SMOKE
  buf, feats = bench.synthetic_buffer(sizes), bench.synthetic_features(sizes)
  arrays = (buf[k] for k in ("class_membership", "prototypes", "prototype_distances"))
  buffer = bench.state_lib.make_replay_buffer(
    *arrays, buf["class_embeddings"], buf["query_embeddings"]
  )
  (row,) = bench.bench_algorithms(sizes, buf, buffer, feats, ["copy_of_uniform"], repeats=1)
  assert row["numpy_s"] is None and row["ratio_numpy_over_jax"] is None
  assert row["jax_s"]["median_s"] > 0 and row["note"] == bench.NO_REFERENCE
  run = {"sizes": bench.dataclasses.asdict(sizes), "repeats": 1, "rows": [row]}
  run["processes"] = {"copy_of_uniform": {"jax_ms": [0.30, 0.50], "numpy_ms": []}}
  report = dict(
    runs=[run], device="cpu", backend="cpu", jax_version="x", numpy_version="y", not_measured=[]
  )
  text = bench.render_markdown(report)
  assert "| algorithm: `copy_of_uniform` (no NumPy reference) | B=4 |" in text
  assert "| not measured | - | - |" in text
  assert "| `copy_of_uniform` | 0.40 ms (0.30-0.50) | no NumPy reference | - | - |" in text

"""The per-step time breakdown (owl_cl.train.timing): its partition of a step, its summary."""

import time

import jax
import jax.numpy as jnp
import pytest

from owl_cl.train import timing


def test_step_record_partitions_the_step_by_hand():
  # C_0 = 10.0. embed dispatched at 10.5 (the device waited 0.5 s for the host), done 11.0;
  # retrieval dispatched at 10.6, queued behind embed: runs 11.0 -> 11.3; the train step
  # dispatched at 11.5 (0.2 s of host gather), done 12.5.
  calls = [("embed", 10.5, 11.0), ("retrieval", 10.6, 11.3), ("train_step", 11.5, 12.5)]
  record = timing.step_record(10.0, calls)
  expected = {"embed": 0.5, "retrieval": 0.3, "train_step": 1.0, "host_idle": 0.7}
  assert record.keys() == expected.keys() | {"step_seconds"}
  # Differences of numbers ~10 in float64: exact to ~1e-14.
  assert record == pytest.approx(dict(expected, step_seconds=2.5), abs=1e-12)


def test_step_record_first_step_and_jitter():
  # No previous step: the chain starts at the first dispatch (no idle before it).
  assert timing.step_record(None, [("train_step", 3.0, 4.0)]) == pytest.approx(
    {"train_step": 1.0, "host_idle": 0.0, "step_seconds": 1.0}
  )
  # A completion timestamped before its call could start (watcher jitter) counts 0 s and the
  # chain goes on from that start, so the parts still add up to the step.
  record = timing.step_record(5.0, [("retrieval", 5.2, 5.1), ("train_step", 5.3, 6.0)])
  assert record == pytest.approx(
    {"retrieval": 0.0, "train_step": 0.7, "host_idle": 0.3, "step_seconds": 1.0}, abs=1e-12
  )
  # A late timestamp (embed 11.8, after the retrieval that needs it finished at 11.3) is
  # lowered to 11.3; the train step's to the next step's first completion (12.0).
  calls = [("embed", 10.1, 11.8), ("retrieval", 10.2, 11.3), ("train_step", 11.5, 12.4)]
  record = timing.step_record(10.0, calls, next_done=12.0)
  assert record == pytest.approx(
    {"embed": 1.2, "retrieval": 0.0, "train_step": 0.5, "host_idle": 0.3, "step_seconds": 2.0},
    abs=1e-12,
  )


def test_collect_with_calls_prepared_ahead_by_hand():
  # Step 1 (the loop's first): retrieval 0.0 -> 0.1, the train step dispatched at 0.2, done
  # 1.0. Step 2's features and retrieval were prepared ahead (stale lookahead), dispatched at
  # 0.15 and 0.16, before step 1's train step: they do not need it, so they must not cut
  # step 1 short (they end inside it: 0 s of their own); step 2's train step, dispatched at
  # 0.5 while step 1's still ran, starts at 1.0 and ends at 2.0 (no host idle).
  timer = timing.StepTimer()
  try:
    for calls in (
      [("retrieval", 0.0, 0.1), ("train_step", 0.2, 1.0)],
      [("embed", 0.15, 0.3), ("retrieval", 0.16, 0.4), ("train_step", 0.5, 2.0)],
    ):
      for name, dispatch, done in calls:
        timer.device(name, dispatch, done)
      timer.end_step()
    first, second = timer.collect()
  finally:
    timer.close()
  assert first == pytest.approx(
    {"retrieval": 0.1, "train_step": 0.8, "host_idle": 0.1, "step_seconds": 1.0}, abs=1e-12
  )
  assert second == pytest.approx(
    {"embed": 0.0, "retrieval": 0.0, "train_step": 1.0, "host_idle": 0.0, "step_seconds": 1.0},
    abs=1e-12,
  )


def test_summarize_by_hand():
  records = [
    {"step_seconds": 1.0, "train_step": 0.9, "host_idle": 0.1, "gather": 0.05},
    {"step_seconds": 3.0, "train_step": 2.0, "host_idle": 1.0, "gather": 0.8},
    {"step_seconds": 2.0, "train_step": 1.5, "host_idle": 0.5, "gather": 0.3},
  ]
  summary = timing.summarize(records)
  assert summary["steps"] == 3
  assert summary["mean"]["step_seconds"] == pytest.approx(2.0)
  assert summary["median"]["host_idle"] == pytest.approx(0.5)
  assert summary["mean"]["gather"] == pytest.approx(1.15 / 3, abs=1e-6)  # rounded to 1e-6
  assert summary["mean"]["embed"] == 0.0  # absent = 0 (e.g. uniform retrieval)
  assert summary["host_idle_fraction"] == pytest.approx(1.6 / 6.0, abs=1e-6)
  assert timing.summarize([]) == {}


def test_timer_on_real_device_calls_is_a_consistent_partition():
  """Three steps of a feature -> retrieval -> train chain on the device: every part is
  non-negative and the parts add up to the step (float rounding of perf_counter seconds)."""
  embed = jax.jit(lambda w, x: jnp.tanh(x @ w))
  retrieve = jax.jit(lambda f: jnp.argsort(f.sum(-1)))
  train = jax.jit(lambda w, f: w - 1e-3 * f.T @ f)
  w = jnp.eye(64)
  x = jnp.ones((64, 64))
  timer = timing.StepTimer()
  try:
    for _ in range(3):
      t = time.perf_counter()
      f = embed(w, x)
      timer.device("embed", t, f)
      t = time.perf_counter()
      indices = jax.device_get(retrieve(f))
      timer.device("retrieval", t, time.perf_counter())
      start = time.perf_counter()
      gathered = x[indices[:8]]  # host-side stand-in for the gather
      timer.host("gather", time.perf_counter() - start)
      t = time.perf_counter()
      w = train(w, f + gathered.sum())
      timer.device("train_step", t, w)
      timer.end_step()
    records = timer.collect()
  finally:
    timer.close()
  assert len(records) == 3 and timer.collect() == []  # each step is returned once
  for record in records:
    assert set(record) == {"step_seconds", *timing.COMPONENTS} - {"input"}
    assert all(v >= 0.0 for v in record.values()), record
    parts = sum(record[k] for k in ("embed", "retrieval", "train_step", "host_idle"))
    assert parts == pytest.approx(record["step_seconds"], abs=1e-9)
    # The host waited for the indices, so the gather lies inside the device's idle time.
    assert record["gather"] <= record["host_idle"] + 1e-9
  summary = timer.summary()
  assert summary["steps"] == 2  # the first step (compilation) is left out
  assert 0.0 <= summary["host_idle_fraction"] <= 1.0
  assert timing.means(records).keys() == {"step_seconds", *timing.COMPONENTS, "host_idle_fraction"}

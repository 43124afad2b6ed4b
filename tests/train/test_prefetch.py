"""The background batch prefetcher (owl_cl.train.prefetch): same items, bounded, errors kept."""

import threading
import time

import pytest

from owl_cl.train import prefetch


def _counting(n, reads):
  for i in range(n):
    reads.append(i)
    yield i


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("limit", [None, 0, 4, 20])
def test_yields_what_the_serial_map_would(depth, limit):
  reads, threads = [], set()

  def transform(i):
    threads.add(threading.current_thread().name)
    return {"x": 10 * i}

  with prefetch.Prefetcher(_counting(7, reads), transform, depth, limit) as items:
    got = list(items)
    assert next(items, "end") == "end"  # stays exhausted
  n = 7 if limit is None else min(7, limit)
  assert got == [{"x": 10 * i} for i in range(n)]
  assert reads == list(range(n))  # never more than `limit` batches read
  if n:
    assert threads == ({threading.current_thread().name} if depth == 0 else {"batch-prefetch"})


def test_reader_error_is_raised_after_the_items_before_it():
  def batches():
    yield 1
    yield 2
    raise OSError("bad image 3.jpg")

  with prefetch.Prefetcher(batches(), lambda b: b, 2, None) as items:
    assert next(items) == 1 and next(items) == 2
    with pytest.raises(OSError, match="bad image 3.jpg"):
      next(items)


def test_close_stops_a_reader_that_is_ahead():
  reads = []
  items = prefetch.Prefetcher(_counting(100, reads), lambda b: b, 2, None)
  assert next(items) == 0
  deadline = time.time() + 10
  while len(reads) < 4 and time.time() < deadline:  # the reader fills the queue (2) + 1 held
    time.sleep(0.01)
  items.close()
  # At most depth + 1 read beyond the consumed one, and nothing after close.
  assert len(reads) == 4
  time.sleep(0.1)
  assert len(reads) == 4


def test_bad_depth_or_limit_is_refused():
  with pytest.raises(ValueError, match="depth"):
    prefetch.Prefetcher(iter([]), lambda b: b, -1, None)
  with pytest.raises(ValueError, match="limit"):
    prefetch.Prefetcher(iter([]), lambda b: b, 1, -2)

"""Bounded background prefetch of the training batches (issue 10 item 4).

`Prefetcher(batches, transform, depth, limit)` reads the next batches of an iterator and
applies `transform` (in the loop: `sharding_lib.shard_batch`, the host->device transfer) in a
background thread, up to `depth` batches ahead, while the loop's own thread waits for the
device (the retrieved indices) and gathers the replay batch. It yields exactly the items the
serial `map(transform, islice(batches, limit))` would, in the same order: only the thread that
computes them differs, so the training results are the same bit for bit.

Position: the loop counts a batch when it consumes it (`LoopState.batch_in_epoch`), never
when it is prefetched, and `limit` (the steps left in the phase) keeps the reader from
decoding batches that no step will take; a batch read ahead and not consumed (a stop by
SIGTERM, an error) is dropped, and a resumed loop reads it again from its position.

`depth` 0 is the serial loop: every batch is read and transferred in the caller's thread when
asked for (no thread is started).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
import itertools
import queue
import threading
from typing import Any

_END = object()  # the reader has no more items


class Failure:
  """An exception of the reader thread (or of a batch the loop read early), raised again in
  the consumer's thread when the item is taken."""

  def __init__(self, error: BaseException):
    self.error = error


class ReadAhead:
  """The training loop's view of its phase's items: `(epoch, None)` as an epoch begins, then
  `(epoch, batch)` per batch (`trainer.train_loop`), taken in order with `take`, and the next
  batch readable before its turn with `peek_batch` (a stale retrieval's features read it one
  step early). Items read early are kept and taken in their turn; an error met while reading
  early is raised when its item is taken, where the serial loop would have met it.
  """

  def __init__(self, items: Iterator):
    self._items = items
    self._early = collections.deque()  # items read before their turn

  def take(self) -> Any:
    """The next item, or None at the phase's end. Raises the error of a failed read."""
    item = self._early.popleft() if self._early else next(self._items, None)
    if isinstance(item, Failure):
      raise item.error
    return item

  def peek_batch(self) -> Any:
    """The next item's batch, read now and kept for its turn (the epoch markers before it
    too), or None when no batch follows or reading it failed."""
    while True:
      try:
        item = next(self._items, None)
      except Exception as error:  # pylint: disable=broad-except
        item = Failure(error)
      self._early.append(item)
      if item is None or isinstance(item, Failure):
        return None
      if item[1] is not None:
        return item[1]


class Prefetcher:
  """Iterator over `transform(batch)` for the first `limit` batches, read `depth` ahead.

  Args:
    batches: iterator of host batches (e.g. `Detector.train_batches`).
    transform: applied to every batch in the reader thread (e.g. `shard_batch`).
    depth: batches kept ready (the reader holds at most one more while it waits); 0 = none,
      read in the caller's thread.
    limit: how many batches at most are read (None: all of them).

  Raises (from `next`): the reader's exception (a bad image's DataError, ...), in order: the
  items before it are yielded first.
  ValueError (at once): a negative `depth` or `limit`.

  Use as a context manager (or call `close()`): stops and joins the reader thread.
  """

  def __init__(
    self, batches: Iterator, transform: Callable[[Any], Any], depth: int, limit: int | None
  ):
    if depth < 0:
      raise ValueError(f"prefetch depth must be >= 0, got {depth}")
    if limit is not None and limit < 0:
      raise ValueError(f"prefetch limit must be >= 0, got {limit}")
    self._items = map(transform, itertools.islice(batches, limit))
    self._thread = None
    if depth:
      self._queue: queue.Queue = queue.Queue(maxsize=depth)
      self._stop = threading.Event()
      self._thread = threading.Thread(target=self._read, name="batch-prefetch", daemon=True)
      self._thread.start()

  def _put(self, item) -> bool:
    """Puts `item` when there is room; False if the consumer stopped meanwhile."""
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.05)
        return True
      except queue.Full:
        continue
    return False

  def _read(self) -> None:
    # `close` sets the stop event before it makes room in the queue: a put that room let
    # through is followed by this check, so nothing is read after `close`.
    while not self._stop.is_set():
      try:
        item = next(self._items)
      except StopIteration:
        self._put(_END)
        return
      except BaseException as error:  # pylint: disable=broad-except
        # Handed to the consumer, which raises it where the serial loop would have.
        self._put(Failure(error))
        return
      if not self._put(item):
        return

  def __iter__(self):
    return self

  def __next__(self):
    if self._thread is None:
      return next(self._items)
    item = self._queue.get()
    if item is _END:
      self._queue.put(_END)  # a later `next` ends too
      raise StopIteration
    if isinstance(item, Failure):
      self._queue.put(item)
      raise item.error
    return item

  def close(self) -> None:
    """Stops the reader (dropping what it read ahead) and waits for it to end."""
    if self._thread is None:
      return
    self._stop.set()
    while self._thread.is_alive():
      try:  # make room for a put in progress
        self._queue.get(timeout=0.05)
      except queue.Empty:
        pass
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()

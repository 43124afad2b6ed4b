"""`hf_warnings_as_errors`: a block in which HF transformers may not warn (tests of exports)."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import logging
import warnings


@contextlib.contextmanager
def hf_warnings_as_errors() -> Iterator[None]:
  """Fails the block if transformers warns in it, through `warnings` or its loggers.

  transformers reports most problems of a config or checkpoint through `logging`, many with
  `warning_once` (a cache over the message): the cache is cleared on entry, so a line an
  earlier test (or the test's own reference model) already emitted is emitted again. The
  verbosity is set to 'warning' for the block (an environment may have quietened it) and
  restored after.

  Raises:
    AssertionError: on exit, listing every warning line transformers logged in the block.
    Warning: a `warnings.warn` in the block (raised at the call, as `simplefilter('error')`).
  """
  import transformers  # pylint: disable=g-import-not-at-top  (the 'hf' extra)

  records: list[logging.LogRecord] = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = records.append
  hf_logger = logging.getLogger("transformers")
  verbosity = transformers.logging.get_verbosity()
  transformers.logging.set_verbosity_warning()
  transformers.utils.logging.warning_once.cache_clear()
  hf_logger.addHandler(handler)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      yield
  finally:
    hf_logger.removeHandler(handler)
    transformers.logging.set_verbosity(verbosity)
  lines = [f"{r.name}: {r.getMessage()}" for r in records]
  assert not lines, "transformers warned:\n" + "\n".join(lines)

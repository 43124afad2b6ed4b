"""What a user reads in a run's log (`owl_cl.run_log`, `owl_cl.main.QuietLibraryInfo`)."""

import logging

import pytest

from owl_cl import main
from owl_cl import run_log


class _Collect(logging.Handler):
  """Keeps the records that pass its filters."""

  def __init__(self):
    super().__init__()
    self.records = []

  def emit(self, record):
    self.records.append(record)


def test_metrics_line_gives_each_sets_headline_metrics_in_points():
  metrics = {
    "pretrain_val": {"AP": 0.2584, "AP50": 0.61, "AR": 0.3},
    "held_out": {"AP": 0.154, "APr": 0.1006, "APc": 0.2},
    "thermal": {"AP": float("nan"), "AP50": float("nan")},
  }
  assert run_log.metrics_line("pre-training", metrics) == (
    "after pre-training: pretrain_val AP 25.8 | held_out AP 15.4 APr 10.1 | thermal AP nan"
  )


def _warn_five_times(logger):
  for reset in range(1, 6):
    logger.warning("buffer exhausted (reset #%d)", reset)  # one place: one kind


def test_repeated_warnings_are_counted_and_summarised_once_per_period():
  logger = logging.getLogger("test_run_log.repeats")
  logger.propagate = False
  logger.setLevel(logging.INFO)
  first, second = _Collect(), _Collect()
  repeats = run_log.RepeatedWarnings()
  for handler in (first, second):
    handler.addFilter(repeats)
    logger.addHandler(handler)
  try:
    _warn_five_times(logger)
    logger.warning("another kind")
    for _ in range(3):
      logger.info("an INFO line")  # other levels pass untouched
      logger.error("an ERROR line")
    # Both handlers got the same records: the first warning of each kind and every other line.
    for handler in (first, second):
      messages = [r.getMessage() for r in handler.records]
      assert messages == [
        "buffer exhausted (reset #1)",
        "another kind",
        *["an INFO line", "an ERROR line"] * 3,
      ]
    # Counted once per record, not once per handler: 4 more of the first kind, none of the other.
    with pytest.MonkeyPatch.context() as patch:
      logged = []
      patch.setattr(run_log.absl_logging, "warning", lambda fmt, text, **k: logged.append(text))
      lines = repeats.summarise("dataset 1 (thermal)")
    assert lines == logged and len(lines) == 1
    assert lines[0].startswith("the warning of test_run_log.py:")
    assert lines[0].endswith(
      "above was repeated 4 more times during dataset 1 (thermal); the last: buffer exhausted "
      "(reset #5)"
    )
    # A new period shows the first warning of each kind again.
    first.records.clear()
    _warn_five_times(logger)
    assert [r.getMessage() for r in first.records] == ["buffer exhausted (reset #1)"]
  finally:
    for handler in (first, second):
      logger.removeHandler(handler)


def test_summarised_warnings_installs_on_the_root_handlers_and_summarises_on_exit(monkeypatch):
  root = logging.getLogger()
  handler = _Collect()
  root.addHandler(handler)
  logged = []
  monkeypatch.setattr(run_log.absl_logging, "warning", lambda fmt, text, **k: logged.append(text))
  logger = logging.getLogger("test_run_log.block")
  try:
    with pytest.raises(KeyboardInterrupt), run_log.summarised_warnings("the run") as repeats:
      assert repeats in handler.filters
      _warn_five_times(logger)
      raise KeyboardInterrupt  # a run stopped midway still summarises
    assert repeats not in handler.filters
    assert len(logged) == 1 and "repeated 4 more times during the run" in logged[0]
    assert [r.getMessage() for r in handler.records if r.name == logger.name] == [
      "buffer exhausted (reset #1)"
    ]
  finally:
    root.removeHandler(handler)


@pytest.mark.parametrize(
  "name,level,pathname,shown",
  [
    # JAX's TPU probe on a machine without one (jax/_src/xla_bridge.py, logger.info).
    ("jax._src.xla_bridge", logging.INFO, "/site-packages/jax/_src/xla_bridge.py", False),
    ("jax._src.xla_bridge", logging.WARNING, "/site-packages/jax/_src/xla_bridge.py", True),
    ("absl", logging.INFO, "/site-packages/orbax/checkpoint/x.py", False),
    ("absl", logging.INFO, "/repo/owl_cl/experiment.py", True),
    ("jaxtyping", logging.INFO, "/site-packages/jaxtyping/x.py", True),  # not JAX's logger
  ],
)
def test_quiet_library_info_drops_jax_and_orbax_info_only(name, level, pathname, shown):
  record = logging.LogRecord(name, level, pathname, 1, "message", (), None)
  assert main.QuietLibraryInfo().filter(record) is shown

"""utils.cache_entry_lock: one process builds a cache entry, the others wait for it and reuse it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from owl_cl import utils

# A tiny builder run in separate processes: under the entry's lock, builds the entry (a file
# naming its builder) unless it exists, then prints what it reads.
_BUILDER = """
import os, sys, time
from absl import logging
from owl_cl import utils
logging.set_verbosity(logging.INFO)
entry, log, hold, contenders = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
with open(log + ".started", "a") as f:
  f.write(f"{os.getpid()}\\n")
print("started", flush=True)
with utils.cache_entry_lock(entry, "test entry", poll_s=0.02):
  if not os.path.exists(entry):
    with open(log, "a") as f:
      f.write(f"{os.getpid()}\\n")
    # The builder holds the lock until every contender has started (and then `hold` s), so
    # that however slowly they start, the others find the lock held.
    deadline = time.time() + 120
    while time.time() < deadline and len(open(log + ".started").read().split()) < contenders:
      time.sleep(0.02)
    time.sleep(hold)
    utils.atomic_write_text(entry, f"built by {os.getpid()}")
  with open(entry) as f:
    print(f.read(), flush=True)
"""

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(entry, log, hold, contenders=1):
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.Popen(
    [sys.executable, "-c", _BUILDER, str(entry), str(log), str(hold), str(contenders)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
  )


def test_three_processes_one_builds_the_others_wait_and_reuse(tmp_path):
  entry, log = tmp_path / "cache" / "entry", tmp_path / "builders.log"
  # The builder holds the lock until all 3 have started, then 1 s: the others find it held.
  procs = [_start(entry, log, 1.0, contenders=3) for _ in range(3)]
  outputs = [p.communicate(timeout=120) for p in procs]
  assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
  builders = log.read_text().split()
  assert len(builders) == 1  # exactly one process built the entry
  contents = {out.split("\n")[1] for out, _ in outputs}
  assert contents == {f"built by {builders[0]}"}  # and every process read that one
  waited = [err for _, err in outputs if "is being built by pid" in err]
  assert len(waited) == 2 and all(f"pid {builders[0]} on host" in err for err in waited)


def test_a_killed_builder_s_lock_is_taken_over(tmp_path, caplog):
  entry, log = tmp_path / "entry", tmp_path / "builders.log"
  holder = _start(entry, log, 600.0)  # takes the lock and sleeps inside it
  deadline = time.time() + 60
  while not (log.exists() and log.read_text().strip()) and time.time() < deadline:
    time.sleep(0.05)
  pid = int(log.read_text().split()[0])
  assert pid == holder.pid
  holder.send_signal(signal.SIGKILL)  # killed while building: no clean release
  holder.wait(timeout=60)
  assert not entry.exists()
  start = time.time()
  with caplog.at_level("WARNING"), utils.cache_entry_lock(str(entry), "test entry"):
    taken = time.time() - start
    with open(str(entry) + utils.ENTRY_LOCK_SUFFIX) as f:
      assert json.load(f)["pid"] == os.getpid()
  assert taken < 5.0  # the kernel dropped the dead holder's flock: no wait
  assert f"taking over the lock of pid {pid}" in caplog.text
  with open(str(entry) + utils.ENTRY_LOCK_SUFFIX) as f:
    assert f.read() == ""  # a clean release leaves no record


def _waiting_lines(caplog):
  return [r.getMessage() for r in list(caplog.records) if "is being built by" in r.getMessage()]


def test_a_waiter_logs_the_holder_and_its_progress(tmp_path, caplog):
  entry = str(tmp_path / "entry")
  order = []

  def wait_for_it():
    with utils.cache_entry_lock(entry, "test entry", poll_s=0.01, progress_s=0.05):
      order.append("waiter")

  with caplog.at_level("INFO"):
    with utils.cache_entry_lock(entry, "test entry"):
      # flock locks an open file: a second open in another thread waits as another process.
      thread = threading.Thread(target=wait_for_it)
      thread.start()
      # Held until the waiter has logged 3 lines (however slowly a loaded machine runs it).
      deadline = time.time() + 60
      while len(_waiting_lines(caplog)) < 3 and time.time() < deadline:
        time.sleep(0.01)
      order.append("holder")
    thread.join(timeout=30)
  assert order == ["holder", "waiter"]
  lines = _waiting_lines(caplog)
  # The first line at once, then one per progress_s (0.05 s) of the wait.
  assert len(lines) >= 3
  assert all(f"test entry {entry} is being built by pid {os.getpid()}" in m for m in lines)

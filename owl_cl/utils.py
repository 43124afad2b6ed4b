"""Small helpers the whole package shares, each written once.

- `atomic_write` / `atomic_write_text`: write to a temporary file next to the target, then
  `os.replace` it, so a reader (or a resumed run) never sees a half-written file.
- `atomic_directory`: the same for a folder (checkpoints, the replay store, the built-in
  benchmark, converted models): written in a temporary sibling, renamed into place complete.
- `digest` / `file_digest`: the short content digests that key the caches (pre-trained model,
  replay buffer, real-data fingerprint).
- `shuffled`: the seeded permutation that orders the downstream sequence (`sequence_seed`).
- `expand_path`: `~` and relative paths of the config made absolute.
- `workdir_lock`: one run per workdir (refuses a second one with the holder's pid and host).
- `cache_entry_lock`: one builder per cache entry (the others wait for it, then reuse it);
  on a cache that cannot be written, entries are read without it (`ReadOnlyCacheError`).
- `DiskFullError`, `is_disk_full`, `free_bytes`: a full disk, named by its path and device.
- `remove_stale_temporaries`: clears the `.tmp*` leftovers of killed cache writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import tempfile
import time
from typing import Any, TypeVar

from absl import logging
import numpy as np

T = TypeVar("T")

# Hex characters kept of a SHA-256 digest: 64 bits, plenty to tell cache entries apart.
DIGEST_CHARS = 16


def expand_path(path: str) -> str:
  """`path` with `~` expanded, made absolute (relative to the working directory)."""
  return os.path.abspath(os.path.expanduser(path))


def digest(obj: Any) -> str:
  """A 16-hex-character SHA-256 of `obj` as sorted-key JSON (non-JSON values via `str`).

  Equal for equal contents whatever the dict order, so it keys caches by their settings.
  """
  text = json.dumps(obj, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def file_digest(path: str) -> str:
  """A 16-hex-character SHA-256 of the bytes of the file at `path`.

  Raises:
    FileNotFoundError: no file at `path`.
  """
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    # In 16 MiB chunks: annotation files reach GBs (Objects365 train), not held in memory.
    for chunk in iter(lambda: f.read(1 << 24), b""):
      sha.update(chunk)
  return sha.hexdigest()[:DIGEST_CHARS]


def cpu_model() -> str:
  """The CPU's model name from /proc/cpuinfo (Linux), else `platform.processor()`, else
  'unknown': what a benchmark's record names its machine by."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          return value.strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def shuffled(items: Sequence[T], seed: int | None) -> list[T]:
  """`items` in the order of NumPy's `default_rng(seed).permutation`; unchanged when seed is None.

  The run's downstream sequence order (config.sequence_seed): the same seed gives the same
  order on every machine (NumPy's PCG64 stream is fixed across versions).
  """
  items = list(items)
  if seed is None:
    return items
  order = np.random.default_rng(seed).permutation(len(items))
  return [items[i] for i in order]


def atomic_write(path: str, write: Callable[[str], None], *, suffix: str = "") -> None:
  """Calls `write(tmp)` on a temporary path next to `path`, fsyncs it, then renames it to `path`.

  `os.replace` is atomic on POSIX within one file system, so `path` holds either its old
  contents or the complete new ones, never a partial file (an interrupted run, a crash).

  Args:
    path: the file to (re)write; its folder is created when missing.
    write: writes the whole file at the path it is given.
    suffix: ending of the temporary name, for writers that append one otherwise (np.savez
      adds '.npz' to a name without it).

  Raises:
    Exception: whatever `write` raises; the temporary file is removed first.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(
    dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp" + suffix
  )
  # mkstemp creates 0600; the output gets a normal file's mode (0666 less the umask), so a
  # colleague of the group can read results.json.
  os.fchmod(fd, 0o666 & ~current_umask())
  os.close(fd)
  try:
    write(tmp)
    with open(tmp, "rb+") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` atomically (`atomic_write`)."""

  def write(tmp: str) -> None:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)

  atomic_write(path, write)


def atomic_write_json(path: str, obj: Any, **dump_kwargs) -> None:
  """Writes `obj` as JSON (`json.dumps(obj, **dump_kwargs)`) to `path` atomically."""
  atomic_write_text(path, json.dumps(obj, **dump_kwargs))


def write_report(stem: str, report: dict, markdown: str, indent: int = 1) -> None:
  """A benchmark's results: `<stem>.json` (`report`) and `<stem>.md` (`markdown`), each
  written atomically (a killed benchmark never leaves a half-written file); prints the
  Markdown. Non-JSON values are written with `str`."""
  atomic_write_text(stem + ".json", json.dumps(report, indent=indent, default=str))
  atomic_write_text(stem + ".md", markdown)
  print(markdown, flush=True)


EXISTING_FOLDER_POLICIES = ("error", "replace", "keep")


@contextlib.contextmanager
def atomic_directory(path: str, *, if_exists: str = "error") -> Iterator[str]:
  """Yields a temporary folder next to `path`; when the block ends normally it becomes `path`.

  A reader (or a resumed run) sees either no folder, the old one, or the complete new one:
  the block writes into `.tmp-<name>-XXXX` in the same parent, which is then renamed (atomic
  on POSIX within one file system). When the block raises, or the process is killed, the
  temporary is removed (or left as a `.tmp*` that `remove_stale_temporaries` clears later);
  `path` is never touched.

  Args:
    path: the folder to create; its parent is created when missing.
    if_exists: what to do when `path` exists at the end of the block: 'error' (raise),
      'replace' (move the old folder aside, move the new one in, then delete the old; the old
      one is moved back if the move in fails), or 'keep' (another writer finished first, e.g.
      a concurrent run filling the same cache: keep its folder and discard ours).

  Yields:
    The temporary folder's path (absolute), empty.

  Raises:
    FileExistsError: `path` exists with if_exists='error' (checked before and after the
      block, so no work is wasted on an output that cannot be written).
    ValueError: an unknown `if_exists`.
    Exception: whatever the block raises (the temporary is removed first).
  """
  if if_exists not in EXISTING_FOLDER_POLICIES:
    raise ValueError(f"if_exists={if_exists!r} is not one of {EXISTING_FOLDER_POLICIES}")
  path = os.path.abspath(path)
  if if_exists == "error" and os.path.exists(path):
    raise FileExistsError(f"refusing to overwrite existing {path}")
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(path)}-", dir=parent)
  # mkdtemp creates 0700; the output gets a normal folder's mode (0777 less the umask).
  os.chmod(tmp, 0o777 & ~current_umask())
  try:
    yield tmp
    if not os.path.exists(path):
      os.replace(tmp, path)
    elif if_exists == "error":
      raise FileExistsError(f"refusing to overwrite existing {path}")
    elif if_exists == "replace":
      _swap_in(tmp, path)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)  # gone already unless the block failed, or 'keep'


def open_progress_folder(path: str, manifest: dict, what: str, subfolder: str = "") -> bool:
  """Opens the progress folder of a resumable computation; returns True when resuming.

  A folder whose `manifest.json` differs from `manifest` (another computation, or none
  readable) is deleted with a warning naming `what`; a new folder (with `subfolder` inside)
  then gets the manifest, written atomically. Used by the buffer build and ASER-PC's left term.
  """
  manifest_path = os.path.join(path, "manifest.json")
  if os.path.isdir(path):
    try:
      with open(manifest_path) as f:
        old = json.load(f)
    except (OSError, ValueError):
      old = None
    if old != manifest:
      logging.warning("%s: %s is of another computation; restarting", what, path)
      shutil.rmtree(path)
  if os.path.isdir(path):
    logging.info("%s: resuming in %s", what, path)
    return True
  os.makedirs(os.path.join(path, subfolder) if subfolder else path)
  atomic_write_json(manifest_path, manifest)
  return False


def _swap_in(new: str, path: str) -> None:
  """Replaces the folder `path` by the folder `new` (same parent); the old one is deleted."""
  old = tempfile.mkdtemp(prefix=f".tmp-old-{os.path.basename(path)}-", dir=os.path.dirname(path))
  os.rmdir(old)  # a free name in the same folder, for the rename
  os.replace(path, old)
  try:
    os.replace(new, path)
  except BaseException:
    os.replace(old, path)
    raise
  remove_tree(old)


def remove_tree(path: str) -> None:
  """Deletes the file or folder `path` (nothing when it does not exist)."""
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


def current_umask() -> int:
  """The process's umask (read from /proc where possible: setting it is not thread-safe)."""
  with contextlib.suppress(OSError, ValueError):
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


# ----------------------------------------------------------------------------- workdir lock

LOCK_FILE = ".owl_cl.lock"


class WorkdirLockedError(RuntimeError):
  """Another live process runs in the workdir; the message names its pid and host."""


@contextlib.contextmanager
def workdir_lock(workdir: str) -> Iterator[None]:
  """Holds the exclusive lock of `workdir` (`<workdir>/.owl_cl.lock`) while the body runs.

  Design: the lock is an `fcntl.flock` on the file, and the file holds a record of the
  holder (pid, host, start time) for the messages. The kernel drops a flock when its
  process dies however it dies (SIGKILL, OOM, a node reboot drops it on the server), so a
  killed run never leaves the workdir stuck, and taking the lock is atomic (no window where
  two runs both see "free"). A pid file alone could not tell a live process on another host
  from a dead one, and pids are reused. The file itself is never deleted (deleting a lock
  file races with a process that has just opened it). A record left in a free lock is a run
  that did not end cleanly: it is taken over with a log line. On NFS, Linux emulates flock
  with the server's byte-range locks (NFSv4), which hold across hosts.

  Args:
    workdir: the run's folder (created if missing).

  Raises:
    WorkdirLockedError: another process holds the lock (its pid and host in the message).
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
  try:
    _take_lock(fd, workdir)
    with _held(fd, f"workdir {workdir}"):
      yield
  finally:
    os.close(fd)


@contextlib.contextmanager
def _held(fd: int, name: str) -> Iterator[None]:
  """The body of a taken flock on `fd`: a record left by a holder that did not end cleanly is
  taken over with a warning naming `name`, ours is written, and emptied at a clean end (the
  kernel releases the flock when the file is closed, or the process dies)."""
  previous = _read_lock_record(fd)
  if previous:
    logging.warning(
      "%s: taking over the lock of pid %s on host %s (started %s), which ended without "
      "releasing it (killed?)",
      name,
      previous.get("pid", "?"),
      previous.get("host", "?"),
      previous.get("started", "?"),
    )
  _write_lock_record(fd)
  try:
    yield
  finally:
    os.ftruncate(fd, 0)


def check_workdir_free(workdir: str) -> None:
  """Raises WorkdirLockedError when another process holds `workdir`'s lock; writes nothing.

  The early check of a run (before its data is loaded and scanned, which can take long), so a
  second run is refused at once; `workdir_lock` takes the lock later. Without a lock file no
  run holds the workdir (a holder never deletes its file).
  """
  try:
    fd = os.open(os.path.join(workdir, LOCK_FILE), os.O_RDONLY)
  except FileNotFoundError:
    return
  try:
    _take_lock(fd, workdir)  # released when the file is closed
  finally:
    os.close(fd)


def _take_lock(fd: int, workdir: str) -> None:
  """flock(LOCK_EX | LOCK_NB) on `fd`; WorkdirLockedError naming the holder when taken."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno not in (errno.EAGAIN, errno.EACCES):
      raise
    holder = _read_lock_record(fd)
    raise WorkdirLockedError(
      f"workdir {workdir} is in use by another run (pid {holder.get('pid', '?')} on host "
      f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to "
      "end or use another --workdir"
    ) from None


def _write_lock_record(fd: int) -> None:
  """Replaces the record in the held lock file `fd` by this process's (pid, host, start)."""
  record = {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(record).encode(), 0)
  os.fsync(fd)


def _read_lock_record(fd: int) -> dict:
  """The holder record in an open lock file ({} when empty or unreadable)."""
  with contextlib.suppress(OSError, ValueError):
    data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    if isinstance(data, dict):
      return data
  return {}


# ----------------------------------------------------------------------------- full disks


class DiskFullError(OSError):
  """No space left for a file the run writes (a checkpoint, a cache entry, another file).

  The message names the path, the mount point of its device (the device that is full: the
  workdir's, the cache's and the compilation cache's may differ), the space needed and the
  space free; what was committed before stays, so the same command resumes once space is
  freed. An OSError with errno ENOSPC (what `main` reports as one line, exit status 2).

  Args:
    path: the folder (or file) that could not be written.
    needed: bytes the write takes (None: unknown). free: bytes free there (None: unknown).
    what: the write, e.g. 'the checkpoint of stage 2'.
  """

  def __init__(self, path: str, needed: int | None, free: int | None, what: str):
    need = f"about {_mib(needed)} needed, " if needed is not None else ""
    have = f"{_mib(free)} free" if free is not None else "the device is full"
    super().__init__(
      errno.ENOSPC,
      f"no space left for {what} in {path} (device mounted at {mount_point(path)}: {need}{have});"
      " free space on that device and run the same command to resume (the last committed "
      "checkpoint is kept)",
    )
    self.path, self.needed, self.free = path, needed, free

  def __str__(self) -> str:
    return self.strerror


def _mib(n: int) -> str:
  return f"{n / 2**20:.1f} MiB"


# NumPy's `ndarray.tofile` (hence `np.save`) reports a short write without an errno:
# OSError("%ld requested and %ld written"), numpy/_core/src/multiarray/convert.c. On a
# local file a write comes up short when the device (or the quota) is full.
_NUMPY_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


def is_disk_full(error: BaseException) -> bool:
  """Whether `error` is a full disk: OSError ENOSPC or EDQUOT, NumPy's short write
  (`_NUMPY_SHORT_WRITE`), or orbax's / tensorstore's ValueError 'RESOURCE_EXHAUSTED ... No
  space left on device' (raised from its write thread)."""
  if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
    return True
  text = str(error)
  if isinstance(error, OSError) and error.errno is None and _NUMPY_SHORT_WRITE.fullmatch(text):
    return True
  return "No space left on device" in text or "Disk quota exceeded" in text


def nearest_existing(path: str) -> str:
  """`path` made absolute, or its nearest existing parent folder."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def free_bytes(path: str) -> int | None:
  """Bytes free for this user on the device holding `path` (its nearest existing folder);
  None when unknown (no such device, or one that reports a total size of 0)."""
  try:
    usage = shutil.disk_usage(nearest_existing(path))
  except OSError:
    return None
  # A file system that reports no size (some FUSE mounts of object stores) tells nothing.
  return usage.free if usage.total > 0 else None


def mount_point(path: str) -> str:
  """The mount point of the file system holding `path` (its nearest existing folder): what
  names the device in a message (`os.path.ismount` going up; '/' at the top)."""
  path = nearest_existing(path)
  while not os.path.ismount(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


@contextlib.contextmanager
def disk_full_named(path: str, what: str) -> Iterator[None]:
  """Turns a full-disk error raised inside the block (`is_disk_full`) into a `DiskFullError`
  naming the file it carries, else `path`, and that path's device.

  For writers whose errors name no file (NumPy's `save`, orbax, a `write` on an open file),
  so that a full cache disk is not reported as the workdir's. A `DiskFullError` raised inside
  (a checkpoint of the workdir written within the block) passes unchanged.
  """
  try:
    yield
  except (OSError, ValueError) as e:
    if isinstance(e, DiskFullError) or not is_disk_full(e):
      raise
    where = getattr(e, "filename", None) or path
    raise DiskFullError(where, None, free_bytes(where), what) from e


# ----------------------------------------------------------------------------- cache entry locks

# The lock file of cache entry `<path>` is `<path>.lock` (never deleted, as the workdir's).
ENTRY_LOCK_SUFFIX = ".lock"
# Seconds between two tries of a held entry lock, and between two "still waiting" log lines.
ENTRY_LOCK_POLL_SECONDS = 0.5
ENTRY_LOCK_PROGRESS_SECONDS = 30.0
# What creating or opening a lock file for writing fails with where the cache cannot be
# written: a read-only mount (EROFS), or a folder this user may not write (EACCES, EPERM).
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class ReadOnlyCacheError(OSError):
  """A cache entry the run needs is missing or damaged where the cache cannot be written.

  One line naming the entry, its state and what to do (`main` reports it with exit status 2).

  Args:
    path: the entry. what: its kind, e.g. 'pre-trained model'.
    state: e.g. 'not in the cache', 'damaged (<reason>)'.
  """

  def __init__(self, path: str, what: str, state: str):
    super().__init__(
      errno.EROFS,
      f"{what} {path} is {state}, and the cache cannot be written there (read-only): build "
      "it with the same config and a writable cache_dir, then share that folder, or set "
      "--config.cache_dir to a writable folder",
    )
    self.path = path

  def __str__(self) -> str:
    return self.strerror


@contextlib.contextmanager
def cache_entry_lock(
  path: str,
  what: str = "cache entry",
  *,
  poll_s: float = ENTRY_LOCK_POLL_SECONDS,
  progress_s: float = ENTRY_LOCK_PROGRESS_SECONDS,
) -> Iterator[bool]:
  """Holds the exclusive lock of the cache entry `path` (`<path>.lock`), waiting for a holder.

  Runs sharing a `cache_dir` (a local sweep, one workdir each) need the same entries (the
  pre-trained model, the replay store, ...): the first to take an entry's lock builds it while
  the others wait here, then find it complete and reuse it. The caller checks for the entry
  again once it holds the lock (another run may have built it meanwhile) before building.

  Design as `workdir_lock`: an `fcntl.flock` on the lock file, whose content is the holder's
  record (pid, host, start time) for the log lines. The kernel drops the lock when its holder
  dies however it dies, so a killed builder's lock is free at once; a record left in a free
  lock is taken over with a warning. The wait polls a non-blocking flock every `poll_s`
  seconds (a blocking flock could not log progress), logging the holder when it starts and
  every `progress_s` seconds. On NFS, Linux maps flock to the server's byte-range locks
  (NFSv4, or NFSv3 with lockd), which hold across hosts; NFSv3 mounted with `nolock` and some
  FUSE file systems grant every flock locally: there concurrent runs are not kept apart
  (docs/stored_state.md). flock locks an open file, not a process: two threads of one
  process that each call this are kept apart as well, but one thread that calls it again
  for the same entry while holding it waits for itself.

  A cache that cannot be written (a read-only mount shared across a cluster, a folder of
  another user) is detected here: the lock file cannot be created or opened for writing
  (`READ_ONLY_ERRNOS`). The body then runs without the exclusive lock and gets False: it
  may read and verify the entry, and must raise `ReadOnlyCacheError` instead of building
  it. Detected rather than set in the config: the same command then runs on a writable
  cache and on a read-only mount of it, and nothing has to be kept in step with the mount.
  Where the lock file exists, a shared flock is waited for (`LOCK_SH` works on a file open
  for reading): a builder on a writable mount of the same files holds `LOCK_EX`, and its
  entry is read once complete. A full disk inside the body (an error that names no file)
  is reported as a `DiskFullError` naming `path` and its device (`disk_full_named`).

  Args:
    path: the cache entry (file or folder; it need not exist). Its parent is created.
    what: the entry's kind for the log lines, e.g. 'pre-trained model'.
    poll_s: seconds between two tries while another process holds the lock.
    progress_s: seconds between two "still waiting" log lines.

  Yields:
    True: the lock is held and the entry may be built. False: the cache cannot be written.

  Raises:
    OSError: the lock file cannot be created or locked for another reason.
    DiskFullError: no space left on the entry's device (its parent, the lock, or the body).
  """
  path = os.path.abspath(path)
  with disk_full_named(path, f"the {what}"):
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      fd = os.open(path + ENTRY_LOCK_SUFFIX, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
      if e.errno not in READ_ONLY_ERRNOS:
        raise
      fd = None
    if fd is None:
      with _read_only_lock(path, what, poll_s, progress_s):
        yield False
      return
    try:
      _wait_for_flock(fd, fcntl.LOCK_EX, path, what, poll_s, progress_s)
      with _held(fd, f"{what} {path}"):
        yield True
    finally:
      os.close(fd)


@contextlib.contextmanager
def _read_only_lock(path: str, what: str, poll_s: float, progress_s: float) -> Iterator[None]:
  """A shared flock on the existing lock file of `path` opened for reading; nothing when
  there is none (no builder ever locked it) or the file system refuses the flock."""
  logging.info("%s %s: the cache cannot be written here; reading it without building", what, path)
  try:
    fd = os.open(path + ENTRY_LOCK_SUFFIX, os.O_RDONLY)
  except OSError:
    yield
    return
  try:
    try:
      _wait_for_flock(fd, fcntl.LOCK_SH, path, what, poll_s, progress_s)
    except OSError as e:  # e.g. ENOLCK: a file system without locks; read unlocked
      logging.info("%s %s: no shared lock (%s); reading it unlocked", what, path, e)
    yield
  finally:
    os.close(fd)


def _wait_for_flock(
  fd: int, operation: int, path: str, what: str, poll_s: float, progress_s: float
) -> None:
  """Takes flock `operation` (LOCK_EX or LOCK_SH) on `fd`, polling every `poll_s` seconds
  while another process holds a conflicting lock, logging the holder every `progress_s`."""
  start = time.monotonic()
  next_log = start
  while True:
    try:
      fcntl.flock(fd, operation | fcntl.LOCK_NB)
      return
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise
    now = time.monotonic()
    if now >= next_log:
      holder = _read_lock_record(fd)
      logging.info(
        "%s %s is being built by pid %s on host %s (since %s); waiting for it (%.0f s so far)",
        what,
        path,
        holder.get("pid", "?"),
        holder.get("host", "?"),
        holder.get("started", "?"),
        now - start,
      )
      next_log = now + progress_s
    time.sleep(poll_s)


# ----------------------------------------------------------------------------- temporaries

# A temporary entry whose newest file is at least this old belongs to a killed write: live
# writers (benchmark generation, orbax saves) touch their files far more often.
STALE_TEMPORARY_SECONDS = 3600.0


def _is_temporary(name: str) -> bool:
  """Names of the temporaries of the atomic writers (utils, checkpointing, store, builtin)."""
  return name.startswith((".tmp", ".trash_", ".new-")) or ".tmp" in name


def _newest_mtime(path: str) -> float:
  newest = os.lstat(path).st_mtime
  if os.path.isdir(path) and not os.path.islink(path):
    for root, dirs, files in os.walk(path):
      for name in dirs + files:
        with contextlib.suppress(OSError):
          newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
  return newest


def remove_stale_temporaries(
  folder: str, min_age_seconds: float = STALE_TEMPORARY_SECONDS, now: float | None = None
) -> list[str]:
  """Removes the leftover temporaries of killed writes directly in `folder`.

  A cache is shared by concurrent runs (one workdir each), so only entries untouched for
  `min_age_seconds` (newest file inside, for a folder) are removed: another run's write in
  progress is never taken away.

  Returns:
    The removed paths (each logged); [] when `folder` does not exist.
  """
  now = time.time() if now is None else now
  removed = []
  with contextlib.suppress(FileNotFoundError):
    for name in sorted(os.listdir(folder)):
      path = os.path.join(folder, name)
      if not _is_temporary(name):
        continue
      try:
        if now - _newest_mtime(path) < min_age_seconds:
          continue
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path)
        else:
          os.remove(path)
      except OSError as e:
        logging.warning("could not remove the stale temporary %s: %s", path, e)
        continue
      logging.info("removed %s, left by an interrupted write", path)
      removed.append(path)
  return removed

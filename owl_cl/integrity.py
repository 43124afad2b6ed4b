"""Per-file digests of stored state, written when an artifact is committed and checked on read.

Every artifact that costs compute (the cached pre-trained model, the replay store, the replay
image cache, stage and step checkpoints) is a folder of files. When the writer has finished
the folder, `write_manifest` records each file's size and SHA-256 in `MANIFEST_NAME`, written
last and atomically: a folder with a manifest is complete, and any byte changed, cut or
deleted afterwards is found by `verify_directory` (every file, streamed in 16 MiB chunks so a
100 GB store is never held in memory) or by `verify_file` (one file), or chunk by chunk
on first use (`LazyVerifier`, for stores too large to hash before every run: files larger than
one chunk also record each chunk's digest).

A mismatch raises `IntegrityError`, which names the file and what differs. What follows is
the caller's policy: a cache entry is moved aside with `set_aside` (renamed, never deleted,
so the evidence survives) and rebuilt; a workdir checkpoint falls back to the previous one.

Neither orbax nor tensorstore checks the bytes it reads against a digest (tensorstore's
zarr driver has no checksum codec for the arrays orbax writes), hence this module. SHA-256
and not a faster non-cryptographic hash: `hashlib` ships it, it runs at about 1-2 GB/s per
core with the CPU's SHA extensions, and a checked 100 GB store costs minutes against the
hours it took to compute.

This module is a leaf: it imports nothing of owl_cl but `utils`.
"""

from __future__ import annotations

from collections.abc import Iterable
import hashlib
import json
import os
import threading
import time

from absl import logging

from owl_cl import utils

MANIFEST_NAME = "owl_cl_manifest.json"
MANIFEST_VERSION = 1

# Bytes hashed per read: large enough for disk throughput, small enough for any host.
_CHUNK_BYTES = 1 << 24


class IntegrityError(RuntimeError):
  """A stored file differs from the digest recorded when it was committed.

  Attributes:
    path: the file (or folder, when its manifest is missing or unreadable) at fault.
    reason: what differs, e.g. 'SHA-256 differs from the manifest'.
  """

  def __init__(self, path: str, reason: str):
    super().__init__(f"{path}: {reason}")
    self.path = path
    self.reason = reason


def sha256_file(path: str) -> str:
  """The SHA-256 of the file at `path` as 64 hex characters, read in 16 MiB chunks.

  Raises:
    OSError: the file cannot be read (FileNotFoundError when it is missing).
  """
  return _digests(path)[0]


def _digests(path: str) -> tuple[str, list[str]]:
  """(SHA-256 of the whole file, SHA-256 of each `_CHUNK_BYTES` chunk), in one read."""
  sha = hashlib.sha256()
  chunks = []
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
      sha.update(chunk)
      chunks.append(hashlib.sha256(chunk).hexdigest())
  return sha.hexdigest(), chunks


def _relative_files(directory: str) -> list[str]:
  """Every regular file below `directory` (relative, '/'-separated, sorted), manifest aside."""
  names = []
  for root, dirs, files in os.walk(directory):
    dirs.sort()
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
      if rel != MANIFEST_NAME:
        names.append(rel)
  return sorted(names)


def write_manifest(directory: str, files: Iterable[str] | None = None) -> dict:
  """Records the size and SHA-256 of files in `directory` in its manifest, written atomically.

  Call it after the last file of the artifact is written (and flushed): the manifest is the
  artifact's commit mark.

  Args:
    directory: the artifact's folder.
    files: paths relative to `directory` to record; None records every file below it.

  Returns:
    The manifest: {'version': 1, 'files': {relative path: {'size': bytes, 'sha256': hex}}};
    a file larger than one 16 MiB chunk also gets 'chunks': [hex SHA-256 of each chunk]
    (computed in the same read), for `LazyVerifier`.

  Raises:
    OSError: a file cannot be read, or the manifest cannot be written (full disk: the
      artifact then has no manifest and is not trusted on read).
  """
  names = _relative_files(directory) if files is None else sorted(files)
  records = {}
  for rel in names:
    path = os.path.join(directory, rel)
    size = os.path.getsize(path)
    sha, chunks = _digests(path)
    records[rel] = {"size": size, "sha256": sha}
    if len(chunks) > 1:
      records[rel]["chunks"] = chunks
  manifest = {"version": MANIFEST_VERSION, "files": records}
  utils.atomic_write_json(os.path.join(directory, MANIFEST_NAME), manifest, indent=1)
  return manifest


def has_manifest(directory: str) -> bool:
  """Whether `directory` holds a manifest (a committed artifact of this version or later)."""
  return os.path.isfile(os.path.join(directory, MANIFEST_NAME))


def check_unmanifested(directory: str, checksums_field: str = "checksums") -> dict:
  """The `meta.json` of an artifact folder without a manifest, when it is one of an earlier
  version (its meta does not say a manifest was written); the caller loads it unverified.

  Returns:
    the folder's meta dict.

  Raises:
    IntegrityError: meta.json is missing or unreadable, or its `checksums_field` says a
      manifest was written (so the manifest was lost: the folder is damaged).
  """
  meta_path = os.path.join(directory, "meta.json")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise IntegrityError(meta_path, "missing") from None
  except (OSError, ValueError) as e:
    raise IntegrityError(meta_path, f"unreadable ({e})") from None
  if not isinstance(meta, dict) or meta.get(checksums_field):
    raise IntegrityError(
      os.path.join(directory, MANIFEST_NAME), "missing (meta.json says it was written)"
    )
  return meta


def read_manifest(directory: str) -> dict:
  """The manifest of `directory`, checked for its shape.

  Raises:
    IntegrityError: no manifest, or one that is not valid JSON of the expected shape.
  """
  path = os.path.join(directory, MANIFEST_NAME)
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except FileNotFoundError:
    raise IntegrityError(directory, f"no {MANIFEST_NAME} (written incompletely?)") from None
  except (OSError, ValueError) as e:
    raise IntegrityError(path, f"unreadable manifest ({e})") from None
  files = manifest.get("files") if isinstance(manifest, dict) else None
  if not isinstance(files, dict) or not all(
    isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("sha256"), str)
    for r in files.values()
  ):
    raise IntegrityError(path, "manifest without a valid 'files' table")
  return manifest


def verify_file(directory: str, rel: str, manifest: dict | None = None) -> None:
  """Checks one file of `directory` against its manifest record (size, then SHA-256).

  Args:
    directory: the artifact's folder.
    rel: the file's path relative to `directory` ('/'-separated).
    manifest: the folder's manifest when already read (`read_manifest`), else read here.

  Raises:
    IntegrityError: the file is missing, not in the manifest, or differs in size or digest.
  """
  manifest = read_manifest(directory) if manifest is None else manifest
  path = os.path.join(directory, rel)
  record = manifest["files"].get(rel)
  if record is None:
    raise IntegrityError(path, f"not listed in {MANIFEST_NAME}")
  try:
    size = os.path.getsize(path)
  except FileNotFoundError:
    raise IntegrityError(path, "missing (listed in the manifest)") from None
  if size != record["size"]:
    raise IntegrityError(path, f"{size} bytes, the manifest recorded {record['size']}")
  if sha256_file(path) != record["sha256"]:
    raise IntegrityError(path, "SHA-256 differs from the manifest (changed on disk)")


def verify_sizes(directory: str) -> dict:
  """Checks that every file recorded in `directory`'s manifest exists with its recorded size.

  The cheap part of `verify_directory` (no byte read): a cut or missing file is found at once.

  Returns:
    The manifest.

  Raises:
    IntegrityError: no or unreadable manifest, or the first file that is missing or of
      another size.
  """
  manifest = read_manifest(directory)
  for rel, record in manifest["files"].items():
    path = os.path.join(directory, rel)
    try:
      size = os.path.getsize(path)
    except FileNotFoundError:
      raise IntegrityError(path, "missing (listed in the manifest)") from None
    if size != record["size"]:
      raise IntegrityError(path, f"{size} bytes, the manifest recorded {record['size']}")
  return manifest


def verify_directory(directory: str) -> dict:
  """Checks every file recorded in `directory`'s manifest (sizes first, then digests).

  Sizes of all files are compared before any digest, so a truncation is reported at once
  without reading the rest of a large store.

  Returns:
    The manifest, for callers that go on to read the files.

  Raises:
    IntegrityError: no or unreadable manifest, or the first file that is missing or differs.
  """
  manifest = verify_sizes(directory)
  for rel in manifest["files"]:
    verify_file(directory, rel, manifest)
  return manifest


class LazyVerifier:
  """Checks a committed folder's files chunk by chunk, each chunk when it is first read.

  For stores too large to hash before every run: `verify_sizes` at open (a cut or missing file
  is found at once), then `check(rel, start, stop)` before bytes [start, stop) of a file are
  used hashes the 16 MiB chunks they fall in that were not checked yet (each chunk once per
  verifier). A file recorded without chunk digests (at most one chunk, or a manifest written
  before they were recorded) is checked whole at its first use. Thread-safe.

  Args:
    directory: the committed folder (its manifest is read and the sizes checked here).

  Raises:
    IntegrityError: (constructor) no or unreadable manifest, a cut or missing file.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self.manifest = verify_sizes(directory)
    self._checked: dict[str, set[int]] = {}
    self._lock = threading.Lock()

  def check(self, rel: str, start: int = 0, stop: int | None = None) -> None:
    """Verifies the chunks of file `rel` holding bytes [start, stop) (stop None: to its end).

    Raises:
      IntegrityError: a chunk (or the file, without chunk digests) differs from its digest;
        the file is not in the manifest.
    """
    record = self.manifest["files"].get(rel)
    path = os.path.join(self.directory, rel)
    if record is None:
      raise IntegrityError(path, f"not listed in {MANIFEST_NAME}")
    stop = record["size"] if stop is None else min(int(stop), record["size"])
    chunks = record.get("chunks")
    if not chunks:
      wanted = {0}
    else:
      wanted = set(range(int(start) // _CHUNK_BYTES, max(int(start), stop - 1) // _CHUNK_BYTES + 1))
    with self._lock:
      todo = sorted(wanted - self._checked.setdefault(rel, set()))
    for i in todo:
      if not chunks:
        verify_file(self.directory, rel, self.manifest)
      else:
        with open(path, "rb") as f:
          f.seek(i * _CHUNK_BYTES)
          data = f.read(_CHUNK_BYTES)
        if hashlib.sha256(data).hexdigest() != chunks[i]:
          raise IntegrityError(
            path,
            f"bytes {i * _CHUNK_BYTES}-{i * _CHUNK_BYTES + len(data)} (chunk {i}): SHA-256 "
            "differs from the manifest (changed on disk)",
          )
      with self._lock:
        self._checked[rel].add(i)


def set_aside(path: str, reason: str) -> str:
  """Renames the file or folder `path` to `<path>.corrupt-<UTC time>` and logs a warning.

  Never deletes: the evidence of a corruption stays for the user to inspect; the caller
  rebuilds the artifact at `path`.

  Args:
    path: the artifact to move aside.
    reason: the failure (e.g. `str(IntegrityError)`), for the warning.

  Returns:
    The new path.

  Raises:
    utils.ReadOnlyCacheError: the folder cannot be written (a read-only cache): the damaged
      entry is named, with what to do.
    OSError: the rename fails for another reason.
  """
  stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  target = f"{path}.corrupt-{stamp}"
  n = 1
  while os.path.exists(target):
    n += 1
    target = f"{path}.corrupt-{stamp}-{n}"
  try:
    os.replace(path, target)
  except OSError as e:
    if e.errno not in utils.READ_ONLY_ERRNOS:
      raise
    raise utils.ReadOnlyCacheError(path, "cache entry", f"damaged ({reason})") from None
  logging.warning("%s failed its integrity check (%s); moved to %s", path, reason, target)
  return target

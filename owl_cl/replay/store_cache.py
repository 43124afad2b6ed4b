"""The cache of built replay stores: `cached_store` loads the store cached under a digest of
what it depends on, checked against its manifest (docs/stored_state.md), or builds it
(`replay.build.build_store`, run by the caller's `build_fn`) and caches it; a damaged entry is
set aside and rebuilt.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging

from owl_cl import distributed
from owl_cl import integrity
from owl_cl import utils
from owl_cl.replay import store as store_lib
from owl_cl.utils import atomic_write_json
from owl_cl.utils import digest

# How `cached_store` checks a cached store when loading it (docs/stored_state.md): 'full'
# hashes every file first; 'lazy' checks sizes and the small files, then each chunk of the
# per-image arrays when `gather` first reads it (`integrity.LazyVerifier`).
STORE_VERIFICATIONS = ("full", "lazy")


def cached_store(
  cache_root: str,
  key_material: dict,
  build_fn,
  superseded: tuple[tuple[dict, str], ...] = (),
  *,
  source=None,
  image_cache: str | None = None,
  verification: str = "full",
) -> tuple[store_lib.ReplayStore, dict]:
  """Loads the store cached under a digest of `key_material`, or builds and caches it.

  `build_fn(path, build_dir, build_key)` writes the store to `path` atomically (`build_store`),
  keeping its progress in `build_dir` (next to the cache entry) so that an interrupted build
  resumes there; a store is trusted only once its statistics file is written after it, and
  every time it is loaded its files are checked against the manifest written with it (a
  damaged store is set aside and rebuilt with a warning, `_load_cached`). Runs sharing the
  cache take the entry's lock (`<key>.lock`): one builds, the others wait and reuse its store.

  Args:
    cache_root: folder of the cached stores (one sub-folder per key digest).
    key_material: JSON-able dict of everything the store depends on.
    build_fn: `(path, build_dir, build_key) -> stats dict`, run on every process (the forward
      is collective; process 0 writes).
    superseded: (key material, reason) of stores that earlier code versions cached for the
      same run; when one of them is on disk and the current one is not, the rebuild is
      logged with its reason (e.g. class embeddings that were stored unnormalised).
    source: the pre-training source the store's images are decoded from at gather time
      (`store_lib.ReplayStore.load`); None: gather refuses a store of images by reference.
    image_cache: root of the optional uint8 image cache on local disk (`replay.image_cache`).
    verification: 'full' (every file hashed before the store is used) or 'lazy' (sizes and
      the small files first, each chunk of the per-image arrays when first gathered;
      `replay.store_verification`).
  Returns:
    (store memory-mapped from the cache, stats dict with "seconds").
  Raises:
    ValueError: an unknown `verification`.
  """
  if verification not in STORE_VERIFICATIONS:
    raise ValueError(f"verification={verification!r} is not one of {STORE_VERIFICATIONS}")
  key = digest(key_material)
  path = os.path.join(cache_root, key)

  def load(path):
    return store_lib.ReplayStore.load(path, source=source, image_cache=image_cache)

  stats_path = path + ".stats.json"
  # One run builds while the others sharing the cache wait for its store (the lock); whoever
  # gets the lock looks again, since the store may have been cached meanwhile.
  with distributed.cache_entry_lock(path, "replay buffer") as writable:
    found = _load_cached(path, stats_path, load, verification) if distributed.is_writer() else None
    if distributed.writer_value(found is not None):
      if found is None:  # verified by the writer
        with open(stats_path) as f:
          found = load(path), json.load(f)
        if verification == "lazy":
          _attach_lazy_verifier(found[0], path, stats_path)
      logging.info("re-using the cached replay buffer %s", path)
      return found
    if not writable:
      raise utils.ReadOnlyCacheError(path, "the replay buffer", "not in the cache")
    for old_material, reason in superseded:
      old_path = os.path.join(cache_root, digest(old_material))
      if os.path.isdir(old_path):
        logging.warning(
          "the replay buffer cached in %s is out of date (%s); rebuilding it in %s",
          old_path,
          reason,
          path,
        )
    start = time.time()
    stats = build_fn(path, path + ".build", key)
    if distributed.is_writer():
      stats["seconds"] = round(time.time() - start, 1)
      atomic_write_json(stats_path, stats, indent=2)
    distributed.barrier("buffer-cached", timeout_s=600.0)
  with open(stats_path) as f:
    stats = json.load(f)
  logging.info(
    "replay buffer: %d of %d images (%.1f s), cached in %s",
    stats["images_kept"],
    stats["images_considered"],
    stats["seconds"],
    path,
  )
  return load(path), stats


def _set_aside_entry(path: str, stats_path: str, error: Exception) -> None:
  """Sets the damaged store `path` and its statistics aside (renamed, a warning each)."""
  if os.path.exists(path):
    integrity.set_aside(path, str(error))
  if os.path.exists(stats_path):
    integrity.set_aside(stats_path, "its replay store was set aside")


def _attach_lazy_verifier(store, path: str, stats_path: str, verifier=None) -> None:
  """Makes `store.gather` check each chunk of its per-image arrays when first read
  (`verifier`: the folder's `_lazy_verifier`, made here when None)."""
  store.verifier = _lazy_verifier(path) if verifier is None else verifier
  store.on_damage = lambda error: _set_aside_entry(path, stats_path, error)


def _lazy_verifier(path: str) -> integrity.LazyVerifier:
  """The `integrity.LazyVerifier` of the store at `path`, with what is read at once checked:
  every size, the small files whole (meta.json, the buffer's arrays, which `replay_buffer`
  reads whole) and the first chunk (the header) of each per-image file.

  Raises:
    IntegrityError: a cut or missing file, a checked part that differs.
  """
  verifier = integrity.LazyVerifier(path)
  for rel in verifier.manifest["files"]:
    verifier.check(rel, 0, 1 if store_lib.is_row_file(rel) else None)
  return verifier


def _load_cached(
  path: str, stats_path: str, load, verification: str = "full"
) -> tuple[store_lib.ReplayStore, dict] | None:
  """The cached store at `path` and its statistics once they pass their integrity check.

  None when there is no complete entry (the store and its statistics file, written after
  it), or when it was damaged: a file of the store differs from its manifest (streamed
  SHA-256 of every file, `integrity.verify_directory`; with `verification` 'lazy' the sizes
  and the small files only, the per-image rows being checked as `gather` reads them), a file
  or the manifest is missing, the statistics are unreadable. A damaged entry is set aside
  (the folder and its statistics renamed `.corrupt-<time>`, never deleted; a warning names
  the file) for the caller to rebuild. A store cached before manifests were written
  (meta.json without `store_lib.CHECKSUMS_FIELD`) is loaded unverified with a warning; one
  that then fails to load is set aside the same way.

  Raises:
    OSError: the entry cannot be renamed aside (e.g. a read-only cache).
  """
  if not (os.path.isdir(path) and os.path.exists(stats_path)):
    return None
  try:
    verified = integrity.has_manifest(path)
    verifier = None
    if verified and verification == "full":
      integrity.verify_directory(path)
    elif verified:
      verifier = _lazy_verifier(path)  # the per-image rows when gathered
    else:
      _check_unverified_store(path)
    try:
      with open(stats_path) as f:
        stats = json.load(f)
      if not isinstance(stats, dict) or "images_kept" not in stats:
        raise ValueError("no 'images_kept'")
    except ValueError as e:
      raise integrity.IntegrityError(stats_path, f"unreadable statistics ({e})") from None
    try:
      store = load(path)
    except Exception as e:  # pylint: disable=broad-except
      if verified:
        raise  # intact files that do not load: not damage, a real error
      # NumPy raises a variety of errors for a damaged .npy of an unverified store.
      raise integrity.IntegrityError(path, f"does not load ({type(e).__name__}: {e})") from e
    if verifier is not None:
      _attach_lazy_verifier(store, path, stats_path, verifier)
  except integrity.IntegrityError as e:
    _set_aside_entry(path, stats_path, e)
    logging.warning("the cached replay buffer was damaged (%s); building it again", e)
    return None
  return store, stats


def _check_unverified_store(path: str) -> None:
  """A store folder without a manifest: one of an earlier version (logged), or a damaged one.

  Raises:
    IntegrityError: meta.json is missing or unreadable, or says a manifest was written.
  """
  integrity.check_unmanifested(path, store_lib.CHECKSUMS_FIELD)
  logging.warning(
    "the cached replay buffer %s predates checksums: loaded unverified (delete it to build "
    "it again with checksums)",
    path,
  )

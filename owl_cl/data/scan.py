"""The data scan: every image of every split a run uses is decoded once before training.

`scan_benchmark(bench, cache_dir)` decodes every image of every split of the run's data (the
pre-training set's train and eval splits, the held-out set, each downstream dataset's train,
val and test splits) with the pipeline's own decoder (`CocoSource.decode_image`: PIL, every
pixel, the size compared with the json's, a PNG's IEND chunk present), so a truncated JPEG
or PNG, a missing file or an image whose size differs from its annotation fails here and not
hours into training. The
annotations were checked when the splits were read (`CocoSource`: boxes finite, w, h > 0,
inside the image within `box_tolerance`, known category ids, non-empty category names;
every problem of every file in one error, `benchmark._SplitLoader`); an empty split is
refused here. Every problem of every split is listed in one `DataError` naming the dataset,
the split, the file and the reason.

A split that passed is recorded in `<cache_dir>/data_scan/<key>.json` (written atomically),
keyed by the content digest of its annotation file, its images' (path, size, mtime) (TFDS:
the record files'), the json's image sizes and the EXIF orientation policy: a second run
over unchanged data skips the scan; a changed, added or replaced file changes the key and is
scanned again. A record is checked when read (valid JSON naming the split's annotation file
and image count): a damaged one is set aside (`.corrupt-<time>`, a warning naming it) and the
split scanned again. Runs sharing the cache take a record's lock (`<key>.json.lock`,
`utils.cache_entry_lock`): one scans the split, the others wait and reuse its record.

Source: docs/reference.md §10 (the paper's datasets); issue 12 item 5.
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import contextlib
import json
import os
import time

from absl import logging
import tqdm

from owl_cl import integrity
from owl_cl import utils
from owl_cl.data.coco import CocoSource
from owl_cl.data.coco import DataError
from owl_cl.data.coco import problem_list
from owl_cl.utils import atomic_write_json
from owl_cl.utils import digest
from owl_cl.utils import file_digest

__all__ = ["SCAN_FOLDER", "split_key", "scan_splits", "benchmark_splits", "scan_benchmark"]

# Below cache_dir: one small json per split that passed.
SCAN_FOLDER = "data_scan"
# Bump when what the scan checks changes: older records no longer vouch for a split.
# 2: PNGs must end with IEND; 16-bit greyscale scaled; the EXIF orientation policy.
SCAN_VERSION = 2
# Decoding threads (PIL releases the GIL while decoding).
NUM_THREADS = min(8, os.cpu_count() or 1)
_BLOCK = 1024  # images handed to the threads at a time

# (dataset name, split name, source) of one split the run reads.
Split = tuple[str, str, CocoSource]


def _stat(path: str) -> tuple[str, int, int] | tuple[str, None, None]:
  try:
    st = os.stat(path)
  except OSError:
    return (path, None, None)
  return (path, st.st_size, st.st_mtime_ns)


def split_key(source: CocoSource) -> str:
  """The digest a scan record of `source` is filed under (module docstring).

  Covers the annotation file's bytes (when it is a file; a TFDS source's annotations come
  from its records), the source's `exif_orientation`, each image's id, json height / width
  and file (path, size, mtime in ns), or, for a source whose pixels come from a reader (TFDS
  ArrayRecord), the record files below `image_dir`.
  """
  ann = source.annotation_file
  images = [
    (int(source.image_info(i)["id"]), source.image_info(i)["height"], source.image_info(i)["width"])
    for i in range(len(source))
  ]
  if source.reads_files:
    files = [_stat(source.image_path(i)) for i in range(len(source))]
  else:
    files = sorted(
      _stat(os.path.join(folder, name))
      for folder, _, names in os.walk(source.image_dir)
      for name in names
    )
  return digest(
    {
      "version": SCAN_VERSION,
      "annotation_file": ann,
      "exif_orientation": source.exif_orientation,
      "annotations": file_digest(ann) if os.path.isfile(ann) else None,
      "images": images,
      "files": files,
    }
  )


def _decode(source: CocoSource, index: int) -> str:
  """'' when image `index` decodes as training would decode it, else the reason."""
  try:
    source.decode_image(index)
  except DataError as e:
    return str(e)
  except Exception as e:  # pylint: disable=broad-except
    # Whatever else a broken file makes the decoder raise (e.g. a decompression bomb
    # warning turned error, a MemoryError) is a bad file too: named, not a crash later.
    return f"{source.annotation_file}: cannot decode image {source.image_path(index)}: {e!r}"
  return ""


def _scan_split(source: CocoSource, desc: str, num_threads: int) -> list[str]:
  """The problem of every image of `source` that does not decode (empty: all decode)."""
  problems = []
  with (
    concurrent.futures.ThreadPoolExecutor(max(1, num_threads)) as pool,
    tqdm.tqdm(total=len(source), desc=desc, unit="img", dynamic_ncols=True, mininterval=2.0) as bar,
  ):
    # In blocks: a split of millions of images never has millions of futures pending. Ordered
    # results (map), so the error lists the bad images in the annotation's order.
    for start in range(0, len(source), _BLOCK):
      block = range(start, min(start + _BLOCK, len(source)))
      problems += [p for p in pool.map(lambda i: _decode(source, i), block) if p]
      bar.update(len(block))
  return problems


def scan_splits(
  splits: Sequence[Split],
  cache_dir: str | None,
  *,
  decode: bool = True,
  num_threads: int = NUM_THREADS,
) -> dict[str, int]:
  """Decodes every image of every split not yet recorded as good; records the good ones.

  Args:
    splits: (dataset name, split name, source) of each split; a source listed twice (one
      split in two roles) is scanned once.
    cache_dir: folder of the records (`<cache_dir>/data_scan`); None: nothing is recorded.
    decode: False checks only that no split is empty (`config.data.validate_images=False`).
    num_threads: decoding threads.

  Returns:
    {'scanned': images decoded now, 'cached': images not decoded: of splits recorded as good
    before, or the same files as a split decoded in this call}.

  Raises:
    DataError: one error listing every empty split and every image that does not decode
      (at most `MAX_LISTED_PROBLEMS` per split, then a count), each line naming the dataset,
      the split, the file and the reason. Nothing is recorded for a split with a problem.
  """
  folder = os.path.join(cache_dir, SCAN_FOLDER) if cache_dir else None
  problems, counts, seen = [], {"scanned": 0, "cached": 0}, set()
  found: dict[str, list[str]] = {}  # key -> bad images of a split scanned in this call
  for name, split, source in splits:
    if id(source) in seen:
      continue
    seen.add(id(source))
    where = f"dataset {name!r} split {split!r}"
    if len(source) == 0:
      problems.append(f"{where}: {source.annotation_file} has no images (an empty split)")
      continue
    if not decode:
      continue
    key = split_key(source)
    record = os.path.join(folder, f"{key}.json") if folder else None
    # One run scans a split while the others sharing the cache wait for its record.
    lock = utils.cache_entry_lock(record, "data scan") if record else contextlib.nullcontext()
    with lock as writable:
      # Where the cache cannot be written, a split without a valid record is scanned and
      # not recorded: the scan is the check itself, so the run goes on (logged).
      writable = writable is not False
      if key not in found and record and _valid_record(record, source, writable):
        counts["cached"] += len(source)
        continue
      start = time.time()
      if key in found:  # the same files in another role: decoded once, reported for each
        bad = found[key]
        counts["cached"] += len(source)
      else:
        bad = found[key] = _scan_split(source, f"checking {name}/{split}", num_threads)
        counts["scanned"] += len(source)
      if bad:
        problems += [f"{where}: {line}" for line in problem_list(bad).split("\n")]
        continue
      if record and not writable:
        logging.info("data scan of %s/%s passed; not recorded (read-only cache)", name, split)
      elif record:
        atomic_write_json(
          record,
          {
            "dataset": name,
            "split": split,
            "annotation_file": source.annotation_file,
            "images": len(source),
            "seconds": round(time.time() - start, 2),
          },
          indent=2,
          sort_keys=True,
        )
  if problems:
    raise DataError(
      f"the run's data failed the scan ({len(problems)} problem{'s' * (len(problems) > 1)}):\n"
      + "\n".join(f"  - {p}" for p in problems)
    )
  logging.info(
    "data scan: %d images decoded, %d of unchanged splits skipped (cache %s)",
    counts["scanned"],
    counts["cached"],
    folder,
  )
  return counts


def _valid_record(record: str, source: CocoSource, writable: bool = True) -> bool:
  """Whether the scan record `record` vouches for `source` (False when there is none).

  A record that is not valid JSON naming `source`'s annotation file and image count is damaged:
  it is set aside (`integrity.set_aside`, a warning naming it; left in place when the cache
  cannot be written, `writable` False) and False returned (rescanned).
  """
  if not os.path.isfile(record):
    return False
  try:
    with open(record, encoding="utf-8") as f:
      data = json.load(f)
    valid = (
      isinstance(data, dict)
      and data.get("annotation_file") == source.annotation_file
      and data.get("images") == len(source)
    )
    reason = "its annotation file or image count differs from the split's"
  except (OSError, ValueError) as e:
    valid, reason = False, f"unreadable ({e})"
  if not valid:
    if writable:
      integrity.set_aside(record, reason)
    logging.warning(
      "data scan record %s was damaged (%s); scanning the split again%s",
      record,
      reason,
      "" if writable else " (left in place: the cache cannot be written)",
    )
  return valid


def benchmark_splits(bench) -> list[Split]:
  """(dataset name, split, source) of every split an `owl_cl.benchmark.Benchmark` reads."""
  out = []
  roles = [(bench.pretrain_eval, bench.pretrain), (bench.held_out_eval, bench.held_out)]
  roles += [(d.name, d) for d in getattr(bench, "extra_evals", ())]
  roles += [(d.name, d) for d in getattr(bench, "zero_shot", ())]
  for name, dataset in roles + [(d.name, d) for d in bench.sequence]:
    for split in ("train", "valid", "test"):
      source = getattr(dataset, split)
      if source is not None:
        out.append((name, "val" if split == "valid" else split, source))
  return out


def scan_benchmark(
  bench, cache_dir: str | None, *, decode: bool = True, num_threads: int = NUM_THREADS
) -> dict[str, int]:
  """`scan_splits` over every split of `bench` (see `scan_splits`)."""
  return scan_splits(benchmark_splits(bench), cache_dir, decode=decode, num_threads=num_threads)

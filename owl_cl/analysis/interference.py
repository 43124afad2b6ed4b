"""Built-in version 2's interference factor in the retrieval records: which classes are replayed.

`python -m owl_cl.analysis.interference DIR... [--out FILE.md]` (docs/experiments.md, factor 3):
for each downstream dataset that interferes with two named pre-training classes
(`owl_cl.data.builtin.vocabulary.interference()`), the share of the class-based replays
(`records/<dataset>.npz` `sampled_class_counts`: the class each class step drew) that went to
those two classes, per algorithm: mean ± 95% t-interval half-width over the runs, in percent.
A class-balanced draw gives 2 / 20 = 10 %; an algorithm that protects the interfered classes
(SWIL's similarity weights, ASER's Shapley values) gives more. Algorithms without a class step
(`uniform`, `no_replay`) record no classes and are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import os
from typing import Any

from owl_cl.analysis import report as report_lib
from owl_cl.analysis import runs as runs_lib
from owl_cl.analysis import stats
from owl_cl.data.builtin import vocabulary
from owl_cl.eval import results as results_lib
from owl_cl.utils import atomic_write_text

__all__ = ["named_class_shares", "build_table", "render_markdown", "main"]


def named_class_shares(workdir: str) -> dict[str, float]:
  """{interfering dataset: share (%) of its class-step replays drawn from its two named
  pre-training classes} of one run; datasets without records or class steps are absent.

  Raises:
    ValueError: a records file whose class count is not the 20 pre-training classes (names
      the file).
  """
  names = vocabulary.pretrain_class_names()
  out = {}
  for item in vocabulary.interference():
    path = os.path.join(workdir, runs_lib.RECORDS_DIR, f"{item.dataset}.npz")
    if not os.path.exists(path):
      continue
    counts = runs_lib.load_records(path)["sampled_class_counts"]
    if counts.shape != (len(names),):
      raise ValueError(
        f"{path}: sampled_class_counts has shape {counts.shape}, not the {len(names)} "
        "pre-training classes of built-in version 2"
      )
    total = int(counts.sum())
    if total:
      named = sum(int(counts[names.index(c)]) for c in item.pretrain_classes)
      out[item.dataset] = 100.0 * named / total
  return out


def build_table(workdirs: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
  """{algorithm: {dataset: `stats.summarize` of `named_class_shares` over its runs}} of the
  complete runs among `workdirs` (incomplete ones are skipped), algorithms in first-seen order.
  """
  shares: dict[str, dict[str, list[float]]] = {}
  for workdir in workdirs:
    results = results_lib.load_results(workdir)
    if results.get("status") != "complete":
      continue
    by_set = shares.setdefault(results["algorithm"], {})
    for dataset, share in named_class_shares(workdir).items():
      by_set.setdefault(dataset, []).append(share)
  return {
    a: {d: stats.summarize(v) for d, v in by_set.items()} for a, by_set in shares.items() if by_set
  }


def render_markdown(table: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
  """The table as markdown: one row per algorithm, one column per interfering dataset (its
  named classes in the header), cells 'mean ± half-width (n)'."""
  items = [i for i in vocabulary.interference() if any(i.dataset in t for t in table.values())]
  header = [f"`{i.dataset}`: {' / '.join(i.pretrain_classes)}" for i in items]
  lines = [
    "| algorithm | " + " | ".join(header) + " |",
    "|---|" + "---:|" * len(items),
  ]
  for algorithm, by_set in table.items():
    cells = [stats.describe(by_set[i.dataset], 1) if i.dataset in by_set else "-" for i in items]
    lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m owl_cl.analysis.interference DIR... [--out FILE.md]`: prints (and writes) the
  table of the runs below the DIRs (`owl_cl.analysis.report.find_runs`).

  Returns:
    0, or 2 after printing a `ReportError` (no runs below the DIRs) to stderr.
  """
  import argparse  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", help="run workdirs or sweep folders")
  parser.add_argument("--out", help="also write the table to this markdown file")
  args = parser.parse_args(argv)
  try:
    text = render_markdown(build_table(report_lib.find_runs(args.dirs)))
  except report_lib.ReportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text, end="")
  if args.out:
    atomic_write_text(args.out, text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

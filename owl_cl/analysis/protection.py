"""Factor 3's test with per-class AP: do the retrieval algorithms protect the interfered classes?

`python -m owl_cl.analysis.protection DIR... [--reference uniform] [--out FILE.md]`
(docs/experiments.md, factor 3): built-in version 2 names, for each interfering downstream
dataset, two pre-training classes (`owl_cl.data.builtin.vocabulary.interference()`). The
design predicts that an algorithm replaying them more often than the reference "forgets less
on them". For every complete run with per-class AP (results.json `per_class`, issue 49):

* forgetting of a class = its AP on the pre-training evaluation set after pre-training (stage
  0) minus its AP at the last stage that evaluated that set (the final one), in points;
* per interfering dataset of the run's sequence: `named` = the mean forgetting of its two
  named classes, `others` = the mean forgetting of the other pre-training classes.

Per algorithm and dataset, paired with the reference's run of the same seeds and task order
(`report.pair_key`), the table gives the protective effect on the named classes, reference
forgetting minus the algorithm's (positive: the algorithm forgets less on them), and the same
beyond the general effect, (reference named - others) - (algorithm named - others), each the
mean ± 95% t-interval half-width with the paired t-test (`stats.paired_difference`) and Holm's
correction over the table's named-class comparisons. Exploratory unless a design states it.
Runs without per-class AP (written before it was recorded) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
import os
from typing import Any

import numpy as np

from owl_cl.analysis import report as report_lib
from owl_cl.analysis import stats
from owl_cl.data.builtin import vocabulary
from owl_cl.eval import results as results_lib
from owl_cl.utils import atomic_write_text

__all__ = ["class_forgetting", "build_table", "render_markdown", "main"]

# The two comparisons of each (algorithm, dataset) cell.
EFFECTS = ("named", "beyond_others")


def _per_class_ap(stage: Mapping[str, Any], eval_set: str) -> dict[str, float]:
  """{class: AP (points)} of one stage on `eval_set`, classes without an AP left out."""
  table = (stage.get("per_class") or {}).get(eval_set) or {}
  return {c: 100.0 * v["AP"] for c, v in table.items() if v.get("AP") is not None}


def class_forgetting(results: Mapping[str, Any]) -> dict[str, dict[str, float]]:
  """{interfering dataset: {'named': points, 'others': points}} of one run (module docstring):
  the mean forgetting of the dataset's two named pre-training classes and of the other
  pre-training classes between stage 0 and the last stage that evaluated the pre-training set.

  Args:
    results: a finalised results dict (`owl_cl.eval.results.load_results`).

  Returns:
    One entry per interfering dataset of `results['sequence']` whose named classes have an AP
    at both stages; {} for a run without per-class AP or without a later evaluation of the
    pre-training set.
  """
  eval_set = ((results.get("roles") or {}).get("pretrain") or {}).get("eval_set")
  stages = results.get("stages") or []
  later = [s for s in stages[1:] if eval_set in (s.get("per_class") or {})]
  if eval_set is None or not stages or not later:
    return {}
  before, after = _per_class_ap(stages[0], eval_set), _per_class_ap(later[-1], eval_set)
  lost = {c: before[c] - after[c] for c in vocabulary.pretrain_class_names() if c in before}
  lost = {c: v for c, v in lost.items() if c in after}
  out = {}
  for item in vocabulary.interference():
    named = item.pretrain_classes
    if item.dataset not in (results.get("sequence") or []) or not set(named) <= set(lost):
      continue
    others = [v for c, v in lost.items() if c not in named]
    out[item.dataset] = {
      "named": float(np.mean([lost[c] for c in named])),
      "others": float(np.mean(others)) if others else math.nan,
    }
  return out


def _runs(workdirs: Sequence[str]) -> dict[str, dict[str, dict]]:
  """{algorithm: {pair key: class_forgetting}} of the complete runs with per-class AP."""
  runs: dict[str, dict[str, dict]] = {}
  for workdir in workdirs:
    results = results_lib.load_results(workdir)
    if results.get("status") != "complete":
      continue
    forgetting = class_forgetting(results)
    if forgetting:
      runs.setdefault(results["algorithm"], {})[report_lib.pair_key(results)] = forgetting
  return runs


def build_table(workdirs: Sequence[str], reference: str = "uniform") -> dict[str, Any]:
  """The paired comparisons of every algorithm with `reference` (module docstring).

  Args:
    workdirs: run folders (`report.find_runs`); incomplete runs and runs without per-class AP
      are skipped.
    reference: the algorithm compared against.

  Returns:
    {'reference': str, 'rows': {algorithm: {dataset: {'named': d, 'beyond_others': d}}}},
    d a `stats.paired_difference` dict in points over the (seeds, order) pairs that both runs
    have, plus 'p_holm' on the 'named' ones; algorithms in first-seen order, datasets in
    `interference()` order; {} rows when no run of `reference` has per-class AP.
  """
  runs = _runs(workdirs)
  base = runs.get(reference, {})
  rows: dict[str, dict[str, dict[str, Any]]] = {}
  for algorithm, by_key in runs.items():
    if algorithm == reference or not base:
      continue
    for item in vocabulary.interference():
      pairs = [
        (base[k][item.dataset], v[item.dataset])
        for k, v in by_key.items()
        if k in base and item.dataset in v and item.dataset in base[k]
      ]
      if not pairs:
        continue
      ref, alg = ([p[i] for p in pairs] for i in (0, 1))
      rows.setdefault(algorithm, {})[item.dataset] = {
        # Reference forgetting - algorithm forgetting: > 0 when the algorithm forgets less.
        "named": stats.paired_difference([r["named"] for r in ref], [a["named"] for a in alg]),
        "beyond_others": stats.paired_difference(
          [r["named"] - r["others"] for r in ref], [a["named"] - a["others"] for a in alg]
        ),
      }
  cells = [cell["named"] for by_set in rows.values() for cell in by_set.values()]
  for cell, p in zip(cells, stats.holm([c["p"] for c in cells])):
    cell["p_holm"] = float(p)
  return {"reference": reference, "rows": rows}


def _cell(difference: Mapping[str, Any]) -> str:
  text = stats.describe(difference, 2)
  p = difference.get("p_holm", difference["p"])
  return text if math.isnan(p) else f"{text}, p {p:.3f}"


def render_markdown(table: Mapping[str, Any]) -> str:
  """The table as markdown: one row per algorithm, two columns per interfering dataset (its
  named classes in the header): the protective effect on them and beyond the other classes,
  'mean ± half-width (n = pairs), p' (Holm-adjusted for the named classes, raw beyond)."""
  rows = table["rows"]
  items = [i for i in vocabulary.interference() if any(i.dataset in r for r in rows.values())]
  if not items:
    return "No pairs of runs with per-class AP of the pre-training set.\n"
  header = []
  for i in items:
    header += [f"`{i.dataset}`: {' / '.join(i.pretrain_classes)}", f"`{i.dataset}` beyond others"]
  lines = [
    f"Protective effect against `{table['reference']}` (points of AP forgetting avoided)",
    "",
    "| algorithm | " + " | ".join(header) + " |",
    "|---|" + "---:|" * len(header),
  ]
  for algorithm, by_set in rows.items():
    cells = []
    for i in items:
      cell = by_set.get(i.dataset)
      cells += [_cell(cell[e]) for e in EFFECTS] if cell else ["-", "-"]
    lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m owl_cl.analysis.protection DIR... [--reference uniform] [--out FILE.md]`:
  prints (and writes) the table of the runs below the DIRs (`report.find_runs`).

  Returns:
    0, or 2 after printing a `ReportError` (no runs below the DIRs) to stderr.
  """
  import argparse  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", help="run workdirs or sweep folders")
  parser.add_argument("--reference", default="uniform", help="the algorithm compared against")
  parser.add_argument("--out", help="also write the table to this markdown file")
  args = parser.parse_args(argv)
  try:
    text = render_markdown(build_table(report_lib.find_runs(args.dirs), args.reference))
  except report_lib.ReportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text, end="")
  if args.out:
    atomic_write_text(os.path.abspath(args.out), text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

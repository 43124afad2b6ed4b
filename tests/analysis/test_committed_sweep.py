"""The README's results table is `python -m owl_cl.report` on the committed sweep's runs.

`benchmarks/sweep_builtin.sh` copies every complete run's results.json of the committed sweep
into `benchmarks/results/sweep_builtin/runs/` and writes the report there; the README shows its
summary table between the markers below. Re-computing the report from those files must give
the README's table and the committed report.md, character for character.
"""

import os
import re

from owl_cl.analysis import report as report_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "benchmarks", "results", "sweep_builtin")
BEGIN = "<!-- sweep_builtin summary: benchmarks/sweep_builtin.sh -->"
END = "<!-- /sweep_builtin summary -->"


def _readme_table() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
  assert match, f"README.md has no {BEGIN} ... {END} block"
  return match.group(1)


def _report():
  runs = report_lib.find_runs([os.path.join(SWEEP, "runs")])
  return report_lib.build_report(report_lib.load_points(runs), "uniform")


def test_readme_table_is_the_committed_sweeps_report():
  table = _readme_table()
  rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
  assert rows[0] == report_lib.NO_FINETUNING
  report = _report()
  assert report["algorithms"] and set(rows[1:]) == set(report["algorithms"])
  assert table == report_lib.render_summary_table(report, order=rows[1:])
  # Every algorithm has at least 5 runs (the n >= 5).
  assert min(report["summary"][a]["pretrain_AP"]["n"] for a in report["algorithms"]) >= 5


def test_committed_report_md_is_current():
  table = _readme_table()
  order = [line.split("|")[1].strip() for line in table.splitlines()[3:]]
  with open(os.path.join(SWEEP, report_lib.REPORT_MD), encoding="utf-8") as f:
    committed = f.read()
  assert committed == report_lib.render_markdown(_report(), order=order)

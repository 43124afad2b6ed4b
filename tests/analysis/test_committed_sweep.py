"""The committed sweeps' tables are `python -m owl_cl.report` on their committed runs.

`benchmarks/sweep_round2.sh` (the second design) and `benchmarks/sweep_builtin.sh` (the first)
copy every complete run's results.json into `benchmarks/results/<sweep>/runs/` and write the
report there; the README shows the second's summary table and docs/experiments.md the first's,
between the markers below. Re-computing the reports from those files must give those tables
and the committed report.md files (by order too) and factor 3's protection.md, character for
character. The same holds for `benchmarks/owlv2_builtin.sh` (OWLv2 beside v1): its two reports
and docs/owlv2.md's table of both.
"""

import json
import os
import re

import pytest

from owl_cl.analysis import claims
from owl_cl.analysis import protection
from owl_cl.analysis import report as report_lib
from owl_cl.configs import base

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "benchmarks", "results", "sweep_builtin")
BEGIN = "<!-- sweep_builtin summary: benchmarks/sweep_builtin.sh -->"
END = "<!-- /sweep_builtin summary -->"
FIRST_SWEEP_PAGE = "docs/experiments.md"
# The second committed sweep (docs/design_round2.md; the README's table).
ROUND2 = os.path.join(ROOT, "benchmarks", "results", "sweep_round2")
ROUND2_BEGIN = "<!-- sweep_round2 summary: benchmarks/sweep_round2.sh -->"
ROUND2_END = "<!-- /sweep_round2 summary -->"


def _marked_block(begin: str, end: str, page: str = "README.md") -> str:
  """The text of `page` (repository-relative) between the markers begin and end (their own
  lines excluded)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = f.read()
  match = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.S)
  assert match, f"{page} has no {begin} ... {end} block"
  return match.group(1)


def _readme_table() -> str:
  """The first sweep's table: the README's until the second sweep, now docs/experiments.md's."""
  return _marked_block(BEGIN, END, page=FIRST_SWEEP_PAGE)


def _readme_rows(table: str) -> list[str]:
  """The first column of the table's rows, in the README's order (header and rule dropped)."""
  return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


def _readme_order() -> list[str]:
  """The algorithms in the README table's order (its first row, no fine-tuning, dropped)."""
  return _readme_rows(_readme_table())[1:]


def _report():
  runs = report_lib.find_runs([os.path.join(SWEEP, "runs")])
  return report_lib.build_report(report_lib.load_points(runs), "uniform")


@pytest.mark.slow
def test_first_sweeps_table_is_its_report():
  table = _readme_table()
  rows = _readme_rows(table)
  assert rows[0] == report_lib.NO_FINETUNING
  report = _report()
  assert report["algorithms"] and set(rows[1:]) == set(report["algorithms"])
  assert table == report_lib.render_summary_table(report, order=rows[1:])
  # Every algorithm has at least 5 runs (the n >= 5).
  assert min(report["summary"][a]["pretrain_AP"]["n"] for a in report["algorithms"]) >= 5


@pytest.mark.slow
def test_committed_report_md_is_current():
  order = _readme_order()
  with open(os.path.join(SWEEP, report_lib.REPORT_MD), encoding="utf-8") as f:
    committed = f.read()
  assert committed == report_lib.render_markdown(_report(), order=order)


@pytest.mark.slow
def test_committed_reports_by_order_are_current():
  # benchmarks/sweep_builtin.sh writes one report per stored order (factor 4, the order effect).
  order = _readme_order()
  for task_order in ("random_0", "random_1"):
    runs = sorted(
      d
      for d in report_lib.find_runs([os.path.join(SWEEP, "runs")])
      if os.path.basename(d).split("_seed")[0].endswith(task_order)
    )
    assert len(runs) == 5 * len(order), task_order  # every algorithm, seeds 0-4
    report = report_lib.build_report(report_lib.load_points(runs), "uniform")
    path = os.path.join(SWEEP, "by_order", task_order, report_lib.REPORT_MD)
    with open(path, encoding="utf-8") as f:
      assert f.read() == report_lib.render_markdown(report, order=order)


OWLV2 = os.path.join(ROOT, "benchmarks", "results", "owlv2_builtin")
OWLV2_BEGIN = "<!-- owlv2_builtin summary: benchmarks/owlv2_builtin.sh -->"
OWLV2_END = "<!-- /owlv2_builtin summary -->"
OWLV2_MODELS = {"OWL-ViT v1": "v1", "OWLv2": "v2"}


def _model_report(model: str):
  runs = report_lib.find_runs([os.path.join(OWLV2, model, "runs")])
  return report_lib.build_report(report_lib.load_points(runs), "swil")


def test_owlv2_page_table_is_the_committed_reports():
  # benchmarks/owlv2_builtin.sh: one report per model (they differ in model.variant and
  # loss.objectness_weight, so one report refuses them), their summaries in one table, shown
  # by docs/owlv2.md.
  shown = _marked_block(OWLV2_BEGIN, OWLV2_END, page="docs/owlv2.md")
  reports = {label: _model_report(model) for label, model in OWLV2_MODELS.items()}
  table = report_lib.render_labelled_summary(reports)
  assert shown == table
  with open(os.path.join(OWLV2, "summary.md"), encoding="utf-8") as f:
    assert f.read() == table
  for label, model in OWLV2_MODELS.items():
    report = reports[label]
    assert report["algorithms"] == ["swil"]
    assert report["summary"]["swil"]["pretrain_AP"]["n"] >= 5
    with open(os.path.join(OWLV2, model, report_lib.REPORT_MD), encoding="utf-8") as f:
      assert f.read() == report_lib.render_markdown(report)


# The fields launch/sweep.py sets per run of benchmarks/sweep_builtin.sh (`--seed-fields`'s
# default and `--orders`); every other field is the config file's.
SWEEP_RUN_FIELDS = {"seeds.data", "seeds.retrieval", "task_order"}
# benchmarks/sweep_round2.sh's (launch/designs.py ROUND2: `--seed-fields=seed`, the orders).
ROUND2_RUN_FIELDS = {"seed", "task_order"}


def _section(title: str) -> str:
  """The README's section whose `## ` heading starts with `title`, up to the next one."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  match = re.search(rf"^## {re.escape(title)}[^\n]*\n(.*?)(?=^## )", text, re.S | re.M)
  assert match, f"README.md has no '## {title}' section"
  return match.group(1)


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def test_readme_main_command_runs_the_config_of_its_results():
  import importlib.util  # pylint: disable=g-import-not-at-top

  commands = re.findall(r"python -m owl_cl\.main --config=(\S+)", _section("Two commands"))
  assert len(commands) == 1, commands
  path, _, arg = commands[0].partition(":")
  spec = importlib.util.spec_from_file_location("readme_main_config", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  # What the results section says of its benchmark.
  results = _section("Results")
  version = re.search(r"built-in benchmark version (\d)", results)
  datasets = re.search(r"(\d+) downstream datasets", results)
  buffer = re.search(r"a ([\d,]+)-image buffer", results)
  assert version and datasets and buffer, "the results section no longer states its benchmark"
  assert config.data.builtin.version == int(version.group(1)) == 2
  assert len(config.data.builtin.downstream) == int(datasets.group(1)) == 7
  assert config.replay.budget == int(buffer.group(1).replace(",", "")) == 1200
  # The committed sweep's runs of that algorithm ran this config, field for field, but for
  # the fields the sweep sets per run.
  want = _flat(json.loads(config.to_json_best_effort()))
  defaults = _flat(json.loads(base.get_config("builtin1").to_json_best_effort()))
  # The second sweep's table (3 model seeds x 4 orders) and the first sweep's (seeds 0-4 on
  # random_0 and random_1), each with the fields it sets per run.
  for sweep, n, fields in ((ROUND2, 12, ROUND2_RUN_FIELDS), (SWEEP, 10, SWEEP_RUN_FIELDS)):
    _check_runs_of(want, defaults, sweep, config.experiment_name, n, fields)


def _check_runs_of(want: dict, defaults: dict, sweep: str, name: str, n: int, fields: set):
  """The sweep's n runs of `name` ran the config `want` (flat), field for field, but for the
  `fields` the sweep sets per run."""
  runs = report_lib.find_runs([os.path.join(sweep, "runs")])
  ran = [r for r in runs if os.path.basename(r).startswith(f"{name}_random_")]
  assert len(ran) == n, ran
  for run in ran:
    with open(os.path.join(run, "results.json"), encoding="utf-8") as f:
      got = _flat(json.load(f)["config"])
    # A field added after the sweep is absent from its runs' configs: at its default it keeps
    # their results (`experiment.existing_run` accepts it so on resume too).
    got = {**{k: v for k, v in defaults.items() if k not in got}, **got}
    differing = {k for k in set(want) | set(got) if want.get(k, "?") != got.get(k, "?")}
    assert differing <= fields, (run, sorted(differing - fields))


# The second committed sweep (docs/design_round2.md): benchmarks/sweep_round2.sh copies each
# cell's runs into benchmarks/results/sweep_round2/runs/ and, once all are in, writes its report
# with the analysis plan `round2`, one report per order and factor 3's protection.md there.


def _round2_order() -> list[str]:
  """The rows of the README's round-2 table, no fine-tuning dropped: the design's order."""
  return _readme_rows(_marked_block(ROUND2_BEGIN, ROUND2_END))[1:]


def _round2_runs() -> dict[str, dict]:
  """{run folder: its results.json} of the committed runs."""
  runs = {}
  for run in report_lib.find_runs([os.path.join(ROUND2, "runs")]):
    with open(os.path.join(run, "results.json"), encoding="utf-8") as f:
      runs[run] = json.load(f)
  return runs


@pytest.mark.slow
def test_round2_runs_say_where_they_come_from():
  # Each run has its commit, a clean tree and the environment.json of the machine that ran it
  # (launch/sweep_design.py). A cell (model seed, order: the runs a paired comparison pairs)
  # ran at one commit on one machine, and every run of a model seed evaluated one pre-trained
  # model (stage 0) however many sittings it took. That the runs are the design's 252 and that
  # the commits' run code is one are tests/launch/test_designs.py's.
  cell_sources, pretrained = {}, {}
  for run, results in _round2_runs().items():
    with open(os.path.join(run, "environment.json"), encoding="utf-8") as f:
      machine = json.load(f)["cpu_flags"]
    assert results["status"] == "complete" and results["dirty"] is False, run
    assert re.fullmatch(r"[0-9a-f]{40}", results["commit"]), run
    model = results["seeds"]["model"]
    cell = (model, results["task_order"]["name"])
    cell_sources.setdefault(cell, set()).add((results["commit"], machine))
    stage0 = json.dumps(results["stages"][0]["metrics"], sort_keys=True)
    pretrained.setdefault(model, set()).add(stage0)
  assert all(len(sources) == 1 for sources in cell_sources.values()), cell_sources
  assert all(len(models) == 1 for models in pretrained.values())


@pytest.mark.slow
def test_round2_readme_table_and_report_md_are_its_report():
  # One test, so the report (about 19 s) is built once whichever worker runs it.
  points = report_lib.load_points(list(_round2_runs()))
  report = report_lib.build_report(points, "uniform", plan=claims.PLANS["round2"])
  order = _round2_order()
  assert set(order) == set(report["algorithms"]) and report["plan"] == "round2"
  table = _marked_block(ROUND2_BEGIN, ROUND2_END)
  assert table == report_lib.render_summary_table(report, order=order)
  assert min(report["summary"][a]["pretrain_AP"]["n"] for a in order) >= 12  # the n
  with open(os.path.join(ROUND2, report_lib.REPORT_MD), encoding="utf-8") as f:
    assert f.read() == report_lib.render_markdown(report, order=order)


@pytest.mark.slow
def test_round2_reports_by_order_are_current():
  # One report per stored order (launch/sweep_design.py), each of every row x model seed.
  order, by_order = _round2_order(), {}
  runs = _round2_runs()
  models = {results["seeds"]["model"] for results in runs.values()}
  for run, results in runs.items():
    by_order.setdefault(results["task_order"]["name"], []).append(run)
  assert len(by_order) == len(os.listdir(os.path.join(ROUND2, "by_order"))) > 1
  for task_order, folders in by_order.items():
    report = report_lib.build_report(report_lib.load_points(sorted(folders)), "uniform")
    assert {report["summary"][a]["pretrain_AP"]["n"] for a in order} == {len(models)}
    path = os.path.join(ROUND2, "by_order", task_order, report_lib.REPORT_MD)
    with open(path, encoding="utf-8") as f:
      assert f.read() == report_lib.render_markdown(report, order=order), task_order


def test_round2_protection_table_is_current():
  # Factor 3 (docs/design_round2.md): the protective effect on the named classes, recomputed
  # from the committed per-class AP.
  table = protection.build_table(list(_round2_runs()), "uniform")
  with open(os.path.join(ROUND2, "protection.md"), encoding="utf-8") as f:
    assert f.read() == protection.render_markdown(table)

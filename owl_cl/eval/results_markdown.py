"""`results.md`: one run's results dict as markdown in the paper's Table 3 layout.

The text `owl_cl.eval.results.write_results` writes beside `results.json`: the Table 3 rows
(No fine-tuning, the run's algorithm), the per-dataset matrices, the replay fractions (paper
Table 4) and forgetting / BWT / FWT, in % with one decimal; its first line is the run's
ownership marker. Also the cells and tables `merge_results_tables` shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from typing import Any

from owl_cl.eval import table3


def pct(value: Any, signed: bool = False) -> str:
  """A fraction in [0, 1] as percent with one decimal (`0.4567` -> `"45.7"`, signed: `"+45.7"`);
  None / NaN -> `"-"`."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "-"
  return f"{100.0 * float(value):+.1f}" if signed else f"{100.0 * float(value):.1f}"


def _shown_columns(roles: Mapping[str, Any]) -> list[str]:
  """Table-3 columns with an eval set (a run without an LVIS stand-in has no LVIS column)."""
  return [key for key in table3.COLUMNS if roles[key]["eval_set"] is not None]


def column_titles(roles: Mapping[str, Any]) -> list[str]:
  """Titles of the shown Table-3 columns (label and eval set, its AP key where not "AP"), then
  the downstream mean's with its number of sets."""
  titles = []
  for key in _shown_columns(roles):
    role = roles[key]
    if role["AP"] != "AP":
      titles.append(f"{role['label']} (`{role['eval_set']}` {role['AP']})")
    else:
      titles.append(f"{role['label']} (`{role['eval_set']}`)")
  titles.append(f"{roles['downstream_label']} ({len(roles['downstream'])} sets)")
  return titles


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  """Markdown table lines: the header, the rule (first column left-, others right-aligned), a
  line per row (cells already formatted)."""
  lines = [
    "| " + " | ".join(header) + " |",
    "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
  ]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return lines


def row_cells(row: Mapping[str, Any], suffix: str, roles: Mapping[str, Any]) -> list[str]:
  """The cells (%, `pct`) of a Table-3 row (`table3.table3_row`) for metric `suffix` ("AP" or
  "AP50"), in the order of `column_titles`."""
  return [pct(row.get(f"{key}_{suffix}")) for key in _shown_columns(roles) + ["downstream_mean"]]


def partial_note(summary: Mapping[str, Any]) -> str:
  """`" (partial: k/n datasets)"` when a results summary has fewer stages than expected, else
  `""`."""
  expected = summary.get("stages_expected")
  done = summary.get("stages_completed")
  if expected and done is not None and done < expected:
    return f" (partial: {done - 1}/{expected - 1} datasets)"
  return ""


def _replay_section(results: Mapping[str, Any]) -> list[str]:
  """Per-dataset replay fractions (the paper's Table 4 "Replay %"), from each stage's
  `train` summary (`replay_steps_fraction`, `replay_samples_fraction`, `replays_in_loss`,
  `replay_slots`, `replayed_images`, `loss_adaptivity`, `loss_threshold`); [] if no stage
  has them (e.g. no replay)."""
  trained = [(s["name"], s.get("train") or {}) for s in results["stages"][1:]]
  trained = [(n, t) for n, t in trained if "replay_samples_fraction" in t]
  if not trained:
    return []
  modes = sorted({str(t.get("loss_adaptivity")) for _, t in trained})
  thresholds = sorted(
    {t.get("loss_threshold") for _, t in trained if t.get("loss_threshold") is not None}
  )
  lines = [
    "## Replay (paper Table 4: fraction replayed)",
    "",
    f"- loss adaptivity: {', '.join(modes)}"
    + (f" (threshold l = {', '.join(f'{x:g}' for x in thresholds)})" if thresholds else ""),
    "",
  ]
  rows = []
  totals = {
    "steps": 0,
    "replay_steps": 0,
    "replays_in_loss": 0,
    "replay_slots": 0,
    "replayed_images": 0,
  }
  for name, t in trained:
    rows.append(
      [
        f"`{name}`",
        str(t.get("steps", "-")),
        str(t.get("replayed_images", "-")),
        str(t.get("replays_in_loss", "-")),
        pct(t.get("replay_steps_fraction")),
        pct(t.get("replay_samples_fraction")),
      ]
    )
    for key in totals:
      totals[key] += int(t.get(key) or 0)
  steps, slots = totals["steps"], totals["replay_slots"]
  rows.append(
    [
      "all",
      str(steps),
      str(totals["replayed_images"]),
      str(totals["replays_in_loss"]),
      pct(totals["replay_steps"] / steps if steps else None),
      pct(totals["replays_in_loss"] / slots if slots else None),
    ]
  )
  lines += table(
    [
      "Dataset",
      "steps",
      "retrieved images",
      "replays in loss",
      "steps with replay (%)",
      "samples replayed (%)",
    ],
    rows,
  )
  return lines + [""]


def _header_lines(results: Mapping[str, Any]) -> list[str]:
  """`results.md`'s ownership marker, title and run facts (id, status, seed, sequence,
  stages, wall time, time written)."""
  summary = results["summary"]
  algo = results["algorithm"]
  lines = [
    f'<!-- owl_cl-results run_id="{results["run_id"]}" '
    f"schema_version={results['schema_version']} -->",
    f"# Results: {algo}",
    "",
  ]
  lines.append(f"- run id: `{results['run_id']}`")
  if results.get("status"):
    lines.append(f"- status: {results['status']}")
  if results.get("seed") is not None:
    lines.append(f"- seed: {results['seed']}")
  if results.get("sequence"):
    lines.append(f"- sequence ({len(results['sequence'])}): " + " -> ".join(results["sequence"]))
  if results.get("schedule") not in (None, "sequence"):
    lines.append(f"- schedule: {results['schedule']} (docs/baselines.md)")
  lines.append(
    f"- stages completed: {summary['stages_completed'] - 1} datasets after "
    "pre-training" + partial_note(summary)
  )
  total = (results.get("wall_times") or {}).get("total") or (results.get("timings") or {}).get(
    "wall_seconds"
  )
  if total is not None:
    lines.append(f"- wall time: {total / 3600:.2f} h")
  if results.get("updated_at"):
    lines.append(f"- written: {results['updated_at']}")
  lines.append("")
  return lines


def _table3_section(results: Mapping[str, Any]) -> list[str]:
  """The paper's Table 3 layout, AP then AP50: "No fine-tuning" and the run's last stage."""
  roles = results["roles"]
  summary = results["summary"]
  algo = results["algorithm"]
  lines = []
  header = ["Algorithm"] + column_titles(roles)
  for suffix, title in (("AP", "mAP@[.5:.95]"), ("AP50", "AP50")):
    lines += [f"## Table 3 layout: {title} (%) after stage `{summary['final']['stage']}`", ""]
    rows = [
      ["No fine-tuning"] + row_cells(summary["no_finetuning"], suffix, roles),
      [algo + partial_note(summary)] + row_cells(summary["final"], suffix, roles),
    ]
    lines += table(header, rows) + [""]
  return lines


def _ivlod_section(results: Mapping[str, Any]) -> list[str]:
  """The IVLOD row of the continual open-vocabulary detection papers (`owl_cl.eval.ivlod`):
  ZCOCO, Avg, LVIS APr and the per-dataset APs after the last task, beside No fine-tuning;
  nothing without a results.json `ivlod` block."""
  block = results.get("ivlod")
  if not block:
    return []
  datasets = block["datasets"]
  header = ["Algorithm", "ZCOCO", f"Avg ({len(datasets)})", "LVIS APr"]
  header += [f"`{d}`" for d in datasets]
  rows = []
  for key, label in (("no_finetuning", "No fine-tuning"), ("final", results["algorithm"])):
    row = block["rows"][key]
    cells = [pct(row[k]) for k in ("ZCOCO", "Avg", "LVIS_APr")]
    rows.append([label] + cells + [pct(row["per_dataset"].get(d)) for d in datasets])
  final = block["rows"]["final"]["stage"]
  order = f" (`{results['task_order']}`)" if results.get("task_order") else ""
  return [
    f"## IVLOD (ZiRa, DitHub): AP (%) after stage `{final}`",
    "",
    f"ZCOCO: AP on `{block['zero_shot_set']}`; Avg: mean AP over the {len(datasets)} "
    f"downstream test sets; LVIS APr: `{block['lvis_set']}` rare classes (docs/ivlod.md).",
    f"One task order{order}: an IVLOD result is the mean and spread over the stored orders "
    "(`python -m owl_cl.report`), never this row alone.",
    "",
    *table(header, rows),
    "",
  ]


def _own_task_section(results: Mapping[str, Any]) -> list[str]:
  """Each downstream set's AP and AP50 right after its own training, their mean and min
  (`summary.own`; the min is the "min own" a `per_task` run bounds); [] without it."""
  own = results["summary"].get("own")
  if not own or not own.get("per_set"):
    return []
  names = list(own["per_set"])
  rows = [
    [metric]
    + [pct(own["per_set"][n][metric]) for n in names]
    + [pct(own[f"mean_{metric}"]), pct(own[f"min_{metric}"])]
    for metric in ("AP", "AP50")
  ]
  lines = ["## Own-task AP (%): each dataset right after its own training", ""]
  return lines + table(["Metric"] + [f"`{n}`" for n in names] + ["mean", "min"], rows) + [""]


def _per_dataset_section(results: Mapping[str, Any], eval_sets: list[str]) -> list[str]:
  """Per-dataset AP and AP50 matrices: a row per stage, a column per eval set, plus the
  downstream mean."""
  lines = []
  downstream = results["roles"]["downstream"]
  for metric in ("AP", "AP50"):
    lines += [f"## Per-dataset {metric} (%) after each stage", ""]
    rows = []
    for stage in results["stages"]:
      cells = [pct(table3.stage_value(stage, name, metric)) for name in eval_sets]
      cells.append(pct(table3.downstream_mean(stage, downstream, metric)))
      rows.append([f"{stage['index']}: {stage['name']}"] + cells)
    lines += table(["Stage"] + [f"`{n}`" for n in eval_sets] + ["downstream mean"], rows)
    lines.append("")
  return lines


def _forgetting_section(results: Mapping[str, Any], eval_sets: list[str]) -> list[str]:
  """Forgetting, BWT and FWT per eval set, AP and AP50 (points, %)."""
  lines = [
    "## Forgetting and transfer (points, %)",
    "",
    "Forgetting f_j = max over stages since j was learned (before the last) of the "
    "metric minus its final value (Chaudhry et al. 2018); BWT = mean over downstream "
    "sets learned before the last stage of final minus just-after-learning (Lopez-Paz "
    "& Ranzato 2017); FWT = mean of the metric just before learning minus after "
    "pre-training (zero-shot reference); retained = final / after pre-training.",
    "",
  ]
  for metric in ("AP", "AP50"):
    f = results["forgetting"][metric]
    rows = []
    for name in eval_sets:
      s = f["per_set"][name]
      rows.append(
        [
          f"`{name}`",
          s["trained_at"] or "-",
          pct(s["initial"]),
          pct(s["best_before_final"]),
          pct(s["final"]),
          pct(s["forgetting"]),
          pct(s["retained_fraction"]),
        ]
      )
    lines += [f"### {metric}", ""]
    lines += table(
      [
        "Eval set",
        "trained at",
        "after pre-training",
        "best before final",
        "final",
        "forgetting",
        "retained (%)",
      ],
      rows,
    )
    lines += [
      "",
      f"- average forgetting: {pct(f['average_forgetting'])}",
      f"- BWT: {pct(f['bwt'], signed=True)}",
      f"- FWT: {pct(f['fwt'], signed=True)}",
      "",
    ]
  return lines


def render_results_markdown(results: Mapping[str, Any]) -> str:
  """`results.md` text of one finalised results dict (see `finalize_results`).

  Sections: (a) the paper's Table 3 layout (Algorithm | O365 stand-in | LVIS stand-in |
  held-out (rare) | ODinW stand-in mean), rows "No fine-tuning" (stage 0) and the run's
  algorithm (last stage; a per-task run: the mean over its task models), AP then AP50, in %
  with one decimal, followed by each dataset's own-task AP (`_own_task_section`); (b)
  per-dataset AP and AP50
  matrices (rows: stages, columns: eval sets, plus the downstream mean); (c) with replay,
  the fraction of steps and samples replayed per dataset (paper Table 4, `_replay_section`);
  (d) forgetting, BWT and FWT (AP and AP50 points, %); with an `ivlod` block, the IVLOD row
  (ZCOCO, Avg, LVIS APr, per dataset) after (a). Missing values print as '-'.

  Args:
    results: a finalised results dict.

  Returns:
    Markdown text; its first line is the ownership marker
    `<!-- owl_cl-results run_id="..." schema_version=1 -->`.
  """
  eval_sets = table3.eval_set_order(results)
  lines = _header_lines(results)
  lines += _table3_section(results)
  lines += _ivlod_section(results)
  lines += _own_task_section(results)
  lines += _per_dataset_section(results, eval_sets)
  lines += _replay_section(results)
  lines += _forgetting_section(results, eval_sets)
  return "\n".join(lines)

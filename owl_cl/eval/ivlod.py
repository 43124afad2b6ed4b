"""The IVLOD metric block: what ZiRa (NeurIPS'24) and DitHub (NeurIPS'25) report on ODinW-13.

After the sequence of downstream datasets (ODinW-13, configs/ivlod_odinw13.py), the
continual open-vocabulary detection papers report one row per method:

* **Avg**: the mean over the downstream test sets of COCO AP (mAP@[.5:.95]) after the last
  task (their released `train_multidatasets.py` / `main.py`: "average AP" over the 13 result
  files, COCO's excluded);
* the 13 per-dataset APs after the last task (the table's columns);
* **ZCOCO**: COCO AP on COCO val 2017 after the last task, the zero-shot retention (their
  "AP on COCO", `test_zero_shot_coco.py`);

and owl_cl adds **LVIS APr** (the paper's held-out rare classes) beside ZCOCO. The same row at
stage 0 ("No fine-tuning": the pre-trained model) is the zero-shot reference. Values are
fractions in [0, 1] like every results.json metric (the papers print %, as results.md does).
An average over stages is not computed: the released code prints only the final one
(docs/ivlod.md).

results.json `ivlod` (recomputed from the stages by `owl_cl.eval.results.finalize_results`
whenever a results dict carries an `ivlod` key naming its sets):

```
{"zero_shot_set": str | null, "lvis_set": str | null, "datasets": [str, ...],
 "rows": {"no_finetuning": ROW, "final": ROW}}
ROW = {"stage": str, "Avg": float | null, "ZCOCO": float | null, "LVIS_APr": float | null,
       "per_dataset": {dataset: float | null}}
```

Source: JarintotionDin/ZiRaGroundingDINO `train_multidatasets.py` (main: "average AP", "AP on
COCO"); chiara-cap/DitHub `main.py` (the same); docs/ivlod.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from owl_cl.eval import table3

__all__ = ["IVLOD_KEYS", "ivlod_row", "ivlod_block"]

# The row's scalar columns, in the papers' order (ZCOCO, Avg) and owl_cl's addition.
IVLOD_KEYS = ("ZCOCO", "Avg", "LVIS_APr")


def ivlod_row(
  stage: Mapping[str, Any],
  datasets: Sequence[str],
  zero_shot_set: str | None,
  lvis_set: str | None,
) -> dict[str, Any]:
  """One stage's IVLOD row.

  Args:
    stage: a results.json stage ({'name', 'metrics': {eval_set: {'AP': float, 'APr': ...}}}).
    datasets: the downstream eval sets averaged into Avg (ODinW-13's 13).
    zero_shot_set: the eval set of ZCOCO (COCO val 2017); None: no ZCOCO.
    lvis_set: the LVIS eval set whose 'APr' is reported; None: none.

  Returns:
    {'stage': name, 'Avg', 'ZCOCO', 'LVIS_APr': floats in [0, 1] or NaN, 'per_dataset':
    {dataset: AP or NaN}}. Avg is NaN when a dataset's AP is missing (never a partial
    average, as `table3.downstream_mean`).
  """
  per_dataset = {d: table3.stage_value(stage, d, "AP") for d in datasets}
  return {
    "stage": stage.get("name"),
    "Avg": table3.downstream_mean(stage, list(datasets), "AP"),
    "ZCOCO": table3.stage_value(stage, zero_shot_set, "AP"),
    "LVIS_APr": table3.stage_value(stage, lvis_set, "APr"),
    "per_dataset": per_dataset,
  }


def ivlod_block(
  stages: Sequence[Mapping[str, Any]],
  datasets: Sequence[str],
  zero_shot_set: str | None,
  lvis_set: str | None,
) -> dict[str, Any]:
  """The results.json `ivlod` block (module docstring) of a run's stages.

  Args:
    stages: the results' stages, stage 0 after pre-training, the last the latest written.
    datasets: as `ivlod_row`.
    zero_shot_set: as `ivlod_row`.
    lvis_set: as `ivlod_row`.

  Returns:
    {'zero_shot_set', 'lvis_set', 'datasets': list, 'rows': {'no_finetuning': stage 0's row,
    'final': the last stage's row}}.

  Raises:
    ValueError: no stages.
  """
  if not stages:
    raise ValueError("the IVLOD block needs at least stage 0 (after pre-training)")
  row = lambda s: ivlod_row(s, datasets, zero_shot_set, lvis_set)
  return {
    "zero_shot_set": zero_shot_set,
    "lvis_set": lvis_set,
    "datasets": [str(d) for d in datasets],
    "rows": {"no_finetuning": row(stages[0]), "final": row(stages[-1])},
  }

"""The committed sweeps' designs, written once: their rows, cells, run order and report.

A design is rows (a report's row: its name, its config file and config overrides) x model
seeds x stored task orders. `DESIGNS` holds two:

* `builtin`: the first committed sweep (docs/experiments.md, "The committed sweep"): 15 rows,
  seeds 0-4 of the data and retrieval on one pre-trained model, orders `random_0` and
  `random_1`. Its fixed row list below is that design's record; its report is in
  benchmarks/results/sweep_builtin/.
* `round2`: the second design (docs/design_round2.md): every retrieval algorithm of the
  registry (`owl_cl.replay.retrieval.registry.ALGORITHMS`, so one registered later is in it),
  every baseline of `owl_cl.configs.BASELINES` (`no_replay` among them), WiSE-FT alone at
  `WISE_FT_ALPHAS` (its retention / plasticity curve) and composed with replay
  (`COMPOSED`), x model seeds 0-2 (`seed`) x the stored orders `random_0`-`random_3`.

`launch/sweep_design.py` runs a design and writes its report. A row that combines WiSE-FT
with another config is named `<config>+wise_ft(<alpha>)` (`row_name`), WiSE-FT alone
`wise_ft(<alpha>)`.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import importlib
import math

from owl_cl import configs
from owl_cl.analysis import claims
from owl_cl.config_fields import SCHEDULES
from owl_cl.configs import wise_ft as wise_ft_config
from owl_cl.replay.retrieval import registry

# The planning figures of docs/design_round2.md ("Cost"), measured by the second sweep's
# sittings on the 2-core machine, 2 runs at a time: a model seed's pre-training (333-405 s,
# 2026-12-01) and the machine's wall time per cached run (82 s each, two side by side). They
# give 3.2 h for the 252 runs, against 3.4 h at the idle second sitting's 74 runs an hour.
# (The first sweep's figures, 5 min and 65 s, gave 4.8 h.)
PRETRAIN_SECONDS = 400
RUN_SECONDS = 41
WISE_FT = "wise_ft"
SEQUENTIAL = SCHEDULES[0]  # one dataset after another (the others: joint, per task)
ALPHA_FIELD = "train.wise_ft.alpha"
# WiSE-FT alone: the curve's mixing coefficients (configs/wise_ft.py's own 0.5 among them;
# 1 is `no_replay`, 0 the pre-trained model); composed with replay: (config, alpha).
WISE_FT_ALPHAS = tuple(sorted({0.25, wise_ft_config.ALPHA, 0.75}))
COMPOSED = (("swil", wise_ft_config.ALPHA),)


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of a design: `name` (the runs' `experiment_name`, the report's row), its config
  file `configs/<config>.py` and config overrides ((field, value) strings)."""

  name: str
  config: str
  overrides: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Design:
  """A sweep's design: rows x seeds x orders, run in priority order, and its report.

  Attributes:
    name: the design's name (`DESIGNS`).
    rows: the rows in the report's order (the summary table's).
    seeds: the values of `seed_fields`.
    orders: stored task orders (owl_cl/data/orders/builtin.json).
    seed_fields: config fields each seed sets (`launch/sweep.py --seed-fields`).
    config_arg: the configs' argument, e.g. 'builtin2'.
    cells: 'order': every row and seed of the first order, then the next order;
      'model_order': the (model seed, order) cells one after another, every row in each
      (`cell_order`), so a sweep stopped early has complete cells for every row.
    first_rows: the names of the rows run first in each order ('order') or cell
      ('model_order'; the first fills the cache), the others after them, each part in the
      rows' order.
    out: the report's folder (the runs' results.json in `<out>/runs/`).
    root: the workdirs' default parent folder.
    plan: the report's analysis plan (`owl_cl.analysis.claims.PLANS`), or None.
    reference: the row every other is compared with in the report (`--reference`).
    interference / protection: factor 3's tables (`owl_cl.analysis.interference` from the
      workdirs' records, `owl_cl.analysis.protection` from the copied results).
  """

  name: str
  rows: tuple[Row, ...]
  seeds: tuple[int, ...]
  orders: tuple[str, ...]
  seed_fields: tuple[str, ...] | None
  config_arg: str
  cells: str
  first_rows: tuple[str, ...]
  out: str
  root: str
  plan: str | None = None
  reference: str = "uniform"
  interference: bool = False
  protection: bool = False


def row_name(config: str, alpha: float = 1.0) -> str:
  """A row's name: `config` alone (alpha 1, no blend), 'wise_ft(0.25)' (WiSE-FT alone at
  alpha 0.25), 'swil+wise_ft(0.5)' (swil's config with WiSE-FT at 0.5)."""
  if alpha == 1.0:
    return config
  blend = f"{WISE_FT}({alpha:g})"
  return blend if config == WISE_FT else f"{config}+{blend}"


def _row(config: str, alpha: float = 1.0) -> Row:
  overrides = () if alpha == 1.0 else ((ALPHA_FIELD, f"{alpha:g}"),)
  return Row(row_name(config, alpha), config, overrides)


def _schedule(config: str) -> str:
  return importlib.import_module(f"owl_cl.configs.{config}").get_config().train.schedule


def round2_rows() -> tuple[Row, ...]:
  """The second design's rows, in the report's order: the sequential baselines (lower
  bounds), WiSE-FT alone over `WISE_FT_ALPHAS`, every retrieval algorithm (registry order),
  the composed rows, then the baselines of another schedule (upper bounds: joint, per task)."""
  baselines = [b for b in configs.BASELINES if b != WISE_FT]
  lower = [_row(b) for b in baselines if _schedule(b) == SEQUENTIAL]
  upper = [_row(b) for b in baselines if _schedule(b) != SEQUENTIAL]
  alone = [_row(WISE_FT, a) for a in WISE_FT_ALPHAS]
  retrieval = [_row(a) for a in registry.ALGORITHMS]
  composed = [_row(c, a) for c, a in COMPOSED]
  return tuple(lower + alone + retrieval + composed + upper)


# The first design's record (benchmarks/sweep_builtin.sh ran it; its report's row order).
BUILTIN = Design(
  name="builtin",
  rows=tuple(
    _row(a)
    for a in (
      "no_replay",
      "lwf",
      "heads_only",
      "lora",
      "uniform",
      "uniform_balanced",
      "swil",
      "grasp",
      "sw_grasp",
      "a_sw_grasp",
      "aser",
      "aser_pc",
      "sw_aser_pc",
      "joint",
      "per_task",
    )
  ),
  seeds=(0, 1, 2, 3, 4),
  orders=("random_0", "random_1"),
  seed_fields=None,  # seeds.data and seeds.retrieval: one pre-trained model
  config_arg="builtin2",
  cells="order",
  # Run first on each order: no_replay and the retrieval algorithms (then the baselines).
  first_rows=("no_replay",) + tuple(registry.ALGORITHMS),
  out="benchmarks/results/sweep_builtin",
  root="workdirs/sweep_builtin2",
  interference=True,
)

ROUND2 = Design(
  name="round2",
  rows=round2_rows(),
  seeds=(0, 1, 2),
  orders=("random_0", "random_1", "random_2", "random_3"),
  seed_fields=("seed",),  # the model seed, and with it the data and retrieval seeds
  config_arg="builtin2",
  cells="model_order",
  # The plan's reference first in each cell: it fills the seed's cache (model and buffer).
  first_rows=(claims.ROUND2.reference,),
  out="benchmarks/results/sweep_round2",
  root="workdirs/sweep_round2",
  plan=claims.ROUND2.name,
  reference=claims.ROUND2.reference,
  protection=True,
)

DESIGNS = {d.name: d for d in (BUILTIN, ROUND2)}


def cell_order(num_seeds: int, num_orders: int) -> list[tuple[int, int]]:
  """The (seed index, order index) cells in run order: cell i is (i mod S, (i + i // L) mod
  O), L = lcm(S, O), so every prefix spreads over the seeds and the orders (3 x 4: (0, 0),
  (1, 1), (2, 2), (0, 3), (1, 0), ...) and the S x O cells each come once."""
  lcm = math.lcm(num_seeds, num_orders)
  return [(i % num_seeds, (i + i // lcm) % num_orders) for i in range(num_seeds * num_orders)]


def run_order(design: Design) -> list[tuple[Row, int, str]]:
  """(row, seed, order) of every run, in the design's priority order (`Design.cells`)."""
  # The rows named in `first_rows` first, each part in the rows' own order.
  first = [r for r in design.rows if r.name in design.first_rows]
  rows = first + [r for r in design.rows if r.name not in design.first_rows]
  if design.cells == "order":
    return [(r, s, o) for o in design.orders for r in rows for s in design.seeds]
  if design.cells == "model_order":
    cells = cell_order(len(design.seeds), len(design.orders))
    return [(r, design.seeds[s], design.orders[o]) for s, o in cells for r in rows]
  raise ValueError(f"design {design.name!r}: unknown cells {design.cells!r}")


def model_count(design: Design) -> int:
  """How many pre-trained models the design trains: its seeds when they set the model seed."""
  fields = design.seed_fields or ()
  return len(design.seeds) if {"seed", "seeds.model"} & set(fields) else 1


def estimate_seconds(design: Design, runs: int | None = None) -> float:
  """The planning estimate of the design's wall time on the idle 2-core machine, 2 runs at a
  time: `PRETRAIN_SECONDS` per pre-trained model + `RUN_SECONDS` per run (`runs`: default
  all of them)."""
  runs = len(run_order(design)) if runs is None else runs
  return model_count(design) * PRETRAIN_SECONDS + runs * RUN_SECONDS


def summary(design: Design) -> str:
  """One line: rows, cells, runs and the planning estimate of the time."""
  runs = len(run_order(design))
  hours = estimate_seconds(design) / 3600.0
  return (
    f"design {design.name}: {len(design.rows)} rows x {len(design.seeds)} seed(s) x "
    f"{len(design.orders)} order(s) = {runs} runs; estimate {hours:.1f} h on 2 idle cores "
    f"({model_count(design)} pre-training(s) x {PRETRAIN_SECONDS} s + {runs} x "
    f"{RUN_SECONDS} s, docs/design_round2.md 'Cost')"
  )


def row_names(rows: Sequence[Row]) -> list[str]:
  """The rows' names."""
  return [r.name for r in rows]

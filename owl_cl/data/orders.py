"""Task orders as data: named, fixed orders of each suite's downstream datasets.

One JSON file per suite in `owl_cl/data/orders/<suite>.json` (shipped as package data):

```
{"suite": str, "seed": int, "num_random": int, "datasets": [str, ...],
 "orders": {"canonical": [...], "reversed": [...], "random_0": [...], ...}}
```

* `datasets` is the suite's canonical listing (`owl_cl.data.suites` / `owl_cl.data.odinw` /
  `owl_cl.data.builtin.DOWNSTREAM_NAMES`), never a directory listing;
* `canonical` is that listing, `reversed` its reverse, and `random_<i>` (i < `num_random`) the
  i-th permutation drawn by `np.random.default_rng(ORDER_SEED).permutation` of the listing
  (one generator per suite, draws in turn; NumPy's PCG64 stream is fixed across versions).

The files are generated once by `python -m owl_cl.data.orders --write` and never derived at
run time: a test checks they equal `generate_orders` and that each order is a permutation of
the suite's datasets. A config selects an order with `task_order` (`resolve_order`): its name
(`'random_3'`), its index in the file (`'2'`), or `'<suite>/<name>'`. A run whose sequence is a
subset of a suite (the built-in default trains on 5 of its 7 datasets; a suite's `names`)
follows the order restricted to its datasets (a uniformly random permutation restricted to a
subset is a uniformly random permutation of the subset).
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
from typing import Any

import numpy as np

from owl_cl.config_fields import ConfigError
from owl_cl.data import builtin
from owl_cl.data import odinw
from owl_cl.data import suites

__all__ = [
  "ORDER_SEED",
  "NUM_RANDOM",
  "ORDER_SUITES",
  "OrderError",
  "suite_datasets",
  "generate_orders",
  "orders_path",
  "load_orders",
  "format_orders",
  "resolve_order",
  "task_order_problem",
]

# The seed of every stored random order (documented in docs/experiments.md): changing it
# changes the stored files, which the tests would flag.
ORDER_SEED = 20240601
# Random orders stored per suite, beyond 'canonical' and 'reversed'.
NUM_RANDOM = 8
ORDER_SUITES = ("builtin", "odinw_paper", "odinw13", "odinw35", "odinw13_zira")
ORDERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orders")


class OrderError(ConfigError):
  """An unknown, ambiguous or corrupted task order (the message names the file / value); a
  `ConfigError`, so `owl_cl.main` reports it without a traceback."""


def suite_datasets(suite: str) -> tuple[str, ...]:
  """The canonical dataset listing of one of `ORDER_SUITES`.

  Raises:
    OrderError: unknown suite.
  """
  if suite == "builtin":
    return tuple(builtin.DOWNSTREAM_NAMES)
  if suite == "odinw_paper":
    return tuple(odinw.ODINW_NAMES)
  if suite == "odinw13":
    return tuple(d.name for d in suites.ODINW13)
  if suite == "odinw35":
    return tuple(d.name for d in suites.ODINW35)
  if suite == "odinw13_zira":  # ODinW-13 as the IVLOD papers read it (docs/ivlod.md)
    return tuple(d.name for d in suites.ODINW13_ZIRA)
  raise OrderError(f"unknown order suite {suite!r}; known: {ORDER_SUITES}")


def generate_orders(
  suite: str, *, seed: int = ORDER_SEED, num_random: int = NUM_RANDOM
) -> dict[str, Any]:
  """The order file's contents of `suite` (module docstring), generated from `seed`.

  Args:
    suite: one of `ORDER_SUITES`.
    seed: seed of `np.random.default_rng`, one generator per suite.
    num_random: number of `random_<i>` orders.

  Returns:
    dict(suite, seed, num_random, datasets [D], orders {name: [D names]}) in file order.

  Raises:
    OrderError: unknown suite.
  """
  datasets = list(suite_datasets(suite))
  rng = np.random.default_rng(seed)
  orders = {"canonical": list(datasets), "reversed": datasets[::-1]}
  for i in range(num_random):
    orders[f"random_{i}"] = [datasets[j] for j in rng.permutation(len(datasets))]
  return dict(suite=suite, seed=seed, num_random=num_random, datasets=datasets, orders=orders)


def orders_path(suite: str) -> str:
  """`owl_cl/data/orders/<suite>.json`."""
  return os.path.join(ORDERS_DIR, f"{suite}.json")


def load_orders(suite: str) -> dict[str, Any]:
  """Reads and verifies a suite's stored order file.

  Returns:
    The file's dict (see `generate_orders`).

  Raises:
    OrderError: unknown suite, unreadable file, or a file whose `datasets` differ from the
      suite's listing or whose order is not a permutation of them (names file and order).
  """
  path = orders_path(suite)
  datasets = list(suite_datasets(suite))
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise OrderError(f"{path}: cannot read the task orders ({e})") from None
  if data.get("suite") != suite or data.get("datasets") != datasets:
    raise OrderError(
      f"{path}: field 'datasets' (suite {data.get('suite')!r}) is not the suite {suite!r}'s "
      f"listing {datasets}; regenerate with `python -m owl_cl.data.orders --write`."
    )
  for name, order in (data.get("orders") or {}).items():
    if sorted(order) != sorted(datasets):
      raise OrderError(f"{path}: order {name!r} is not a permutation of the suite's datasets")
  if not data.get("orders"):
    raise OrderError(f"{path}: field 'orders' is empty")
  return data


def _suite_of(names: Sequence[str]) -> str:
  names = set(names)
  exact = [s for s in ORDER_SUITES if set(suite_datasets(s)) == names]
  if exact:
    return exact[0]
  supersets = [s for s in ORDER_SUITES if names <= set(suite_datasets(s))]
  if len(supersets) == 1:
    return supersets[0]
  if not supersets:
    raise OrderError(
      f"config field 'task_order': the sequence {sorted(names)} is not within any suite with "
      f"stored orders ({', '.join(ORDER_SUITES)}); use sequence_seed or no order."
    )
  raise OrderError(
    f"config field 'task_order': the sequence {sorted(names)} lies in suites {supersets}; "
    "name one as '<suite>/<order>'."
  )


def resolve_order(task_order: str | int, sequence: Sequence[str]) -> dict[str, Any]:
  """The stored order `task_order` applied to a run's downstream datasets.

  Args:
    task_order: an order name ('canonical', 'random_3'), its index in the file (int or a
      string of digits), or '<suite>/<name or index>'.
    sequence: the run's downstream dataset names (any order).

  Returns:
    dict(suite, name, index, datasets: the sequence's names in the order's order [len(sequence)]).

  Raises:
    OrderError: unknown order or suite, an index out of range, a sequence in no suite (or in
      several, without '<suite>/'), or names outside the suite (each message names the value).
  """
  text = str(task_order).strip()
  suite, _, key = text.rpartition("/")
  suite = suite or _suite_of(sequence)
  data = load_orders(suite)
  missing = [n for n in sequence if n not in data["datasets"]]
  if missing:
    raise OrderError(
      f"config field 'task_order' = {text!r}: datasets {missing} are not in suite {suite!r}"
    )
  names = list(data["orders"])
  if key.isdigit():
    index = int(key)
    if index >= len(names):
      raise OrderError(
        f"config field 'task_order' = {text!r}: index {index} out of range, suite {suite!r} "
        f"stores {len(names)} orders ({', '.join(names)})"
      )
    name = names[index]
  elif key in names:
    name = key
  else:
    raise OrderError(
      f"config field 'task_order' = {text!r}: no order {key!r} in suite {suite!r} "
      f"(known: {', '.join(names)})"
    )
  keep = set(sequence)
  ordered = [n for n in data["orders"][name] if n in keep]
  return dict(suite=suite, name=name, index=names.index(name), datasets=ordered)


def format_orders(data: dict[str, Any]) -> str:
  """The stored text of an order file: one key per line, each order on one line."""
  head = [f"  {json.dumps(k)}: {json.dumps(data[k])}," for k in ("suite", "seed", "num_random")]
  head.append(f'  "datasets": {json.dumps(data["datasets"])},')
  orders = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in data["orders"].items()]
  return "\n".join(["{", *head, '  "orders": {', ",\n".join(orders), "  }", "}"]) + "\n"


def task_order_problem(value: Any) -> str:
  """The config rule of `task_order`: '' when None or a name / index / '<suite>/<key>' that
  some stored suite has, else what is wrong (the sequence is checked by `resolve_order`)."""
  if value is None:
    return ""
  if isinstance(value, bool) or not isinstance(value, (str, int)):
    return "must be an order name, an index or '<suite>/<order>' (a str), or None"
  suite, _, key = str(value).strip().rpartition("/")
  if suite and suite not in ORDER_SUITES:
    return f"names an unknown suite {suite!r} (known: {', '.join(ORDER_SUITES)})"
  for s in [suite] if suite else ORDER_SUITES:
    names = list(load_orders(s)["orders"])
    if key in names or (key.isdigit() and int(key) < len(names)):
      return ""
  return f"is no stored order (names: {', '.join(names)}, or their index)"


def _main(argv: Sequence[str] | None = None) -> int:
  import argparse

  parser = argparse.ArgumentParser(
    prog="python -m owl_cl.data.orders", description="Check or (re)write the stored task orders."
  )
  parser.add_argument("--write", action="store_true", help="rewrite owl_cl/data/orders/*.json")
  args = parser.parse_args(argv)
  status = 0
  for suite in ORDER_SUITES:
    text = format_orders(generate_orders(suite))
    path = orders_path(suite)
    if args.write:
      os.makedirs(ORDERS_DIR, exist_ok=True)
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
      os.replace(path + ".tmp", path)
      print(f"wrote {path}")
    else:
      same = False
      if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
          same = f.read() == text
      print(f"{path}: {'up to date' if same else 'DIFFERS from generate_orders'}")
      status |= not same
  return status


if __name__ == "__main__":
  raise SystemExit(_main())

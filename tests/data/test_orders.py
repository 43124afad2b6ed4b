"""Stored task orders (owl_cl/data/orders): the files, their resolution and their application."""

import json

import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl.data import orders
from owl_cl.testing.configs import tiny_config


@pytest.mark.parametrize("suite", orders.ORDER_SUITES)
def test_stored_orders_equal_regenerated_and_are_permutations(suite):
  with open(orders.orders_path(suite), encoding="utf-8") as f:
    text = f.read()
  generated = orders.generate_orders(suite)
  assert json.loads(text) == generated
  assert text == orders.format_orders(generated)  # byte for byte: the files are the generator's
  data = orders.load_orders(suite)
  assert data["seed"] == orders.ORDER_SEED
  assert len(data["orders"]) == 2 + orders.NUM_RANDOM
  listing = list(orders.suite_datasets(suite))
  assert data["datasets"] == listing
  assert data["orders"]["canonical"] == listing
  assert data["orders"]["reversed"] == listing[::-1]
  for order in data["orders"].values():
    assert sorted(order) == sorted(listing) and len(set(order)) == len(listing)
  # random_i is the i-th draw of one generator seeded with ORDER_SEED (independent of the
  # listing's names: a permutation of indices).
  rng = np.random.default_rng(orders.ORDER_SEED)
  for i in range(orders.NUM_RANDOM):
    assert data["orders"][f"random_{i}"] == [listing[j] for j in rng.permutation(len(listing))]


def test_suite_sizes():
  assert [len(orders.suite_datasets(s)) for s in orders.ORDER_SUITES] == [7, 15, 13, 35, 13]


def test_resolve_by_name_index_suite_and_subset():
  stored = orders.load_orders("builtin")["orders"]
  full = list(orders.suite_datasets("builtin"))
  got = orders.resolve_order("random_2", full[::-1])
  assert got == dict(suite="builtin", name="random_2", index=4, datasets=stored["random_2"])
  assert orders.resolve_order("4", full) == got
  assert orders.resolve_order(4, full) == got
  assert orders.resolve_order("builtin/random_2", full) == got
  # A subset follows the order restricted to it, whatever order it comes in.
  sub = ["tiny", "thermal", "glyphs"]
  expected = [n for n in stored["reversed"] if n in sub]
  assert expected == ["glyphs", "tiny", "thermal"]
  assert orders.resolve_order("reversed", sub)["datasets"] == expected
  assert orders.resolve_order("reversed", sorted(sub))["datasets"] == expected
  # ODinW-13's 13 names are also in ODinW-35: the exact suite wins.
  odinw13 = list(orders.suite_datasets("odinw13"))
  assert orders.resolve_order("canonical", odinw13)["suite"] == "odinw13"
  assert orders.resolve_order("odinw35/canonical", odinw13)["suite"] == "odinw35"


def test_resolve_refusals():
  full = list(orders.suite_datasets("builtin"))
  with pytest.raises(orders.OrderError, match="no order 'random_99' in suite 'builtin'"):
    orders.resolve_order("random_99", full)
  with pytest.raises(orders.OrderError, match="index 10 out of range"):
    orders.resolve_order("10", full)
  with pytest.raises(orders.OrderError, match="not within any suite"):
    orders.resolve_order("canonical", ["thermal", "Pothole"])
  # WildfireSmoke is in the paper's 15 and in ODinW-35: ambiguous without '<suite>/'.
  with pytest.raises(orders.OrderError, match="name one as '<suite>/<order>'"):
    orders.resolve_order("canonical", ["WildfireSmoke"])
  assert orders.resolve_order("odinw_paper/canonical", ["WildfireSmoke"])["suite"] == "odinw_paper"
  with pytest.raises(orders.OrderError, match=r"datasets \['thermal'\] are not in suite"):
    orders.resolve_order("odinw13/canonical", ["thermal"])


def test_task_order_rule():
  assert orders.task_order_problem(None) == ""
  assert orders.task_order_problem("random_0") == ""
  assert orders.task_order_problem("9") == ""
  assert orders.task_order_problem("odinw35/reversed") == ""
  assert "no stored order" in orders.task_order_problem("random_99")
  assert "no stored order" in orders.task_order_problem("10")
  assert "unknown suite 'coco'" in orders.task_order_problem("coco/canonical")
  assert "must be an order name" in orders.task_order_problem(1.5)


def test_corrupted_order_file_is_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(orders, "ORDERS_DIR", str(tmp_path))
  data = orders.generate_orders("builtin")
  data["orders"]["random_0"][0] = data["orders"]["random_0"][1]  # a repeated name
  (tmp_path / "builtin.json").write_text(orders.format_orders(data))
  with pytest.raises(orders.OrderError, match="order 'random_0' is not a permutation"):
    orders.load_orders("builtin")
  (tmp_path / "builtin.json").write_text("{")
  with pytest.raises(orders.OrderError, match="builtin.json: cannot read"):
    orders.load_orders("builtin")


def test_load_benchmark_follows_the_stored_order(tmp_path):
  config = tiny_config("uniform", str(tmp_path))  # built-in datasets ('thermal', 'digits')
  config.sequence_seed = 3  # replaced by the stored order
  config.task_order = "random_4"
  bench = benchmark.load_benchmark(config)
  stored = orders.load_orders("builtin")["orders"]["random_4"]
  expected = [n for n in stored if n in ("thermal", "digits")]
  assert [d.name for d in bench.sequence] == expected == ["digits", "thermal"]
  assert bench.task_order == dict(suite="builtin", name="random_4", index=6, datasets=expected)
  config.task_order = "canonical"
  bench = benchmark.load_benchmark(config)
  assert [d.name for d in bench.sequence] == ["thermal", "digits"]
  config.task_order = None
  assert benchmark.load_benchmark(config).task_order is None

"""owl_cl.analysis.protection: factor 3's protective effect on the named classes, from per-class
AP, paired across runs (issue 49 item 2)."""

import os

import pytest

from owl_cl.analysis import protection
from owl_cl.data.builtin import vocabulary as V
from owl_cl.eval import results as results_lib

NAMES = V.pretrain_class_names()
# negative's named classes (vocabulary.interference(), docs/experiments.md factor 3).
NAMED = ("red dotted", "brown dotted")


def per_class(named_lost=0.0, others_lost=0.0):
  """{class: {'AP'}} of the pre-training set: AP 0.5 minus the points lost (named / others)."""
  return {
    c: {"category_id": k, "AP": 0.5 - (named_lost if c in NAMED else others_lost) / 100}
    for k, c in enumerate(NAMES)
  }


def write_run(root, algorithm, seed, named_lost, others_lost, status="complete", classes=True):
  """A run of the sequence negative -> digits: stage 0 and the final stage evaluate the
  pre-training set ('pretrain_val'), the middle stage only the dataset."""
  workdir = os.path.join(root, f"{algorithm}_{seed}")
  stages = [
    {"name": "pretrained", "metrics": {"pretrain_val": {"AP": 0.5}}},
    {"name": "negative", "metrics": {"negative": {"AP": 0.3}}},
    {"name": "digits", "metrics": {"pretrain_val": {"AP": 0.4}}},
  ]
  if classes:
    stages[0]["per_class"] = {"pretrain_val": per_class()}
    # A stage whose per-class AP does not cover the pre-training set is passed over.
    stages[1]["per_class"] = {"negative": {"dotted sticker": {"category_id": 1, "AP": 0.3}}}
    stages[2]["per_class"] = {"pretrain_val": per_class(named_lost, others_lost)}
  results_lib.write_results(
    workdir,
    {
      "run_id": f"{algorithm}_{seed}",
      "algorithm": algorithm,
      "status": status,
      "seeds": {"model": 0, "data": seed, "retrieval": seed},
      "sequence": ["negative", "digits"],
      "eval_sets": {"pretrain": "pretrain_val", "downstream": ["negative", "digits"]},
      "stages": stages,
    },
  )
  return workdir


def test_class_forgetting_hand_worked(tmp_path):
  assert V.interference()[1].dataset == "negative" and V.interference()[1].pretrain_classes == NAMED
  run = results_lib.load_results(write_run(tmp_path, "uniform", 0, 10.0, 4.0))
  forgetting = protection.class_forgetting(run)
  # digits interferes with nothing; the other interfering datasets are not in the sequence.
  assert list(forgetting) == ["negative"]
  # 100 * (0.5 - (0.5 - x / 100)) differs from x by float64 rounding (1e-15 relative).
  assert forgetting["negative"]["named"] == pytest.approx(10.0, rel=1e-12)
  assert forgetting["negative"]["others"] == pytest.approx(4.0, rel=1e-12)
  # A run written before per-class AP was recorded has none (and still loads).
  old = results_lib.load_results(write_run(tmp_path, "uniform", 9, 0, 0, classes=False))
  assert protection.class_forgetting(old) == {}


def test_paired_protective_effect_hand_worked(tmp_path):
  # (named, others) points lost per seed: uniform (the reference) and swil.
  uniform = {0: (10.0, 5.0), 1: (12.0, 5.0), 2: (14.0, 5.0)}
  swil = {0: (7.0, 4.0), 1: (8.0, 6.0), 2: (11.0, 3.0)}
  dirs = [write_run(tmp_path, "uniform", s, *v) for s, v in uniform.items()]
  dirs += [write_run(tmp_path, "swil", s, *v) for s, v in swil.items()]
  # Left out: an unpaired seed, a running run, runs without per-class AP.
  dirs.append(write_run(tmp_path, "swil", 3, 0.0, 0.0))
  dirs.append(write_run(tmp_path, "uniform", 4, 0.0, 0.0, status="running"))
  dirs.append(write_run(tmp_path, "swil", 4, 50.0, 0.0))
  dirs += [write_run(tmp_path, a, 5, 0.0, 0.0, classes=False) for a in ("uniform", "swil")]
  table = protection.build_table(dirs, reference="uniform")
  assert table["reference"] == "uniform" and list(table["rows"]) == ["swil"]
  cell = table["rows"]["swil"]["negative"]
  # Named: uniform's forgetting minus swil's per seed: 3, 4, 3 points.
  assert cell["named"]["n"] == 3
  assert cell["named"]["mean"] == pytest.approx(10 / 3, rel=1e-12)
  # Beyond the other classes: (10-5) - (7-4) = 2, (12-5) - (8-6) = 5, (14-5) - (11-3) = 1.
  assert cell["beyond_others"]["mean"] == pytest.approx(8 / 3, rel=1e-12)
  # One comparison in the family: Holm leaves its p-value as it is.
  assert cell["named"]["p_holm"] == pytest.approx(cell["named"]["p"], rel=1e-12)
  assert 0.0 < cell["named"]["p"] < 1.0
  md = protection.render_markdown(table).splitlines()
  assert md[2] == (
    "| algorithm | `negative`: red dotted / brown dotted | `negative` beyond others |"
  )
  assert md[4].startswith("| swil | 3.33 ± ") and "(n = 3), p " in md[4]


def test_no_reference_or_no_per_class_gives_an_empty_table(tmp_path):
  dirs = [write_run(tmp_path, "swil", 0, 1.0, 1.0)]
  assert protection.build_table(dirs)["rows"] == {}
  assert protection.render_markdown({"reference": "uniform", "rows": {}}).startswith("No pairs")


def test_cli_writes_the_table(tmp_path, capsys):
  for algorithm, lost in (("uniform", 10.0), ("swil", 7.0)):
    for seed in (0, 1):
      write_run(tmp_path / "runs", algorithm, seed, lost + seed, 5.0)
  out = tmp_path / "table.md"
  assert protection.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
  assert out.read_text() == capsys.readouterr().out
  # A constant 3-point difference: no spread (t infinite, p 0).
  assert "| swil | 3.00 ± 0.00 (n = 2), p 0.000 |" in out.read_text()
  assert protection.main([str(tmp_path / "missing")]) == 2
  assert "no such folder" in capsys.readouterr().err

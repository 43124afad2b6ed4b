"""owl_cl.analysis.interference: the named classes' share of the class-step replays."""

import math
import os

import numpy as np
import pytest

from owl_cl.analysis import interference
from owl_cl.data.builtin import vocabulary as V
from owl_cl.eval import results as results_lib
from owl_cl.replay import records as records_lib

NAMES = V.pretrain_class_names()


def write_run(root, name, algorithm, counts_by_dataset, status="complete"):
  """A workdir with results.json and records/<dataset>.npz whose sampled_class_counts are
  {class name: count} (others 0)."""
  workdir = os.path.join(root, name)
  results_lib.write_results(
    workdir,
    {
      "run_id": name,
      "algorithm": algorithm,
      "status": status,
      "stages": [{"name": "pretrained", "metrics": {}}],
    },
  )
  os.makedirs(os.path.join(workdir, "records"))
  for dataset, by_class in counts_by_dataset.items():
    records = records_lib.RetrievalRecords(len(NAMES))
    for cls, n in by_class.items():
      records.sampled_class_counts[NAMES.index(cls)] = n
    records.save(os.path.join(workdir, "records", f"{dataset}.npz"))
  return workdir


def test_shares_hand_worked(tmp_path):
  # thermal's named classes: yellow striped, purple striped (vocabulary.interference()).
  assert V.interference()[0].dataset == "thermal"
  assert V.interference()[0].pretrain_classes == ("yellow striped", "purple striped")
  a = write_run(
    tmp_path,
    "swil_0",
    "swil",
    {"thermal": {"yellow striped": 3, "purple striped": 1, "blue plain": 4}, "digits": {}},
  )
  b = write_run(
    tmp_path, "swil_1", "swil", {"thermal": {"yellow striped": 1, "red plain": 1, "red dotted": 2}}
  )
  write_run(tmp_path, "swil_2", "swil", {"thermal": {"yellow striped": 9}}, status="running")
  # 4 of 8 replays, 1 of 4; digits interferes with nothing and has no class steps.
  assert interference.named_class_shares(a) == {"thermal": 50.0}
  assert interference.named_class_shares(b) == {"thermal": 25.0}
  table = interference.build_table([a, b, str(tmp_path / "swil_2")])  # the running run: out
  cell = table["swil"]["thermal"]
  half = 12.71 * np.std([50.0, 25.0], ddof=1) / math.sqrt(2)  # t_{0.975, 1} = 12.71 (table)
  assert cell["n"] == 2 and cell["mean"] == 37.5
  assert cell["half_width"] == pytest.approx(half, rel=1e-3)
  md = interference.render_markdown(table)
  assert md.splitlines()[0] == "| algorithm | `thermal`: yellow striped / purple striped |"
  assert md.splitlines()[2] == f"| swil | 37.5 ± {cell['half_width']:.1f} (n = 2) |"


def test_a_records_file_of_other_classes_is_named(tmp_path):
  workdir = write_run(tmp_path, "x", "swil", {})
  path = os.path.join(workdir, "records", "thermal.npz")
  records_lib.RetrievalRecords(7).save(path)
  with pytest.raises(ValueError, match="thermal.npz: sampled_class_counts has shape"):
    interference.named_class_shares(workdir)


def test_cli_writes_the_table(tmp_path, capsys):
  write_run(tmp_path, "a", "swil", {"negative": {"red dotted": 1, "brown dotted": 1}})
  out = tmp_path / "table.md"
  assert interference.main([str(tmp_path), "--out", str(out)]) == 0
  assert out.read_text() == capsys.readouterr().out
  assert "| swil | 100.0 (n = 1) |" in out.read_text()
  (tmp_path / "empty").mkdir()
  assert interference.main([str(tmp_path / "empty")]) == 2
  assert "no results.json below" in capsys.readouterr().err

"""configs/ivlod_odinw13.py's protocol end to end on generated ODinW-13-shaped data: the 13
datasets in ZiRa's folders (tiny images, 2 steps each), COCO val 2017 as the zero-shot set,
the tiny model and the built-in pre-training / held-out sets."""

import importlib
import json
import os

import pytest

from owl_cl import experiment
from owl_cl.data import orders
from owl_cl.data import suites
from owl_cl.testing import fake_data
from owl_cl.testing.configs import tiny_config


# 13 stages of 2 steps, evaluated, checkpointed: 84 s user + 7 s sys CPU for the test file
# (its 90 s session fixture included; 2 shared cores at load average 18, 5 min wall).
@pytest.mark.slow
def test_ivlod_protocol_runs_and_reports(pretrained_cache_dir, tmp_path):
  ivlod = importlib.import_module("configs.ivlod_odinw13")
  root = str(tmp_path / "data")
  fake_data.write_fake_glip(
    root, "odinw13", num_images=dict(train=2, test=1), image_size=(16, 24), variant="zira"
  )
  fake_data.write_fake_coco2017(root, "val", num_images=2, image_size=(16, 24))
  config = tiny_config("no_replay", pretrained_cache_dir)
  # The 13 datasets' train steps lower to one program: 12 come from the compilation cache.
  config.compilation_cache_dir = str(tmp_path / "xla")
  ivlod.apply_ivlod(config, "zira", root=root, steps=(2,) * 13)
  config.train.batch_size = 2
  config.max_train_steps_per_dataset = None  # the protocol's budgets: 2 steps per task
  config.eval.downstream_after_each_dataset = "seen"
  results = experiment.run(config, str(tmp_path / "run"))

  names = [d.name for d in suites.ODINW13_ZIRA]
  assert results["status"] == "complete"
  assert results["sequence"] == orders.load_orders("odinw13_zira")["orders"]["canonical"] == names
  assert results["task_order"]["suite"] == "odinw13_zira"
  for stage in results["stages"][1:]:
    assert stage["train"]["steps"] == 2 and stage["train"]["settings"]["num_steps"] == 2
  first, last = results["stages"][0], results["stages"][-1]
  assert (
    set(first["metrics"])
    == set(last["metrics"])
    == {
      "pretrain_val",
      "held_out",
      "coco_val2017",
      *names,
    }
  )
  assert first["metrics"]["coco_val2017"]["num_images"] == 2
  # The block holds the stages' values: Avg is the mean of the 13 final APs, ZCOCO the COCO
  # set's AP (fractions, rounded by JSON to the same float64).
  with open(tmp_path / "run" / "results.json") as f:
    on_disk = json.load(f)
  block = on_disk["ivlod"]
  assert block["zero_shot_set"] == "coco_val2017" and block["lvis_set"] is None
  final = block["rows"]["final"]
  aps = [last["metrics"][n]["AP"] for n in names]
  assert final["per_dataset"] == dict(zip(names, aps, strict=True))
  assert abs(final["Avg"] - sum(aps) / 13) <= 1e-12  # 13 values in [0, 1]: float64 sums
  assert final["ZCOCO"] == last["metrics"]["coco_val2017"]["AP"]
  with open(os.path.join(tmp_path, "run", "results.md")) as f:
    assert "## IVLOD (ZiRa, DitHub): AP (%) after stage `thermalDogsAndPeople`" in f.read()

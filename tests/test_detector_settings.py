"""Issue 47: the run's consumers read the typed settings the `Detector` converts once at
construction (`Detector.run`, `.train_spec`, `.replay_spec`, ...), never its ConfigDict.

The source check (`config_reads`, on `ast`) fails when a module of `owl_cl/` reads `.config`
of a Detector or of the experiment's session outside `BOUNDARY`; the other tests show the
consumers that used to read it (the replay setup, the pre-trained model's cache entry, the
experiment's results) take what was converted at construction, with the same values and
cache keys.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import types

import pytest

from owl_cl import pretrained
from owl_cl.config_fields import ConfigError
from owl_cl.detector import Detector
from owl_cl.replay import setup as replay_setup
from owl_cl.testing.configs import tiny_detector_config
from owl_cl.train.spec import LossSpec

REPO = pathlib.Path(__file__).resolve().parent.parent

# The names a Detector (or the experiment's `_Session`, which holds one) goes by in owl_cl's
# modules: `detector.config`, `self.detector.config`, `session.config` are reads of its config.
HOLDERS = ("detector", "session")
# Classes whose own `self.config` is a Detector's or a session's ConfigDict.
HOLDER_CLASSES = ("Detector", "_Session")

# Reads of a Detector's / a session's ConfigDict allowed ('<file>:<line text>' -> reason):
# only where the config is written out (run.json, results.json's "config", provenance) or
# converted. None remain: the experiment converts its `config` argument at its boundary
# (`experiment.run`, `_open_session`), never a held one.
BOUNDARY: dict[str, str] = {}
# The text of every module `config_reads` can find a read in (a superset of them).
_MAY_READ = re.compile(r"\b(?:" + "|".join(HOLDERS) + r"|self)\s*\.\s*config\b")


def config_reads(source: str) -> list[str]:
  """The reads of `.config` of a Detector or a session in a module's `source`: each as
  'line <n>: <expression>' (`ast.unparse`), in source order. A read is an attribute
  `config` loaded (not assigned) from a name or attribute in `HOLDERS`, or `self.config`
  inside a class of `HOLDER_CLASSES`; a model's `model.config` or `jax.config` is not one."""
  found = []

  def visit(node: ast.AST, in_holder: bool) -> None:
    for child in ast.iter_child_nodes(node):
      holder = in_holder
      if isinstance(child, ast.ClassDef):
        holder = child.name in HOLDER_CLASSES
      if (
        isinstance(child, ast.Attribute)
        and child.attr == "config"
        and isinstance(child.ctx, ast.Load)
      ):
        base = child.value
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if name in HOLDERS or (in_holder and name == "self" and isinstance(base, ast.Name)):
          found.append(f"line {child.lineno}: {ast.unparse(child)}")
      visit(child, holder)

  visit(ast.parse(source), False)
  return found


def test_the_check_finds_the_reads_it_is_for_and_nothing_else():
  source = (
    "def f(detector, model):\n"
    "  a = detector.config.train.batch_size\n"  # line 2: a read
    "  b = model.config.image_size\n"  # a model's own config: not one
    "  jax.config.update('x', 1)\n"  # not one
    "  return self.detector.config\n"  # line 5: a read
    "class _Session:\n"
    "  def g(self):\n"
    "    return self.config.seed, session.config\n"  # line 8: two reads
    "class Detector:\n"
    "  def __init__(self, config):\n"
    "    self.config = config\n"  # assigned, not read
    "class Other:\n"
    "  def h(self):\n"
    "    return self.config\n"  # another class's own config: not one
  )
  assert config_reads(source) == [
    "line 2: detector.config",
    "line 5: self.detector.config",
    "line 8: self.config",
    "line 8: session.config",
  ]


def test_no_module_reads_a_detectors_or_a_sessions_config():
  found = {}
  for path in sorted((REPO / "owl_cl").rglob("*.py")):
    name = str(path.relative_to(REPO))
    text = path.read_text()
    if not _MAY_READ.search(text):  # most modules: not parsed (the check stays under a second)
      continue
    lines = text.splitlines()
    for read in config_reads(text):
      number = int(read.split(":")[0].split()[1])
      key = f"{name}:{lines[number - 1].strip()}"
      if key not in BOUNDARY:
        found[key] = read
  assert found == {}, "read the Detector's typed settings instead (docs/extending.md)"
  assert all(len(why.split()) >= 3 for why in BOUNDARY.values()), "each entry says why"


def test_a_bad_replay_field_is_one_line_at_the_detectors_construction():
  with pytest.raises(ConfigError, match=r"config\.replay\.ratio=-1\.0"):
    Detector(tiny_detector_config(**{"replay.ratio": -1.0}))


def test_the_replay_reads_the_settings_converted_at_construction():
  """`Replay` and `build_options` read the detector's typed settings: a later change of the
  ConfigDict does not reach them (main's code read `detector.config` and took it)."""
  config = tiny_detector_config(
    **{"replay.algorithm": "uniform", "replay.ratio": 0.5, "train.batch_size": 4}
  )
  config.seed, config.data.num_workers = 3, 1
  detector = Detector(config)
  config.replay.ratio, config.train.batch_size, config.seed = 1.0, 8, 9
  config.data.eval_batch_size, config.data.num_workers = 6, 5
  store = types.SimpleNamespace(num_classes=2)
  assert replay_setup.Replay(detector, store, None).num_replay == 2  # round(0.5 * 4)
  source = types.SimpleNamespace(class_names=["a", "b"], annotation_file="a.json")
  options = replay_setup.build_options(detector, source)
  assert (options["buffer_spec"].seed, options["batch_size"], options["num_workers"]) == (3, 2, 1)


def test_the_per_image_loss_options_are_the_loss_sections_fields():
  """`LossSpec.per_image_options` (the buffer selection's and the loss adaptivity's
  `detection_loss` options), written out by hand: every field but the normalisation, and the
  objectness weight only for OWLv2 (v1's options, digested into the build manifests, unchanged
  from the hand-kept dict they replace)."""
  v1 = {
    "focal_alpha": 0.25,
    "focal_gamma": 2.0,
    "class_weight": 1.0,
    "bbox_weight": 1.0,
    "giou_weight": 1.0,
    "matcher": "auto",
  }
  detector = Detector(tiny_detector_config(**{"loss.focal_alpha": 0.25}))
  assert detector.loss_options == v1
  assert detector.loss_spec.per_image_options("owlv2") == dict(v1, objectness_weight=0.0)
  # A weight field added to the section (docs/extending.md, "A loss term") is one of them.
  spec_cls = dataclasses.make_dataclass(
    "CountLossSpec", [("count_weight", float, 0.0)], bases=(LossSpec,), frozen=True
  )
  assert spec_cls(count_weight=0.5).per_image_options("v1") == dict(
    v1, focal_alpha=0.3, count_weight=0.5
  )


def test_the_pretrained_cache_entry_is_the_configs_key_from_the_typed_settings(tmp_path):
  """`pretrained.cache_entry` keys the model from the detector's specs: the same key as
  `cache_key` of the config at construction (the disk key unchanged), and a later change of
  the ConfigDict changes neither it nor the entry's folder."""
  annotations = tmp_path / "train.json"
  annotations.write_text('{"images": []}')
  config = tiny_detector_config()
  config.cache_dir = str(tmp_path / "cache")
  detector = Detector(config)
  bench = types.SimpleNamespace(
    pretrain=types.SimpleNamespace(train=types.SimpleNamespace(annotation_file=str(annotations)))
  )
  path, key = pretrained.cache_entry(detector, bench)
  expected = pretrained.cache_key(
    config,
    detector.model_spec,
    resize_method=detector.resize_method,
    pretrain_data=pretrained.file_digest(str(annotations)),
  )
  assert key == expected and path == str(tmp_path / "cache" / "pretrained" / key)
  config.seed, config.loss.giou_weight, config.cache_dir = 5, 2.0, str(tmp_path / "other")
  assert pretrained.cache_entry(detector, bench) == (path, key)
  # Had the entry read the config, the key would have changed (the seed and loss are keyed).
  changed = pretrained.cache_key(
    config,
    detector.model_spec,
    resize_method=detector.resize_method,
    pretrain_data=pretrained.file_digest(str(annotations)),
  )
  assert changed != key

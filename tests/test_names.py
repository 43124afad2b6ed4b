"""No algorithm name, model field or config path is written by hand in more than one place.

Issue 47's done-when, checked on the source: the string literals of the package (less the
config files users edit, `owl_cl/configs/<name>.py` and `owl_cl/configs/examples/`),
launch/*.py and benchmarks/*.py, and the words of benchmarks/*.sh.

* An algorithm name (the retrieval registry's, `configs.BASELINES`, `configs.PROTOCOLS`) may
  be written at its one definition site (the registry's table or a `register(...)` call, the
  `BASELINES` / `PROTOCOLS` tables) or where `ALGORITHM_NAMES_ALLOWED` says why.
* A list of `ModelConfig` field names (a tuple, list or set display naming two or more of
  them) may be written only where `MODEL_FIELD_LISTS_ALLOWED` says why: the fields and their
  rules are `variants.ModelConfig`'s.
* A dotted config path (`'train.batch_size'`, `'config.data.eval_batch_size'`) must name a
  field of `config_rules.SECTION_SPECS` and be listed, with its reason, in
  `CONFIG_PATHS_ALLOWED`.

Every allow-list entry must still match a literal (a stale entry fails), so the lists stay
the record of what is written by hand and why.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import os
import re

from owl_cl import config_rules
from owl_cl import config_spec
from owl_cl import configs
from owl_cl.model import variants
from owl_cl.replay.retrieval import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- the reasons, one per kind of hand-written name
_SCHEDULE = "a train.schedule value (config_fields.SCHEDULES); the baseline is named after it"
_SECTION = "the train.<name> config section or term the baseline turns on, named alike"
_WEIGHTING = (
  "a replay.within_class_weighting value (steps.WITHIN_CLASS_WEIGHTINGS), not the algorithm"
)
_EXAMPLE = "one algorithm to run as an example or default; any registry name would do"
_REFERENCE = "the algorithm the paired comparisons are made against (a default the user can change)"
_NUMPY = (
  "benchmarks/retrieval.py's NUMPY_REFERENCES: the NumPy maths paired with each registry name"
)
_DESIGN = "the first design's record: the rows it ran, fixed before its runs"
_MESSAGE = "names the field in an error message"
_CLAIM = "a confirmatory claim of the round-2 design names the algorithms it compares"
# The nine of paper Table 2 (the registry's built-in ones), as benchmarks/retrieval.py's
# NumPy references and the first sweep script name them.
_NUMPY_NAMES = ("uniform", "uniform_balanced", "grasp", "swil", "sw_grasp", "a_sw_grasp")
_NUMPY_NAMES += ("aser", "aser_pc", "sw_aser_pc")

# (path, literal) -> why it is written here.
# (path, scope, literal) -> why it is written there; scope: the top-level function, class or
# assigned name holding it (`_scope`), '' for a shell script's words.
ALGORITHM_NAMES_ALLOWED = {
  **{
    ("benchmarks/retrieval.py", "NUMPY_REFERENCES", name): _NUMPY
    for name in (*_NUMPY_NAMES, "forgetting_aware", "sw_forgetting_aware")
  },
  ("benchmarks/buffer.py", "child", "swil"): _EXAMPLE,
  ("benchmarks/protocol_gpu.py", "main", "swil"): _EXAMPLE,
  ("benchmarks/owlv2_builtin.sh", "", "swil"): _EXAMPLE,
  ("owl_cl/testing/reproduction.py", "reference_config", "swil"): _EXAMPLE
  + " (the committed run's)",
  ("owl_cl/replay/spec.py", "_ReplayHead", "swil"): "replay.algorithm's default",
  ("benchmarks/step.py", "lora_arithmetic", "lora"): _SECTION + " (its LoRA rows' results key)",
  ("benchmarks/step.py", "render_lora", "lora"): _SECTION + " (its LoRA rows' results key)",
  ("benchmarks/step.py", "render_markdown", "lora"): _SECTION + " (its LoRA rows' results key)",
  ("benchmarks/step.py", "main", "lora"): _SECTION + " (its LoRA rows' results key)",
  ("benchmarks/gpu_session.sh", "", "lora"): "step.py's --skip-lora option",
  ("owl_cl/analysis/claims.py", "ROUND2", "uniform"): _REFERENCE,
  **{
    ("owl_cl/analysis/claims.py", "ROUND2", n): _CLAIM
    for n in ("uniform_balanced", "swil", "sw_grasp")
  },
  ("owl_cl/analysis/protection.py", "build_table", "uniform"): _REFERENCE,
  ("owl_cl/analysis/protection.py", "main", "uniform"): _REFERENCE,
  ("owl_cl/analysis/report.py", "build_report", "uniform"): _REFERENCE,
  ("owl_cl/analysis/report.py", "_per_set", "per_task"): _SCHEDULE,
  ("owl_cl/config_fields.py", "SCHEDULES", "joint"): _SCHEDULE + " (their definition)",
  ("owl_cl/config_fields.py", "SCHEDULES", "per_task"): _SCHEDULE + " (their definition)",
  ("owl_cl/eval/results.py", "_forgetting", "per_task"): _SCHEDULE,
  ("owl_cl/eval/results.py", "_summary", "joint"): _SCHEDULE,
  ("owl_cl/eval/table3.py", "final_stage", "per_task"): _SCHEDULE,
  ("owl_cl/eval/table3.py", "own_task_summary", "joint"): _SCHEDULE,
  ("owl_cl/eval/table3.py", "per_task_stage", "per_task"): _SCHEDULE,
  ("owl_cl/experiment.py", "_Session", "joint"): _SCHEDULE,
  ("owl_cl/experiment.py", "_Session", "per_task"): _SCHEDULE,
  ("owl_cl/experiment.py", "_run", "per_task"): _SCHEDULE,
  ("owl_cl/experiment.py", "stage_eval_sets", "joint"): _SCHEDULE,
  ("owl_cl/experiment.py", "stage_eval_sets", "per_task"): _SCHEDULE,
  ("owl_cl/experiment.py", "stage_names", "joint"): _SCHEDULE,
  ("owl_cl/validation.py", "schedule_problem", "joint"): _SCHEDULE,
  ("owl_cl/train/wise_ft.py", "blends_after", "per_task"): _SCHEDULE,
  ("owl_cl/phases.py", "JOINT", "joint"): "the joint phase's name, from train.schedule's value",
  ("owl_cl/trainer.py", "train_joint", "joint"): "the joint phase's summary key (phases.JOINT)",
  ("owl_cl/detector.py", "lora_problem", "lora"): _SECTION,
  ("owl_cl/detector.py", "lora_problem", "lwf"): _SECTION,
  ("owl_cl/model/convert/cli.py", "_cmd_lora", "lora"): _SECTION,
  ("owl_cl/train/step.py", "STEP_TERMS", "lwf"): _SECTION + " (the train step's term)",
  ("owl_cl/train/optim.py", "FROZEN_PRESETS", "heads_only"): "a train.frozen preset's name",
  ("owl_cl/replay/retrieval/steps.py", "WITHIN_CLASS_WEIGHTINGS", "uniform"): _WEIGHTING,
  ("owl_cl/replay/retrieval/steps.py", "WITHIN_CLASS_WEIGHTINGS", "grasp"): _WEIGHTING,
  ("owl_cl/replay/retrieval/spec.py", "RetrievalSpec", "uniform"): _WEIGHTING,
  ("owl_cl/replay/retrieval/adaptive.py", "AdaptiveSwGraspAlgorithm", "uniform"): _WEIGHTING,
  ("owl_cl/replay/retrieval/adaptive.py", "AdaptiveSwGraspAlgorithm", "grasp"): _WEIGHTING,
  ("owl_cl/replay/retrieval/asv.py", "AsvAlgorithm", "uniform"): _WEIGHTING,
  ("owl_cl/replay/retrieval/asv.py", "AsvAlgorithm", "grasp"): _WEIGHTING,
  **{
    ("launch/designs.py", "BUILTIN", name): _DESIGN
    for name in (*_NUMPY_NAMES, "no_replay", "joint", "per_task", "lwf", "heads_only", "lora")
  },
  ("launch/designs.py", "Design", "uniform"): _REFERENCE,
  ("launch/designs.py", "WISE_FT", "wise_ft"): "the WiSE-FT baseline's config, whose alphas the "
  "second design's curve rows expand",
  ("launch/designs.py", "COMPOSED", "swil"): "the replay the second design composes with WiSE-FT "
  "(docs/design_round2.md)",
}

# (path, first field of the list) -> why.
MODEL_FIELD_LISTS_ALLOWED = {
  ("owl_cl/model/convert/openai_clip.py", "context_length"): (
    "OpenAI CLIP state-dict keys that happen to share the fields' names"
  ),
}

# literal -> why (every one must name a field of a spec).
CONFIG_PATHS_ALLOWED = {
  "config.data.train_prompt_templates": _MESSAGE,
  "config.eval.prompt_templates": _MESSAGE,
  "config.data.eval_batch_size": _MESSAGE,
  "config.pretrain.batch_size": _MESSAGE,
  "config.train.batch_size": _MESSAGE,
  "train.wise_ft": "the section's prefix for config_spec.from_config (its messages)",
  "pretrain.batch_size": "validation.DEVICE_SPLIT_FIELDS: split over the devices, no spec says so",
  "train.batch_size": "validation.DEVICE_SPLIT_FIELDS: split over the devices, no spec says so",
  "data.builtin.version": "the built-in benchmark's version, compared across a report's runs",
  "train.schedule": "analysis.report's method-defining fields (the composed method's name)",
  "train.lwf": "analysis.report's method-defining fields (the composed method's name)",
  "train.frozen": "analysis.report's method-defining fields (the composed method's name)",
  "train.lora": "analysis.report's method-defining fields (the composed method's name)",
  "train.wise_ft.alpha": "launch/designs.py: the override each WiSE-FT row of a design sets",
}


@functools.cache
def _python_files() -> tuple[str, ...]:
  files = glob.glob("owl_cl/**/*.py", root_dir=ROOT, recursive=True)
  # The config files users edit (and their examples) write names by design.
  files = [
    f for f in files if not f.startswith("owl_cl/configs/") or f == "owl_cl/configs/__init__.py"
  ]
  return sorted(
    files + glob.glob("launch/*.py", root_dir=ROOT) + glob.glob("benchmarks/*.py", root_dir=ROOT)
  )


@functools.cache
def _text(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


@functools.cache
def _tree(path: str) -> ast.Module:
  return ast.parse(_text(path), path)


def _quoting(body: str, *, at_least: int = 1) -> list[str]:
  """The files holding at least `at_least` quoted matches of the regex `body` (a quote, then
  `body`, then a quote: how a literal it matches is written): the only files worth parsing."""
  quoted = re.compile(rf"""['"](?:{body})['"]""")
  return [f for f in _python_files() if len(quoted.findall(_text(f))) >= at_least]


def _any_of(words) -> str:
  return "|".join(map(re.escape, sorted(words)))


def _scope(node: ast.stmt) -> str:
  """A top-level statement's name: its function's or class's, or its assignment's target."""
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return node.name
  targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
  return ",".join(t.id for t in targets if isinstance(t, ast.Name)) or "<module>"


def _string_literals(path: str) -> list[tuple[str, ast.Constant]]:
  """(scope, literal) of every string literal of `path`; scope: `_scope` of its top-level
  statement (an allow-list entry names it, so a new literal elsewhere in the file is found)."""
  return [
    (_scope(top), n)
    for top in _tree(path).body
    for n in ast.walk(top)
    if isinstance(n, ast.Constant) and isinstance(n.value, str)
  ]


def _registered_here(path: str) -> set[int]:
  """ids of the literals that define a name: the first argument of a `register(...)` call,
  and the keys of the registry's `ALGORITHMS` and of `BASELINES` (and `PROTOCOLS`' items)."""
  out = set()
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Call) and node.args:
      func = node.func
      name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      if name == "register":
        out.add(id(node.args[0]))
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      named = {t.id for t in targets if isinstance(t, ast.Name)}
      if named & {"ALGORITHMS", "BASELINES", "PROTOCOLS"}:
        value = node.value
        elements = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
        out.update(id(e) for e in elements)
  return out


def _algorithm_name_findings(names: set[str]) -> tuple[list[str], set[tuple[str, str]]]:
  findings, used = [], set()
  for path in _quoting(_any_of(names)):
    defined = _registered_here(path)
    for scope, node in _string_literals(path):
      if node.value not in names or id(node) in defined:
        continue
      if (path, scope, node.value) in ALGORITHM_NAMES_ALLOWED:
        used.add((path, scope, node.value))
      else:
        findings.append(f"({path!r}, {scope!r}, {node.value!r}): line {node.lineno}")
  for path in sorted(glob.glob("benchmarks/*.sh", root_dir=ROOT)):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        for word in re.findall(r"[A-Za-z0-9_]+", line):
          if word not in names:
            continue
          if (path, "", word) in ALGORITHM_NAMES_ALLOWED:
            used.add((path, "", word))
          else:
            findings.append(f"({path!r}, '', {word!r}): line {lineno}")
  return findings, used


def test_algorithm_names_are_written_at_their_definition_only():
  names = {*registry.ALGORITHMS, *configs.BASELINES, *configs.PROTOCOLS}
  findings, used = _algorithm_name_findings(names)
  assert not findings, "algorithm names written by hand (iterate the registry instead):\n" + (
    "\n".join(findings)
  )
  assert all(ALGORITHM_NAMES_ALLOWED.values())
  assert set(ALGORITHM_NAMES_ALLOWED) - used == set(), "stale allow-list entries"


def test_model_field_lists_are_derived_from_model_config():
  fields = {f.name for f in dataclasses.fields(variants.ModelConfig)}
  findings, used = [], set()
  for path in _quoting(_any_of(fields), at_least=2):
    if path == "owl_cl/model/variants.py":  # their definition
      continue
    for node in ast.walk(_tree(path)):
      if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        continue
      named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in fields]
      if len(named) < 2:
        continue
      if (path, named[0]) in MODEL_FIELD_LISTS_ALLOWED:
        used.add((path, named[0]))
      else:
        findings.append(f"{path}:{node.lineno}: {named}")
  assert not findings, "hand lists of ModelConfig fields:\n" + "\n".join(findings)
  assert set(MODEL_FIELD_LISTS_ALLOWED) - used == set(), "stale allow-list entries"


def test_config_paths_written_by_hand_name_spec_fields():
  sections = {name: spec for name, spec in config_rules.SECTION_SPECS.items() if name}
  leaves = {path for name, spec in sections.items() for path, _ in config_spec.leaves(spec, name)}
  # A path names a leaf or a section (a prefix of leaves).
  known = leaves | {p.rsplit(".", i)[0] for p in leaves for i in range(1, p.count(".") + 1)}
  body = rf"(?:config\.)?(?:{_any_of(sections)})(?:\.[a-z_][a-z0-9_]*)+"
  pattern = re.compile(rf"^{body}$")
  findings, used = [], set()
  for path in _quoting(body):
    for _, node in _string_literals(path):
      if not pattern.match(node.value):
        continue
      if node.value.removeprefix("config.") not in known:
        # A file name such as 'model.safetensors' unless it says it is a config path.
        if node.value.startswith("config."):
          findings.append(f"{path}:{node.lineno}: {node.value!r} names no field of a spec")
      elif node.value in CONFIG_PATHS_ALLOWED:
        used.add(node.value)
      else:
        findings.append(f"{path}:{node.lineno}: {node.value!r}")
  assert not findings, "config paths written by hand:\n" + "\n".join(findings)
  assert set(CONFIG_PATHS_ALLOWED) - used == set(), "stale allow-list entries"

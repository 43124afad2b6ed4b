"""The datasets of a run: the pre-training set, the held-out classes and the downstream sequence.

The datasets are declared in the config as dataset entries (`owl_cl.data.entries`, suites
`owl_cl.data.suites`):

* `data.sequence`: a list of entries or suite references, the downstream sequence (each
  entry needs train and test splits; a val split feeds `train.carry='best_validation'`);
* `data.pretrain`: one entry, the pre-training / replay source (its train split is the
  buffer's candidate pool, its test split, else its val split, the pre-training proxy eval);
* `data.held_out`: one entry, the held-out / open-vocabulary eval set (test split, else val);
* `data.zero_shot`: a list of entries, further zero-shot eval sets (test split, else val),
  evaluated when the pre-training and held-out sets are (e.g. COCO val 2017, the IVLOD
  papers' "ZCOCO", docs/ivlod.md); None: none.

A field left None takes its default: the built-in benchmark (generated under `cache_dir`)
without `data.root`; with it, the paper's declaration `PAPER_DECLARATION` (Objects365, LVIS
val, the ODinW paper suite restricted to `data.odinw_datasets`). Entries and suite items
without a `root` take `data.root`; an 'odinw13' suite item without `variant` takes
`data.odinw13_variant`. `stage_eval_names` says which evaluation sets are evaluated after
each stage of the sequence.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from owl_cl import config_spec
from owl_cl.config_fields import uses_real_data
from owl_cl.data import builtin
from owl_cl.data import coco
from owl_cl.data import data_spec
from owl_cl.data import entries as entries_lib
from owl_cl.data import odinw
from owl_cl.data import orders
from owl_cl.data import pretraining
from owl_cl.data import readers
from owl_cl.data import real_inputs
from owl_cl.data import suites
from owl_cl.eval_spec import EvalSpec
from owl_cl.utils import digest
from owl_cl.utils import expand_path
from owl_cl.utils import shuffled

PRETRAIN_EVAL = "pretrain_val"
HELD_OUT_EVAL = "held_out"
OBJECTS365_EVAL = "o365"
LVIS_EVAL = "lvis"
EVALUATION_PROTOCOLS = ("coco", "lvis")
# The declaration fields of `config.data` and the splits each role needs.
DECLARED_FIELDS = ("sequence", "pretrain", "held_out", "zero_shot")
# The declaration fields that hold a list of entries (the others hold one entry).
LIST_FIELDS = ("sequence", "zero_shot")
# The paper's protocol as a declaration (the `:paper` config sets these fields; a config with
# `data.root` and none of them gets them too): Objects365 v2 train / val, LVIS v1 val, the
# 15 ODinW datasets of the paper (`data.odinw_datasets` picks and orders them).
PAPER_DECLARATION = {
  "sequence": [{"suite": "odinw_paper"}],
  "pretrain": {"name": OBJECTS365_EVAL, "kind": "objects365"},
  "held_out": {"name": LVIS_EVAL, "kind": "lvis", "evaluation": "lvis"},
}


def _rooted(kind) -> bool:
  """True for a kind whose files sit below the data root (`Reader.root_folder`): an item of
  it without `root` takes `data.root`."""
  return isinstance(kind, str) and kind in readers.READERS and bool(readers.get(kind).root_folder)


def _label(entry: entries_lib.DatasetEntry | None) -> str:
  """The results table's column label of a pre-training / held-out / zero-shot set: its
  reader's (`Reader.label`: 'O365', 'LVIS', 'ZCOCO', COCO val 2017 being the IVLOD papers'
  "ZCOCO", docs/ivlod.md), else the entry's name."""
  if entry is None:
    return "pre-training"
  return readers.get(entry.kind).label or entry.name


@dataclasses.dataclass(frozen=True)
class Dataset:
  """One detection dataset of the run: its training and evaluation sources.

  `valid` is the validation split (used by `train.carry='best_validation'`), None when the
  dataset has none; `evaluation` is 'coco' (COCO AP, exclusive classes) or 'lvis' (LVIS AP
  and APr, federated); `max_detections` overrides the detections kept per image
  (`eval.top_k` and COCOeval's maxDets: 100 for EgoHands and BrackishUnderwater in the
  paper's protocol), None = the config's.
  """

  name: str
  train: coco.CocoSource | None
  test: coco.CocoSource
  valid: coco.CocoSource | None = None
  evaluation: str = "coco"
  max_detections: int | None = None


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """The data of a run: the pre-training set, the held-out classes and the sequence.

  `pretrain.test` and `held_out.test` are evaluated under the names `pretrain_eval` and
  `held_out_eval`; `roles` says which eval set fills which Table 3 column (results.json
  `roles`; None: the built-in benchmark's default roles). `zero_shot` are further eval-only
  sets (`data.zero_shot`), evaluated under their names when the pre-training sets are.
  """

  pretrain: Dataset
  held_out: Dataset
  sequence: tuple[Dataset, ...]
  fingerprint: str
  pretrain_eval: str = PRETRAIN_EVAL
  held_out_eval: str = HELD_OUT_EVAL
  roles: dict | None = None
  # The stored order applied (`owl_cl.data.orders.resolve_order`: suite, name, index,
  # datasets); None when the sequence follows sequence_seed.
  task_order: dict | None = None
  # Further evaluation sets of the pre-training classes, evaluated whenever the pre-training
  # set is: version 2's tail classes ('pretrain_tail'); () otherwise.
  extra_evals: tuple[Dataset, ...] = ()
  # The built-in benchmark's version when the run reads any of its datasets, else None.
  builtin_version: int | None = None
  # Zero-shot retention sets (`data.zero_shot`, e.g. COCO val 2017 for IVLOD's ZCOCO),
  # evaluated whenever the pre-training set is.
  zero_shot: tuple[Dataset, ...] = ()

  def eval_sets(self) -> list[tuple[str, Dataset]]:
    """(eval-set name, dataset) of every eval set: pre-training, held-out, the extra sets, the
    zero-shot sets, each dataset."""
    fixed = [(self.pretrain_eval, self.pretrain), (self.held_out_eval, self.held_out)]
    extra = [(d.name, d) for d in self.extra_evals + self.zero_shot]
    return fixed + extra + [(d.name, d) for d in self.sequence]


def _plain(value):
  """A config value (ConfigDict, FieldReference-free) as plain dicts / lists: a copy, so that
  `declaration` filling in defaults never changes the config (a plain dict in a config list
  is the config's own object)."""
  if hasattr(value, "to_dict"):
    return value.to_dict()
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def declaration(config: ml_collections.ConfigDict) -> dict:
  """{field: declared value or None} of `DECLARED_FIELDS`, with the defaults filled in.

  Without `data.root` an undeclared field stays None (the built-in benchmark's set). With real
  data (`uses_real_data`) an undeclared field takes `PAPER_DECLARATION`'s. Entry and suite
  items of the kinds below a data root ('odinw', 'objects365', 'lvis', ODinW suites) without
  `root` get `data.root`; an 'odinw_paper' suite item without `names` gets
  `data.odinw_datasets` (when set) and without `subset_seed` gets `data.subset_seed`; an
  'odinw13' suite item without `variant` gets `data.odinw13_variant` (when set).
  """
  data = config.data
  real = uses_real_data(config)
  root = data.get("root")
  out = {}
  for field in DECLARED_FIELDS:
    value = _plain(data.get(field))
    if value is None and real and field in PAPER_DECLARATION:
      value = _plain(PAPER_DECLARATION[field])
    out[field] = value
  items = [out["pretrain"], out["held_out"]] + [
    v for f in LIST_FIELDS if isinstance(out[f], list) for v in out[f]
  ]
  for item in items:
    if not isinstance(item, dict):
      continue
    if "suite" in item:
      if item["suite"] != "builtin" and not item.get("root") and root:
        item["root"] = root
      if item["suite"] == "odinw13" and "variant" not in item:
        if data.get("odinw13_variant") is not None:
          item["variant"] = data.odinw13_variant
      if item["suite"] in ("odinw_paper", "odinw15"):
        if item.get("names") is None and data.get("odinw_datasets") is not None:
          item["names"] = list(data.odinw_datasets)
        if "subset_seed" not in item and "subset_seed" in data:
          item["subset_seed"] = data.subset_seed
    elif _rooted(item.get("kind")) and not item.get("root") and root:
      item["root"] = root
      if item.get("kind") == "odinw" and "subset_seed" not in item and "subset_seed" in data:
        item["subset_seed"] = data.subset_seed
  return out


def declared_entries(
  config: ml_collections.ConfigDict, builtin_benchmark=None
) -> dict[str, entries_lib.DatasetEntry | list[entries_lib.DatasetEntry] | None]:
  """The declared datasets as entries: {'pretrain': entry | None, 'held_out': entry | None,
  'sequence': [entry, ...] | None} (None: the built-in benchmark's).

  Args:
    config: the run's config. builtin_benchmark: the generated built-in benchmark, for
      'builtin' suite items (None: those items are left out, as validation does).

  Raises:
    DataError: every structural problem of every declared item (`entry_from_config`,
      `suites.entries_from_config`), each naming `data.<field>`.
  """
  decl = declaration(config)
  out, problems = {}, []
  for field in DECLARED_FIELDS:
    value = decl[field]
    if value is None:
      out[field] = None
      continue
    try:
      if field in LIST_FIELDS:
        items = [v for v in value if builtin_benchmark is not None or not is_builtin_suite(v)]
        out[field] = suites.entries_from_config(items, benchmark=builtin_benchmark)
      else:
        if not isinstance(value, dict) or "suite" in value:
          raise coco.DataError(
            f"must be one dataset entry (a dict with name and kind), got {value!r}"
          )
        out[field] = entries_lib.entry_from_config(value)
    except coco.DataError as e:
      problems.append(f"config.data.{field}: {e}")
  if problems:
    raise coco.DataError("\n".join(problems))
  return out


def is_builtin_suite(item) -> bool:
  """True for a `dict(suite='builtin', ...)` item (its datasets are generated by the run)."""
  return isinstance(item, dict) and item.get("suite") == "builtin"


def _eval_split(entry: entries_lib.DatasetEntry) -> str:
  """The split evaluated for a pre-training / held-out entry: test, else val, else train."""
  return next(s for s in ("test", "val", "train") if s in entry.split_names)


def _protocol(entry: entries_lib.DatasetEntry, split: str, source=True) -> str:
  if source is None:
    return "coco"  # the split could not be read: reported by `_SplitLoader`, never evaluated
  return entries_lib.evaluation_protocol(entry, split)


class _SplitLoader:
  """`entries.load_split` that records a split's DataError and goes on with the next split,
  so one error (`raise_problems`) names every unreadable file of every dataset.
  `coco_options` go to every `CocoSource` (e.g. `exif_orientation`)."""

  def __init__(self, **coco_options):
    self.problems: list[str] = []
    self.coco_options = coco_options

  def __call__(self, entry: entries_lib.DatasetEntry, split: str) -> coco.CocoSource | None:
    try:
      return entries_lib.load_split(entry, split, **self.coco_options)
    except coco.DataError as e:
      self.problems += [f"dataset {entry.name!r} split {split!r}: {p}" for p in str(e).split("\n")]
      return None

  def raise_problems(self) -> None:
    """Raises one DataError listing every recorded problem (nothing when there is none)."""
    if self.problems:
      raise coco.DataError(
        f"the run's data cannot be read ({len(self.problems)} problem"
        f"{'s' * (len(self.problems) > 1)}):\n" + "\n".join(f"  - {p}" for p in self.problems)
      )


def _sequence_dataset(entry: entries_lib.DatasetEntry, load=entries_lib.load_split) -> Dataset:
  split = lambda s: load(entry, s) if s in entry.split_names else None
  test = split("test")
  return Dataset(
    entry.name,
    split("train"),
    test,
    valid=split("val"),
    evaluation=_protocol(entry, "test", test),
    # The entry's value for every kind (an ODinW member's defaults to the registry's, the
    # paper protocol; None: the config's eval.top_k / max_dets).
    max_detections=entry.max_detections,
  )


def load_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The run's data, assembled from the config's declaration (module docstring).

  The sequence follows the stored order `task_order` when set (`apply_task_order`), else it
  is shuffled by `sequence_seed`. Nothing declared and no `data.root`: the
  built-in benchmark as before; with `data.root`: the paper's declaration, which gives the
  datasets of `load_real_benchmark`.

  Raises:
    MissingInputsError: the paper's protocol with missing files (`data.real_inputs.check_inputs`).
    DataError: a declared dataset that cannot be read (names the entry, field and value).
    OrderError: `task_order` names no stored order of the sequence's suite.
  """
  return apply_task_order(_load_benchmark(config), config.get("task_order"))


def apply_task_order(bench: Benchmark, task_order: str | int | None) -> Benchmark:
  """`bench` with its sequence in the stored order `task_order` (None: `bench` unchanged).

  Args:
    bench: a loaded benchmark (its sequence in any order).
    task_order: see `owl_cl.data.orders.resolve_order`.

  Returns:
    A new Benchmark: sequence (and roles' downstream list) reordered, `task_order` recorded.

  Raises:
    OrderError: see `owl_cl.data.orders.resolve_order`.
  """
  if task_order is None:
    return bench
  order = orders.resolve_order(task_order, [d.name for d in bench.sequence])
  by_name = {d.name: d for d in bench.sequence}
  roles = bench.roles
  if roles is not None and roles.get("downstream") is not None:
    roles = dict(roles, downstream=list(order["datasets"]))
  return dataclasses.replace(
    bench,
    sequence=tuple(by_name[n] for n in order["datasets"]),
    roles=roles,
    task_order=order,
  )


def _load_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  if uses_real_data(config):
    real_inputs.check_inputs(config)
  decl = declaration(config)
  needs_builtin = (
    decl["pretrain"] is None
    or decl["held_out"] is None
    or decl["sequence"] is None
    or any(is_builtin_suite(v) for v in decl["sequence"])
  )
  if not needs_builtin:
    return _declared_benchmark(config, declared_entries(config), None)
  built = _builtin_benchmark(config)
  if all(decl[f] is None for f in DECLARED_FIELDS):
    return built[1]
  return _declared_benchmark(config, declared_entries(config, built[0]), built[1])


def _declared_benchmark(config, declared: dict, default: Benchmark | None) -> Benchmark:
  """The Benchmark of `declared` entries; undeclared roles from `default` (built-in)."""
  pretrain_eval, held_out_eval = PRETRAIN_EVAL, HELD_OUT_EVAL
  exif = data_spec.settings(config).exif_orientation
  load = _SplitLoader(exif_orientation=exif)
  if declared["pretrain"] is None:
    pretrain = default.pretrain
  else:
    e = declared["pretrain"]
    split = _eval_split(e)
    train = load(e, "train") if "train" in e.split_names else None
    test = load(e, split)
    pretrain = Dataset(
      e.name, train, test, evaluation=_protocol(e, split, test), max_detections=e.max_detections
    )
    pretrain_eval = e.name
  if declared["held_out"] is None:
    held_out = default.held_out
  else:
    e = declared["held_out"]
    split = _eval_split(e)
    test = load(e, split)
    held_out = Dataset(
      e.name, None, test, evaluation=_protocol(e, split, test), max_detections=e.max_detections
    )
    held_out_eval = e.name
  if declared["sequence"] is None:
    sequence = list(default.sequence)
  else:
    sequence = shuffled(
      [_sequence_dataset(e, load) for e in declared["sequence"]], config.sequence_seed
    )
  zero_shot = []
  for e in declared.get("zero_shot") or []:
    split = _eval_split(e)
    test = load(e, split)
    zero_shot.append(
      Dataset(
        e.name, None, test, evaluation=_protocol(e, split, test), max_detections=e.max_detections
      )
    )
  load.raise_problems()
  roles = None
  if held_out.evaluation == "lvis" and declared["held_out"] is not None:
    # The paper's columns: pre-training proxy, open-vocabulary AP and its rare classes' APr.
    ho_label = _label(declared["held_out"])
    odinw_only = declared["sequence"] and all(e.kind == "odinw" for e in declared["sequence"])
    roles = {
      "pretrain": {"eval_set": pretrain_eval, "label": _label(declared["pretrain"])},
      "open_vocab": {"eval_set": held_out_eval, "label": ho_label},
      "held_out": {
        "eval_set": held_out_eval,
        "AP": "APr",
        "AP50": None,
        "label": f"{ho_label} rare",
      },
      "downstream": [d.name for d in sequence],
      "downstream_label": "ODinW mean" if odinw_only else "downstream mean",
    }
    if declared.get("zero_shot"):
      roles["zero_shot"] = [{"eval_set": e.name, "label": _label(e)} for e in declared["zero_shot"]]
  fingerprint = digest(
    {
      "declared": {
        f: [dataclasses.asdict(e) for e in v]
        if isinstance(v, list)
        else (dataclasses.asdict(v) if v is not None else None)
        for f, v in declared.items()
      },
      "builtin": default.fingerprint if default is not None else None,
      # Only when not the default: the caches keyed before the option existed stay valid.
      **({"exif_orientation": exif} if exif != "ignore" else {}),
    }
  )
  return Benchmark(
    pretrain,
    held_out,
    tuple(sequence),
    fingerprint=fingerprint,
    pretrain_eval=pretrain_eval,
    held_out_eval=held_out_eval,
    roles=roles,
    # The tail set belongs to the built-in pre-training set: kept only with it.
    extra_evals=default.extra_evals if default is not None and declared["pretrain"] is None else (),
    builtin_version=default.builtin_version if default is not None else None,
    zero_shot=tuple(zero_shot),
  )


def _builtin_benchmark(config: ml_collections.ConfigDict):
  """(generated BuiltinBenchmark, its Benchmark: sequence ordered by sequence_seed)."""
  # `data.builtin`'s fields are `ensure_benchmark`'s keywords; a config (run.json) that
  # predates a field (version 2's `version`, `num_tail_val`) gets its default, version 1's.
  settings = data_spec.settings(config).builtin
  bench = builtin.ensure_benchmark(
    os.path.join(expand_path(config.cache_dir), "builtin"), **dataclasses.asdict(settings)
  )
  pretrain = Dataset("pretrain", bench.pretrain_train.source(), bench.pretrain_val.source())
  held_out = Dataset(HELD_OUT_EVAL, None, bench.held_out_val.source())
  sequence = [Dataset(d.name, d.train.source(), d.test.source()) for d in bench.downstream]
  sequence = shuffled(sequence, config.sequence_seed)
  extra = ()
  if bench.tail_val is not None:
    extra = (Dataset(builtin.TAIL_DATASET, None, bench.tail_val.source()),)
  return bench, Benchmark(
    pretrain,
    held_out,
    tuple(sequence),
    fingerprint=bench.fingerprint,
    extra_evals=extra,
    builtin_version=bench.version,
  )


def load_real_benchmark(config: ml_collections.ConfigDict) -> Benchmark:
  """The paper's data hard-wired: Objects365, LVIS val and the ODinW sequence.

  The reference the paper's declaration (`PAPER_DECLARATION`, what `load_benchmark` uses) is
  tested against: same datasets, images, boxes, labels and balanced subsets.

  pre-training set = Objects365 (train: the buffer's images; val: evaluated as 'o365'),
  held-out = LVIS val (evaluated as 'lvis': AP, and APr as the rare column), sequence = the
  `data.odinw_datasets` (train / valid / test splits) shuffled by `sequence_seed`.

  Raises:
    MissingInputsError: see `data.real_inputs.check_inputs`.
  """
  real_inputs.check_inputs(config)
  root = expand_path(config.data.root)
  names = real_inputs.odinw_names(config)
  subset_seed = config.data.get("subset_seed", 0)
  sequence = []
  for name in names:
    split = lambda s, name=name: odinw.odinw_source(root, name, s, subset_seed=subset_seed)
    sequence.append(
      Dataset(
        name,
        split("train"),
        split("test"),
        valid=split("val"),
        max_detections=odinw.ODINW_DATASETS[name].max_detections,
      )
    )
  sequence = shuffled(sequence, config.sequence_seed)
  pretrain = Dataset(
    OBJECTS365_EVAL,
    pretraining.objects365_source(root, "train"),
    pretraining.objects365_source(root, "val"),
  )
  held_out = Dataset(LVIS_EVAL, None, pretraining.lvis_source(root, "val"), evaluation="lvis")
  roles = {
    "pretrain": {"eval_set": OBJECTS365_EVAL, "label": "O365"},
    "open_vocab": {"eval_set": LVIS_EVAL, "label": "LVIS"},
    "held_out": {"eval_set": LVIS_EVAL, "AP": "APr", "AP50": None, "label": "LVIS rare"},
    "downstream": [d.name for d in sequence],
    "downstream_label": "ODinW mean",
  }
  fingerprint = digest({"root": root, "datasets": names, "subset_seed": subset_seed})
  return Benchmark(
    pretrain,
    held_out,
    tuple(sequence),
    fingerprint=fingerprint,
    pretrain_eval=OBJECTS365_EVAL,
    held_out_eval=LVIS_EVAL,
    roles=roles,
  )


def stage_eval_names(config: ml_collections.ConfigDict, bench: Benchmark, index: int) -> list[str]:
  """The eval sets evaluated after dataset `index` (1-based) of the sequence.

  The final stage evaluates every set; earlier stages the downstream sets per
  `eval.downstream_after_each_dataset` ('all' | 'seen': datasets 1..index) plus the
  pre-training, held-out, extra (version 2's tail classes) and zero-shot sets if
  `eval.pretraining_sets_after_each_dataset`.
  Stage 0 (after pre-training) always evaluates everything (the "No fine-tuning" row).

  Raises:
    ConfigError: an `eval` field that breaks its rule (`eval_spec.EvalSpec`).
  """
  return eval_names_after(config_spec.from_config(EvalSpec, config.eval, "eval"), bench, index)


def eval_names_after(settings: EvalSpec, bench: Benchmark, index: int) -> list[str]:
  """`stage_eval_names` with the typed `config.eval` (`settings`): the eval sets evaluated
  after dataset `index` (1-based) of the sequence."""
  names = [d.name for d in bench.sequence]
  extra = [d.name for d in bench.extra_evals + bench.zero_shot]
  pretraining_sets = [bench.pretrain_eval, bench.held_out_eval] + extra
  everything = pretraining_sets + names
  if index >= len(bench.sequence):
    return everything
  out = []
  if settings.pretraining_sets_after_each_dataset:
    out += pretraining_sets
  return out + (names if settings.downstream_after_each_dataset == "all" else names[:index])

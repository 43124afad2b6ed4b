"""Built-in benchmark version 2 (docs/experiments.md): version 1 unchanged, version 2's design
checked by value (class frequencies, tail set, interference, reappearing class, negative
control, buffer / replay sizes), its version in every cache key, bad versions refused."""

import collections
import dataclasses
from fractions import Fraction
import hashlib
import json
import os

import ml_collections
import numpy as np
import pytest
from scipy import stats

from owl_cl import benchmark as benchmark_lib
from owl_cl import cache_keys
from owl_cl import integrity
from owl_cl import validation
from owl_cl.config_fields import ConfigError
from owl_cl.configs import base
from owl_cl.data import builtin as B
from owl_cl.data.builtin import vocabulary as V

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools")

# The smallest benchmark (every dataset, one image per split), seed 3.
SMALLEST = dict(
  seed=3,
  progress=False,
  num_pretrain_train=2,
  num_pretrain_val=1,
  num_held_out_val=1,
  num_downstream_train=1,
  num_downstream_test=1,
  downstream=B.DOWNSTREAM_NAMES,
)
# Version 1's key and content digest of SMALLEST, computed at main (05e91f2, before version 2
# existed) with `_content_digest`: version 1 must stay byte for byte what it was, so that
# existing caches and results stay valid.
V1_KEY_AT_MAIN = "builtin_v3_c74a70247671"
V1_CONTENT_AT_MAIN = "32a86c14b6cb187d7f090c825f5fb2c56e6075e475da78316f755e00f87145c2"


def _content_digest(root: str) -> str:
  """sha256 over (relative path, bytes) of every file in sorted order, except benchmark.json
  (it holds the generation's wall time) and the manifest (it holds that file's digest)."""
  h = hashlib.sha256()
  for dirpath, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for f in sorted(files):
      rel = os.path.relpath(os.path.join(dirpath, f), root)
      if rel in ("benchmark.json", integrity.MANIFEST_NAME) or rel.startswith("."):
        continue
      h.update(rel.encode())
      with open(os.path.join(dirpath, f), "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


def test_version_1_unchanged(tmp_path):
  bench = B.ensure_benchmark(str(tmp_path), **SMALLEST)
  assert bench.fingerprint == V1_KEY_AT_MAIN and bench.version == 1
  assert _content_digest(bench.root) == V1_CONTENT_AT_MAIN
  with open(os.path.join(bench.root, "benchmark.json")) as f:
    meta = json.load(f)
  # No field of version 2 in version 1's metadata: its config is the one of before.
  assert "design" not in meta and "benchmark_version" not in meta
  assert set(meta["config"]) == {
    "seed",
    "num_pretrain_train",
    "num_pretrain_val",
    "num_held_out_val",
    "num_downstream_train",
    "num_downstream_test",
    "downstream",
  }
  assert bench.tail_val is None and bench.design == {}


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
  """Version 2 with 160 pre-training images (~400 objects: the class distribution's shape is
  visible), a 20-image tail set and two / one images per downstream split."""
  return B.ensure_benchmark(
    str(tmp_path_factory.mktemp("v2")),
    version=2,
    seed=0,
    progress=False,
    num_pretrain_train=160,
    num_pretrain_val=1,
    num_held_out_val=1,
    num_tail_val=20,
    num_downstream_train=2,
    num_downstream_test=1,
    downstream=B.DOWNSTREAM_NAMES,
  )


def _coco(split_files):
  with open(split_files.annotation_file) as f:
    return json.load(f)


def test_version_2_keys_and_metadata(v2):
  assert v2.version == 2 and v2.fingerprint.startswith("builtin2_v3_")
  # The same sizes under version 1 give another folder: the version keys the benchmark.
  v1_key = dataclasses.replace(v2.config, version=1).key()
  assert v1_key != v2.fingerprint and v1_key.startswith("builtin_v3_")
  with open(os.path.join(v2.root, "benchmark.json")) as f:
    meta = json.load(f)
  assert meta["benchmark_version"] == 2 and meta["design"] == json.loads(json.dumps(V.design(2)))
  assert _coco(v2.pretrain_train)["info"]["benchmark_version"] == 2


def test_class_frequencies_follow_one_over_rank():
  freq = V.class_frequencies()
  ranked = [freq[f"{c} {p}"] for c, p in V.FREQUENCY_ORDER]
  # p_r = (1 / r) / H_20, H_20 = 55835135 / 15519504 (the 20th harmonic number, exact).
  h20 = sum(Fraction(1, r) for r in range(1, 21))
  assert h20 == Fraction(55835135, 15519504)
  np.testing.assert_allclose(ranked, [float(1 / (r * h20)) for r in range(1, 21)], rtol=1e-12)
  # The 5 rarest together: (1/16 + ... + 1/20) / H_20 = 7.77 % (the design's "about 8 %").
  tail = sum(freq[n] for n in V.tail_class_names())
  assert tail == pytest.approx(float(sum(Fraction(1, r) for r in range(16, 21)) / h20), rel=1e-12)
  assert 0.077 < tail < 0.078
  # Every pre-training class ranked once; the rank order is the seeded permutation.
  assert sorted(V.FREQUENCY_ORDER) == sorted(V.PRETRAIN_PAIRS)
  perm = np.random.default_rng(V.FREQUENCY_SEED).permutation(20)
  assert V.FREQUENCY_ORDER[0] == V.PRETRAIN_PAIRS[perm[0]]


def test_pretraining_objects_are_long_tailed(v2):
  coco = _coco(v2.pretrain_train)
  names = {c["id"]: c["name"] for c in coco["categories"]}
  assert sorted(names.values()) == sorted(V.pretrain_class_names())
  counts = collections.Counter(names[a["category_id"]] for a in coco["annotations"])
  freq = V.class_frequencies()
  observed = np.array([counts[n] for n in freq])
  expected = np.array(list(freq.values())) * observed.sum()
  # ~400 objects: a chi-square test against 1 / rank does not reject it (p > 0.001) while
  # it rejects the uniform distribution of version 1 (p < 1e-6).
  assert observed.sum() > 300
  assert stats.chisquare(observed, expected).pvalue > 1e-3
  assert stats.chisquare(observed).pvalue < 1e-6
  head = counts[" ".join(V.FREQUENCY_ORDER[0])]
  tail = sum(counts[n] for n in V.tail_class_names())
  assert head > 2 * tail  # rank 1 alone: 27.8 %, the 5 rarest together 7.8 %


def test_tail_set_holds_only_tail_classes(v2):
  coco = _coco(v2.tail_val)
  names = {c["id"]: c["name"] for c in coco["categories"]}
  # Every pre-training class is queried (a tail object taken for a head class is a miss) ...
  assert list(names.values()) == V.pretrain_class_names()
  # ... and every object is of one of the 5 rarest, each of them present.
  seen = collections.Counter(names[a["category_id"]] for a in coco["annotations"])
  assert set(seen) == set(V.tail_class_names()) and len(V.tail_class_names()) == 5
  assert V.tail_class_names() == [" ".join(p) for p in V.FREQUENCY_ORDER[-5:]]
  assert v2.design["tail_classes"] == V.tail_class_names()


def test_interference_named_by_rule_and_recorded(v2):
  recorded = {i["dataset"]: i for i in v2.design["interference"]}
  assert set(recorded) == {"thermal", "negative", "tiny", "clutter", "textured"}
  # Hand-worked: a plain orange bead (250, 135, 20) is nearest, among the plain pre-training
  # colours, to red (215, 35, 35): 35^2 + 100^2 + 15^2 = 11,450, then brown (140, 85, 35):
  # 110^2 + 50^2 + 15^2 = 14,825 (green 46,925, purple 48,050, blue 80,925; yellow plain is
  # held out).
  assert recorded["tiny"]["pretrain_classes"] == ["red plain", "brown plain"]
  # The negative's cyan (30, 205, 215) shows inverted as (225, 50, 40): red dotted (350), then
  # brown dotted (85^2 + 35^2 + 5^2 = 8,475); green dotted is held out.
  assert recorded["negative"]["rgb"] == [225, 50, 40]
  assert recorded["negative"]["pretrain_classes"] == ["red dotted", "brown dotted"]
  assert recorded["clutter"]["pretrain_classes"] == ["green plain", "red checkered"]
  pretrain = set(V.pretrain_class_names())
  for name, item in recorded.items():
    assert len(item["pretrain_classes"]) == 2 and set(item["pretrain_classes"]) <= pretrain
    if item["downstream_class"] is not None:
      # The downstream class exists in the dataset and shares the pattern's word with the
      # named classes (the confusable name).
      assert item["downstream_class"] in v2.classes[name]
      word = item["pattern"]
      assert word in item["downstream_class"].split()
      assert all(n.split()[1] == word for n in item["pretrain_classes"])
  # clutter's unannotated distractors are exactly its two named classes.
  assert V.DOMAINS_V2["clutter"].distractor_pairs == V.CLUTTER_DISTRACTOR_PAIRS


def test_reappearing_class_and_negative_control(v2):
  holders = [d for d in v2.downstream_names if V.REAPPEARING_CLASS in v2.classes[d]]
  assert holders == ["clutter", "glyphs"]
  assert v2.design["reappearing_class"] == {"name": "pink star", "datasets": holders}
  # The negative control shares no word with a pre-training class, and its inks are no
  # pre-training colour.
  control = V.DOMAINS_V2[V.NEGATIVE_CONTROL]
  words = {w for n in V.pretrain_class_names() for w in n.split()}
  assert not any(set(n.split()) & words for n, _ in control.classes)
  assert {s.color for _, s in control.classes} == {"black ink", "orange ink"}
  assert not {"black", "orange"} & set(V.PRETRAIN_COLORS)
  assert not any(i.dataset == V.NEGATIVE_CONTROL for i in V.interference())


def test_buffer_several_times_one_datasets_replays():
  c = base.get_config("builtin2")
  assert c.data.builtin.version == 2 and c.data.builtin.downstream == V.DOWNSTREAM_NAMES
  replays = c.data.builtin.num_downstream_train * c.train.num_epochs * c.replay.ratio
  # 200 new images x 2 epochs x 1:1 = 400 replays per dataset; a buffer of 1,200: each image
  # is replayed at most once per dataset (no dedup reset), a third of the buffer per dataset.
  assert replays == 400 and c.replay.budget == 1200
  assert c.replay.budget / replays >= 3
  assert c.replay.budget <= c.data.builtin.num_pretrain_train
  # Between stages only the datasets seen so far (the run's cost, docs/experiments.md).
  assert c.eval.downstream_after_each_dataset == "seen"
  assert not c.eval.pretraining_sets_after_each_dataset
  with pytest.raises(ValueError, match="'builtin2' is a built-in benchmark"):
    base.get_config("paper,builtin2")


def test_default_is_version_2_and_builtin1_is_version_1():
  # The default job (`--config=configs/<algorithm>.py`) is ':builtin2', field for field.
  default = base.get_config("").to_dict()
  assert default == base.get_config("builtin2").to_dict()
  # ':builtin1' is the fields' own values: version 1, eq. 7's buffer, 8 epochs, every set
  # evaluated after each dataset; version 2's settings on top of it give the default.
  v1 = base.get_config("builtin1")
  assert (v1.data.builtin.version, v1.replay.budget, v1.train.num_epochs) == (1, None, 8)
  assert v1.eval.downstream_after_each_dataset == "all"
  assert v1.eval.pretraining_sets_after_each_dataset
  assert base.apply_builtin_v2(v1).to_dict() == default
  # The paper's protocol reads no built-in benchmark: neither version's settings apply.
  assert base.get_config("paper").replay.budget is None
  with pytest.raises(ValueError, match="'builtin1' is a built-in benchmark"):
    base.get_config("paper,builtin1")
  with pytest.raises(ValueError, match="'builtin1' and 'builtin2' exclude each other"):
    base.get_config("builtin1,builtin2")


def test_version_in_cache_keys(tmp_path):
  v1, v2c = base.get_config("builtin1"), base.get_config("builtin2")
  ann = tmp_path / "ann.json"
  ann.write_text("{}")
  source = ml_collections.ConfigDict({"annotation_file": str(ann)})
  meta = {"cache_key": "model"}
  assert cache_keys.buffer_key_material(v1, source, meta)["data"]["builtin"] == {"version": 1}
  assert cache_keys.buffer_key_material(v2c, source, meta)["data"]["builtin"] == {"version": 2}


def test_run_benchmark_evaluates_the_tail_set(tmp_path):
  c = base.get_config("builtin2")
  c.cache_dir = str(tmp_path)
  for field, n in (("num_pretrain_train", 2), ("num_pretrain_val", 1), ("num_held_out_val", 1)):
    c.data.builtin[field] = n
  c.data.builtin.num_tail_val = 1
  c.data.builtin.num_downstream_train = c.data.builtin.num_downstream_test = 1
  c.data.builtin.downstream = ("tiny", "digits")
  bench = benchmark_lib.load_benchmark(c)
  assert bench.builtin_version == 2 and [d.name for d in bench.extra_evals] == ["pretrain_tail"]
  assert [n for n, _ in bench.eval_sets()][:3] == ["pretrain_val", "held_out", "pretrain_tail"]
  # `:builtin2` evaluates the pre-training sets only after pre-training and at the end.
  assert "pretrain_tail" not in benchmark_lib.stage_eval_names(c, bench, 1)
  c.eval.pretraining_sets_after_each_dataset = True
  assert "pretrain_tail" in benchmark_lib.stage_eval_names(c, bench, 1)
  c.eval.pretraining_sets_after_each_dataset = False
  assert "pretrain_tail" not in benchmark_lib.stage_eval_names(c, bench, 1)
  assert "pretrain_tail" in benchmark_lib.stage_eval_names(c, bench, 2)  # the final stage


@pytest.mark.parametrize("bad", [3, 0])
def test_bad_version_refused_up_front(tmp_path, bad):
  c = base.get_config("")
  c.cache_dir = str(tmp_path / "cache")
  c.data.builtin.version = bad
  with pytest.raises(ConfigError, match=r"data\.builtin\.version") as e:
    validation.validate(c, str(tmp_path / "wd"))
  assert f"data.builtin.version={bad}" in str(e.value)
  assert not os.path.exists(tmp_path / "cache") and not os.path.exists(tmp_path / "wd")
  with pytest.raises(ValueError, match="version 3 unknown"):
    B.ensure_benchmark(str(tmp_path / "direct"), version=3, progress=False)
  assert not os.path.exists(tmp_path / "direct")

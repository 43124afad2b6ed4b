"""The streaming, resumable buffer builder (owl_cl/replay/build.py, docs/reference.md §6).

Checked against an independent in-memory reference (the builder as it was before streaming:
every image preprocessed and analysed at once, then selected), and a build killed mid-way
(SIGKILL of a subprocess, or an exception at a chunk boundary) against an uninterrupted one.
"""

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import benchmark
from owl_cl import pretrained
from owl_cl.data import input_pipeline
from owl_cl.data import owlv2_images
from owl_cl.detector import Detector
from owl_cl.replay import buffer_selection
from owl_cl.replay import build as build_lib
from owl_cl.replay import build_steps
from owl_cl.replay import setup as replay_setup
from owl_cl.replay import store as store_lib
from owl_cl.testing.configs import tiny_config
from owl_cl.train import losses
from owl_cl.train import top_k as top_k_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small batches and one-batch chunks: the 48 pre-training images make 6 chunks in pass 1.
BATCH = 8


@pytest.fixture(scope="module")
def setup(pretrained_cache_dir):
  config = tiny_config("swil", pretrained_cache_dir)
  config.data.eval_batch_size = BATCH
  detector = Detector(config)
  bench = benchmark.load_benchmark(config)
  params, _ = pretrained.pretrained_params(detector, bench, None)
  source = bench.pretrain.train
  return detector, params, source, replay_setup.build_options(detector, source)


def _analyse(detector, params, source, options):
  """The in-memory builder's first half: every image preprocessed, then analysed per batch.

  Returns (examples [N, ...], analysis dict [N, ...])."""
  o = options["buffer_spec"]
  examples = input_pipeline.stack_examples(
    [
      input_pipeline.preprocess_train_example(
        source.load(i),
        o.example,
        rng=input_pipeline.example_rng(o.seed, 0, i),
        **o.example_options,
      )
      for i in range(len(source))
    ]
  )
  num_classes = len(source.class_names)

  @jax.jit
  def forward(batch):
    out = detector.model.apply({"params": params}, batch["images"], batch["queries"], train=False)
    det = losses.detection_loss(
      out["pred_logits"], out["pred_boxes"], batch["labels"], batch["boxes"], **o.loss_config
    )
    top_class, top_query = top_k_lib.top_k_embeddings(
      out["pred_logits"],
      out["class_embeddings"],
      out["query_embeddings"],
      batch["queries"][..., 0] > 0,
      o.top_k,
    )
    counts = buffer_selection.instance_counts_from_labels(
      batch["labels"], batch["query_class"], num_classes
    )
    sums, token_counts = buffer_selection.per_image_class_token_embeddings(
      out["pred_logits"],
      out["class_embeddings"],
      batch["query_class"],
      counts,
      max_per_class=o.max_per_class,
    )
    feature_map = out["feature_map"]
    return dict(
      image_features=top_k_lib.top_k_token_features(
        out["pred_logits"],
        feature_map.reshape(feature_map.shape[0], -1, feature_map.shape[-1]),
        batch["queries"][..., 0] > 0,
        o.top_k,
      ),
      loss=det["per_example"],
      logits=out["pred_logits"],
      top_class=top_class,
      top_query=top_query,
      sums=sums,
      token_counts=token_counts,
      counts=counts,
      class_embeddings=out["class_embeddings"],
    )

  n = len(source)
  parts = {}
  for start in range(0, n, BATCH):
    idx = np.arange(start, min(start + BATCH, n))
    padded = np.concatenate([idx, np.full(BATCH - len(idx), idx[0])])
    out = jax.device_get(forward({k: examples[k][padded] for k in build_lib.EXAMPLE_KEYS}))
    for k, v in out.items():
      parts.setdefault(k, []).append(np.asarray(v)[: len(idx)])
  return examples, {k: np.concatenate(v) for k, v in parts.items()}


def _reference(examples, a, o):
  """The in-memory builder's selection (`o`: the `BufferSpec`): kept image indices, their
  prototypes, distances, logits, top-k class / query embeddings and examples."""
  membership = a["counts"] > 0
  keep = buffer_selection.select_buffer(
    a["loss"],
    membership,
    o.loss_threshold,
    min_per_class=o.min_per_class,
    fill_all_for_rare_classes=o.fill_all_for_rare_classes,
    drop_images_without_class=o.drop_images_without_class,
    top_up_order=o.top_up_order,
  )
  prototypes, _ = buffer_selection.buffer_prototypes(
    a["sums"], a["token_counts"], keep, o.prototype_images
  )
  max_instances = o.distance_max_instances or o.example.max_instances
  distances = buffer_selection.prototype_distances(
    jnp.asarray(a["logits"][keep]),
    jnp.asarray(a["class_embeddings"][keep]),
    jnp.asarray(examples["query_class"][keep]),
    jnp.asarray(a["counts"][keep]),
    prototypes,
    max_instances=max_instances,
  )
  return dict(
    keep=np.flatnonzero(keep),
    loss=a["loss"],
    membership=membership[keep],
    prototypes=np.asarray(prototypes),
    distances=np.asarray(distances),
    logits=a["logits"][keep],
    top_class=a["top_class"][keep],
    top_query=a["top_query"][keep],
    image_features=a["image_features"][keep],
    examples={k: examples[k][keep] for k in build_lib.EXAMPLE_KEYS + ("image_id",)},
  )


def _with(options, **changes):
  """`build_options` with the `BufferSpec` fields `changes` replaced."""
  return {**options, "buffer_spec": dataclasses.replace(options["buffer_spec"], **changes)}


def _options(options, **changes):
  return {**_with(options, **changes), "chunk_images": BATCH}


@pytest.fixture(scope="module")
def analysis(setup):
  detector, params, source, options = setup
  return _analyse(detector, params, source, options)


# Default: prototypes over the kept images; released: over every image, with the top-k tokens'
# ViT features stored (ASER on image features).
@pytest.mark.slow
@pytest.mark.parametrize(
  "changes", [{}, {"prototype_images": "all", "image_features": True}], ids=["paper", "released"]
)
def test_streaming_build_equals_in_memory_reference(setup, analysis, tmp_path, changes):
  detector, params, source, options = setup
  examples, analysis = analysis
  # Threshold at the 40% loss quantile: the threshold keeps some, the top-up adds others.
  threshold = float(np.quantile(analysis["loss"], 0.4))
  options = _options(options, loss_threshold=threshold, min_per_class=3, **changes)
  ref = _reference(examples, analysis, options["buffer_spec"])
  stats = build_lib.build_store(detector.model, params, source, str(tmp_path / "s"), **options)
  store = store_lib.ReplayStore.load(str(tmp_path / "s"), source=source)
  assert 0 < stats["kept_below_threshold"] < stats["images_kept"] < len(source)
  assert not os.path.exists(str(tmp_path / "s.build"))
  # Same images, in index order, kept by reference (no pixels in the store).
  assert store.by_reference and "images" not in store.examples
  np.testing.assert_array_equal(store.examples["source_index"], ref["keep"])
  np.testing.assert_array_equal(
    store.examples["image_id"], ref["examples"]["image_id"].astype(np.int64)
  )
  for k in store_lib.TARGET_KEYS:
    np.testing.assert_array_equal(store.examples[k], ref["examples"][k], err_msg=k)
  # Gathered images are decoded again, bit for bit the images the forward saw.
  gathered = store.gather(np.arange(store.num_images))
  for k in build_lib.EXAMPLE_KEYS + ("image_id",):
    assert gathered[k].dtype == ref["examples"][k].dtype, k
    np.testing.assert_array_equal(gathered[k], ref["examples"][k], err_msg=k)
  b = store.buffer_arrays
  np.testing.assert_array_equal(b["class_membership"], ref["membership"])
  # Unit-norm class embeddings (|x| <= 1): float32 sums in another order differ by ~1e-7.
  np.testing.assert_allclose(b["prototypes"], ref["prototypes"], atol=1e-5, rtol=0)
  np.testing.assert_allclose(b["class_embeddings"], ref["top_class"], atol=1e-5, rtol=0)
  np.testing.assert_allclose(b["query_embeddings"], ref["top_query"], atol=1e-5, rtol=1e-5)
  if options["buffer_spec"].image_features:
    np.testing.assert_allclose(b["image_features"], ref["image_features"], atol=1e-5, rtol=1e-5)
  else:
    assert "image_features" not in b
  finite = np.isfinite(ref["distances"])
  np.testing.assert_array_equal(np.isfinite(b["prototype_distances"]), finite)
  np.testing.assert_allclose(
    b["prototype_distances"][finite], ref["distances"][finite], atol=1e-5, rtol=0
  )
  # float16 storage: identical up to the rounding of nearly identical float32 logits.
  expected = store_lib.decode_logits(
    store_lib.encode_logits(ref["logits"], ref["examples"]["queries"]), ref["examples"]["queries"]
  )
  np.testing.assert_allclose(gathered["stored_logits"], expected, rtol=2**-10, atol=1e-3)


def _arrays(path):
  store = store_lib.ReplayStore.load(path)
  return {k: np.asarray(v) for k, v in store._arrays().items()}  # pylint: disable=protected-access


def _assert_same_store(a, b):
  a, b = _arrays(a), _arrays(b)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class _Stop(Exception):
  pass


# Every image kept (6 chunks in every pass), DER++ logits in bfloat16.
RESUME_SPEC = dict(loss_threshold=1e9, logits_dtype="bfloat16")


def _resume_options(options):
  """`build_options` with RESUME_SPEC and one-batch chunks."""
  return {**_with(options, **RESUME_SPEC), "chunk_images": BATCH}


@pytest.fixture(scope="module")
def whole(setup, tmp_path_factory):
  """The store of an uninterrupted build with RESUME_OPTIONS."""
  detector, params, source, options = setup
  path = str(tmp_path_factory.mktemp("whole") / "store")
  build_lib.build_store(detector.model, params, source, path, **_resume_options(options))
  return path


@pytest.mark.parametrize("stop_at", [("losses", 3), ("distances", 2)])
def test_interrupted_build_resumes_to_the_same_store(setup, whole, tmp_path, stop_at):
  detector, params, source, options = setup
  options = _resume_options(options)
  calls = []

  def stop(name, batches):
    calls.append((name, batches))
    if (name, batches) == stop_at:
      raise _Stop

  path = str(tmp_path / "resumed")
  with pytest.raises(_Stop):
    build_lib.build_store(detector.model, params, source, path, chunk_hook=stop, **options)
  assert not os.path.exists(path) and os.path.isdir(path + ".build")
  resumed = []
  build_lib.build_store(
    detector.model, params, source, path, chunk_hook=lambda *c: resumed.append(c), **options
  )
  # The resumed build starts at the chunk that was not committed.
  assert resumed[0] == stop_at
  assert not os.path.exists(path + ".build")
  _assert_same_store(whole, path)


@pytest.mark.slow
def test_killed_subprocess_build_resumes_to_the_same_store(setup, whole, tmp_path):
  detector, params, source, options = setup
  options = _resume_options(options)
  path = str(tmp_path / "killed")
  script = textwrap.dedent(
    f"""
    import dataclasses, os, signal
    from owl_cl import benchmark, pretrained
    from owl_cl.detector import Detector
    from owl_cl.replay import build, setup
    from owl_cl.testing.configs import tiny_config

    config = tiny_config("swil", {detector.config.cache_dir!r})
    config.data.eval_batch_size = {BATCH}
    detector = Detector(config)
    bench = benchmark.load_benchmark(config)
    params, _ = pretrained.pretrained_params(detector, bench, None)
    source = bench.pretrain.train
    options = setup.build_options(detector, source)
    options["buffer_spec"] = dataclasses.replace(options["buffer_spec"], **{RESUME_SPEC!r})
    options["chunk_images"] = {BATCH}

    def kill(name, batches):
      # Mid-chunk: pass 2's arrays of this chunk are written, its progress is not.
      if (name, batches) == ("features", 3):
        os.kill(os.getpid(), signal.SIGKILL)

    build.build_store(detector.model, params, source, {path!r}, chunk_hook=kill, **options)
    """
  )
  # The same platform as this process (the resumed half is compared bit for bit).
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert not os.path.exists(path)
  with np.load(os.path.join(path + ".build", "features.npz")) as z:
    assert int(z["batches"]) == 2
  resumed = []
  build_lib.build_store(
    detector.model, params, source, path, chunk_hook=lambda *c: resumed.append(c), **options
  )
  assert resumed[0] == ("features", 3)
  _assert_same_store(whole, path)


def test_build_folder_of_other_settings_is_restarted(setup, tmp_path):
  detector, params, source, options = setup
  path = str(tmp_path / "store")

  def stop(name, batches):
    if (name, batches) == ("features", 2):
      raise _Stop

  with pytest.raises(_Stop):
    build_lib.build_store(
      detector.model, params, source, path, chunk_hook=stop, **_resume_options(options)
    )
  # Another selection (no threshold, 3 images per class): pass 1 is redone, not resumed.
  calls = []
  changed = _with(_resume_options(options), loss_threshold=-np.inf, min_per_class=3)
  stats = build_lib.build_store(
    detector.model, params, source, path, chunk_hook=lambda *c: calls.append(c), **changed
  )
  assert calls[0] == ("losses", 1)
  assert store_lib.ReplayStore.load(path).num_images == stats["images_kept"] < len(source)
  build_lib.build_store(detector.model, params, source, str(tmp_path / "fresh"), **changed)
  _assert_same_store(str(tmp_path / "fresh"), path)


@pytest.mark.parametrize("budget, expected", [(3, 3), (1.0, None)])
def test_budget_brings_the_store_to_its_size(setup, tmp_path, budget, expected):
  """`replay.budget` (docs/baselines.md): a count of 3 stores 3 images, the fraction 1.0 the
  whole pre-training set (eq. 7's selection topped up in loss order)."""
  detector, params, source, options = setup
  path = str(tmp_path / "s")
  stats = build_lib.build_store(
    detector.model, params, source, path, **_with(options, budget=budget)
  )
  expected = len(source) if expected is None else expected
  assert store_lib.ReplayStore.load(path).num_images == stats["images_kept"] == expected


def _as_previous_version(path, dest, images):
  """A copy of the store at `path` as the previous version wrote it: format 1, the images'
  pixels `images` float32 [N, S, S, 3] in `examples.images`, no source indices."""
  shutil.copytree(path, dest)
  os.remove(os.path.join(dest, "examples.source_index.npy"))
  np.save(os.path.join(dest, "examples.images.npy"), images)
  with open(os.path.join(dest, "meta.json")) as f:
    meta = json.load(f)
  del meta["images"], meta["arrays"]["examples.source_index"]
  meta.update(format_version=1, arrays={"examples.images": "float32", **meta["arrays"]})
  with open(os.path.join(dest, "meta.json"), "w") as f:
    json.dump(meta, f)


def test_store_by_reference_gathers_what_the_pixel_store_did(
  setup, analysis, whole, tmp_path, caplog
):
  """The store by reference gathers the batches a store of the previous version (pixels)
  gathers for the same buffer, and such a store still loads and gathers, with one log line."""
  source = setup[2]
  examples, _ = analysis
  store = store_lib.ReplayStore.load(whole, source=source)
  kept = np.asarray(store.examples["source_index"])
  # The previous builder stored exactly the training examples' float32 images.
  _as_previous_version(whole, str(tmp_path / "old"), examples["images"][kept])
  with caplog.at_level(logging.INFO):
    old = store_lib.ReplayStore.load(str(tmp_path / "old"), source=source)
  lines = [r for r in caplog.records if "holds its images' pixels" in r.getMessage()]
  assert len(lines) == 1 and not old.by_reference
  indices = np.array([5, 0, 5, store.num_images - 1, 17])
  valid = np.array([True, True, False, True, True])
  a, b = store.gather(indices, valid), old.gather(indices, valid)
  assert (
    a.keys()
    == b.keys()
    == set(build_lib.EXAMPLE_KEYS)
    | {
      "image_id",
      "stored_logits",
      "example_mask",
      "buffer_index",
    }
  )
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  # Without its source, a store by reference reads but refuses to gather, saying why.
  with pytest.raises(ValueError, match="by reference"):
    store_lib.ReplayStore.load(whole).gather([0])


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"example_options": {"squash": False, "hflip": True}}, r"example_options set \['hflip'\]"),
    ({"logits_dtype": "int8"}, "logits_dtype='int8' is unknown"),
    ({"prototype_images": "kept"}, "replay.selection.prototype_images='kept' is unknown"),
  ],
  ids=["augmented", "logits_dtype", "prototype_images"],
)
def test_bad_buffer_spec_is_refused_when_made(setup, changes, message):
  """A `BufferSpec` the build cannot honour is refused when it is made, before any build
  (augmented examples: images by reference are re-made without the augmentation)."""
  spec = setup[3]["buffer_spec"]
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(spec, **changes)


class _EmptySource:
  class_names = ("a",)

  def __len__(self):
    return 0


def test_empty_source_is_refused_before_any_work(setup, tmp_path):
  detector, params, _, options = setup
  with pytest.raises(ValueError, match="pre-training set .* has no image"):
    build_lib.build_store(detector.model, params, _EmptySource(), str(tmp_path / "s"), **options)
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_owlv2_store_keeps_objectness_and_selection_may_include_it(pretrained_cache_dir, tmp_path):
  """OWLv2 (random tiny model: the builder does not care whether it is pre-trained): the store
  keeps each kept image's objectness logits (float16: relative rounding 2^-11) beside its
  class logits; the selection loss is the detection loss without the objectness term, or with
  it at loss.objectness_weight under `selection_objectness` (docs/owlv2.md)."""
  config = tiny_config("swil", pretrained_cache_dir)
  config.model.variant = "owlv2_tiny"
  config.loss.objectness_weight = 0.5
  config.data.eval_batch_size = BATCH
  detector = Detector(config)
  params = detector.init_params(0)
  # Random last layers (zero-initialised as scenic's) so that objectness varies per token.
  rng = np.random.default_rng(0)
  head = params["objectness_head"]["Dense_2"]
  head["kernel"] = rng.normal(0.0, 0.1, head["kernel"].shape).astype(np.float32)
  source = benchmark.load_benchmark(config).pretrain.train
  options = _with(replay_setup.build_options(detector, source), selection_objectness=True)
  spec = options["buffer_spec"]
  build_lib.build_store(detector.model, params, source, str(tmp_path / "s"), **options)
  store = store_lib.ReplayStore.load(str(tmp_path / "s"), source=source)
  gathered = store.gather(np.arange(store.num_images))
  # OWLv2's images by reference are re-made by its preprocessing (pad, then resize).
  assert store.image_reference["resize"] == "pad_then_resize"
  first = source.load(int(store.examples["source_index"][0]))["image"]
  np.testing.assert_array_equal(
    gathered["images"][0], owlv2_images.pad_then_resize(first, detector.image_size)
  )
  out = jax.jit(detector.model.apply)({"params": params}, gathered["images"], gathered["queries"])
  objectness = np.asarray(out["objectness_logits"])
  assert np.ptp(objectness, axis=1).min() > 0  # varies per token
  np.testing.assert_allclose(gathered["stored_objectness"], objectness, rtol=2**-10, atol=1e-6)

  # The per-image selection loss, with and without the objectness term.
  transform = build_lib.BufferExample(source, spec.seed, spec.example, {})
  examples = [transform(i) for i in range(BATCH)]
  batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
  batch["image_id"] = batch["image_id"].astype(np.int32)
  batch["valid"] = np.ones(BATCH, bool)
  step_options = dict(
    num_classes=len(source.class_names),
    top_k=spec.top_k,
    max_per_class=spec.max_per_class,
    distance_max_instances=4,
    loss_config=dict(spec.loss_config),
  )
  out = detector.model.apply({"params": params}, batch["images"], batch["queries"])
  det = {
    with_term: losses.detection_loss(
      out["pred_logits"],
      out["pred_boxes"],
      batch["labels"],
      batch["boxes"],
      objectness_logits=out["objectness_logits"] if with_term else None,
      **spec.loss_config,
    )["per_example"]
    for with_term in (False, True)
  }
  for with_term in (False, True):
    steps = build_steps.make_steps(
      detector.model, detector.mesh, **step_options, selection_objectness=with_term
    )
    got = steps["losses"](params, batch)["per_image_loss"]
    # Losses O(1-10) of the same float32 forward, jitted in another program: ~1e-6 relative.
    np.testing.assert_allclose(got, det[with_term], rtol=1e-5, err_msg=str(with_term))
  assert np.all(np.asarray(det[True]) > np.asarray(det[False]))  # the term is positive

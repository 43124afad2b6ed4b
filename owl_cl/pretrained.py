"""The model a run starts from: `config.init_checkpoint`, or pre-trained here and cached.

`pretrained_params` loads the configured checkpoint (owl_cl parameters, an HF folder or a
scenic msgpack), or the cached pre-trained model of the built-in benchmark, or pre-trains it
(`trainer.pretrain`) and caches it under `cache_dir/pretrained/<digest of its settings>`.

The cache entry is committed with a manifest of its files' SHA-256 (`integrity`), verified
before every load: a changed, cut or missing file sets the entry aside
(`<key>.corrupt-<time>`, never deleted) and the model is pre-trained again, with a warning
naming the file. Runs sharing the cache take the entry's lock (`<key>.lock`): one pre-trains,
the others wait and load its model (docs/stored_state.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from absl import logging
import jax
import ml_collections

from owl_cl import cache_keys
from owl_cl import config_spec
from owl_cl import distributed
from owl_cl import integrity
from owl_cl import model as model_lib
from owl_cl import trainer
from owl_cl import utils
from owl_cl.benchmark import Benchmark
from owl_cl.config_fields import ConfigError
from owl_cl.detector import Detector
from owl_cl.model import convert
from owl_cl.model import variants
from owl_cl.model.spec import ModelSpec
from owl_cl.train import checkpointing
from owl_cl.utils import digest
from owl_cl.utils import expand_path
from owl_cl.utils import file_digest

# The ModelConfig fields a parameter tree determines (`convert.infer_model_config`).
ARCHITECTURE_FIELDS = variants.ARCHITECTURE_FIELDS


def architecture(tree) -> dict[str, int] | None:
  """`ARCHITECTURE_FIELDS` read off a parameter tree (leaves with `.shape`); None when the
  tree is not an OWL-ViT's (a needed leaf is absent)."""
  try:
    config = convert.infer_model_config(tree)
  except (ValueError, KeyError, IndexError):
    return None
  return {f: int(getattr(config, f)) for f in ARCHITECTURE_FIELDS}


def describe_architecture(arch: dict[str, int] | None) -> str:
  """'variant 'tiny' with vision_width=64, ...' (the nearest of `model.VARIANTS`)."""
  if arch is None:
    return "an unknown architecture (not an OWL-ViT parameter tree)"

  def differing(variant):
    return {f: v for f, v in arch.items() if model_lib.VARIANTS[variant][f] != v}

  nearest = min(model_lib.VARIANTS, key=lambda v: len(differing(v)))
  extra = differing(nearest)
  if not extra:
    return f"variant {nearest!r}"
  return f"variant {nearest!r} with " + ", ".join(f"{f}={v}" for f, v in extra.items())


def params_checkpoint_problem(path: str, like, needs: str = "") -> str:
  """What keeps the owl_cl parameter checkpoint at `path` from loading into `like` ('' when
  nothing does), read from orbax's metadata (shapes) and `meta.json`, no array loaded.

  Args:
    path: a `checkpointing.save_params` folder (expanded). like: the model's parameter tree
      (leaves with `.shape`, e.g. ShapeDtypeStruct). needs: how the config names its model
      (e.g. "config.model.variant='tiny' with overrides {...}").

  Returns:
    A message naming `path`, the model it holds (meta.json's `model` when saved by owl_cl,
    and the architecture read off the stored shapes), the model the config needs, and every
    differing architecture field; '' when every parameter has the model's shape.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  try:
    metadata = ocp.StandardCheckpointer().metadata(os.path.join(path, "params"))
    stored = convert.tree.flatten(dict(getattr(metadata, "item_metadata", metadata)))
  except Exception as e:  # pylint: disable=broad-except
    # Orbax raises a variety of errors for damaged metadata; any of them means unreadable.
    return f"config.init_checkpoint={path}: cannot read its parameter metadata ({e})"
  expected = convert.tree.flatten(like)
  wrong = sorted(
    k for k in set(stored) & set(expected) if tuple(stored[k].shape) != tuple(expected[k].shape)
  )
  missing = sorted(set(expected) - set(stored))
  unexpected = sorted(set(stored) - set(expected))
  if not (wrong or missing or unexpected):
    return ""
  held_arch = architecture(convert.tree.unflatten(stored))
  needed_arch = architecture(like)
  held = describe_architecture(held_arch)
  meta_path = os.path.join(path, "meta.json")
  saved_model = None
  if os.path.isfile(meta_path):
    try:
      with open(meta_path) as f:
        saved_model = json.load(f).get("model")
    except (OSError, ValueError):
      saved_model = None
  if saved_model:
    held += f" (meta.json: saved from config.model {json.dumps(saved_model, sort_keys=True)})"
  lines = [
    f"config.init_checkpoint={path} holds another model: {held}; the config needs "
    f"{describe_architecture(needed_arch)}" + (f" ({needs})" if needs else "")
  ]
  if held_arch and needed_arch:
    diff = [f for f in ARCHITECTURE_FIELDS if held_arch[f] != needed_arch[f]]
    if diff:
      lines.append(
        "differing: "
        + ", ".join(f"{f} {held_arch[f]} (checkpoint) vs {needed_arch[f]} (config)" for f in diff)
      )
  lines.append(
    f"{len(wrong)} parameters of another shape, {len(missing)} missing, {len(unexpected)} "
    "unexpected; use a checkpoint of this model, or set config.model to the checkpoint's"
  )
  return "\n    ".join(lines)


def hf_checkpoint_problem(path: str, like, needs: str = "") -> str:
  """What makes the HF `OwlViTForObjectDetection` folder `path` another model than `like`
  ('' when its config.json gives the same architecture, or cannot be read: the loader then
  names what is wrong), from config.json alone (no weights read).

  Args and message: as `params_checkpoint_problem`.
  """
  try:
    held = convert.hf_config_to_model_config(path)
  except (ValueError, ImportError, OSError, KeyError, TypeError):
    return ""
  held_arch = {f: int(getattr(held, f)) for f in ARCHITECTURE_FIELDS}
  needed_arch = architecture(like)
  if needed_arch is None or held_arch == needed_arch:
    return ""
  diff = [f for f in ARCHITECTURE_FIELDS if held_arch[f] != needed_arch[f]]
  return "\n    ".join(
    [
      f"config.init_checkpoint={path} holds another model: "
      f"{describe_architecture(held_arch)} (its config.json); the config needs "
      f"{describe_architecture(needed_arch)}" + (f" ({needs})" if needs else ""),
      "differing: "
      + ", ".join(f"{f} {held_arch[f]} (checkpoint) vs {needed_arch[f]} (config)" for f in diff),
      "use a checkpoint of this model, or set config.model to the checkpoint's",
    ]
  )


def model_description(config: ml_collections.ConfigDict) -> str:
  """ "config.model.variant='tiny' with overrides {...}" (for error messages; a config whose
  `model` fields break their rules raises their ConfigError)."""
  return config_spec.from_config(ModelSpec, config.model, "model").description()


def load_init_checkpoint(path: str, like, needs: str = "") -> tuple[Any, dict]:
  """Parameters of `config.init_checkpoint`. Returns (params, meta).

  Formats, recognised by what `path` holds: an owl_cl parameter checkpoint (a folder with
  `params/`, `owl_cl.train.checkpointing.save_params`); an HF `OwlViTForObjectDetection`
  folder (`config.json` + weights); otherwise a scenic msgpack file (or a folder of
  `checkpoint_<step>` files). Scenic and HF go through owl_cl.model.convert.

  Args:
    path: the checkpoint (expanded).
    like: ShapeDtypeStruct tree of the model's parameters.

    needs: how the config names its model, quoted in the errors (`model_description`).

  Raises:
    owl_cl.model.convert.CheckpointMismatchError: an owl_cl checkpoint of another model
      (names `path`, the model it holds and the model the config needs, checked on the
      stored shapes before any array is read: `params_checkpoint_problem`); an HF or scenic
      checkpoint listing every missing, unexpected or wrongly shaped parameter against the
      configured model (e.g. a B/32 checkpoint for the L/14 config).
    FileNotFoundError: nothing readable at `path`.
  """
  if os.path.isdir(os.path.join(path, "params")):
    problem = params_checkpoint_problem(path, like, needs)
    if problem:
      raise convert.CheckpointMismatchError(path, what=f" of the config: {problem}")
    return checkpointing.load_params(path, like)
  what = f" ({needs})" if needs else ""
  try:
    if os.path.isfile(os.path.join(path, "config.json")):
      params, hf_config = convert.load_hf_checkpoint(path)
      params = convert.check_params(params, like, path)
      return params, {"source": path, "format": "hf", "hf_model_config": str(hf_config)}
    params = convert.load_scenic_checkpoint(path, like)
  except convert.CheckpointMismatchError as e:
    if not what:
      raise
    raise convert.CheckpointMismatchError(
      e.source, e.missing, e.unexpected, e.wrong_shape, what=what
    ) from e
  return params, {"source": path, "format": "scenic"}


def cache_entry(detector: Detector, bench: Benchmark) -> tuple[str, str]:
  """(path, key) of the pre-trained model's cache entry, `cache_dir/pretrained/<key>`.

  The key covers everything pre-training depends on (model, data, pre-training config, seed,
  the pre-training annotation file's content), so a changed setting never reuses a stale
  model (`cache_key`).
  """
  # The detector's typed settings: the same specs `cache_key` converts from a config.
  record = cache_keys.PretrainedKeySpec(
    model=detector.model_spec,
    pretrain=detector.pretrain_spec,
    train=detector.train_spec,
    data=detector.data_spec,
    loss=detector.loss_spec,
    seed=detector.run.seed_of("model"),
    resize=detector.resize_method,
    pretrain_data=file_digest(bench.pretrain.train.annotation_file),
  )
  key = digest(cache_keys.key_material(record, cache_keys.PRETRAINED))
  return os.path.join(expand_path(detector.run.cache_dir), "pretrained", key), key


def cache_key(
  config: ml_collections.ConfigDict, model: ModelSpec, *, resize_method: str, pretrain_data: str
) -> str:
  """The pre-trained model's cache key: a 16-hex-character digest (`utils.digest`) of the
  `cache_keys.key_material` of its `cache_keys.PretrainedKeySpec`: the specs pre-training
  reads (model, pretrain, the train fields it reads, data, loss), each field keyed or saying
  why not, the model's seed, the preprocessing and the pre-training annotations.

  Args:
    config: the run's config (its pretrain, train, data and loss sections and seeds).
    model: `config.model` as its spec (`Detector.model_spec`).
    resize_method: the detector's (an OWLv2 model's own preprocessing enters the key).
    pretrain_data: the digest of the pre-training annotation file (`utils.file_digest`).

  Raises:
    ConfigError: a `pretrain`, `train`, `data`, `loss` or top-level field that breaks its rule.
  """
  record = cache_keys.pretrained_key_spec(
    config, model, resize_method=resize_method, pretrain_data=pretrain_data
  )
  return digest(cache_keys.key_material(record, cache_keys.PRETRAINED))


def check_read_only_cache(detector: Detector, bench: Benchmark) -> None:
  """Refuses, before the run writes anything, a cache that cannot be written and lacks the
  pre-trained model the run needs (it would be pre-trained for hours, then not stored).

  Only whether the entry is there is checked here; its files are verified when it is
  loaded (`pretrained_params`). Nothing to check with `init_checkpoint` or real data.

  Raises:
    utils.ReadOnlyCacheError: no entry, and its folder cannot be written (`os.access`, as
      `experiment.enable_compilation_cache`; the entry lock detects the same from its lock
      file's open).
  """
  if detector.run.init_checkpoint or detector.real_data:
    return
  path, _ = cache_entry(detector, bench)
  if not os.path.exists(path) and not os.access(utils.nearest_existing(path), os.W_OK):
    raise utils.ReadOnlyCacheError(path, "the pre-trained model", "not in the cache")


def pretrained_params(
  detector: Detector, bench: Benchmark, writer, step_checkpoints=None
) -> tuple[Any, dict]:
  """Loads `init_checkpoint`, or the cached pre-trained model, or pre-trains and caches it.

  The cache key covers everything pre-training depends on (model, data, pre-training
  config, seed), so a changed setting never reuses a stale model. `step_checkpoints`
  (`checkpointing.StepCheckpointer` of the run's workdir, phase 0; None: none): a killed
  pre-training resumes from its newest step checkpoint there; they are deleted once the
  finished model is in the cache (written atomically, as before).

  Raises:
    owl_cl.preemption.Preempted: SIGTERM during pre-training (after its step checkpoint).
    utils.ReadOnlyCacheError: the cache cannot be written and holds no intact model (one
      found damaged is named as such).
  """
  like = jax.eval_shape(lambda: detector.init_params(detector.run.seed_of("model")))
  if detector.run.init_checkpoint:
    return load_init_checkpoint(
      expand_path(detector.run.init_checkpoint), like, needs=detector.model_spec.description()
    )
  if detector.real_data:
    raise ConfigError("config.init_checkpoint is required with real data (config.data.root)")
  path, key = cache_entry(detector, bench)
  # One run pre-trains while the others sharing the cache wait for its model (the lock), and
  # whoever gets the lock looks again: the model may have been cached meanwhile.
  with distributed.cache_entry_lock(path, "pre-trained model") as writable:
    # The writer checks the files; every process then loads them together (orbax's restore
    # synchronises the processes of a multi-process run).
    usable = check_cached_model(path) if distributed.is_writer() else False
    loaded = load_cached_model(path, like) if distributed.writer_value(usable) else None
    if loaded is not None:
      logging.info("re-using the cached pre-trained model %s", path)
      return loaded
    if not writable:
      raise utils.ReadOnlyCacheError(path, "the pre-trained model", "not in the cache")
    logging.info("no cached pre-trained model: pre-training (cache %s)", path)
    start = time.time()
    # Looked up on the module at call time, so a test can replace it.
    params, curve = trainer.pretrain(detector, bench, writer, step_checkpoints)
    meta = {"seconds": round(time.time() - start, 1), "curve": curve, "cache_key": key}
    # The model it holds, named when it is given as another config's init_checkpoint.
    meta["model"] = config_spec.key_material(detector.model_spec)  # as in its key
    meta["validation"] = detector.evaluate(params, bench.pretrain.test, "pre-training val")
    # One writer: the temporary folder and the rename are not safe to run on several hosts
    # sharing the cache; the others wait until the model is on disk.
    if distributed.is_writer():
      save_cached_model(path, params, meta)
    distributed.barrier("pretrained-saved", timeout_s=600.0)
  if step_checkpoints is not None:
    step_checkpoints.discard(0)
  return params, meta


# meta.json of a cache entry written with a manifest says so: an entry of this version whose
# manifest is gone is damaged, not one of an earlier version.
CHECKSUMS_FIELD = "checksums"


def save_cached_model(path: str, params, meta: dict) -> None:
  """Writes the pre-trained model's cache entry `path` atomically, its manifest last.

  The parameters and `meta.json` (`checkpointing.save_params`, with `CHECKSUMS_FIELD` added)
  and then the manifest of their digests (`integrity.write_manifest`) are written in a
  temporary sibling folder that is renamed to `path` once complete: a folder at `path` always
  has its manifest.

  Raises:
    OSError: a write failed (nothing is left at `path`).
  """
  # 'keep': the caller holds the entry's lock and found no entry; should another writer have
  # committed one all the same (a file system whose locks do not hold across hosts), it holds
  # the same model and stays.
  with utils.atomic_directory(path, if_exists="keep") as tmp:
    checkpointing.save_params(tmp, params, dict(meta, **{CHECKSUMS_FIELD: True}), overwrite=True)
    integrity.write_manifest(tmp)


def check_cached_model(path: str) -> bool:
  """Whether the cached pre-trained model at `path` may be loaded: it passes its check.

  Every file is checked against the entry's manifest (streamed SHA-256, `integrity`), no
  array read. A damaged entry (a file changed, cut or missing, the manifest missing or
  unreadable) is set aside (`integrity.set_aside`: renamed `<path>.corrupt-<time>`, a
  warning naming the file) and False returned, so the caller pre-trains again. An entry
  cached before manifests were written (its meta.json without `CHECKSUMS_FIELD`) passes
  unverified with a warning (`load_cached_model` then sets it aside if it does not load).

  Args:
    path: the entry (`cache_dir/pretrained/<key>`).

  Returns:
    True when the entry is there and intact (or of an earlier version); False when there is
    none or it was set aside.

  Raises:
    OSError: the entry cannot be renamed aside (e.g. a read-only cache).
  """
  if not os.path.exists(path):
    return False
  try:
    _check_cached_model(path)
  except integrity.IntegrityError as e:
    integrity.set_aside(path, str(e))
    logging.warning("the cached pre-trained model was damaged (%s); pre-training it again", e)
    return False
  return True


def load_cached_model(path: str, like) -> tuple[Any, dict] | None:
  """The cached pre-trained model at `path`, once `check_cached_model` passed it.

  Called by every process of a run together. An entry of an earlier version (no manifest)
  that does not load is set aside with a warning and None returned (single-process runs;
  in a multi-process run the error is raised: the processes could not agree on a rebuild).

  Args:
    path: the entry. like: the parameters' ShapeDtypeStruct tree.

  Returns:
    (params, meta) as `checkpointing.load_params`, meta without `CHECKSUMS_FIELD`; None when
    the entry was set aside.

  Raises:
    Exception: whatever orbax raises for an entry that passed its manifest check yet does not
      load (not damage: a real error), or for any entry in a multi-process run.
  """
  try:
    params, meta = checkpointing.load_params(path, like)
  except Exception as e:  # pylint: disable=broad-except
    # orbax raises a variety of errors for damaged files of an unverified entry.
    if integrity.has_manifest(path) or jax.process_count() > 1:
      raise
    integrity.set_aside(path, f"does not load ({type(e).__name__}: {e})")
    logging.warning("the cached pre-trained model does not load (%s); pre-training it again", e)
    return None
  meta.pop(CHECKSUMS_FIELD, None)
  return params, meta


def _check_cached_model(path: str) -> bool:
  """Verifies the entry at `path`; True when checked against a manifest, False for an entry
  of an earlier version (unverified, logged).

  Raises:
    IntegrityError: a file differs from the manifest, or the manifest or meta.json is missing.
  """
  if integrity.has_manifest(path):
    integrity.verify_directory(path)
    return True
  integrity.check_unmanifested(path, CHECKSUMS_FIELD)
  logging.warning(
    "the cached pre-trained model %s predates checksums: loaded unverified (delete it to "
    "pre-train it again with checksums)",
    path,
  )
  return False

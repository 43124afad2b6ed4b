"""Building the replay buffer from the pre-training set with the pre-trained model
(docs/reference.md §6).

One eval-mode forward pass of the pre-trained model over every pre-training image (with its
fixed, seeded training queries) gives, per image: the detection loss (eq. 7 ranks images by
it), the logits to distil (DER++), the top-k class and query embeddings (retrieval features)
and the per-class token embeddings that make the class prototypes. `select_buffer` keeps the
images with loss < t and tops every class up to its minimum; prototypes and prototype
distances are computed over the kept images. The result is a `ReplayStore`, cached on disk
under a key of everything it depends on.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from owl_cl import distributed
from owl_cl.data import pipeline
from owl_cl.replay import buffer_selection
from owl_cl.replay import state as state_lib
from owl_cl.replay import store as store_lib
from owl_cl.train import losses
from owl_cl.utils import atomic_write_json
from owl_cl.utils import digest

# The arrays of a stored example (defined once, by the store that holds them).
EXAMPLE_KEYS = store_lib.REQUIRED_EXAMPLE_KEYS


def preprocess_source(
  source,
  *,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  image_size: int,
  num_queries: int,
  max_instances: int,
  num_negatives: int,
  seed: int,
  **options,
) -> dict[str, np.ndarray]:
  """Fixed training examples of every image of `source` (queries drawn once, seeded).

  `options` go to `pipeline.preprocess_train_example` (squash, merge_iou, negative_weights:
  the run's preprocessing; no augmentation).

  Returns:
    dict of stacked arrays with the batch-dict keys `EXAMPLE_KEYS` ([N, ...]) plus
    `image_id` [N]; the negatives of image i come from `pipeline.example_rng(seed, 0, i)`.
  """
  examples = []
  for i in tqdm.trange(len(source), desc="buffer: preprocessing", mininterval=2.0):
    examples.append(
      pipeline.preprocess_train_example(
        source.load(i),
        class_tokens=class_tokens,
        empty_tokens=empty_tokens,
        image_size=image_size,
        num_queries=num_queries,
        max_instances=max_instances,
        num_negatives=num_negatives,
        rng=pipeline.example_rng(seed, 0, i),
        **options,
      )
    )
  stacked = pipeline.stack_examples(examples)
  return {k: stacked[k] for k in EXAMPLE_KEYS + ("image_id",)}


def _batches(n: int, batch_size: int):
  for start in range(0, n, batch_size):
    idx = np.arange(start, min(start + batch_size, n))
    # Pad the last batch with copies of its first row (static shapes); sliced off after.
    yield idx, np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])


def analyse_images(
  model,
  params,
  examples: dict[str, np.ndarray],
  *,
  num_classes: int,
  top_k: int,
  max_per_class: int,
  loss_config: dict,
  batch_size: int,
  image_features: bool = False,
) -> dict[str, np.ndarray]:
  """Per-image quantities of the pre-trained model (one jitted forward per batch).

  Returns dict (N images, T tokens, Q queries, E width, C classes):
    per_image_loss float32 [N] (detection loss, docs/reference.md §3), logits float32 [N,T,Q],
    top_class_embeddings / top_query_embeddings float32 [N,k,E] (docs/reference.md §6),
    prototype_sums float32 [N,C,E], prototype_counts float32 [N,C] (top-n_c tokens per class,
    n_c = min(max_per_class, #instances)), instance_counts int32 [N,C],
    class_embeddings float32 [N,T,E] (for the prototype distances); with `image_features`
    also top_image_features [N,k,D] (the ViT output tokens of the same top-k tokens).
  """

  @jax.jit
  def forward(params, batch):
    out = model.apply({"params": params}, batch["images"], batch["queries"], train=False)
    det = losses.detection_loss(
      out["pred_logits"], out["pred_boxes"], batch["labels"], batch["boxes"], **loss_config
    )
    query_mask = batch["queries"][..., 0] > 0
    top_class, top_query = buffer_selection.top_k_embeddings(
      out["pred_logits"], out["class_embeddings"], out["query_embeddings"], query_mask, top_k
    )
    counts = buffer_selection.instance_counts_from_labels(
      batch["labels"], batch["query_class"], num_classes
    )
    sums, token_counts = buffer_selection.per_image_class_token_embeddings(
      out["pred_logits"],
      out["class_embeddings"],
      batch["query_class"],
      counts,
      max_per_class=max_per_class,
    )
    result = {
      "per_image_loss": det["per_example"],
      "logits": out["pred_logits"],
      "top_class_embeddings": top_class,
      "top_query_embeddings": top_query,
      "prototype_sums": sums,
      "prototype_counts": token_counts,
      "instance_counts": counts,
      "class_embeddings": out["class_embeddings"],
    }
    if image_features:
      feature_map = out["feature_map"]
      result["top_image_features"] = buffer_selection.top_k_token_features(
        out["pred_logits"],
        feature_map.reshape(feature_map.shape[0], -1, feature_map.shape[-1]),
        query_mask,
        top_k,
      )
    return result

  n = examples["images"].shape[0]
  parts: dict[str, list] = {}
  for idx, padded in tqdm.tqdm(
    list(_batches(n, batch_size)), desc="buffer: pre-trained model forward", mininterval=2.0
  ):
    batch = {k: jnp.asarray(examples[k][padded]) for k in EXAMPLE_KEYS}
    out = jax.device_get(forward(params, batch))
    for k, v in out.items():
      parts.setdefault(k, []).append(np.asarray(v)[: len(idx)])
  return {k: np.concatenate(v) for k, v in parts.items()}


def build_store(
  model,
  params,
  source,
  *,
  class_tokens: np.ndarray,
  empty_tokens: np.ndarray,
  image_size: int,
  num_queries: int,
  max_instances: int,
  num_negatives: int,
  seed: int,
  loss_threshold: float,
  min_per_class: int,
  fill_all_for_rare_classes: bool,
  top_k: int,
  max_per_class: int,
  loss_config: dict,
  batch_size: int,
  example_options: dict | None = None,
  distance_max_instances: int | None = None,
  drop_images_without_class: bool = False,
  top_up_order: str = "class_index",
  prototype_images: str = "buffer",
  image_features: bool = False,
) -> tuple[store_lib.ReplayStore, dict]:
  """Selects the buffer from `source` (the pre-training set) and builds its `ReplayStore`.

  Selection is eq. 7 of the paper (docs/reference.md §6): loss < `loss_threshold`, then each class
  with
  fewer than `min_per_class` kept images gets its images in ascending loss order.
  `example_options`: preprocessing options of `preprocess_source` (the run's squash,
  merge_iou, negative_weights). `distance_max_instances`: cap on the class-c embeddings an
  image's prototype distance takes the min over (None: all its instances, the paper; 6: the
  released code, which reuses the prototype's top-n_c tokens). `drop_images_without_class`,
  `top_up_order`: `selection.select_buffer`'s options. `prototype_images`: the prototypes
  average the kept images ('buffer') or every image of `source` ('all', released code;
  `buffer_selection.buffer_prototypes`). `image_features`: also store the top-k tokens' ViT
  features (ASER on image features, `replay.aser.asv_features`).

  Returns:
    (store, statistics dict: images considered / kept, per-class counts, loss quantiles).

  Raises:
    ValueError: if no image is selected (threshold and minimum both select nothing), or an
      unknown `prototype_images` (before any work).
  """
  if prototype_images not in buffer_selection.PROTOTYPE_IMAGES:
    raise ValueError(
      f"replay.selection.prototype_images={prototype_images!r} is unknown; "
      f"known: {list(buffer_selection.PROTOTYPE_IMAGES)}"
    )
  num_classes = len(source.class_names)
  examples = preprocess_source(
    source,
    class_tokens=class_tokens,
    empty_tokens=empty_tokens,
    image_size=image_size,
    num_queries=num_queries,
    max_instances=max_instances,
    num_negatives=num_negatives,
    seed=seed,
    **(example_options or {}),
  )
  analysis = analyse_images(
    model,
    params,
    examples,
    num_classes=num_classes,
    top_k=top_k,
    max_per_class=max_per_class,
    loss_config=loss_config,
    batch_size=batch_size,
    image_features=image_features,
  )
  membership = analysis["instance_counts"] > 0
  keep = buffer_selection.select_buffer(
    analysis["per_image_loss"],
    membership,
    loss_threshold,
    min_per_class=min_per_class,
    fill_all_for_rare_classes=fill_all_for_rare_classes,
    drop_images_without_class=drop_images_without_class,
    top_up_order=top_up_order,
  )
  if not keep.any():
    raise ValueError(
      f"replay.selection selected no image (loss_threshold={loss_threshold}, "
      f"min_per_class={min_per_class})"
    )
  prototypes, _ = buffer_selection.buffer_prototypes(
    analysis["prototype_sums"], analysis["prototype_counts"], keep, prototype_images
  )
  distances = jax.jit(buffer_selection.prototype_distances, static_argnames=("max_instances",))(
    jnp.asarray(analysis["logits"][keep]),
    jnp.asarray(analysis["class_embeddings"][keep]),
    jnp.asarray(examples["query_class"][keep]),
    jnp.asarray(analysis["instance_counts"][keep]),
    prototypes,
    max_instances=max_instances if distance_max_instances is None else distance_max_instances,
  )
  buffer = state_lib.make_replay_buffer(
    jnp.asarray(membership[keep]),
    prototypes,
    distances,
    jnp.asarray(analysis["top_class_embeddings"][keep]),
    jnp.asarray(analysis["top_query_embeddings"][keep]),
    jnp.asarray(analysis["top_image_features"][keep]) if image_features else None,
  )
  store = store_lib.ReplayStore(
    {k: examples[k][keep] for k in EXAMPLE_KEYS},
    analysis["logits"][keep],
    buffer,
    source.class_names,
  )
  loss = analysis["per_image_loss"]
  stats = {
    "images_considered": int(len(keep)),
    "images_kept": int(keep.sum()),
    "kept_below_threshold": int((loss < loss_threshold).sum()),
    "images_per_class": {
      name: int(membership[keep][:, c].sum()) for c, name in enumerate(source.class_names)
    },
    "loss_quantiles": {
      q: float(np.quantile(loss, float(q))) for q in ("0.1", "0.25", "0.5", "0.75", "0.9")
    },
  }
  return store, stats


def cached_store(
  cache_root: str,
  key_material: dict,
  build_fn,
  superseded: tuple[tuple[dict, str], ...] = (),
) -> tuple[store_lib.ReplayStore, dict]:
  """Loads the store cached under a digest of `key_material`, or builds and caches it.

  The store is written to a temporary folder and renamed (ReplayStore.save), so an
  interrupted build never leaves a cache that is later trusted.

  Args:
    cache_root: folder of the cached stores (one sub-folder per key digest).
    key_material: JSON-able dict of everything the store depends on.
    build_fn: `() -> (ReplayStore, stats dict)`.
    superseded: (key material, reason) of stores that earlier code versions cached for the
      same run; when one of them is on disk and the current one is not, the rebuild is
      logged with its reason (e.g. class embeddings that were stored unnormalised).
  Returns:
    (store, stats dict with "seconds").
  """
  key = digest(key_material)
  path = os.path.join(cache_root, key)
  stats_path = path + ".stats.json"
  if os.path.isdir(path) and os.path.exists(stats_path):
    logging.info("re-using the cached replay buffer %s", path)
    with open(stats_path) as f:
      return store_lib.ReplayStore.load(path), json.load(f)
  for old_material, reason in superseded:
    old_path = os.path.join(cache_root, digest(old_material))
    if os.path.isdir(old_path):
      logging.warning(
        "the replay buffer cached in %s is out of date (%s); rebuilding it in %s",
        old_path,
        reason,
        path,
      )
  start = time.time()
  store, stats = build_fn()
  stats["seconds"] = round(time.time() - start, 1)
  # Every process built the same store (deterministic in the key); one writes the cache.
  if distributed.is_writer():
    os.makedirs(cache_root, exist_ok=True)
    if not os.path.isdir(path):
      store.save(path)
    atomic_write_json(stats_path, stats, indent=2)
  distributed.barrier("buffer-cached", timeout_s=600.0)
  logging.info(
    "replay buffer: %d of %d images (%.1f s), cached in %s",
    stats["images_kept"],
    stats["images_considered"],
    stats["seconds"],
    path,
  )
  return store, stats

"""The jitted per-batch functions of the replay buffer's three build passes
(docs/reference.md §6): the eval-mode forward of the pre-trained model, then the detection loss
and class membership (pass 1), the logits, top-k embeddings and prototype sums (pass 2), or the
prototype distances (pass 3). `replay.build` streams the batches through them.
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import jax
import jax.numpy as jnp

from owl_cl.replay import buffer_selection
from owl_cl.replay import store as store_lib
from owl_cl.train import losses
from owl_cl.train import sharding as sharding_lib
from owl_cl.train import top_k as top_k_lib

# The arrays of an example the store keeps: all but the pixels, plus the image id, which with
# the source index (written from the selection) references the image.
STORED_EXAMPLE_KEYS = store_lib.TARGET_KEYS + ("image_id",)


def make_steps(
  model,
  mesh,
  *,
  num_classes: int,
  top_k: int,
  max_per_class: int,
  distance_max_instances: int,
  loss_config: dict,
  prototype_sums_of_all: bool = False,
  image_features: bool = False,
  selection_objectness: bool = False,
) -> dict[str, Callable]:
  """The jitted per-batch functions of the three passes (outputs replicated on the mesh).

  Every function takes (params, batch) with the batch dict's `EXAMPLE_KEYS` [B, ...], plus
  `image_id` int32 [B] and `valid` bool [B] (False for padding rows), sharded along 'data'.

  Returns dict:
    'losses': -> per_image_loss float32 [B] (docs/reference.md §3), membership bool [B, C];
      with `prototype_sums_of_all` also the batch's prototype_sums / prototype_counts (as
      'features': the prototypes over every image, `prototype_images='all'`).
    'features': -> logits float32 [B, T, Q] (OWLv2: and objectness float32 [B, T]),
      top_class_embeddings / top_query_embeddings
      float32 [B, k, E] (`train.top_k.top_k_embeddings`), prototype_sums float32 [C, E]
      and prototype_counts int32 [C] summed over the valid rows
      (`buffer_selection.per_image_class_token_embeddings`), and the batch's examples
      without their pixels (`STORED_EXAMPLE_KEYS`), so that the writer has every process's
      rows; with
      `image_features` also top_image_features [B, k, D] (the ViT output tokens of the top-k
      tokens, `train.top_k.top_k_token_features`).
    'distances': (params, batch, prototypes float32 [C, E]) -> prototype_distances float32
      [B, C] (`buffer_selection.prototype_distances` with `distance_max_instances`).
  With `selection_objectness` (OWLv2), 'losses' adds the objectness term at the loss config's
  `objectness_weight` to each image's loss (docs/owlv2.md, buffer selection); without it, and
  for v1, the loss is the detection loss's class and box terms.
  The functions are module-level `jax.jit`s whose static arguments are the model (a linen
  module: hashed and compared by its configuration), the mesh and these options, so a later
  build with the same ones (a resumed build, the tests) reuses jit's compilations.
  Source: docs/reference.md §6.
  """
  options = dict(
    num_classes=int(num_classes),
    top_k=int(top_k),
    max_per_class=int(max_per_class),
    distance_max_instances=int(distance_max_instances),
    loss_config=tuple(sorted(loss_config.items())),
    prototype_sums_of_all=bool(prototype_sums_of_all),
    image_features=bool(image_features),
    selection_objectness=bool(selection_objectness),
  )
  static = dict(model=model, mesh=mesh, options=tuple(sorted(options.items())))
  return {
    "losses": functools.partial(_losses_step, **static),
    "features": functools.partial(_features_step, **static),
    "distances": functools.partial(_distances_step, **static),
  }


_STATIC = ("model", "mesh", "options")


def _forward(model, options, params, batch):
  out = model.apply({"params": params}, batch["images"], batch["queries"], train=False)
  counts = buffer_selection.instance_counts_from_labels(
    batch["labels"], batch["query_class"], options["num_classes"]
  )
  return out, counts


def _prototype_sums(options, out, counts, batch):
  sums, token_counts = buffer_selection.per_image_class_token_embeddings(
    out["pred_logits"],
    out["class_embeddings"],
    batch["query_class"],
    counts,
    max_per_class=options["max_per_class"],
  )
  # Reduced on the device: the host receives [C, E], not [B, C, E].
  valid = batch["valid"]
  return {
    "prototype_sums": jnp.sum(jnp.where(valid[:, None, None], sums, 0.0), axis=0),
    "prototype_counts": jnp.sum(jnp.where(valid[:, None], token_counts, 0), axis=0),
  }


@functools.partial(jax.jit, static_argnames=_STATIC)
def _losses_step(params, batch, *, model, mesh, options):
  options = dict(options)
  out, counts = _forward(model, options, params, batch)
  det = losses.detection_loss(
    out["pred_logits"],
    out["pred_boxes"],
    batch["labels"],
    batch["boxes"],
    # OWLv2: the objectness term counts in the selection loss only when asked
    # (replay.selection.objectness_in_loss, docs/owlv2.md); v1 has no objectness logits.
    objectness_logits=out.get("objectness_logits") if options["selection_objectness"] else None,
    **dict(options["loss_config"]),
  )
  result = {"per_image_loss": det["per_example"], "membership": counts > 0}
  if options["prototype_sums_of_all"]:
    result.update(_prototype_sums(options, out, counts, batch))
  return jax.lax.with_sharding_constraint(result, sharding_lib.replicated(mesh))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _features_step(params, batch, *, model, mesh, options):
  options = dict(options)
  top_k = options["top_k"]
  out, counts = _forward(model, options, params, batch)
  query_mask = batch["queries"][..., 0] > 0
  top_class, top_query = top_k_lib.top_k_embeddings(
    out["pred_logits"], out["class_embeddings"], out["query_embeddings"], query_mask, top_k
  )
  result = {
    "logits": out["pred_logits"],
    "top_class_embeddings": top_class,
    "top_query_embeddings": top_query,
    **_prototype_sums(options, out, counts, batch),
    **{k: batch[k] for k in STORED_EXAMPLE_KEYS},
  }
  if "objectness_logits" in out:  # OWLv2: distilled by DER++ too (docs/owlv2.md)
    result["objectness"] = out["objectness_logits"]
  if options["image_features"]:
    feature_map = out["feature_map"]
    result["top_image_features"] = top_k_lib.top_k_token_features(
      out["pred_logits"],
      feature_map.reshape(feature_map.shape[0], -1, feature_map.shape[-1]),
      query_mask,
      top_k,
    )
  return jax.lax.with_sharding_constraint(result, sharding_lib.replicated(mesh))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _distances_step(params, batch, prototypes, *, model, mesh, options):
  options = dict(options)
  out, counts = _forward(model, options, params, batch)
  distances = buffer_selection.prototype_distances(
    out["pred_logits"],
    out["class_embeddings"],
    batch["query_class"],
    counts,
    prototypes,
    max_instances=options["distance_max_instances"],
  )
  return jax.lax.with_sharding_constraint(distances, sharding_lib.replicated(mesh))

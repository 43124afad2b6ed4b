"""Prompt templates for OWL-ViT queries: training prompts and evaluation ensembles
(docs/reference.md §2).

* :data:`CLIP_IMAGENET_TEMPLATES`: the 80 ImageNet prompt templates of OpenAI CLIP (notebook
  ``notebooks/Prompt_Engineering_for_ImageNet.ipynb``, ``imagenet_templates``; the same list
  is scenic's ``CLIP_PAPER_PROMPT_TEMPLATES``), in the notebook's order.
* :data:`TRAINING_TEMPLATES` = ``('{}',) + CLIP_IMAGENET_TEMPLATES`` (81): scenic's
  ``TRAINING_PROMPT_TEMPLATES``; one is drawn uniformly per label and image during training.
* :data:`OWL_VIT_EVAL_TEMPLATES`: the 7 evaluation templates of docs/reference.md §2 (CLIP's best 7,
  scenic's ``CLIP_BEST_PROMPT_TEMPLATES``), ensembled at evaluation (scenic: mean of the
  logits over templates; released code: mean of the sigmoid probabilities).

Prompted strings are built as scenic does: canonicalise the label, substitute it for ``{}``,
canonicalise the whole string again (so "itap of a dog." -> "itap of a dog").

Config names (`configs/base.py`): ``data.train_prompt_templates`` in :data:`TRAIN_TEMPLATE_SETS`
(``'none'`` | ``'clip_80'``) and ``eval.prompt_templates`` in :data:`EVAL_TEMPLATE_SETS`
(``'none'`` | ``'owl_vit_7'``); ``'none'`` is the bare label (template ``'{}'``).

Source: docs/reference.md §2; scenic `scenic/projects/owl_vit/preprocessing/label_ops.py` (template
lists,
``_add_prompt``) and `scenic/projects/owl_vit/evaluator.py` (``tokenize_queries``); OpenAI CLIP
notebook ``Prompt_Engineering_for_ImageNet.ipynb``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from owl_cl.model.text import canonicalize_label

__all__ = [
  "CLIP_IMAGENET_TEMPLATES",
  "EVAL_TEMPLATE_SETS",
  "OWL_VIT_EVAL_TEMPLATES",
  "TRAIN_TEMPLATE_SETS",
  "TRAINING_TEMPLATES",
  "eval_templates",
  "prompt_texts",
  "prompt_tokens",
  "train_templates",
]

#: The 80 CLIP ImageNet prompt templates (OpenAI CLIP notebook
#: ``Prompt_Engineering_for_ImageNet.ipynb``, ``imagenet_templates``), in its order.
CLIP_IMAGENET_TEMPLATES: tuple[str, ...] = (
  "a bad photo of a {}.",
  "a photo of many {}.",
  "a sculpture of a {}.",
  "a photo of the hard to see {}.",
  "a low resolution photo of the {}.",
  "a rendering of a {}.",
  "graffiti of a {}.",
  "a bad photo of the {}.",
  "a cropped photo of the {}.",
  "a tattoo of a {}.",
  "the embroidered {}.",
  "a photo of a hard to see {}.",
  "a bright photo of a {}.",
  "a photo of a clean {}.",
  "a photo of a dirty {}.",
  "a dark photo of the {}.",
  "a drawing of a {}.",
  "a photo of my {}.",
  "the plastic {}.",
  "a photo of the cool {}.",
  "a close-up photo of a {}.",
  "a black and white photo of the {}.",
  "a painting of the {}.",
  "a painting of a {}.",
  "a pixelated photo of the {}.",
  "a sculpture of the {}.",
  "a bright photo of the {}.",
  "a cropped photo of a {}.",
  "a plastic {}.",
  "a photo of the dirty {}.",
  "a jpeg corrupted photo of a {}.",
  "a blurry photo of the {}.",
  "a photo of the {}.",
  "a good photo of the {}.",
  "a rendering of the {}.",
  "a {} in a video game.",
  "a photo of one {}.",
  "a doodle of a {}.",
  "a close-up photo of the {}.",
  "a photo of a {}.",
  "the origami {}.",
  "the {} in a video game.",
  "a sketch of a {}.",
  "a doodle of the {}.",
  "a origami {}.",
  "a low resolution photo of a {}.",
  "the toy {}.",
  "a rendition of the {}.",
  "a photo of the clean {}.",
  "a photo of a large {}.",
  "a rendition of a {}.",
  "a photo of a nice {}.",
  "a photo of a weird {}.",
  "a blurry photo of a {}.",
  "a cartoon {}.",
  "art of a {}.",
  "a sketch of the {}.",
  "a embroidered {}.",
  "a pixelated photo of a {}.",
  "itap of the {}.",
  "a jpeg corrupted photo of the {}.",
  "a good photo of a {}.",
  "a plushie {}.",
  "a photo of the nice {}.",
  "a photo of the small {}.",
  "a photo of the weird {}.",
  "the cartoon {}.",
  "art of the {}.",
  "a drawing of the {}.",
  "a photo of the large {}.",
  "a black and white photo of a {}.",
  "the plushie {}.",
  "a dark photo of a {}.",
  "itap of a {}.",
  "graffiti of the {}.",
  "a toy {}.",
  "itap of my {}.",
  "a photo of a cool {}.",
  "a photo of a small {}.",
  "a tattoo of the {}.",
)

#: Training prompts (docs/reference.md §2; scenic ``TRAINING_PROMPT_TEMPLATES``): the bare label +
# the 80.
TRAINING_TEMPLATES: tuple[str, ...] = ("{}",) + CLIP_IMAGENET_TEMPLATES

#: The 7 evaluation templates of docs/reference.md §2 (scenic ``CLIP_BEST_PROMPT_TEMPLATES``).
OWL_VIT_EVAL_TEMPLATES: tuple[str, ...] = (
  "itap of a {}.",
  "a bad photo of the {}.",
  "a origami {}.",
  "a photo of the large {}.",
  "a {} in a video game.",
  "art of the {}.",
  "a photo of the small {}.",
)

#: ``data.train_prompt_templates`` values -> templates.
TRAIN_TEMPLATE_SETS = {"none": ("{}",), "clip_80": TRAINING_TEMPLATES}
#: ``eval.prompt_templates`` values -> templates.
EVAL_TEMPLATE_SETS = {"none": ("{}",), "owl_vit_7": OWL_VIT_EVAL_TEMPLATES}


def _lookup(table: dict, name: str, field: str) -> tuple[str, ...]:
  if name not in table:
    raise ValueError(f"{field}={name!r} is unknown; known: {sorted(table)}")
  return table[name]


def train_templates(name: str) -> tuple[str, ...]:
  """Templates of a ``data.train_prompt_templates`` value ('none' -> ('{}',), 'clip_80' ->
  :data:`TRAINING_TEMPLATES`). Raises ValueError naming the field for an unknown name."""
  return _lookup(TRAIN_TEMPLATE_SETS, name, "config.data.train_prompt_templates")


def eval_templates(name: str) -> tuple[str, ...]:
  """Templates of an ``eval.prompt_templates`` value ('none' -> ('{}',), 'owl_vit_7' ->
  :data:`OWL_VIT_EVAL_TEMPLATES`). Raises ValueError naming the field for an unknown name."""
  return _lookup(EVAL_TEMPLATE_SETS, name, "config.eval.prompt_templates")


def prompt_texts(class_names: Sequence[str], templates: Sequence[str]) -> list:
  """Prompted query strings, ``[C][P]`` nested lists of ``str``.

  ``canonicalize_label(template.format(canonicalize_label(name)))`` for every class and
  template (scenic ``_add_prompt`` / ``tokenize_queries``).

  Args:
    class_names: C label strings. templates: P strings, each with exactly one ``'{}'``.

  Returns:
    list of C lists of P canonical strings.

  Raises:
    ValueError: a template without exactly one ``'{}'``, or no template.

  Source: docs/reference.md §2; scenic `label_ops._add_prompt`.
  """
  templates = list(templates)
  if not templates:
    raise ValueError("at least one prompt template is needed")
  for t in templates:
    if not isinstance(t, str) or t.count("{}") != 1:
      raise ValueError(f"prompt template must contain exactly one '{{}}': {t!r}")
  return [
    [canonicalize_label(t.format(canonicalize_label(name))) for t in templates]
    for name in class_names
  ]


def prompt_tokens(tokenizer, class_names: Sequence[str], templates: Sequence[str]) -> np.ndarray:
  """Tokens of every (class, template) prompt.

  Args:
    tokenizer: any owl_cl tokenizer (``encode(texts) -> int32 [N, L]``).
    class_names: C label strings. templates: P templates (see :func:`prompt_texts`).

  Returns:
    int32 ``[C, P, L]``; ``[:, 0]`` with ``templates[0] == '{}'`` equals the tokens of the
    canonical class names. Training: pass it as ``class_tokens`` to
    `owl_cl.data.pipeline.train_dataset` (one template drawn per query from the example's
    generator). Evaluation: embed it and ensemble over P.

  Raises:
    ValueError: see :func:`prompt_texts`.

  Source: docs/reference.md §2.
  """
  texts = prompt_texts(class_names, templates)
  num_classes, num_templates = len(texts), len(templates)
  flat = tokenizer.encode([s for row in texts for s in row])
  return np.asarray(flat, np.int32).reshape(num_classes, num_templates, -1)

"""The text helpers both query tokenizers share (`tokenizer`, `clip_tokenizer`).

The query context length, the label canonicalisation and the check of `encode`'s input; a
leaf of `owl_cl.model`, so the two tokenizers import it and not each other
(docs/architecture.md, "Layers"). Source: docs/reference.md §2.
"""

from __future__ import annotations

from collections.abc import Sequence
import re

#: Text context length L of OWL-ViT queries (docs/reference.md §1: "text context 16").
DEFAULT_CONTEXT_LENGTH = 16

_NOT_ALLOWED = re.compile(r"[^a-z0-9\-# ]")
_WHITESPACE = re.compile(r"\s+")


def canonicalize_label(text: str) -> str:
  """Canonicalises a label / query string before tokenisation.

  Lowercases, replaces every character outside ``[a-z0-9-# ]`` by a space, collapses runs of
  whitespace to one space and strips both ends. Example: ``"Traffic_Light (Red)!"`` ->
  ``"traffic light red"``.

  Args:
    text: Python ``str`` (any length, any characters).

  Returns:
    The canonical ``str`` (possibly ``''``).

  Raises:
    TypeError: if ``text`` is not a ``str``.

  Source: docs/reference.md §2 (tokenizer: label canonicalisation); scenic
  `scenic/projects/owl_vit/preprocessing/label_ops.py` (``_canonicalize_string_tf``).
  """
  if not isinstance(text, str):
    raise TypeError(f"canonicalize_label expects a str, got {type(text).__name__}")
  # Scenic also collapses runs of '-' and drops '#' (its not-promptable marker) except at the
  # start; the reference (docs/reference.md §2) asks for neither, so neither is done.
  text = _NOT_ALLOWED.sub(" ", text.lower())
  return _WHITESPACE.sub(" ", text).strip()


def as_text_list(texts: str | Sequence[str]) -> list[str]:
  """The texts a tokenizer's ``encode`` was given, as a ``list[str]`` (a ``str`` -> ``[str]``).

  Raises:
    TypeError: an item is not a ``str`` (the message shows it).
  """
  if isinstance(texts, str):
    return [texts]
  texts = list(texts)
  for t in texts:
    if not isinstance(t, str):
      raise TypeError(f"encode expects str items, got {type(t).__name__}: {t!r}")
  return texts

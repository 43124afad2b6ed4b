"""Text tokenisation for OWL-ViT queries.

Source: docs/reference.md §2 (tokenizer, label canonicalisation); scenic
`scenic/projects/owl_vit/clip/tokenizer.py` for the CLIP layout
([SOT] + tokens + [EOT], cut to the context length, right-padded with 0).

Contents:

* :func:`owl_cl.model.text.canonicalize_label` — the label clean-up applied before
  tokenising (with the other text helpers both tokenizers share).
* :class:`WordHashTokenizer` — a self-contained word-level tokenizer (no downloads) for the
  ``tiny`` model variant. Every word of the canonicalised text maps to
  ``1 + crc32(word) % (vocab_size - 3)``; ``SOT = vocab_size - 2`` and ``EOT = vocab_size - 1``
  so that the EOT is the largest id (the text tower pools the row at ``argmax(token id)``).
* :func:`get_tokenizer` / :func:`register_tokenizer` — a name -> factory registry. Known names:
  ``'word_hash'`` and ``'clip'`` (the OpenAI CLIP BPE of the ViT variants,
  :class:`owl_cl.model.clip_tokenizer.ClipTokenizer`, from a local vocabulary:
  ``get_tokenizer('clip', vocab_path=...)``).

Every tokenizer exposes ``encode(texts) -> np.ndarray int32 [N, context_length]``,
``vocab_size``, ``context_length``, ``sot_token`` and ``eot_token``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import zlib

import numpy as np

from owl_cl.model.clip_tokenizer import ClipTokenizer
from owl_cl.model.text import DEFAULT_CONTEXT_LENGTH
from owl_cl.model.text import as_text_list
from owl_cl.model.text import canonicalize_label

__all__ = [
  "DEFAULT_VOCAB_SIZE",
  "WordHashTokenizer",
  "get_tokenizer",
  "known_tokenizers",
  "register_tokenizer",
]

#: Vocabulary size of the word-hash tokenizer; the ``tiny`` model variant uses it.
DEFAULT_VOCAB_SIZE = 8192


class WordHashTokenizer:
  """Word-level hashing tokenizer for the ``tiny`` model (self-contained, deterministic).

  Encoding of one text: canonicalise (:func:`canonicalize_label`), split on spaces, map each
  word ``w`` to ``1 + zlib.crc32(w.encode('utf-8')) % (vocab_size - 3)`` (ids in
  ``[1, vocab_size - 3]``), build ``[SOT] + ids + [EOT]`` with ``SOT = vocab_size - 2`` and
  ``EOT = vocab_size - 1``, cut to ``context_length`` (the EOT is lost when the text has more
  than ``context_length - 2`` words, as with CLIP) and right-pad with 0. ``''`` encodes to
  ``[SOT, EOT, 0, ...]`` (a real, unmasked query; only all-zero rows are padding queries).
  Id 0 is padding and never produced for a word; EOT is the largest id.

  Args:
    vocab_size: int >= 4, the total number of ids (including 0, SOT, EOT).
    context_length: int >= 2, the number of tokens per text (L = 16 for OWL-ViT).

  Raises:
    ValueError: if ``vocab_size < 4`` or ``context_length < 2``.

  Source: ours (docs/reference.md §1: the `tiny` variant); layout as the CLIP
  tokenizer of docs/reference.md §2 / scenic `scenic/projects/owl_vit/clip/tokenizer.py`.
  """

  def __init__(
    self, vocab_size: int = DEFAULT_VOCAB_SIZE, context_length: int = DEFAULT_CONTEXT_LENGTH
  ):
    if int(vocab_size) < 4:
      raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    if int(context_length) < 2:
      raise ValueError(f"context_length must be >= 2, got {context_length}")
    self._vocab_size = int(vocab_size)
    self._context_length = int(context_length)

  @property
  def vocab_size(self) -> int:
    """Number of ids, ``int``; valid ids are ``[0, vocab_size)``."""
    return self._vocab_size

  @property
  def context_length(self) -> int:
    """Tokens per encoded text, ``int`` (16 by default)."""
    return self._context_length

  @property
  def sot_token(self) -> int:
    """Start-of-text id, ``vocab_size - 2``."""
    return self._vocab_size - 2

  @property
  def eot_token(self) -> int:
    """End-of-text id, ``vocab_size - 1`` (the largest id)."""
    # The largest id, as CLIP's: the text tower pools the row at argmax(token id) (docs/reference.md
    # §1).
    return self._vocab_size - 1

  def word_id(self, word: str) -> int:
    """Id of one (already canonical) word: ``1 + crc32(utf-8 bytes) % (vocab_size - 3)``.

    Args:
      word: a non-empty ``str`` without spaces.

    Returns:
      ``int`` in ``[1, vocab_size - 3]``.
    """
    # crc32, not hash(): Python's str hash is salted per process, and the ids must be the same
    # in every process and run. The offset 1 and the modulus keep 0, SOT and EOT free.
    return 1 + zlib.crc32(word.encode("utf-8")) % (self._vocab_size - 3)

  def tokenize(self, text: str) -> list:
    """Token ids of one text, unpadded but cut to ``context_length`` (``list[int]``)."""
    words = canonicalize_label(text).split()
    ids = [self.sot_token] + [self.word_id(w) for w in words] + [self.eot_token]
    return ids[: self._context_length]

  def encode(self, texts: str | Sequence[str]) -> np.ndarray:
    """Encodes texts to a fixed-shape token array.

    Args:
      texts: a sequence of N ``str`` (a single ``str`` is treated as N = 1).

    Returns:
      ``np.ndarray`` int32 ``[N, context_length]``: ``[SOT] + word ids + [EOT]`` cut to
      ``context_length`` and right-padded with 0. ``N = 0`` gives shape ``[0, L]``.

    Raises:
      TypeError: if an item is not a ``str``.
    """
    texts = as_text_list(texts)
    out = np.zeros((len(texts), self._context_length), np.int32)
    for i, text in enumerate(texts):
      ids = self.tokenize(text)
      out[i, : len(ids)] = ids
    return out

  def __call__(self, texts: str | Sequence[str]) -> np.ndarray:
    """Alias of :meth:`encode`."""
    return self.encode(texts)

  def __repr__(self) -> str:
    return (
      f"WordHashTokenizer(vocab_size={self._vocab_size}, context_length={self._context_length})"
    )


def _clip_tokenizer(**kwargs):
  """Factory of ``'clip'``: :class:`owl_cl.model.clip_tokenizer.ClipTokenizer` (kwargs
  ``vocab_path``, ``context_length``, ``canonicalize``)."""
  return ClipTokenizer(**kwargs)


_REGISTRY: dict[str, Callable[..., object]] = {
  "word_hash": WordHashTokenizer,
  "clip": _clip_tokenizer,
}


def known_tokenizers() -> list:
  """Sorted ``list[str]`` of the registered tokenizer names."""
  return sorted(_REGISTRY)


def register_tokenizer(
  name: str, factory: Callable[..., object], *, overwrite: bool = False
) -> None:
  """Registers a tokenizer factory under ``name`` (used e.g. to add the CLIP BPE tokenizer).

  Args:
    name: registry key, ``str``.
    factory: callable ``(**kwargs) -> tokenizer`` (an object with ``encode``, ``vocab_size``,
      ``context_length``).
    overwrite: allow replacing an existing entry.

  Raises:
    ValueError: if ``name`` is already registered and ``overwrite`` is False.
  """
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"tokenizer {name!r} is already registered")
  _REGISTRY[name] = factory


def get_tokenizer(name: str, **kwargs):
  """Builds a tokenizer by name.

  Args:
    name: one of :func:`known_tokenizers` (``'word_hash'``, ``'clip'``).
    **kwargs: passed to the factory (for ``'word_hash'``: ``vocab_size``, ``context_length``;
      for ``'clip'``: ``vocab_path`` (required), ``context_length``, ``canonicalize``).

  Returns:
    The tokenizer object (``encode(texts) -> np.ndarray int32 [N, L]``, ``vocab_size``,
    ``context_length``, ``sot_token``, ``eot_token``).

  Raises:
    ValueError: for an unknown name (the message lists the known names), or invalid kwargs
      values as raised by the factory ('clip' without ``vocab_path``).
    FileNotFoundError: 'clip' with a missing vocabulary (the message names the path).

  Source: CONVENTIONS.md (Tokenizer); docs/reference.md §2.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown tokenizer {name!r}; known tokenizers: {known_tokenizers()}")
  return _REGISTRY[name](**kwargs)

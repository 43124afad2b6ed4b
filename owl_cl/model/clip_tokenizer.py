"""The OpenAI CLIP byte-level BPE tokenizer for OWL-ViT queries (registered as ``'clip'``).

Source: docs/reference.md §2 (tokenizer: SOT 49406, EOT 49407, ``[SOT] + bpe + [EOT]`` cut to 16,
right-pad
0; label canonicalisation); scenic `scenic/projects/owl_vit/clip/tokenizer.py` (``tokenize``:
``tokens[:max_token_len]``, so a query of more than ``L - 2`` BPE tokens loses its EOT) and
`scenic/projects/owl_vit/evaluator.py` (``tokenize_queries``: the *prompted* string is
canonicalised, then tokenised); OpenAI CLIP `clip/simple_tokenizer.py` (vocabulary layout and
BPE); HF `tokenizers`, configured as transformers' ``CLIPTokenizer``.

Vocabulary files (nothing is downloaded; pass a local path):

* an HF checkpoint folder (e.g. ``openai/clip-vit-large-patch14`` or
  ``google/owlvit-large-patch14`` saved locally) holding ``vocab.json`` and ``merges.txt``, or
  the path of such a ``vocab.json`` (``merges.txt`` next to it);
* OpenAI's ``bpe_simple_vocab_16e6.txt.gz`` (or an uncompressed ``.txt``): the vocabulary is
  built as OpenAI's ``SimpleTokenizer`` does (:func:`openai_bpe_vocabulary`).

Both give the same 49,408 ids for the released vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import gzip
import json
import os

import numpy as np

from owl_cl.model.text import DEFAULT_CONTEXT_LENGTH
from owl_cl.model.text import as_text_list
from owl_cl.model.text import canonicalize_label

__all__ = [
  "ClipTokenizer",
  "END_OF_TEXT",
  "OPENAI_NUM_MERGES",
  "START_OF_TEXT",
  "bytes_to_unicode",
  "load_vocabulary",
  "openai_bpe_vocabulary",
]

START_OF_TEXT = "<|startoftext|>"
END_OF_TEXT = "<|endoftext|>"
#: OpenAI's SimpleTokenizer keeps merge lines [1, 49152 - 256 - 2 + 1) of the bpe file.
OPENAI_NUM_MERGES = 49152 - 256 - 2
#: CLIP's pre-tokenisation pattern (OpenAI `simple_tokenizer.py`, HF `CLIPTokenizer`).
_SPLIT_PATTERN = (
  r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|"""
  r"""[\p{N}]|[^\s\p{L}\p{N}]+"""
)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """The reversible byte -> unicode-character table of byte-level BPE (GPT-2 / CLIP).

  Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves; the other 68 bytes
  map to ``chr(256 + n)`` in increasing byte order. The dict's insertion order (printable bytes
  first, then the rest) is the order of the first 256 vocabulary entries.

  Returns:
    ``dict[int, str]`` with 256 entries (byte value -> one character).

  Source: OpenAI CLIP `clip/simple_tokenizer.py` (``bytes_to_unicode``).
  """
  # `tokenizers`' ByteLevel pre-tokenizer builds the same table internally but does not expose
  # its order, which OpenAI's vocabulary file needs (its first 256 entries follow it).
  printable = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
  )
  table = {b: chr(b) for b in printable}
  extra = 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def _read_text(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    return f.read().decode("utf-8")


def openai_bpe_vocabulary(
  path: str, num_merges: int = OPENAI_NUM_MERGES
) -> tuple[dict[str, int], list[tuple[str, str]]]:
  """Vocabulary and merges from OpenAI's ``bpe_simple_vocab_16e6.txt.gz``.

  Built as OpenAI's ``SimpleTokenizer``: line 0 of the file is a header and skipped; merge
  lines ``1 .. num_merges`` are kept (each ``"a b"``); the vocabulary is the 256
  :func:`bytes_to_unicode` characters, then the same characters + ``'</w>'``, then the
  concatenation of every merge, then ``<|startoftext|>`` and ``<|endoftext|>``; ids are
  positions in that list (49,406 / 49,407 for the released file).

  Args:
    path: the ``.txt.gz`` (or plain ``.txt``) file.
    num_merges: merges kept (OpenAI: 48,894). Shorter files keep all their merge lines; empty
      lines (a trailing newline) are skipped.

  Returns:
    (vocab ``dict[str, int]``, merges ``list[tuple[str, str]]`` in rank order).

  Raises:
    FileNotFoundError: ``path`` does not exist (the message names it).
    ValueError: a merge line that is not two symbols (the message names the file and line).

  Source: OpenAI CLIP `clip/simple_tokenizer.py` (``SimpleTokenizer.__init__``).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"CLIP BPE vocabulary file not found: {path}")
  lines = _read_text(path).split("\n")
  merges: list[tuple[str, str]] = []
  for number, line in enumerate(lines[1 : num_merges + 1], start=2):
    if not line.strip():
      continue
    parts = line.split()
    if len(parts) != 2:
      raise ValueError(f"{path}: line {number} is not a merge of two symbols: {line!r}")
    merges.append((parts[0], parts[1]))
  symbols = list(bytes_to_unicode().values())
  symbols = symbols + [s + "</w>" for s in symbols]
  symbols += ["".join(m) for m in merges]
  symbols += [START_OF_TEXT, END_OF_TEXT]
  # As OpenAI's dict(zip(vocab, range(len(vocab)))): a repeated string keeps its last id.
  vocab = {s: i for i, s in enumerate(symbols)}
  return vocab, merges


def _hf_vocabulary(
  vocab_file: str, merges_file: str
) -> tuple[dict[str, int], list[tuple[str, str]]]:
  """(vocab, merges) from an HF ``vocab.json`` + ``merges.txt`` pair."""
  if not os.path.isfile(merges_file):
    raise FileNotFoundError(
      f"CLIP BPE merges file not found: {merges_file} (needed next to {vocab_file})"
    )
  try:
    with open(vocab_file, encoding="utf-8") as f:
      vocab = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{vocab_file}: not valid json ({e})") from e
  if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
    raise ValueError(f"{vocab_file}: must map token strings to integer ids")
  merges: list[tuple[str, str]] = []
  for number, line in enumerate(_read_text(merges_file).split("\n"), start=1):
    if not line.strip() or (number == 1 and line.startswith("#version")):
      continue
    parts = line.split()
    if len(parts) != 2:
      raise ValueError(f"{merges_file}: line {number} is not a merge of two symbols: {line!r}")
    merges.append((parts[0], parts[1]))
  return vocab, merges


def load_vocabulary(vocab_path: str) -> tuple[dict[str, int], list[tuple[str, str]], str]:
  """Reads a CLIP BPE vocabulary from any of the supported locations.

  Args:
    vocab_path: an HF folder with ``vocab.json`` + ``merges.txt``; the path of such a
      ``vocab.json``; or OpenAI's ``bpe_simple_vocab_16e6.txt.gz`` / ``.txt``.

  Returns:
    (vocab ``dict[str, int]``, merges ``list[tuple[str, str]]``, a description of the files).

  Raises:
    FileNotFoundError: nothing usable at ``vocab_path`` (the message names the path and what
      was looked for).
    ValueError: malformed files.

  Source: docs/reference.md §2; HF ``CLIPTokenizer`` files; OpenAI `clip/simple_tokenizer.py`.
  """
  path = os.path.abspath(os.path.expanduser(os.fspath(vocab_path)))
  if os.path.isdir(path):
    vocab_file = os.path.join(path, "vocab.json")
    if os.path.isfile(vocab_file):
      vocab, merges = _hf_vocabulary(vocab_file, os.path.join(path, "merges.txt"))
      return vocab, merges, f"{vocab_file} + merges.txt"
    for name in ("bpe_simple_vocab_16e6.txt.gz", "bpe_simple_vocab_16e6.txt"):
      if os.path.isfile(os.path.join(path, name)):
        bpe_file = os.path.join(path, name)
        return (*openai_bpe_vocabulary(bpe_file), bpe_file)
    raise FileNotFoundError(
      f"CLIP tokenizer vocabulary not found in folder {path}: expected vocab.json + "
      "merges.txt (HF checkpoint folder) or bpe_simple_vocab_16e6.txt.gz (OpenAI)"
    )
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"CLIP tokenizer vocabulary not found: {path} (give an HF checkpoint folder with "
      "vocab.json + merges.txt, a vocab.json, or OpenAI's bpe_simple_vocab_16e6.txt.gz; "
      "config field model.tokenizer_vocab_path)"
    )
  if path.endswith(".json"):
    vocab, merges = _hf_vocabulary(path, os.path.join(os.path.dirname(path), "merges.txt"))
    return vocab, merges, f"{path} + merges.txt"
  return (*openai_bpe_vocabulary(path), path)


class ClipTokenizer:
  """CLIP byte-level BPE tokenizer with OWL-ViT's query layout (docs/reference.md §2).

  Encoding of one text: canonicalise it (:func:`canonicalize_label`: lowercase, characters
  outside ``[a-z0-9-# ]`` -> space, collapse whitespace; so a template's final '.' is
  dropped); byte-level BPE (CLIP's split pattern, end-of-word suffix ``</w>``);
  ``[SOT] + ids + [EOT]``; cut to ``context_length`` (more than ``context_length - 2`` BPE
  tokens lose the EOT); right-pad with 0. ``''`` encodes to ``[SOT, EOT, 0, ...]`` (a real,
  unmasked query).

  Args:
    vocab_path: see :func:`load_vocabulary`.
    context_length: tokens per text (L = 16 for OWL-ViT), >= 2.
    canonicalize: apply :func:`canonicalize_label` before tokenising (default True; False
      tokenises the text as given, as OpenAI's CLIP does after its own whitespace clean-up).

  Raises:
    FileNotFoundError: the vocabulary is missing (the message names the path).
    ValueError: ``context_length < 2``; a vocabulary without ``<|startoftext|>`` /
      ``<|endoftext|>``; malformed files.

  Source: docs/reference.md §2; scenic `scenic/projects/owl_vit/clip/tokenizer.py`; OpenAI CLIP
  `clip/simple_tokenizer.py`; transformers ``CLIPTokenizer`` (the `tokenizers` configuration).
  """

  def __init__(
    self,
    vocab_path: str | None = None,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    canonicalize: bool = True,
  ):
    if vocab_path is None:
      raise ValueError(
        "the 'clip' tokenizer needs a local vocabulary: get_tokenizer('clip', vocab_path=...) "
        "(config field model.tokenizer_vocab_path): an HF checkpoint folder with vocab.json "
        "+ merges.txt, or OpenAI's bpe_simple_vocab_16e6.txt.gz"
      )
    if int(context_length) < 2:
      raise ValueError(f"context_length must be >= 2, got {context_length}")
    from tokenizers import Regex  # pylint: disable=g-import-not-at-top
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    from tokenizers import models  # pylint: disable=g-import-not-at-top
    from tokenizers import normalizers  # pylint: disable=g-import-not-at-top
    from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top

    vocab, merges, description = load_vocabulary(vocab_path)
    for special in (START_OF_TEXT, END_OF_TEXT):
      if special not in vocab:
        raise ValueError(f"CLIP vocabulary {description} has no {special!r} token")
    self._vocab_path = os.fspath(vocab_path)
    self._description = description
    self._context_length = int(context_length)
    self._canonicalize = bool(canonicalize)
    self._sot = int(vocab[START_OF_TEXT])
    self._eot = int(vocab[END_OF_TEXT])
    self._vocab_size = max(int(v) for v in vocab.values()) + 1
    # The BPE runs in HF `tokenizers` (fast, well kept), configured as transformers'
    # CLIPTokenizer so that it gives OpenAI's ids: NFC + whitespace collapse + lowercase
    # normaliser; CLIP's split regex, then the byte-level mapping; BPE with the end-of-word
    # suffix </w> and no continuing-subword prefix.
    tokenizer = Tokenizer(
      models.BPE(
        vocab=dict(vocab),
        merges=list(merges),
        continuing_subword_prefix="",
        end_of_word_suffix="</w>",
        fuse_unk=False,
        unk_token=END_OF_TEXT,
      )
    )
    tokenizer.normalizer = normalizers.Sequence(
      [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
    self._tokenizer = tokenizer

  @property
  def vocab_size(self) -> int:
    """Number of ids (largest id + 1), ``int``; 49,408 for the released vocabulary."""
    return self._vocab_size

  @property
  def context_length(self) -> int:
    """Tokens per encoded text, ``int`` (16 for OWL-ViT)."""
    return self._context_length

  @property
  def sot_token(self) -> int:
    """Id of ``<|startoftext|>`` (49406 for the released vocabulary)."""
    return self._sot

  @property
  def eot_token(self) -> int:
    """Id of ``<|endoftext|>`` (49407 for the released vocabulary; the largest id)."""
    return self._eot

  def bpe_ids(self, texts: Sequence[str]) -> list[list[int]]:
    """BPE ids of each text without SOT/EOT, truncation or padding (``list[list[int]]``).

    Canonicalises first when the tokenizer was built with ``canonicalize=True``.
    """
    texts = as_text_list(texts)
    # Scenic canonicalises the prompted string (evaluator.tokenize_queries), which is why a
    # template's final '.' disappears.
    if self._canonicalize:
      texts = [canonicalize_label(t) for t in texts]
    encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
    return [list(e.ids) for e in encodings]

  def tokenize(self, text: str) -> list[int]:
    """Token ids of one text, ``[SOT] + bpe + [EOT]`` cut to ``context_length`` (unpadded)."""
    return ([self._sot] + self.bpe_ids([text])[0] + [self._eot])[: self._context_length]

  def encode(self, texts: str | Sequence[str]) -> np.ndarray:
    """Encodes texts to OWL-ViT query tokens.

    Args:
      texts: a sequence of N ``str`` (a single ``str`` is treated as N = 1).

    Returns:
      ``np.ndarray`` int32 ``[N, context_length]``: ``[SOT] + bpe + [EOT]``, cut to
      ``context_length`` (EOT lost beyond ``context_length - 2`` BPE tokens, as scenic),
      right-padded with 0. ``N = 0`` gives ``[0, L]``.

    Raises:
      TypeError: an item is not a ``str``.
    """
    texts = as_text_list(texts)
    out = np.zeros((len(texts), self._context_length), np.int32)
    if not texts:
      return out
    for i, ids in enumerate(self.bpe_ids(texts)):
      # Cut after adding EOT, as scenic's `tokens[:max_token_len]`: long queries lose EOT.
      row = ([self._sot] + ids + [self._eot])[: self._context_length]
      out[i, : len(row)] = row
    return out

  def __call__(self, texts: str | Sequence[str]) -> np.ndarray:
    """Alias of :meth:`encode`."""
    return self.encode(texts)

  def __repr__(self) -> str:
    return (
      f"ClipTokenizer({self._description}, vocab_size={self._vocab_size}, "
      f"context_length={self._context_length})"
    )

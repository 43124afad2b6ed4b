"""Tests of owl_cl.model.tokenizer (docs/reference.md §2)."""

import zlib

import numpy as np
import pytest

from owl_cl.model.text import canonicalize_label
from owl_cl.model.tokenizer import WordHashTokenizer
from owl_cl.model.tokenizer import get_tokenizer
from owl_cl.model.tokenizer import known_tokenizers
from owl_cl.model.tokenizer import register_tokenizer


@pytest.mark.parametrize(
  "raw,canonical",
  [
    ("Traffic_Light (Red)!", "traffic light red"),
    ("  Hello   World  ", "hello world"),
    ("hot-air_balloon", "hot-air balloon"),
    ("#1 Dad", "#1 dad"),
    ("Tabasco_sauce", "tabasco sauce"),
    ("pin_(non_jewelry)", "pin non jewelry"),
    ("café\tau\nlait", "caf au lait"),
    ("A.B,C;D", "a b c d"),
    ("", ""),
    ("!!!", ""),
    ("digit seven", "digit seven"),
  ],
)
def test_canonicalize_label(raw, canonical):
  assert canonicalize_label(raw) == canonical
  assert canonicalize_label(canonical) == canonical  # idempotent


def test_canonicalize_label_type_error():
  with pytest.raises(TypeError):
    canonicalize_label(3)


def test_special_tokens_and_layout():
  tok = WordHashTokenizer()
  assert tok.vocab_size == 8192 and tok.context_length == 16
  assert tok.sot_token == 8190 and tok.eot_token == 8191
  ids = tok.encode(["Red Triangle"])
  assert ids.shape == (1, 16) and ids.dtype == np.int32
  red = 1 + zlib.crc32(b"red") % 8189
  tri = 1 + zlib.crc32(b"triangle") % 8189
  np.testing.assert_array_equal(ids[0], [8190, red, tri, 8191] + [0] * 12)
  assert tok.word_id("red") == red


def test_empty_string():
  tok = WordHashTokenizer()
  np.testing.assert_array_equal(tok.encode([""])[0], [tok.sot_token, tok.eot_token] + [0] * 14)
  # punctuation-only text canonicalises to ''
  np.testing.assert_array_equal(tok.encode(["?!"]), tok.encode([""]))
  assert tok.encode([""])[0, 0] > 0  # not a padding query (query mask = tokens[0] > 0)


def test_truncation_and_padding():
  tok = WordHashTokenizer(context_length=16)
  words = [f"w{i}" for i in range(20)]
  exact = tok.encode([" ".join(words[:14])])[0]  # 1 + 14 + 1 = 16: EOT kept
  assert exact[-1] == tok.eot_token and np.all(exact[1:15] < tok.sot_token)
  long = tok.encode([" ".join(words[:15])])[0]  # 17 tokens: EOT lost, as CLIP
  assert long[0] == tok.sot_token and tok.eot_token not in long
  np.testing.assert_array_equal(long[1:], [tok.word_id(w) for w in words[:15]])
  short = tok.encode(["a b"])[0]
  assert list(short[4:]) == [0] * 12
  small = WordHashTokenizer(vocab_size=100, context_length=4)
  out = small.encode(["a b c d e", "a"])
  assert out.shape == (2, 4)
  assert out[0, 0] == 98 and 99 not in out[0]
  np.testing.assert_array_equal(out[1], [98, small.word_id("a"), 99, 0])


def test_ids_range_and_eot_is_max():
  tok = WordHashTokenizer(vocab_size=64)
  texts = [f"word{i} other{i * 7}" for i in range(200)]
  ids = tok.encode(texts)
  words = ids[:, 1:3]
  assert words.min() >= 1 and words.max() <= 64 - 3
  assert np.all(ids.argmax(-1) == 3)  # the text tower's argmax pooling finds the EOT


def test_determinism_and_batching():
  a = WordHashTokenizer().encode(["blue circle", "yellow star", ""])
  b = get_tokenizer("word_hash").encode(["blue circle", "yellow star", ""])
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[1], WordHashTokenizer().encode("yellow star")[0])
  assert WordHashTokenizer().encode([]).shape == (0, 16)
  # canonicalisation happens before hashing
  np.testing.assert_array_equal(WordHashTokenizer().encode(["Blue_Circle!"])[0], a[0])
  with pytest.raises(TypeError):
    WordHashTokenizer().encode(["ok", 3])


def test_class_name_words_hash_to_distinct_ids():
  tok = WordHashTokenizer()
  names = ["digit seven", "red triangle", "blue circle", "yellow star", "green square"]
  words = sorted({w for n in names for w in canonicalize_label(n).split()})
  ids = [tok.word_id(w) for w in words]
  assert len(set(ids)) == len(words) == 10
  digits = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "digit"]
  assert len({tok.word_id(w) for w in digits}) == len(digits)
  encoded = tok.encode(names)
  assert len({tuple(r) for r in encoded}) == len(names)


def test_registry():
  assert "word_hash" in known_tokenizers()
  tok = get_tokenizer("word_hash", vocab_size=1000, context_length=8)
  assert tok.vocab_size == 1000 and tok.context_length == 8 and tok.eot_token == 999
  with pytest.raises(ValueError, match="word_hash"):
    get_tokenizer("nonexistent")
  with pytest.raises(ValueError):
    register_tokenizer("word_hash", WordHashTokenizer)
  with pytest.raises(ValueError):
    WordHashTokenizer(vocab_size=3)
  with pytest.raises(ValueError):
    WordHashTokenizer(context_length=1)

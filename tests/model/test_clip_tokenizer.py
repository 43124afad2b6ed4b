"""Tests of owl_cl.model.clip_tokenizer (docs/reference.md §2) on small vocabularies written by the
tests.

Ids in the small vocabulary (OpenAI layout, `openai_bpe_vocabulary`): the 256 byte characters
in `bytes_to_unicode` order (printable ASCII '!'..'~' first, so character c has id
ord(c) - 33), then the same + '</w>' (id ord(c) - 33 + 256), then one id per merge
(512, 513, ...), then <|startoftext|>, <|endoftext|>.
"""

import gzip
import json
import re

import numpy as np
import pytest

from owl_cl.model import clip_tokenizer
from owl_cl.model.clip_tokenizer import ClipTokenizer
from owl_cl.model.clip_tokenizer import bytes_to_unicode
from owl_cl.model.clip_tokenizer import load_vocabulary
from owl_cl.model.text import canonicalize_label
from owl_cl.model.tokenizer import get_tokenizer
from owl_cl.model.tokenizer import known_tokenizers

MERGES = [("d", "o"), ("do", "g</w>"), ("c", "a"), ("ca", "t</w>"), ("h", "o"), ("ho", "t</w>")]
DO, DOG, CA, CAT, HO, HOT = 512, 513, 514, 515, 516, 517
SOT, EOT = 518, 519


def char(c):
  return ord(c) - 33


def char_end(c):
  return ord(c) - 33 + 256


def _write_openai(path, merges=MERGES):
  text = "#version: 0.2 (header line, skipped)\n" + "\n".join(" ".join(m) for m in merges) + "\n"
  with gzip.open(path, "wb") as f:
    f.write(text.encode("utf-8"))
  return str(path)


def _vocab_dict(merges=MERGES):
  symbols = list(bytes_to_unicode().values())
  symbols = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
  symbols += ["<|startoftext|>", "<|endoftext|>"]
  return {s: i for i, s in enumerate(symbols)}


def _write_hf(folder, merges=MERGES):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "vocab.json").write_text(json.dumps(_vocab_dict(merges)), encoding="utf-8")
  (folder / "merges.txt").write_text(
    "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8"
  )
  return str(folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("clip_vocab")
  return {
    "openai": _write_openai(root / "bpe_simple_vocab_16e6.txt.gz"),
    "hf": _write_hf(root / "hf_checkpoint"),
  }


def _reference_bpe_ids(text, vocab, merges):
  """Independent reference: OpenAI SimpleTokenizer's greedy lowest-rank merging, for the ASCII
  strings of these tests (no byte remapping needed: printable ASCII maps to itself)."""
  ranks = {m: i for i, m in enumerate(merges)}
  ids = []
  for piece in re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", text):
    word = list(piece[:-1]) + [piece[-1] + "</w>"]
    while len(word) > 1:
      pairs = [
        (ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(word[:-1], word[1:]))
      ]
      rank, _ = min(pairs)
      if rank == float("inf"):
        break
      first, second = merges[rank]
      merged, i = [], 0
      while i < len(word):
        if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
          merged.append(first + second)
          i += 2
        else:
          merged.append(word[i])
          i += 1
      word = merged
    ids.extend(vocab[w] for w in word)
  return ids


def test_bytes_to_unicode_layout():
  table = bytes_to_unicode()
  assert len(table) == 256 and len(set(table.values())) == 256
  assert table[ord("a")] == "a" and table[ord("!")] == "!"
  assert table[0] == chr(256) and table[ord(" ")] == chr(256 + 32)
  assert list(table)[:3] == [33, 34, 35]  # printable bytes first (vocabulary order)


def test_openai_vocabulary_layout(files):
  vocab, merges = clip_tokenizer.openai_bpe_vocabulary(files["openai"])
  assert merges == MERGES
  assert vocab == _vocab_dict()
  assert vocab["a"] == 64 and vocab["a</w>"] == 320  # 320 is 'a' in the released CLIP vocab
  assert vocab["do"] == DO and vocab["hot</w>"] == HOT
  assert vocab["<|startoftext|>"] == SOT and vocab["<|endoftext|>"] == EOT
  # num_merges keeps only the first merge lines, as OpenAI's 49152-256-2 cut.
  vocab2, merges2 = clip_tokenizer.openai_bpe_vocabulary(files["openai"], num_merges=2)
  assert merges2 == MERGES[:2] and vocab2["<|endoftext|>"] == 512 + 2 + 1
  assert clip_tokenizer.OPENAI_NUM_MERGES == 48894


@pytest.mark.parametrize(
  "text,ids",
  [
    ("a dog", [SOT, char_end("a"), DOG, EOT]),
    ("hot-dog", [SOT, HOT, char_end("-"), DOG, EOT]),
    ("cats", [SOT, CA, char("t"), char_end("s"), EOT]),  # (ca, t) is no merge
    ("Dog 2", [SOT, DOG, char_end("2"), EOT]),  # canonicalised, digit alone
    ("doho", [SOT, DO, char("h"), char_end("o"), EOT]),  # (h, o</w>) is no merge
    ("odd", [SOT, char("o"), char("d"), char_end("d"), EOT]),
    ("Hot_Cat!", [SOT, HOT, CAT, EOT]),  # '_', '!' -> space
    ("12", [SOT, char_end("1"), char_end("2"), EOT]),  # digits split one by one
    ("", [SOT, EOT]),
  ],
)
def test_hand_worked_ids(files, text, ids):
  tok = ClipTokenizer(files["openai"])
  out = tok.encode([text])
  assert out.shape == (1, 16) and out.dtype == np.int32
  np.testing.assert_array_equal(out[0], ids + [0] * (16 - len(ids)))
  assert tok.tokenize(text) == ids


def test_special_tokens_and_properties(files):
  tok = get_tokenizer("clip", vocab_path=files["hf"])
  assert "clip" in known_tokenizers()
  assert tok.sot_token == SOT and tok.eot_token == EOT
  assert tok.vocab_size == 520 and tok.context_length == 16
  assert tok.encode([""])[0, 0] > 0  # '' is a real query (mask = tokens[0] > 0)
  assert tok.encode([]).shape == (0, 16)
  np.testing.assert_array_equal(tok.encode("a dog"), tok.encode(["a dog"]))
  with pytest.raises(TypeError):
    tok.encode(["ok", 3])


def test_truncation_loses_eot_like_scenic(files):
  tok = ClipTokenizer(files["openai"])
  fourteen = tok.encode([" ".join(["dog"] * 14)])[0]  # 1 + 14 + 1 = 16: EOT kept
  np.testing.assert_array_equal(fourteen, [SOT] + [DOG] * 14 + [EOT])
  fifteen = tok.encode([" ".join(["dog"] * 15)])[0]  # scenic: tokens[:16], no EOT
  np.testing.assert_array_equal(fifteen, [SOT] + [DOG] * 15)
  many = tok.encode([" ".join(["cats"] * 9)])[0]  # 27 BPE tokens, cut mid-word
  np.testing.assert_array_equal(many, [SOT] + [CA, char("t"), char_end("s")] * 5)
  short = ClipTokenizer(files["openai"], context_length=4).encode(["a dog", "hot dog cat"])
  np.testing.assert_array_equal(short, [[SOT, char_end("a"), DOG, EOT], [SOT, HOT, DOG, CAT]])


def test_padding_is_zero(files):
  tok = ClipTokenizer(files["openai"], context_length=8)
  out = tok.encode(["a", "dog cat hot", ""])
  np.testing.assert_array_equal(
    out,
    [
      [SOT, char_end("a"), EOT, 0, 0, 0, 0, 0],
      [SOT, DOG, CAT, HOT, EOT, 0, 0, 0],
      [SOT, EOT, 0, 0, 0, 0, 0, 0],
    ],
  )


def test_canonicalisation_before_tokenising(files):
  tok = ClipTokenizer(files["openai"])
  np.testing.assert_array_equal(tok.encode(["Hot_Dog (Cat)."]), tok.encode(["hot dog cat"]))
  # A template's final '.' is dropped (scenic canonicalises the prompted string).
  np.testing.assert_array_equal(tok.encode(["a dog."]), tok.encode(["a dog"]))
  raw = ClipTokenizer(files["openai"], canonicalize=False)
  assert raw.tokenize("a dog.") == [SOT, char_end("a"), DOG, char_end("."), EOT]
  assert raw.tokenize("A  DOG") == [SOT, char_end("a"), DOG, EOT]  # lowercase, whitespace


def test_hf_and_openai_loaders_agree(files):
  v_openai, m_openai, _ = load_vocabulary(files["openai"])
  v_hf, m_hf, _ = load_vocabulary(files["hf"])
  v_json, m_json, _ = load_vocabulary(files["hf"] + "/vocab.json")
  assert v_openai == v_hf == v_json and m_openai == m_hf == m_json
  texts = [
    "a dog",
    "hot-dog cats",
    "odd doho 42",
    "a photo of the small cat",
    "itap of a hot dog.",
    " ".join(["dog"] * 20),
    "",
    "#1 dad",
  ]
  a = ClipTokenizer(files["openai"]).encode(texts)
  b = get_tokenizer("clip", vocab_path=files["hf"]).encode(texts)
  np.testing.assert_array_equal(a, b)


def test_matches_reference_bpe(files):
  vocab = _vocab_dict()
  tok = ClipTokenizer(files["hf"])
  rng = np.random.default_rng(0)
  alphabet = list("dogcathx-#1 ")
  for _ in range(200):
    text = canonicalize_label("".join(rng.choice(alphabet, size=rng.integers(0, 12))))
    assert tok.bpe_ids([text])[0] == _reference_bpe_ids(text, vocab, MERGES), text


def test_matches_transformers_clip_tokenizer(files):
  transformers = pytest.importorskip("transformers")
  hf = transformers.CLIPTokenizer.from_pretrained(files["hf"])
  tok = ClipTokenizer(files["hf"], context_length=64)
  for text in ["a dog", "hot-dog cats", "odd doho 42", "a photo of the small cat", "#1 dad"]:
    assert hf(text)["input_ids"] == tok.tokenize(text), text


def test_missing_vocabulary_errors(tmp_path, files):
  missing = tmp_path / "no_such_vocab.txt.gz"
  with pytest.raises(FileNotFoundError, match="no_such_vocab.txt.gz"):
    get_tokenizer("clip", vocab_path=str(missing))
  empty = tmp_path / "empty_folder"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="empty_folder"):
    ClipTokenizer(str(empty))
  only_vocab = tmp_path / "only_vocab"
  only_vocab.mkdir()
  (only_vocab / "vocab.json").write_text(json.dumps(_vocab_dict()))
  with pytest.raises(FileNotFoundError, match="merges.txt"):
    ClipTokenizer(str(only_vocab))
  with pytest.raises(ValueError, match="vocab_path"):
    get_tokenizer("clip")
  with pytest.raises(ValueError, match="context_length"):
    ClipTokenizer(files["openai"], context_length=1)
  bad = tmp_path / "bad.txt.gz"
  with gzip.open(bad, "wb") as f:
    f.write(b"#version\nd o\nthree symbols here\n")
  with pytest.raises(ValueError, match="line 3"):
    ClipTokenizer(str(bad))

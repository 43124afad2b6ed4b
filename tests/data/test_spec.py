"""ExampleSpec (owl_cl/data/spec.py): checks at construction, tokens kept bit for bit; the
batch key tuples."""

import dataclasses

import numpy as np
import pytest

from owl_cl.data import input_pipeline
from owl_cl.data.spec import EVAL_META_KEYS
from owl_cl.data.spec import MODEL_INPUT_KEYS
from owl_cl.data.spec import TRAIN_EXAMPLE_KEYS
from owl_cl.data.spec import ExampleSpec
from owl_cl.model.tokenizer import WordHashTokenizer
from owl_cl.replay import build as build_lib

SIZES = dict(image_size=32, num_queries=4, max_instances=3, num_negatives=0)


def _tokens():
  tok = WordHashTokenizer(vocab_size=64, context_length=6)
  return tok.encode(["cat", "dog", "red car"]), tok.encode([""])[0]


def test_tokens_and_sizes_are_kept():
  class_tokens, empty = _tokens()
  spec = ExampleSpec(class_tokens=class_tokens, empty_tokens=empty, **SIZES)
  assert spec.num_classes == 3
  assert (spec.image_size, spec.num_queries, spec.max_instances, spec.num_negatives) == (
    32,
    4,
    3,
    0,
  )
  # The buffer build digests the tokenizer's int32 arrays (replay.build's manifest): the spec
  # keeps them bit for bit, so a build folder left by an earlier version is still resumed.
  assert spec.class_tokens.dtype == np.int32 and spec.empty_tokens.dtype == np.int32
  assert build_lib._fingerprint([spec.class_tokens, spec.empty_tokens]) == (  # pylint: disable=protected-access
    build_lib._fingerprint([class_tokens, empty])  # pylint: disable=protected-access
  )
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.num_queries = 5


@pytest.mark.parametrize(
  "field, value",
  [("image_size", 0), ("num_queries", 0), ("max_instances", 2.0), ("num_negatives", -1)],
)
def test_bad_size_names_the_field(field, value):
  class_tokens, empty = _tokens()
  with pytest.raises(ValueError, match=f"ExampleSpec.{field} .*got {value!r}"):
    ExampleSpec(class_tokens=class_tokens, empty_tokens=empty, **dict(SIZES, **{field: value}))


def test_token_lengths_must_agree():
  class_tokens, empty = _tokens()
  with pytest.raises(ValueError, match="class_tokens"):
    ExampleSpec(class_tokens=class_tokens[:, :4], empty_tokens=empty, **SIZES)


def test_batch_keys_are_the_examples_keys():
  class_tokens, empty = _tokens()
  spec = ExampleSpec(class_tokens=class_tokens, empty_tokens=empty, **SIZES)
  example = dict(
    image=np.zeros((8, 12, 3), np.uint8),
    boxes=np.array([[1, 1, 5, 5]], np.float32),
    labels=np.array([2]),
    image_id=7,
  )
  train = input_pipeline.preprocess_train_example(example, spec, rng=np.random.default_rng(0))
  evaluation = input_pipeline.preprocess_eval_example(example, image_size=16)
  assert set(TRAIN_EXAMPLE_KEYS) | set(EVAL_META_KEYS) == set(train)
  assert set(EVAL_META_KEYS) | {"images"} == set(evaluation)
  assert MODEL_INPUT_KEYS == TRAIN_EXAMPLE_KEYS[:4] and "query_class" not in MODEL_INPUT_KEYS
  assert train["query_class"][1] == 2 and train["labels"][0, 1] == 1.0  # the one positive

"""Prompt templates (docs/reference.md §2): lists, prompted strings, tokens, training-prompt
draws."""

import dataclasses

import numpy as np
import pytest

from owl_cl.data import input_pipeline
from owl_cl.data import prompts
from owl_cl.data.spec import ExampleSpec
from owl_cl.model.tokenizer import WordHashTokenizer


def test_template_lists():
  t80 = prompts.CLIP_IMAGENET_TEMPLATES
  assert len(t80) == 80 and len(set(t80)) == 80
  assert all(t.count("{}") == 1 for t in t80)
  # Spot checks against OpenAI's notebook order (Prompt_Engineering_for_ImageNet.ipynb).
  assert t80[0] == "a bad photo of a {}."
  assert t80[1] == "a photo of many {}."
  assert t80[39] == "a photo of a {}."
  assert t80[20] == "a close-up photo of a {}."
  assert t80[73] == "itap of a {}."
  assert t80[-1] == "a tattoo of the {}."
  train = prompts.TRAINING_TEMPLATES
  assert len(train) == 81 and train[0] == "{}" and train[1:] == t80
  assert prompts.OWL_VIT_EVAL_TEMPLATES == (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
  )
  assert set(prompts.OWL_VIT_EVAL_TEMPLATES) <= set(t80)  # CLIP's best 7 are among the 80
  assert prompts.train_templates("none") == ("{}",) == prompts.eval_templates("none")
  assert prompts.train_templates("clip_80") == train
  assert prompts.eval_templates("owl_vit_7") == prompts.OWL_VIT_EVAL_TEMPLATES
  with pytest.raises(ValueError, match="config.eval.prompt_templates"):
    prompts.eval_templates("clip_80")
  with pytest.raises(ValueError, match="config.data.train_prompt_templates"):
    prompts.train_templates("owl_vit_7")


def test_prompt_texts_canonicalise_label_and_prompt():
  texts = prompts.prompt_texts(
    ["Traffic_Light", "arctic_(type_of_shoe)"], ["{}", "itap of a {}.", "a {} in a video game."]
  )
  assert texts == [
    ["traffic light", "itap of a traffic light", "a traffic light in a video game"],
    [
      "arctic type of shoe",
      "itap of a arctic type of shoe",
      "a arctic type of shoe in a video game",
    ],
  ]
  with pytest.raises(ValueError, match="exactly one"):
    prompts.prompt_texts(["a"], ["no placeholder"])
  with pytest.raises(ValueError, match="at least one"):
    prompts.prompt_texts(["a"], [])


def test_prompt_tokens_shape_and_rows():
  tok = WordHashTokenizer(vocab_size=512, context_length=8)
  names = ["red plain", "blue striped", "hot spot"]
  tokens = prompts.prompt_tokens(tok, names, prompts.OWL_VIT_EVAL_TEMPLATES)
  assert tokens.shape == (3, 7, 8) and tokens.dtype == np.int32
  np.testing.assert_array_equal(tokens[1, 4], tok.encode(["a blue striped in a video game"])[0])
  bare = prompts.prompt_tokens(tok, names, ("{}",))[:, 0]
  np.testing.assert_array_equal(bare, tok.encode(names))


def test_training_prompts_one_template_per_label_drawn_by_the_rng():
  """[C, P, L] class tokens (data.train_prompt_templates='clip_80'): each query row is one of
  its class's prompts, drawn from the example's generator (reproducible, varied)."""
  tok = WordHashTokenizer(vocab_size=4096, context_length=16)
  names = ["red plain", "blue striped", "green dotted"]
  tokens = prompts.prompt_tokens(tok, names, prompts.TRAINING_TEMPLATES)  # [3, 81, 16]
  example = {
    "image": np.zeros((20, 20, 3), np.uint8),
    "boxes": np.array([[1, 1, 8, 8], [10, 10, 18, 18]], np.float32),
    "labels": np.array([0, 2]),
    "image_id": 1,
  }
  spec = ExampleSpec(
    class_tokens=tokens,
    empty_tokens=tok.encode([""])[0],
    image_size=16,
    num_queries=4,
    max_instances=3,
    num_negatives=1,
  )
  drawn = set()
  for seed in range(40):
    out = input_pipeline.preprocess_train_example(
      example, spec, rng=input_pipeline.example_rng(seed, 0, 0)
    )
    again = input_pipeline.preprocess_train_example(
      example, spec, rng=input_pipeline.example_rng(seed, 0, 0)
    )
    np.testing.assert_array_equal(out["queries"], again["queries"])
    for q, cls in zip(out["queries"], out["query_class"]):
      if cls < 0:
        np.testing.assert_array_equal(q, spec.empty_tokens)
        continue
      match = np.flatnonzero((tokens[cls] == q).all(-1))
      assert match.size >= 1, (seed, cls)
      drawn.add((int(cls), int(match[0])))
  assert len({p for c, p in drawn if c == 0}) > 20  # many different templates are drawn
  # The default [C, L] class tokens keep the bare names (built-in benchmark behaviour).
  plain = input_pipeline.preprocess_train_example(
    example,
    dataclasses.replace(spec, class_tokens=tokens[:, 0]),
    rng=input_pipeline.example_rng(0, 0, 0),
  )
  for q, cls in zip(plain["queries"], plain["query_class"]):
    if cls >= 0:
      np.testing.assert_array_equal(q, tok.encode([names[cls]])[0])

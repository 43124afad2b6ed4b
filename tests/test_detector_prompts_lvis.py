"""Detector wiring of the CLIP tokenizer, prompt templates and the LVIS protocol (docs/reference.md
§2, §4)."""

import gzip
import json
import os

import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest

from owl_cl.config_fields import ConfigError
from owl_cl.data import coco
from owl_cl.data import prompts
from owl_cl.detector import Detector
from owl_cl.testing.configs import tiny_detector_config as tiny_config


@pytest.fixture(scope="module")
def lvis_source(tmp_path_factory):
  """An LVIS-v1-schema json (with file_name, so CocoSource reads it) and 3 PNG images."""
  root = tmp_path_factory.mktemp("lvis_source")
  os.makedirs(root / "images")
  categories = [
    {"id": i, "name": n, "frequency": f, "synonyms": [n], "def": n}
    for i, n, f in ((2, "red_plain", "r"), (5, "blue striped", "c"), (9, "Hot spot", "f"))
  ]
  images, annotations = [], []
  for k, (h, w) in enumerate(((24, 32), (32, 20), (30, 30))):
    Image.fromarray(np.full((h, w, 3), 60 * k, np.uint8)).save(root / "images" / f"{k}.png")
    images.append(
      {
        "id": 10 + k,
        "file_name": f"{k}.png",
        "height": h,
        "width": w,
        "neg_category_ids": [categories[(k + 1) % 3]["id"]],
        "not_exhaustive_category_ids": [],
      }
    )
    annotations.append(
      {
        "id": k + 1,
        "image_id": 10 + k,
        "category_id": categories[k]["id"],
        "bbox": [2.0, 3.0, 10.0, 12.0],
        "area": 120.0,
        "iscrowd": 0,
      }
    )
  path = root / "lvis_tiny.json"
  path.write_text(
    json.dumps({"images": images, "annotations": annotations, "categories": categories})
  )
  return coco.CocoSource(str(path), str(root / "images"), name="lvis_tiny")


@pytest.mark.slow
def test_template_query_embeddings_and_lvis_protocol(lvis_source):
  detector = Detector(tiny_config(**{"eval.prompt_templates": "owl_vit_7"}))
  params = detector.init_params(0)
  q = detector.eval_query_embeddings(params, lvis_source)
  assert q.shape == (7, 3, 32)
  # Slice [p, c] is the text embedding of class c's prompt under template p.
  text = prompts.prompt_texts(lvis_source.class_names, prompts.OWL_VIT_EVAL_TEMPLATES)
  assert text[2][0] == "itap of a hot spot"  # text is [C][P]
  direct = detector._text_embed(
    params, jnp.asarray(detector.tokenizer.encode([text[2][0], text[1][4]]))
  )
  np.testing.assert_allclose(np.asarray(q[4, 1]), np.asarray(direct[1]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(q[0, 2]), np.asarray(direct[0]), rtol=1e-5, atol=1e-6)
  result = detector.evaluate(params, lvis_source, "lvis", protocol="lvis")
  assert result["num_images"] == 3
  for key in ("AP", "APr", "APc", "APf"):
    assert 0.0 <= result[key] <= 1.0, key
  with pytest.raises(ValueError, match="protocol"):
    detector.evaluate(params, lvis_source, "x", protocol="voc")


def test_default_runner_keeps_bare_names(lvis_source):
  detector = Detector(tiny_config())
  tokens = detector.train_class_tokens(lvis_source)
  np.testing.assert_array_equal(
    tokens, detector.tokenizer.encode(["red plain", "blue striped", "hot spot"])
  )
  prompted = Detector(tiny_config(**{"data.train_prompt_templates": "clip_80"}))
  assert prompted.train_class_tokens(lvis_source).shape == (3, 81, 8)


def test_clip_tokenizer_and_config_errors(tmp_path):
  with pytest.raises(ConfigError, match="tokenizer_vocab_path"):
    Detector(tiny_config(**{"model.tokenizer": "clip"}))
  with pytest.raises(FileNotFoundError, match="nowhere.txt.gz"):
    Detector(
      tiny_config(
        **{
          "model.tokenizer": "clip",
          "model.tokenizer_vocab_path": str(tmp_path / "nowhere.txt.gz"),
        }
      )
    )
  vocab = tmp_path / "bpe_simple_vocab_16e6.txt.gz"
  with gzip.open(vocab, "wb") as f:
    f.write(b"#version: 0.2\nr e\nre d</w>\n")
  detector = Detector(
    tiny_config(**{"model.tokenizer": "clip", "model.tokenizer_vocab_path": str(vocab)})
  )
  # 256 + 256 + 2 merges + SOT/EOT = 516 ids; 'red' -> one merged token.
  assert detector.tokenizer.sot_token == 514 and detector.tokenizer.context_length == 8
  assert list(detector.tokenizer.encode(["Red"])[0]) == [514, 513, 515, 0, 0, 0, 0, 0]
  with pytest.raises(ConfigError, match="prompt_templates"):
    Detector(tiny_config(**{"eval.prompt_templates": "clip_80"}))
  with pytest.raises(ConfigError, match="ensemble"):
    Detector(tiny_config(**{"eval.ensemble": "mean"}))

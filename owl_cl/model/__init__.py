"""OWL-ViT v1 model (scenic parameter tree) and query tokenizers.

Public API (CONVENTIONS.md, Model / Tokenizer; docs/reference.md §1, §2):

* :func:`create_model` ``(variant, **overrides) -> OwlViT``; :func:`get_variant_config`
  ``-> ModelConfig`` (also ``model.config``);
  :data:`VARIANTS` (``tiny``, ``vit_b32``, ``vit_b16``, ``vit_l14``).
* :class:`OwlViT` with methods ``image_embedder``, ``text_embedder``, ``class_predictor``,
  ``box_predictor``; :func:`compute_box_bias`.
* :func:`get_tokenizer`, :class:`WordHashTokenizer`, :func:`canonicalize_label`.

Checkpoints from scenic, HF transformers and OpenAI CLIP convert through
:mod:`owl_cl.model.convert` (imported on demand, not here).
"""

from owl_cl.model.clip import quick_gelu
from owl_cl.model.owl_vit import VARIANTS
from owl_cl.model.owl_vit import ModelConfig
from owl_cl.model.owl_vit import OwlViT
from owl_cl.model.owl_vit import compute_box_bias
from owl_cl.model.owl_vit import create_model
from owl_cl.model.owl_vit import get_variant_config
from owl_cl.model.text import canonicalize_label
from owl_cl.model.tokenizer import WordHashTokenizer
from owl_cl.model.tokenizer import get_tokenizer
from owl_cl.model.tokenizer import known_tokenizers
from owl_cl.model.tokenizer import register_tokenizer

__all__ = [
  "ModelConfig",
  "OwlViT",
  "VARIANTS",
  "WordHashTokenizer",
  "canonicalize_label",
  "compute_box_bias",
  "create_model",
  "get_tokenizer",
  "get_variant_config",
  "known_tokenizers",
  "quick_gelu",
  "register_tokenizer",
]

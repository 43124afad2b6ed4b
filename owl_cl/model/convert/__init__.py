"""OWL-ViT checkpoints from elsewhere, converted to and from our parameter tree.

One module per format, all returning the ``params`` collection as a nested ``dict`` of float32
``np.ndarray`` whose paths and shapes equal our module's (docs/reference.md §1.1), or raising
:class:`CheckpointMismatchError` that lists every missing, unexpected and wrongly shaped path:

* ``tree``: the shared checks (:func:`check_params`, :func:`abstract_params`) and model-config
  inference (:func:`infer_model_config`, :func:`model_config_to_dict`).
* ``scenic``: scenic's legacy Flax msgpack files (:func:`load_scenic_checkpoint`).
* ``hf``: HF transformers ``OwlViTForObjectDetection`` in both directions
  (:func:`load_hf_checkpoint`, :func:`save_hf_checkpoint`, ...).
* ``openai_clip``: OpenAI CLIP TorchScript files as the towers' initialisation
  (:func:`load_clip_torchscript`, :func:`fresh_head_params`).
* ``layouts``: how a leaf is stored in torch (shared by ``hf`` and ``openai_clip``).
* ``cli``: ``python -m owl_cl.model.convert ...`` (see docs/checkpoints.md).

Not to be confused with ``owl_cl.train.checkpointing``, which saves and restores a run's own
state. This package re-exports every public function, so ``from owl_cl.model import convert``
and ``convert.load_scenic_checkpoint(...)`` is all a caller needs.
"""

from owl_cl.model.convert.cli import main
from owl_cl.model.convert.hf import HF_IGNORED_KEYS
from owl_cl.model.convert.hf import hf_config_to_model_config
from owl_cl.model.convert.hf import hf_state_dict_to_params
from owl_cl.model.convert.hf import load_hf_checkpoint
from owl_cl.model.convert.hf import load_hf_state_dict
from owl_cl.model.convert.hf import model_config_to_hf_config
from owl_cl.model.convert.hf import params_to_hf_state_dict
from owl_cl.model.convert.hf import save_hf_checkpoint
from owl_cl.model.convert.openai_clip import CLIP_IGNORED_KEYS
from owl_cl.model.convert.openai_clip import fresh_head_params
from owl_cl.model.convert.openai_clip import load_clip_torchscript
from owl_cl.model.convert.scenic import fix_scenic_names
from owl_cl.model.convert.scenic import load_scenic_checkpoint
from owl_cl.model.convert.scenic import read_scenic_checkpoint
from owl_cl.model.convert.tree import CheckpointMismatchError
from owl_cl.model.convert.tree import abstract_params
from owl_cl.model.convert.tree import check_params
from owl_cl.model.convert.tree import infer_model_config
from owl_cl.model.convert.tree import model_config_from_dict
from owl_cl.model.convert.tree import model_config_to_dict

__all__ = [
  "CLIP_IGNORED_KEYS",
  "CheckpointMismatchError",
  "HF_IGNORED_KEYS",
  "abstract_params",
  "check_params",
  "fix_scenic_names",
  "fresh_head_params",
  "hf_config_to_model_config",
  "hf_state_dict_to_params",
  "infer_model_config",
  "load_clip_torchscript",
  "load_hf_checkpoint",
  "load_hf_state_dict",
  "load_scenic_checkpoint",
  "main",
  "model_config_from_dict",
  "model_config_to_dict",
  "model_config_to_hf_config",
  "params_to_hf_state_dict",
  "read_scenic_checkpoint",
  "save_hf_checkpoint",
]

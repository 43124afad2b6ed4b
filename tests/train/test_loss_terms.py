"""The loss-term registry (`owl_cl.train.loss_terms`): a term registered from a module of its
own reaches `detection_loss` and the train step's loss (docs/extending.md, "A loss term")."""

import dataclasses
import importlib
import pathlib
import sys
import textwrap

import jax
import numpy as np
import pytest

from owl_cl.train import loss_terms
from owl_cl.train import losses
from owl_cl.train.spec import LossSpec

# The throwaway term, as a user writes it (docs/extending.md): each image's number of tokens
# matched to a real instance, normaliser 1, so its per-image value is that count.
TERM_MODULE = textwrap.dedent(
  '''
  import jax.numpy as jnp

  from owl_cl.train import loss_terms


  def count_term(m):
    """(#matched real instances, 1) of each image."""
    count = jnp.sum(m.matched.astype(jnp.float32), axis=1)
    return count, jnp.ones_like(count)


  loss_terms.register(loss_terms.LossTerm("loss_count", "count_weight", count_term))
  '''
)


@pytest.fixture
def count_term(tmp_path, monkeypatch):
  """Imports the throwaway term's module from a temporary folder; unregisters it after."""
  (tmp_path / "count_term.py").write_text(TERM_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  importlib.import_module("count_term")
  yield
  loss_terms.unregister("loss_count")
  sys.modules.pop("count_term", None)


def _example():
  """Two images, three tokens, queries ('', cat, dog). Image 0: two real instances (a cat and
  a dog); image 1: one cat and a padding instance. Each real instance is matched to exactly
  one token (3 tokens >= 2 instances), so #matched = [2, 1]."""
  logits = np.array(
    [[[0.0, 2.0, -1.0], [0.0, -1.0, 2.0], [0.0, -2.0, -2.0]]] * 2, np.float32
  )  # [2, 3, 3]
  boxes = np.array([[[0.3, 0.3, 0.2, 0.2], [0.7, 0.7, 0.2, 0.2], [0.5, 0.5, 0.1, 0.1]]] * 2)
  labels = np.array([[[0, 1, 0], [0, 0, 1]], [[0, 1, 0], [1, 0, 0]]], np.float32)  # [2, 2, 3]
  targets = np.array([[[0.3, 0.3, 0.2, 0.2], [0.7, 0.7, 0.2, 0.2]]] * 2, np.float32)
  return logits, boxes.astype(np.float32), labels, targets


@pytest.mark.parametrize("normalization", ["per_image", "per_batch"])
def test_registered_term_reaches_detection_loss(count_term, normalization):
  logits, boxes, labels, targets = _example()
  loss = lambda **kw: losses.detection_loss(
    logits, boxes, labels, targets, normalization=normalization, matcher="scipy", **kw
  )
  without, off, on = loss(), loss(count_weight=0.0), loss(count_weight=0.5)
  assert "loss_count" not in without and "loss_count" not in off  # weight 0: off
  # Hand-worked: per image 2 and 1 matched instances; 'per_image': the mean (2 + 1) / 2;
  # 'per_batch': the sum 3 over the sum of the normalisers 2. Both 1.5.
  assert float(on["loss_count"]) == 1.5
  np.testing.assert_array_equal(on["per_example"], without["per_example"] + 0.5 * np.array([2, 1]))
  # The built-in terms are unchanged, bit for bit (the new term is added after them).
  for name in ("loss_class", "loss_bbox", "loss_giou"):
    assert float(on[name]) == float(without[name])
  # The loss grows by 0.5 x 1.5; the sums of float32 values of magnitude ~3 round at their
  # spacing, 2.4e-7 (a mean's rounding differs from the separate addition by an ulp or two).
  np.testing.assert_allclose(float(on["loss"]), float(without["loss"]) + 0.75, atol=1e-6)


def test_register_refuses_a_clash_and_detection_loss_an_unknown_weight():
  with pytest.raises(ValueError, match="clashes with the registered 'loss_class'"):
    loss_terms.register(loss_terms.LossTerm("loss_other", "class_weight", loss_terms.class_term))
  logits, boxes, labels, targets = _example()
  with pytest.raises(TypeError, match="no registered loss term: \\['count_weight'\\]"):
    losses.detection_loss(logits, boxes, labels, targets, count_weight=1.0)


@pytest.mark.slow
def test_registered_term_reaches_the_train_step(count_term):
  """Its weight as a field of the `loss` section (here a subclass of `LossSpec`, as the field
  added to `owl_cl/train/spec.py` would be) reaches the train step's loss and metrics."""
  from owl_cl.train import step as step_lib
  from tests.train.test_loss_adaptivity import _setup

  model, params, new, _ = _setup()
  spec_cls = dataclasses.make_dataclass(
    "CountLossSpec", [("count_weight", float, 0.0)], bases=(LossSpec,), frozen=True
  )
  step = jax.jit(step_lib._loss_fn, static_argnames=("model", "spec"))  # pylint: disable=protected-access
  run = lambda weight: step(
    params,
    new,
    None,
    jax.random.PRNGKey(0),
    model=model,
    spec=step_lib.StepSpec(loss=spec_cls(matcher="jax", count_weight=weight)),
  )[1]
  off, on = jax.device_get(run(0.0)), jax.device_get(run(0.5))
  # Hand-worked from the batch: each real instance (a row with a positive label among columns
  # 1..) is matched to one token; the tiny model has 16 tokens >= every image's instances.
  real = (np.asarray(new["labels"])[..., 1:] > 0).any(axis=-1).sum(axis=1)
  assert float(on["loss_count"]) == pytest.approx(real.mean(), abs=0)
  # As above: float32 sums of magnitude ~10, spacing ~1e-6.
  np.testing.assert_allclose(on["loss"], off["loss"] + 0.5 * real.mean(), atol=1e-5)
  assert on["loss_class"] == off["loss_class"]


def test_extending_docs_show_the_tested_module():
  """docs/extending.md's "A loss term" shows exactly the module this file registers."""
  docs = (pathlib.Path(__file__).parents[2] / "docs" / "extending.md").read_text()
  assert textwrap.indent(TERM_MODULE.strip(), "    ") in docs

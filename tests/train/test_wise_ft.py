"""WiSE-FT (owl_cl.train.wise_ft, docs/baselines.md "WiSE-FT"): the blend by hand, its end
points, dtypes, the LoRA form against the blend of the merged kernels, and when it applies."""

import jax.numpy as jnp
import numpy as np
import pytest

from owl_cl import config_spec
from owl_cl.config_fields import ConfigError
from owl_cl.model import lora
from owl_cl.testing.configs import load_config
from owl_cl.train import wise_ft
from owl_cl.train.spec import TrainSpec

THETA_0 = {
  "dense": {"kernel": np.array([[1.0, 2.0], [-3.0, 0.5]], np.float32)},
  "bias": np.array([4.0, -8.0], np.float32),
}
THETA_FT = {
  "dense": {"kernel": np.array([[3.0, -2.0], [1.0, 0.5]], np.float32)},
  "bias": np.array([0.0, 8.0], np.float32),
}


def _leaves(tree):
  return {"kernel": np.asarray(tree["dense"]["kernel"]), "bias": np.asarray(tree["bias"])}


def test_blend_hand_worked_and_its_end_points():
  # alpha 0.25: 0.75 * theta_0 + 0.25 * theta_ft, worked by hand:
  # kernel [[0.75 + 0.75, 1.5 - 0.5], [-2.25 + 0.25, 0.375 + 0.125]], bias [3 + 0, -6 + 2].
  out = _leaves(wise_ft.blend(THETA_0, THETA_FT, 0.25))
  np.testing.assert_array_equal(out["kernel"], [[1.5, 1.0], [-2.0, 0.5]])
  np.testing.assert_array_equal(out["bias"], [3.0, -4.0])
  # alpha 0.5: the mean, (theta_0 + theta_ft) / 2.
  out = _leaves(wise_ft.blend(THETA_0, THETA_FT, 0.5))
  np.testing.assert_array_equal(out["kernel"], [[2.0, 0.0], [-1.0, 0.5]])
  np.testing.assert_array_equal(out["bias"], [2.0, 0.0])
  # alpha 0: the pre-trained model; alpha 1: the fine-tuned one, exactly (0 * x = 0).
  for alpha, expected in ((0.0, THETA_0), (1.0, THETA_FT)):
    out = _leaves(wise_ft.blend(THETA_0, THETA_FT, alpha))
    for name, value in _leaves(expected).items():
      np.testing.assert_array_equal(out[name], value)


def test_blend_keeps_each_leafs_dtype():
  theta_0 = {"w": np.array([1.0, 3.0], np.float32), "h": jnp.array([1.0, 2.0], jnp.bfloat16)}
  theta_ft = {"w": np.array([2.0, 5.0], np.float32), "h": jnp.array([3.0, 2.0], jnp.bfloat16)}
  out = wise_ft.blend(theta_0, theta_ft, 0.5)
  assert out["w"].dtype == jnp.float32 and out["h"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["w"]), [1.5, 4.0])
  np.testing.assert_array_equal(np.asarray(out["h"], np.float32), [2.0, 2.0])
  # bfloat16 has 8 significant bits: 1 + 2^-7 and 1 + 2^-6 are neighbours, and their mean
  # 1 + 1.5 * 2^-7 lies half-way: cast back to bfloat16 it rounds to the even one, 1 + 2^-6.
  a = jnp.array([1 + 2**-7], jnp.bfloat16)
  b = jnp.array([1 + 2**-6], jnp.bfloat16)
  got = wise_ft.blend({"x": a}, {"x": b}, 0.5)["x"]
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), [1 + 2**-6])


def test_blend_refuses_what_cannot_be_blended():
  with pytest.raises(ValueError, match=r"alpha=1.5 must be in \[0, 1\]"):
    wise_ft.blend(THETA_0, THETA_FT, 1.5)
  with pytest.raises(ValueError, match="trees differ"):
    wise_ft.blend(THETA_0, {"bias": THETA_FT["bias"]}, 0.5)
  with pytest.raises(ValueError, match=r"\['bias'\] has shape \(2,\) and \(3,\)"):
    wise_ft.blend(THETA_0, dict(THETA_FT, bias=np.zeros(3, np.float32)), 0.5)
  with pytest.raises(ValueError, match=r"\['bias'\] is not floating"):
    wise_ft.blend(THETA_0, dict(THETA_FT, bias=np.zeros(2, np.int32)), 0.5)


def test_lora_blend_is_the_blend_of_the_merged_kernels():
  """W + s A (alpha B) = (1 - alpha) W + alpha (W + s A B): the LoRA form equals the blend of
  the merged kernels with the pre-trained ones, the base bit for bit unchanged."""
  options = lora.LoraOptions(rank=1, alpha=2.0)  # s = 2
  params = {
    "d": {
      "kernel": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
      "kernel_lora_a": np.array([[1.0], [2.0]], np.float32),
      "kernel_lora_b": np.array([[3.0, 4.0]], np.float32),
    },
    "head": {"bias": np.array([0.25, -1.0], np.float32)},  # no adapter: left as it is
  }
  out = wise_ft.blend_lora(params, 0.5)
  np.testing.assert_array_equal(np.asarray(out["d"]["kernel_lora_b"]), [[1.5, 2.0]])
  for path in (("d", "kernel"), ("d", "kernel_lora_a"), ("head", "bias")):
    assert out[path[0]][path[1]] is params[path[0]][path[1]]
  # By hand: merged fine-tuned kernel W + 2 [[1], [2]] [[3, 4]] = [[7, 10], [15, 20]]; its
  # blend with W at alpha 0.5 is [[4, 6], [9, 12]], the merge of the scaled adapters.
  merged = lora.merge(out, options)["d"]["kernel"]
  np.testing.assert_array_equal(np.asarray(merged), [[4.0, 6.0], [9.0, 12.0]])
  theta_0 = {"d": {"kernel": params["d"]["kernel"]}, "head": params["head"]}
  np.testing.assert_array_equal(
    np.asarray(merged),
    np.asarray(wise_ft.blend(theta_0, lora.merge(params, options), 0.5)["d"]["kernel"]),
  )
  with pytest.raises(ValueError, match="no '\\*_lora_b' adapter"):
    wise_ft.blend_lora(theta_0, 0.5)
  # A LoRA run's stage blend is this form, without theta_0 (a LoRA run keeps none).
  spec = wise_ft.WiseFtSpec(alpha=0.5, when="each")
  staged = wise_ft.after_stage(
    spec, None, params, stage=1, num_stages=2, schedule="sequence", lora=True
  )
  np.testing.assert_array_equal(np.asarray(staged["d"]["kernel_lora_b"]), [[1.5, 2.0]])


@pytest.mark.parametrize(
  "when, schedule, expected",
  [
    ("each", "sequence", [True, True, True]),
    ("end", "sequence", [False, False, True]),
    ("end", "per_task", [True, True, True]),  # each task's model ends its own sequence
    ("each", "per_task", [True, True, True]),
  ],
)
def test_blends_after_each_or_the_last_stage(when, schedule, expected):
  spec = wise_ft.WiseFtSpec(alpha=0.5, when=when)
  assert [wise_ft.blends_after(spec, i, 3, schedule) for i in (1, 2, 3)] == expected
  off = wise_ft.WiseFtSpec(alpha=1.0, when=when)
  assert not any(wise_ft.blends_after(off, i, 3, schedule) for i in (1, 2, 3))
  assert (
    wise_ft.after_stage(
      off, THETA_0, THETA_FT, stage=3, num_stages=3, schedule=schedule, lora=False
    )
    is THETA_FT
  )


def test_the_config_and_its_spec():
  config = load_config("wise_ft")
  spec = config_spec.from_config(TrainSpec, config.train, "train").wise_ft
  assert spec == wise_ft.WiseFtSpec(alpha=0.5, when="each") and spec.on
  assert config.replay.algorithm == "none" and config.experiment_name == "wise_ft"
  # Off by default: every other config is unchanged.
  assert not config_spec.from_config(TrainSpec, load_config("swil").train, "train").wise_ft.on
  config.train.wise_ft.when = "always"
  with pytest.raises(
    ConfigError, match=r"config.train.wise_ft.when='always' is unknown; known: \['each', 'end'\]"
  ):
    config_spec.from_config(TrainSpec, config.train, "train")

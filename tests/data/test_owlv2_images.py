"""OWLv2 preprocessing (owl_cl.data.owlv2_images) against HF's Owlv2ImageProcessorPil."""

import numpy as np
import pytest

from owl_cl.data import owlv2_images

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")


@pytest.mark.parametrize("shape,size", [((30, 50, 3), 24), ((41, 17, 3), 32), ((20, 20, 3), 40)])
def test_matches_hf_owlv2_image_processor(shape, size):
  """Down-sampling (both aspect ratios) and up-sampling; HF (transformers 5) pads with 0.0."""
  rng = np.random.default_rng(sum(shape) + size)
  image = rng.integers(0, 256, shape, dtype=np.uint8)
  processor = transformers.Owlv2ImageProcessorPil(
    size={"height": size, "width": size}, do_normalize=False
  )
  hf = processor(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
  ours = owlv2_images.pad_then_resize(image, size, pad_value=0.0)
  assert ours.shape == (size, size, 3) and ours.dtype == np.float32
  # Same scipy calls on the same float32 input: equal up to float32 rounding of values in [0, 1].
  np.testing.assert_allclose(ours, hf, atol=1e-6, rtol=0)


def test_pad_value_and_geometry_hand_worked():
  """A 2 x 4 white image to 4 x 4 (no filter: factor 1): rows 0-1 white, rows 2-3 the fill."""
  image = np.full((2, 4, 3), 255, np.uint8)
  out = owlv2_images.pad_then_resize(image, 4)
  np.testing.assert_array_equal(out[:2], 1.0)
  np.testing.assert_array_equal(out[2:], 0.5)  # scenic's gray fill
  # Down by 2 (8 x 8 -> 4 x 4) of a constant image stays constant (filter and zoom average).
  const = np.full((8, 8, 3), 0.25, np.float32)
  np.testing.assert_allclose(owlv2_images.pad_then_resize(const, 4), 0.25, atol=1e-7)


def test_bad_input_named():
  with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
    owlv2_images.pad_then_resize(np.zeros((4, 4)), 4)
  with pytest.raises(ValueError, match="pad_value"):
    owlv2_images.pad_then_resize(np.zeros((4, 4, 3)), 4, pad_value=2.0)

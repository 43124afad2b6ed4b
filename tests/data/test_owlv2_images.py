"""OWLv2 preprocessing (owl_cl.data.owlv2_images) against HF's Owlv2ImageProcessorPil."""

import numpy as np
import pytest

from owl_cl.data import owlv2_images

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")


@pytest.mark.slow
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


def test_pipeline_uses_pad_then_resize_and_v1_boxes():
  """`resize='pad_then_resize'` (an OWLv2 model's pipeline): the training image is exactly
  `pad_then_resize(image, S, 0.5)` and the evaluation image `pad_then_resize(image, S, 0.0)`;
  the boxes, labels and queries are v1's (the content sits at the same place and scale
  S / max(H, W)). The functions are the ones tested against HF above."""
  from owl_cl.data import image_ops
  from owl_cl.data import input_pipeline
  from owl_cl.data.spec import ExampleSpec

  size = 32
  rng = np.random.default_rng(3)
  example = dict(
    image=rng.integers(0, 256, (30, 50, 3), dtype=np.uint8),
    boxes=np.array([[5, 3, 25, 20], [30, 10, 48, 29]], np.float32),
    labels=np.array([1, 2]),
    image_id=7,
  )
  tokens = np.zeros((4, 16), np.int32)
  tokens[:, 0], tokens[:, 1], tokens[:, 2] = 49406, 1000 + np.arange(4), 49407
  empty = np.zeros(16, np.int32)
  empty[:2] = 49406, 49407
  spec = ExampleSpec(tokens, empty, size, num_queries=4, max_instances=3, num_negatives=1)

  def train(**kw):
    return input_pipeline.preprocess_train_example(
      example, spec, rng=np.random.default_rng(0), **kw
    )

  v1, v2 = train(), train(resize="pad_then_resize")
  np.testing.assert_array_equal(v2["images"], owlv2_images.pad_then_resize(example["image"], size))
  assert not np.array_equal(v2["images"], v1["images"])  # another resampling
  for k in ("boxes", "labels", "queries", "query_class", "orig_size"):
    np.testing.assert_array_equal(v2[k], v1[k], err_msg=k)
  # Box 0 (x 5..25, y 3..20 of 50 x 30) at scale 32 / 50, as cx, cy, w, h / S: hand-worked.
  np.testing.assert_allclose(
    v2["boxes"][0], np.array([15, 11.5, 20, 17]) * (32 / 50) / 32, rtol=1e-6
  )
  ev = input_pipeline.preprocess_eval_example(
    example, image_size=size, pad_value=0.0, resize="pad_then_resize"
  )
  np.testing.assert_array_equal(
    ev["images"], owlv2_images.pad_then_resize(example["image"], size, 0.0)
  )
  with pytest.raises(ValueError, match="squash"):
    image_ops.preprocess_image(example["image"], size, 0.5, squash=True, method="pad_then_resize")
  with pytest.raises(ValueError, match="unknown resize method 'crop'"):
    image_ops.preprocess_image(example["image"], size, 0.5, method="crop")


def test_owlv2_detector_and_buffer_images_pad_then_resize(tmp_path):
  """An OWLv2 detector's training and evaluation options pick 'pad_then_resize' (v1's stay
  as they were), the replay store's images by reference are re-made with it (the uint8 cache
  has no stage of it and is not used), and squash_resize is refused up front for OWLv2."""
  from owl_cl import validation
  from owl_cl.configs import base
  from owl_cl.data import input_pipeline
  from owl_cl.detector import Detector
  from owl_cl.replay import images as images_lib

  v2 = base.get_config("owlv2")
  detector = Detector(v2)
  assert detector.resize_method == "pad_then_resize"
  source = [
    dict(image=np.random.default_rng(i).integers(0, 256, (20 + i, 30, 3), dtype=np.uint8))
    for i in range(2)
  ]
  options = detector.example_options(source)
  assert options["resize"] == "pad_then_resize"
  assert "resize" not in Detector(base.get_config("")).example_options(source)

  class Source:
    def __len__(self):
      return len(source)

    def load(self, i):
      return dict(source[i], image_id=i)

  images = images_lib.BufferImages(
    Source(),
    np.array([1, 0]),
    np.array([1, 0]),
    image_size=16,
    resize="pad_then_resize",
    cache_dir=str(tmp_path / "cache"),
    cache_key="k",
  )
  assert images.cache is None
  got = images(np.array([0, 1, 0]))
  for row, i in enumerate([1, 0, 1]):
    np.testing.assert_array_equal(got[row], owlv2_images.pad_then_resize(source[i]["image"], 16))
  batch = next(
    iter(
      input_pipeline.eval_dataset(
        [dict(s, image_id=i) for i, s in enumerate(source)],
        image_size=16,
        batch_size=2,
        resize="pad_then_resize",
      )
    )
  )
  np.testing.assert_array_equal(
    batch["images"][1], owlv2_images.pad_then_resize(source[1]["image"], 16, 0.0)
  )
  v2.data.squash_resize = True
  (problem,) = validation.model_problems(v2)
  assert "config.data.squash_resize=True resizes without padding" in problem

"""OWLv2's image preprocessing: pad to a square, then resize with anti-aliasing.

OWL-ViT v1 (``owl_cl.data.pipeline.resize_with_pad``, scenic's ``ResizeWithPad``) resizes the
image so that its long side is S, then pads bottom/right; OWLv2 pads the image bottom/right to
a square first and resizes the square to S x S with a Gaussian anti-aliasing filter and linear
interpolation (skimage's ``resize``, which scenic's OWLv2 colab and HF's
``Owlv2ImageProcessorPil`` reproduce with scipy.ndimage). Both put the content at the top left
scaled by S / max(H, W), so boxes map the same way (``pipeline.scale_boxes``); the pixels
differ by the filter.
"""

from __future__ import annotations

import numpy as np

__all__ = [
  "OWLV2_PAD_VALUE",
  "pad_then_resize",
]

#: Fill of the padding in OWLv2's preprocessing: gray 0.5 (scenic `preprocessing/image_ops.py`,
#: ``pad_value: float = 0.5``; the OWLv2 colab pads with gray). HF's processor (transformers 5)
#: pads with 0.0; pass ``pad_value=0.0`` to match it (docs/owlv2.md).
OWLV2_PAD_VALUE = 0.5


def pad_then_resize(image: np.ndarray, size: int, pad_value: float = OWLV2_PAD_VALUE) -> np.ndarray:
  """OWLv2's preprocessing of one image, before CLIP normalisation.

  Steps: uint8 -> float (x / 255, float64 product cast to float32, as HF's ``rescale``); pad
  bottom/right to ``max(H, W)`` square with ``pad_value``; Gaussian filter with sigma
  ``max(0, (f - 1) / 2)`` per spatial axis, f = input / output size (mode 'mirror'); linear
  zoom to S x S (``scipy.ndimage.zoom``, order 1, ``grid_mode=True``, mode 'mirror'); clip to
  the padded image's value range.

  Args:
    image: [H, W, 3] uint8 (0..255) or float in [0, 1].
    size: S, output pixels per side (int >= 1).
    pad_value: fill of the padding, float in [0, 1] (default 0.5, scenic).

  Returns:
    float32 [S, S, 3] in [0, 1]; content at the top left, ``round(H * S / max(H, W))`` rows.

  Raises:
    ValueError: image not [H, W, 3], size < 1, pad_value outside [0, 1].

  Source: HF transformers `models/owlv2/image_processing_pil_owlv2.py`
  (``Owlv2ImageProcessorPil.pad``, ``resize``, ``_preprocess``); scikit-image
  ``transform.resize(anti_aliasing=True)``; scenic OWLv2 colab (pad to square, gray).
  """
  image = np.asarray(image)
  if image.ndim != 3 or image.shape[2] != 3:
    raise ValueError(f"image must be [H, W, 3], got shape {image.shape}")
  if int(size) < 1:
    raise ValueError(f"size must be >= 1, got {size}")
  if not 0.0 <= float(pad_value) <= 1.0:
    raise ValueError(f"pad_value must be in [0, 1], got {pad_value}")
  if image.dtype == np.uint8:
    image = (image.astype(np.float64) * (1 / 255)).astype(np.float32)
  image = image.astype(np.float32, copy=False)
  h, w = image.shape[:2]
  side = max(h, w)
  square = np.pad(
    image, ((0, side - h), (0, side - w), (0, 0)), constant_values=np.float32(pad_value)
  )
  factors = np.array([side / size, side / size, 1.0])
  # Anti-aliasing only when downsampling (sigma 0 elsewhere), as skimage / HF.
  sigma = np.maximum(0.0, (factors - 1) / 2)
  # Imported here: scipy.ndimage takes about 0.2 s to import, which every process of a run
  # (and every test subprocess) paid at start-up although only OWLv2 inputs use it.
  from scipy import ndimage  # noqa: PLC0415

  filtered = ndimage.gaussian_filter(square, sigma, cval=0, mode="mirror")
  out = ndimage.zoom(filtered, 1 / factors, order=1, mode="mirror", cval=0, grid_mode=True)
  return np.clip(out, square.min(), square.max()).astype(np.float32)

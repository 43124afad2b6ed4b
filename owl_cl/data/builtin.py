"""The built-in benchmark: a small, offline, deterministic stand-in for O365 / LVIS-rare / ODinW.

Scenes are generated once from a seed into a cache folder as COCO json + PNG files and are read
back through `owl_cl.data.coco.CocoSource` exactly like real data. Everything is built from
material that ships inside installed packages (no network):

* backgrounds and textures: scikit-image's bundled photographs (`skimage.data.astronaut`,
  `coffee`, `chelsea`, `rocket`, `camera`, `coins`, `moon`, `page`, `text`, `clock`, `brick`,
  `grass`, `gravel`, `hubble_deep_field`, `immunohistochemistry`, `cell`, `retina`,
  `checkerboard`, `stereo_motorcycle`) and matplotlib's `grace_hopper.jpg` sample image;
* handwritten digits: scikit-learn's `load_digits` (8x8 scans, upsampled);
* glyphs: matplotlib's bundled DejaVu fonts (`matplotlib.get_data_path()/fonts/ttf`);
* drawn shapes (polygons / ellipses rendered at 128 px and area-downsampled).

Objects never overlap (their masks are at least 2 px apart, box IoU < 0.3); each annotation's
box is the tight bounding box of the object's pixel mask (also stored as COCO RLE
`segmentation`, `area` = mask pixels).

Splits (defaults; see `BuiltinConfig`):

* `pretrain` (Objects365 stand-in): 20 colour x fill-pattern classes ('red plain',
  'blue striped', ...: 6 colours x 4 patterns minus 4 held-out pairs; object shapes vary as a
  nuisance), `train` 1,200 images, `val` 200 images, muted photograph backgrounds.
* `held_out` (LVIS-rare stand-in): the 4 held-out colour-pattern pairs — each word occurs in
  pre-training, the combination never does (also never as a downstream distractor); `val` 100.
* downstream (ODinW stand-in), 7 datasets of 2-4 new concepts, `train` 200 / `test` 60 each:
  `thermal` (inferno false colour; hot / warm objects), `negative` (inverted colours; patterned
  stickers), `tiny` (9-13 px objects after resizing to 64), `clutter` (unannotated
  distractors of pre-training classes), `textured` (objects filled with photograph crops),
  `digits` (large handwritten 0 / 1, each in its own ink), `glyphs` (letters W / O / I in
  DejaVu fonts, each in its own ink, on document backgrounds).

Learnability (the design constraint): every class is told apart by appearance visible inside
one 8 px patch of a 64 px input (colour, fill pattern, texture, intensity, ink colour); the
domain-specific outline (digits, glyphs, shapes) comes on top. Classes defined by silhouette
alone (colour x shape; shape-only heart/arrow/diamond; digits 0/1/4 and letters in random ink)
were learnt far too slowly by the tiny ViT trained from scratch on CPU (pre-training AP50 0.24
after 1,600 steps; 0.05-0.2 after 100 fine-tuning steps).

Scenes are 96-128 px on the long side, aspect ratio 0.7-1.43, with 1-4 annotated objects whose
long side is 20-45% of the scene's (>= 12.8 px after resizing to 64; `tiny`: 14-20%, >= 9 px;
`digits` 32-50%, `glyphs` 30-50%, 1-3 objects).

API: `ensure_benchmark(cache_dir, seed=0, **sizes) -> BuiltinBenchmark`,
`BuiltinBenchmark.describe()`, `render_preview(...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
import time
from typing import Any
import zlib

from absl import logging
import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

from owl_cl import integrity
from owl_cl import utils
from owl_cl.data.coco import CocoSource

__all__ = [
  "FORMAT_VERSION",
  "BuiltinConfig",
  "SplitFiles",
  "DownstreamDataset",
  "BuiltinBenchmark",
  "ensure_benchmark",
  "generate_benchmark",
  "render_preview",
  "PRETRAIN_COLORS",
  "PRETRAIN_PATTERNS",
  "HELD_OUT_PAIRS",
  "DOWNSTREAM_NAMES",
  "pretrain_class_names",
  "held_out_class_names",
  "downstream_class_names",
]

FORMAT_VERSION = 3  # bump whenever generated content changes (keys the cache)

# ------------------------------------------------------------------------------------------
# Class vocabulary.
# ------------------------------------------------------------------------------------------
COLORS: dict[str, tuple[int, int, int]] = {
  "red": (215, 35, 35),
  "green": (40, 170, 60),
  "blue": (35, 75, 225),
  "yellow": (245, 215, 40),
  "purple": (145, 55, 195),
  "brown": (140, 85, 35),
  "orange": (250, 135, 20),
  "cyan": (30, 205, 215),
  "pink": (250, 115, 195),
  "white": (245, 245, 240),
  "black": (25, 25, 25),
}
# Pre-training classes are colour x fill-pattern pairs. Both attributes are visible inside a
# single 8 px patch of a 64 px input, which a small ViT trained from scratch learns within a few
# hundred steps (silhouette-defined classes proved much slower: AP50 0.24 after 1600 steps).
# Object shapes vary as a nuisance (square, circle, triangle, hexagon).
PRETRAIN_COLORS = ("red", "green", "blue", "yellow", "purple", "brown")
PRETRAIN_PATTERNS = ("plain", "striped", "dotted", "checkered")
NUISANCE_SHAPES = ("square", "circle", "triangle", "hexagon")
# Held out: one colour per pattern (a Latin-square diagonal), so each word is still seen in
# pre-training (every pattern with 5 colours, every colour with >= 3 patterns) while these
# combinations never are (neither in pre-training nor as downstream distractors).
HELD_OUT_PAIRS = tuple((PRETRAIN_COLORS[i], PRETRAIN_PATTERNS[(i + 1) % 4]) for i in range(4))
_PRETRAIN_PAIRS = tuple(
  (c, p) for c in PRETRAIN_COLORS for p in PRETRAIN_PATTERNS if (c, p) not in HELD_OUT_PAIRS
)


def pretrain_class_names() -> list[str]:
  """The 20 pre-training classes, 'colour pattern' (e.g. 'red plain'), colour-major order."""
  return [f"{c} {p}" for c, p in _PRETRAIN_PAIRS]


def held_out_class_names() -> list[str]:
  """The 4 held-out (never pre-trained) classes, 'colour pattern'."""
  return [f"{c} {p}" for c, p in HELD_OUT_PAIRS]


@dataclasses.dataclass(frozen=True)
class _Obj:
  """How to draw one object class."""

  kind: str  # 'shape' | 'digit' | 'glyph'
  form: Any  # shape name | tuple of shape names (one drawn) | digit | letter
  fill: str  # 'color' | 'any_color' | 'texture' | 'hot' | 'warm' | 'ink'
  color: str = ""  # colour name for fill='color'; texture name for fill='texture'
  pattern: str = "plain"  # plain | striped | dotted | checkered


@dataclasses.dataclass(frozen=True)
class _Domain:
  """A dataset's rendering recipe."""

  name: str
  classes: tuple[tuple[str, _Obj], ...]
  size_frac: tuple[float, float] = (0.20, 0.45)  # object long side / scene long side
  n_objects: tuple[int, int] = (1, 4)
  background: str = "muted"  # muted | light | document | thermal
  bg_photos: tuple[str, ...] = ()  # () = the default photo set
  post: str = ""  # '' | 'invert' | 'thermal'
  distractors: tuple[int, int] = (0, 0)
  distractor_size: tuple[float, float] = (0.12, 0.30)
  description: str = ""


def _colour_pattern_domain(
  name: str, pairs: Sequence[tuple[str, str]], description: str
) -> _Domain:
  return _Domain(
    name,
    tuple((f"{c} {p}", _Obj("shape", NUISANCE_SHAPES, "color", c, p)) for c, p in pairs),
    description=description,
  )


# Ink colours of digits and glyphs: each class is written in its own ink (a cue visible inside
# one patch; outline-only classes were learnt too slowly in ~100 fine-tuning steps).
_INKS = {
  "blue ink": (30, 60, 190),
  "red ink": (185, 30, 30),
  "green ink": (25, 130, 45),
  "orange ink": (225, 115, 15),
  "purple ink": (125, 35, 165),
}
_BG_DEFAULT = (
  "astronaut",
  "coffee",
  "chelsea",
  "rocket",
  "camera",
  "coins",
  "moon",
  "clock",
  "grass",
  "gravel",
  "brick",
  "hubble",
  "ihc",
  "cell",
  "retina",
  "motorcycle",
  "grace_hopper",
  "page",
)
_TEXTURES = {
  "fur patch": "chelsea",
  "brick patch": "brick",
  "starfield patch": "hubble",
  "checkerboard patch": "checkerboard",
}

_DOWNSTREAM: tuple[_Domain, ...] = (
  _Domain(
    "thermal",
    (
      ("hot spot", _Obj("shape", ("circle", "hexagon"), "hot")),
      ("warm body", _Obj("shape", ("square", "triangle", "circle"), "warm")),
    ),
    size_frac=(0.22, 0.45),
    background="thermal",
    post="thermal",
    description="thermal-like false colour (inferno colour map of intensity): hot "
    "(white-yellow) and warm (red-orange) objects on a cool scene",
  ),
  _Domain(
    "negative",
    tuple(
      (f"{p} sticker", _Obj("shape", NUISANCE_SHAPES, "color", c, p))
      for p, c in (("striped", "orange"), ("dotted", "cyan"), ("checkered", "pink"))
    ),
    post="invert",
    description="colour negative of pre-training-like scenes: striped "
    "orange / dotted cyan / checkered pink stickers, "
    "inverted",
  ),
  _Domain(
    "tiny",
    (
      ("orange bead", _Obj("shape", "circle", "color", "orange")),
      ("cyan tile", _Obj("shape", "square", "color", "cyan")),
    ),
    size_frac=(0.14, 0.20),
    description="scale shift: tiny objects (9-13 px after resizing to 64)",
  ),
  _Domain(
    "clutter",
    (
      ("pink star", _Obj("shape", "star", "color", "pink")),
      ("white square", _Obj("shape", "square", "color", "white")),
    ),
    size_frac=(0.20, 0.40),
    n_objects=(1, 3),
    distractors=(3, 6),
    description="clutter: 3-6 unannotated distractors of pre-training classes",
  ),
  _Domain(
    "textured",
    tuple((n, _Obj("shape", "blob", "texture", t)) for n, t in _TEXTURES.items()),
    size_frac=(0.25, 0.45),
    bg_photos=(
      "astronaut",
      "coffee",
      "rocket",
      "camera",
      "coins",
      "moon",
      "grass",
      "gravel",
      "clock",
      "cell",
      "motorcycle",
      "grace_hopper",
    ),
    description="objects filled with photograph crops (cat fur, brick, Hubble "
    "starfield, checkerboard), dark outline",
  ),
  _Domain(
    "digits",
    (
      ("digit zero", _Obj("digit", 0, "ink", "blue ink")),
      ("digit one", _Obj("digit", 1, "ink", "red ink")),
    ),
    size_frac=(0.32, 0.50),
    n_objects=(1, 3),
    background="light",
    description="large handwritten digits 0 (blue ink) and 1 (red ink) "
    "(scikit-learn digits; train/test drawn from disjoint scans) on light "
    "paper",
  ),
  _Domain(
    "glyphs",
    (
      ("letter w", _Obj("glyph", "W", "ink", "green ink")),
      ("letter o", _Obj("glyph", "O", "ink", "orange ink")),
      ("letter i", _Obj("glyph", "I", "ink", "purple ink")),
    ),
    size_frac=(0.30, 0.50),
    n_objects=(1, 3),
    background="document",
    bg_photos=("page", "text"),
    description="letters W (green), O (orange), I (purple) in bold DejaVu fonts on "
    "document-photograph backgrounds",
  ),
)
DOWNSTREAM_NAMES = tuple(d.name for d in _DOWNSTREAM)
_DOMAINS = {d.name: d for d in _DOWNSTREAM}


def downstream_class_names() -> dict[str, list[str]]:
  """Downstream dataset name -> its class names (in contiguous index order)."""
  return {d.name: [n for n, _ in d.classes] for d in _DOWNSTREAM}


# ------------------------------------------------------------------------------------------
# Assets (bundled photographs, digits, fonts).
# ------------------------------------------------------------------------------------------
def _load_photos(max_side: int = 256) -> dict[str, np.ndarray]:
  import matplotlib.cbook
  import skimage.data as sd

  loaders = {
    "astronaut": sd.astronaut,
    "coffee": sd.coffee,
    "chelsea": sd.chelsea,
    "rocket": sd.rocket,
    "camera": sd.camera,
    "coins": sd.coins,
    "moon": sd.moon,
    "page": sd.page,
    "text": sd.text,
    "clock": sd.clock,
    "brick": sd.brick,
    "grass": sd.grass,
    "gravel": sd.gravel,
    "hubble": sd.hubble_deep_field,
    "ihc": sd.immunohistochemistry,
    "cell": sd.cell,
    "retina": sd.retina,
    "checkerboard": sd.checkerboard,
    "motorcycle": lambda: sd.stereo_motorcycle()[0],
    "grace_hopper": lambda: np.asarray(
      Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    ),
  }
  photos = {}
  for name, fn in loaders.items():
    a = np.asarray(fn())
    if a.dtype == bool:
      a = a.astype(np.uint8) * 255
    if a.ndim == 2:
      a = np.repeat(a[..., None], 3, axis=-1)
    a = a[..., :3].astype(np.uint8)
    im = Image.fromarray(a)
    s = max_side / max(im.size)
    if s < 1:
      im = im.resize((max(1, round(im.size[0] * s)), max(1, round(im.size[1] * s))), Image.LANCZOS)
    photos[name] = np.asarray(im)
  return photos


class _Assets:
  def __init__(self):
    import matplotlib
    from sklearn.datasets import load_digits

    self.photos = _load_photos()
    digits = load_digits()
    self.digit_images = digits.images.astype(np.float32) / 16.0
    self.digit_index = {d: np.nonzero(digits.target == d)[0] for d in range(10)}
    font_dir = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
    self.fonts = [
      ImageFont.truetype(os.path.join(font_dir, f), 96)
      for f in ("DejaVuSans-Bold.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSansMono-Bold.ttf")
    ]
    import matplotlib as mpl

    self.inferno = (mpl.colormaps["inferno"](np.linspace(0, 1, 256))[:, :3]).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Object masks.
# ------------------------------------------------------------------------------------------
_RES = 128  # hi-res canvas of one object mask


def _rot(pts: np.ndarray, angle: float) -> np.ndarray:
  c, s = np.cos(angle), np.sin(angle)
  return pts @ np.array([[c, s], [-s, c]])


def _poly(draw: ImageDraw.ImageDraw, pts: np.ndarray, fill: int = 255) -> None:
  r = _RES / 2
  draw.polygon([(float(r + x * r * 0.96), float(r + y * r * 0.96)) for x, y in pts], fill=fill)


def _ellipse(draw, cx, cy, rad, fill=255):
  r = _RES / 2
  draw.ellipse(
    [
      r + (cx - rad) * r * 0.96,
      r + (cy - rad) * r * 0.96,
      r + (cx + rad) * r * 0.96,
      r + (cy + rad) * r * 0.96,
    ],
    fill=fill,
  )


def _shape_hires(shape: str, rng: np.random.Generator) -> np.ndarray:
  """uint8 [_RES, _RES] mask (0/255) of a shape centred in the canvas."""
  img = Image.new("L", (_RES, _RES), 0)
  d = ImageDraw.Draw(img)
  full = rng.uniform(0, 2 * np.pi)
  small = np.deg2rad(rng.uniform(-20, 20))
  k = np.arange
  if shape == "triangle":
    a = full + k(3) * 2 * np.pi / 3
    _poly(d, np.stack([np.cos(a), np.sin(a)], -1))
  elif shape == "square":
    a = np.pi / 4 + k(4) * np.pi / 2
    _poly(d, _rot(np.stack([np.cos(a), np.sin(a)], -1), small))
  elif shape == "circle":
    _ellipse(d, 0, 0, 1.0)
  elif shape == "blob":  # texture patches: a disc, a tilted square or a hexagon
    kind = int(rng.integers(3))
    if kind == 0:
      _ellipse(d, 0, 0, 1.0)
    else:
      n = 4 if kind == 1 else 6
      a = (np.pi / 4 + small if n == 4 else full) + k(n) * 2 * np.pi / n
      _poly(d, np.stack([np.cos(a), np.sin(a)], -1))
  elif shape == "star":
    a = full + k(10) * np.pi / 5
    rad = np.where(k(10) % 2 == 0, 1.0, 0.42)
    _poly(d, np.stack([rad * np.cos(a), rad * np.sin(a)], -1))
  elif shape == "cross":
    w = 0.32
    pts = np.array(
      [
        [-w, -1],
        [w, -1],
        [w, -w],
        [1, -w],
        [1, w],
        [w, w],
        [w, 1],
        [-w, 1],
        [-w, w],
        [-1, w],
        [-1, -w],
        [-w, -w],
      ]
    )
    _poly(d, _rot(pts, small))
  elif shape == "hexagon":
    a = full + k(6) * np.pi / 3
    _poly(d, np.stack([np.cos(a), np.sin(a)], -1))
  elif shape == "crescent":
    _ellipse(d, 0, 0, 1.0)
    _ellipse(d, 0.45 * np.cos(full), 0.45 * np.sin(full), 0.85, fill=0)
  elif shape == "ring":
    _ellipse(d, 0, 0, 1.0)
    _ellipse(d, 0, 0, 0.55, fill=0)
  elif shape == "heart":
    t = np.linspace(0, 2 * np.pi, 60, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    pts = np.stack([x, y + 2.5], -1) / 17.0
    _poly(d, _rot(pts, small))
  elif shape == "arrow":
    pts = np.array(
      [[-1, -0.2], [0.15, -0.2], [0.15, -0.6], [1, 0], [0.15, 0.6], [0.15, 0.2], [-1, 0.2]]
    )
    _poly(d, _rot(pts, full))
  elif shape == "diamond":
    pts = np.array([[0, -1], [0.62, 0], [0, 1], [-0.62, 0]])
    _poly(d, _rot(pts, small))
  else:
    raise ValueError(f"unknown shape {shape!r}")
  return np.asarray(img)


def _digit_hires(assets: _Assets, digit: int, split: str, rng) -> np.ndarray:
  idx = assets.digit_index[digit]
  # train and test use disjoint scans (even / odd positions); val shares test's.
  pool = idx[0::2] if split == "train" else idx[1::2]
  img = assets.digit_images[pool[rng.integers(len(pool))]]
  im = Image.fromarray((img * 255).astype(np.uint8)).resize((96, 96), Image.BICUBIC)
  canvas = Image.new("L", (_RES, _RES), 0)
  canvas.paste(im, (16, 16))
  canvas = canvas.rotate(float(rng.uniform(-12, 12)), resample=Image.BILINEAR)
  # A threshold above mid-grey thins the blurry 8x8 strokes.
  return np.where(np.asarray(canvas) > 150, 255, 0).astype(np.uint8)


def _glyph_hires(assets: _Assets, letter: str, rng) -> np.ndarray:
  font = assets.fonts[rng.integers(len(assets.fonts))]
  canvas = Image.new("L", (_RES + 32, _RES + 32), 0)
  ImageDraw.Draw(canvas).text((24, 8), letter, fill=255, font=font)
  canvas = canvas.rotate(float(rng.uniform(-15, 15)), resample=Image.BILINEAR)
  return np.asarray(canvas)


def _tight(mask: np.ndarray) -> np.ndarray:
  ys = np.nonzero(mask.any(1))[0]
  xs = np.nonzero(mask.any(0))[0]
  return mask[ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1]


def _finalize(hires: np.ndarray, long_side: int, aspect: float) -> np.ndarray:
  """Crop a hi-res mask tight, area-resize so its long side is ~long_side, threshold, crop."""
  crop = _tight(hires > 127).astype(np.uint8) * 255
  hh, ww = crop.shape
  ww_a = ww * aspect
  s = long_side / max(hh, ww_a)
  nh, nw = max(2, int(round(hh * s))), max(2, int(round(ww_a * s)))
  small = np.asarray(Image.fromarray(crop).resize((nw, nh), Image.BOX))
  m = small >= 128
  if not m.any():
    m = small > 0
  return _tight(m)


def _object_mask(assets: _Assets, obj: _Obj, long_side: int, split: str, rng) -> np.ndarray:
  if obj.kind == "shape":
    form = obj.form if isinstance(obj.form, str) else obj.form[rng.integers(len(obj.form))]
    hires = _shape_hires(form, rng)
    aspect = rng.uniform(0.85, 1.18) if form not in ("circle", "ring") else 1.0
  elif obj.kind == "digit":
    hires = _digit_hires(assets, obj.form, split, rng)
    aspect = rng.uniform(0.9, 1.1)
  elif obj.kind == "glyph":
    hires = _glyph_hires(assets, obj.form, rng)
    aspect = rng.uniform(0.9, 1.1)
  else:
    raise ValueError(obj.kind)
  return _finalize(hires, long_side, aspect)


# ------------------------------------------------------------------------------------------
# Scene rendering.
# ------------------------------------------------------------------------------------------
def _lum(x: np.ndarray) -> np.ndarray:
  return x @ np.array([0.299, 0.587, 0.114], np.float32)


def _photo_crop(photo: np.ndarray, h: int, w: int, rng, lo: float = 0.35) -> np.ndarray:
  """A random crop with aspect w/h of a uint8 photo, resized to float32 [h, w, 3] in [0, 1]."""
  ph, pw = photo.shape[:2]
  if pw / ph > w / h:
    mh, mw = ph, ph * w / h
  else:
    mh, mw = pw * h / w, pw
  s = rng.uniform(lo, 1.0)
  ch, cw = max(2, int(mh * s)), max(2, int(mw * s))
  y = int(rng.integers(0, ph - ch + 1))
  x = int(rng.integers(0, pw - cw + 1))
  im = Image.fromarray(photo[y : y + ch, x : x + cw]).resize((w, h), Image.BILINEAR)
  out = np.asarray(im, np.float32) / 255.0
  if rng.random() < 0.5:
    out = out[:, ::-1]
  return out


def _background(assets: _Assets, dom: _Domain, h: int, w: int, rng) -> np.ndarray:
  names = dom.bg_photos or _BG_DEFAULT
  photo = assets.photos[names[rng.integers(len(names))]]
  crop = _photo_crop(photo, h, w, rng)
  lum = _lum(crop)[..., None]
  if dom.background == "muted":
    desat = rng.uniform(0.45, 0.8)
    x = crop * (1 - desat) + lum * desat
    contrast = rng.uniform(0.45, 0.75)
    return 0.5 + (x - x.mean()) * contrast
  if dom.background == "light":
    tint = np.array([1.0, rng.uniform(0.94, 1.0), rng.uniform(0.82, 0.97)], np.float32)
    return (0.72 + 0.25 * lum) * tint
  if dom.background == "document":
    return 0.35 + 0.6 * lum * np.ones(3, np.float32)
  if dom.background == "thermal":
    return np.repeat(0.05 + 0.4 * lum, 3, axis=-1)
  raise ValueError(dom.background)


def _fill(assets: _Assets, obj: _Obj, mask: np.ndarray, rng) -> np.ndarray:
  """float32 [h, w, 3] pixels of the object (only those under the mask are used)."""
  h, w = mask.shape
  yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
  if obj.fill in ("color", "any_color"):
    if obj.fill == "color":
      name = obj.color
    else:
      names = [n for n in COLORS if n not in ("white", "black")]
      name = names[rng.integers(len(names))]
    base = np.asarray(COLORS[name], np.float32) / 255.0
    c = np.clip(base * rng.uniform(0.88, 1.06) + rng.normal(0, 0.02, 3), 0, 1)
    a = rng.uniform(0, 2 * np.pi)
    grad = (xx / max(w - 1, 1) - 0.5) * np.cos(a) + (yy / max(h - 1, 1) - 0.5) * np.sin(a)
    out = np.clip(c * (1 + 0.15 * grad)[..., None], 0, 1)
    if obj.pattern != "plain":
      ink = (
        np.array([0.97, 0.97, 0.95], np.float32)
        if _lum(base) < 0.6
        else np.array([0.1, 0.1, 0.12], np.float32)
      )
      out[_pattern_mask(obj.pattern, h, w, rng)] = ink
    return out
  if obj.fill in ("hot", "warm"):
    r = np.hypot((xx - (w - 1) / 2) / max(w / 2, 1), (yy - (h - 1) / 2) / max(h / 2, 1))
    if obj.fill == "hot":
      v = rng.uniform(0.90, 0.95) + 0.05 * np.clip(1 - r, 0, 1)
    else:
      v = rng.uniform(0.55, 0.62) + 0.06 * np.clip(1 - r, 0, 1)
    return np.repeat(v[..., None], 3, axis=-1).astype(np.float32)
  if obj.fill == "texture":
    photo = assets.photos[obj.color]
    tex = _photo_crop(photo, h, w, rng, lo=0.25 if obj.color != "checkerboard" else 0.3)
    if obj.color == "brick":
      tex = np.clip(_lum(tex)[..., None] * np.array([1.25, 0.62, 0.42], np.float32) + 0.08, 0, 1)
    edge = mask & ~_erode(mask)
    tex = tex.copy()
    tex[edge] = 0.08
    return tex
  if obj.fill == "ink":  # the class's ink colour, darkened/brightened a little
    c = np.asarray(_INKS[obj.color], np.float32) / 255.0
    c = np.clip(c * rng.uniform(0.8, 1.1) + rng.normal(0, 0.02, 3), 0, 1)
    return np.broadcast_to(c, (h, w, 3)).astype(np.float32)
  raise ValueError(obj.fill)


def _pattern_mask(pattern: str, h: int, w: int, rng) -> np.ndarray:
  """bool [h, w]: where the fill pattern's ink goes (scene pixels; periods of 6-8 px, i.e.
  ~3-5 px after resizing a 96-128 px scene to 64)."""
  yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
  a = rng.uniform(0, np.pi)
  u = xx * np.cos(a) + yy * np.sin(a) + rng.uniform(0, 100)
  v = -xx * np.sin(a) + yy * np.cos(a) + rng.uniform(0, 100)
  if pattern == "striped":
    period = rng.uniform(6.0, 8.0)
    return (u % period) < period * 0.45
  if pattern == "dotted":
    period = rng.uniform(6.5, 8.0)
    du = (u % period) - period / 2
    dv = (v % period) - period / 2
    return du * du + dv * dv <= (period * 0.3) ** 2
  if pattern == "checkered":
    cell = rng.uniform(3.5, 4.5)
    return ((np.floor(u / cell) + np.floor(v / cell)) % 2) == 0
  raise ValueError(f"unknown pattern {pattern!r}")


def _erode(m: np.ndarray) -> np.ndarray:
  p = np.pad(m, 1)
  return p[1:-1, 1:-1] & p[:-2, 1:-1] & p[2:, 1:-1] & p[1:-1, :-2] & p[1:-1, 2:]


def _dilate(m: np.ndarray, r: int) -> np.ndarray:
  out = np.pad(m, r)
  for _ in range(r):
    p = out
    out = p.copy()
    out[1:] |= p[:-1]
    out[:-1] |= p[1:]
    out[:, 1:] |= p[:, :-1]
    out[:, :-1] |= p[:, 1:]
  return out


def _iou(a, b) -> float:
  ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
  iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
  inter = ix * iy
  union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
  return inter / union if union > 0 else 0.0


_MAX_IOU = 0.3
_GAP = 2  # minimum pixel gap between object masks


def _render_scene(
  assets: _Assets,
  dom: _Domain,
  split: str,
  rng: np.random.Generator,
  distractor_objs: Sequence[_Obj],
):
  """Returns (uint8 [H, W, 3], list of (class index, x0, y0, mask bool [h, w]))."""
  long_side = int(rng.integers(96, 129))
  ar = float(np.exp(rng.uniform(np.log(0.7), np.log(1.43))))
  if ar >= 1:
    W, H = long_side, max(48, int(round(long_side / ar)))
  else:
    H, W = long_side, max(48, int(round(long_side * ar)))
  img = _background(assets, dom, H, W, rng).astype(np.float32)
  occupied = np.zeros((H, W), bool)
  placed: list[tuple[int, int, int, np.ndarray]] = []
  boxes: list[tuple[int, int, int, int]] = []

  def place(obj: _Obj, frac: tuple[float, float]) -> tuple[int, int, np.ndarray] | None:
    mask = None
    for attempt in range(40):
      if attempt % 5 == 0:  # a new size/pose every 5 position attempts
        side = int(round(rng.uniform(*frac) * long_side))
        mask = _object_mask(assets, obj, side, split, rng)
      h, w = mask.shape
      if h > H - 2 or w > W - 2:
        continue
      y = int(rng.integers(1, H - h))
      x = int(rng.integers(1, W - w))
      box = (x, y, x + w, y + h)
      if any(_iou(box, b) >= _MAX_IOU for b in boxes):
        continue
      grown = _dilate(mask, _GAP)
      y0, x0 = y - _GAP, x - _GAP
      sy0, sx0 = max(0, y0), max(0, x0)
      sy1, sx1 = min(H, y0 + grown.shape[0]), min(W, x0 + grown.shape[1])
      if (occupied[sy0:sy1, sx0:sx1] & grown[sy0 - y0 : sy1 - y0, sx0 - x0 : sx1 - x0]).any():
        continue
      occupied[y : y + h, x : x + w] |= mask
      boxes.append(box)
      region = img[y : y + h, x : x + w]
      region[mask] = _fill(assets, obj, mask, rng)[mask]
      return x, y, mask
    return None

  n = int(rng.integers(dom.n_objects[0], dom.n_objects[1] + 1))
  for _ in range(n):
    ci = int(rng.integers(len(dom.classes)))
    res = place(dom.classes[ci][1], dom.size_frac)
    if res is not None:
      placed.append((ci,) + res)
  if dom.distractors[1] > 0:
    nd = int(rng.integers(dom.distractors[0], dom.distractors[1] + 1))
    for _ in range(nd):
      place(distractor_objs[rng.integers(len(distractor_objs))], dom.distractor_size)

  if dom.post == "invert":
    img = 1.0 - img
  elif dom.post == "thermal":
    idx = np.clip(img[..., 0] * 255 + 0.5, 0, 255).astype(np.int32)
    img = assets.inferno[idx]
  img = img + rng.normal(0, 0.012, img.shape).astype(np.float32)
  out = (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)
  return out, placed


# ------------------------------------------------------------------------------------------
# Writing a split.
# ------------------------------------------------------------------------------------------
def _split_code(dataset: str, split: str) -> int:
  return zlib.crc32(f"{dataset}/{split}".encode())


def _write_split(
  root: str,
  dataset: str,
  split: str,
  dom: _Domain,
  num_images: int,
  seed: int,
  assets: _Assets,
  pbar,
) -> dict[str, int]:
  from pycocotools import mask as mask_utils

  img_dir = os.path.join(root, dataset, "images")
  os.makedirs(img_dir, exist_ok=True)
  distractors = [_Obj("shape", NUISANCE_SHAPES, "color", c, p) for c, p in _PRETRAIN_PAIRS]
  images, anns = [], []
  code = _split_code(dataset, split)
  for i in range(num_images):
    rng = np.random.default_rng(np.random.SeedSequence([seed, code, i]))
    img, objs = _render_scene(assets, dom, split, rng, distractors)
    H, W = img.shape[:2]
    fname = f"{split}_{i:06d}.png"
    Image.fromarray(img).save(os.path.join(img_dir, fname), format="PNG", compress_level=3)
    image_id = i + 1
    images.append(dict(id=image_id, file_name=fname, height=H, width=W))
    for ci, x, y, m in objs:
      h, w = m.shape
      full = np.zeros((H, W), np.uint8, order="F")
      full[y : y + h, x : x + w] = m
      rle = mask_utils.encode(full)
      anns.append(
        dict(
          id=len(anns) + 1,
          image_id=image_id,
          category_id=ci + 1,
          bbox=[x, y, w, h],
          area=int(m.sum()),
          iscrowd=0,
          segmentation=dict(size=[H, W], counts=rle["counts"].decode("ascii")),
        )
      )
    if pbar is not None:
      pbar.update(1)
  cats = [dict(id=i + 1, name=n, supercategory=dataset) for i, (n, _) in enumerate(dom.classes)]
  info = dict(
    description=f"owl_cl built-in benchmark: {dataset}/{split}",
    format_version=FORMAT_VERSION,
    seed=seed,
    dataset=dataset,
    split=split,
    domain=dom.description,
  )
  with open(os.path.join(root, dataset, f"{split}.json"), "w") as f:
    json.dump(
      dict(info=info, images=images, annotations=anns, categories=cats), f, separators=(",", ":")
    )
  return dict(images=len(images), instances=len(anns))


# ------------------------------------------------------------------------------------------
# Public API.
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BuiltinConfig:
  """All generation parameters (they, with FORMAT_VERSION, key the cache folder)."""

  seed: int = 0
  num_pretrain_train: int = 1200
  num_pretrain_val: int = 200
  num_held_out_val: int = 100
  num_downstream_train: int = 200
  num_downstream_test: int = 60
  downstream: tuple[str, ...] = DOWNSTREAM_NAMES

  def key(self) -> str:
    """'builtin_v<FORMAT_VERSION>_<12 hex digits of sha256 of the parameters>'."""
    payload = json.dumps(
      dict(dataclasses.asdict(self), format_version=FORMAT_VERSION), sort_keys=True
    )
    return f"builtin_v{FORMAT_VERSION}_{hashlib.sha256(payload.encode()).hexdigest()[:12]}"

  def splits(self) -> list[tuple[str, str, _Domain, int]]:
    """(dataset, split, domain, number of images) in generation order."""
    unknown = [d for d in self.downstream if d not in _DOMAINS]
    if unknown:
      raise ValueError(f"unknown downstream datasets {unknown}; known: {DOWNSTREAM_NAMES}")
    pre = _colour_pattern_domain(
      "pretrain", _PRETRAIN_PAIRS, "colour x fill-pattern pairs on muted photograph backgrounds"
    )
    held = _colour_pattern_domain(
      "held_out", HELD_OUT_PAIRS, "held-out colour-pattern pairs, never in pre-training"
    )
    out = [
      ("pretrain", "train", pre, self.num_pretrain_train),
      ("pretrain", "val", pre, self.num_pretrain_val),
      ("held_out", "val", held, self.num_held_out_val),
    ]
    for d in self.downstream:
      out.append((d, "train", _DOMAINS[d], self.num_downstream_train))
      out.append((d, "test", _DOMAINS[d], self.num_downstream_test))
    return out


@dataclasses.dataclass(frozen=True)
class SplitFiles:
  """One split on disk: its COCO json, the folder its file names are relative to, and its
  name 'dataset/split'."""

  annotation_file: str
  image_dir: str
  name: str = ""

  def source(self, name: str | None = None, **kwargs) -> CocoSource:
    """`CocoSource(annotation_file, image_dir, name or self.name, **kwargs)`."""
    return CocoSource(self.annotation_file, self.image_dir, name or self.name or None, **kwargs)


@dataclasses.dataclass(frozen=True)
class DownstreamDataset:
  """One downstream dataset: name, train/test `SplitFiles` and class names."""

  name: str
  train: SplitFiles
  test: SplitFiles
  classes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BuiltinBenchmark:
  """A generated built-in benchmark (see the module docstring).

  Attributes:
    root: the cache folder `<cache_dir>/builtin_v<version>_<hash>`.
    config: the `BuiltinConfig` it was generated from.
    splits: (dataset, split) -> SplitFiles; datasets 'pretrain' (train, val), 'held_out' (val)
      and each downstream name (train, test).
    downstream_names: downstream datasets in canonical order (the CL order is a seeded shuffle
      chosen by the experiment, docs/reference.md §10).
    classes: dataset -> class names in contiguous index order.
    counts: 'dataset/split' -> dict(images, instances).
    generation_seconds: wall time of the generation that produced the cache.
  """

  root: str
  config: BuiltinConfig
  splits: dict[tuple[str, str], SplitFiles]
  downstream_names: tuple[str, ...]
  classes: dict[str, tuple[str, ...]]
  counts: dict[str, dict[str, int]]
  generation_seconds: float

  @property
  def fingerprint(self) -> str:
    """The cache key 'builtin_v<version>_<hash>' (identifies the generated data)."""
    return os.path.basename(self.root)

  @property
  def pretrain_train(self) -> SplitFiles:
    return self.splits[("pretrain", "train")]

  @property
  def pretrain_val(self) -> SplitFiles:
    return self.splits[("pretrain", "val")]

  @property
  def held_out_val(self) -> SplitFiles:
    return self.splits[("held_out", "val")]

  @property
  def downstream(self) -> tuple[DownstreamDataset, ...]:
    """The downstream datasets in canonical order."""
    return tuple(
      DownstreamDataset(d, self.splits[(d, "train")], self.splits[(d, "test")], self.classes[d])
      for d in self.downstream_names
    )

  @property
  def pretrain_classes(self) -> tuple[str, ...]:
    return self.classes["pretrain"]

  @property
  def held_out_classes(self) -> tuple[str, ...]:
    return self.classes["held_out"]

  def split(self, dataset: str, split: str) -> SplitFiles:
    """SplitFiles of (dataset, split); KeyError naming the available ones otherwise."""
    try:
      return self.splits[(dataset, split)]
    except KeyError:
      raise KeyError(
        f"no split {dataset}/{split}; available: {sorted('/'.join(k) for k in self.splits)}"
      ) from None

  def source(self, dataset: str, split: str, **kwargs) -> CocoSource:
    """`CocoSource` of (dataset, split), named 'dataset/split'; decoded images are cached in
    memory by default (`cache_images=True`; the benchmark is small)."""
    kwargs.setdefault("cache_images", True)
    return self.split(dataset, split).source(f"{dataset}/{split}", **kwargs)

  def describe(self) -> str:
    """A markdown summary: per dataset its domain shift, classes and image/instance counts."""
    descr = {
      "pretrain": "colour x fill-pattern pairs on muted photograph backgrounds, "
      "shapes vary (O365 stand-in)",
      "held_out": "held-out colour-pattern pairs, never in pre-training (LVIS-rare stand-in)",
    }
    descr.update({d.name: d.description for d in _DOWNSTREAM})
    lines = [
      f"Built-in benchmark `{os.path.basename(self.root)}` (seed {self.config.seed}, "
      f"format v{FORMAT_VERSION})",
      "",
      "| dataset | split(s): images / instances | classes | domain |",
      "|---|---|---|---|",
    ]
    for ds in ["pretrain", "held_out"] + list(self.downstream_names):
      parts = [
        f"{sp} {self.counts[f'{ds}/{sp}']['images']} / {self.counts[f'{ds}/{sp}']['instances']}"
        for sp in ("train", "val", "test")
        if f"{ds}/{sp}" in self.counts
      ]
      lines.append(
        f"| {ds} | {'; '.join(parts)} | {len(self.classes[ds])}: "
        f"{', '.join(self.classes[ds])} | {descr[ds]} |"
      )
    return "\n".join(lines)


def _benchmark_from_meta(root: str, meta: dict[str, Any]) -> BuiltinBenchmark:
  cfg = meta["config"]
  cfg = BuiltinConfig(**dict(cfg, downstream=tuple(cfg["downstream"])))
  splits = {}
  for ds, sp in ((k.split("/")[0], k.split("/")[1]) for k in meta["counts"]):
    splits[(ds, sp)] = SplitFiles(
      os.path.join(root, ds, f"{sp}.json"), os.path.join(root, ds, "images"), f"{ds}/{sp}"
    )
  return BuiltinBenchmark(
    root=root,
    config=cfg,
    splits=splits,
    downstream_names=tuple(cfg.downstream),
    classes={k: tuple(v) for k, v in meta["classes"].items()},
    counts=meta["counts"],
    generation_seconds=float(meta["generation_seconds"]),
  )


_META = "benchmark.json"


def _complete(root: str) -> dict[str, Any] | None:
  """The metadata if `root` holds a complete generation (metadata, every json, every PNG)."""
  try:
    with open(os.path.join(root, _META)) as f:
      meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
      return None
    per_dataset: dict[str, int] = {}
    for key, c in meta["counts"].items():
      ds, sp = key.split("/")
      if not os.path.isfile(os.path.join(root, ds, f"{sp}.json")):
        return None
      per_dataset[ds] = per_dataset.get(ds, 0) + c["images"]
    for ds, n in per_dataset.items():
      if len([f for f in os.listdir(os.path.join(root, ds, "images")) if f.endswith(".png")]) != n:
        return None
    return meta
  except (OSError, ValueError, KeyError):
    return None


def generate_benchmark(
  root: str, config: BuiltinConfig, *, progress: bool = True
) -> dict[str, Any]:
  """Generate every split of `config` into the (new, empty) folder `root`, non-atomically.

  Returns the metadata dict written last to `root/benchmark.json` (its presence marks the
  generation complete). Prefer `ensure_benchmark`, which adds caching and atomicity.
  """
  from tqdm.auto import tqdm

  t0 = time.perf_counter()
  assets = _Assets()
  todo = config.splits()
  counts, classes = {}, {}
  with tqdm(
    total=sum(n for *_, n in todo), desc="built-in benchmark", unit="img", disable=not progress
  ) as pbar:
    for ds, sp, dom, n in todo:
      counts[f"{ds}/{sp}"] = _write_split(root, ds, sp, dom, n, config.seed, assets, pbar)
      classes[ds] = [c for c, _ in dom.classes]
  import PIL
  import skimage
  import sklearn

  meta = dict(
    format_version=FORMAT_VERSION,
    key=config.key(),
    config=dataclasses.asdict(config),
    counts=counts,
    classes=classes,
    generation_seconds=round(time.perf_counter() - t0, 3),
    versions=dict(
      numpy=np.__version__,
      pillow=PIL.__version__,
      skimage=skimage.__version__,
      sklearn=sklearn.__version__,
    ),
  )
  with open(os.path.join(root, _META), "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
  return meta


def ensure_benchmark(
  cache_dir: str,
  seed: int = 0,
  *,
  num_pretrain_train: int = 1200,
  num_pretrain_val: int = 200,
  num_held_out_val: int = 100,
  num_downstream_train: int = 200,
  num_downstream_test: int = 60,
  downstream: Sequence[str] = DOWNSTREAM_NAMES,
  progress: bool = True,
) -> BuiltinBenchmark:
  """Return the built-in benchmark, generating it into `cache_dir` if needed.

  The cache folder is `cache_dir/builtin_v<FORMAT_VERSION>_<hash of all parameters>/`. It is
  trusted only if complete (metadata present, every json and PNG there) and every file matches
  the manifest written with it (`integrity.verify_directory`). Otherwise the benchmark is
  generated into a temporary sibling folder, its manifest written last, and renamed into place
  atomically, so an interrupted or failed generation never leaves a cache that is later
  trusted. A damaged folder is set aside (`.corrupt-<time>`, a warning naming the file); an
  incomplete one, or one generated before manifests were written, is replaced (generation is
  deterministic and takes seconds). Concurrent runs take the folder's lock
  (`utils.cache_entry_lock`): one generates, the others wait and reuse it. Deterministic: the
  same parameters give byte-identical json and
  identical PNG pixels (every image's randomness derives from (seed, dataset/split, index)).

  Args:
    cache_dir: parent folder (created if missing).
    seed: generation seed (int >= 0).
    num_pretrain_train / num_pretrain_val / num_held_out_val / num_downstream_train /
      num_downstream_test: images per split.
    downstream: names of the downstream datasets to generate, a subset of `DOWNSTREAM_NAMES`.
    progress: show a tqdm progress bar.

  Returns:
    `BuiltinBenchmark`.

  Raises:
    ValueError: unknown downstream name. OSError: file system errors.

  Default size (3,320 images): ~21 s of CPU time on one core (measured; ~50 s wall on a
  shared, busy 2-core machine), of which ~3 s loading the bundled photographs.
  """
  config = BuiltinConfig(
    seed=seed,
    num_pretrain_train=num_pretrain_train,
    num_pretrain_val=num_pretrain_val,
    num_held_out_val=num_held_out_val,
    num_downstream_train=num_downstream_train,
    num_downstream_test=num_downstream_test,
    downstream=tuple(downstream),
  )
  config.splits()  # validates names
  os.makedirs(cache_dir, exist_ok=True)
  root = os.path.join(os.fspath(cache_dir), config.key())
  with utils.cache_entry_lock(root, "built-in benchmark"):
    if integrity.has_manifest(root):
      try:
        integrity.verify_directory(root)
        meta = _complete(root)
        if meta is not None:
          return _benchmark_from_meta(root, meta)
      except integrity.IntegrityError as e:
        integrity.set_aside(root, str(e))
        logging.warning("the built-in benchmark was damaged (%s); generating it again", e)
    elif os.path.exists(root):
      logging.info(
        "the built-in benchmark at %s is incomplete or predates checksums: generating it again",
        root,
      )
    # An incomplete leftover (a killed generation that predates atomic writes, or one of an
    # earlier version without a manifest) is replaced.
    with utils.atomic_directory(root, if_exists="replace") as tmp:
      generate_benchmark(tmp, config, progress=progress)
      integrity.write_manifest(tmp)  # the commit mark, last
  meta = _complete(root)
  if meta is None:
    raise OSError(f"built-in benchmark at {root} is incomplete after generation")
  return _benchmark_from_meta(root, meta)


def render_preview(
  benchmark: BuiltinBenchmark,
  path: str,
  *,
  per_dataset: int = 6,
  cell: int = 128,
  draw_boxes: bool = True,
) -> str:
  """Save a PNG grid: one row per dataset (first split), `per_dataset` scenes each, boxes and
  class names drawn. Returns `path`."""
  datasets = ["pretrain", "held_out"] + list(benchmark.downstream_names)
  label_h = 12
  grid = Image.new(
    "RGB", (per_dataset * (cell + 4) + 70, len(datasets) * (cell + label_h + 4)), (255, 255, 255)
  )
  draw = ImageDraw.Draw(grid)
  for r, ds in enumerate(datasets):
    sp = "train" if (ds, "train") in benchmark.splits else "val"
    src = benchmark.source(ds, sp)
    y0 = r * (cell + label_h + 4)
    draw.text((2, y0 + cell // 2), ds, fill=(0, 0, 0))
    for c in range(min(per_dataset, len(src))):
      ex = src.load(c)
      im = Image.fromarray(ex["image"])
      s = cell / max(im.size)
      im = im.resize((round(im.size[0] * s), round(im.size[1] * s)), Image.NEAREST)
      d = ImageDraw.Draw(im)
      names = []
      if draw_boxes:
        for b, l in zip(ex["boxes"] * s, ex["labels"]):
          d.rectangle(
            [float(b[0]), float(b[1]), float(b[2]) - 1, float(b[3]) - 1], outline=(0, 255, 0)
          )
          names.append(src.class_names[l])
      x0 = 70 + c * (cell + 4)
      grid.paste(im, (x0, y0))
      draw.text((x0, y0 + cell), ", ".join(sorted(set(names)))[:28], fill=(0, 0, 0))
  grid.save(path)
  return path

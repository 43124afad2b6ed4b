"""The built-in benchmark's procedural renderer: bundled assets, object masks, fills, scenes.

Everything is drawn from material that ships inside installed packages (scikit-image and
matplotlib photographs, scikit-learn digits, matplotlib's DejaVu fonts); see the
`owl_cl.data.builtin` package docstring. A scene's randomness is the `rng` it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
import os

import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

from owl_cl.data.builtin.vocabulary import COLORS
from owl_cl.data.builtin.vocabulary import DEFAULT_BACKGROUNDS
from owl_cl.data.builtin.vocabulary import INKS
from owl_cl.data.builtin.vocabulary import Domain
from owl_cl.data.builtin.vocabulary import ObjectStyle


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


class Assets:
  """The bundled material a scene is drawn from: photographs (uint8 [h, w, 3], long side <=
  256 px), scikit-learn's digits (float32 [8, 8] in [0, 1]), three DejaVu bold fonts at 96 px
  and the inferno colour map (float32 [256, 3])."""

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


def _digit_hires(assets: Assets, digit: int, split: str, rng) -> np.ndarray:
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


def _glyph_hires(assets: Assets, letter: str, rng) -> np.ndarray:
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


def _object_mask(assets: Assets, obj: ObjectStyle, long_side: int, split: str, rng) -> np.ndarray:
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


def _background(assets: Assets, dom: Domain, h: int, w: int, rng) -> np.ndarray:
  names = dom.bg_photos or DEFAULT_BACKGROUNDS
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


def _fill(assets: Assets, obj: ObjectStyle, mask: np.ndarray, rng) -> np.ndarray:
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
    c = np.asarray(INKS[obj.color], np.float32) / 255.0
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


def render_scene(
  assets: Assets,
  dom: Domain,
  split: str,
  rng: np.random.Generator,
  distractor_objs: Sequence[ObjectStyle],
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

  def place(obj: ObjectStyle, frac: tuple[float, float]) -> tuple[int, int, np.ndarray] | None:
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
    if dom.class_weights:  # version 2 (version 1 keeps its draws: the same bytes)
      ci = int(
        rng.choice(len(dom.classes), p=np.asarray(dom.class_weights) / sum(dom.class_weights))
      )
    else:
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

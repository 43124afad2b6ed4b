"""The built-in benchmark's classes and each dataset's rendering recipe (`Domain`).

Design and learnability constraints: `owl_cl.data.builtin` (package docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from typing import Any

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
PRETRAIN_PAIRS = tuple(
  (c, p) for c in PRETRAIN_COLORS for p in PRETRAIN_PATTERNS if (c, p) not in HELD_OUT_PAIRS
)


def pretrain_class_names() -> list[str]:
  """The 20 pre-training classes, 'colour pattern' (e.g. 'red plain'), colour-major order."""
  return [f"{c} {p}" for c, p in PRETRAIN_PAIRS]


def held_out_class_names() -> list[str]:
  """The 4 held-out (never pre-trained) classes, 'colour pattern'."""
  return [f"{c} {p}" for c, p in HELD_OUT_PAIRS]


@dataclasses.dataclass(frozen=True)
class ObjectStyle:
  """How to draw one object class."""

  kind: str  # 'shape' | 'digit' | 'glyph'
  form: Any  # shape name | tuple of shape names (one drawn) | digit | letter
  fill: str  # 'color' | 'any_color' | 'texture' | 'hot' | 'warm' | 'ink'
  color: str = ""  # colour name for fill='color'; texture name for fill='texture'
  pattern: str = "plain"  # plain | striped | dotted | checkered


@dataclasses.dataclass(frozen=True)
class Domain:
  """A dataset's rendering recipe."""

  name: str
  classes: tuple[tuple[str, ObjectStyle], ...]
  size_frac: tuple[float, float] = (0.20, 0.45)  # object long side / scene long side
  n_objects: tuple[int, int] = (1, 4)
  background: str = "muted"  # muted | light | document | thermal
  bg_photos: tuple[str, ...] = ()  # () = the default photo set
  post: str = ""  # '' | 'invert' | 'thermal'
  distractors: tuple[int, int] = (0, 0)
  distractor_size: tuple[float, float] = (0.12, 0.30)
  description: str = ""


def colour_pattern_domain(name: str, pairs: Sequence[tuple[str, str]], description: str) -> Domain:
  """A `Domain` of colour x fill-pattern classes ('red plain', ...) of nuisance shapes."""
  return Domain(
    name,
    tuple((f"{c} {p}", ObjectStyle("shape", NUISANCE_SHAPES, "color", c, p)) for c, p in pairs),
    description=description,
  )


# Ink colours of digits and glyphs: each class is written in its own ink (a cue visible inside
# one patch; outline-only classes were learnt too slowly in ~100 fine-tuning steps).
INKS = {
  "blue ink": (30, 60, 190),
  "red ink": (185, 30, 30),
  "green ink": (25, 130, 45),
  "orange ink": (225, 115, 15),
  "purple ink": (125, 35, 165),
}
DEFAULT_BACKGROUNDS = (
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

DOWNSTREAM: tuple[Domain, ...] = (
  Domain(
    "thermal",
    (
      ("hot spot", ObjectStyle("shape", ("circle", "hexagon"), "hot")),
      ("warm body", ObjectStyle("shape", ("square", "triangle", "circle"), "warm")),
    ),
    size_frac=(0.22, 0.45),
    background="thermal",
    post="thermal",
    description="thermal-like false colour (inferno colour map of intensity): hot "
    "(white-yellow) and warm (red-orange) objects on a cool scene",
  ),
  Domain(
    "negative",
    tuple(
      (f"{p} sticker", ObjectStyle("shape", NUISANCE_SHAPES, "color", c, p))
      for p, c in (("striped", "orange"), ("dotted", "cyan"), ("checkered", "pink"))
    ),
    post="invert",
    description="colour negative of pre-training-like scenes: striped "
    "orange / dotted cyan / checkered pink stickers, "
    "inverted",
  ),
  Domain(
    "tiny",
    (
      ("orange bead", ObjectStyle("shape", "circle", "color", "orange")),
      ("cyan tile", ObjectStyle("shape", "square", "color", "cyan")),
    ),
    size_frac=(0.14, 0.20),
    description="scale shift: tiny objects (9-13 px after resizing to 64)",
  ),
  Domain(
    "clutter",
    (
      ("pink star", ObjectStyle("shape", "star", "color", "pink")),
      ("white square", ObjectStyle("shape", "square", "color", "white")),
    ),
    size_frac=(0.20, 0.40),
    n_objects=(1, 3),
    distractors=(3, 6),
    description="clutter: 3-6 unannotated distractors of pre-training classes",
  ),
  Domain(
    "textured",
    tuple((n, ObjectStyle("shape", "blob", "texture", t)) for n, t in _TEXTURES.items()),
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
  Domain(
    "digits",
    (
      ("digit zero", ObjectStyle("digit", 0, "ink", "blue ink")),
      ("digit one", ObjectStyle("digit", 1, "ink", "red ink")),
    ),
    size_frac=(0.32, 0.50),
    n_objects=(1, 3),
    background="light",
    description="large handwritten digits 0 (blue ink) and 1 (red ink) "
    "(scikit-learn digits; train/test drawn from disjoint scans) on light "
    "paper",
  ),
  Domain(
    "glyphs",
    (
      ("letter w", ObjectStyle("glyph", "W", "ink", "green ink")),
      ("letter o", ObjectStyle("glyph", "O", "ink", "orange ink")),
      ("letter i", ObjectStyle("glyph", "I", "ink", "purple ink")),
    ),
    size_frac=(0.30, 0.50),
    n_objects=(1, 3),
    background="document",
    bg_photos=("page", "text"),
    description="letters W (green), O (orange), I (purple) in bold DejaVu fonts on "
    "document-photograph backgrounds",
  ),
)
DOWNSTREAM_NAMES = tuple(d.name for d in DOWNSTREAM)
DOMAINS = {d.name: d for d in DOWNSTREAM}


def downstream_class_names() -> dict[str, list[str]]:
  """Downstream dataset name -> its class names (in contiguous index order)."""
  return {d.name: [n for n, _ in d.classes] for d in DOWNSTREAM}

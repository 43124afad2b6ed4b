"""The built-in benchmark's classes and each dataset's rendering recipe (`Domain`).

Design and learnability constraints: `owl_cl.data.builtin` (package docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
from typing import Any

import numpy as np

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
  # Version 2 only (empty: version 1's behaviour, the same random draws): each object's class
  # drawn with these probabilities instead of uniformly, and the unannotated distractors drawn
  # from these (colour, pattern) pairs instead of every pre-training class.
  class_weights: tuple[float, ...] = ()
  distractor_pairs: tuple[tuple[str, str], ...] = ()


def colour_pattern_domain(
  name: str,
  pairs: Sequence[tuple[str, str]],
  description: str,
  class_weights: Sequence[float] = (),
) -> Domain:
  """A `Domain` of colour x fill-pattern classes ('red plain', ...) of nuisance shapes;
  `class_weights` (version 2) the probability of each pair per object, () uniform."""
  return Domain(
    name,
    tuple((f"{c} {p}", ObjectStyle("shape", NUISANCE_SHAPES, "color", c, p)) for c, p in pairs),
    description=description,
    class_weights=tuple(float(w) for w in class_weights),
  )


# Ink colours of digits and glyphs: each class is written in its own ink (a cue visible inside
# one patch; outline-only classes were learnt too slowly in ~100 fine-tuning steps).
INKS = {
  "blue ink": (30, 60, 190),
  "red ink": (185, 30, 30),
  "green ink": (25, 130, 45),
  "orange ink": (225, 115, 15),
  "purple ink": (125, 35, 165),
  "black ink": (20, 20, 24),  # version 2's digits (colours of no pre-training class)
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


# ------------------------------------------------------------------------------------------
# Version 2: where the retrieval algorithm matters (docs/experiments.md, "Built-in benchmark
# version 2"). The same 20 pre-training and 4 held-out classes, the same 7 dataset names and
# domain shifts; long-tailed pre-training classes, a tail-classes evaluation set, downstream
# classes that interfere with named pre-training classes, a class in two downstream datasets
# and a negative control. Fixed before any run; nothing here is tuned on results.
# ------------------------------------------------------------------------------------------
BENCHMARK_VERSIONS = (1, 2)
# The pre-training classes' frequency ranks: a permutation of PRETRAIN_PAIRS drawn once from
# this seed (PCG64's permutation is fixed across NumPy versions), so which classes are rare
# is not chosen by hand.
FREQUENCY_SEED = 20240602
FREQUENCY_ORDER: tuple[tuple[str, str], ...] = tuple(
  PRETRAIN_PAIRS[i] for i in np.random.default_rng(FREQUENCY_SEED).permutation(len(PRETRAIN_PAIRS))
)
NUM_TAIL_CLASSES = 5  # the tail-classes evaluation set: the 5 rarest classes
TAIL_PAIRS = FREQUENCY_ORDER[-NUM_TAIL_CLASSES:]


def class_frequencies() -> dict[str, float]:
  """Version 2's pre-training class distribution: 'colour pattern' -> probability of an object
  being of that class, proportional to 1 / rank (Zipf, exponent 1) over `FREQUENCY_ORDER`;
  sums to 1. Rank 1: 27.8 %, rank 20: 1.4 %, the 5 rarest together 7.8 %."""
  weights = {f"{c} {p}": 1.0 / (r + 1) for r, (c, p) in enumerate(FREQUENCY_ORDER)}
  total = sum(weights.values())
  return {name: w / total for name, w in weights.items()}


def tail_class_names() -> list[str]:
  """Version 2's tail classes: the `NUM_TAIL_CLASSES` rarest pre-training classes, rarest
  last."""
  return [f"{c} {p}" for c, p in TAIL_PAIRS]


def nearest_same_pattern(rgb: Sequence[int], pattern: str, k: int = 2) -> tuple[str, ...]:
  """The `k` pre-training classes with fill pattern `pattern` whose colours are nearest to
  `rgb` (Euclidean distance in RGB 0-255; ties by class order): the classes a downstream
  object of that colour and pattern interferes with. Returns 'colour pattern' names, nearest
  first. Raises ValueError for a pattern no pre-training class has."""
  pairs = [(c, p) for c, p in PRETRAIN_PAIRS if p == pattern]
  if not pairs:
    raise ValueError(f"no pre-training class has pattern {pattern!r}")
  rgb = np.asarray(rgb, np.float64)
  dist = [float(np.sum((np.asarray(COLORS[c], np.float64) - rgb) ** 2)) for c, _ in pairs]
  order = np.argsort(dist, kind="stable")[:k]
  return tuple(f"{pairs[i][0]} {pairs[i][1]}" for i in order)


@dataclasses.dataclass(frozen=True)
class Interference:
  """A downstream dataset's interference with named pre-training classes (version 2).

  `downstream_class` shares `pattern` (a fill pattern, or the checkerboard texture) and a word
  of its name with the pre-training classes `pretrain_classes` (those of that pattern nearest
  in colour to `rgb`, `nearest_same_pattern`; `rgb` is the colour as it shows in the scene,
  after the domain's inversion or false colour, `rendered_rgb`); for `clutter`,
  `downstream_class` is None and `pretrain_classes` are its unannotated distractors (trained
  as background)."""

  dataset: str
  downstream_class: str | None
  pattern: str
  rgb: tuple[int, int, int] | None
  pretrain_classes: tuple[str, ...]
  mechanism: str


_V1 = {d.name: d for d in DOWNSTREAM}
# The checkerboard photograph (black and white squares) counts as mid-grey.
_CHECKERBOARD_RGB = (128, 128, 128)
# clutter's distractors: two classes that no other dataset names, chosen before any run.
CLUTTER_DISTRACTOR_PAIRS = (("green", "plain"), ("red", "checkered"))
REAPPEARING_CLASS = "pink star"  # in clutter and in glyphs (different backgrounds)
NEGATIVE_CONTROL = "digits"
_PINK_STAR = ObjectStyle("shape", "star", "color", "pink")


def rendered_rgb(rgb: Sequence[int], post: str) -> tuple[int, int, int]:
  """The colour an object drawn in `rgb` (0-255) shows after a domain's post-processing
  `post` ('' unchanged, 'invert' 255 - rgb, 'thermal' the inferno colour of its red channel,
  as `render.render_scene` applies them; the renderer's small noise left out)."""
  if post == "invert":
    return tuple(255 - int(v) for v in rgb)
  if post == "thermal":
    import matplotlib as mpl

    r, g, b = mpl.colormaps["inferno"](int(rgb[0]))[:3]
    return (round(r * 255), round(g * 255), round(b * 255))
  return tuple(int(v) for v in rgb)


def _shared_pattern(dataset, name, pattern, colour_or_rgb):
  drawn = tuple(COLORS[colour_or_rgb]) if isinstance(colour_or_rgb, str) else colour_or_rgb
  rgb = rendered_rgb(drawn, _V1[dataset].post)  # the colour as it shows in the scene
  return Interference(
    dataset,
    name,
    pattern,
    rgb,
    nearest_same_pattern(rgb, pattern),
    f"shares the {pattern} pattern and the word '{pattern.split()[0]}' with the named classes,"
    " in a colour near theirs",
  )


@functools.cache
def interference() -> tuple[Interference, ...]:
  """Version 2's designed interference: per downstream dataset, the class that shares a
  pattern (and its word) with two named pre-training classes (docs/experiments.md).

  A function, computed once on first use, not a module constant: the thermal colour comes
  from matplotlib's inferno map, and importing matplotlib (about 0.1 s) would otherwise be paid
  by every process that imports the built-in benchmark.
  """
  return (
    _shared_pattern("thermal", "striped pipe", "striped", "orange"),
    _shared_pattern("negative", "dotted sticker", "dotted", "cyan"),
    _shared_pattern("tiny", "plain bead", "plain", "orange"),
    Interference(
      "clutter",
      None,
      "",
      None,
      tuple(f"{c} {p}" for c, p in CLUTTER_DISTRACTOR_PAIRS),
      "its 3-6 unannotated distractors are objects of the named classes (trained as background)",
    ),
    Interference(
      "textured",
      "checkered patch",
      "checkered",
      _CHECKERBOARD_RGB,
      nearest_same_pattern(_CHECKERBOARD_RGB, "checkered"),
      "a checkerboard-photograph fill and the word 'checkered' shared with the named classes",
    ),
  )


def _v2_domain(v1: Domain, classes, description: str, **changes) -> Domain:
  return dataclasses.replace(v1, classes=tuple(classes), description=description, **changes)


DOWNSTREAM_V2: tuple[Domain, ...] = (
  _v2_domain(
    _V1["thermal"],
    _V1["thermal"].classes
    + (
      ("striped pipe", ObjectStyle("shape", ("square", "hexagon"), "color", "orange", "striped")),
    ),
    "thermal-like false colour: hot spots, warm bodies and striped pipes (orange, dark stripes "
    "before the colour map)",
  ),
  _v2_domain(
    _V1["negative"],
    (
      ("dotted sticker", ObjectStyle("shape", NUISANCE_SHAPES, "color", "cyan", "dotted")),
      ("white ring", ObjectStyle("shape", "ring", "color", "white")),
    ),
    "colour negative: dotted cyan stickers and white rings, inverted",
  ),
  _v2_domain(
    _V1["tiny"],
    (
      ("plain bead", ObjectStyle("shape", "circle", "color", "orange")),
      ("cyan tile", ObjectStyle("shape", "square", "color", "cyan")),
    ),
    "scale shift: tiny plain orange beads and cyan tiles (9-13 px after resizing to 64)",
  ),
  _v2_domain(
    _V1["clutter"],
    _V1["clutter"].classes,
    "clutter: pink stars and white squares among 3-6 unannotated green plain / red checkered "
    "objects",
    distractor_pairs=CLUTTER_DISTRACTOR_PAIRS,
  ),
  _v2_domain(
    _V1["textured"],
    tuple(
      (n if n != "checkerboard patch" else "checkered patch", style)
      for n, style in _V1["textured"].classes
    ),
    "objects filled with photograph crops (fur, brick, starfield, checkered board), dark outline",
  ),
  _v2_domain(
    _V1["digits"],
    (
      ("digit zero", ObjectStyle("digit", 0, "ink", "black ink")),
      ("digit one", ObjectStyle("digit", 1, "ink", "orange ink")),
    ),
    "negative control: handwritten 0 (black ink) and 1 (orange ink) on light paper, no colour, "
    "pattern or word of a pre-training class",
  ),
  _v2_domain(
    _V1["glyphs"],
    _V1["glyphs"].classes + ((REAPPEARING_CLASS, _PINK_STAR),),
    "letters W / O / I in inks and pink stars (also in clutter) on document photographs",
  ),
)
DOMAINS_V2 = {d.name: d for d in DOWNSTREAM_V2}


def pretrain_domain(version: int) -> Domain:
  """The pre-training set's `Domain`: uniform classes (version 1) or `class_frequencies`
  (version 2), classes in `PRETRAIN_PAIRS` order either way."""
  weights = ()
  if version == 2:
    freq = class_frequencies()
    weights = tuple(freq[f"{c} {p}"] for c, p in PRETRAIN_PAIRS)
  return colour_pattern_domain(
    "pretrain",
    PRETRAIN_PAIRS,
    "colour x fill-pattern pairs on muted photograph backgrounds",
    class_weights=weights,
  )


def tail_domain() -> Domain:
  """Version 2's tail-classes evaluation set: every pre-training class name (so a tail object
  taken for a head class is a miss), objects of the `TAIL_PAIRS` only, drawn uniformly."""
  tail = set(TAIL_PAIRS)
  n = len(TAIL_PAIRS)
  return colour_pattern_domain(
    "pretrain_tail",
    PRETRAIN_PAIRS,
    "the 5 rarest pre-training classes (objects of those only; all 20 names queried)",
    class_weights=tuple(1.0 / n if pair in tail else 0.0 for pair in PRETRAIN_PAIRS),
  )


def downstream_domains(version: int) -> dict[str, Domain]:
  """{dataset name: Domain} of the version's downstream datasets (the same 7 names)."""
  return dict(DOMAINS) if version == 1 else dict(DOMAINS_V2)


def design(version: int) -> dict[str, Any]:
  """The version's design as recorded in the benchmark's metadata (`benchmark.json`
  'design'; {} for version 1): class frequencies, tail classes, interference, the reappearing
  class and the negative control."""
  if version == 1:
    return {}
  return {
    "class_frequencies": class_frequencies(),
    "frequency_seed": FREQUENCY_SEED,
    "tail_classes": tail_class_names(),
    "interference": [dataclasses.asdict(i) for i in interference()],
    "reappearing_class": {
      "name": REAPPEARING_CLASS,
      "datasets": [d.name for d in DOWNSTREAM_V2 if REAPPEARING_CLASS in dict(d.classes)],
    },
    "negative_control": NEGATIVE_CONTROL,
  }

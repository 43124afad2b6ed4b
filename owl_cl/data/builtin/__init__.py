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

Splits (defaults; see `BuiltinSpec`):

* `pretrain` (Objects365 stand-in): 20 colour x fill-pattern classes ('red plain',
  'blue striped', ...: 6 colours x 4 patterns minus 4 held-out pairs; object shapes vary as a
  nuisance), `train` 4,000 images, `val` 200 images, muted photograph backgrounds.
* `held_out` (LVIS-rare stand-in): the 4 held-out colour-pattern pairs — each word occurs in
  pre-training, the combination never does (also never as a downstream distractor); `val` 100.
* downstream (ODinW stand-in), 7 datasets of 2-4 new concepts (the first 5 below by default),
  `train` 200 / `test` 60 each:
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

Version 2 (`ensure_benchmark(..., version=2)`; docs/experiments.md, "Built-in benchmark
version 2"): the same classes, dataset names and domain shifts, with long-tailed pre-training
classes (frequency proportional to 1 / rank), a tail-classes evaluation set `pretrain_tail/val`,
downstream classes that interfere with named pre-training classes, a class in two downstream
datasets and a negative control (`vocabulary.design(2)`, stored in `benchmark.json`). The
description above is version 1 (`ensure_benchmark`'s default; the configs' default is version 2,
`:builtin1` selects version 1), which version 2 leaves byte for byte unchanged.

API: `ensure_benchmark(cache_dir, seed=0, **parameters) -> BuiltinBenchmark` (`BuiltinSpec`),
`BuiltinBenchmark.describe()`, `render_preview(...)`.

Modules: `vocabulary.py` (the classes and each dataset's rendering recipe), `render.py` (the
procedural renderer: bundled assets, object masks, fills, scenes), `benchmark.py` (writing
the splits, the cache folder, `BuiltinBenchmark`); the public names are re-exported here.
"""

from owl_cl.data.builtin.benchmark import FORMAT_VERSION
from owl_cl.data.builtin.benchmark import TAIL_DATASET
from owl_cl.data.builtin.benchmark import BuiltinBenchmark
from owl_cl.data.builtin.benchmark import BuiltinSpec
from owl_cl.data.builtin.benchmark import DownstreamDataset
from owl_cl.data.builtin.benchmark import SplitFiles
from owl_cl.data.builtin.benchmark import ensure_benchmark
from owl_cl.data.builtin.benchmark import generate_benchmark
from owl_cl.data.builtin.benchmark import render_preview
from owl_cl.data.builtin.vocabulary import BENCHMARK_VERSIONS
from owl_cl.data.builtin.vocabulary import COLORS
from owl_cl.data.builtin.vocabulary import DOWNSTREAM_NAMES
from owl_cl.data.builtin.vocabulary import HELD_OUT_PAIRS
from owl_cl.data.builtin.vocabulary import PRETRAIN_COLORS
from owl_cl.data.builtin.vocabulary import PRETRAIN_PATTERNS
from owl_cl.data.builtin.vocabulary import downstream_class_names
from owl_cl.data.builtin.vocabulary import held_out_class_names
from owl_cl.data.builtin.vocabulary import pretrain_class_names

__all__ = [
  "FORMAT_VERSION",
  "TAIL_DATASET",
  "BENCHMARK_VERSIONS",
  "BuiltinSpec",
  "SplitFiles",
  "DownstreamDataset",
  "BuiltinBenchmark",
  "ensure_benchmark",
  "generate_benchmark",
  "render_preview",
  "COLORS",
  "PRETRAIN_COLORS",
  "PRETRAIN_PATTERNS",
  "HELD_OUT_PAIRS",
  "DOWNSTREAM_NAMES",
  "pretrain_class_names",
  "held_out_class_names",
  "downstream_class_names",
]

"""Kind 'lvis': LVIS v1 (split val; train when declared) below a data `root`.

    dict(name="lvis", kind="lvis", root="/data", evaluation="lvis")

Read by `pretraining.lvis_source` (images found through `coco_url` below `<root>/coco/`);
evaluated with the federated LVIS AP and APr.

Source: LVIS v1 format (lvisdataset.org); `owl_cl.data.pretraining`.
"""

from __future__ import annotations

from owl_cl.data import pretraining
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.rooted import rooted_reader

READER = reader_lib.register(
  rooted_reader(
    "lvis",
    "lvis",
    ("val",),
    pretraining.lvis_paths,
    lambda entry, split, options: pretraining.lvis_source(entry.root, split, **options),
    evaluation="lvis",
    label="LVIS",
  )
)

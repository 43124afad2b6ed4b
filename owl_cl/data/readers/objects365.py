"""Kind 'objects365': Objects365 v2 (splits train, val) below a data `root`.

    dict(name="o365", kind="objects365", root="/data")

Read by `pretraining.objects365_source`: the forbidden (LVIS-rare) categories are removed
from the train split; evaluated with COCO AP.

Source: Objects365 v2 release; docs/reference.md §6; `owl_cl.data.pretraining`.
"""

from __future__ import annotations

from owl_cl.data import pretraining
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.rooted import rooted_reader

READER = reader_lib.register(
  rooted_reader(
    "objects365",
    "objects365",
    ("train", "val"),
    pretraining.objects365_paths,
    lambda entry, split, options: pretraining.objects365_source(entry.root, split, **options),
    evaluation="coco",
    label="O365",
  )
)

"""Kind 'coco2017': COCO 2017 (split val; train when declared) below a data `root`.

    dict(name="coco_val2017", kind="coco2017", root="/data")

`<root>/coco/annotations/instances_<split>2017.json` with the images in `<root>/coco/<split>2017/`
(`pretraining.coco_paths`), read as kind 'coco': the IVLOD protocol's zero-shot "ZCOCO" set
(docs/ivlod.md).

Source: COCO 2017 release (cocodataset.org); `owl_cl.data.pretraining`.
"""

from __future__ import annotations

from owl_cl.data import pretraining
from owl_cl.data.readers import reader as reader_lib
from owl_cl.data.readers.rooted import rooted_reader

READER = reader_lib.register(
  rooted_reader(
    "coco2017",
    "coco",
    ("val",),
    pretraining.coco_paths,
    reader_lib.coco_json_source,
    evaluation="coco",
    label="ZCOCO",
  )
)

"""Your own data: continual learning over a sequence of two COCO folders and a TFDS dataset.

Run (README "Your own data"):
  python -m owl_cl.main --config=configs/examples/own_data.py:/data/own --workdir=/tmp/own_run
with /data/own holding kitchen/ and warehouse/ (COCO json + images) and tfds/ (the TFDS data
folder with own_data_shelf prepared as ArrayRecord). Pre-training, the replay buffer and the
pre-training / held-out evaluation sets stay the built-in benchmark's (data.pretrain and
data.held_out unset); `python -m owl_cl.testing.own_data /data/own` writes this data from the
built-in benchmark's images.
"""

import os

from configs import base


def get_config(arg: str = "~/own_data"):
  """swil replay over the three datasets below the folder `arg` (default ~/own_data)."""
  root = os.path.expanduser(arg or "~/own_data")
  c = base.algorithm_config("own_data_swil", "swil")
  c.data.sequence = [
    dict(
      name="kitchen",
      kind="coco",
      train=dict(annotation_file=f"{root}/kitchen/train.json", image_dir=f"{root}/kitchen/images"),
      test=dict(annotation_file=f"{root}/kitchen/test.json", image_dir=f"{root}/kitchen/images"),
    ),
    dict(
      name="warehouse",
      kind="coco",
      train=dict(
        annotation_file=f"{root}/warehouse/train.json", image_dir=f"{root}/warehouse/images"
      ),
      test=dict(
        annotation_file=f"{root}/warehouse/test.json", image_dir=f"{root}/warehouse/images"
      ),
    ),
    # A TFDS split name per split; labels 0..K-1 are category ids 1..K (the default).
    dict(
      name="shelf",
      kind="tfds",
      tfds="tfds:own_data_shelf",
      data_dir=f"{root}/tfds",
      train="train",
      test="test",
    ),
  ]
  return c

"""Your own data: continual learning over a sequence of two COCO folders and a TFDS dataset.

Run (docs/data.md "Your own data"):
  python -m owl_cl.main --config=configs/examples/own_data.py:/data/own --workdir=/tmp/own_run
with /data/own holding kitchen/ and warehouse/ (COCO json + images) and tfds/ (the TFDS data
folder with own_data_shelf prepared as ArrayRecord). Pre-training, the replay buffer and the
pre-training / held-out evaluation sets stay the built-in benchmark's (data.pretrain and
data.held_out unset); `python -m owl_cl.testing.own_data /data/own` writes this data from the
built-in benchmark's images. The argument `/data/own,quick` is the quick try of docs/data.md: the
tiny budget of the tests (`owl_cl.testing.configs.tiny_budget`).
"""

import os

from owl_cl.configs import base
from owl_cl.testing.configs import tiny_budget


def get_config(arg: str = "~/own_data"):
  """swil replay over the three datasets below the folder `arg` (default ~/own_data)."""
  # 'DIR,quick': the same run with a tiny model and budget (about a minute on 2 CPU cores).
  root, quick = arg or "~/own_data", False
  if root.endswith(",quick"):
    root, quick = root.removesuffix(",quick"), True
  root = os.path.expanduser(root)
  # Pre-training, the buffer and their evaluation sets: version 1 of the built-in benchmark with
  # the fields' own settings (8 epochs, eq. 7's buffer, every set evaluated after each dataset).
  c = base.algorithm_config("own_data_swil", "swil", "builtin1")
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
  if quick:
    # The XLA compilation cache stays on (<cache_dir>/xla): datasets 2 and 3 then reuse the
    # steps compiled for dataset 1, which is most of a tiny run's time.
    tiny_budget(c)
    # The pre-training / held-out sets at stage 0 and at the end only; 8 images per eval set.
    c.eval.pretraining_sets_after_each_dataset = False
    c.max_eval_images = 8
  return c

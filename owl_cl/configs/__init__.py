"""The config files users edit (`--config=configs/<name>.py[:<arg>]`; docs/configs.md).

Each file is a retrieval algorithm of `owl_cl.replay.retrieval.registry.ALGORITHMS` (the file
of the same name), a baseline of `BASELINES`, a protocol of `PROTOCOLS`, or `base.py`, the
defaults they all start from. `launch/sweep.py`, the docs' tables and the tests iterate these
registries (tests/launch/test_sweep.py checks that the files are exactly them).
"""

# The baselines (docs/baselines.md): config name -> what it runs. `no_replay` is the config of
# `replay.algorithm='none'`.
BASELINES = {
  "no_replay": "sequential fine-tuning on the new data alone",
  "heads_only": "the heads trained, the towers frozen (train.frozen), no replay",
  "lwf": "distillation to the pre-trained model (train.lwf), no replay",
  "lora": "low-rank adapters, the base frozen (train.lora), no replay",
  "joint": "every dataset at once (train.schedule='joint'), with uniform replay",
  "per_task": "one model per dataset (train.schedule='per_task'), no replay",
  "wise_ft": "each dataset's model blended with the pre-trained one (train.wise_ft), no replay",
}

# Config files that are protocols on real data, not algorithms: ODinW-13's (docs/ivlod.md).
PROTOCOLS = ("ivlod_odinw13",)

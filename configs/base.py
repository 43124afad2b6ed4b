"""Base configuration: every value the code uses lives here (ml_collections).

`get_config(arg)`: arg '' (default) = the built-in benchmark with the tiny model. Algorithm
configs (`uniform.py`, `uniform_balanced.py`, `grasp.py`, `swil.py`, `sw_grasp.py`,
`a_sw_grasp.py`, `aser.py`, `aser_pc.py`, `sw_aser_pc.py`, `no_replay.py`) start from this one.
Any field can be overridden on the command line, e.g. `--config.replay.dedup=epoch`.
"""

import ml_collections

KNOWN_ARGS = ("",)


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """Returns the base config. Raises ValueError for an unknown `arg`."""
  if arg not in KNOWN_ARGS:
    raise ValueError(f"unknown config argument {arg!r}; known: {KNOWN_ARGS}")
  c = ml_collections.ConfigDict()
  c.experiment_name = "base"
  c.seed = 0
  # Order of the downstream sequence: None keeps the benchmark's order, an int shuffles it.
  c.sequence_seed = ml_collections.config_dict.placeholder(int)
  # Where cached artefacts (built-in benchmark, pre-trained models, buffers) live.
  c.cache_dir = "~/.cache/owl_cl"
  # Persistent XLA compilation cache ('' disables): later runs skip recompiling.
  c.compilation_cache_dir = "~/.cache/owl_cl/xla"

  # --- model ---------------------------------------------------------------------------
  c.model = ml_collections.ConfigDict()
  c.model.variant = "tiny"
  c.model.tokenizer = "word_hash"
  # Any field of the variant's ModelConfig, e.g. vision_layers=2. The tiny model's queries are
  # at most a few words: a text context of 8 halves the text tower's cost.
  c.model.overrides = ml_collections.ConfigDict({"context_length": 8})
  # A parameter checkpoint (owl_cl.train.checkpointing.save_params layout). None: pre-train
  # the model on the pre-training set (built-in benchmark) and cache it.
  c.init_checkpoint = ml_collections.config_dict.placeholder(str)

  # --- data ----------------------------------------------------------------------------
  c.data = ml_collections.ConfigDict()
  c.data.root = ml_collections.config_dict.placeholder(str)   # None: built-in benchmark
  # Q per training image: '' + positives + negatives, padded with ''. 24 > 20 pre-training
  # classes: every image contrasts its objects against every other class name.
  c.data.num_queries = 24
  c.data.num_negatives = 23      # random negative class names per training image (up to)
  c.data.max_instances = 8       # M boxes per image
  c.data.num_workers = 0         # grain worker processes (0 = in process)
  c.data.eval_batch_size = 64
  c.data.builtin = ml_collections.ConfigDict()
  c.data.builtin.seed = 0
  c.data.builtin.num_pretrain_train = 4000
  c.data.builtin.num_pretrain_val = 200
  c.data.builtin.num_held_out_val = 100
  c.data.builtin.num_downstream_train = 200
  c.data.builtin.num_downstream_test = 60
  # The sequence (ODinW stand-in); also available: "tiny", "digits" (slower to learn).
  c.data.builtin.downstream = ("thermal", "negative", "clutter", "textured", "glyphs")

  # --- pre-training (only when no init_checkpoint is given) ------------------------------
  c.pretrain = ml_collections.ConfigDict()
  c.pretrain.batch_size = 32
  c.pretrain.num_steps = 1500
  c.pretrain.learning_rate = 1e-3
  c.pretrain.warmup_steps = 100
  c.pretrain.text_lr_multiplier = 1.0   # from scratch: the text tower learns at full LR
  c.pretrain.layerwise_decay = 1.0
  c.pretrain.weight_decay = 0.0
  # The text tower embeds each distinct query row of a batch once (at most this many distinct
  # rows; more falls back to embedding every row). 0 disables it.
  c.pretrain.max_unique_queries = 64
  c.pretrain.eval_every_steps = 400    # validation AP on the pre-training val split (curve)

  # --- continual fine-tuning (per downstream dataset; fresh optimizer each) -------------
  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 16          # new images per step
  c.train.num_epochs = 8
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 10
  # The paper trains the text tower at 0.1x; CLIP's text tower already knows the downstream
  # words. The tiny model's text tower has never seen the built-in benchmark's downstream
  # words, so it trains at the full LR here.
  c.train.text_lr_multiplier = 1.0
  c.train.layerwise_decay = 1.0
  c.train.b1 = 0.9
  c.train.b2 = 0.999
  c.train.eps = 1e-8
  c.train.weight_decay = 0.0
  c.train.grad_clip_norm = 1.0
  c.train.log_every_steps = 20
  c.train.max_unique_queries = 64    # see pretrain.max_unique_queries

  # --- detection loss (SPEC §3) ----------------------------------------------------------
  c.loss = ml_collections.ConfigDict()
  c.loss.focal_alpha = 0.3
  c.loss.focal_gamma = 2.0
  c.loss.class_weight = 1.0
  c.loss.bbox_weight = 1.0
  c.loss.giou_weight = 1.0

  # --- replay (SPEC §6-§8) ---------------------------------------------------------------
  c.replay = ml_collections.ConfigDict()
  # uniform | uniform_balanced | grasp | swil | sw_grasp | a_sw_grasp | aser | aser_pc |
  # sw_aser_pc | none (paper Table 2)
  c.replay.algorithm = "swil"
  c.replay.ratio = 1.0             # replayed images per new image (paper 1:1)
  c.replay.dedup = "dataset"       # none | epoch | dataset | fraction (SPEC §8)
  c.replay.dedup_fraction = 1.0 / 3.0   # 'fraction': reset after this fraction of the buffer
  c.replay.der_alpha = 2.0         # DER++ logit distillation weight
  c.replay.der_beta = 1.0          # DER++ replay detection-loss weight
  c.replay.swil_w = 1.0            # similarity weighting exponent w (SWIL, paper 1.0)
  c.replay.grasp_w = 1.0           # prototype weighting exponent w (GRASP, paper 1.0; code 0.7)
  # Balanced class order: 'sequential' (paper) | 'reshuffled' (released code: a random
  # permutation reshuffled after every pass).
  c.replay.balanced_order = "sequential"
  # A-SW-GRASP: GRASP for a new image iff the normalised entropy of its SWIL distribution
  # exceeds tau (the paper gives no value; it describes tau as "too close to 1.0").
  c.replay.adaptive_entropy_threshold = 0.99
  # Adversarial Shapley value (ASER, ASER-PC, SW-ASER-PC; paper suppl. Table 7, SPEC §7).
  c.replay.aser = ml_collections.ConfigDict()
  # N_c candidates per call; None = the algorithm's paper value (ASER 168, *-PC 352).
  c.replay.aser.num_candidates = ml_collections.config_dict.placeholder(int)
  c.replay.aser.knn_k = 20                 # K of the KNN-SV recursion
  c.replay.aser.c = 0.15                   # c of eq. 4 (dynamic w)
  c.replay.aser.token_matching = "all_to_all"   # paper | 'nearest_token' (released code)
  c.replay.aser.distance = "l2"            # 'l2' (released code) | 'cosine'
  c.replay.aser.weight_reduction = "min"   # eq. 4 min/min (paper) | 'max' (released code)
  c.replay.aser.chunk_size = 64            # images per chunk of the ASER-PC precomputation
  # Analysis records (paper Figs. 3-5) in <workdir>/records/<dataset>.npz.
  c.replay.records = True
  c.replay.top_k = 8               # k class embeddings per image
  # Loss adaptivity (paper §4 eqs. 5-6, Table 4; SPEC §9). mode: 'none' (1:1 replay, the
  # paper's main results); 'paper' (replay only for the r new images whose pre-step loss
  # exceeds l, L_T = L_B + (r/|B|) L_R; needs ratio 1); 'released_gate' (the released code:
  # drop L_R on steps whose mean new loss is below l; replays still retrieved and marked).
  # The paper gives no value of l (Table 4 reports the resulting replay fractions, 97% and
  # 85%; the released code's `replay_thresh` has no default): 0.3 here, the buffer loss
  # threshold, i.e. "replay for new images not yet learned as well as the buffer images".
  c.replay.loss_adaptivity = ml_collections.ConfigDict()
  c.replay.loss_adaptivity.mode = "none"       # none | paper | released_gate
  c.replay.loss_adaptivity.threshold = 0.3     # l, in units of the detection loss
  c.replay.buffer = ml_collections.ConfigDict()
  c.replay.buffer.loss_threshold = 0.3   # eq. 7: keep images with pre-trained loss < t
  c.replay.buffer.min_per_class = 20     # then top up each class to this many images
  c.replay.buffer.fill_all_for_rare_classes = False   # released code: add all of them
  c.replay.buffer.max_instances_per_prototype = 6

  # --- evaluation (SPEC §4) --------------------------------------------------------------
  c.eval = ml_collections.ConfigDict()
  c.eval.top_k = 100               # detections per image
  c.eval.max_dets = 100            # COCOeval maxDets
  c.eval.multi_label = False       # exclusive datasets: argmax class per token

  # --- checkpoints -----------------------------------------------------------------------
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.max_to_keep = ml_collections.config_dict.placeholder(int)   # None = all

  # --- debugging / tiny budgets ----------------------------------------------------------
  c.max_train_steps_per_dataset = ml_collections.config_dict.placeholder(int)
  c.max_eval_images = ml_collections.config_dict.placeholder(int)
  return c


def algorithm_config(experiment_name: str, algorithm: str,
                     arg: str = "") -> ml_collections.ConfigDict:
  """The base config with `replay.algorithm` set (used by the per-algorithm config files)."""
  c = get_config(arg)
  c.experiment_name = experiment_name
  c.replay.algorithm = algorithm
  return c

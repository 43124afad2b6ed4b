"""Command line: ``python -m owl_cl.model.convert {scenic-to-owl_cl, hf-to-owl_cl,
owl_cl-to-hf, clip-to-owl_cl} INPUT OUTPUT ...``.

Each command writes (or reads) our own parameter format, ``owl_cl.train.checkpointing``'s
``save_params`` layout: an orbax tree plus ``meta.json`` recording where the parameters came
from. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
import json
import os
import sys
from typing import Any

import jax

from owl_cl import integrity
from owl_cl.model import lora as lora_lib
from owl_cl.model import owl_vit as owl_lib
from owl_cl.model.convert import hf
from owl_cl.model.convert import openai_clip
from owl_cl.model.convert import scenic
from owl_cl.model.convert import tree
from owl_cl.train import checkpointing


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  out = {}
  for item in items or ():
    if "=" not in item:
      raise SystemExit(f"--override expects name=value, got {item!r}")
    name, value = item.split("=", 1)
    try:
      out[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[name] = value
  if "dtype" in out:
    out["dtype"] = tree.jnp_dtype(out["dtype"])
  return out


def _config_from_args(args) -> owl_lib.ModelConfig:
  overrides = _parse_overrides(args.override)
  return owl_lib.create_model(args.variant, **overrides).config


def _write_ours(path: str, params: tree.PyTree, meta: dict, overwrite: bool) -> None:
  """``checkpointing.save_params`` (atomic); an existing output is replaced only with
  ``overwrite`` and only after the new one is complete."""
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"refusing to overwrite existing {path} (pass --overwrite)")
  checkpointing.save_params(path, params, meta, overwrite=overwrite)


def _meta(source: str, fmt: str, config: owl_lib.ModelConfig) -> dict:
  return {
    "converted_from": os.path.abspath(source),
    "source_format": fmt,
    "model_config": tree.model_config_to_dict(config),
    "converter": "owl_cl.model.convert",
  }


def _cmd_scenic(args) -> None:
  config = _config_from_args(args)
  params = scenic.load_scenic_checkpoint(args.input, config)
  _write_ours(args.output, params, _meta(args.input, "scenic", config), args.overwrite)


def _cmd_hf_to_ours(args) -> None:
  params, config = hf.load_hf_checkpoint(args.input)
  _write_ours(args.output, params, _meta(args.input, "hf", config), args.overwrite)


def _cmd_ours_to_hf(args) -> None:
  params, meta = checkpointing.load_params(args.input)
  if args.variant:
    config = _config_from_args(args)
  elif "model_config" in meta:
    config = tree.model_config_from_dict(meta["model_config"])
  else:
    config = tree.infer_model_config(params)
  hf.save_hf_checkpoint(params, args.output, config, overwrite=args.overwrite)


def _cmd_lora(args) -> None:
  """The base checkpoint with a LoRA run's adapters (its newest intact stage checkpoint, or
  `--stage`, verified against its manifest) merged into the kernels (docs/lora.md)."""
  run_file = os.path.join(args.workdir, "run.json")
  with open(run_file, encoding="utf-8") as f:
    lora_config = json.load(f)["config"]["train"].get("lora")
  options = lora_lib.options_from_config(lora_config)
  if options is None:
    raise ValueError(f"{run_file}: config.train.lora is off (rank 0): no adapters to merge")
  params, meta = checkpointing.load_params(args.input)
  config = (
    tree.model_config_from_dict(meta["model_config"])
    if "model_config" in meta
    else tree.infer_model_config(params)
  )
  # The variant's name does not matter: every field of `config` is given.
  model = owl_lib.create_model("tiny", **config.as_dict())
  like = jax.tree.map(
    lambda s: jax.numpy.zeros(s.shape, s.dtype), lora_lib.abstract_adapters(model, options)
  )
  stages = checkpointing.StageCheckpointer(os.path.join(args.workdir, "checkpoints"))
  try:
    stage = stages.latest_stage() if args.stage is None else args.stage
    if stage is None:
      raise ValueError(f"{args.workdir}/checkpoints holds no stage checkpoint")
    if args.stage is not None:
      integrity.verify_directory(os.path.join(stages.directory, str(stage)))
    adapters, _, _ = stages.restore(stage, like, None)
  finally:
    stages.close()
  merged = lora_lib.merge(lora_lib.combine(params, adapters), options)
  out_meta = dict(meta, lora={"workdir": os.path.abspath(args.workdir), "stage": int(stage)})
  out_meta["lora"].update(rank=options.rank, alpha=options.alpha, targets=list(options.targets))
  _write_ours(args.output, merged, out_meta, args.overwrite)


def _cmd_clip(args) -> None:
  config = _config_from_args(args)
  like = tree.flatten(tree.abstract_params(config))
  fresh = tree.flatten(openai_clip.fresh_head_params(config, jax.random.key(args.seed)))
  init = {k: fresh.get(k, v) for k, v in like.items()}
  params = openai_clip.load_clip_torchscript(args.input, tree.unflatten(init))
  meta = _meta(args.input, "openai_clip", config)
  meta["init_seed"] = args.seed
  _write_ours(args.output, params, meta, args.overwrite)


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line converter; see docs/checkpoints.md and ``--help``."""
  parser = argparse.ArgumentParser(
    prog="python -m owl_cl.model.convert",
    description="Convert OWL-ViT and OWLv2 checkpoints to and from owl_cl's parameter format.",
  )
  sub = parser.add_subparsers(dest="command", required=True)

  def model_args(p, required):
    p.add_argument(
      "--variant", required=required, help=f"model variant, one of {sorted(owl_lib.VARIANTS)}"
    )
    p.add_argument(
      "--override",
      action="append",
      default=[],
      metavar="NAME=VALUE",
      help="ModelConfig field override, e.g. image_size=768 (repeatable)",
    )

  p = sub.add_parser("scenic-to-owl_cl", help="scenic msgpack checkpoint -> owl_cl")
  p.add_argument("input", help="msgpack file or folder of checkpoint_<step> files")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  model_args(p, required=True)
  p.set_defaults(fn=_cmd_scenic)

  p = sub.add_parser(
    "hf-to-owl_cl",
    help="saved HF OwlViTForObjectDetection or Owlv2ForObjectDetection folder -> owl_cl "
    "(the version is read from config.json's model_type)",
  )
  p.add_argument("input", help="folder with config.json and weights")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  p.set_defaults(fn=_cmd_hf_to_ours)

  p = sub.add_parser(
    "owl_cl-to-hf",
    help="owl_cl checkpoint -> saved HF folder (Owlv2ForObjectDetection for an OWLv2 model)",
  )
  p.add_argument("input", help="owl_cl checkpoint folder (save_params layout)")
  p.add_argument("output", help="HF folder to write")
  model_args(p, required=False)
  p.set_defaults(fn=_cmd_ours_to_hf)

  p = sub.add_parser(
    "lora-to-owl_cl",
    help="a LoRA run's adapters merged into its base -> owl_cl (then owl_cl-to-hf for HF)",
  )
  p.add_argument("input", help="the run's base: owl_cl checkpoint folder (save_params layout)")
  p.add_argument("workdir", help="the LoRA run's workdir (run.json, checkpoints/)")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  p.add_argument("--stage", type=int, default=None, help="stage (default: the newest intact)")
  p.set_defaults(fn=_cmd_lora)

  p = sub.add_parser("clip-to-owl_cl", help="OpenAI CLIP TorchScript file -> owl_cl init")
  p.add_argument("input", help="e.g. ViT-L-14.pt")
  p.add_argument("output", help="owl_cl checkpoint folder to write")
  model_args(p, required=True)
  p.add_argument("--seed", type=int, default=0, help="PRNG seed of the fresh heads")
  p.set_defaults(fn=_cmd_clip)

  for p in sub.choices.values():
    p.add_argument(
      "--overwrite",
      action="store_true",
      help="replace an existing output (after the new one is complete)",
    )
  args = parser.parse_args(argv)
  try:
    args.fn(args)
  except (FileExistsError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from e
  print(f"wrote {os.path.abspath(args.output)}")


if __name__ == "__main__":
  main()

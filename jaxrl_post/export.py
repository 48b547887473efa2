"""Export a run's policy as a Hugging Face model directory.

  python -m jaxrl_post.export WORKDIR [--step N] --out DIR

  WORKDIR            a training run's directory (config.gin + checkpoints/)
  --step N           which checkpoint (default: the newest complete one)
  --out DIR          written: config.json, model.safetensors (shards + index when larger
                     than --max-shard-size), tokenizer.json, tokenizer_config.json (with
                     the chat template), generation_config.json
  --dtype            stored weights: float32 (default, what training keeps), bfloat16, float16
  --max-shard-size   e.g. 5GB (default), 200MB
  --compilation_cache=PATH|off
                     persistent XLA compilation cache (default: ~/.cache/jaxrl_post/xla)

LoRA adapters are merged into the base weights, so the directory loads in transformers
(AutoModelForCausalLM.from_pretrained) and in our own loader (--model DIR) alike. A mistake
is one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxrl_post import compile_cache
from jaxrl_post.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.export",
                              description="Write a run's policy as a Hugging Face directory.")
  p.add_argument("workdir", help="training run directory")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  p.add_argument("--max-shard-size", default="5GB", help="split weights above this size")
  compile_cache.add_cache_flag(p)
  return p.parse_args(argv)


def _check_out(out: str) -> None:
  """Refuses to write over a directory that is not an earlier export."""
  if os.path.isfile(out):
    raise UserError(f"{out}: exists and is a file, not a directory")
  if os.path.isdir(out) and os.listdir(out) and \
      not os.path.isfile(os.path.join(out, "config.json")):
    raise UserError(f"{out}: directory is not empty and holds no model (config.json); "
                    "choose a new --out")


def run(args: argparse.Namespace) -> dict:
  from jaxrl_post.models.hf_export import parse_size, save_pretrained
  from jaxrl_post.pipeline.trained import load_trained

  max_shard = parse_size(args.max_shard_size)
  _check_out(args.out)
  policy = load_trained(args.workdir, args.step)
  files = save_pretrained(args.out, policy.config, policy.params, policy.tokenizer,
                          dtype=args.dtype, max_shard_bytes=max_shard)
  return {"step": policy.step, "out": args.out, "files": files}


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache)
  try:
    result = run(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported step {result['step']} of {args.workdir} to {result['out']} "
        f"({len(result['files'])} files)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

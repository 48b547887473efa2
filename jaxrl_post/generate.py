"""Generate from a model: python -m jaxrl_post.generate --prompt TEXT [--chat] [--json].

  --model NAME_OR_PATH   embedded name (default smollm2-135m-instruct), GGUF file or
                         Hugging Face directory
  --chat                 wrap the prompt as a user turn in the model's chat template
  --temperature 0        greedy decoding
  --json                 print exactly one JSON object:
                         {"prompt_token_ids", "output_token_ids", "output_text"}
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl_post.errors import UserError

DEFAULT_MODEL = "smollm2-135m-instruct"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.generate",
                              description="Generate text from a language model.")
  p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, GGUF file or HF dir")
  p.add_argument("--prompt", required=True, help="prompt text")
  p.add_argument("--chat", action="store_true", help="apply the model's chat template")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.7, help="0 means greedy")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                 help="compute dtype (auto: float32 on CPU, bfloat16 on accelerators)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
  import jax

  from jaxrl_post import models
  from jaxrl_post.models.decode import generate_dense

  dtype = args.dtype
  if dtype == "auto":
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  model, tok = models.load(args.model, compute_dtype=dtype)
  if args.chat:
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
  else:
    prompt_ids = tok.encode(args.prompt)
  result = generate_dense(model, [prompt_ids], max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, stop_ids=tok.stop_ids)
  out = result.tokens[0]
  return {"prompt_token_ids": prompt_ids, "output_token_ids": out,
          "output_text": tok.decode(out, skip_special_tokens=True)}


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    result = run(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(result, ensure_ascii=False))
  else:
    print(result["output_text"])
  return 0


if __name__ == "__main__":
  sys.exit(main())

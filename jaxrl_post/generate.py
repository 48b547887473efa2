"""Generate from a model: python -m jaxrl_post.generate --prompt TEXT [--chat] [--json].

  --model NAME_OR_PATH   embedded name (default smollm2-135m-instruct), GGUF file or
                         Hugging Face directory
  --checkpoint WORKDIR   a training run's policy instead (its newest checkpoint, or --step N);
                         LoRA adapters are merged, the tokenizer is the run's
  --chat                 wrap the prompt as a user turn in the model's chat template
  --temperature 0        greedy decoding
  --json                 print exactly one JSON object:
                         {"prompt_token_ids", "output_token_ids", "output_text"}

Decoding runs on the rollout engine (paged KV cache), the same code path as RL rollouts.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl_post import compile_cache
from jaxrl_post.errors import UserError

DEFAULT_MODEL = "smollm2-135m-instruct"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.generate",
                              description="Generate text from a language model.")
  p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, GGUF file or HF dir")
  p.add_argument("--checkpoint", default=None, metavar="WORKDIR",
                 help="generate from a training run's checkpoint (overrides --model)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument("--prompt", required=True, help="prompt text")
  p.add_argument("--chat", action="store_true", help="apply the model's chat template")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.7, help="0 means greedy")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                 help="compute dtype (auto: float32 on CPU, bfloat16 on accelerators)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  compile_cache.add_cache_flag(p)
  return p.parse_args(argv)


def _engine_for(model, prompt_len: int, max_new_tokens: int, num_stop_ids: int):
  """A one-slot engine whose page pool holds exactly this request."""
  from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig
  from jaxrl_post.rollout.pages import cdiv

  page_size = 16
  context = model.config.max_position_embeddings
  max_seq_len = min(cdiv(prompt_len + max_new_tokens, 64) * 64, context)
  pool = PoolConfig(page_size=page_size, num_pages=cdiv(max_seq_len, page_size) + 1)
  config = EngineConfig(num_slots=1, decode_steps=16, prefill_chunk=256,
                        max_seq_len=max_seq_len, max_stop_ids=max(1, num_stop_ids), pool=pool)
  return Engine.from_model(model, config)


def _load(args: argparse.Namespace, dtype: str):
  """(model, tokenizer) from --checkpoint (a run directory) or --model."""
  from jaxrl_post import models

  if args.checkpoint is None:
    if args.step is not None:
      raise UserError("--step needs --checkpoint WORKDIR")
    return models.load(args.model, compute_dtype=dtype)
  from jaxrl_post.pipeline.trained import load_trained

  policy = load_trained(args.checkpoint, args.step)
  return policy.model(compute_dtype=dtype), policy.tokenizer


def run(args: argparse.Namespace) -> dict:
  import jax

  from jaxrl_post.rollout import Request, SamplingParams, generate

  dtype = args.dtype
  if dtype == "auto":
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  model, tok = _load(args, dtype)
  if args.chat:
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
  else:
    prompt_ids = tok.encode(args.prompt)
  sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                            stop_ids=tok.stop_ids)
  engine = _engine_for(model, len(prompt_ids), sampling.max_tokens, len(tok.stop_ids))
  completion = generate(engine, [Request(tuple(prompt_ids), seed=args.seed)],
                        sampling=sampling)[0][0]
  out = list(completion.tokens)
  return {"prompt_token_ids": prompt_ids, "output_token_ids": out,
          "output_text": tok.decode(out, skip_special_tokens=True)}


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache)
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

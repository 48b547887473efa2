"""KV memory one sequence holds in the rollout engine, with and without the window pool.

  python scripts/bench_kv_memory.py [--models gemma3-1b,gemma3-4b] [--contexts 8192,32768]

Per model preset and sequence length (prompt + completion), the bytes of K and V a
decoding sequence holds at its longest: every layer at every position in one pool (the
layout before the window pool), against the global layers at every position and the
sliding layers only at the pages their window and the decode calls ahead span
(rollout.pages.window_span). Both come from the engine's own sizing functions, which the
tests check against the pages an engine really holds. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

from jaxrl_post.models import preset
from jaxrl_post.rollout.pages import (cdiv, page_bytes, pool_page_bytes, window_layers,
                                      window_share, window_span)


def per_sequence(name: str, tokens: int, page_size: int, decode_steps: int, dtype: str):
  cfg = preset(name)
  pages = cdiv(tokens, page_size)
  sliding = window_layers(cfg)
  span = window_span(cfg, page_size, decode_steps)
  one_pool = pages * page_bytes(cfg, page_size, dtype)
  share = window_share(cfg, page_size, pages, decode_steps)  # As the engine sizes its pool.
  split = pages * pool_page_bytes(cfg, page_size, dtype, share)
  return {"model": name, "tokens": tokens, "layers": cfg.num_layers, "sliding_layers": sliding,
          "window": cfg.sliding_window, "window_pages_per_sequence": min(pages, span or pages),
          "one_pool_mb": round(one_pool / 2**20, 1), "window_pool_mb": round(split / 2**20, 1),
          "ratio": round(one_pool / split, 2)}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="gemma3-1b,gemma3-4b")
  p.add_argument("--contexts", default="8192,32768")
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--decode_steps", type=int, default=16)
  p.add_argument("--dtype", default="bfloat16")
  a = p.parse_args(argv)
  rows = [per_sequence(m, int(t), a.page_size, a.decode_steps, a.dtype)
          for m in a.models.split(",") for t in a.contexts.split(",")]
  print(json.dumps({"page_size": a.page_size, "decode_steps": a.decode_steps,
                    "kv_dtype": a.dtype, "sequences": rows}))


if __name__ == "__main__":
  main()

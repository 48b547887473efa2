"""Prefill attention of long prompts, the plain-jnp gather against the paged prefill kernel.

  python scripts/bench_prefill.py [--models gemma3-1b,gemma3-4b] [--contexts 8192,32768]

One engine prefill call per (model, context): the last `--chunk` tokens of a prompt of
`--context` tokens, its earlier pages already written (an earlier chunk or a prefix-cache
hit), packed into the engine's rows (rollout.prefill_pack, rows of 24 tokens, pages of 16).
Per layer type (sliding, global) it reports

* key pages per row: what the jnp path gathers (every page the row lists) against what the
  kernel reads (kernels.paged_prefill.needed_pages: the pages some query's window spans;
  the kernels' loops and DMAs stop at that count, tests/kernels/test_paged_prefill.py);
* the K/V megabytes (bf16) one layer's call reads that way, summed over the rows.

Counts only: nothing here is timed or compiled. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from jaxrl_post.kernels.paged_prefill import needed_pages
from jaxrl_post.models import preset
from jaxrl_post.rollout.pages import cdiv
from jaxrl_post.rollout.prefill_pack import Chunk, pack

ROW = 24  # The engine's packed prefill row (rollout.prefilling._PACKED_ROW).


def rows_for(context: int, chunk: int, page_size: int):
  pages = list(range(1, cdiv(context, page_size) + 1))
  start = context - chunk
  rows, _ = pack([Chunk(0, np.zeros(chunk, np.int32), start, pages)], shards=1, width=ROW,
                 page_size=page_size)
  return rows


def measure(name: str, context: int, chunk: int, page_size: int) -> dict:
  cfg = preset(name)
  rows = rows_for(context, chunk, page_size)
  listed = rows.key_segments >= 0  # [rows, K]: what the jnp path gathers
  layout = [jnp.asarray(x) for x in (rows.key_pages, rows.key_segments, rows.key_starts,
                                     rows.positions, rows.segments)]
  kv_page = 2 * cfg.num_kv_heads * page_size * cfg.head_dim * 2  # K and V, bf16
  out = {"model": name, "context": context, "chunk": chunk, "rows": int(rows.tokens.shape[0]),
         "window": cfg.sliding_window}
  for kind, window in (("sliding", cfg.sliding_window), ("global", None)):
    counts = np.asarray(needed_pages(*layout, page_size, window)[3])
    out[kind] = {"key_pages_per_row_jnp": int(listed.sum(axis=1).max()),
                 "key_pages_per_row_kernel": int(counts.max()),
                 "kv_mb_read_jnp": round(int(listed.sum()) * kv_page / 2**20, 1),
                 "kv_mb_read_kernel": round(int(counts.sum()) * kv_page / 2**20, 1)}
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="gemma3-1b,gemma3-4b")
  p.add_argument("--contexts", default="8192,32768")
  p.add_argument("--chunk", type=int, default=256, help="prompt tokens of the call "
                 "(the engine's prefill_chunk)")
  p.add_argument("--page-size", type=int, default=16)
  args = p.parse_args(argv)
  results = [measure(m, int(c), args.chunk, args.page_size)
             for m in args.models.split(",") for c in args.contexts.split(",")]
  print(json.dumps({"results": results}))


if __name__ == "__main__":
  main()

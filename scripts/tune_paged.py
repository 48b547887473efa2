"""Sweep the paged decode kernel's tunables on this device and report HBM bandwidth.

  python scripts/tune_paged.py [--json] [--shapes 64x4096x9x3x64,256x768x32x8x64]

For each decode shape (sequences x context x query heads x KV heads x head_dim, bf16,
16-token pages scattered over the pool) and each PagedAttentionConfig of the grid
(block_kv x num_warps x num_stages x num_splits), times the kernel (median of --runs after
a warm-up), checks it against the float32 reference, and reports GB/s of K/V read and the
share of the device's HBM peak. The last line is one JSON object: every point and, per
shape, the best config. Only a GPU's times mean anything; on a CPU the kernel runs in the
Pallas interpreter (use tiny shapes there, to check the script).
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post import kernels
from jaxrl_post.kernels.paged_attention import PagedAttentionConfig
from jaxrl_post.telemetry import peaks

import bench_kernels as bench  # scripts/ is on sys.path when run as a script


def _inputs(rng, b, ctx, hq, hkv, d, page_size=16):
  pages = ctx // page_size
  shape = (hkv, b * pages, page_size, d)
  k = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  table = jnp.asarray(rng.permutation(b * pages).reshape(b, pages), jnp.int32)
  q = jnp.asarray(rng.standard_normal((b, hq, d), np.float32), jnp.bfloat16)
  return q, k, v, table, jnp.full((b,), pages * page_size, jnp.int32)


def sweep(shape: str, grid: dict, runs: int, rng) -> dict:
  b, ctx, hq, hkv, d = (int(x) for x in shape.split("x"))
  inputs = _inputs(rng, b, ctx, hq, hkv, d)
  want = jax.jit(kernels.paged_attention_reference)(*inputs)
  kv_bytes = 2 * b * ctx * hkv * d * 2
  peak = peaks.lookup(peaks.HBM_BYTES_PER_S, jax.devices()[0].device_kind)
  points = []
  for values in itertools.product(*grid.values()):
    config = PagedAttentionConfig(**dict(zip(grid, values)))
    fn = jax.jit(lambda *a, c=config: kernels.paged_attention(*a, config=c))
    try:
      ms = bench.median_ms(fn, *inputs, runs=runs, warmup=2)
      err = bench.max_abs_err(fn(*inputs), want)
    except Exception as e:  # noqa: BLE001  (a config Triton cannot compile is a data point)
      points.append({**dict(zip(grid, values)), "error": str(e).splitlines()[0][:200]})
      continue
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    points.append({**dict(zip(grid, values)), "ms": round(ms, 4), "gb_per_s": round(gbps, 1),
                   "hbm_pct_of_peak": round(100 * gbps * 1e9 / peak, 1) if peak else None,
                   "max_abs_err": err})
  ok = [p for p in points if "ms" in p]
  best = min(ok, key=lambda p: p["ms"]) if ok else None
  default = next((p for p in ok if all(p[k] == getattr(PagedAttentionConfig(), k)
                                       for k in grid)), None)
  return {"shape": shape, "points": points, "best": best, "default": default}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true", help="print only the JSON object")
  p.add_argument("--shapes", default="64x4096x9x3x64,64x4096x32x8x64,256x768x32x8x64")
  p.add_argument("--block-kv", default="128,256")
  p.add_argument("--num-warps", default="4,8")
  p.add_argument("--num-stages", default="2,3")
  p.add_argument("--num-splits", default="0", help="0: the kernel's own choice")
  p.add_argument("--runs", type=int, default=10)
  args = p.parse_args(argv)
  ints = lambda s: [int(x) for x in s.split(",")]
  grid = {"block_kv": ints(args.block_kv), "num_warps": ints(args.num_warps),
          "num_stages": ints(args.num_stages),
          "num_splits": [n or None for n in ints(args.num_splits)]}
  rng = np.random.default_rng(0)
  result = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "sweeps": []}
  for shape in args.shapes.split(","):
    result["sweeps"].append(sweep(shape, grid, args.runs, rng))
    if not args.json:
      s = result["sweeps"][-1]
      print(shape, "best", json.dumps(s["best"]), "default", json.dumps(s["default"]),
            flush=True)
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

"""Benchmark the Pallas kernels against their references on the current backend.

  python scripts/bench_kernels.py [--json] [--batch 32 --context 2048 ...]

Each kernel and its reference are jitted, warmed up and timed by the median of --runs
calls (block_until_ready). Reported per kernel: times, max |kernel - reference|, and on a
GPU the HBM bandwidth reached by decode attention (K/V bytes read / time) as a share of
the device's peak (H100 3.35 TB/s, H200 4.8 TB/s). chunked_logprob_memory_ratio is XLA's
temporary bytes for the dense value-and-grad over those of the chunked one, from the
compiled memory analysis at T=4096, V=49152, d=576 (compile only, any backend).

On a CPU the kernels run in the Pallas interpreter, so their times say nothing about the
kernels; the defaults are small so the script finishes in a couple of minutes. Absolute
times count only on a GPU/TPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post import kernels
from jaxrl_post.telemetry import peaks

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def median_ms(fn, *args, runs: int, warmup: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def max_abs_err(a, b) -> float:
  leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in leaves)


def peak_bandwidth():
  return peaks.lookup(peaks.HBM_BYTES_PER_S, jax.devices()[0].device_kind)


def bandwidth(bytes_read: int, ms: float) -> dict:
  """Achieved GB/s and share of peak; only meaningful (and only reported) on a GPU."""
  if jax.default_backend() != "gpu":
    return {}
  gbps = bytes_read / (ms * 1e-3) / 1e9
  peak = peak_bandwidth()
  pct = None if peak is None else 100 * gbps * 1e9 / peak
  return {"hbm_gb_per_s": gbps, "hbm_pct_of_peak": pct}


# ----------------------------------------------------------------------------- decode


def decode_inputs(args, rng, batch, pages_per_seq):
  """Random q and a fragmented pool: every sequence's pages are scattered."""
  dtype = DTYPES[args.dtype]
  num_pages = batch * pages_per_seq
  shape = (args.kv_heads, num_pages, args.page_size, args.head_dim)
  k_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  v_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
  q = jnp.asarray(rng.standard_normal((batch, args.heads, args.head_dim), np.float32), dtype)
  return q, k_pages, v_pages, table


def bench_paged(args, rng) -> dict:
  pages = args.context // args.page_size
  context = pages * args.page_size
  q, k_pages, v_pages, table = decode_inputs(args, rng, args.batch, pages)
  lengths = jnp.full((args.batch,), context, jnp.int32)
  inputs = (q, k_pages, v_pages, table, lengths)
  kernel = jax.jit(kernels.paged_attention)
  reference = jax.jit(kernels.paged_attention_reference)
  result = {"batch": args.batch, "context": context, "page_size": args.page_size,
            "kernel_ms": median_ms(kernel, *inputs, runs=args.runs, warmup=args.warmup),
            "reference_ms": median_ms(reference, *inputs, runs=args.runs, warmup=args.warmup),
            "max_abs_err": max_abs_err(kernel(*inputs), reference(*inputs))}
  kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * q.dtype.itemsize
  return result | bandwidth(kv_bytes + 2 * q.nbytes, result["kernel_ms"])


def rope_prep(args, rng, batch):
  """(QKPrep, PrepOperands): RoPE at random positions, applied in the decode kernels to
  the queries and new keys they read, as the engine's decode step has them do."""
  from jaxrl_post.kernels.qk_prep import PrepOperands, QKPrep
  angles = rng.integers(0, 8192, (batch, 1)) * 500000.0 ** (
      -np.arange(args.head_dim // 2) / (args.head_dim // 2))
  return QKPrep(), PrepOperands(jnp.asarray(np.cos(angles), jnp.float32),
                                jnp.asarray(np.sin(angles), jnp.float32))


def bench_append(args, rng) -> dict:
  """The GPU decode step's attention: the new token's K/V written inside the kernel
  (kernels.paged_append), against the scatter then paged_attention it replaces, both
  updating donated pools in place as the engine's step does; and the kernel rotating the
  queries and new keys itself (RoPE in the kernel, `kernel_with_rope_ms`), as the engine
  calls it."""
  from jaxrl_post.kernels.paged_append import (paged_attention_append,
                                               paged_attention_append_reference)
  pages = args.context // args.page_size
  context = pages * args.page_size
  q, k_pages, v_pages, table = decode_inputs(args, rng, args.batch, pages)
  new = jnp.asarray(rng.standard_normal((args.batch, 2 * args.kv_heads, args.head_dim),
                                        np.float32), q.dtype)
  qkv = jnp.concatenate([q, new], axis=1)
  lengths = jnp.full((args.batch,), context, jnp.int32)
  page, slot = table[:, -1], jnp.full((args.batch,), (context - 1) % args.page_size, jnp.int32)
  want = jax.jit(paged_attention_append_reference)(qkv, k_pages, v_pages, table, lengths,
                                                   page, slot)[0]

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def separate(k_pages, v_pages):
    kv = jnp.swapaxes(new, 0, 1)  # [2 Hkv, B, D]
    k_pages = k_pages.at[:, page, slot].set(kv[:args.kv_heads])
    v_pages = v_pages.at[:, page, slot].set(kv[args.kv_heads:])
    return kernels.paged_attention(q, k_pages, v_pages, table, lengths), k_pages, v_pages

  fused = jax.jit(paged_attention_append, donate_argnums=(1, 2), static_argnames="prep")
  prep, ops = rope_prep(args, rng, args.batch)
  want_rope = jax.jit(paged_attention_append_reference, static_argnames="prep")(
      qkv, k_pages, v_pages, table, lengths, page, slot, prep=prep, prep_ops=ops)[0]
  pools = {"fused": [k_pages, v_pages], "separate": [jnp.copy(k_pages), jnp.copy(v_pages)],
           "rope": [jnp.copy(k_pages), jnp.copy(v_pages)]}

  def run(name):  # Each call takes the pools the previous one returned.
    if name == "fused":
      out, _, *pools[name] = fused(qkv, *pools[name], table, lengths, page, slot)
    elif name == "rope":
      out, _, *pools[name] = fused(qkv, *pools[name], table, lengths, page, slot, prep=prep,
                                   prep_ops=ops)
    else:
      out, *pools[name] = separate(*pools[name])
    return out

  fused_ms = median_ms(run, "fused", runs=args.runs, warmup=args.warmup)
  separate_ms = median_ms(run, "separate", runs=args.runs, warmup=args.warmup)
  result = {"batch": args.batch, "context": context, "page_size": args.page_size,
            "kernel_ms": fused_ms, "write_then_attend_ms": separate_ms,
            "kernel_with_rope_ms": median_ms(run, "rope", runs=args.runs, warmup=args.warmup),
            "max_abs_err": max_abs_err(run("fused"), want),
            "max_abs_err_with_rope": max_abs_err(run("rope"), want_rope)}
  kv_bytes = 2 * args.batch * (context + 1) * args.kv_heads * args.head_dim * q.dtype.itemsize
  return result | bandwidth(kv_bytes + 2 * qkv.nbytes, fused_ms)


def bench_prefill(args, rng) -> dict:
  """The engine's prefill of the last --chunk tokens of a --context-token prompt (its
  earlier pages written), packed into rows of 24 by the engine's packer, per --batch
  prompts; HBM traffic counts the K/V pages each row reads once per KV head."""
  from jaxrl_post.kernels.paged_prefill import needed_pages
  from jaxrl_post.rollout.prefill_pack import Chunk, pack
  dtype = DTYPES[args.dtype]
  pages = args.context // args.page_size
  chunk = min(args.chunk, pages * args.page_size)
  perm = rng.permutation(args.batch * pages).reshape(args.batch, pages)
  chunks = [Chunk(0, np.zeros(chunk, np.int32), pages * args.page_size - chunk, perm[b])
            for b in range(args.batch)]
  rows, _ = pack(chunks, shards=1, width=24, page_size=args.page_size)
  shape = (args.kv_heads, args.batch * pages, args.page_size, args.head_dim)
  k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                      for _ in range(2))
  q = jnp.asarray(rng.standard_normal((*rows.tokens.shape, args.heads, args.head_dim),
                                      np.float32), dtype)
  layout = tuple(jnp.asarray(x) for x in (rows.key_pages, rows.key_segments, rows.key_starts,
                                          rows.positions, rows.segments))
  inputs = (q, k_pages, v_pages, *layout)
  kernel = jax.jit(kernels.paged_prefill_attention)
  reference = jax.jit(kernels.paged_prefill_attention_reference)
  valid = np.asarray(rows.segments) >= 0
  err = float(np.abs(np.asarray(kernel(*inputs), np.float32)[valid] -
                     np.asarray(reference(*inputs), np.float32)[valid]).max())
  result = {"prompts": args.batch, "context": pages * args.page_size, "chunk": chunk,
            "rows": int(rows.tokens.shape[0]),
            "kernel_ms": median_ms(kernel, *inputs, runs=args.runs, warmup=args.warmup),
            "reference_ms": median_ms(reference, *inputs, runs=args.runs, warmup=args.warmup),
            "max_abs_err": err}
  read = int(np.asarray(needed_pages(*layout, args.page_size, None)[3]).sum())
  kv_bytes = 2 * read * args.page_size * args.kv_heads * args.head_dim * q.dtype.itemsize
  return result | bandwidth(kv_bytes + 2 * q.nbytes, result["kernel_ms"])


def cascade_inputs(args, rng):
  """A prompt of --context tokens shared by --samples samples, each with --suffix tokens:
  (groups, q, k_pages, v_pages, (prefix table, prefix lengths, suffix table, suffix
  lengths)) as cascade attention takes them."""
  groups = max(1, args.batch // args.samples)
  batch = groups * args.samples
  pre_pages, suf_pages = args.context // args.page_size, args.suffix // args.page_size
  pre_len, suf_len = pre_pages * args.page_size, suf_pages * args.page_size
  q, k_pages, v_pages, table = decode_inputs(args, rng, batch, pre_pages + suf_pages)
  prefix = table[::args.samples, :pre_pages]  # each group's first sequence owns the prompt
  tables = (prefix, jnp.full((groups,), pre_len, jnp.int32), table[:, pre_pages:],
            jnp.full((batch,), suf_len, jnp.int32))
  return groups, q, k_pages, v_pages, tables


def bench_cascade(args, rng) -> dict:
  """Prompt of --context tokens shared by --samples samples, each with --suffix tokens."""
  groups, q, k_pages, v_pages, tables = cascade_inputs(args, rng)
  batch, pre_len, suf_len = q.shape[0], int(tables[1][0]), int(tables[3][0])
  inputs = (q, k_pages, v_pages, *tables)
  kernel = jax.jit(kernels.cascade_attention)
  reference = jax.jit(kernels.cascade_attention_reference)
  flat_table = jnp.concatenate([jnp.repeat(tables[0], args.samples, axis=0), tables[2]], 1)
  flat_lengths = jnp.full((batch,), pre_len + suf_len, jnp.int32)
  flat = (q, k_pages, v_pages, flat_table, flat_lengths)
  paged = jax.jit(kernels.paged_attention)
  result = {"groups": groups, "samples": args.samples, "prefix": pre_len, "suffix": suf_len,
            "kernel_ms": median_ms(kernel, *inputs, runs=args.runs, warmup=args.warmup),
            "reference_ms": median_ms(reference, *inputs, runs=args.runs, warmup=args.warmup),
            "paged_same_inputs_ms": median_ms(paged, *flat, runs=args.runs, warmup=args.warmup),
            "max_abs_err": max_abs_err(kernel(*inputs), reference(*inputs))}
  row = args.kv_heads * args.head_dim * q.dtype.itemsize * 2
  kv_bytes = row * (groups * pre_len + batch * suf_len)
  return result | bandwidth(kv_bytes + 2 * q.nbytes, result["kernel_ms"])


def bench_cascade_append(args, rng) -> dict:
  """The GPU engine's cascade decode attention: the block prefix's kernel
  (paged_attention_block_parts) and the suffix kernel that writes the new K/V and folds
  the prefix's parts in (paged_attention_append with prior=), as
  rollout.attention.cascade_decode_append calls them, against kernels.cascade_attention
  (which neither writes nor reads the queries in place). Shapes as bench_cascade."""
  from jaxrl_post.kernels.paged_append import paged_attention_append
  from jaxrl_post.kernels.paged_attention import (PagedAttentionConfig,
                                                  paged_attention_block_parts)
  groups, q, k_pages, v_pages, tables = cascade_inputs(args, rng)
  prefix, pre_lengths, suffix, suf_lengths = tables  # the new token at suf_len - 1
  batch, pre_len, suf_len = q.shape[0], int(pre_lengths[0]), int(suf_lengths[0])
  new = jnp.asarray(rng.standard_normal((batch, 2 * args.kv_heads, args.head_dim),
                                        np.float32), q.dtype)
  qkv = jnp.concatenate([q, new], axis=1)
  page = suffix[:, -1]
  slot = jnp.full((batch,), (suf_len - 1) % args.page_size, jnp.int32)
  config = PagedAttentionConfig()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def engine(k_pages, v_pages):
    prior = paged_attention_block_parts(qkv, k_pages, v_pages, prefix, pre_lengths, config)
    out, _, k_pages, v_pages = paged_attention_append(
        qkv, k_pages, v_pages, suffix, suf_lengths, page, slot, config=config, prior=prior)
    return out, k_pages, v_pages

  kv = jnp.swapaxes(new, 0, 1)  # [2 Hkv, B, D]
  written = (k_pages.at[:, page, slot].set(kv[:args.kv_heads]),
             v_pages.at[:, page, slot].set(kv[args.kv_heads:]))
  want = jax.jit(kernels.cascade_attention_reference)(q, *written, *tables)
  cascade = jax.jit(kernels.cascade_attention)
  pools = [jnp.copy(k_pages), jnp.copy(v_pages)]

  def run():  # Each call takes the pools the previous one returned.
    out, *pools[:] = engine(*pools)
    return out

  result = {"groups": groups, "samples": args.samples, "prefix": pre_len, "suffix": suf_len,
            "kernel_ms": median_ms(run, runs=args.runs, warmup=args.warmup),
            "cascade_attention_ms": median_ms(cascade, q, *written, *tables, runs=args.runs,
                                              warmup=args.warmup),
            "max_abs_err": max_abs_err(run(), want)}
  row = args.kv_heads * args.head_dim * q.dtype.itemsize * 2
  kv_bytes = row * (groups * pre_len + batch * suf_len)
  return result | bandwidth(kv_bytes + 2 * qkv.nbytes, result["kernel_ms"])


# ----------------------------------------------------------------------------- training


def packed_row(rng, t):  # [t] segment ids: sequences of t/8..t/2 tokens, padded tail
  ends = np.cumsum(rng.integers(t // 8, t // 2, size=8))
  seg = np.searchsorted(ends, np.arange(t), side="right") + 1
  return np.where(np.arange(t) < t - t // 16, seg, 0)


def bench_packed(args, rng) -> dict:
  """One row per batch entry packed with sequences of random lengths (and some padding)."""
  dtype = DTYPES[args.dtype]
  b, t = args.packed_batch, args.seq
  draw = lambda h: jnp.asarray(rng.standard_normal((b, t, h, args.head_dim), np.float32), dtype)
  q, k, v = draw(args.heads), draw(args.kv_heads), draw(args.kv_heads)
  seg = jnp.asarray(np.stack([packed_row(rng, t) for _ in range(b)]), jnp.int32)
  weights = draw(args.heads)

  def value_and_grad(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  fwd, ref = jax.jit(kernels.packed_attention), jax.jit(kernels.packed_attention_reference)
  train, ref_train = value_and_grad(kernels.packed_attention), value_and_grad(
      kernels.packed_attention_reference)
  time_it = functools.partial(median_ms, runs=args.runs, warmup=args.warmup)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]  # errors against float32 gradients
  return {"batch": b, "seq": t,
          "fwd_kernel_ms": time_it(fwd, q, k, v, seg),
          "fwd_reference_ms": time_it(ref, q, k, v, seg),
          "fwd_bwd_kernel_ms": time_it(train, q, k, v),
          "fwd_bwd_reference_ms": time_it(ref_train, q, k, v),
          "max_abs_err": max_abs_err(fwd(q, k, v, seg), ref(q, k, v, seg)),
          "max_abs_grad_err": max_abs_err(train(q, k, v)[1], ref_train(*f32)[1])}


def logprob_step(fn):
  """value_and_grad of a loss using both outputs, as the policy loss does."""
  def loss(hidden, lm_head, targets, cot):
    logprob, entropy = fn(hidden, lm_head, targets, 1.0)
    return jnp.sum(logprob * cot[0] + entropy * cot[1])
  return jax.value_and_grad(loss, argnums=(0, 1))


def bench_logprob(args, rng) -> dict:
  dtype = DTYPES[args.dtype]
  t, d, v = args.tokens, args.dim, args.vocab
  hidden = jnp.asarray(rng.standard_normal((t, d), np.float32), dtype)
  lm_head = jnp.asarray(rng.standard_normal((d, v), np.float32) / np.sqrt(d), dtype)
  targets = jnp.asarray(rng.integers(0, v, size=t), jnp.int32)
  cot = jnp.asarray(rng.standard_normal((2, t), np.float32))
  inputs = (hidden, lm_head, targets, cot)
  chunked = jax.jit(logprob_step(kernels.chunked_logprob))
  dense = jax.jit(logprob_step(kernels.chunked_logprob_reference))
  time_it = functools.partial(median_ms, runs=args.runs, warmup=args.warmup)
  values = (jax.jit(kernels.chunked_logprob)(hidden, lm_head, targets),
            jax.jit(kernels.chunked_logprob_reference)(hidden, lm_head, targets))
  result = {"tokens": t, "vocab": v, "dim": d,
            "fwd_bwd_kernel_ms": time_it(chunked, *inputs),
            "fwd_bwd_dense_ms": time_it(dense, *inputs),
            "max_abs_err": max_abs_err(*values),
            "max_abs_grad_err": max_abs_err(chunked(*inputs)[1], dense(
                hidden.astype(jnp.float32), lm_head.astype(jnp.float32), targets, cot)[1])}
  result["dense_over_kernel_time"] = result["fwd_bwd_dense_ms"] / result["fwd_bwd_kernel_ms"]
  return result


def logprob_memory(args) -> dict:
  """XLA's temporary bytes of the dense vs chunked value-and-grad (compile only)."""
  dtype = DTYPES[args.dtype]
  t, d, v = args.mem_tokens, args.mem_dim, args.mem_vocab
  spec = (jax.ShapeDtypeStruct((t, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
          jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((2, t), jnp.float32))
  temp = lambda fn: (jax.jit(logprob_step(fn)).lower(*spec).compile()
                     .memory_analysis().temp_size_in_bytes)
  dense, chunked = temp(kernels.chunked_logprob_reference), temp(kernels.chunked_logprob)
  return {"tokens": t, "vocab": v, "dim": d, "dtype": args.dtype,
          "dense_temp_bytes": dense, "chunked_temp_bytes": chunked, "ratio": dense / chunked}


# ----------------------------------------------------------------------------- main


def parse_args():
  on_cpu = jax.default_backend() == "cpu"
  small = lambda cpu, accel: cpu if on_cpu else accel
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
  p.add_argument("--runs", type=int, default=small(3, 20))
  p.add_argument("--warmup", type=int, default=small(1, 3))
  p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2: 9)")
  p.add_argument("--kv-heads", type=int, default=3)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--batch", type=int, default=small(4, 64), help="decode sequences")
  p.add_argument("--context", type=int, default=small(256, 4096), help="decode tokens / prompt")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--chunk", type=int, default=small(64, 256), help="prefill tokens / prompt")
  p.add_argument("--samples", type=int, default=small(2, 8), help="cascade samples per prompt")
  p.add_argument("--suffix", type=int, default=small(64, 512), help="cascade private tokens")
  p.add_argument("--packed-batch", type=int, default=small(1, 8))
  p.add_argument("--seq", type=int, default=small(256, 4096), help="packed row length")
  p.add_argument("--tokens", type=int, default=small(512, 4096), help="logprob tokens")
  p.add_argument("--vocab", type=int, default=small(4096, 49152))
  p.add_argument("--dim", type=int, default=small(128, 576))
  p.add_argument("--mem-tokens", type=int, default=4096)
  p.add_argument("--mem-vocab", type=int, default=49152)
  p.add_argument("--mem-dim", type=int, default=576)
  return p.parse_args()


def main():
  args = parse_args()
  rng = np.random.default_rng(0)
  results = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
             "jax": jax.__version__, "dtype": args.dtype,
             "interpreted": jax.default_backend() == "cpu"}
  for name, bench in [("paged_attention", bench_paged), ("paged_append", bench_append),
                      ("paged_prefill", bench_prefill),
                      ("cascade_attention", bench_cascade),
                      ("cascade_append", bench_cascade_append),
                      ("packed_attention", bench_packed), ("chunked_logprob", bench_logprob)]:
    results[name] = bench(args, rng)
    if not args.json:
      print(name, json.dumps(results[name]), flush=True)
  memory = logprob_memory(args)
  results["chunked_logprob_memory"] = memory
  results["chunked_logprob_memory_ratio"] = memory["ratio"]
  results["max_abs_err"] = {k: results[k]["max_abs_err"] for k in
                            ("paged_attention", "paged_append", "paged_prefill",
                             "cascade_attention", "cascade_append",
                             "packed_attention", "chunked_logprob")}
  if args.json:
    print(json.dumps(results))
  else:
    print("chunked_logprob_memory", json.dumps(memory))


if __name__ == "__main__":
  main()

"""Paged prefill attention: packed rows of prompt chunks against their own pages.

A prefill call packs several prompts' chunks end to end into rows of T tokens (the
rollout engine's prefill_pack). Every token's K/V is already in the pool when attention
runs, so a query reads keys only through pages: for each row a list of key pages, each
page tagged with the chunk (segment) it belongs to and the position of its first token.
Query t sees key s iff both are in one segment, s is not after t, and, with a sliding
window, s is fewer than ``window`` positions before t. A padding query (negative segment)
sees nothing and gets 0.

Compared with gathering every row's pages into a dense [T, K * page_size] score matrix
(the plain-jnp path), the kernels read each page once per KV head for all the query heads
of its group and all the row's queries, keep only an online-softmax state, and -- because
the wrapper first moves the pages no query of the row can see (behind a sliding window)
to the end of the row's list and counts the rest -- read only the pages a window spans.

Layout and lowerings follow kernels.paged_attention (one pool [Hkv, P, ps, D]; the
query heads of a KV head stacked with the row's tokens into one [T * G, D] matrix):

* ``triton`` (GPU): grid (row, KV head, query block); each program walks the row's needed
  pages in power-of-two blocks of >= 16 keys, gathering them from the head's pool.
* ``mosaic`` (TPU): grid (row, KV head, query block, page block) with the page list, the
  pages' segments and first positions and the count in SMEM; the index maps DMA exactly
  the needed pages (steps past the count repeat the last page, which issues no new DMA,
  and skip their compute).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxrl_post.kernels.paged_attention import (
    MASK_VALUE, PagedAttentionConfig, _finish, _online_update, _pages_per_block, _scores,
    held_slot, resolve_backend)

_BLOCK_Q = 128  # Query rows (tokens x heads of a group) per program.
_SHARED_ROWS = 16384  # Triton: query rows (and keys) per block x head_dim, at most.


def _visible(q_pos, q_seg, k_pos, k_seg, window):
  """[M, 1] query and [1, N] (or [M, N]) key positions/segments -> [M, N] bool."""
  keep = (q_seg == k_seg) & (q_seg >= 0) & (k_pos <= q_pos)
  return keep if window is None else keep & (q_pos - k_pos < window)


def needed_pages(key_pages, key_segments, key_starts, positions, segments, page_size,
                 window):
  """The row's key pages some query of the row can see, first, and how many there are.

  Returns (pages, segments, starts) reordered per row (seen pages first, each group in
  its original order) and [R] int32 counts. Without a window every page of a segment in
  the row is seen; with one, the pages wholly behind every query's window are not.
  """
  seg_q = segments[:, :, None]  # [R, T, 1]
  pos_q = positions[:, :, None]
  start = key_starts[:, None, :]  # [R, 1, K]
  seen = (seg_q >= 0) & (seg_q == key_segments[:, None, :]) & (start <= pos_q)
  if window is not None:
    seen &= pos_q - (start + page_size - 1) < window
  seen = seen.any(axis=1)  # [R, K]
  order = jnp.argsort(~seen, axis=1, stable=True)
  take = lambda x: jnp.take_along_axis(x, order, axis=1)
  return (take(key_pages), take(key_segments), take(key_starts),
          seen.sum(axis=1).astype(jnp.int32))


def _cost(r, hkv, m, d, key_pages, page_size, itemsize):
  """Reads: K and V of every listed page once per (row, KV head), queries, f32 outputs."""
  keys = key_pages * page_size
  kv = 2 * r * hkv * keys * d * itemsize
  io = r * hkv * m * d * (itemsize + 4) + r * key_pages * 12
  return pl.CostEstimate(flops=4 * r * hkv * m * keys * d,
                         transcendentals=r * hkv * m * keys, bytes_accessed=kv + io)


# ----------------------------------------------------------------------------- GPU kernel


def _kernel_triton(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, pages_ref, kpos_ref, kseg_ref,
                   count_ref, o_ref, *, sm_scale, pages_per_block, window):
  """One (row, KV head, query block): q_ref [bq, D], k_ref/v_ref [P, ps, D], pages_ref [K],
  kpos_ref/kseg_ref [K * ps] the position and segment of every listed key."""
  page_size = k_ref.shape[1]
  q = q_ref[...]
  bq, d = q.shape
  q_pos, q_seg = qpos_ref[...][:, None], qseg_ref[...][:, None]
  block_kv = pages_per_block * page_size

  def body(j, carry):
    start = j * pages_per_block
    pages = pages_ref[pl.ds(start, pages_per_block)]
    k = k_ref[pages].reshape(block_kv, d)
    v = v_ref[pages].reshape(block_kv, d)
    k_pos = kpos_ref[pl.ds(start * page_size, block_kv)][None, :]
    k_seg = kseg_ref[pl.ds(start * page_size, block_kv)][None, :]
    s = jnp.where(_visible(q_pos, q_seg, k_pos, k_seg, window), _scores(q, k, sm_scale),
                  MASK_VALUE)
    return _online_update(s, v, *carry)

  init = (jnp.full((bq, 1), MASK_VALUE, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, d), jnp.float32))
  num_blocks = pl.cdiv(count_ref[0], pages_per_block)
  out, _ = _finish(*jax.lax.fori_loop(0, num_blocks, body, init))
  o_ref[...] = jnp.where(q_seg >= 0, out, 0.0)


def _call_triton(q, qpos, qseg, k_pages, v_pages, pages, kseg, kstart, count, sm_scale,
                 config, interpret, window):
  """q [R, Hkv, M, D] -> [R, Hkv, M, D] f32."""
  r, hkv, m, d = q.shape
  _, num_pages, page_size, _ = k_pages.shape
  for name, n in (("head_dim", d), ("page_size", page_size)):
    if n & (n - 1):
      raise ValueError(f"the triton prefill kernel needs a power-of-two {name}, got {n}")
  # Shared memory holds the query block and the pipelined K/V blocks: at head_dim 256,
  # 128 x 128 blocks ask for 321 KB of an H100's 227 KB, so both shrink as head_dim grows.
  rows = _SHARED_ROWS // d
  ppb = max(pl.next_power_of_2(_pages_per_block(min(config.block_kv, rows), page_size) + 1)
            // 2, pl.cdiv(16, page_size))
  bq = min(_BLOCK_Q, rows, max(16, pl.next_power_of_2(m)))
  mp, kp = pl.cdiv(m, bq) * bq, pl.cdiv(pages.shape[1], ppb) * ppb
  q = jnp.pad(q, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
  qpos = jnp.pad(qpos, ((0, 0), (0, mp - m)))
  qseg = jnp.pad(qseg, ((0, 0), (0, mp - m)), constant_values=-1)
  pad_k = ((0, 0), (0, kp - pages.shape[1]))
  pages = jnp.pad(pages, pad_k)
  kseg = jnp.repeat(jnp.pad(kseg, pad_k, constant_values=-1), page_size, axis=1)
  kpos = (jnp.pad(kstart, pad_k)[:, :, None] + jnp.arange(page_size)).reshape(r, -1)
  kernel = functools.partial(_kernel_triton, sm_scale=sm_scale, pages_per_block=ppb,
                             window=window)
  pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda i, h, b: (h, 0, 0, 0))
  row = lambda n: pl.BlockSpec((None, n), lambda i, h, b: (i, 0))
  out = pl.pallas_call(
      kernel,
      grid=(r, hkv, mp // bq),
      in_specs=[
          pl.BlockSpec((None, None, bq, d), lambda i, h, b: (i, h, b, 0)),
          pool_spec, pool_spec,
          pl.BlockSpec((None, bq), lambda i, h, b: (i, b)),
          pl.BlockSpec((None, bq), lambda i, h, b: (i, b)),
          row(kp), row(kp * page_size), row(kp * page_size),
          pl.BlockSpec((1,), lambda i, h, b: (i,)),
      ],
      out_specs=pl.BlockSpec((None, None, bq, d), lambda i, h, b: (i, h, b, 0)),
      out_shape=jax.ShapeDtypeStruct((r, hkv, mp, d), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      cost_estimate=_cost(r, hkv, mp, d, kp, page_size, k_pages.dtype.itemsize),
      name="paged_prefill_attention_triton",
  )(q, k_pages, v_pages, qpos, qseg, pages, kpos, kseg, count)
  return out[:, :, :m]


# ----------------------------------------------------------------------------- TPU kernel


def _kernel_mosaic(pages_ref, kseg_ref, kstart_ref, count_ref, q_ref, qpos_ref, qseg_ref,
                   *refs, sm_scale, pages_per_block, max_pages, window):
  """One (row, KV head, query block, page block) step: q_ref [bq, D], qpos/qseg [bq, 1],
  each K/V ref one page [ps, D]."""
  k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
  o_ref, m_sc, l_sc, acc_sc = refs[2 * pages_per_block:]
  row, i = pl.program_id(0), pl.program_id(3)
  count = count_ref[row]

  @pl.when(i == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(i * pages_per_block < count)
  def _step():
    q, q_pos, q_seg = q_ref[...], qpos_ref[...], qseg_ref[...]
    carry = (m_sc[...], l_sc[...], acc_sc[...])
    for j in range(pages_per_block):
      slot = i * pages_per_block + j
      at = row * max_pages + slot
      s = _scores(q, k_refs[j][...], sm_scale)  # [bq, ps]
      k_pos = kstart_ref[at] + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
      k_seg = jnp.where(slot < count, kseg_ref[at], -1)
      s = jnp.where(_visible(q_pos, q_seg, k_pos, k_seg, window), s, MASK_VALUE)
      carry = _online_update(s, v_refs[j][...], *carry)
    m_sc[...], l_sc[...], acc_sc[...] = carry

  @pl.when(i == pl.num_programs(3) - 1)
  def _write():
    out, _ = _finish(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[...] = jnp.where(qseg_ref[...] >= 0, out, 0.0)


def _page_index_map(j, pages_per_block, max_pages):
  def index_map(r, h, b, i, pages_ref, kseg_ref, kstart_ref, count_ref):
    slot = held_slot(i, j, pages_per_block, jnp.maximum(count_ref[r] - 1, 0))
    return h, pages_ref[r * max_pages + slot], 0, 0
  return index_map


def _call_mosaic(q, qpos, qseg, k_pages, v_pages, pages, kseg, kstart, count, sm_scale,
                 config, interpret, window):
  """q [R, Hkv, M, D] -> [R, Hkv, M, D] f32."""
  r, hkv, m, d = q.shape
  page_size = k_pages.shape[2]
  ppb = _pages_per_block(config.block_kv, page_size)
  bq = min(_BLOCK_Q, pl.cdiv(m, 8) * 8)
  mp, kp = pl.cdiv(m, bq) * bq, pl.cdiv(pages.shape[1], ppb) * ppb
  q = jnp.pad(q, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
  qpos = jnp.pad(qpos, ((0, 0), (0, mp - m)))[..., None]
  qseg = jnp.pad(qseg, ((0, 0), (0, mp - m)), constant_values=-1)[..., None]
  pad_k = ((0, 0), (0, kp - pages.shape[1]))
  flat = lambda x, fill=0: jnp.pad(x, pad_k, constant_values=fill).reshape(-1)
  page_specs = [pl.BlockSpec((None, None, page_size, d), _page_index_map(j, ppb, kp))
                for j in range(ppb)]
  q_spec = pl.BlockSpec((None, None, bq, d), lambda r_, h, b, i, *_: (r_, h, b, 0))
  tok_spec = pl.BlockSpec((None, bq, 1), lambda r_, h, b, i, *_: (r_, b, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(r, hkv, mp // bq, kp // ppb),
      in_specs=[q_spec, tok_spec, tok_spec, *page_specs, *page_specs],
      out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                      pltpu.VMEM((bq, d), jnp.float32)],
  )
  kernel = functools.partial(_kernel_mosaic, sm_scale=sm_scale, pages_per_block=ppb,
                             max_pages=kp, window=window)
  out = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((r, hkv, mp, d), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      cost_estimate=_cost(r, hkv, mp, d, kp, page_size, k_pages.dtype.itemsize),
      name="paged_prefill_attention_mosaic",
  )(flat(pages), flat(kseg, -1), flat(kstart), count, q, qpos, qseg,
    *([k_pages] * ppb), *([v_pages] * ppb))
  return out[:, :, :m]


# ----------------------------------------------------------------------------- public API


def _check(q, k_pages, v_pages, key_pages, key_segments, key_starts, positions, segments):
  r, t, hq, d = q.shape
  hkv, _, _, dk = k_pages.shape
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
  if dk != d or hq % hkv:
    raise ValueError(f"q {q.shape} does not fit k_pages {k_pages.shape}")
  for name, x, want in (("key_segments", key_segments, key_pages.shape),
                        ("key_starts", key_starts, key_pages.shape),
                        ("positions", positions, (r, t)), ("segments", segments, (r, t))):
    if x.shape != want or key_pages.shape[0] != r:
      raise ValueError(f"{name} {x.shape} does not fit q {q.shape} / key_pages "
                       f"{key_pages.shape}")


@functools.partial(jax.jit, static_argnames=("config", "window"))
def paged_prefill_attention(q, k_pages, v_pages, key_pages, key_segments, key_starts,
                            positions, segments, *, config=PagedAttentionConfig(),
                            window=None):
  """Packed prompt chunks' queries against their segments' pages (module docstring).

  Args:
    q: [R, T, Hq, D] queries of the rows' tokens.
    k_pages, v_pages: [Hkv, num_pages, page_size, D] pools; Hq is a multiple of Hkv.
    key_pages: [R, K] int32 each row's key pages (ids are clipped into the pool).
    key_segments: [R, K] int32 the segment of each key page (negative: unused).
    key_starts: [R, K] int32 position of each key page's first token.
    positions, segments: [R, T] int32 of the queries (negative segment: padding).
    config: static tunables (block_kv, backend, interpret, Triton warps and stages;
      num_splits is a decode setting and unused here).
    window: static sliding window (keys at least this many positions back are masked).

  Returns:
    [R, T, Hq, D] in q's dtype; padding queries give 0.
  """
  _check(q, k_pages, v_pages, key_pages, key_segments, key_starts, positions, segments)
  r, t, hq, d = q.shape
  hkv, num_pages, page_size, _ = k_pages.shape
  g = hq // hkv
  backend, interpret = resolve_backend(config.backend, config.interpret)
  call = _call_triton if backend == "triton" else _call_mosaic
  pages, kseg, kstart, count = needed_pages(
      jnp.clip(key_pages.astype(jnp.int32), 0, num_pages - 1), key_segments.astype(jnp.int32),
      key_starts.astype(jnp.int32), positions, segments, page_size, window)
  # [R, T, Hkv, G, D] -> [R, Hkv, T * G, D]: a KV head's query heads and tokens together.
  qg = q.astype(k_pages.dtype).reshape(r, t, hkv, g, d).transpose(0, 2, 1, 3, 4)
  qg = qg.reshape(r, hkv, t * g, d)
  tokens = lambda x: jnp.repeat(x.astype(jnp.int32), g, axis=1)  # [R, T * G]
  out = call(qg, tokens(positions), tokens(segments), k_pages, v_pages, pages, kseg, kstart,
             count, 1.0 / math.sqrt(d), config, interpret, window)
  out = out.reshape(r, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(r, t, hq, d)
  return out.astype(q.dtype)


# ----------------------------------------------------------------------------- reference


def paged_prefill_attention_reference(q, k_pages, v_pages, key_pages, key_segments,
                                      key_starts, positions, segments, window=None):
  """float32 [R, T, Hq, D]: every row's pages gathered densely, masked, plain softmax."""
  r, t, hq, d = q.shape
  hkv, num_pages, page_size, _ = k_pages.shape
  ids = jnp.clip(key_pages, 0, num_pages - 1)
  dense = lambda pool: pool[:, ids].astype(jnp.float32).reshape(hkv, r, -1, d)  # [Hkv,R,S,D]
  k, v = dense(k_pages), dense(v_pages)
  k_pos = (key_starts[:, :, None] + jnp.arange(page_size)).reshape(r, 1, -1)  # [R, 1, S]
  k_seg = jnp.repeat(key_segments, page_size, axis=1)[:, None, :]
  valid = _visible(positions[:, :, None], segments[:, :, None], k_pos, k_seg, window)
  qg = q.astype(jnp.float32).reshape(r, t, hkv, hq // hkv, d)
  scores = jnp.einsum("rthgd,hrsd->rthgs", qg, k,
                      precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
  mask = valid[:, :, None, None, :]
  scores = jnp.where(mask, scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1, keepdims=True)
  probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
  out = jnp.einsum("rthgs,hrsd->rthgd", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(r, t, hq, d)

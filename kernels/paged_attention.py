"""Paged decode attention: one query token per sequence against a paged KV pool.

Pool layout: ``k_pages``/``v_pages`` are ``[Hkv, num_pages, page_size, D]``. One KV head's
pages are contiguous, so the unit a kernel reads -- one page of one head -- is a dense
``(page_size, D)`` tile: a single DMA on TPU and one coalesced 2-D load on GPU. Putting the
head axis first (rather than ``[num_pages, page_size, Hkv, D]``) also means a kernel program
that owns one KV head never touches the bytes of the other heads, and a page id means the
same thing for every head, so one page table serves the whole layer. The rollout engine
writes new tokens with a scatter on ``(page, slot)``, which this layout keeps cheap.

GQA is handled by grouping: the ``Hq // Hkv`` query heads that share a KV head are one
``[G, D]`` matrix, so every K/V byte is read once per sequence and used by all heads of its
group (decode is bandwidth-bound; this is what makes GQA decode cheap).

Two kernels, one per lowering, both written as pallas_call and run in interpret mode on CPU:

* ``triton`` (GPU): Triton has no scalar prefetch, so the page-table row is an ordinary
  input and pages are gathered inside the kernel (``k_ref[pages]``) from the head's whole
  pool. The grid is ``(B, Hkv, splits)``: the context is split into ``splits`` partitions
  (flash-decoding) so that small batches still fill the GPU, and the partial results are
  merged by log-sum-exp afterwards. A program's query block is a power of two >= 16 rows
  (Triton's block shapes must be powers of two and ``tl.dot`` needs 16 rows), loaded and
  stored under a mask past the group's queries, so q needs no padding nor the output a slice.
* ``mosaic`` (TPU): ``PrefetchScalarGridSpec`` puts the page table and lengths in SMEM, and
  the K/V BlockSpec index maps read them, so the Pallas pipeline DMAs exactly the pages a
  step needs (double-buffered). A step covers ``pages_per_block`` pages by passing the pool
  that many times with consecutive page slots. Steps past a sequence's length clamp to its
  last page (no new DMA is issued for a repeated block index) and skip their compute.

Both return the attention output and its log-sum-exp, so partial attentions over disjoint
key sets (context splits, or the shared prefix and private suffix of cascade attention)
merge exactly with :func:`merge_attention_parts`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxrl_post.kernels import qk_prep
from jaxrl_post.kernels.platform import kernel_platform
from jaxrl_post.kernels.qk_prep import prepared_rows, scale_halves

# Large finite negative for masked scores: exp() of it underflows to exactly 0 without
# producing inf - inf = NaN in the running-max update.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BACKENDS = ("triton", "mosaic")


def _dot_precision(dtype):
  """f32 inputs get IEEE f32 dots (Triton otherwise uses TF32); bf16 uses the MXU/TC."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _scores(q, k, sm_scale):  # [M, D], [N, D] -> [M, N] f32
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          precision=_dot_precision(q.dtype),
                          preferred_element_type=jnp.float32)
  return s * sm_scale


def _weighted_values(p, v):  # [M, N] f32, [N, D] -> [M, D] f32
  return jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=_dot_precision(v.dtype),
                             preferred_element_type=jnp.float32)


def _online_update(s, v, m, l, acc):
  """One flash-attention step: fold scores s [M, N] and values v [N, D] into (m, l, acc)."""
  m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))  # [M, 1]
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new)  # [M, N]
  l_new = alpha * l + p.sum(axis=-1, keepdims=True)
  acc_new = alpha * acc + _weighted_values(p, v)
  return m_new, l_new, acc_new


def _finish(m, l, acc):
  """Normalised output and log-sum-exp; an empty key set gives (0, -inf)."""
  nonempty = l > 0
  out = acc / jnp.where(nonempty, l, 1.0)
  lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
  return out, lse


def merge_attention_parts(outs, lses):  # [N, ..., D] f32, [N, ...] f32 -> [..., D], [...]
  """Exact merge of attentions over disjoint key sets by their log-sum-exps.

  Each part i is softmax attention over its own keys, ``outs[i]``, with normaliser
  ``exp(lses[i])``. The union's attention is the lse-weighted mean of the parts. Parts with
  no keys carry ``lse = -inf`` and drop out; if every part is empty the result is (0, -inf).
  """
  m = lses.max(axis=0)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lses - m_safe)  # [N, ...]
  denom = w.sum(axis=0)
  nonempty = denom > 0
  out = (w[..., None] * outs).sum(axis=0) / jnp.where(nonempty, denom, 1.0)[..., None]
  lse = jnp.where(nonempty, m_safe + jnp.log(jnp.where(nonempty, denom, 1.0)), -jnp.inf)
  return out, lse


# ----------------------------------------------------------------------------- GPU kernel


def _visible(pos, length, window):
  """Keys a query at position length - 1 sees: before it, and with a sliding window not
  more than `window` positions back."""
  valid = pos < length
  return valid if window is None else valid & (pos >= length - window)


def _fold_pages(q, k_ref, v_ref, pt_ref, carry, first, num_blocks, pages_per_block,
                sm_scale, visible):
  """Online softmax of q [Gp, D] over `num_blocks` blocks of the table's pages from page
  `first` on, keys at positions where visible(pos) holds, folded into carry (m, l, acc)."""
  page_size, d = k_ref.shape[1], q.shape[1]
  block_kv = pages_per_block * page_size

  def body(j, carry):
    start = first + j * pages_per_block
    pages = pt_ref[pl.ds(start, pages_per_block)]  # [ppb]
    k = k_ref[pages].reshape(block_kv, d)  # [bk, D]
    v = v_ref[pages].reshape(block_kv, d)
    s = _scores(q, k, sm_scale)  # [Gp, bk]
    pos = start * page_size + jnp.arange(block_kv, dtype=jnp.int32)  # [bk]
    s = jnp.where(visible(pos)[None, :], s, MASK_VALUE)
    return _online_update(s, v, *carry)

  return jax.lax.fori_loop(0, num_blocks, body, carry)


def _split_pages(split, keys, page_size, pages_per_split, pages_per_block):
  """(first page, page blocks) of context split `split` over a table holding `keys` keys:
  the split's pages that hold any, in blocks of pages_per_block."""
  first = split * pages_per_split
  end = jnp.minimum(first + pages_per_split, pl.cdiv(keys, page_size))
  return first, pl.cdiv(jnp.maximum(end - first, 0), pages_per_block)


def _empty_carry(rows, d):
  return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))


def _paged_kernel_triton(q_ref, k_ref, v_ref, pt_ref, len_ref, o_ref, lse_ref, *,
                         sm_scale, pages_per_block, pages_per_split, groups, window=None):
  """One (sequence, KV head, context split): q_ref [Gp, D] of which the first `groups`
  rows are queries (the rest masked), k_ref/v_ref [P, ps, D]."""
  page_size = k_ref.shape[1]
  length = len_ref[0]
  first, num_blocks = _split_pages(pl.program_id(2), length, page_size, pages_per_split,
                                   pages_per_block)
  gp, d = q_ref.shape
  rows = jnp.arange(gp) < groups
  q = pltriton.load(q_ref, mask=rows[:, None], other=0)
  carry = _fold_pages(q, k_ref, v_ref, pt_ref, _empty_carry(gp, d), first, num_blocks,
                      pages_per_block, sm_scale, lambda pos: _visible(pos, length, window))
  out, lse = _finish(*carry)
  pltriton.store(o_ref, out, mask=rows[:, None])
  pltriton.store(lse_ref, lse.reshape(gp), mask=rows)


def _split_plan(batch, hkv, max_pages, pages_per_block, num_splits):
  """Static (splits, pages_per_split) with pages_per_split a multiple of the page block."""
  blocks = pl.cdiv(max_pages, pages_per_block)
  if num_splits is None:  # Aim for >= 256 programs (about two waves on an H100).
    num_splits = pl.next_power_of_2(pl.cdiv(256, batch * hkv))
  num_splits = max(1, min(num_splits, blocks))
  return num_splits, pl.cdiv(blocks, num_splits) * pages_per_block


def _cost(q, k_pages, table_pages):
  """What a call reads and computes when every row uses its whole page table: K and V of
  each row's pages once per KV head, the queries, the f32 outputs. The engine narrows the
  table to the pages in use, so this is the step's attention traffic, which XLA's cost
  model (and so jaxrl_post.plan) would otherwise take to be the whole pool per call."""
  b, hkv, g, d = q.shape
  tokens = table_pages * k_pages.shape[2]
  kv = 2 * b * hkv * tokens * d * k_pages.dtype.itemsize
  io = q.size * q.dtype.itemsize + b * hkv * g * (d + 1) * 4 + b * table_pages * 4
  return pl.CostEstimate(flops=4 * b * hkv * g * tokens * d,
                         transcendentals=b * hkv * g * tokens, bytes_accessed=kv + io)


def triton_blocks(q_shape, pool_shape, table_pages, config):
  """(pages per block, splits, pages per split, query rows per program) of a Triton call
  with q [B, Hkv, G, D] on a pool [Hkv, P, ps, D]; refuses shapes it has no kernel for."""
  b, hkv, g, d = q_shape
  page_size = pool_shape[2]
  for name, n in (("head_dim", d), ("page_size", page_size)):
    if n & (n - 1):  # Padding the pool per call would copy all of it: refuse instead.
      raise ValueError(f"the triton paged kernel needs a power-of-two {name}, got {n}")
  if d < 16:
    raise ValueError(f"the triton paged kernel needs head_dim >= 16 (tl.dot), got {d}")
  # Power-of-two page blocks of >= 16 keys: Triton block shapes and tl.dot's minimum.
  ppb = max(pl.next_power_of_2(_pages_per_block(config.block_kv, page_size) + 1) // 2,
            pl.cdiv(16, page_size))
  splits, pps = _split_plan(b, hkv, table_pages, ppb, config.num_splits)
  return ppb, splits, pps, max(16, pl.next_power_of_2(g))


def _paged_call_triton(q, k_pages, v_pages, page_table, lengths, sm_scale, config,
                       interpret, window=None):
  """q [B, Hkv, G, D] -> out [B, Hkv, G, D] f32, lse [B, Hkv, G] f32."""
  b, hkv, g, d = q.shape
  _, num_pages, page_size, _ = k_pages.shape
  ppb, splits, pps, gp = triton_blocks(q.shape, k_pages.shape, page_table.shape[1], config)
  page_table = jnp.pad(page_table, ((0, 0), (0, splits * pps - page_table.shape[1])))
  kernel = functools.partial(_paged_kernel_triton, sm_scale=sm_scale,
                             pages_per_block=ppb, pages_per_split=pps, groups=g,
                             window=window)
  pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda i, h, s: (h, 0, 0, 0))
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, hkv, splits),
      in_specs=[
          pl.BlockSpec((None, None, gp, d), lambda i, h, s: (i, h, 0, 0)),
          pool_spec, pool_spec,
          pl.BlockSpec((None, splits * pps), lambda i, h, s: (i, 0)),
          pl.BlockSpec((1,), lambda i, h, s: (i,)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, gp, d), lambda i, h, s: (s, i, h, 0, 0)),
          pl.BlockSpec((None, None, None, gp), lambda i, h, s: (s, i, h, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((splits, b, hkv, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((splits, b, hkv, g), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      cost_estimate=_cost(q, k_pages, page_table.shape[1]),
      name="paged_attention_triton",
  )(q, k_pages, v_pages, page_table, lengths)
  # One split (enough sequences to fill the GPU) is the answer itself: no merge pass.
  return (out[0], lse[0]) if splits == 1 else merge_attention_parts(out, lse)


# ----------------------------------------------------------------------------- TPU kernel


def _paged_kernel_mosaic(pt_ref, len_ref, q_ref, *refs, sm_scale, pages_per_block,
                        window=None):
  """One (sequence, KV head, page block) grid step; q_ref [G, D], each K/V ref [ps, D]."""
  k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
  o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[2 * pages_per_block:]
  b, i = pl.program_id(0), pl.program_id(2)
  page_size = k_refs[0].shape[0]
  length = len_ref[b]

  @pl.when(i == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(i * pages_per_block * page_size < length)
  def _step():
    q = q_ref[...]  # [G, D]
    carry = (m_sc[...], l_sc[...], acc_sc[...])
    for j in range(pages_per_block):
      s = _scores(q, k_refs[j][...], sm_scale)  # [G, ps]
      first = (i * pages_per_block + j) * page_size
      pos = first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(_visible(pos, length, window), s, MASK_VALUE)
      carry = _online_update(s, v_refs[j][...], *carry)
    m_sc[...], l_sc[...], acc_sc[...] = carry

  @pl.when(i == pl.num_programs(2) - 1)
  def _write():
    out, lse = _finish(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[...] = out
    lse_ref[...] = lse


def held_slot(i, j, pages_per_block, last):
  """The page-table slot that page input j of page block i reads, for a row whose last
  page is slot `last`. Pallas copies an input's block in only when its index differs from
  the step before, so past the row's end each input keeps the page it already holds: in
  the block with the last page, the inputs beyond it keep the previous block's pages, and
  every later block repeats that one. A row's pages are then each read once (a row of
  fewer pages than a block reads its last page again in the spare inputs); the kernels
  mask keys by position, so what a spare input holds is never used."""
  tail = jnp.minimum(i, last // pages_per_block)
  slot = tail * pages_per_block + j
  before = jnp.where(tail > 0, slot - pages_per_block, last)
  return jnp.where(slot <= last, slot, before)


def _page_index_map(j, pages_per_block, page_size, max_pages):
  """Index map for page input j of a step: held_slot of the row's table."""
  def index_map(b, h, i, pt_ref, len_ref):
    last = jnp.maximum((len_ref[b] + page_size - 1) // page_size - 1, 0)
    return h, pt_ref[b * max_pages + held_slot(i, j, pages_per_block, last)], 0, 0
  return index_map


def _paged_call_mosaic(q, k_pages, v_pages, page_table, lengths, sm_scale, config,
                       interpret, window=None):
  """q [B, Hkv, G, D] -> out [B, Hkv, G, D] f32, lse [B, Hkv, G] f32."""
  b, hkv, g, d = q.shape
  _, _, page_size, _ = k_pages.shape
  ppb = _pages_per_block(config.block_kv, page_size)
  max_pages = pl.cdiv(page_table.shape[1], ppb) * ppb
  page_table = jnp.pad(page_table, ((0, 0), (0, max_pages - page_table.shape[1])))
  page_specs = [pl.BlockSpec((None, None, page_size, d),
                             _page_index_map(j, ppb, page_size, max_pages))
                for j in range(ppb)]
  q_spec = pl.BlockSpec((None, None, g, d), lambda i, h, s, *_: (i, h, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, hkv, max_pages // ppb),
      in_specs=[q_spec, *page_specs, *page_specs],
      out_specs=[q_spec, pl.BlockSpec((None, None, g, 1), lambda i, h, s, *_: (i, h, 0, 0))],
      scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                      pltpu.VMEM((g, d), jnp.float32)],
  )
  kernel = functools.partial(_paged_kernel_mosaic, sm_scale=sm_scale, pages_per_block=ppb,
                             window=window)
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, hkv, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, g, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      cost_estimate=_cost(q, k_pages, max_pages),
      name="paged_attention_mosaic",
  )(page_table.reshape(-1), lengths, q, *([k_pages] * ppb), *([v_pages] * ppb))
  return out, lse[..., 0]


# ----------------------------------------------------------------------------- public API


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
  """Tunables of the paged decode kernels (static: a change recompiles).

  Attributes:
    block_kv: keys per inner step, rounded down to whole pages (at least one page). GPU:
      one Triton loop iteration loads this many keys, rounded to a power-of-two number of
      pages and at least 16 keys (tl.dot's minimum). TPU: one grid step DMAs this many.
    num_splits: GPU context partitions per sequence (flash-decoding); None picks enough
      to give about 256 programs. Ignored on TPU, whose grid walks the context serially.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth.
    backend: "triton" or "mosaic"; None picks by the platform traced for (TPU -> mosaic,
      otherwise triton, which the CPU runs in interpret mode; see kernels.platform).
    interpret: run the Pallas interpreter; None means "only on CPU".
  """
  block_kv: int = 128
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  backend: str | None = None
  interpret: bool | None = None


def _pages_per_block(block_kv, page_size):
  return max(1, block_kv // page_size)


def resolve_backend(backend, interpret):
  """(backend, interpret) for this call: TPU -> mosaic, GPU -> triton, CPU -> interpreter,
  by the platform the call is traced for (kernels.platform), not the host's."""
  platform = kernel_platform()
  if backend is None:
    backend = "mosaic" if platform == "tpu" else "triton"
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if interpret is None:
    interpret = platform == "cpu"
  return backend, interpret


def kernel_supports(head_dim: int, page_size: int, backend: str | None = None) -> bool:
  """Whether the decode kernel for the traced-for platform takes pools of this shape.

  Triton's needs power-of-two head_dim and page_size and head_dim >= 16 (tl.dot); it pads
  neither, since padding the pool would copy all of it per call. Mosaic's blocks are whole
  pages, any shape. Callers route other shapes to the plain-jnp path (rollout.attention).
  """
  backend, _ = resolve_backend(backend, None)
  if backend == "mosaic":
    return True
  power_of_two = lambda n: n > 0 and not n & (n - 1)
  return power_of_two(head_dim) and power_of_two(page_size) and head_dim >= 16


def _check_inputs(q, k_pages, v_pages, page_table, lengths):
  b, hq, d = q.shape
  hkv, _, _, dk = k_pages.shape
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
  if dk != d or hq % hkv:
    raise ValueError(f"q {q.shape} does not fit k_pages {k_pages.shape}")
  if page_table.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"page_table {page_table.shape} / lengths {lengths.shape} vs B={b}")


def paged_attention_parts(q, k_pages, v_pages, page_table, lengths, config, window=None):
  """Un-jitted core: ([B, Hq, D] f32 output, [B, Hq] f32 log-sum-exp).

  Kept separate so cascade attention can merge float32 parts before rounding.
  """
  _check_inputs(q, k_pages, v_pages, page_table, lengths)
  b, hq, d = q.shape
  hkv, num_pages = k_pages.shape[:2]
  backend, interpret = resolve_backend(config.backend, config.interpret)
  call = _paged_call_triton if backend == "triton" else _paged_call_mosaic
  # Entries past a sequence's length may still be read inside its last block: clamp them
  # into the pool so a stale or sentinel id can never address memory outside it.
  page_table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
  # A length past the table's capacity would index past the table: clip it there.
  capacity = page_table.shape[1] * k_pages.shape[2]
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
  qg = q.reshape(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
  out, lse = call(qg, k_pages, v_pages, page_table, lengths, 1.0 / math.sqrt(d), config,
                  interpret, window)
  return out.reshape(b, hq, d), lse.reshape(b, hq)


def _block_kernel_triton(qkv_ref, k_ref, v_ref, pt_ref, len_ref, *refs, sm_scale,
                         pages_per_block, pages_per_split, rows, groups, prep=None):
  """One (block of rows, KV head, context split) of cascade's shared prefix: qkv_ref
  [Rp, Hq + 2 Hkv, D] the block's rows (the first `rows` real), of which the head's
  `groups` queries of each row are read and attended as one [Rp * Gp, D] matrix. With
  `prep`, refs start with the rows' RoPE tables [Rp, D/2] x2 and the q norm's scale [D]
  (and the k norm's, unused), and the queries are normed and rotated as they are read."""
  *prep_refs, o_ref, lse_ref = refs
  page_size = k_ref.shape[1]
  length = len_ref[0]
  first, num_blocks = _split_pages(pl.program_id(2), length, page_size, pages_per_split,
                                   pages_per_block)
  rp, gp, d = o_ref.shape
  real = (jnp.arange(rp) < rows)[:, None] & (jnp.arange(gp) < groups)[None, :]
  cols = lambda c: qkv_ref.at[:, pl.ds(pl.program_id(1) * groups, gp), c]
  if prep is None:
    q = pltriton.load(cols(slice(None)), mask=real[:, :, None], other=0).reshape(rp * gp, d)
  else:
    half, live = d // 2, (jnp.arange(rp) < rows)[:, None]
    per_query = lambda t: jnp.broadcast_to(
        pltriton.load(t, mask=live, other=0)[:, None, :], (rp, gp, half)).reshape(-1, half)
    scale = None if prep.norm_eps is None else scale_halves(prep, prep_refs[2], half)
    q = prepared_rows(
        lambda c: pltriton.load(cols(c), mask=real[:, :, None], other=0).reshape(-1, half),
        d, per_query(prep_refs[0]), per_query(prep_refs[1]), scale, prep.norm_eps,
        qkv_ref.dtype)
  carry = _fold_pages(q, k_ref, v_ref, pt_ref, _empty_carry(rp * gp, d), first, num_blocks,
                      pages_per_block, sm_scale, lambda pos: pos < length)
  out, lse = _finish(*carry)
  pltriton.store(o_ref, out.reshape(rp, gp, d), mask=real[:, :, None])
  pltriton.store(lse_ref, lse.reshape(rp, gp), mask=real)


def paged_attention_block_parts(qkv, k_pages, v_pages, block_table, block_lengths, config,
                                prep=None, prep_ops=None):
  """Cascade decode's shared prefix on a GPU: each block of R = B / Gb rows attends to its
  block's pages, which are read once per block and KV head for all its rows' queries.

  qkv [B, Hq + 2 Hkv, D]: each row's queries, then its new keys and values, as
  kernels.paged_append takes them (one array for both kernels: the queries are not
  copied out of it); rows of a block are consecutive. block_table [Gb, M], block_lengths
  [Gb].
  Returns each context split's parts unmerged, per row: out [S, B, Hkv, G, D] f32 and lse
  [S, B, Hkv, G] f32 (G = Hq / Hkv; empty parts (0, -inf)), for a kernel that folds them
  into its own softmax (kernels.paged_append's `prior`). The queries are read where the
  rows hold them (no grouped copy is made); Triton needs power-of-two blocks, so R
  and G are padded to powers of two under a mask, at least 16 query rows a program.
  prep, prep_ops: as in kernels.paged_append (the queries normed and rotated as read).
  """
  b, heads, d = qkv.shape
  hkv, num_pages, page_size, dk = k_pages.shape
  blocks, hq = block_table.shape[0], heads - 2 * hkv
  if k_pages.shape != v_pages.shape or dk != d or hq <= 0 or hq % hkv:
    raise ValueError(f"qkv {qkv.shape} (Hq + 2 Hkv heads) does not fit pools "
                     f"{k_pages.shape} / {v_pages.shape}")
  if b % blocks or block_lengths.shape != (blocks,):
    raise ValueError(f"{b} rows do not make blocks of block_table {block_table.shape} / "
                     f"block_lengths {block_lengths.shape}")
  if prep is not None:
    qk_prep.check(prep, prep_ops, b, d)
  backend, interpret = resolve_backend(config.backend, config.interpret)
  if backend != "triton":
    raise ValueError(f"the block prefix kernel is a Triton kernel, not {backend!r}")
  r, g = b // blocks, hq // hkv
  rp = pl.next_power_of_2(r)
  gp = max(pl.next_power_of_2(g), pl.cdiv(16, rp))
  ppb, splits, pps, _ = triton_blocks((blocks, hkv, r * g, d), k_pages.shape,
                                      block_table.shape[1], config)
  table = jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1)
  table = jnp.pad(table, ((0, 0), (0, splits * pps - table.shape[1])))
  lengths = jnp.clip(block_lengths.astype(jnp.int32), 0, block_table.shape[1] * page_size)
  kernel = functools.partial(_block_kernel_triton, sm_scale=1.0 / math.sqrt(d),
                             pages_per_block=ppb, pages_per_split=pps, rows=r, groups=g,
                             prep=prep)
  by_block = lambda t: t.reshape(blocks, r, *t.shape[1:])  # the rows' tables, per block
  prep_specs, prep_args = qk_prep.block_specs(
      prep, prep_ops and prep_ops._replace(cos=by_block(prep_ops.cos),
                                           sin=by_block(prep_ops.sin)),
      d, (None, rp), lambda i, h, s: (i, 0, 0))
  pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda i, h, s: (h, 0, 0, 0))
  out, lse = pl.pallas_call(
      kernel,
      grid=(blocks, hkv, splits),
      in_specs=[pl.BlockSpec((None, rp, heads, d), lambda i, h, s: (i, 0, 0, 0)),
                pool_spec, pool_spec,
                pl.BlockSpec((None, splits * pps), lambda i, h, s: (i, 0)),
                pl.BlockSpec((1,), lambda i, h, s: (i,)), *prep_specs],
      out_specs=[
          pl.BlockSpec((None, None, rp, None, gp, d), lambda i, h, s: (s, i, 0, h, 0, 0)),
          pl.BlockSpec((None, None, rp, None, gp), lambda i, h, s: (s, i, 0, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((splits, blocks, r, hkv, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((splits, blocks, r, hkv, g), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      cost_estimate=_cost(jax.ShapeDtypeStruct((blocks, hkv, r * g, d), qkv.dtype),
                          k_pages, table.shape[1]),
      name="paged_attention_blocks_triton",
  )(qkv.reshape(blocks, r, heads, d), k_pages, v_pages, table, lengths, *prep_args)
  return out.reshape(splits, b, hkv, g, d), lse.reshape(splits, b, hkv, g)


@functools.partial(jax.jit, static_argnames=("config", "window"))
def paged_attention_with_lse(q, k_pages, v_pages, page_table, lengths, *,
                             config=PagedAttentionConfig(), window=None):
  """Paged decode attention that also returns the log-sum-exp of the scaled scores.

  Args:
    q: [B, Hq, D] one query token per sequence.
    k_pages: [Hkv, num_pages, page_size, D] key pool; Hq is a multiple of Hkv.
    v_pages: [Hkv, num_pages, page_size, D] value pool.
    page_table: [B, max_pages] int32 page ids; token t of sequence b lives at
      page ``page_table[b, t // page_size]``, slot ``t % page_size``. Pages may be shared.
    lengths: [B] int32 number of valid tokens, at most max_pages * page_size (0 gives a
      zero output and lse = -inf).
    config: static tunables.
    window: static sliding window: keys more than this many positions before the query
      (at position length - 1) are masked. A caller passes the table from the window's
      first page on (and lengths counted from it), so the kernel reads only those pages.

  Returns:
    ([B, Hq, D] in q's dtype, [B, Hq] float32 log-sum-exp).
  """
  out, lse = paged_attention_parts(q, k_pages, v_pages, page_table, lengths, config, window)
  return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("config", "window"))
def paged_attention(q, k_pages, v_pages, page_table, lengths, *,
                    config=PagedAttentionConfig(), window=None):
  """Paged decode attention, [B, Hq, D] in q's dtype; see paged_attention_with_lse."""
  out, _ = paged_attention_parts(q, k_pages, v_pages, page_table, lengths, config, window)
  return out.astype(q.dtype)


# ----------------------------------------------------------------------------- reference


def gather_pages(pages, page_table):  # [Hkv, P, ps, D], [B, M] -> [B, M * ps, Hkv, D]
  """Dense per-sequence K or V from the pool (what the kernels avoid materialising).

  Ids are clipped into the pool: slots past a sequence's length may hold any sentinel.
  """
  hkv, num_pages, page_size, d = pages.shape
  b, m = page_table.shape
  dense = pages[:, jnp.clip(page_table, 0, num_pages - 1)]  # [Hkv, B, M, ps, D]
  return dense.reshape(hkv, b, m * page_size, d).transpose(1, 2, 0, 3)


def masked_decode_attention_reference(q, k, v, valid):
  """float32 masked GQA softmax and its log-sum-exp.

  Args:
    q: [B, Hq, D] queries.
    k: [B, S, Hkv, D] keys.
    v: [B, S, Hkv, D] values.
    valid: [B, S] True for keys the query may attend to.

  Returns:
    ([B, Hq, D] float32, [B, Hq] float32); a row with no valid key gives (0, -inf).
  """
  b, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
  scores = jnp.einsum("bkgd,bskd->bkgs", qg, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
  valid = valid[:, None, None, :]
  scores = jnp.where(valid, scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)  # [B, Hkv, G]
  probs = jnp.where(valid, jnp.exp(scores - lse[..., None]), 0.0)
  out = jnp.einsum("bkgs,bskd->bkgd", probs, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, hq, d), lse.reshape(b, hq)


def paged_attention_with_lse_reference(q, k_pages, v_pages, page_table, lengths,
                                       window=None):
  """float32 reference: gather pages densely, mask by length (and window), plain softmax."""
  k = gather_pages(k_pages, page_table)  # [B, S, Hkv, D]
  v = gather_pages(v_pages, page_table)
  pos = jnp.arange(k.shape[1])[None, :]
  valid = pos < lengths[:, None]  # [B, S]
  if window is not None:
    valid &= pos >= lengths[:, None] - window
  return masked_decode_attention_reference(q, k, v, valid)


def paged_attention_reference(q, k_pages, v_pages, page_table, lengths, window=None):
  """float32 [B, Hq, D] reference output of paged_attention."""
  return paged_attention_with_lse_reference(q, k_pages, v_pages, page_table, lengths,
                                            window)[0]

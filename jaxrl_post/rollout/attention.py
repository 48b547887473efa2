"""Attention against the paged KV pool: the decode step and the prefill chunk.

The pool holds every layer: ``[Hkv, L, num_pages, page_size, D]`` per K and V. The
functions take the whole pool plus a layer index rather than one layer's slice: inside the
scanned layer loop a slice ``pool[:, layer]`` would be a copy of that layer's pool per step.
Reshaped to ``[Hkv, L * num_pages, page_size, D]`` (free: the layout is contiguous) it is
exactly the pool layout of jaxrl_post.kernels.paged_attention, with layer l's page p at
``l * num_pages + p``, so the decode kernel reads it directly.

Decode runs the Pallas kernel on GPU and TPU and the plain-jnp path (gather the sequence's
pages, mask by length, float32 softmax) on the CPU, where Pallas only interprets, and for
soft-capped scores and pool shapes the GPU kernel does not take
(`kernels.paged_attention.kernel_supports`). A sliding-window layer reads only the pages
its window spans, on either path: the kernel gets the table from the window's first page
on and masks the keys before the window in it. Prefill takes the same split: on GPU/TPU
kernels.paged_prefill reads each row's pages once per KV head (a sliding layer only the
pages some query's window spans), on the CPU the jnp path gathers them.

On a GPU the decode step's K/V write runs inside the attention kernel
(`paged_decode_append`, `cascade_decode_append`: kernels.paged_append), so a layer's
attention is one launch rather than two scatters and the kernel; a TPU writes with
kernels.kv_write and a CPU with a scatter, then attend. Those kernels can also norm and
rotate q and k as they read them (their `prep`; rollout.forward.prepares_in_kernel).

Cascade decode (`cascade_decode_attention`) is the same split for blocks of slots that
decode samples of one prompt: the block's shared prompt pages are read once for all its
rows, each row's own pages once, and the two partial attentions merge by log-sum-exp. On
a TPU it is jaxrl_post.kernels.cascade_attention on the stacked pool; on a GPU the prefix
kernel hands its parts to the suffix kernel that also writes the K/V
(`cascade_decode_append`); on the CPU the jnp path does the same split with the kernels'
own query grouping and merge.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxrl_post.kernels import cascade_attention, paged_attention
from jaxrl_post.kernels.cascade_attention import group_queries, ungroup_queries
from jaxrl_post.kernels.paged_append import paged_attention_append_parts
from jaxrl_post.kernels.paged_attention import (PagedAttentionConfig, kernel_supports,
                                                merge_attention_parts,
                                                paged_attention_block_parts)
from jaxrl_post.kernels.paged_prefill import paged_prefill_attention as paged_prefill
from jaxrl_post.models import layers as L
from jaxrl_post.rollout.pages import cdiv
from jaxrl_post.sharding import on_accelerator, target_platform


class SharedPrefix(NamedTuple):
  """The prompt pages each block of slots shares, for cascade decode attention.

  Block g is rows g*K .. g*K + K - 1 of the decode batch (K = B // G). Only whole pages are
  shared: a prompt's partial last page is copied per sample, so it starts the sample's own
  pages and the shared part is contiguous with them.
  """

  table: jax.Array  # [G, Mp] int32 the block's shared prompt pages, in token order
  lengths: jax.Array  # [G] int32 tokens in them (a multiple of page_size; 0 for none)


def use_kernel_default(k_pool=None) -> bool:
  """Kernels where the traced-for devices are accelerators (the engine traces attention
  inside shard_map over its mesh, whose devices say; see sharding.platform) and the
  kernel takes the pool's shape (a head_dim of 8, or 80, has no Triton kernel: such a
  model decodes on the jnp path rather than failing to compile)."""
  if not on_accelerator():
    return False
  return k_pool is None or kernel_supports(k_pool.shape[-1], k_pool.shape[-2])


def gather_pages(pool, layer, page_table):  # [Hkv, L, P, ps, D], [], [B, M] -> [B, M*ps, Hkv, D]
  """Dense keys (or values) of each row's pages, in token order, in the model's layout."""
  pages = pool[:, layer, page_table]  # [Hkv, B, M, ps, D]
  hkv, b, m, ps, d = pages.shape
  return pages.transpose(1, 2, 3, 0, 4).reshape(b, m * ps, hkv, d)


def _flat(pool, layer):  # [Hkv, L, P, ps, D] -> ([Hkv, L*P, ps, D], page id offset of `layer`)
  """The stacked pool as one kernel pool (a free reshape) and where `layer`'s pages start."""
  hkv, n_layers, n_pages, ps, d = pool.shape
  return pool.reshape(hkv, n_layers * n_pages, ps, d), layer * n_pages


def _kernel_decode(q, k_pool, v_pool, layer, page_table, lengths, sliding_window=None):
  (k, offset), (v, _) = _flat(k_pool, layer), _flat(v_pool, layer)
  if sliding_window is not None:  # The window's pages only, positions counted from them.
    page_table, first = _window_pages(page_table, lengths, sliding_window, k_pool.shape[3])
    lengths = lengths - first * k_pool.shape[3]
  return paged_attention(q, k, v, page_table + offset, lengths, window=sliding_window)


def appends_in_kernel(k_pool, logit_cap=None) -> bool:
  """Whether the decode step's K/V write runs inside the attention kernel
  (`paged_decode_append`): on a GPU, whose Triton kernel takes the pool's shape, without
  score soft-capping. A TPU writes with kernels.kv_write and a CPU with a scatter."""
  return target_platform() == "gpu" and use_kernel_default(k_pool) and logit_cap is None


def side_by_side(q, k, v):  # [B, Hq, D], [B, Hkv, D] x2 -> [B, Hq + 2 Hkv, D]
  """q, k and v as the append kernels take them: one array, which XLA builds in the same
  fusion as their RoPE."""
  return jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)], axis=1)


def paged_decode_append(qkv, k_pool, v_pool, layer, pages, slots, page_table, lengths,
                        sliding_window=None, prep=None, prep_ops=None):
  """Writes each row's new K/V at (pages, slots) of `layer` and attends over its tokens,
  the new one included, in one kernel (kernels.paged_append): the decode step's write and
  `paged_decode_attention` without the scatters' launches.

  qkv [B, Hq + 2 Hkv, D] (`side_by_side`; with prep, a kernels.qk_prep.QKPrep, and its
  operands, q and k before their norms and RoPE, which the kernel applies); pages, slots
  [B] int32 (page 0, the sink, for rows whose output is unused); lengths [B] with the new
  token. Returns (attn [B, Hq, D] in qkv's dtype, k_pool, v_pool).
  """
  (kf, offset), (vf, _) = _flat(k_pool, layer), _flat(v_pool, layer)
  if sliding_window is not None:
    page_table, first = _window_pages(page_table, lengths, sliding_window, k_pool.shape[3])
    lengths = lengths - first * k_pool.shape[3]
  out, _, kf, vf = paged_attention_append_parts(
      qkv, kf, vf, page_table + offset, lengths, pages + offset, slots,
      PagedAttentionConfig(), sliding_window, out_dtype=qkv.dtype, prep=prep,
      prep_ops=prep_ops)
  return out, kf.reshape(k_pool.shape), vf.reshape(v_pool.shape)


def _window(mask, q_pos, k_pos, sliding_window):
  if sliding_window is None:
    return mask
  return mask & ((q_pos[..., :, None] - k_pos[..., None, :]) < sliding_window)


def paged_decode_attention(q, k_pool, v_pool, layer, page_table, lengths, sliding_window=None,
                           use_kernel: Optional[bool] = None,
                           logit_cap: Optional[float] = None):
  """One query token per sequence against its pages: the decode step's attention.

  Args:
    q: [B, Hq, D] the query of the token at position ``lengths - 1``.
    k_pool: [Hkv, L, num_pages, page_size, D] keys of every layer.
    v_pool: [Hkv, L, num_pages, page_size, D] values.
    layer: scalar int, the layer whose pages to read.
    page_table: [B, M] int32; token t of row b lives in page ``page_table[b, t // page_size]``.
      Entries past a row's length may name any page (they are masked).
    lengths: [B] int32 valid tokens per row, the query's own included (>= 1).
    sliding_window: static; keys older than this many positions are masked (Mistral).
    use_kernel: static; the Pallas kernel (interpreted on a CPU) instead of plain jnp.
      None: the kernel on GPU/TPU when there is no soft-capping.
    logit_cap: static soft-capping of the scores (attn_logit_softcapping), or None.

  Returns:
    [B, Hq, D] in q's dtype.
  """
  if use_kernel is None:
    use_kernel = use_kernel_default(k_pool) and logit_cap is None
  if use_kernel:
    if logit_cap is not None:
      raise ValueError("the paged attention kernel has no soft-capping")
    return _kernel_decode(q, k_pool, v_pool, layer, page_table, lengths, sliding_window)
  ps = k_pool.shape[3]
  first = jnp.zeros((1,), jnp.int32)  # Page index of each row's first gathered page.
  if sliding_window is not None:
    page_table, first = _window_pages(page_table, lengths, sliding_window, ps)
  k_pos = first[:, None] * ps + jnp.arange(page_table.shape[1] * ps)[None, :]  # [B or 1, S]
  valid = _window((k_pos < lengths[:, None])[:, None], (lengths - 1)[:, None], k_pos,
                  sliding_window)[:, 0]  # [B, S]
  out, _ = _head_major_attention(q, k_pool, v_pool, layer, page_table, valid, logit_cap)
  return out.astype(q.dtype)


def _window_pages(page_table, lengths, sliding_window: int, page_size: int):
  """([B, n] the pages a windowed query can see, [B] the index of the first in the table).

  The query at position lengths - 1 sees keys from lengths - window on: at most
  cdiv(window - 1, page_size) + 1 pages. Gathering only those keeps a sliding layer's
  decode read at the window's size instead of the sequence's, and never touches pages a
  sequence gave back behind its window.
  """
  m = page_table.shape[1]
  n = min(-(-(sliding_window - 1) // page_size) + 1, m)
  first = jnp.clip((lengths - sliding_window) // page_size, 0, m - n)  # [B]
  index = first[:, None] + jnp.arange(n)[None, :]
  return jnp.take_along_axis(page_table, index, axis=1), first


def _head_major_pages(pool, layer, page_table):  # -> [Hkv, B, M * ps, D]
  """Each row's pages of `layer` in token order, kept head-major as the pool stores them:
  one gather from the pool seen as [Hkv, L * P, ps, D] (a free reshape), no transpose."""
  hkv, n_layers, n_pages, ps, d = pool.shape
  flat = pool.reshape(hkv, n_layers * n_pages, ps, d)
  pages = jnp.take(flat, page_table + layer * n_pages, axis=1)  # [Hkv, B, M, ps, D]
  return pages.reshape(hkv, page_table.shape[0], -1, d)


# Most bytes of gathered float32 keys and values one pass of the CPU path holds (see
# _head_major_attention).
CPU_GATHER_BYTES = 4 << 20


def _head_major_attention(q, k_pool, v_pool, layer, page_table, valid, logit_cap=None):
  """q [N, H, D] against each row's pages of `layer`, float32, with the log-sum-exp.

  On a CPU the rows run in chunks whose gathered keys and values fit CPU_GATHER_BYTES: a
  chunk's pages are still in cache when the two products read them, where a whole decode
  batch's (20 MB a layer at 320 rows) went out to memory and back twice. At 300 rows of
  80 keys (30 layers, 3 KV heads of 64) that cut a step's attention from about 520 to 350
  ms. An accelerator runs the rows at once (its decode takes the kernels; this path is
  their fallback).

  Returns ([N, H, D] float32, [N, H] float32); a row with no valid key gives (0, -inf).
  """
  n = q.shape[0]
  hkv, _, _, ps, d = k_pool.shape
  row_bytes = 2 * hkv * page_table.shape[1] * ps * d * 4
  chunks = cdiv(n, max(1, CPU_GATHER_BYTES // row_bytes))
  if chunks == 1 or on_accelerator():
    return _head_major_rows(q, k_pool, v_pool, layer, page_table, valid, logit_cap)
  rows = cdiv(n, chunks)
  # Padding rows have no valid key: (0, -inf), cut off below.
  pad = lambda x: jnp.pad(x, [(0, chunks * rows - n)] + [(0, 0)] * (x.ndim - 1))
  split = lambda x: pad(x).reshape(chunks, rows, *x.shape[1:])
  out, lse = jax.lax.map(
      lambda c: _head_major_rows(c[0], k_pool, v_pool, layer, c[1], c[2], logit_cap),
      (split(q), split(page_table), split(valid)))
  return out.reshape(-1, *out.shape[2:])[:n], lse.reshape(-1, *lse.shape[2:])[:n]


def _head_major_rows(q, k_pool, v_pool, layer, page_table, valid, logit_cap=None):
  """_head_major_attention on all rows at once.

  valid: [N, S] the keys each row may attend to (S = the table's pages x page size).
  Few queries per KV head (a decode step's) make the scores and the weighted sum
  matrix-vector products: they run as multiply-and-sum fusions over the gathered
  head-major keys and values, read once, instead of transposing them into [N, S, H, D]
  for a batched matmul (most of a decode step's attention time on a CPU).
  """
  n, h, d = q.shape
  hkv = k_pool.shape[0]
  k = _head_major_pages(k_pool, layer, page_table).astype(jnp.float32)  # [Hkv, N, S, D]
  v = _head_major_pages(v_pool, layer, page_table).astype(jnp.float32)
  qg = q.reshape(n, hkv, h // hkv, d).transpose(1, 0, 2, 3).astype(jnp.float32)
  scores = jnp.sum(qg[:, :, :, None, :] * k[:, :, None], axis=-1) / math.sqrt(d)
  scores = L.softcap(scores, logit_cap)
  valid = valid[None, :, None, :]  # [1, N, 1, S]
  scores = jnp.where(valid, scores, -jnp.inf)  # [Hkv, N, G, S]
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.where(valid, jnp.exp(scores - lse[..., None]), 0.0)
  out = jnp.sum(probs[..., None] * v[:, :, None], axis=-2)  # [Hkv, N, G, D]
  ungroup = lambda x: jnp.moveaxis(x, 0, 1).reshape(n, h, *x.shape[3:])
  return ungroup(out), ungroup(lse)


def paged_prefill_attention(q, k_pool, v_pool, layer, key_pages, key_segments, key_starts,
                            positions, segments, sliding_window=None, logit_cap=None,
                            use_kernel: Optional[bool] = None):
  """Packed prompt chunks' queries against their own segments' pages (the chunk's own K/V
  included): a query sees a key iff both belong to one segment and the key's position is
  not after the query's (rollout.prefill_pack lays the rows out).

  Args:
    q: [B, T, Hq, D] queries of the rows' tokens.
    k_pool: [Hkv, L, num_pages, page_size, D].
    v_pool: [Hkv, L, num_pages, page_size, D].
    layer: scalar int.
    key_pages: [B, K] int32 each row's key pages.
    key_segments: [B, K] int32 the segment of each key page (negative: none).
    key_starts: [B, K] int32 position of each key page's first token.
    positions: [B, T] int32 positions of the queries.
    segments: [B, T] int32 segment of each query (negative: padding, sees nothing).
    sliding_window: static, as in paged_decode_attention.
    logit_cap: static, as in paged_decode_attention.
    use_kernel: static; kernels.paged_prefill (interpreted on a CPU) instead of plain jnp.
      None: the kernel on GPU/TPU when there is no soft-capping.

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  if use_kernel is None:
    use_kernel = use_kernel_default(k_pool) and logit_cap is None
  if use_kernel:
    if logit_cap is not None:
      raise ValueError("the paged prefill kernel has no soft-capping")
    (k, offset), (v, _) = _flat(k_pool, layer), _flat(v_pool, layer)
    return paged_prefill(q, k, v, key_pages + offset, key_segments, key_starts, positions,
                         segments, window=sliding_window)
  ps = k_pool.shape[3]
  k = gather_pages(k_pool, layer, key_pages).astype(q.dtype)  # [B, K*ps, Hkv, D]
  v = gather_pages(v_pool, layer, key_pages).astype(q.dtype)
  k_pos = (key_starts[:, :, None] + jnp.arange(ps)[None, None, :]).reshape(q.shape[0], -1)
  k_seg = jnp.repeat(key_segments, ps, axis=1)  # [B, K*ps]
  mask = ((k_seg[:, None, :] == segments[:, :, None]) & (segments[:, :, None] >= 0) &
          (k_pos[:, None, :] <= positions[:, :, None]))  # [B, T, K*ps]
  return L.attention(q, k, v, _window(mask, positions, k_pos, sliding_window), logit_cap)


def _masked_part(q, k_pool, v_pool, layer, page_table, lengths):
  """Attention of q [N, H, D] over each row's first `lengths` tokens of its pages, with
  its log-sum-exp for the merge; an empty row gives (0, -inf)."""
  valid = jnp.arange(page_table.shape[1] * k_pool.shape[3])[None, :] < lengths[:, None]
  return _head_major_attention(q, k_pool, v_pool, layer, page_table, valid)


def _jnp_cascade(q, k_pool, v_pool, layer, shared, suffix_table, suffix_lengths):
  """cascade_attention in plain jnp: prefix keys gathered once per block, suffix per row."""
  hq = q.shape[1]
  groups, hkv = shared.table.shape[0], k_pool.shape[0]
  # A block's K queries stacked per KV head: one [K * Hq/Hkv, D] query group reads the
  # block's prefix keys once, as the kernel does.
  qg = group_queries(q, groups, hkv)  # [G, Hkv * K * Hq/Hkv, D]
  pre_out, pre_lse = _masked_part(qg, k_pool, v_pool, layer, shared.table, shared.lengths)
  pre_out = ungroup_queries(pre_out, groups, hkv, hq)  # [B, Hq, D]
  pre_lse = ungroup_queries(pre_lse, groups, hkv, hq)  # [B, Hq]
  suf_out, suf_lse = _masked_part(q, k_pool, v_pool, layer, suffix_table, suffix_lengths)
  out, _ = merge_attention_parts(jnp.stack([pre_out, suf_out]), jnp.stack([pre_lse, suf_lse]))
  return out.astype(q.dtype)


def _kernel_cascade(q, k_pool, v_pool, layer, shared, suffix_table, suffix_lengths):
  (k, offset), (v, _) = _flat(k_pool, layer), _flat(v_pool, layer)
  return cascade_attention(q, k, v, shared.table + offset, shared.lengths,
                           suffix_table + offset, suffix_lengths)


def cascade_decode_append(qkv, k_pool, v_pool, layer, pages, slots, shared: SharedPrefix,
                          suffix_table, suffix_lengths, prep=None, prep_ops=None):
  """cascade_decode_attention with the new K/V written by its suffix part's kernel
  (kernels.paged_append), as paged_decode_append does for plain decode: the block's
  prompt pages, which no row writes, are read first (kernels.paged_attention's
  paged_attention_block_parts), then each row's own pages and its new token. qkv, prep
  and prep_ops as in paged_decode_append. Returns (attn [B, Hq, D] in qkv's dtype,
  k_pool, v_pool)."""
  (kf, offset), (vf, _) = _flat(k_pool, layer), _flat(v_pool, layer)
  config = PagedAttentionConfig()
  # Both kernels read the queries from the one q/k/v array, and the prefix kernel's
  # context splits go to the suffix kernel unmerged: it folds them into its own softmax,
  # so the two kernels are the layer's whole attention.
  prior = paged_attention_block_parts(qkv, kf, vf, shared.table + offset, shared.lengths,
                                      config, prep, prep_ops)
  out, _, kf, vf = paged_attention_append_parts(
      qkv, kf, vf, suffix_table + offset, suffix_lengths, pages + offset, slots, config,
      out_dtype=qkv.dtype, prior=prior, prep=prep, prep_ops=prep_ops)
  return out, kf.reshape(k_pool.shape), vf.reshape(v_pool.shape)


def cascade_decode_attention(q, k_pool, v_pool, layer, shared: SharedPrefix, suffix_table,
                             suffix_lengths, use_kernel: Optional[bool] = None):
  """Decode attention for blocks of samples of one prompt: shared pages read once per block.

  Row b's keys are its block's shared prefix (``shared.lengths[b // K]`` tokens) followed by
  its own pages. Rows with nothing to attend to (a suffix length of 0 in a block whose
  prefix length is 0: free slots) get a zero output, never NaN.

  Args:
    q: [B, Hq, D] the query of each row's newest token; B = G * K.
    k_pool: [Hkv, L, num_pages, page_size, D] keys of every layer.
    v_pool: [Hkv, L, num_pages, page_size, D] values.
    layer: scalar int, the layer whose pages to read.
    shared: per block, the shared prefix pages and their token count.
    suffix_table: [B, Ms] int32 each row's pages after its block's prefix.
    suffix_lengths: [B] int32 valid tokens in them, the query's own included.
    use_kernel: static; kernels.cascade_attention (interpreted on a CPU) instead of plain
      jnp. None: the kernel on GPU/TPU.

  Returns:
    [B, Hq, D] in q's dtype.
  """
  if use_kernel is None:
    use_kernel = use_kernel_default(k_pool)
  attend = _kernel_cascade if use_kernel else _jnp_cascade
  return attend(q, k_pool, v_pool, layer, shared, suffix_table, suffix_lengths)

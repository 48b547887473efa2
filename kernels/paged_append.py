"""Paged decode attention that also appends the new token's keys and values (GPU).

A decode step writes each sequence's new K/V into its page and then attends over all its
tokens, itself included. Done as a scatter and then the paged kernel, that is three launches
per layer (K, V, attention), and on a GPU a decode step at RL batch sizes is made of its
launches as much as of its bytes. Here one Triton kernel does all three: the program that
owns (sequence, KV head, split 0) stores the new K/V row into the aliased pool, and every
program attends over the pool's keys *before* the new one, the new key and value entering
split 0's online softmax from registers. No program reads what another writes in the same
call (the new position is masked in the pool), so there is no race, and the result is the
write followed by paged attention, the order of summation aside.

Query rows are loaded and stored under a mask, as the plain kernel's are, so neither q nor
the output is padded to Triton's 16 rows. Given a kernels.qk_prep.QKPrep, the kernel also
norms (Qwen3's q/k norm) and rotates (RoPE) the queries and the new key as it reads them,
so the layer's Q/K/V product feeds it directly.

Pool layout and page tables as in :mod:`paged_attention`. Runs in interpret mode on CPU;
TPU writes with kernels.kv_write and attends with the Mosaic kernel instead.

kernel -> pallas_call wrapper -> jitted API -> float32 reference at the bottom.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_post.kernels import qk_prep
from jaxrl_post.kernels.qk_prep import prepared_rows, scale_halves
from jaxrl_post.kernels.paged_attention import (
    MASK_VALUE, PagedAttentionConfig, _cost, _empty_carry, _finish, _fold_pages,
    _split_pages, _visible, merge_attention_parts, paged_attention_with_lse_reference,
    resolve_backend, triton_blocks)


def _fold_new(q, kn, vn, carry, sm_scale, mine):
  """Folds the new key/value [D] into (m, l, acc) of q [Gp, D] where `mine` (split 0)."""
  m, l, acc = carry
  s = jnp.sum(q.astype(jnp.float32) * kn.astype(jnp.float32)[None, :], axis=1,
              keepdims=True) * sm_scale  # [Gp, 1]
  m_new = jnp.where(mine, jnp.maximum(m, s), m)
  alpha = jnp.exp(m - m_new)
  p = jnp.where(mine, jnp.exp(s - m_new), 0.0)
  return m_new, alpha * l + p, alpha * acc + p * vn.astype(jnp.float32)[None, :]


def _prior_carry(out_ref, lse_ref, gp, rows):
  """(m, l, acc) of gp query rows (`rows` real) given attention parts over other keys
  (out_ref [S, G, D], lse_ref [S, G]: S parts, unmerged), as the online softmax would hold
  them after those keys; parts with no keys (lse -inf) add nothing."""
  parts = [(pltriton.load(out_ref.at[i, pl.ds(0, gp), :], mask=rows[:, None], other=0),
            pltriton.load(lse_ref.at[i, pl.ds(0, gp)], mask=rows,
                          other=MASK_VALUE).reshape(gp, 1))
           for i in map(jnp.int32, range(out_ref.shape[0]))]
  m = functools.reduce(jnp.maximum, [lse for _, lse in parts], jnp.float32(MASK_VALUE))
  weights = [jnp.exp(lse - m) for _, lse in parts]
  return (m, functools.reduce(jnp.add, weights),
          functools.reduce(jnp.add, [w * out for w, (out, _) in zip(weights, parts)]))


def _append_kernel(qkv_ref, k_ref, v_ref, pt_ref, len_ref, wp_ref, ws_ref, *refs, sm_scale,
                   pages_per_block, pages_per_split, groups, heads, window=None,
                   prior=False, prep=None):
  """One (sequence, KV head, context split): qkv_ref [Hq + 2 Hkv, D] (the sequence's
  queries, new keys and new values), pools [P, ps, D]; the length counts the new token.
  With `prior`, refs start with the sequence's prior parts of the head ([S, G, D] and
  [S, G]: cascade's shared prefix), which split 0 starts its online softmax from. With
  `prep` (a QKPrep), the row's RoPE tables [D/2] x2 and its norm's scales [D] x2 come
  next, and the queries and the new key are normed and rotated as they are read."""
  refs = list(refs)
  prior_out, prior_lse = (refs.pop(0), refs.pop(0)) if prior else (None, None)
  tables = (refs.pop(0), refs.pop(0)) if prep is not None else None
  normed = prep is not None and prep.norm_eps is not None
  scales = (refs.pop(0), refs.pop(0)) if normed else (None, None)
  o_ref, lse_ref, k_out, v_out = refs
  page_size = k_ref.shape[1]
  h, split = pl.program_id(1), pl.program_id(2)
  new_k, new_v = heads + h, heads + (qkv_ref.shape[0] - heads) // 2 + h  # rows of qkv
  length = len_ref[0]
  old = length - 1  # Keys already in the pool; the new one is at position `old`.
  first, num_blocks = _split_pages(split, old, page_size, pages_per_split, pages_per_block)
  gp, d = o_ref.shape
  rows = jnp.arange(gp) < groups
  if tables is None:
    q = pltriton.load(qkv_ref.at[pl.ds(h * groups, gp), :], mask=rows[:, None], other=0)
    kn = qkv_ref[new_k, :].astype(k_out.dtype)
  else:
    cos, sin = tables[0][...][None, :], tables[1][...][None, :]
    half = d // 2
    q = prepared_rows(
        lambda cols: pltriton.load(qkv_ref.at[pl.ds(h * groups, gp), cols],
                                   mask=rows[:, None], other=0),
        d, cos, sin, scale_halves(prep, scales[0], half), prep.norm_eps, qkv_ref.dtype)
    kn = prepared_rows(lambda cols: qkv_ref[pl.ds(new_k, 1), cols], d, cos, sin,
                       scale_halves(prep, scales[1], half), prep.norm_eps, k_out.dtype).reshape(d)
  carry = _empty_carry(gp, d)
  if prior:
    before = _prior_carry(prior_out, prior_lse, gp, rows)
    carry = tuple(jnp.where(split == 0, a, b) for a, b in zip(before, carry))
  carry = _fold_pages(q, k_ref, v_ref, pt_ref, carry, first, num_blocks,
                      pages_per_block, sm_scale,
                      lambda pos: _visible(pos, length, window) & (pos < old))
  # Rounded as the pool stores them, so the new token counts as the pool's copy would.
  vn = qkv_ref[new_v, :].astype(v_out.dtype)
  out, lse = _finish(*_fold_new(q, kn, vn, carry, sm_scale, split == 0))
  pltriton.store(o_ref, out.astype(o_ref.dtype), mask=rows[:, None])
  pltriton.store(lse_ref, lse.reshape(gp), mask=rows)

  @pl.when(split == 0)
  def _write():
    page, slot = wp_ref[0], ws_ref[0]
    k_out[page, slot, :] = kn
    v_out[page, slot, :] = vn


def _append_call(qkv, k_pages, v_pages, page_table, lengths, write_page, write_slot, config,
                 interpret, window, out_dtype, prior=None, prep=None, prep_ops=None):
  """qkv [B, Hq + 2 Hkv, D] -> (out [B, Hkv, G, D] in out_dtype (float32 when the context
  is split), lse [B, Hkv, G] f32, k_pages, v_pages); prior, prep and prep_ops as in
  paged_attention_append_parts."""
  b, rows, d = qkv.shape
  hkv, num_pages, page_size, _ = k_pages.shape
  hq = rows - 2 * hkv
  g = hq // hkv
  ppb, splits, pps, gp = triton_blocks((b, hkv, g, d), k_pages.shape, page_table.shape[1],
                                       config)
  page_table = jnp.pad(page_table, ((0, 0), (0, splits * pps - page_table.shape[1])))
  prior_specs, prior_args = [], ()
  if prior is not None:  # Each program reads its row's parts for its KV head.
    prior_args, parts = prior, prior[0].shape[0]
    prior_specs = [pl.BlockSpec((parts, None, None, g, d), lambda i, h, s: (0, i, h, 0, 0)),
                   pl.BlockSpec((parts, None, None, g), lambda i, h, s: (0, i, h, 0))]
  prep_specs, prep_args = qk_prep.block_specs(prep, prep_ops, d)
  kernel = functools.partial(_append_kernel, sm_scale=1.0 / math.sqrt(d),
                             pages_per_block=ppb, pages_per_split=pps, groups=g, heads=hq,
                             window=window, prior=prior is not None, prep=prep)
  pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda i, h, s: (h, 0, 0, 0))
  row = pl.BlockSpec((1,), lambda i, h, s: (i,))
  dtype = out_dtype if splits == 1 else jnp.float32  # Splits merge in float32.
  out, lse, k_pages, v_pages = pl.pallas_call(
      kernel,
      grid=(b, hkv, splits),
      in_specs=[pl.BlockSpec((None, rows, d), lambda i, h, s: (i, 0, 0)), pool_spec,
                pool_spec, pl.BlockSpec((None, splits * pps), lambda i, h, s: (i, 0)),
                row, row, row, *prior_specs, *prep_specs],
      out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, h, s: (s, i, h, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda i, h, s: (s, i, h, 0)),
                 pool_spec, pool_spec],
      out_shape=[jax.ShapeDtypeStruct((splits, b, hkv, g, d), dtype),
                 jax.ShapeDtypeStruct((splits, b, hkv, g), jnp.float32),
                 jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      input_output_aliases={1: 2, 2: 3},
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      cost_estimate=_cost(jax.ShapeDtypeStruct((b, hkv, g, d), qkv.dtype), k_pages,
                          page_table.shape[1]),
      name="paged_attention_append_triton",
  )(qkv, k_pages, v_pages, page_table, lengths, write_page, write_slot, *prior_args,
    *prep_args)
  if splits == 1:  # Enough sequences to fill the GPU: the answer itself, no merge pass.
    return out[0], lse[0], k_pages, v_pages
  out, lse = merge_attention_parts(out, lse)
  return out.astype(out_dtype), lse, k_pages, v_pages


def paged_attention_append_parts(qkv, k_pages, v_pages, page_table, lengths, write_page,
                                 write_slot, config, window=None, out_dtype=jnp.float32,
                                 prior=None, prep=None, prep_ops=None):
  """Un-jitted core: (out [B, Hq, D] in out_dtype, lse [B, Hq] f32, k_pages, v_pages).

  prior: None, or attention of each row's queries over keys outside its table, which the
  answer then includes: cascade decode's shared prefix as S parts, unmerged (out [S, B,
  Hkv, G, D] f32, lse [S, B, Hkv, G] f32, G = Hq / Hkv; kernels.paged_attention's
  paged_attention_block_parts). They are merged in the kernel, so no pass over them comes
  between the two kernels, nor after when the context is not split.
  prep, prep_ops: None, or a kernels.qk_prep.QKPrep and its PrepOperands: qkv's queries
  and keys are then the projection's, before the q/k norm and RoPE, which the kernel
  applies (the pool gets the rotated key).
  """
  b, rows, d = qkv.shape
  hkv, num_pages, page_size, dk = k_pages.shape
  hq = rows - 2 * hkv
  if k_pages.shape != v_pages.shape or dk != d or hq <= 0 or hq % hkv:
    raise ValueError(f"qkv {qkv.shape} (Hq + 2 Hkv heads) does not fit pools "
                     f"{k_pages.shape} / {v_pages.shape}")
  if prior is not None and (prior[0].shape[1:] != (b, hkv, hq // hkv, d) or
                            prior[1].shape != prior[0].shape[:-1]):
    raise ValueError(f"prior parts {prior[0].shape} / {prior[1].shape} do not fit qkv "
                     f"{qkv.shape} on {hkv} KV heads")
  if prep is not None:
    qk_prep.check(prep, prep_ops, b, d)
  backend, interpret = resolve_backend(config.backend, config.interpret)
  if backend != "triton":
    raise ValueError(f"paged_attention_append is a Triton kernel, not {backend!r}; a TPU "
                     "writes with kernels.kv_write and attends with paged_attention")
  clip = lambda x, hi: jnp.clip(x.astype(jnp.int32), 0, hi)
  capacity = page_table.shape[1] * page_size
  out, lse, k_pages, v_pages = _append_call(
      qkv, k_pages, v_pages, clip(page_table, num_pages - 1), clip(lengths, capacity),
      clip(write_page, num_pages - 1), clip(write_slot, page_size - 1), config, interpret,
      window, out_dtype, prior, prep, prep_ops)
  return out.reshape(b, hq, d), lse.reshape(b, hq), k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("config", "window", "prep"),
                   donate_argnames=("k_pages", "v_pages"))
def paged_attention_append(qkv, k_pages, v_pages, page_table, lengths, write_page,
                           write_slot, *, config=PagedAttentionConfig(), window=None,
                           prior=None, prep=None, prep_ops=None):
  """Writes each sequence's new K/V and attends over its tokens, the new one included.

  Args:
    qkv: [B, Hq + 2 Hkv, D] each sequence's new token: its Hq query heads (at position
      ``lengths - 1``), then its Hkv keys, then its Hkv values, side by side: one
      product's output where the kernel norms and rotates q and k itself (`prep`), else
      the output of one fusion of the projection's epilogue (RoPE).
    k_pages, v_pages: [Hkv, num_pages, page_size, D] the pools, updated in place (donated).
    page_table: [B, max_pages] int32; the pages holding each sequence's tokens.
    lengths: [B] int32 tokens per sequence with the new one (>= 1).
    write_page, write_slot: [B] int32 where the new K/V go: the page holding position
      ``lengths - 1`` (a sink page for a row whose output is not wanted) and its slot.
    config: static tunables (backend must resolve to triton).
    window: static sliding window, as in paged_attention.
    prior: None, or each row's attention over keys outside its table to include (cascade
      decode's shared prefix; see paged_attention_append_parts).
    prep, prep_ops: static kernels.qk_prep.QKPrep and its PrepOperands, to norm and rotate
      the queries and new keys in the kernel (see paged_attention_append_parts).

  Returns:
    (out [B, Hq, D] in qkv's dtype, lse [B, Hq] float32, k_pages, v_pages).
  """
  return paged_attention_append_parts(qkv, k_pages, v_pages, page_table, lengths,
                                      write_page, write_slot, config, window,
                                      out_dtype=qkv.dtype, prior=prior, prep=prep,
                                      prep_ops=prep_ops)


# ----------------------------------------------------------------------------- reference


def paged_attention_append_reference(qkv, k_pages, v_pages, page_table, lengths,
                                     write_page, write_slot, window=None, prep=None,
                                     prep_ops=None):
  """float32 reference: the write as a scatter, then paged attention's reference (with
  `prep`, the queries and keys normed and rotated first, qk_prep.prepare_reference, the
  queries then rounded to qkv's dtype as the kernel and the model's own path round them).
  Returns (out [B, Hq, D] f32, lse [B, Hq] f32, k_pages, v_pages)."""
  hkv = k_pages.shape[0]
  hq = qkv.shape[1] - 2 * hkv
  q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
  if prep is not None:  # The kernel attends with the prepared queries in qkv's dtype.
    q, k = qk_prep.prepare_pair(q, k, prep, prep_ops)
    q = q.astype(qkv.dtype)
  k_pages = k_pages.at[:, write_page, write_slot].set(
      jnp.swapaxes(k, 0, 1).astype(k_pages.dtype))
  v_pages = v_pages.at[:, write_page, write_slot].set(
      jnp.swapaxes(v, 0, 1).astype(v_pages.dtype))
  out, lse = paged_attention_with_lse_reference(q, k_pages, v_pages, page_table, lengths,
                                                window)
  return out, lse, k_pages, v_pages

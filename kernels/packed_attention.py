"""Packed causal attention (prefill and training) with segment ids and gradients.

Many sequences share one row of T tokens; ``segment_ids`` [B, T] names the sequence of each
token and 0 marks padding. Query t attends to key s iff ``s <= t``, both are in the same
segment, and that segment is not padding. Padding queries attend to nothing: their output
(and gradient) is defined as 0, so padded rows never leak into a loss.

Backend choice (documented because it is the interesting decision):

* GPU: a Pallas (Triton) flash-attention forward that also returns the log-sum-exp, and a
  Pallas backward in the FlashAttention-2 form (one kernel for dK/dV looping over query
  blocks, one for dQ looping over key blocks), both recomputing probabilities from the
  saved log-sum-exp instead of storing [T, T] scores. Every (query block, key block) pair
  is first tested for a causal and a segment overlap, so a row of many short sequences
  costs about the sum of their squared lengths, not T^2. ``jax.nn.dot_product_attention``
  was not used: its cuDNN path has no segment ids (packing would need a dense [B, T, T]
  mask, i.e. the O(T^2) memory this kernel exists to avoid).
* TPU: splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``), the Pallas
  TPU kernel maintained with JAX. It already has segment ids, a causal block-sparse mask,
  GQA and Pallas backward kernels tuned for the MXU; rewriting it would only lose speed.
* CPU: ``backend="blocked"``, a pure-jnp FlashAttention: a map over query tiles, a scan
  over the key tiles the causal (and sliding-window) structure allows, online softmax, and
  a custom VJP that recomputes each tile's probabilities from the saved log-sum-exp. It
  never holds more than one [block, block] tile of float32 scores per row and head, which
  is what lets a long packed row train on a CPU; tiles are skipped only by position (a
  data-dependent skip would need a cross-device predicate once the rows are sharded). The
  model uses it on CPU. The GPU kernels also run in the Pallas interpreter (what their
  tests exercise, and the default here on CPU), and the TPU path in interpret mode when
  asked for explicitly.

A sliding window (``sliding_window``: query t sees keys t - window < s <= t) restricts
every backend the same way and narrows the tiles each one visits.

Shapes stay in the model's layout, [B, T, H, D]: the Triton kernels address a head through
a squeezed block dimension (a stride), so no transposes are needed on GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_post.kernels.platform import kernel_platform

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BACKENDS = ("triton", "splash", "blocked")
_NO_SEGMENT = np.iinfo(np.int32).max


# Names of the kernels' backward residuals, for activation-checkpointing policies. Under
# jax.checkpoint the forward's inner ops are visible to the policy: a policy that saves every
# dot (dots_saveable) would save the blocked kernel's [block, block] score tiles of every
# tile pair, i.e. [S, S] memory again. Saving these two names instead (`save_only_these_names`)
# keeps the output and log-sum-exp, from which the backward recomputes the tiles.
RESIDUAL_NAMES = ("packed_attention_out", "packed_attention_lse")


def _named_residuals(o, lse):
  return checkpoint_name(o, RESIDUAL_NAMES[0]), checkpoint_name(lse, RESIDUAL_NAMES[1])


def _precision(dtype):
  """IEEE f32 dots for f32 inputs (Triton would otherwise use TF32)."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _dot(a, b, contract):  # 2-D matmul contracting dims `contract`, f32 accumulation
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=_precision(a.dtype),
                             preferred_element_type=jnp.float32)


def _segment_range(seg):  # [N] int32 -> (min, max) over non-padding ids
  """An empty (all-padding) block gives (INT_MAX, 0), which overlaps nothing."""
  return jnp.where(seg > 0, seg, _NO_SEGMENT).min(), seg.max()


def _overlaps(range_a, range_b):
  return (range_a[0] <= range_b[1]) & (range_b[0] <= range_a[1])


def _mask(seg_q, seg_k, q_start, k_start, window):  # [bq], [bk] -> [bq, bk] bool
  q_pos = q_start + jnp.arange(seg_q.shape[0], dtype=jnp.int32)
  k_pos = k_start + jnp.arange(seg_k.shape[0], dtype=jnp.int32)
  same = (seg_q[:, None] == seg_k[None, :]) & (seg_k != 0)[None, :]
  keep = same & (q_pos[:, None] >= k_pos[None, :])
  if window is not None:
    keep &= (q_pos[:, None] - k_pos[None, :]) < window
  return keep


def _first_key_block(q_start, block_kv, window):
  """The earliest key block a query block starting at q_start can see."""
  if window is None:
    return 0
  return jnp.maximum(q_start - window + 1, 0) // block_kv


def _query_blocks_end(k_start, block_kv, block_q, num_q, window):
  """One past the last query block that sees a key block starting at k_start."""
  if window is None:
    return num_q
  return jnp.minimum((k_start + block_kv - 1 + window - 1) // block_q + 1, num_q)


def rotate_half(x, cos, sin):  # [B, T, H, D], [B, T, D/2] x2 -> [B, T, H, D]
  """RoPE in the rotate-half layout, in x's dtype (the tables cast to it), per half:
  (x1 cos - x2 sin, x2 cos + x1 sin). The rotation packed_attention's `rope` stands for."""
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rotates_in_kernel(head_dim: int) -> bool:
  """Whether the Triton kernels apply RoPE themselves at this head_dim: its halves must be
  blocks of their own (a power of two) that tl.dot takes (16 or more)."""
  return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def _parts(load, width, rope):
  """A q or k block as the parts its scores sum over: (x,) whole, or given RoPE tables
  (cos, sin) [n, D/2] of its rows, its rotation's two halves -- the rotated block never
  exists in HBM. load(cols) reads columns `cols` of the block."""
  if rope is None:
    return (load(pl.ds(0, width)),)
  cos, sin = rope
  half = width // 2
  x1, x2 = load(pl.ds(0, half)), load(pl.ds(half, half))
  return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _scores(qs, ks):  # parts of q [bq, *], of k [bk, *] -> [bq, bk] f32
  s = _dot(qs[0], ks[0], ((1,), (1,)))
  for q, k in zip(qs[1:], ks[1:]):
    s = s + _dot(q, k, ((1,), (1,)))
  return s


def _unrotated(grads, rope):
  """Gradients of the rotated halves (f32) carried back through the rotation to x's."""
  if rope is None:
    return grads
  cos, sin = (t.astype(jnp.float32) for t in rope)
  g1, g2 = grads
  return g1 * cos + g2 * sin, g2 * cos - g1 * sin


def _store(ref, parts):  # parts side by side along the last axis of a 2-D block
  width = ref.shape[-1] // len(parts)
  for i, part in enumerate(parts):
    ref[:, pl.ds(i * width, width)] = part.astype(ref.dtype)


def _tables(refs, rows=None):
  """The (cos, sin) rows of a kernel's RoPE table refs; None without RoPE."""
  if not refs:
    return None
  return tuple(r[...] if rows is None else r[rows, :] for r in refs)


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, sm_scale, block_kv, window, rope):
  """One (row, q head, query block): q_ref [bq, D]; k_ref/v_ref [T, D]; segk_ref [T]; with
  RoPE, tables of the query block's rows [bq, D/2] and of the row's [T, D/2]."""
  q_ref, k_ref, v_ref, segq_ref, segk_ref = refs[:5]
  table_q, table_k = (refs[5:7], refs[7:9]) if rope else ((), ())
  o_ref, lse_ref = refs[-2:]
  block_q, d = q_ref.shape
  q_start = pl.program_id(2) * block_q
  qs = _parts(lambda cols: q_ref[:, cols], d, _tables(table_q))
  seg_q = segq_ref[...]
  q_range = _segment_range(seg_q)

  def attend(k_start, carry):
    m, l, acc = carry
    rows = pl.ds(k_start, block_kv)
    seg_k = segk_ref[rows]
    ks = _parts(lambda cols: k_ref[rows, cols], d, _tables(table_k, rows))
    v = v_ref[rows, :]
    mask = _mask(seg_q, seg_k, q_start, k_start, window)
    s = jnp.where(mask, _scores(qs, ks) * sm_scale, MASK_VALUE)  # [bq, bk]
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, ((1,), (0,)))
    return m_new, alpha * l + p.sum(axis=-1), acc

  def body(j, carry):
    k_start = j * block_kv
    k_range = _segment_range(segk_ref[pl.ds(k_start, block_kv)])
    return jax.lax.cond(_overlaps(q_range, k_range),
                        lambda c: attend(k_start, c), lambda c: c, carry)

  init = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
          jnp.zeros((block_q, d), jnp.float32))
  num_kv = pl.cdiv(q_start + block_q, block_kv)  # causal: key blocks up to the diagonal
  first = _first_key_block(q_start, block_kv, window)  # window: none far behind it
  m, l, acc = jax.lax.fori_loop(first, num_kv, body, init)
  nonempty = l > 0
  l_safe = jnp.where(nonempty, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)


def _table_specs(rope, own, whole):
  """BlockSpecs of the (cos, sin) tables [B, T, D/2]: the program's own rows (`own`, a
  (rows, index_map) pair) and the whole row's (`whole`); none without RoPE."""
  if rope is None:
    return [], []
  half = rope[0].shape[-1]
  spec = lambda rows, index: pl.BlockSpec((None, rows, half), index)
  return [spec(*own)] * 2, [spec(*whole)] * 2


def _fwd_call(q, k, v, seg, rope, sm_scale, window, cfg, interpret):
  """q [B, T, Hq, D], k/v [B, T, Hkv, D], seg [B, T], rope None or (cos, sin) [B, T, D/2]
  -> o like q, lse [B, Hq, T] f32."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  bq, bk = cfg.block_q, cfg.block_kv
  kv_spec = pl.BlockSpec((None, t, None, d), lambda i, h, j: (i, 0, h // (hq // hkv), 0))
  q_spec = pl.BlockSpec((None, bq, None, d), lambda i, h, j: (i, j, h, 0))
  own, whole = _table_specs(rope, (bq, lambda i, h, j: (i, j, 0)),
                            (t, lambda i, h, j: (i, 0, 0)))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, sm_scale=sm_scale, block_kv=bk, window=window,
                        rope=rope is not None),
      grid=(b, hq, t // bq),
      in_specs=[q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, bq), lambda i, h, j: (i, j)),
                pl.BlockSpec((None, t), lambda i, h, j: (i, 0)), *own, *whole],
      out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, h, j: (i, h, j))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, hq, t), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name=_name("packed_attention_fwd", window),
  )(q, k, v, seg, seg, *(rope or ()), *(rope or ()))


def _name(kernel: str, window) -> str:
  """The pallas_call's name, which the compiled program keeps in its op_name: the window
  too, so the plan can count the FLOPs of a call from its text (plan.hlo_cost)."""
  return kernel if window is None else f"{kernel}_window{window}"


# ----------------------------------------------------------------------------- backward


def _probs(qs, ks, seg_q, seg_k, q_start, k_start, lse, sm_scale, window):  # -> [bq, bk] f32
  s = _scores(qs, ks) * sm_scale
  mask = _mask(seg_q, seg_k, q_start, k_start, window)
  return jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)


def _dkv_kernel(*refs, sm_scale, block_q, group, window, rope):
  """One (row, KV head, key block): loops over the group's q heads and later q blocks.

  q_ref/do_ref [T, G, D]; lse_ref/delta_ref [G, T]; k_ref/v_ref [bk, D]; segq_ref [T];
  with RoPE, tables of the row [T, D/2] and of the key block's rows [bk, D/2].
  """
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref = refs[:8]
  table_q, table_k = (refs[8:10], refs[10:12]) if rope else ((), ())
  dk_ref, dv_ref = refs[-2:]
  block_kv, d = k_ref.shape
  t = segq_ref.shape[0]
  k_start = pl.program_id(2) * block_kv
  rope_k = _tables(table_k)
  ks, v = _parts(lambda cols: k_ref[:, cols], d, rope_k), v_ref[...]
  seg_k = segk_ref[...]
  k_range = _segment_range(seg_k)

  def grads(g, q_start, carry):
    dks, dv = carry
    rows = pl.ds(q_start, block_q)
    qs = _parts(lambda cols: q_ref[rows, g, cols], d, _tables(table_q, rows))
    do = do_ref[rows, g, :]  # [bq, D]
    seg_q = segq_ref[rows]
    p = _probs(qs, ks, seg_q, seg_k, q_start, k_start, lse_ref[g, rows], sm_scale, window)
    dv = dv + _dot(p.astype(do.dtype), do, ((0,), (0,)))  # [bk, D]
    dp = _dot(do, v, ((1,), (1,)))  # [bq, bk]
    ds = (p * (dp - delta_ref[g, rows][:, None]) * sm_scale).astype(qs[0].dtype)
    return tuple(dk + _dot(ds, q, ((0,), (0,))) for dk, q in zip(dks, qs)), dv

  def body(g, i, carry):
    q_start = i * block_q
    q_range = _segment_range(segq_ref[pl.ds(q_start, block_q)])
    return jax.lax.cond(_overlaps(q_range, k_range),
                        lambda c: grads(g, q_start, c), lambda c: c, carry)

  dks = tuple(jnp.zeros((block_kv, k.shape[1]), jnp.float32) for k in ks)
  carry = (dks, jnp.zeros((block_kv, d), jnp.float32))
  first = k_start // block_q  # causal: earlier query blocks never see this key block
  end = _query_blocks_end(k_start, block_kv, block_q, t // block_q, window)
  for g in range(group):
    carry = jax.lax.fori_loop(first, end, functools.partial(body, g), carry)
  _store(dk_ref, _unrotated(carry[0], rope_k))
  dv_ref[...] = carry[1].astype(dv_ref.dtype)


def _dq_kernel(*refs, sm_scale, block_kv, window, rope):
  """One (row, q head, query block): q_ref/do_ref [bq, D]; k_ref/v_ref [T, D]; with RoPE,
  tables of the query block's rows [bq, D/2] and of the row's [T, D/2]."""
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref = refs[:8]
  table_q, table_k = (refs[8:10], refs[10:12]) if rope else ((), ())
  dq_ref = refs[-1]
  block_q, d = q_ref.shape
  q_start = pl.program_id(2) * block_q
  rope_q = _tables(table_q)
  qs, do = _parts(lambda cols: q_ref[:, cols], d, rope_q), do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  seg_q = segq_ref[...]
  q_range = _segment_range(seg_q)

  def grad(k_start, dqs):
    rows = pl.ds(k_start, block_kv)
    seg_k = segk_ref[rows]
    ks = _parts(lambda cols: k_ref[rows, cols], d, _tables(table_k, rows))
    v = v_ref[rows, :]
    p = _probs(qs, ks, seg_q, seg_k, q_start, k_start, lse, sm_scale, window)
    ds = (p * (_dot(do, v, ((1,), (1,))) - delta[:, None]) * sm_scale).astype(ks[0].dtype)
    return tuple(dq + _dot(ds, k, ((1,), (0,))) for dq, k in zip(dqs, ks))

  def body(j, dqs):
    k_start = j * block_kv
    k_range = _segment_range(segk_ref[pl.ds(k_start, block_kv)])
    return jax.lax.cond(_overlaps(q_range, k_range),
                        lambda c: grad(k_start, c), lambda c: c, dqs)

  num_kv = pl.cdiv(q_start + block_q, block_kv)
  first = _first_key_block(q_start, block_kv, window)
  dqs = tuple(jnp.zeros((block_q, q.shape[1]), jnp.float32) for q in qs)
  _store(dq_ref, _unrotated(jax.lax.fori_loop(first, num_kv, body, dqs), rope_q))


def _bwd_call(q, k, v, seg, rope, o, lse, do, sm_scale, window, cfg, interpret):
  """Gradients of the padded problem: (dq [B,T,Hq,D], dk, dv [B,T,Hkv,D]) in input dtypes;
  with RoPE, dq and dk those of q and k before their rotation."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  bq, bk = cfg.bwd_block_q, cfg.bwd_block_kv
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows with no keys: every p is masked
  params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  tables = rope or ()

  full_q = pl.BlockSpec((None, t, group, d), lambda i, h, j: (i, 0, h, 0))
  full_stat = pl.BlockSpec((None, group, t), lambda i, h, j: (i, h, 0))
  kv_block = pl.BlockSpec((None, bk, None, d), lambda i, h, j: (i, j, h, 0))
  row, keys = _table_specs(rope, (t, lambda i, h, j: (i, 0, 0)),
                           (bk, lambda i, h, j: (i, j, 0)))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, sm_scale=sm_scale, block_q=bq, group=group,
                        window=window, rope=rope is not None),
      grid=(b, hkv, t // bk),
      in_specs=[full_q, kv_block, kv_block, full_q, full_stat, full_stat,
                pl.BlockSpec((None, t), lambda i, h, j: (i, 0)),
                pl.BlockSpec((None, bk), lambda i, h, j: (i, j)), *row, *keys],
      out_specs=[kv_block, kv_block],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=interpret, name=_name("packed_attention_dkv", window),
  )(q, k, v, do, lse, delta, seg, seg, *tables, *tables)

  q_block = pl.BlockSpec((None, bq, None, d), lambda i, h, j: (i, j, h, 0))
  full_kv = pl.BlockSpec((None, t, None, d), lambda i, h, j: (i, 0, h // group, 0))
  queries, row = _table_specs(rope, (bq, lambda i, h, j: (i, j, 0)),
                              (t, lambda i, h, j: (i, 0, 0)))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, sm_scale=sm_scale, block_kv=bk, window=window,
                        rope=rope is not None),
      grid=(b, hq, t // bq),
      in_specs=[q_block, full_kv, full_kv, q_block,
                pl.BlockSpec((None, None, bq), lambda i, h, j: (i, h, j)),
                pl.BlockSpec((None, None, bq), lambda i, h, j: (i, h, j)),
                pl.BlockSpec((None, bq), lambda i, h, j: (i, j)),
                pl.BlockSpec((None, t), lambda i, h, j: (i, 0)), *queries, *row],
      out_specs=q_block,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=interpret, name=_name("packed_attention_dq", window),
  )(q, k, v, do, lse, delta, seg, seg, *tables, *tables)
  return dq, dk, dv


# ----------------------------------------------------------------------------- GPU path


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, seg, rope, sm_scale, window, cfg, interpret):
  return _fwd_call(q, k, v, seg, rope, sm_scale, window, cfg, interpret)[0]


def _flash_fwd(q, k, v, seg, rope, sm_scale, window, cfg, interpret):
  o, lse = _named_residuals(*_fwd_call(q, k, v, seg, rope, sm_scale, window, cfg, interpret))
  return o, (q, k, v, seg, rope, o, lse)


def _flash_bwd(sm_scale, window, cfg, interpret, res, do):
  q, k, v, seg, rope, o, lse = res
  dq, dk, dv = _bwd_call(q, k, v, seg, rope, o, lse, do, sm_scale, window, cfg, interpret)
  return dq, dk, dv, None, None  # The tables come from positions: nothing to learn there.


_flash.defvjp(_flash_fwd, _flash_bwd)


def _fit_blocks(cfg, t):
  """Blocks no longer than the (power-of-two) padded row, and at least 16 (tl.dot)."""
  cap = max(16, pl.next_power_of_2(t))
  fit = lambda n: max(16, min(n, cap))
  return dataclasses.replace(cfg, block_q=fit(cfg.block_q), block_kv=fit(cfg.block_kv),
                             bwd_block_q=fit(cfg.bwd_block_q),
                             bwd_block_kv=fit(cfg.bwd_block_kv))


def _packed_triton(q, k, v, segment_ids, window, cfg, interpret, rope=None):
  b, t, _, d = q.shape
  cfg = _fit_blocks(cfg, t)
  for n in (cfg.block_q, cfg.block_kv, cfg.bwd_block_q, cfg.bwd_block_kv):
    if n & (n - 1):
      raise ValueError(f"triton block sizes must be powers of two, got {n}")
  if rope is not None and not rotates_in_kernel(d):
    q, k, rope = rotate_half(q, *rope), rotate_half(k, *rope), None
  multiple = max(cfg.block_q, cfg.block_kv, cfg.bwd_block_q, cfg.bwd_block_kv)
  t_pad = pl.cdiv(t, multiple) * multiple
  d_pad = max(16, pl.next_power_of_2(d))  # zero columns change neither scores nor outputs
  pad = lambda x: jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, d_pad - d)))
  seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, t_pad - t)))
  if rope is not None:  # In q's dtype, as rotate_half computes.
    rope = tuple(jnp.pad(r.astype(q.dtype), ((0, 0), (0, t_pad - t), (0, 0))) for r in rope)
  out = _flash(pad(q), pad(k), pad(v), seg, rope, 1.0 / math.sqrt(d), window, cfg, interpret)
  return out[:, :t, :, :d]


# ----------------------------------------------------------------------------- TPU path


def _packed_splash(q, k, v, segment_ids, window, cfg, interpret):
  """Splash attention per row; q pre-scaled since splash applies no softmax scale."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # TPU-only dependency
      splash_attention_kernel as splash, splash_attention_mask as splash_mask)
  b, t, hq, d = q.shape
  blk = cfg.splash_block
  t_pad = pl.cdiv(t, blk) * blk
  to_heads = lambda x: jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, t_pad - t)))
  head_mask = (splash_mask.CausalMask((t_pad, t_pad)) if window is None else
               splash_mask.LocalMask((t_pad, t_pad), window_size=(window - 1, 0), offset=0))
  mask = splash_mask.MultiHeadMask([head_mask] * hq)
  sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                            block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                            block_q_dq=blk, block_kv_dq=blk)
  kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  per_row = lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1))
  scaled_q = (q.astype(jnp.float32) / math.sqrt(d)).astype(q.dtype)
  out = jax.vmap(per_row)(to_heads(scaled_q), to_heads(k), to_heads(v), seg)
  # Splash attends padding (segment 0) to padding: zeroed here. The Triton and blocked
  # kernels' masks give padding queries no keys, so their outputs and gradients there are
  # already exactly 0; a select after them would cost a pass over the output and another
  # over its gradient in every layer.
  return jnp.where((segment_ids != 0)[:, :, None, None], out.transpose(0, 2, 1, 3)[:, :t], 0)

# ----------------------------------------------------------------------------- CPU path


def _key_span(num_blocks, block, window):
  """Key blocks one query block can see: every earlier one, or those the window reaches."""
  if window is None:
    return num_blocks
  return min(num_blocks, (window - 2) // block + 2)


def _tiles(x, block):  # [B, T, ...] -> [T / block, B, block, ...]
  b, t = x.shape[:2]
  return x.reshape(b, t // block, block, *x.shape[2:]).swapaxes(0, 1)


def _untile(x):  # [n, B, block, ...] -> [B, n * block, ...]
  x = x.swapaxes(0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])


def _tile_scores(q, k, seg_q, seg_k, i, j, window):
  """Scores of query tile i against key tile j, [B, Hkv, G, bq, bk] f32, and their mask.

  q [B, bq, Hkv, G, D]; k [B, bk, Hkv, D]; seg_q [B, bq]; seg_k [B, bk].
  """
  bq, bk = q.shape[1], k.shape[1]
  s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
  s = s / math.sqrt(q.shape[-1])
  mask = jax.vmap(lambda a, b: _mask(a, b, i * bq, j * bk, window))(seg_q, seg_k)
  return s, mask[:, None, None]


def _vary(index, tile):
  """The tile loop's index, tied to the tile's data by an optimization barrier.

  Inside a scan over layers, anything computed from loop indices alone (each tile pair's
  causal mask, the zeros of a masked select) is layer-invariant, and JAX hoists it out of
  the layer loop, materialising every [block, block] tile of all n x n pairs at once:
  [S, S] memory again. Through the barrier the index depends on the layer's data.
  """
  return jax.lax.optimization_barrier((index, tile))


def _blocked_forward(q, k, v, seg, window, block):
  """Online softmax over key tiles per query tile: (o like q, lse [n, B, Hkv, G, block])."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  n = t // block
  qt = _tiles(q.reshape(b, t, hkv, hq // hkv, d), block)  # [n, B, bq, Hkv, G, D]
  kt, vt, st = _tiles(k, block), _tiles(v, block), _tiles(seg, block)

  def query_tile(i):
    i, q_i = _vary(i, qt[i])

    def attend(j, carry):
      m, l, acc = carry
      s, mask = _tile_scores(q_i, kt[j], st[i], st[j], i, j, window)
      s = jnp.where(mask, s, MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), vt[j],
                      preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

    def step(carry, r):  # key tile i - r; tiles before the row start are skipped
      j = i - r
      return jax.lax.cond(j >= 0, functools.partial(attend, j), lambda c: c, carry), None

    stat = (b, hkv, hq // hkv, block)
    init = (jnp.full(stat, MASK_VALUE, jnp.float32), jnp.zeros(stat, jnp.float32),
            jnp.zeros((*stat, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(_key_span(n, block, window)))
    nonempty = l > 0
    l_safe = jnp.where(nonempty, l, 1.0)
    o = (acc / l_safe[..., None]).astype(q.dtype)  # [B, Hkv, G, bq, D]
    return o.transpose(0, 3, 1, 2, 4), jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)

  o, lse = jax.lax.map(query_tile, jnp.arange(n))
  return _untile(o).reshape(b, t, hq, d), lse


def _blocked_backward(q, k, v, seg, o, lse, do, window, block):
  """FlashAttention-2 style gradients: per key tile, recompute probabilities of the query
  tiles that see it from the saved log-sum-exp; dQ accumulates across key tiles."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  n = t // block
  grouped = lambda x: _tiles(x.reshape(b, t, hkv, hq // hkv, *x.shape[3:]), block)
  qt, dot = grouped(q), grouped(do)  # [n, B, bq, Hkv, G, D]
  kt, vt, st = _tiles(k, block), _tiles(v, block), _tiles(seg, block)
  delta = jnp.einsum("bthd,bthd->bth", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = grouped(delta).transpose(0, 1, 3, 4, 2)  # [n, B, Hkv, G, bq]
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # queries with no keys: every p is masked

  def key_tile(dq, j):
    j, _ = _vary(j, kt[j])

    def grads(i, carry):
      dk, dv, dq = carry
      s, mask = _tile_scores(qt[i], kt[j], st[i], st[j], i, j, window)
      p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)  # [B, Hkv, G, bq, bk]
      dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), dot[i],
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum("bqhgd,bkhd->bhgqk", dot[i], vt[j], preferred_element_type=jnp.float32)
      ds = p * (dp - delta[i][..., None]) / math.sqrt(d)
      dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qt[i],
                           preferred_element_type=jnp.float32)
      dq_i = dq[i] + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), kt[j],
                                preferred_element_type=jnp.float32)
      return dk, dv, jax.lax.dynamic_update_index_in_dim(dq, dq_i, i, 0)

    def step(carry, r):  # query tile j + r; tiles past the row end are skipped
      i = j + r
      return jax.lax.cond(i < n, functools.partial(grads, i), lambda c: c, carry), None

    zeros = jnp.zeros((b, block, hkv, d), jnp.float32)
    (dk, dv, dq), _ = jax.lax.scan(step, (zeros, zeros, dq),
                                   jnp.arange(_key_span(n, block, window)))
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_tile, jnp.zeros(qt.shape, jnp.float32), jnp.arange(n))
  return (_untile(dq).reshape(q.shape).astype(q.dtype), _untile(dk).astype(k.dtype),
          _untile(dv).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked(q, k, v, seg, window, block):
  return _blocked_forward(q, k, v, seg, window, block)[0]


def _blocked_fwd(q, k, v, seg, window, block):
  o, lse = _named_residuals(*_blocked_forward(q, k, v, seg, window, block))
  return o, (q, k, v, seg, o, lse)


def _blocked_bwd(window, block, res, do):
  return (*_blocked_backward(*res, do, window, block), None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _packed_blocked(q, k, v, segment_ids, window, cfg, interpret):
  """Pure jnp, [block, block] score tiles only; a row shorter than a block is one tile."""
  del interpret  # plain XLA: nothing to interpret
  t = q.shape[1]
  block = min(cfg.jnp_block, t)
  t_pad = -t % block
  pad = lambda x: jnp.pad(x, ((0, 0), (0, t_pad)) + ((0, 0),) * (x.ndim - 2))
  out = _blocked(pad(q), pad(k), pad(v), pad(segment_ids.astype(jnp.int32)), window, block)
  return out[:, :t]


# ----------------------------------------------------------------------------- public API


@dataclasses.dataclass(frozen=True)
class PackedAttentionConfig:
  """Tunables (static). Triton blocks are powers of two, clipped to the padded row.

  Attributes:
    block_q: forward query rows per program.
    block_kv: forward keys per inner step.
    bwd_block_q: backward query rows per step (smaller: the backward holds more tiles).
    bwd_block_kv: backward keys per program (dK/dV) and per step (dQ).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth.
    splash_block: TPU splash attention block (multiple of 128).
    jnp_block: query and key tile of the blocked jnp backend (any size; rows are padded).
    backend: "triton", "splash" or "blocked"; None picks splash on TPU, triton elsewhere.
    interpret: run the Pallas interpreter; None means "only on CPU".
  """
  block_q: int = 64
  block_kv: int = 64
  bwd_block_q: int = 32
  bwd_block_kv: int = 64
  num_warps: int = 4
  num_stages: int = 2
  splash_block: int = 512
  jnp_block: int = 512
  backend: str | None = None
  interpret: bool | None = None


def _resolve(config):
  platform = kernel_platform()  # The traced-for devices', not the host's (kernels.platform).
  backend = config.backend or ("splash" if platform == "tpu" else "triton")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  interpret = platform == "cpu" if config.interpret is None else config.interpret
  return backend, interpret


_IMPLS = {"triton": _packed_triton, "splash": _packed_splash, "blocked": _packed_blocked}


@functools.partial(jax.jit, static_argnames=("config", "sliding_window"))
def packed_attention(q, k, v, segment_ids, rope=None, *, config=PackedAttentionConfig(),
                     sliding_window=None):
  """Causal attention inside packed segments, differentiable in q, k and v.

  Args:
    q: [B, T, Hq, D] queries (RoPE applied, unless `rope` is given).
    k: [B, T, Hkv, D] keys; Hq is a multiple of Hkv.
    v: [B, T, Hkv, D] values.
    segment_ids: [B, T] int, contiguous runs per sequence; 0 marks padding.
    rope: None, or (cos, sin) [B, T, D/2] at each token: q and k are then taken before
      RoPE and rotated as rotate_half does, the gradients being those of the unrotated q
      and k. The Triton kernels rotate each block as they read it (rotates_in_kernel), so
      the rotated q and k are never written; the other backends rotate first.
    config: static tunables.
    sliding_window: static; query t sees only keys s with t - s < sliding_window. Measured
      in tokens of the row, which inside a packed segment equals the position distance.

  Returns:
    [B, T, Hq, D] in q's dtype; exactly 0 at padding positions.
  """
  if q.shape[2] % k.shape[2] or k.shape != v.shape or q.shape[:2] != segment_ids.shape:
    raise ValueError(f"bad shapes q {q.shape} k {k.shape} v {v.shape} "
                     f"segment_ids {segment_ids.shape}")
  if rope is not None and any(r.shape != (*q.shape[:2], q.shape[3] // 2) for r in rope):
    raise ValueError(f"bad RoPE tables {[r.shape for r in rope]} for q {q.shape}")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
  backend, interpret = _resolve(config)
  if backend == "triton":
    return _packed_triton(q, k, v, segment_ids, sliding_window, config, interpret, rope)
  if rope is not None:
    q, k = rotate_half(q, *rope), rotate_half(k, *rope)
  return _IMPLS[backend](q, k, v, segment_ids, sliding_window, config, interpret)


# ----------------------------------------------------------------------------- reference


def packed_attention_reference(q, k, v, segment_ids, sliding_window=None):
  """float32 dense masked softmax; [B, T, Hq, D] f32, 0 at padding positions (q and k
  with RoPE applied)."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  if sliding_window is not None:
    causal &= jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < sliding_window
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  mask = (causal[None] & same & (segment_ids[:, None, :] != 0))[:, None, None]
  # A finite mask value keeps all-masked (padding) rows finite in values and gradients.
  probs = jnp.where(mask, jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1), 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return jnp.where((segment_ids != 0)[:, :, None, None], out.reshape(b, t, hq, d), 0.0)

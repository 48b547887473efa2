"""q and the new k as the GPU's decode kernels prepare them: Qwen3's per-head RMSNorm, then
RoPE, applied to the rows a kernel loads instead of by launches of their own.

A decode layer's attention reads its token's queries and new key from the Q/K/V product.
Normed and rotated by XLA, that is a fusion per layer writing q and k again (two more for
Qwen3's q and k norms) before the kernel reads them; inside the kernels (paged_append's
and paged_attention's block prefix) the rows are normed and rotated in registers, and
the kernels read the projection's output itself.

`QKPrep` is the static half (the norm's epsilon and form), `PrepOperands` the arrays:
RoPE's tables at each row's position and the norms' weights. `prepare_reference` is the
float32 reference; `prepared_rows` the kernels' form.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrl_post.kernels.packed_attention import rotate_half


@dataclasses.dataclass(frozen=True)
class QKPrep:
  """What the decode kernels do to each query and new key before attending (static).

  norm_eps: Qwen3's per-head RMSNorm over head_dim with this epsilon (its weights in
    PrepOperands), or None for none.
  norm_plus_one: the norm scales by 1 + w (Gemma's form) rather than w.
  """

  norm_eps: Optional[float] = None
  norm_plus_one: bool = False


class PrepOperands(NamedTuple):
  """The arrays a QKPrep reads: cos and sin [B, D/2] float32 at each row's new position;
  q_scale and k_scale [D] the q and k norms' weights, in their own dtype (the kernels
  read them in float32), or None without a norm."""

  cos: jax.Array
  sin: jax.Array
  q_scale: Optional[jax.Array] = None
  k_scale: Optional[jax.Array] = None


def check(prep: QKPrep, ops: PrepOperands, rows: int, head_dim: int) -> None:
  """Refuses operands that do not fit `rows` rows of heads of `head_dim`."""
  half = head_dim // 2
  if head_dim % 2 or ops.cos.shape != (rows, half) or ops.sin.shape != (rows, half):
    raise ValueError(f"RoPE tables {ops.cos.shape} / {ops.sin.shape} do not fit {rows} rows "
                     f"of head_dim {head_dim}")
  norm = (ops.q_scale, ops.k_scale)
  given = [s is not None for s in norm]
  if any(given) != all(given) or (prep.norm_eps is not None) != all(given):
    raise ValueError(f"norm_eps {prep.norm_eps} and the q/k norm weights given disagree")
  if prep.norm_eps is not None and any(s.shape != (head_dim,) for s in norm):
    raise ValueError(f"q/k norm weights {[s.shape for s in norm]} do not fit head_dim "
                     f"{head_dim}")


# ----------------------------------------------------------------------------- kernels


def block_specs(prep: Optional[QKPrep], ops: Optional[PrepOperands], head_dim: int,
                rows=(None,), row_index=lambda i, h, s: (i, 0)):
  """(BlockSpecs, arrays) of a kernel call's prep operands: each program reads its rows'
  tables (block `rows` + (D/2,), at the grid's row_index) and the whole scales."""
  if prep is None:
    return [], ()
  table = pl.BlockSpec((*rows, head_dim // 2), row_index)
  specs, args = [table, table], [ops.cos, ops.sin]
  if prep.norm_eps is not None:
    whole = pl.BlockSpec((head_dim,), lambda *grid: (0,))
    specs, args = specs + [whole, whole], args + [ops.q_scale, ops.k_scale]
  return specs, tuple(args)


def prepared_rows(load, width, cos, sin, scale, eps, dtype):
  """Rows [n, D] normed (scale [D/2] x2 float32, or None) and rotated, in `dtype`:
  load(cols) reads columns `cols` of the n rows; cos, sin [n, D/2] float32. Computed per
  half in float32 (the norm's mean over both), the halves then joined side by side in
  registers."""
  half = width // 2
  x1 = load(pl.ds(0, half)).astype(jnp.float32)
  x2 = load(pl.ds(half, half)).astype(jnp.float32)
  if scale is not None:
    ms = (jnp.sum(x1 * x1, axis=1, keepdims=True) + jnp.sum(x2 * x2, axis=1, keepdims=True))
    r = jax.lax.rsqrt(ms / width + eps)
    x1, x2 = x1 * r * scale[0][None, :], x2 * r * scale[1][None, :]
  a, b = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  # [n, D/2] x2 -> [n, D/2, 2] -> [n, 2, D/2] -> [n, D]: Triton joins only on a new
  # minor axis, and the transpose puts the halves back end to end.
  n = a.shape[0]
  joined = jnp.stack([a, b], axis=-1).transpose(0, 2, 1).reshape(n, width)
  return joined.astype(dtype)


def scale_halves(prep: QKPrep, ref, half):
  """A norm weight operand's two halves [D/2] as float32 scales (None for a ref that is
  None)."""
  if ref is None:
    return None
  scale = lambda w: w.astype(jnp.float32) + (1.0 if prep.norm_plus_one else 0.0)
  return scale(ref[pl.ds(0, half)]), scale(ref[pl.ds(half, half)])


# ----------------------------------------------------------------------------- reference


def prepare_reference(x, cos, sin, weight=None, eps=None, plus_one=False):
  """float32 reference: x [B, H, D] normed over D with weight [D] (if given; scaled by
  1 + weight with plus_one), then rotated by cos, sin [B, D/2] (rotate-half layout);
  float32 out."""
  x = x.astype(jnp.float32)
  if weight is not None:
    scale = weight.astype(jnp.float32) + (1.0 if plus_one else 0.0)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale
  return rotate_half(x[:, None], cos[:, None], sin[:, None])[:, 0]  # as one token a row


def prepare_pair(q, k, prep: QKPrep, ops: PrepOperands):
  """prepare_reference of a decode step's queries [B, Hq, D] and new keys [B, Hkv, D]."""
  norm = prep.norm_eps is not None
  one = lambda x, w: prepare_reference(x, ops.cos, ops.sin, w if norm else None,
                                       prep.norm_eps, prep.norm_plus_one)
  return one(q, ops.q_scale), one(k, ops.k_scale)

"""Masked reductions over padded per-token arrays.

Layout everywhere in `jaxrl_post.rl`: per-sequence arrays are [B], per-token arrays are
[B, T], and a response mask [B, T] marks with 1 the tokens that belong to a completion.
Padded positions may hold anything (zeros, -inf logprobs, stale values): every function
here selects with `jnp.where` before arithmetic, never multiplies by the mask, because
`inf * 0` is NaN in the forward pass and `where(m, f(x), 0)` still sends NaN gradients
into `x` when `f` is not finite there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def valid(mask: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
  """float32 copies of `arrays` [B, T] with 0 at padded positions, safe for any arithmetic."""
  m = mask.astype(bool)
  return tuple(jnp.where(m, a.astype(F32), 0.0) for a in arrays)


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  return jnp.sum(jnp.where(mask.astype(bool), x, 0.0), axis=axis)


def masked_count(mask: jax.Array, axis=None) -> jax.Array:
  return jnp.sum(mask.astype(bool).astype(F32), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Mean over valid entries; 0 where there are none (no NaN from empty rows)."""
  return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Population variance over all valid entries, two-pass for f32 accuracy."""
  centred = x - masked_mean(x, mask)
  return masked_mean(centred * centred, mask)


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float) -> jax.Array:
  """(x - mean) / (std + eps) over the valid entries of the whole array; 0 at padding."""
  m = mask.astype(bool)
  x = jnp.where(m, x, 0.0)
  out = (x - masked_mean(x, m)) / (jnp.sqrt(masked_var(x, m)) + eps)
  return jnp.where(m, out, 0.0)


def sequence_lengths(mask: jax.Array) -> jax.Array:  # [B, T] -> [B]
  return masked_count(mask, axis=-1)


def to_tokens(per_sequence: jax.Array, mask: jax.Array) -> jax.Array:  # [B], [B, T] -> [B, T]
  """Broadcasts a per-sequence value to its valid tokens (0 at padding); a value that is
  already per token ([B, T], e.g. multi-turn reward-to-go advantages) is only masked."""
  values = per_sequence.astype(F32)
  return jnp.where(mask.astype(bool), values if values.ndim == 2 else values[:, None], 0.0)

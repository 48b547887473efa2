"""Attention against the paged KV pool: the decode step and the prefill chunk.

The pool holds every layer: ``[Hkv, L, num_pages, page_size, D]`` per K and V. The
functions take the whole pool plus a layer index rather than one layer's slice: inside the
scanned layer loop a slice ``pool[:, layer]`` would be a copy of that layer's pool per step.
Reshaped to ``[Hkv, L * num_pages, page_size, D]`` (free: the layout is contiguous) it is
exactly the pool layout of jaxrl_post.kernels.paged_attention, with layer l's page p at
``l * num_pages + p``, so the decode kernel reads it directly.

Decode runs the Pallas kernel on GPU and TPU and the plain-jnp path (gather the sequence's
pages, mask by length, float32 softmax) on the CPU, where Pallas only interprets, and for
sliding-window models, which the kernel does not cover. Prefill stays plain jnp.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_post.kernels import paged_attention
from jaxrl_post.models import layers as L


def use_kernel_default() -> bool:
  return jax.default_backend() in ("gpu", "tpu")


def gather_pages(pool, layer, page_table):  # [Hkv, L, P, ps, D], [], [B, M] -> [B, M*ps, Hkv, D]
  """Dense keys (or values) of each row's pages, in token order, in the model's layout."""
  pages = pool[:, layer, page_table]  # [Hkv, B, M, ps, D]
  hkv, b, m, ps, d = pages.shape
  return pages.transpose(1, 2, 3, 0, 4).reshape(b, m * ps, hkv, d)


def _kernel_decode(q, k_pool, v_pool, layer, page_table, lengths):
  hkv, n_layers, n_pages, ps, d = k_pool.shape
  flat = lambda pool: pool.reshape(hkv, n_layers * n_pages, ps, d)
  return paged_attention(q, flat(k_pool), flat(v_pool), page_table + layer * n_pages, lengths)


def _window(mask, q_pos, k_pos, sliding_window):
  if sliding_window is None:
    return mask
  return mask & ((q_pos[..., :, None] - k_pos[..., None, :]) < sliding_window)


def paged_decode_attention(q, k_pool, v_pool, layer, page_table, lengths, sliding_window=None,
                           use_kernel: Optional[bool] = None):
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
      None: the kernel on GPU/TPU when there is no sliding window.

  Returns:
    [B, Hq, D] in q's dtype.
  """
  if use_kernel is None:
    use_kernel = use_kernel_default() and sliding_window is None
  if use_kernel:
    if sliding_window is not None:
      raise ValueError("the paged attention kernel has no sliding window")
    return _kernel_decode(q, k_pool, v_pool, layer, page_table, lengths)
  k = gather_pages(k_pool, layer, page_table).astype(q.dtype)  # [B, S, Hkv, D]
  v = gather_pages(v_pool, layer, page_table).astype(q.dtype)
  k_pos = jnp.arange(k.shape[1])[None, :]  # [1, S]
  mask = k_pos < lengths[:, None]  # [B, S]
  mask = _window(mask[:, None, :], (lengths - 1)[:, None], k_pos, sliding_window)
  return L.attention(q[:, None], k, v, mask)[:, 0]


def paged_prefill_attention(q, k_pool, v_pool, layer, page_table, positions, kv_lengths,
                            sliding_window=None):
  """A chunk of prompt queries against their rows' pages (the chunk's own K/V included).

  Args:
    q: [B, T, Hq, D] queries of the chunk's tokens.
    k_pool: [Hkv, L, num_pages, page_size, D].
    v_pool: [Hkv, L, num_pages, page_size, D].
    layer: scalar int.
    page_table: [B, M] int32, each row covering at least ``kv_lengths`` tokens.
    positions: [B, T] int32 positions of the queries (causal: key s is seen iff s <= position).
    kv_lengths: [B] int32 tokens written so far (the chunk's valid tokens included).
    sliding_window: static, as in paged_decode_attention.

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  k = gather_pages(k_pool, layer, page_table).astype(q.dtype)  # [B, S, Hkv, D]
  v = gather_pages(v_pool, layer, page_table).astype(q.dtype)
  k_pos = jnp.arange(k.shape[1])[None, None, :]  # [1, 1, S]
  mask = (k_pos <= positions[:, :, None]) & (k_pos < kv_lengths[:, None, None])  # [B, T, S]
  return L.attention(q, k, v, _window(mask, positions, k_pos[0], sliding_window))

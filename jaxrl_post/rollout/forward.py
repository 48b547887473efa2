"""The policy's forward over the paged KV pool: one prefill chunk, one decode step.

Each layer is the model's own maths -- `qkv_projection` and `post_attention` from
jaxrl_post.models.transformer -- with the attention swapped for the paged one, so a model
change (biases, LoRA, RoPE scaling) reaches the rollout without a second implementation.
Within a layer the new tokens' K/V are written before attending, so a token sees itself.
Layers run under lax.scan with the pool in the carry: the scatter of the new K/V then
updates the pool in place instead of copying it.

The decode step has two attention modes. Plain: each row's page table covers all its
tokens. Cascade (a `SharedPrefix` is given): rows come in blocks of samples of one prompt,
the block's shared prompt pages are attended once per block, and each row's page table
holds only its own pages, which start right after the shared prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.models import layers as L
from jaxrl_post.models.transformer import Transformer, post_attention, qkv_projection
from jaxrl_post.rollout.attention import (SharedPrefix, cascade_decode_attention,
                                          paged_decode_attention, paged_prefill_attention)
from jaxrl_post.rollout.pages import TRASH_PAGE, KVPool


def _write_kv(pool: KVPool, layer, pages, slots, k, v) -> KVPool:  # [N] x2, [N, Hkv, D] x2
  """Stores N tokens' keys and values at (page, slot); rows aimed at page 0 are discarded."""
  k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [Hkv, N, D], as the index yields
  return KVPool(pool.k.at[:, layer, pages, slots].set(k.astype(pool.k.dtype)),
                pool.v.at[:, layer, pages, slots].set(v.astype(pool.v.dtype)))


def _target_pages(page_table, page_index, valid):  # [B, M], [B, T], [B, T] -> [B, T]
  """The page each token writes to; invalid tokens go to the sink page."""
  index = jnp.clip(page_index, 0, page_table.shape[1] - 1)
  pages = jnp.take_along_axis(page_table, index, axis=1)
  return jnp.where(valid, pages, TRASH_PAGE)


def _run_layers(model: Transformer, pool: KVPool, x, positions, attend_and_write):
  """Scans the layers over x [B, T, D] at positions [B, T].

  attend_and_write(pool, layer, q, k, v) stores the new K/V and returns (attn, pool).
  """
  cfg = model.config

  def body(carry, layer_in):
    x, pool = carry
    p, layer = layer_in
    q, k, v = qkv_projection(cfg, x, p, positions)
    attn, pool = attend_and_write(pool, layer, q, k, v)
    return (post_attention(cfg, x, p, attn), pool), None

  layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
  (x, pool), _ = jax.lax.scan(body, (x, pool), (model.layers.stacked(), layer_ids))
  return x, pool


def _final_logits(model: Transformer, h):  # [B, D] -> [B, V] float32
  return model.logits(L.rms_norm(h, model.final_norm[...], model.config.rms_norm_eps))


class _DecodeAttention:
  """The decode step's per-layer write + attention, with the step's fixed operands."""

  def __init__(self, cfg, page_table, lengths, active, shared: SharedPrefix | None):
    self.cfg, self.page_table, self.lengths, self.active = cfg, page_table, lengths, active
    self.positions = lengths[:, None]  # [B, 1]
    self.table_start = 0  # Position of each row's first page-table token.
    self.shared = shared
    if shared is not None:
      if cfg.sliding_window is not None:
        raise ValueError("cascade decode attention has no sliding window")
      rows_per_block = lengths.shape[0] // shared.lengths.shape[0]
      self.table_start = jnp.repeat(shared.lengths, rows_per_block)[:, None]  # [B, 1]
      # Free slots attend to nothing, and a block with no live row skips its prefix read.
      live = active.reshape(-1, rows_per_block).any(axis=1)  # [G]
      self.shared = shared._replace(lengths=jnp.where(live, shared.lengths, 0))
      self.suffix_lengths = jnp.where(active, lengths + 1 - self.table_start[:, 0], 0)  # [B]

  def _attend(self, pool, layer, q):  # q [B, Hq, D] -> [B, Hq, D]
    if self.shared is None:
      return paged_decode_attention(q, pool.k, pool.v, layer, self.page_table,
                                    self.lengths + 1, self.cfg.sliding_window)
    return cascade_decode_attention(q, pool.k, pool.v, layer, self.shared, self.page_table,
                                    self.suffix_lengths)

  def __call__(self, pool, layer, q, k, v):  # q [B, 1, Hq, D], k/v [B, 1, Hkv, D]
    ps = pool.k.shape[3]
    page_index = (self.positions - self.table_start) // ps  # [B, 1]
    pages = _target_pages(self.page_table, page_index, self.active[:, None])[:, 0]
    pool = _write_kv(pool, layer, pages, self.lengths % ps, k[:, 0], v[:, 0])
    return self._attend(pool, layer, q[:, 0])[:, None], pool


def decode_step(model: Transformer, pool: KVPool, tokens, lengths, page_table, active,
                shared: SharedPrefix | None = None):
  """Feeds each row's next token at position `lengths` and returns next-token logits.

  Args:
    model: the policy (parameters already bound).
    pool: the KV pool.
    tokens: [B] int32 the token to feed per row.
    lengths: [B] int32 tokens already in the row's pages (= the fed token's position).
    page_table: [B, M] int32, covering position `lengths` for active rows: all the row's
      pages, or with `shared` only those after its block's shared prefix.
    active: [B] bool; inactive rows write to the sink page and their logits are garbage.
    shared: None for plain paged attention; else cascade attention over blocks of
      B // G rows that share these prompt pages (the model must have no sliding window).

  Returns:
    (logits [B, V] float32, updated pool).
  """
  x = model.embed_tokens(tokens[:, None])  # [B, 1, D]
  attend = _DecodeAttention(model.config, page_table, lengths, active, shared)
  x, pool = _run_layers(model, pool, x, attend.positions, attend)
  return _final_logits(model, x[:, 0]), pool


class _PrefillAttention:
  """A prefill chunk's per-layer write + causal attention over the rows' pages."""

  def __init__(self, cfg, page_table, start, num_valid, width):
    self.cfg, self.page_table = cfg, page_table
    self.positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, T]
    self.valid = jnp.arange(width)[None, :] < num_valid[:, None]  # [B, T]
    self.kv_lengths = start + num_valid  # [B]

  def __call__(self, pool, layer, q, k, v):  # q [B, T, Hq, D], k/v [B, T, Hkv, D]
    ps = pool.k.shape[3]
    pages = _target_pages(self.page_table, self.positions // ps, self.valid)  # [B, T]
    flat = lambda a: a.reshape(-1, *a.shape[2:])
    pool = _write_kv(pool, layer, flat(pages), flat(self.positions % ps), flat(k), flat(v))
    attn = paged_prefill_attention(q, pool.k, pool.v, layer, self.page_table, self.positions,
                                   self.kv_lengths, self.cfg.sliding_window)
    return attn, pool


def prefill_chunk(model: Transformer, pool: KVPool, tokens, start, num_valid, page_table):
  """Writes a chunk of each row's prompt into its pages; logits of each row's last token.

  Args:
    model: the policy (parameters already bound).
    pool: the KV pool.
    tokens: [B, T] int32 chunk tokens, right-padded.
    start: [B] int32 position of each row's first chunk token (tokens before it are in pages).
    num_valid: [B] int32 real tokens in each row's chunk (>= 1).
    page_table: [B, M] int32 covering positions < start + num_valid.

  Returns:
    (logits [B, V] float32 after each row's last valid token, updated pool).
  """
  x = model.embed_tokens(tokens)  # [B, T, D]
  attend = _PrefillAttention(model.config, page_table, start, num_valid, tokens.shape[1])
  x, pool = _run_layers(model, pool, x, attend.positions, attend)
  last = jnp.take_along_axis(x, (num_valid - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
  return _final_logits(model, last), pool

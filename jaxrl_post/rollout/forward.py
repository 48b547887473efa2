"""The policy's forward over the paged KV pool: packed prefill chunks, one decode step.

Each layer is the model's own maths -- `qkv_projection` and `post_attention` from
jaxrl_post.models.transformer -- with the attention swapped for the paged one, so a model
change (biases, LoRA, RoPE scaling) reaches the rollout without a second implementation.
On a GPU a decode layer takes q, k and v from the model's `qkv_side_by_side` instead
(one product's output before the q/k norms and RoPE), and the attention kernels apply
the norms and RoPE as they read them (`prepares_in_kernel`): no launch writes the normed
and rotated q and k in between.
Within a layer the new tokens' K/V are written before attending, so a token sees itself
(on a GPU a decode step's write runs inside the attention kernel, rollout.attention).
Layers run under lax.scan with the pool in the carry: the scatter of the new K/V then
updates the pool in place instead of copying it. Given the weights one buffer per layer
(rollout.weights, a GPU's form) the layers are unrolled instead, the pool threaded through
them the same way, so no matmul reads a copied slice of a stacked weight.

The decode step has two attention modes. Plain: each row's page table covers all its
tokens. Cascade (a `SharedPrefix` is given): rows come in blocks of samples of one prompt,
the block's shared prompt pages are attended once per block, and each row's page table
holds only its own pages, which start right after the shared prefix.

On a rollout mesh (see rollout.layout) the layers' matrices run under GSPMD; the K/V write
and the attention run per device inside shard_map, each device seeing its data shard's
rows and pages (shard-local page ids) and its KV heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl_post.models import layers as L
from jaxrl_post.kernels.qk_prep import PrepOperands, QKPrep
from jaxrl_post.models.transformer import (Transformer, layer_ids, post_attention,
                                           qk_norm_weights, qkv_projection, qkv_side_by_side,
                                           rope_tables_at)
from jaxrl_post.rollout.attention import (SharedPrefix, appends_in_kernel,
                                          cascade_decode_append, cascade_decode_attention,
                                          paged_decode_append, paged_decode_attention,
                                          paged_prefill_attention, side_by_side)
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.rollout.pages import TRASH_PAGE, KVPool
from jaxrl_post.rollout.prefill_pack import PackedRows
from jaxrl_post.kernels.kv_write import write_pages
from jaxrl_post.sharding import constrain, target_platform


def _write_kv(pool: KVPool, layer, pages, slots, k, v) -> KVPool:  # [N] x2, [N, Hkv, D] x2
  """Stores N tokens' keys and values at (page, slot); rows aimed at page 0 are discarded.

  On TPU a Pallas kernel writes them in place (kernels.kv_write: XLA's scatter there would
  copy the whole pool into another layout and back, every layer); elsewhere a scatter.
  """
  if target_platform() == "tpu":
    hkv, n_layers, n_pages, ps, d = pool.k.shape
    flat = lambda buf: buf.reshape(hkv, n_layers * n_pages, ps, d)  # free: contiguous
    ids = layer * n_pages + pages
    return KVPool(write_pages(flat(pool.k), ids, slots, k).reshape(pool.k.shape),
                  write_pages(flat(pool.v), ids, slots, v).reshape(pool.v.shape))
  k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [Hkv, N, D], as the index yields
  return KVPool(pool.k.at[:, layer, pages, slots].set(k.astype(pool.k.dtype)),
                pool.v.at[:, layer, pages, slots].set(v.astype(pool.v.dtype)))


def _pool_layer(cfg, layer):  # scalar int (traced) -> (scalar bool, scalar int32)
  """(whether `layer` is a sliding one, its index among its kind's layers): with a window
  pool (rollout.pages.split_kv) a layer's K/V live at that index of the window pool
  (sliding layers) or of the main pool (global layers)."""
  local = np.asarray([w is not None for w in cfg.layer_windows])
  rank = np.where(local, np.cumsum(local) - 1, np.cumsum(~local) - 1).astype(np.int32)
  return L.layer_is_local(cfg, layer), jnp.asarray(rank)[layer]


def _write(cfg, pool: KVPool, window_map, layer, pages, slots, k, v) -> KVPool:
  """_write_kv into the layer's own pool: with a window pool a sliding layer writes the
  window pages its pages map to, a global layer the pages themselves, and each writes the
  other pool's sink."""
  if pool.wk is None:
    return _write_kv(pool, layer, pages, slots, k, v)
  local, rank = _pool_layer(cfg, layer)
  full = _write_kv(KVPool(pool.k, pool.v), jnp.where(local, 0, rank),
                   jnp.where(local, TRASH_PAGE, pages), slots, k, v)
  window = _write_kv(KVPool(pool.wk, pool.wv), jnp.where(local, rank, 0),
                     jnp.where(local, jnp.take(window_map, pages), TRASH_PAGE), slots, k, v)
  return KVPool(full.k, full.v, window.k, window.v)


def _attend(cfg, attention, window_map, layer, q, pool: KVPool, table, *args):
  """attention(q, k_pool, v_pool, layer, table, *args, sliding_window=, logit_cap=) with
  the layer's window, on the layer's own pool: with a window pool a sliding layer reads
  the window pages its table maps to, a global layer the table's pages."""
  cap = cfg.attn_logit_softcapping
  if pool.wk is None:
    attend = L.per_layer(cfg, lambda window: functools.partial(
        attention, sliding_window=window, logit_cap=cap))
    return attend(layer, q, pool.k, pool.v, layer, table, *args)
  local, rank = _pool_layer(cfg, layer)
  sliding = lambda: attention(q, pool.wk, pool.wv, rank, jnp.take(window_map, table), *args,
                              sliding_window=cfg.sliding_window, logit_cap=cap)
  full = lambda: attention(q, pool.k, pool.v, rank, table, *args, sliding_window=None,
                           logit_cap=cap)
  return jax.lax.cond(local, sliding, full)


def _target_pages(page_table, page_index, valid):  # [B, M], [B, T], [B, T] -> [B, T]
  """The page each token writes to; invalid tokens go to the sink page."""
  index = jnp.clip(page_index, 0, page_table.shape[1] - 1)
  pages = jnp.take_along_axis(page_table, index, axis=1)
  return jnp.where(valid, pages, TRASH_PAGE)


def _run_layers(model: Transformer, pool: KVPool, x, positions, attend_and_write,
                layers=None, adapters=None, project=None):
  """Runs the layers over x [B, T, D] at positions [B, T].

  attend_and_write(pool, layer, *project(x, p, layer)) stores the new K/V and returns
  (attn, pool); project defaults to qkv_projection's q, k and v.
  `layers` None scans the model's stacked layers; a tuple of per-layer weight dicts
  (rollout.weights) unrolls them, so each matmul reads its layer's buffer in place.
  `adapters` [B, T] int32: each token's adapter, for a model holding several
  (LoraConfig.adapters > 1).
  Returns (x, pool, experts): experts [B, T, L, k] int32, each MoE layer's choice for
  each token (what routing replay records), or None for a dense model.
  """
  cfg = model.config

  def body(carry, layer_in):
    x, pool = carry
    x = constrain(x, ("batch", None, "embed"))  # Rows stay on their data shard.
    p, layer = layer_in
    if adapters is not None:
      p = {**p, "lora_adapter": adapters}
    if project is None:
      projected = qkv_projection(cfg, x, p, positions, layer)
    else:
      projected = project(x, p, layer)
    attn, pool = attend_and_write(pool, layer, *projected)
    x, routing = post_attention(cfg, x, p, attn)
    return (x, pool), None if routing is None else routing.experts

  if layers is None:
    (x, pool), experts = jax.lax.scan(body, (x, pool),
                                      (model.layers.stacked(), layer_ids(cfg)))
  else:
    per_layer = []
    for i, p in enumerate(layers):
      (x, pool), routed = body((x, pool), (p, jnp.int32(i)))
      per_layer.append(routed)
    experts = None if per_layer[0] is None else jnp.stack(per_layer)
  if experts is not None:  # [L, B, T, k] -> [B, T, L, k]
    experts = jnp.moveaxis(experts, 0, 2)
  return x, pool, experts


def _final_logits(model: Transformer, h):  # [B, D] -> [B, V] float32
  return model.logits(model.final_rms_norm(h))


def cascade_refusal(cfg) -> str | None:
  """Why cascade decode cannot run this model (None: it can).

  Cascade attention splits each row's keys into the block's shared prompt pages and the
  row's own ones; its kernels have neither a window nor score soft-capping, so windowed
  models (Mistral, Gemma 3) decode with plain paged attention, which has both.
  """
  if cfg.any_window:
    return ("the model has sliding-window layers, and a block's shared prompt pages fall "
            "behind each sample's window at its own pace")
  if cfg.attn_logit_softcapping is not None:
    return "the model soft-caps attention scores"
  return None


def _decode_local(cfg, pool: KVPool, layer, q, k, v, page_table, lengths, active,
                  shared: SharedPrefix | None, window_map=None, prep=None):
  """One device's decode write + attention over its slots and pages (ids shard-local).

  q [B, Hq, D], k/v [B, Hkv, D]; or with `prep` ((QKPrep, PrepOperands): the kernels
  norm and rotate q and k) q is the layer's [B, Hq + 2 Hkv, D] and k, v are None. Every
  other operand as in `decode_step`. Returns (attn [B, Hq, D], pool).
  """
  ps = pool.k.shape[3]
  table_start = 0  # Position of each row's first page-table token.
  if shared is not None:
    if cascade_refusal(cfg):
      raise ValueError(f"no cascade decode attention: {cascade_refusal(cfg)}")
    rows_per_block = lengths.shape[0] // shared.lengths.shape[0]
    table_start = jnp.repeat(shared.lengths, rows_per_block)  # [B]
    # Free slots attend to nothing, and a block with no live row skips its prefix read.
    live = active.reshape(-1, rows_per_block).any(axis=1)  # [G]
    shared = shared._replace(lengths=jnp.where(live, shared.lengths, 0))
  page_index = (lengths - table_start) // ps  # [B]
  pages = _target_pages(page_table, page_index[:, None], active[:, None])[:, 0]
  # Keys each row attends over in its table, the new one included.
  seen = lengths + 1 if shared is None else jnp.where(active, lengths + 1 - table_start, 0)
  if prep is not None or (pool.wk is None and
                          appends_in_kernel(pool.k, cfg.attn_logit_softcapping)):
    qkv = q if prep is not None else side_by_side(q, k, v)
    return _append_local(cfg, pool, layer, qkv, pages, lengths % ps, page_table, seen,
                         shared, prep)
  pool = _write(cfg, pool, window_map, layer, pages, lengths % ps, k, v)
  if shared is None:
    attn = _attend(cfg, paged_decode_attention, window_map, layer, q, pool, page_table, seen)
  else:  # No window pool here (cascade_refusal above).
    attn = cascade_decode_attention(q, pool.k, pool.v, layer, shared, page_table, seen)
  return attn, pool


def _append_local(cfg, pool: KVPool, layer, qkv, pages, slots, page_table, seen,
                  shared: SharedPrefix | None, prep=None):
  """_decode_local on a GPU: the K/V write inside the attention kernel (rollout.attention's
  *_append), for plain and cascade attention alike."""
  prep, ops = prep if prep is not None else (None, None)
  if shared is None:
    attend = L.per_layer(cfg, lambda window: functools.partial(
        paged_decode_append, sliding_window=window, prep=prep, prep_ops=ops))
    attn, k_pool, v_pool = attend(layer, qkv, pool.k, pool.v, layer, pages, slots,
                                  page_table, seen)
  else:
    attn, k_pool, v_pool = cascade_decode_append(qkv, pool.k, pool.v, layer, pages, slots,
                                                 shared, page_table, seen, prep, ops)
  return attn, KVPool(k_pool, v_pool)


def pool_specs(layout: RolloutLayout, window: bool) -> KVPool:
  """The pool's PartitionSpecs, a window pool's included (KV heads over "tensor", pages
  over the batch axes)."""
  spec = layout.pool_spec
  return KVPool(spec, spec, spec, spec) if window else KVPool(spec, spec)


def _per_device_attention(layout: RolloutLayout, local_fn, operand_specs, bound,
                          window: bool = False):
  """attend(pool, layer, *operands) -> (attn, pool) that runs local_fn(pool, layer,
  *operands, *bound) on each device's shards: the pool as pool_specs lays it out, the
  layer index replicated, `bound` the step's operands every layer shares, and the
  attention out laid out as the first operand (the queries). operand_specs covers
  operands and bound in that order."""
  specs = pool_specs(layout, window)
  local = layout.per_device(local_fn, in_specs=(specs, P(), *operand_specs),
                            out_specs=(operand_specs[0], specs))
  return lambda pool, layer, *operands: local(pool, layer, *operands, *bound)


def _step_operands(layout: RolloutLayout, page_table, lengths, active,
                   shared: SharedPrefix | None):
  """A decode step's per-row operands every layer shares, and their specs."""
  rows = layout.rows_spec
  bound = (page_table, lengths, active) + (() if shared is None else (shared,))
  specs = (rows(2), rows(1), rows(1)) + (
      () if shared is None else (SharedPrefix(rows(2), rows(1)),))
  return bound, specs


def _decode_attention(layout: RolloutLayout, cfg, page_table, lengths, active,
                      shared: SharedPrefix | None, window_map=None):
  """attend_and_write for `_run_layers`: the per-device decode write + attention."""
  heads = layout.heads_spec(3)
  window = window_map is not None
  bound, specs = _step_operands(layout, page_table, lengths, active, shared)
  local = _per_device_attention(
      layout,
      lambda pool, layer, q, k, v, wmap, table, lens, act, *sh: _decode_local(
          cfg, pool, layer, q, k, v, table, lens, act, sh[0] if sh else None, wmap),
      (heads, heads, heads, layout.rows_spec(1) if window else P(), *specs),
      bound, window)

  def attend(pool, layer, q, k, v):  # q [B, 1, Hq, D], k/v [B, 1, Hkv, D]
    attn, pool = local(pool, layer, q[:, 0], k[:, 0], v[:, 0], window_map)
    return attn[:, None], pool

  return attend


# XLA:GPU's dot merger makes one product of several that read one input while one of them
# reads and writes at most this (xla_gpu_dot_merger_threshold_mb).
_DOT_MERGER_BYTES = 32 << 20


def prepares_in_kernel(cfg, layout: RolloutLayout, pool: KVPool, split: bool = True) -> bool:
  """Whether a decode step hands its attention kernels q, k and v as one product's output,
  before Qwen3's q/k norms and RoPE, which the kernels apply as they read them
  (kernels.qk_prep): where the K/V write runs in the kernel (a GPU, one pool), the layers
  share one RoPE base, no query scale follows RoPE (Gemma), LoRA adapts all of wq, wk and
  wv or none of them (adapted, the layers `split`: their adapters laid out by group_lora),
  and each tensor shard holds its own KV heads. A layer is then a launch shorter (two
  more with q/k norms): nothing writes the normed and rotated q and k before the kernel."""
  if pool.wk is not None or not appends_in_kernel(pool.k, cfg.attn_logit_softcapping):
    return False
  if cfg.rope_local_base_freq is not None and cfg.any_window:
    return False
  if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
    return False
  adapted = set(cfg.lora.targets) & {"wq", "wk", "wv"} if cfg.lora is not None else set()
  if adapted and (len(adapted) < 3 or not split):
    return False
  if layout.kv_axis is None and layout.mesh.shape["tensor"] > 1:
    return False
  # The product reads the three weights side by side, the product XLA's dot merger makes
  # of the three where one is small; beyond that a GEMM library could take it, and the
  # weights be copied into one buffer every step.
  shards = layout.mesh.shape["tensor"]
  wk_bytes = cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim // shards * \
      jnp.dtype(cfg.compute_dtype).itemsize
  return wk_bytes <= _DOT_MERGER_BYTES


def _prepared_decode(layout: RolloutLayout, cfg, page_table, lengths, active,
                     shared: SharedPrefix | None):
  """(project, attend_and_write) for `_run_layers` where prepares_in_kernel: each layer's
  q, k and v leave one product side by side, and the kernels norm and rotate them with
  the step's RoPE tables, made once for every layer."""
  rows = layout.rows_spec
  prep = QKPrep(norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
                norm_plus_one=cfg.norm_plus_one)
  weights = (P(), P()) if cfg.qk_norm else ()
  bound, specs = _step_operands(layout, page_table, lengths, active, shared)

  def local_fn(pool, layer, qkv, ops, table, lens, act, *sh):
    return _decode_local(cfg, pool, layer, qkv, None, None, table, lens, act,
                         sh[0] if sh else None, prep=(prep, ops))

  local = _per_device_attention(
      layout, local_fn, (layout.heads_spec(3), PrepOperands(rows(2), rows(2), *weights),
                         *specs), bound)
  cos, sin = rope_tables_at(cfg, lengths)  # [B, hd/2] each
  shards = layout.mesh.shape["tensor"] if layout.kv_axis else 1

  def project(x, p, layer):
    return qkv_side_by_side(cfg, x, p, shards), *qk_norm_weights(cfg, p)

  def attend(pool, layer, qkv, q_scale, k_scale):  # qkv [B, 1, Hq + 2 Hkv, D]
    attn, pool = local(pool, layer, qkv[:, 0], PrepOperands(cos, sin, q_scale, k_scale))
    return attn[:, None], pool

  return project, attend


def decode_step(model: Transformer, pool: KVPool, tokens, lengths, page_table, active,
                shared: SharedPrefix | None = None, layout: RolloutLayout | None = None,
                layers=None, window_map=None, adapters=None):
  """Feeds each row's next token at position `lengths` and returns next-token logits.

  Args:
    model: the policy (parameters already bound).
    pool: the KV pool.
    tokens: [B] int32 the token to feed per row.
    lengths: [B] int32 tokens already in the row's pages (= the fed token's position).
    page_table: [B, M] int32 shard-local page ids, covering position `lengths` for active
      rows: all the row's pages, or with `shared` only those after its block's shared
      prefix.
    active: [B] bool; inactive rows write to the sink page and their logits are garbage.
    shared: None for plain paged attention; else cascade attention over blocks of
      B // G rows that share these prompt pages (not for windowed models: cascade_refusal).
    layout: where the rows and pages live (default: one device).
    layers: None (the model's stacked layers) or per-layer weights (see _run_layers).
    window_map: [num_pages] int32 the window page of each page (a pool with a window
      pool: rollout.pages.WindowPages); None otherwise.
    adapters: [B] int32 each row's adapter (a model with several; None otherwise).

  Returns:
    (logits [B, V] float32, updated pool, the fed tokens' experts [B, L, k] int32 or None
    for a dense model).
  """
  layout = layout or RolloutLayout.build(model.config)
  x = model.embed_tokens(tokens[:, None])  # [B, 1, D]
  project = None
  if prepares_in_kernel(model.config, layout, pool, layers is not None):
    project, attend = _prepared_decode(layout, model.config, page_table, lengths, active,
                                       shared)
  else:
    attend = _decode_attention(layout, model.config, page_table, lengths, active, shared,
                               window_map)
  rows = None if adapters is None else adapters[:, None]
  x, pool, experts = _run_layers(model, pool, x, lengths[:, None], attend, layers, rows,
                                 project)
  return _final_logits(model, x[:, 0]), pool, None if experts is None else experts[:, 0]


def _prefill_local(cfg, pool: KVPool, layer, q, k, v, rows: PackedRows, window_map=None):
  """One device's prefill write + attention (q [B, T, Hq, D], k/v [B, T, Hkv, D])."""
  ps = pool.k.shape[3]
  flat = lambda a: a.reshape(-1, *a.shape[2:])
  pool = _write(cfg, pool, window_map, layer, flat(rows.write_pages),
                flat(rows.positions % ps), flat(k), flat(v))
  attn = _attend(cfg, paged_prefill_attention, window_map, layer, q, pool, rows.key_pages,
                 rows.key_segments, rows.key_starts, rows.positions, rows.segments)
  return attn, pool


def _prefill_attention(layout: RolloutLayout, cfg, rows: PackedRows, window_map=None):
  row_specs = rows._replace(**{f: layout.rows_spec(2) for f in rows._fields})
  heads = layout.heads_spec(4)
  window = window_map is not None
  return _per_device_attention(
      layout,
      lambda pool, layer, q, k, v, r, wmap: _prefill_local(cfg, pool, layer, q, k, v, r,
                                                            wmap),
      (heads, heads, heads, row_specs, layout.rows_spec(1) if window else P()),
      (rows, window_map), window)


def prefill_packed(model: Transformer, pool: KVPool, rows: PackedRows, last,
                   layout: RolloutLayout | None = None, layers=None, window_map=None,
                   adapters=None):
  """Writes packed prompt chunks into their pages; logits after each chunk's last token.

  Args:
    model: the policy (parameters already bound).
    pool: the KV pool.
    rows: [B, T] tokens with their positions, segments and write pages, and [B, K] key
      pages per row (see rollout.prefill_pack), shard-local page ids.
    last: [C] int32 flat index (row * T + column) of each chunk's last token.
    layout: where the rows and pages live (default: one device).
    layers: None (the model's stacked layers) or per-layer weights (see _run_layers).
    window_map: as in decode_step.
    adapters: [C] int32 each chunk's adapter (a model with several; None otherwise).

  Returns:
    (logits [C, V] float32 after each chunk's last token, updated pool, each row token's
    experts [B, T, L, k] int32 or None for a dense model).
  """
  layout = layout or RolloutLayout.build(model.config)
  x = model.embed_tokens(rows.tokens)  # [B, T, D]
  attend = _prefill_attention(layout, model.config, rows, window_map)
  per_token = None
  if adapters is not None:  # Padding (no segment) takes chunk 0's: its outputs are unused.
    per_token = jnp.take(adapters, jnp.maximum(rows.segments, 0), mode="clip")
  x, pool, experts = _run_layers(model, pool, x, rows.positions, attend, layers, per_token)
  ends = jnp.take(x.reshape(-1, x.shape[-1]), last, axis=0)  # [C, D]
  return _final_logits(model, ends), pool, experts

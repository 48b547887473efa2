"""Decoder-only transformer in Flax NNX with scanned (stacked) layers.

Every parameter carries `logical_axes` metadata naming its dimensions (LOGICAL_AXES);
jaxrl_post.sharding maps those names to mesh axes with one rules table per role, so model
code never mentions a mesh. Layers are stored stacked along a leading "layers" axis and run
with lax.scan, so compile time stays flat as depth grows.

The forward returns final (normed) hidden states; `lm_head_weight` gives the [D, V] matrix
separately, so losses can chunk over the vocabulary without materialising [T, V] logits.

Activations name their dimensions too (`sharding.constrain` at the residual stream, the
attention heads and the MLP hidden layer). Under `sharding.activation_rules` they are
sharded by the caller's rules table, so adding devices splits the rows (and heads) of the
work; elsewhere the constraints do nothing.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.kernels import PACKED_ATTENTION_RESIDUALS
from jaxrl_post.models import layers as L
from jaxrl_post.models import moe
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.sharding import constrain

LOGICAL_AXES = ("layers", "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "lora_rank",
                "expert", "router")
# How many leading (input) dims each layer matrix contracts; the rest are outputs.
_INPUT_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}

# Logical names of activation dimensions, for sharding.constrain.
_RESIDUAL = ("batch", None, "embed")  # [B, T, D]
_HEADS = ("batch", None, "heads", None)  # [B, T, Hq, hd]
_KV_HEADS = ("batch", None, "kv_heads", None)  # [B, T, Hkv, hd]
_MLP = ("batch", None, "mlp")  # [B, T, F]

_P = jax.checkpoint_policies
# "dots" saves the projections' outputs and the attention kernel's own residuals (output and
# log-sum-exp), never attention scores: dots_saveable would also save the blocked kernel's
# score tiles (its forward runs inside this checkpoint), the [S, S] memory the kernel avoids.
# The projections are the dots without batch dimensions; attention's carry batch and heads.
_REMAT = {
    "full": _P.nothing_saveable,
    "dots": _P.save_from_both_policies(_P.dots_with_no_batch_dims_saveable,
                                       _P.save_only_these_names(*PACKED_ATTENTION_RESIDUALS)),
    "dots_no_batch": _P.dots_with_no_batch_dims_saveable,
}


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """Per-layer parameter shapes and logical axes (without the leading layers axis)."""
  d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  hq, hkv = cfg.num_heads, cfg.num_kv_heads
  shapes = {
      "attn_norm": ((d,), ("embed",)),
      "wq": ((d, hq, hd), ("embed", "heads", "head_dim")),
      "wk": ((d, hkv, hd), ("embed", "kv_heads", "head_dim")),
      "wv": ((d, hkv, hd), ("embed", "kv_heads", "head_dim")),
      "wo": ((hq, hd, d), ("heads", "head_dim", "embed")),
      "mlp_norm": ((d,), ("embed",)),
      "w_gate": ((d, f), ("embed", "mlp")),
      "w_up": ((d, f), ("embed", "mlp")),
      "w_down": ((f, d), ("mlp", "embed")),
  }
  if cfg.moe is not None:  # Experts replace the dense MLP.
    for name in ("w_gate", "w_up", "w_down"):
      del shapes[name]
    shapes.update(moe.param_shapes(cfg))
  if cfg.qkv_bias:
    shapes["bq"] = ((hq, hd), ("heads", "head_dim"))
    shapes["bk"] = ((hkv, hd), ("kv_heads", "head_dim"))
    shapes["bv"] = ((hkv, hd), ("kv_heads", "head_dim"))
  if cfg.o_bias:
    shapes["bo"] = ((d,), ("embed",))
  if cfg.qk_norm:  # One [hd] scale shared by every head: small, so left replicated.
    shapes["q_norm"] = ((hd,), ("head_dim",))
    shapes["k_norm"] = ((hd,), ("head_dim",))
  if cfg.sandwich_norms:  # Gemma's norms on the attention and MLP outputs.
    shapes["post_attn_norm"] = ((d,), ("embed",))
    shapes["post_mlp_norm"] = ((d,), ("embed",))
  return shapes


def lora_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """LoRA A [in..., r] and B [r, out...] per target (without the leading layers axis)."""
  if cfg.lora is None:
    return {}
  base, r = layer_param_shapes(cfg), cfg.lora.rank
  shapes = {}
  for name in cfg.lora.targets:
    (shape, axes), n = base[name], _INPUT_DIMS[name]
    shapes[f"{name}_lora_a"] = ((*shape[:n], r), (*axes[:n], "lora_rank"))
    shapes[f"{name}_lora_b"] = ((r, *shape[n:]), ("lora_rank", *axes[n:]))
  return shapes


def _scaled_normal(key, shape, dtype):
  x = jax.random.normal(key, shape, dtype)
  if isinstance(x, jax.core.Tracer):
    # Compiled (init_model_compiled), the barrier keeps XLA from folding the 0.02 into the
    # sampler's own constants (one rounding apart), so it draws init_model's bits; eagerly
    # it would cost a program of its own per shape.
    x = jax.lax.optimization_barrier(x)
  return 0.02 * x


def _init_value(name, shape, key, dtype, norm_plus_one=False):
  if name.endswith("norm") or name.startswith("b") or name.endswith("lora_b"):
    # Norms start as the identity (w = 1, or 0 where they scale by 1 + w); biases and
    # LoRA B at zero (so an adapter starts as a no-op).
    one = name.endswith("norm") and not norm_plus_one
    return (jnp.ones if one else jnp.zeros)(shape, dtype)
  return _scaled_normal(key, shape, dtype)


class DecoderLayers(nnx.Module):
  """All decoder layers' parameters, stacked along a leading "layers" axis."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    base, lora = layer_param_shapes(cfg), lora_param_shapes(cfg)
    self.names = tuple(base) + tuple(lora)
    for name, (shape, axes) in {**base, **lora}.items():
      value = _init_value(name, (cfg.num_layers, *shape), rngs.params(), dtype,
                          cfg.norm_plus_one)
      kind = nnx.LoRAParam if name in lora else nnx.Param
      setattr(self, name, kind(value, logical_axes=("layers", *axes)))

  def stacked(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in self.names}


class KVCache(NamedTuple):
  """Dense KV cache; slot s of a row holds the token at position s."""

  k: jax.Array  # [L, B, S, Hkv, D]
  v: jax.Array  # [L, B, S, Hkv, D]

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class Transformer(nnx.Module):
  """Llama-family decoder: GQA, RoPE, RMSNorm, SwiGLU, tied or untied embeddings.

  Architecture details (Q/K/V and output biases, Qwen3's q/k norms, a sliding window,
  Gemma 3's extra norms) are config flags that add parameters to the stacked layers; see
  layer_param_shapes. Per-layer differences (Gemma 3's window and RoPE base) are data the
  layer scan carries: each layer gets its index and picks its variant (layers.per_layer).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    dtype = jnp.dtype(cfg.param_dtype)
    d, v = cfg.hidden_size, cfg.vocab_size
    self.embed = nnx.Param(_scaled_normal(rngs.params(), (v, d), dtype),
                           logical_axes=("vocab", "embed"))
    self.layers = DecoderLayers(cfg, rngs=rngs)
    self.final_norm = nnx.Param(_init_value("final_norm", (d,), None, dtype, cfg.norm_plus_one),
                                logical_axes=("embed",))
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Param(_scaled_normal(rngs.params(), (d, v), dtype),
                               logical_axes=("embed", "vocab"))
    if cfg.value_head:
      self.value_w = nnx.Param(_scaled_normal(rngs.params(), (d,), dtype),
                               logical_axes=("embed",))
      self.value_b = nnx.Param(jnp.zeros((), dtype), logical_axes=())

  def __call__(self, tokens, positions, segment_ids=None,
               attention: L.TrainingAttention = L.TrainingAttention()):
    """Packed forward: [B, T] x3 -> final normed hidden states [B, T, D], compute dtype.

    attention: how rows attend; the default keeps long rows off [T, T] score tensors.
    """
    return self.forward_routed(tokens, positions, segment_ids, attention)[0]

  def forward_routed(self, tokens, positions, segment_ids=None,
                     attention: L.TrainingAttention = L.TrainingAttention(), recorded=None,
                     replay: bool = True, layers=None):
    """The packed forward, and each MoE layer's routing (moe.Routing, [L, ...]; None for
    a dense model).

    layers: the decoder's weights as a tuple of per-layer dicts (rollout.weights' split
      form), unrolled so each matmul reads its layer's buffers where they lie (XLA:GPU
      copies a scanned layer's slices out of the stack first); None scans the model's own
      stacked layers.

    recorded: [B, T, L, k] expert ids recorded by the rollout engine (moe.NO_EXPERT where
      none was), or None.
    replay: the MoE layers take the recorded experts instead of their own top-k (routing
      replay); False only compares them with their own choice.
    """
    cfg = self.config
    if segment_ids is None:
      segment_ids = jnp.ones_like(tokens)
    attend = L.per_layer(cfg, lambda window: L.packed_attention_fn(
        segment_ids, positions, window, attention, cfg.attn_logit_softcapping))
    x = constrain(self.embed_tokens(tokens), _RESIDUAL)
    valid = segment_ids != 0

    rope_in_attention = L.rope_in_attention(cfg, tokens.shape[1], attention)
    # Every layer rotates by the same tables but Gemma 3's mixed ones: made once, outside
    # the (rematerialised) layer loop.
    tables = None
    if rope_in_attention and not cfg.mixed_windows:
      tables = _rope_tables(cfg, positions, x.dtype)

    def body(x, layer_in):
      p, layer, rec = layer_in
      if rope_in_attention:
        own = _rope_tables(cfg, positions, x.dtype, layer) if tables is None else tables
        attn = attend(layer, *qkv_before_rope(cfg, x, p), own)
      else:
        attn = attend(layer, *qkv_projection(cfg, x, p, positions, layer))
      return post_attention(cfg, x, p, attn, rec, valid, replay)

    body = _maybe_remat(body, cfg.remat)
    recorded = moe.recorded_layers(recorded, cfg.num_layers)
    if layers is None:
      x, routing = jax.lax.scan(body, x, (self.layers.stacked(), layer_ids(cfg), recorded))
    else:
      routed = []
      for i, p in enumerate(layers):
        x, r = body(x, (p, jnp.int32(i), None if recorded is None else recorded[i]))
        routed.append(r)
      routing = jax.tree.map(lambda *r: jnp.stack(r), *routed)
    return constrain(self.final_rms_norm(x), _RESIDUAL), routing

  def forward_cached(self, tokens, positions, cache: KVCache, write_start):
    """Forward that writes this chunk's K/V into `cache` at `write_start` per row.

    Args:
      tokens: [B, T] ids.
      positions: [B, T] positions; slot == position in the dense cache.
      cache: the dense cache, [L, B, S, Hkv, D] per tensor.
      write_start: [B] first slot to write each row's T new entries to.

    Returns:
      (hidden [B, T, D], updated cache).
    """
    cfg = self.config
    attend = L.per_layer(cfg, lambda window: _cache_attention(
        cfg, L.cache_mask(positions, cache.k.shape[2], window)))
    x = self.embed_tokens(tokens)

    def body(x, layer_in):
      p, ck, cv, layer = layer_in
      (x, _), ck, cv = _layer_cached(cfg, x, p, positions, layer, attend, ck, cv, write_start)
      return x, (ck, cv)

    x, (k, v) = jax.lax.scan(body, x, (self.layers.stacked(), cache.k, cache.v,
                                       layer_ids(cfg)))
    return self.final_rms_norm(x), KVCache(k, v)

  def final_rms_norm(self, x):  # [..., D] -> [..., D]
    cfg = self.config
    return L.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_plus_one)

  def lm_head_weight(self):  # -> [D, V]
    """The output projection, transposed embeddings when tied."""
    if self.config.tie_word_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def logits(self, hidden):  # [..., D] -> [..., V] float32
    w = self.lm_head_weight().astype(hidden.dtype)
    logits = jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)
    return L.softcap(logits, self.config.final_logit_softcapping)

  def values(self, hidden):  # [..., D] -> [...] float32
    """The critic's value of each position's state (PPO); needs cfg.value_head."""
    w = self.value_w[...].astype(jnp.float32)
    return hidden.astype(jnp.float32) @ w + self.value_b[...].astype(jnp.float32)

  def embed_tokens(self, tokens):  # [B, T] -> [B, T, D] in the compute dtype
    cfg = self.config
    x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.compute_dtype)
    if cfg.scale_embeddings:  # Gemma: the factor rounded to the compute dtype, as HF does.
      x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    return x


def _maybe_remat(fn, policy: str):
  if policy == "none":
    return fn
  return jax.checkpoint(fn, policy=_REMAT[policy], prevent_cse=False)


def _dense(cfg: ModelConfig, x, p, name):  # [B, T, in...] -> [B, T, out...]
  """x @ p[name] over its input dims, plus the LoRA delta when the layer has one.

  The tokens are one [B * T] axis inside: the weight gradient is then a plain matmul of
  two 2-D operands, where [B, T] axes made XLA's CPU backend transpose each activation
  gradient into a [features, B * T] copy first (bench_step: the train phase 2.12 -> 1.87 s).
  """
  lead = x.shape[:2]
  x = x.reshape((-1,) + x.shape[2:])
  n = _INPUT_DIMS[name]
  y = jnp.tensordot(x, p[name].astype(x.dtype), axes=n)
  if f"{name}_lora_a" in p:
    a, b = p[f"{name}_lora_a"].astype(x.dtype), p[f"{name}_lora_b"].astype(x.dtype)
    if a.ndim == n + 2:  # One adapter per row, [B, in..., r] (serve's batched multi-LoRA).
      low_rank = lambda xr, ar, br: jnp.tensordot(jnp.tensordot(xr, ar, axes=n), br, axes=1)
      delta = jax.vmap(low_rank)(x.reshape(lead + x.shape[1:]), a, b)
      delta = delta.reshape((-1,) + delta.shape[2:])
    else:
      # The dot's f32 result (rounded as a bf16 dot rounds its own) keeps XLA from merging
      # it with x @ W: the merged dot's operand, W and A side by side, was a copy of W made
      # at every decode step on a GPU.
      xa = jnp.tensordot(x, a, axes=n, preferred_element_type=jnp.float32).astype(x.dtype)
      if cfg.lora.adapters > 1:  # Each token keeps its own adapter's rank components.
        own = p["lora_adapter"].reshape(-1, 1)
        xa = xa * (own == jnp.arange(a.shape[-1]) // (a.shape[-1] // cfg.lora.adapters))
      delta = jnp.tensordot(xa, b, axes=1)
    y = y + (cfg.lora.scale * delta).astype(y.dtype)
  return y.reshape(lead + y.shape[1:])


# Matrices that read the same input: their LoRA A products can be one matmul.
_SHARED_INPUT = (("wq", "wk", "wv"), ("w_gate", "w_up"))


def _group_key(names) -> str:
  return "+".join(names) + "_lora_a"


def group_lora(cfg: ModelConfig, p: dict) -> dict:
  """One layer's weights `p` with its LoRA adapters also laid out for _dense_shared: the
  A matrices of each group of _SHARED_INPUT side by side ([in, m * r]), and each B padded
  with zero rows to [m * r, out...] at its own block. For a program that runs many small
  forwards over the same weights (the GPU's decode loop, which makes this once per call):
  each group's low-rank product is then two matmuls instead of a merged A product that
  XLA slices back apart and m B products, and neither layout is rebuilt at every step.
  Leading axes ride along: serve lays out its rows' adapters ([L, B, in, r] A's, one
  adapter per row) once for all layers and steps of a batch."""
  out = dict(p)
  for names in _SHARED_INPUT:
    lora = [n for n in names if f"{n}_lora_a" in p]
    if len(lora) < 2:
      continue
    a = p[f"{lora[0]}_lora_a"]
    lead, r = a.ndim - 2, a.shape[-1]  # Shared-input matrices have one input axis.
    out[_group_key(lora)] = jnp.concatenate([p[f"{n}_lora_a"] for n in lora], axis=-1)
    for i, n in enumerate(lora):
      b = p[f"{n}_lora_b"]
      pad = [(0, 0)] * b.ndim
      pad[lead] = (i * r, (len(lora) - 1 - i) * r)
      out[f"{n}_lora_b_padded"] = jnp.pad(b, pad)
  return out


def _dense_shared(cfg: ModelConfig, x, p, names):
  """(_dense(cfg, x, p, name) for name in names), the matrices reading the same x; with
  the adapters laid out by group_lora, their low-rank deltas from one A product."""
  lora = [n for n in names if f"{n}_lora_a" in p]
  if len(lora) < 2 or _group_key(lora) not in p:
    return tuple(_dense(cfg, x, p, n) for n in names)
  lead = x.shape[:2]
  x = x.reshape((-1,) + x.shape[2:])
  ys = {n: jnp.tensordot(x, p[n].astype(x.dtype), axes=1) for n in names}
  a = p[_group_key(lora)].astype(x.dtype)
  if a.ndim == 3:  # One adapter per row, [B, in, m * r] (serve's batched multi-LoRA).
    rowwise = jax.vmap(lambda u, w: jnp.tensordot(u, w, axes=1))
    xa = rowwise(x.reshape(lead + x.shape[1:]), a)  # [B, T, m * r]
    for n in lora:
      delta = rowwise(xa, p[f"{n}_lora_b_padded"].astype(x.dtype))
      ys[n] = ys[n] + (cfg.lora.scale * delta.reshape(ys[n].shape)).astype(ys[n].dtype)
    return tuple(ys[n].reshape(lead + ys[n].shape[1:]) for n in names)
  # float32 out, as in _dense: XLA would otherwise merge x @ A with x @ W (a copy of W).
  xa = jnp.tensordot(x, a, axes=1, preferred_element_type=jnp.float32).astype(x.dtype)
  if cfg.lora.adapters > 1:  # Each token keeps its own adapter's rank components.
    r = a.shape[-1] // len(lora)
    own = p["lora_adapter"].reshape(-1, 1)
    xa = xa * (own == (jnp.arange(a.shape[-1]) % r) // (r // cfg.lora.adapters))
  for n in lora:  # The zero rows drop the other matrices' rank components.
    delta = jnp.tensordot(xa, p[f"{n}_lora_b_padded"].astype(x.dtype), axes=1)
    ys[n] = ys[n] + (cfg.lora.scale * delta).astype(ys[n].dtype)
  return tuple(ys[n].reshape(lead + ys[n].shape[1:]) for n in names)


def _norm(cfg: ModelConfig, x, w):
  return L.rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_plus_one)


def layer_ids(cfg: ModelConfig):  # [L] int32, scanned beside the stacked parameters
  return jnp.arange(cfg.num_layers, dtype=jnp.int32)


def _rope_inv_freq(cfg: ModelConfig, layer):  # -> [hd / 2]
  """The layer's RoPE frequencies: Gemma 3's sliding layers have a base of their own."""
  full = jnp.asarray(L.rope_inv_freq(cfg))
  if cfg.rope_local_base_freq is None or not cfg.any_window:
    return full
  local = jnp.asarray(L.rope_inv_freq(cfg, local=True))
  if not cfg.mixed_windows:
    return local
  if layer is None:
    raise ValueError("a model with windowed and full layers needs the layer index")
  return jnp.where(L.layer_is_local(cfg, layer), local, full)


def qkv_projection(cfg: ModelConfig, x, p, positions, layer=None):  # -> 3 x [B, T, H, hd]
  """Pre-norm, Q/K/V projections (with biases, LoRA and Qwen3's q/k norms) and RoPE.

  Every forward (training, dense cache, the rollout's paged one) gets its keys here, so
  the cached K are normed and rotated the same way wherever they are written. `layer`
  (scalar int, traced) picks per-layer RoPE where layers differ (Gemma 3).

  Queries leave here pre-scaled by sqrt(head_dim / query_pre_attn_scalar): every
  attention path (plain, paged, kernels) divides scores by sqrt(head_dim), so this gives
  Gemma's 1 / sqrt(query_pre_attn_scalar) without a scale argument in each of them.
  """
  dt = x.dtype
  q, k, v = _projected(cfg, x, p)
  inv_freq = _rope_inv_freq(cfg, layer)
  q, k = L.apply_rope(q, positions, inv_freq), L.apply_rope(k, positions, inv_freq)
  if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
    q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), dt)
  return constrain(q, _HEADS), constrain(k, _KV_HEADS), constrain(v, _KV_HEADS)


def qkv_before_rope(cfg: ModelConfig, x, p):  # -> 3 x [B, T, H, hd]
  """qkv_projection's q, k and v with q and k not yet rotated, for an attention that
  rotates them itself (layers.rope_in_attention; never with Gemma's query scale)."""
  q, k, v = _projected(cfg, x, p)
  return constrain(q, _HEADS), constrain(k, _KV_HEADS), constrain(v, _KV_HEADS)


def qkv_side_by_side(cfg: ModelConfig, x, p, shards: int = 1):  # -> [B, T, Hq + 2 Hkv, hd]
  """qkv_projection's q, k and v as one product's output, before Qwen3's q/k norms and
  RoPE: for attention kernels that apply those as they read q and k (kernels.qk_prep)
  and take q, k and v as one array. As three products (which XLA merges into one) they
  were concatenated for such a kernel, a copy per layer; here the three weights are
  side by side, which XLA reads in place inside the product's fusion.

  shards: the tensor-parallel shards the heads are split over. Each shard's heads come
  side by side (its q heads, then its k, then its v), so the shard's part of the heads
  axis is its own q, k and v. LoRA on wq, wk and wv needs all three adapted and laid out
  by group_lora (their B's side by side too: one low-rank product); not for Gemma's
  query scale.
  """
  h = _norm(cfg, x, p["attn_norm"])
  names = ("wq", "wk", "wv")
  lead, d = h.shape[:2], h.shape[-1]
  h = h.reshape(-1, d)
  y = jnp.tensordot(h, _by_shard([p[n] for n in names], shards, h.dtype), axes=1)
  if cfg.qkv_bias:
    y = y + _by_shard([p[n] for n in ("bq", "bk", "bv")], shards, h.dtype)
  if _group_key(names) in p:
    y = y + _side_by_side_delta(cfg, h.reshape(*lead, d), p, names, shards).reshape(y.shape)
  elif any(f"{n}_lora_a" in p for n in names):
    raise ValueError("qkv_side_by_side takes LoRA on all of wq, wk and wv, laid out by "
                     "group_lora")
  return constrain(y.reshape(*lead, -1, cfg.head_dim), _HEADS)


def _by_shard(ts, shards: int, dtype):  # [..., H_i, hd] each -> [..., N]
  """Arrays whose last two axes are heads and head_dim side by side per tensor shard:
  shard j's heads of ts[0], then its heads of ts[1], ... (the heads split contiguously)."""
  per_shard = [t.astype(dtype).reshape(*t.shape[:t.ndim - 2], shards, -1) for t in ts]
  joined = jnp.concatenate(per_shard, axis=-1)
  return joined.reshape(*joined.shape[:joined.ndim - 2], -1)


def _side_by_side_delta(cfg: ModelConfig, h, p, names, shards):  # h [B, T, D] -> [B, T, N]
  """The grouped LoRA delta of `names` laid out as qkv_side_by_side lays their outputs."""
  a = p[_group_key(names)].astype(h.dtype)
  b = _by_shard([p[f"{n}_lora_b_padded"] for n in names], shards, h.dtype)
  if a.ndim == 3:  # One adapter per row, [B, in, m * r] (serve's batched multi-LoRA).
    rowwise = jax.vmap(lambda u, w: jnp.tensordot(u, w, axes=1))
    return cfg.lora.scale * rowwise(rowwise(h, a), b)
  # float32 out, as in _dense: XLA would otherwise merge x @ A with x @ W (a copy of W).
  xa = jnp.tensordot(h, a, axes=1, preferred_element_type=jnp.float32).astype(h.dtype)
  if cfg.lora.adapters > 1:  # Each token keeps its own adapter's rank components.
    r = a.shape[-1] // len(names)
    own = p["lora_adapter"][..., None]  # [B, T, 1]
    xa = xa * (own == (jnp.arange(a.shape[-1]) % r) // (r // cfg.lora.adapters))
  return (cfg.lora.scale * jnp.tensordot(xa, b, axes=1)).astype(h.dtype)


def qk_norm_weights(cfg: ModelConfig, p):  # -> (q_norm, k_norm) [hd], or Nones
  """Qwen3's q and k norm weights, for a kernel that norms q and k itself (with
  rms_norm_eps and norm_plus_one), or (None, None) for a model without q/k norms."""
  return (p["q_norm"], p["k_norm"]) if cfg.qk_norm else (None, None)


def rope_tables_at(cfg: ModelConfig, positions):  # [...] -> cos, sin [..., hd/2] float32
  """RoPE's tables at `positions`, for a model whose layers share one RoPE base (not
  Gemma 3's mixed layers)."""
  if cfg.rope_local_base_freq is not None and cfg.any_window:
    raise ValueError("the model's layers rotate with two RoPE bases: tables per layer")
  return L.rope_tables(positions, _rope_inv_freq(cfg, None))


def _rope_tables(cfg: ModelConfig, positions, dtype, layer=None):  # -> cos, sin [B, T, hd/2]
  """The RoPE tables qkv_projection rotates with, in `dtype` (as it casts them)."""
  return tuple(t.astype(dtype) for t in L.rope_tables(positions, _rope_inv_freq(cfg, layer)))


def _projected(cfg: ModelConfig, x, p):  # -> q, k, v [B, T, H, hd] before RoPE
  dt = x.dtype
  h = _norm(cfg, x, p["attn_norm"])
  q, k, v = _dense_shared(cfg, h, p, ("wq", "wk", "wv"))
  if cfg.qkv_bias:
    q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
  if cfg.qk_norm:  # Per head over head_dim, before RoPE (as transformers' Qwen3 does).
    q = _norm(cfg, q, p["q_norm"])
    k = _norm(cfg, k, p["k_norm"])
  return q, k, v


def post_attention(cfg: ModelConfig, x, p, attn, recorded=None, valid=None,
                   replay: bool = True):
  """Output projection + residual, then the feed-forward block + residual: the gated MLP
  (SwiGLU or GeGLU) or the mixture of experts.

  With sandwich_norms (Gemma) each block's output is normed before its residual add.
  x [B, T, D], attn [B, T, Hq, hd] -> (x [B, T, D], moe.Routing or None for a dense MLP).
  recorded [B, T, k], valid [B, T] and replay reach the MoE block (see moe.moe_block).
  """
  dt = x.dtype
  out = _dense(cfg, constrain(attn, _HEADS), p, "wo")
  if cfg.o_bias:
    out = out + p["bo"].astype(dt)
  if cfg.sandwich_norms:
    out = _norm(cfg, out, p["post_attn_norm"])
  x = constrain(x + out, _RESIDUAL)
  h = _norm(cfg, x, p["mlp_norm"])
  if cfg.moe is not None:
    out, routing = moe.moe_block(cfg, h, p, recorded, valid, replay)
  else:
    gate, up = _dense_shared(cfg, h, p, ("w_gate", "w_up"))
    hidden = constrain(_ACTIVATIONS[cfg.mlp_activation](gate) * up, _MLP)
    out, routing = _dense(cfg, hidden, p, "w_down"), None
  if cfg.sandwich_norms:
    out = _norm(cfg, out, p["post_mlp_norm"])
  return constrain(x + out, _RESIDUAL), routing


# gelu_tanh is transformers' gelu_pytorch_tanh (Gemma's hidden_activation).
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _write(cache, new, start):  # [B, S, H, D], [B, T, H, D], [B]
  write_row = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, 0)
  return jax.vmap(write_row)(cache, new, start)


def _cache_attention(cfg: ModelConfig, mask):
  return lambda q, ck, cv: L.attention(q, ck.astype(q.dtype), cv.astype(q.dtype), mask,
                                       cfg.attn_logit_softcapping)


def _layer_cached(cfg: ModelConfig, x, p, positions, layer, attend, ck, cv, start):
  q, k, v = qkv_projection(cfg, x, p, positions, layer)
  ck, cv = _write(ck, k, start), _write(cv, v, start)
  return post_attention(cfg, x, p, attend(layer, q, ck, cv)), ck, cv


def init_lora(model: Transformer, seed: int = 0) -> None:
  """(Re)initialises the LoRA adapters in place: A random, B zero, so W is unchanged."""
  cfg = model.config
  for i, (name, (shape, _)) in enumerate(lora_param_shapes(cfg).items()):
    key = jax.random.fold_in(jax.random.key(seed), i)
    value = _init_value(name, (cfg.num_layers, *shape), key, jnp.dtype(cfg.param_dtype),
                        cfg.norm_plus_one)
    getattr(model.layers, name).set_value(value)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A model with fresh weights, drawn op by op: a sampler compiled per parameter shape,
  which a process building many models (tests, sweeps) compiles once for all of them."""
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def init_model_compiled(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """init_model's weights bit for bit, drawn by one compiled program: a process that builds
  one model (the training command) loads it from the compilation cache rather than
  compiling a sampler per parameter shape (1.1 s of a short CPU run's 8.6)."""
  return _init_model(cfg, jax.random.key(seed))  # The key nnx.Rngs(seed) makes.


@functools.partial(nnx.jit, static_argnums=0)
def _init_model(cfg: ModelConfig, key: jax.Array) -> Transformer:
  return Transformer(cfg, rngs=nnx.Rngs(key))


def abstract_model(cfg: ModelConfig) -> Transformer:
  """Shapes only, no memory: for full-size shape checks and sharded initialisation."""
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def logical_axes(model: Transformer, kind=nnx.Param) -> dict:
  """Nested dict matching `params_of(model, kind)`, each leaf a tuple of axis names."""
  axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], nnx.state(model, kind),
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(axes)


def is_adapter(path) -> bool:
  """Whether the parameter at a `jax.tree_util` key path is a LoRA adapter (A or B)."""
  return "_lora_" in str(path[-1])


def split_adapters(params: dict) -> tuple[dict, dict]:
  """(LoRA adapters, every other parameter) of a nested parameter dict; no copies."""
  halves: tuple[dict, dict] = ({}, {})
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    node = halves[0 if is_adapter(path) else 1]
    for key in path[:-1]:
      node = node.setdefault(key.key, {})
    node[path[-1].key] = x
  return halves


def stack_adapters(adapters: list[dict]) -> dict:
  """Adapters of one rank and targets (split_adapters dicts) side by side on the rank axis:
  the LoRA params of a model whose LoraConfig holds len(adapters) of them."""
  def stack(path, *xs):
    return jnp.concatenate(xs, axis=-1 if str(path[-1].key).endswith("_lora_a") else 1)
  return jax.tree_util.tree_map_with_path(stack, *adapters)


def params_of(model: Transformer, kind=nnx.Param) -> dict:
  """The model's parameters (or those of `kind`, e.g. nnx.LoRAParam) as a nested dict."""
  return nnx.to_pure_dict(nnx.state(model, kind))


def with_params(model: Transformer, params: dict) -> Transformer:
  """A model with the same structure whose parameters are `params` (works under jit)."""
  graphdef, state = nnx.split(model)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def param_count(model: Transformer) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def positions_from_segments(segment_ids):  # [B, T] -> [B, T]
  """Positions restarting at 0 in each packed segment (segments are contiguous)."""
  t = segment_ids.shape[1]
  idx = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
  return idx - start_idx


"""Building blocks of the decoder: RMSNorm, RoPE and masked GQA attention.

Pure functions on arrays. `attention` is the plain-jnp path shared by short packed rows and
the dense-cache decoder; `packed_attention_fn` picks, once per packed forward, between it
and the packed-attention kernels of jaxrl_post.kernels (Triton on GPU, splash on TPU, a
blocked jnp FlashAttention on CPU), which never hold [S, S] float32 scores for long rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_post.kernels import (PackedAttentionConfig, packed_attention, rotate_half,
                                rotates_in_kernel)
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.sharding import active_rules, logical_to_spec, spec_axes, target_platform

# A large finite negative instead of -inf: rows with nothing to attend to (padding)
# then give a uniform softmax instead of NaNs that would poison gradients.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def rms_norm(x, weight, eps: float, plus_one: bool = False):  # [..., D], [D] -> [..., D]
  """RMSNorm computed in float32 (as Hugging Face does), returned in x's dtype.

  plus_one: Gemma's form, scaling by (1 + w) in float32 before the cast back (Llama's
  casts first, then scales by w in x's dtype); the two differ only below float32.
  """
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
  return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:  # [head_dim // 2]
  """Inverse RoPE frequencies, including linear and Llama 3 scaling.

  local: those of Gemma 3's sliding-window layers, rope_local_base_freq without scaling.
  """
  hd = cfg.head_dim
  theta = cfg.rope_local_base_freq if local else cfg.rope_theta
  inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
  if local:
    return inv_freq.astype(np.float32)
  s = cfg.rope_scaling
  if s.kind == "factors":
    inv_freq = inv_freq / np.asarray(s.factors, np.float64)
  elif s.kind == "linear":
    inv_freq = inv_freq / s.factor
  elif s.kind == "llama3":
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def rope_tables(positions, inv_freq):  # [B, T], [D/2] -> cos, sin [B, T, D/2] float32
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, positions, inv_freq):  # [B, T, H, D], [B, T], [D/2] -> [B, T, H, D]
  """Rotate-half RoPE (Hugging Face layout; GGUF weights are un-permuted to match).

  x * cos + rotate_half(x) * sin, written per half (the same products and sums): over
  the whole head the halves' slices and the concatenation made XLA:GPU split a normed
  key's rotation (Qwen3's k-norm) into five fusions, per half it makes one.
  """
  return rotate_half(x, *rope_tables(positions, inv_freq))


def softcap(x, cap: Optional[float]):
  """cap * tanh(x / cap) (Gemma's soft-capping of scores or logits); None: x."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def attention(q, k, v, mask, logit_cap: Optional[float] = None):
  """Masked grouped-query attention, softmax in float32.

  Args:
    q: [B, T, Hq, D] queries.
    k: [B, S, Hkv, D] keys; Hq is a multiple of Hkv.
    v: [B, S, Hkv, D] values.
    mask: [B, T, S] True where query t may attend to key s.
    logit_cap: soft-capping of the scaled scores (attn_logit_softcapping), or None.

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  scores = softcap(scores / math.sqrt(d), logit_cap)
  scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, hq, d)


def packed_mask(segment_ids, positions, sliding_window=None):  # [B, T] x2 -> [B, T, T]
  """Causal mask inside each packed segment; segment id 0 marks padding."""
  t = segment_ids.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  mask = causal[None] & same & (segment_ids[:, None, :] != 0)
  if sliding_window is not None:
    mask &= (positions[:, :, None] - positions[:, None, :]) < sliding_window
  return mask


def cache_mask(positions, cache_len: int, sliding_window=None):  # [B, T] -> [B, T, S]
  """Mask for queries against a dense cache whose slot index is the token position."""
  slots = jnp.arange(cache_len)[None, None, :]
  mask = slots <= positions[:, :, None]
  if sliding_window is not None:
    mask &= (positions[:, :, None] - slots) < sliding_window
  return mask


# ----------------------------------------------------------------------------- packed rows


@dataclasses.dataclass(frozen=True)
class TrainingAttention:
  """How the packed (training) forward attends; static.

  Attributes:
    plain_max_len: rows of at most this many tokens use the plain masked softmax; None:
      512 on TPU and CPU, where their [S, S] scores are small and one fused XLA program
      beats a tiled loop, and 0 on GPU (the kernels at every length). XLA:GPU writes the
      plain path's float32 scores and probabilities to HBM several times over in the
      forward and backward: compiled for an H100, 32,768 tokens in rows of 128 (32 query
      and 8 KV heads of 64) move 10.9 GB there against the Triton kernels' 1.5 GB, and
      rows of 16 still 3.4 GB (docs/BENCHMARKS.md).
    kernel: tunables of the packed-attention kernel that longer rows use; its backend
      None picks Triton on GPU, splash attention on TPU and the blocked jnp path on CPU.
  """

  plain_max_len: Optional[int] = None
  kernel: PackedAttentionConfig = PackedAttentionConfig()

  def plain_up_to(self) -> int:
    """plain_max_len for the devices being traced for."""
    if self.plain_max_len is not None:
      return self.plain_max_len
    return 0 if target_platform() == "gpu" else 512


# attend(q, k, v) -> out; a kernel path's attend(q, k, v, (cos, sin)) takes them before RoPE.
Attend = Callable[..., jax.Array]


def _kernel(config: TrainingAttention) -> PackedAttentionConfig:
  """The kernel config with its backend chosen by the devices traced for (not the host's;
  sharding.platform) where it names none."""
  kernel = config.kernel
  if kernel.backend is None:
    platform = target_platform()
    backend = {"gpu": "triton", "tpu": "splash"}.get(platform, "blocked")
    interpret = platform == "cpu" if kernel.interpret is None else kernel.interpret
    kernel = dataclasses.replace(kernel, backend=backend, interpret=interpret)
  return kernel


def rope_in_attention(cfg: ModelConfig, length: int, config: TrainingAttention) -> bool:
  """Whether the packed forward hands attention q and k before RoPE, with its tables: the
  Triton kernels rotate each block as they read it, so the rotated q and k and their
  gradients never pass through HBM (a pass over q and k in each direction, every layer).
  Not on the plain path or another backend, nor where Gemma's query scale follows RoPE."""
  if length <= config.plain_up_to() or cfg.attn_logit_softcapping is not None:
    return False
  if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
    return False
  return _kernel(config).backend == "triton" and rotates_in_kernel(cfg.head_dim)


def packed_attention_fn(segment_ids, positions, sliding_window: Optional[int],
                        config: TrainingAttention = TrainingAttention(),
                        logit_cap: Optional[float] = None) -> Attend:
  """attend(q [B, S, Hq, D], k, v [B, S, Hkv, D]) -> [B, S, Hq, D] for one packed batch;
  a kernel path's also takes rope, (cos, sin) [B, S, D/2], with q and k before RoPE (where
  rope_in_attention says so).

  Chosen once per forward so the plain path's mask is built once for every layer. Every
  path gives 0 at padding queries (segment id 0): they attend to nothing. The kernels
  measure the sliding window in row tokens, which is the position distance the plain
  path uses wherever positions count up from each segment's start (as packing makes them).
  The kernels have no score soft-capping, so a capped model (Gemma 2 style; no Gemma 3
  checkpoint sets it) takes the plain path at every length.
  """
  if segment_ids.shape[1] <= config.plain_up_to() or logit_cap is not None:
    return _plain_packed(segment_ids, positions, sliding_window, logit_cap)
  kernel = _kernel(config)
  fn = functools.partial(packed_attention, config=kernel, sliding_window=sliding_window)
  if kernel.backend == "blocked":  # plain XLA ops: the partitioner shards them itself
    return lambda q, k, v, rope=None: fn(q, k, v, segment_ids, rope)
  return lambda q, k, v, rope=None: _per_device(fn, q, k, v, segment_ids, rope)


def _plain_packed(segment_ids, positions, sliding_window, logit_cap=None) -> Attend:
  mask = packed_mask(segment_ids, positions, sliding_window)  # [B, S, S]
  real = (segment_ids != 0)[:, :, None, None]

  return lambda q, k, v: jnp.where(real, attention(q, k, v, mask, logit_cap),
                                   0).astype(q.dtype)


def per_layer(cfg: ModelConfig, make: Callable[[Optional[int]], Callable]) -> Callable:
  """fn(layer, *args) -> make(that layer's window)(*args), for the scanned layer loop.

  The window is static in every attention path (kernels take it as a compile-time
  argument), so a model with windowed and full layers (Gemma 3) builds both variants once
  and each scanned layer picks its own with lax.cond on a per-layer flag: one variant is
  run per layer, and the scan body stays one program.
  """
  windows = cfg.layer_windows
  if not cfg.mixed_windows:
    fn = make(windows[0])
    return lambda layer, *args: fn(*args)
  local, full = make(cfg.sliding_window), make(None)
  is_local = np.asarray([w is not None for w in windows])
  return lambda layer, *args: jax.lax.cond(jnp.asarray(is_local)[layer], local, full, *args)


def layer_is_local(cfg: ModelConfig, layer):  # scalar int (traced) -> scalar bool
  """Whether `layer` is a sliding-window layer (for choices that are data, like RoPE)."""
  return jnp.asarray(np.asarray([w is not None for w in cfg.layer_windows]))[layer]


# ----------------------------------------------------------------------------- sharding


def batch_shards(size: int) -> int:
  """How many pieces the active rules cut a "batch" dimension of `size` into (else 1)."""
  active = active_rules()
  if active is None:
    return 1
  rules, mesh = active
  axes = logical_to_spec(("batch",), (size,), rules, mesh)[0]
  return math.prod(mesh.shape[a] for a in spec_axes(axes))


def _per_device(fn, q, k, v, segment_ids, rope=None):
  """fn on each device's rows and heads (shard_map) under active activation rules.

  XLA cannot partition a Pallas call: left to the partitioner it would gather every row
  and head onto every device. Query heads follow their KV heads, so GQA groups stay whole;
  RoPE tables, one per token, follow the rows.
  """
  active = active_rules()
  if active is None:
    return fn(q, k, v, segment_ids, rope)
  rules, mesh = active
  kv = logical_to_spec(("batch", None, "kv_heads", None), k.shape, rules, mesh)
  qs = PartitionSpec(kv[0], None, kv[2], None)
  specs, args = [qs, kv, kv, PartitionSpec(kv[0], None)], [q, k, v, segment_ids]
  if rope is not None:
    specs.append((PartitionSpec(kv[0], None, None),) * 2)
    args.append(tuple(rope))
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=qs,
                       check_vma=False)(*args)

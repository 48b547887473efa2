"""Building blocks of the decoder: RMSNorm, RoPE and masked GQA attention.

Pure functions on arrays. The attention here is the plain-jnp path used for the forward
and the dense-cache decoder; Pallas kernels in jaxrl_post.kernels replace it per backend
and are tested against it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.models.config import ModelConfig

# A large finite negative instead of -inf: rows with nothing to attend to (padding)
# then give a uniform softmax instead of NaNs that would poison gradients.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def rms_norm(x, weight, eps: float):  # [..., D], [D] -> [..., D]
  """RMSNorm computed in float32 (as Hugging Face does), returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:  # [head_dim // 2]
  """Inverse RoPE frequencies, including linear and Llama 3 scaling."""
  hd = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
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


def apply_rope(x, positions, inv_freq):  # [B, T, H, D], [B, T], [D/2] -> [B, T, H, D]
  """Rotate-half RoPE (Hugging Face layout; GGUF weights are un-permuted to match)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def attention(q, k, v, mask):
  """Masked grouped-query attention, softmax in float32.

  Args:
    q: [B, T, Hq, D] queries.
    k: [B, S, Hkv, D] keys; Hq is a multiple of Hkv.
    v: [B, S, Hkv, D] values.
    mask: [B, T, S] True where query t may attend to key s.

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(d)
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


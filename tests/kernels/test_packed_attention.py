"""Packed causal attention with segment ids: values and gradients == dense reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import kernels
from tests.kernels.helpers import assert_close

D = 16
F32, BF16 = jnp.float32, jnp.bfloat16
# Row 0: segments of 10, 17, 1 (a one-token sequence) and 7 tokens, then 5 padding tokens.
# Row 1: one sequence fills the whole row. With 16-token blocks, row 0's last query block
# shares no segment with its first key block, so the block-skipping path runs.
SEGMENTS = np.stack([np.repeat([1, 2, 3, 4, 0], [10, 17, 1, 7, 5]), np.full(40, 9)])
SMALL = dict(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)


def inputs(seed, hq, hkv, dtype, segments=SEGMENTS):
  rng = np.random.default_rng(seed)
  b, t = segments.shape
  draw = lambda h: jnp.asarray(rng.normal(size=(b, t, h, D)), dtype)
  return draw(hq), draw(hkv), draw(hkv), jnp.asarray(segments, jnp.int32), draw(hq)


def loss(attention, q, k, v, seg, weights):
  return jnp.sum(attention(q, k, v, seg).astype(F32) * weights.astype(F32))


@jax.jit
def reference_value_and_grads(q, k, v, seg, weights):
  """The dense reference and jax.grad of it, at the float32 values of the inputs."""
  up = lambda x: x.astype(F32)
  f = functools.partial(loss, kernels.packed_attention_reference)
  grads = jax.grad(f, argnums=(0, 1, 2))(up(q), up(k), up(v), seg, weights)
  return kernels.packed_attention_reference(q, k, v, seg), grads


def check(config, q, k, v, seg, weights, dtype):
  attention = functools.partial(kernels.packed_attention, config=config)
  out = attention(q, k, v, seg)
  grads = jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2))(q, k, v, seg, weights)
  ref_out, ref_grads = reference_value_and_grads(q, k, v, seg, weights)
  assert out.dtype == dtype and out.shape == q.shape
  assert_close(out, ref_out, dtype)
  for g, ref_g in zip(grads, ref_grads):
    assert g.dtype == dtype
    assert_close(g, ref_g, dtype)
  return out, grads


BACKENDS = {"triton": SMALL, "blocked": dict(jnp_block=16)}


@pytest.mark.parametrize("dtype,group", [(F32, 1), (BF16, 2), (F32, 4), (BF16, 4)],
                         ids=["f32-g1", "bf16-g2", "f32-g4", "bf16-g4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_values_and_grads(backend, dtype, group):
  """Padding is exactly 0 in the output and in every gradient, the output's gradient there
  nonzero (`weights`): the kernels' masks alone must give it, nothing selects after them."""
  cfg = kernels.PackedAttentionConfig(backend=backend, **BACKENDS[backend])
  out, grads = check(cfg, *inputs(group, 2 * group, 2, dtype), dtype)
  padding = SEGMENTS == 0
  assert np.all(np.asarray(out, np.float32)[padding] == 0)
  for g in grads:  # padding tokens neither attend nor are attended to
    assert np.all(np.asarray(g, np.float32)[padding] == 0)


def test_default_blocks_and_unpadded_head_dim():
  """Default (64-wide, clipped) blocks and a head_dim of 12 padded to 16 inside."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 40, h, 12)), F32) for h in (4, 2, 2))
  seg = jnp.asarray(SEGMENTS, jnp.int32)
  weights = jnp.asarray(rng.normal(size=q.shape), F32)
  check(kernels.PackedAttentionConfig(backend="triton"), q, k, v, seg, weights, F32)


def test_splash_backend_values_and_grads():
  cfg = kernels.PackedAttentionConfig(backend="splash", splash_block=128, interpret=True)
  check(cfg, *inputs(5, 4, 2, F32), F32)


def test_packed_equals_unpacked():
  """Each sequence gives the same output alone in its own row as packed with others."""
  cfg = kernels.PackedAttentionConfig(backend="triton", **SMALL)
  q, k, v, seg, _ = inputs(6, 4, 2, F32)
  packed = np.asarray(kernels.packed_attention(q, k, v, seg, config=cfg))
  for start, stop in [(0, 10), (10, 27), (27, 28), (28, 35)]:
    row = np.zeros((1, 40), np.int32)
    row[0, :stop - start] = 1
    take = lambda x: jnp.pad(x[:1, start:stop], ((0, 0), (0, 40 - stop + start), (0, 0), (0, 0)))
    alone = kernels.packed_attention(take(q), take(k), take(v), jnp.asarray(row), config=cfg)
    assert_close(np.asarray(alone)[0, :stop - start], packed[0, start:stop], F32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_gpu_kernel_values_and_grads(dtype):
  assert jax.default_backend() == "gpu"
  segments = np.stack([np.repeat([1, 2, 3, 0], [100, 211, 150, 51]), np.full(512, 4)])
  check(kernels.PackedAttentionConfig(), *inputs(7, 8, 2, dtype, segments), dtype)


def rope_tables(segments, d, theta=100.0):
  """cos, sin [B, T, d/2] f32 at each token's position within its segment."""
  seg = np.asarray(segments)
  starts = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], 1)
  idx = np.arange(seg.shape[1])
  positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
  angles = positions[..., None] * theta ** (-np.arange(0, d, 2) / d)
  return jnp.asarray(np.cos(angles), F32), jnp.asarray(np.sin(angles), F32)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend,d", [("triton", 32), ("triton", 16), ("blocked", 32)],
                         ids=["triton-in-kernel", "triton-rotated-before", "blocked"])
def test_rope_tables_give_the_attention_of_rotated_q_and_k(backend, d, dtype):
  """With `rope`, q and k go in before RoPE: values and their gradients equal the float32
  reference's on rotated inputs, differentiated through the rotation. At head_dim 32 the
  Triton kernels rotate each block as they read it (forward, dK/dV and dQ), at 16 they
  cannot split it and rotate first."""
  assert kernels.rotates_in_kernel(d) == (d == 32)
  rng = np.random.default_rng(11)
  b, t = SEGMENTS.shape
  draw = lambda h: jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  q, k, v, weights = draw(4), draw(2), draw(2), draw(4)
  seg = jnp.asarray(SEGMENTS, jnp.int32)
  rope = rope_tables(SEGMENTS, d)
  cfg = kernels.PackedAttentionConfig(backend=backend, **BACKENDS[backend])
  attention = lambda q, k, v, seg: kernels.packed_attention(q, k, v, seg, rope, config=cfg)
  reference = lambda q, k, v, seg: kernels.packed_attention_reference(
      kernels.rotate_half(q, *rope), kernels.rotate_half(k, *rope), v, seg)
  out = attention(q, k, v, seg)
  grads = jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2))(q, k, v, seg, weights)
  up = lambda x: x.astype(F32)
  want = reference(up(q), up(k), up(v), seg)
  want_grads = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2))(
      up(q), up(k), up(v), seg, weights)
  assert out.dtype == dtype
  assert_close(out, want, dtype)
  for g, w in zip(grads, want_grads):
    assert g.dtype == dtype
    assert_close(g, w, dtype)
  assert not np.asarray(out, np.float32)[SEGMENTS == 0].any()

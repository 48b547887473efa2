"""Chunked logprob/entropy: values and gradients == the dense [T, V] computation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import kernels
from tests.kernels.helpers import assert_close

F32, BF16 = jnp.float32, jnp.bfloat16
T, DIM, VOCAB = 37, 16, 203  # neither T nor V is a multiple of the blocks below
BLOCKS = kernels.ChunkedLogprobConfig(token_block=16, vocab_block=64)


def inputs(dtype, seed=0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(T, DIM)), dtype)
  lm_head = jnp.asarray(rng.normal(size=(DIM, VOCAB)) * 0.5, dtype)
  targets = jnp.asarray(rng.integers(0, VOCAB, size=T), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, T)), F32)  # upstream cotangents of both outputs
  return hidden, lm_head, targets, cot


def loss(fn, hidden, lm_head, temperature, targets, cot):
  logprob, entropy = fn(hidden, lm_head, targets, temperature)
  return jnp.sum(logprob * cot[0] + entropy * cot[1])


@jax.jit
def dense(hidden, lm_head, temperature, targets, cot):
  """Reference values and jax.grad of the dense f32 computation."""
  args = (hidden.astype(F32), lm_head.astype(F32), temperature, targets, cot)
  grads = jax.grad(functools.partial(loss, kernels.chunked_logprob_reference),
                   argnums=(0, 1, 2))(*args)
  return kernels.chunked_logprob_reference(*args[:2], targets, temperature), grads


def check(dtype, config, temperature=0.7, seed=0):
  hidden, lm_head, targets, cot = inputs(dtype, seed)
  fn = functools.partial(kernels.chunked_logprob, config=config)
  values = fn(hidden, lm_head, targets, temperature)
  grads = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(
      hidden, lm_head, temperature, targets, cot)
  ref_values, ref_grads = dense(hidden, lm_head, temperature, targets, cot)
  for got, want in zip(values, ref_values):
    # Logits are exact products accumulated in f32 for either input dtype.
    assert got.dtype == F32 and got.shape == (T,)
    assert_close(got, want, F32)
  assert grads[0].dtype == dtype and grads[1].dtype == dtype
  assert_close(grads[0], ref_grads[0], dtype)
  assert_close(grads[1], ref_grads[1], dtype)
  assert_close(grads[2], ref_grads[2], F32 if dtype == F32 else BF16)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_blocked_values_and_grads(dtype):
  check(dtype, BLOCKS)


def test_single_block_and_unit_temperature():
  check(F32, kernels.ChunkedLogprobConfig(token_block=4096, vocab_block=4096), temperature=1.0,
        seed=1)


def test_logprob_only_gradient():
  """A loss that ignores the entropy (a symbolic-zero cotangent) still gets exact grads."""
  hidden, lm_head, targets, _ = inputs(F32, seed=2)
  f = lambda fn: (lambda h, w: fn(h, w, targets, 1.3)[0].sum())
  chunked = functools.partial(kernels.chunked_logprob, config=BLOCKS)
  got = jax.grad(f(chunked), (0, 1))(hidden, lm_head)
  want = jax.grad(f(kernels.chunked_logprob_reference), (0, 1))(hidden, lm_head)
  for g, w in zip(got, want):
    assert_close(g, w, F32)


def test_never_materialises_token_by_vocab_logits():
  """XLA's own accounting: temporaries stay far below one [T, V] f32 array."""
  t, d, v = 2048, 64, 16384
  spec = lambda shape, dt=BF16: jax.ShapeDtypeStruct(shape, dt)
  args = (spec((t, d)), spec((d, v)), spec((t,), jnp.int32), spec((2, t), F32))
  cfg = kernels.ChunkedLogprobConfig(token_block=256, vocab_block=2048)
  step = lambda fn: jax.value_and_grad(
      lambda h, w, tg, c: loss(fn, h, w, 1.0, tg, c), argnums=(0, 1))
  temp = lambda fn: jax.jit(step(fn)).lower(*args).compile().memory_analysis().temp_size_in_bytes
  logits_bytes = t * v * 4
  chunked = temp(functools.partial(kernels.chunked_logprob, config=cfg))
  assert chunked < logits_bytes / 4
  assert temp(kernels.chunked_logprob_reference) > logits_bytes  # the check can tell the two apart


@pytest.mark.gpu
def test_gpu_values_and_grads():
  assert jax.default_backend() == "gpu"
  check(F32, BLOCKS)
  check(BF16, kernels.ChunkedLogprobConfig())


def test_floors_keep_only_the_sampled_set_in_values_and_grads():
  """Per-token floors (top-k / top-p kept sets): the softmax is over the columns at or
  above the floor and the target, as the dense masked reference computes it."""
  hidden, lm_head, targets, cot = inputs(F32, seed=3)
  temperature = 0.8
  z = np.asarray(hidden @ lm_head) / temperature
  ranked = -np.sort(-z, axis=-1)
  keep = np.random.default_rng(3).integers(1, 40, size=T)
  floor = ranked[np.arange(T), keep - 1] - 1e-3  # The keep[i] largest columns.
  floor[::5] = -np.inf  # Some tokens untruncated.
  floor = jnp.asarray(floor, F32)
  fn = lambda h, w, t, temp: kernels.chunked_logprob(h, w, t, temp, floor, config=BLOCKS)
  ref = lambda h, w, t, temp: kernels.chunked_logprob_reference(h, w, t, temp, floor)
  for got, want in zip(fn(hidden, lm_head, targets, temperature),
                       ref(hidden, lm_head, targets, temperature)):
    assert_close(got, want, F32)
  grads = [jax.grad(functools.partial(loss, f), argnums=(0, 1, 2))(
      hidden, lm_head, temperature, targets, cot) for f in (fn, ref)]
  for got, want in zip(*grads):
    assert_close(got, want, F32)
  # A target below its floor still counts (it was sampled): its logprob stays finite.
  assert np.all(np.isfinite(np.asarray(fn(hidden, lm_head, targets, temperature)[0])))

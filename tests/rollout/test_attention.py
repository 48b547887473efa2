"""The decode step's attention: the Pallas kernels over the stacked pool equal plain jnp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rollout.attention import (SharedPrefix, cascade_decode_attention,
                                          paged_decode_attention)


@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("layer", [0, 2])
def test_kernel_on_the_stacked_pool_equals_the_jnp_path(layer, window):
  """window 11: the kernel reads the window's pages from its first one on (a sliding
  layer's table of 4 pages of 8 narrowed to 3) and masks the keys before it."""
  hkv, n_layers, n_pages, ps, d, b, hq = 2, 3, 12, 8, 16, 4, 4
  rng = np.random.default_rng(layer)
  k_pool = jnp.asarray(rng.normal(size=(hkv, n_layers, n_pages, ps, d)), jnp.float32)
  v_pool = jnp.asarray(rng.normal(size=(hkv, n_layers, n_pages, ps, d)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
  table = jnp.asarray(rng.integers(1, n_pages, (b, 4)), jnp.int32)  # shared pages too
  lengths = jnp.asarray([1, 8, 17, 32], jnp.int32)  # 1, one page, ragged, full
  run = lambda use_kernel: paged_decode_attention(q, k_pool, v_pool, jnp.int32(layer), table,
                                                  lengths, sliding_window=window,
                                                  use_kernel=use_kernel)
  np.testing.assert_allclose(run(True), run(False), atol=2e-5)  # f32 kernel tolerance


def test_kernel_refuses_soft_capping():
  pool = jnp.zeros((1, 1, 2, 8, 16))
  with pytest.raises(ValueError, match="soft-capping"):
    paged_decode_attention(jnp.zeros((1, 1, 16)), pool, pool, 0, jnp.zeros((1, 1), jnp.int32),
                           jnp.ones((1,), jnp.int32), logit_cap=30.0, use_kernel=True)


@pytest.mark.parametrize("d, page_size, kernel", [(16, 8, True), (8, 8, False),
                                                   (80, 16, False), (64, 12, False)])
def test_accelerator_default_takes_the_kernel_only_for_shapes_it_compiles(
    monkeypatch, d, page_size, kernel):
  """On a GPU the Triton decode kernel refuses head_dim 8 or 80 and odd page sizes (a tiny
  model's head_dim 8 failed to compile there): the default routes those to plain jnp."""
  from jaxrl_post.kernels.paged_attention import kernel_supports
  from jaxrl_post.rollout import attention

  monkeypatch.setattr(attention, "on_accelerator", lambda: True)
  called = []
  for name in ("_kernel_decode", "_kernel_cascade"):
    real = getattr(attention, name)
    monkeypatch.setattr(attention, name, lambda *a, real=real: called.append(1) or real(*a))
  rng = np.random.default_rng(d)
  k_pool, v_pool = _stacked_pool(rng, 1, 1, 3, page_size, d)
  q = jnp.asarray(rng.normal(size=(2, 2, d)), jnp.float32)
  table, lengths = jnp.asarray([[1, 2], [2, 0]], jnp.int32), jnp.asarray([9, 3], jnp.int32)
  out = paged_decode_attention(q, k_pool, v_pool, jnp.int32(0), table, lengths)
  want = paged_decode_attention(q, k_pool, v_pool, jnp.int32(0), table, lengths,
                                use_kernel=False)
  assert bool(called) == kernel
  np.testing.assert_allclose(out, want, atol=2e-5)  # f32 kernel tolerance
  shared = SharedPrefix(jnp.asarray([[1]], jnp.int32), jnp.asarray([page_size], jnp.int32))
  called.clear()
  cascade_decode_attention(q, k_pool, v_pool, jnp.int32(0), shared,
                           jnp.asarray([[2], [0]], jnp.int32), jnp.asarray([1, 1], jnp.int32))
  assert bool(called) == kernel
  assert kernel_supports(d, page_size, backend="mosaic")


def _stacked_pool(rng, hkv, n_layers, n_pages, ps, d):
  shape = (hkv, n_layers, n_pages, ps, d)
  return (jnp.asarray(rng.normal(size=shape), jnp.float32),
          jnp.asarray(rng.normal(size=shape), jnp.float32))


@pytest.mark.parametrize("layer", [1, 2])
def test_cascade_kernel_on_the_stacked_pool_equals_the_jnp_path(layer):
  hkv, n_layers, n_pages, ps, d, hq = 2, 3, 16, 8, 16, 4
  rng = np.random.default_rng(10 + layer)
  k_pool, v_pool = _stacked_pool(rng, hkv, n_layers, n_pages, ps, d)
  q = jnp.asarray(rng.normal(size=(6, hq, d)), jnp.float32)
  # Blocks of 2 rows. Block 0: a 2-page prompt, both rows live. Block 1: a prompt shorter
  # than a page (no shared pages), second row free. Block 2: empty. Page 0 is the sink.
  shared = SharedPrefix(jnp.asarray([[3, 7, 0], [0, 0, 0], [0, 0, 0]], jnp.int32),
                        jnp.asarray([2 * ps, 0, 0], jnp.int32))
  own = jnp.asarray([[1, 9], [4, 12], [5, 0], [0, 0], [0, 0], [0, 0]], jnp.int32)
  own_lengths = jnp.asarray([1, 11, 5, 0, 0, 0], jnp.int32)
  run = lambda use_kernel: cascade_decode_attention(
      q, k_pool, v_pool, jnp.int32(layer), shared, own, own_lengths, use_kernel=use_kernel)
  kernel, plain = run(True), run(False)
  np.testing.assert_allclose(kernel, plain, atol=2e-5)  # f32 kernel tolerance
  # Live rows equal paged attention over "shared pages, then own pages"; free rows are 0.
  table = jnp.asarray([[3, 7, 1, 9], [3, 7, 4, 12], [5, 0, 0, 0]], jnp.int32)
  want = paged_decode_attention(q[:3], k_pool, v_pool, jnp.int32(layer), table,
                                jnp.asarray([2 * ps + 1, 2 * ps + 11, 5], jnp.int32),
                                use_kernel=False)
  np.testing.assert_allclose(plain[:3], want, atol=2e-5)
  np.testing.assert_array_equal(kernel[3:], 0.0)
  np.testing.assert_array_equal(plain[3:], 0.0)


@pytest.mark.parametrize("window", [None, 1, 4, 5, 9, 64])
def test_jnp_decode_path_equals_dense_attention_over_the_rows_tokens(window):
  """With a window the jnp path gathers only the pages the window spans (1, 2 or 3 of the
  table's 3 here); any window must give what masking the whole table gives."""
  from jaxrl_post.models import layers as L
  from jaxrl_post.rollout.attention import gather_pages
  hkv, n_layers, n_pages, ps, d, b, hq, layer = 2, 3, 12, 4, 8, 3, 6, 1
  k_pool, v_pool = _stacked_pool(np.random.default_rng(9), hkv, n_layers, n_pages, ps, d)
  q = jnp.asarray(np.random.default_rng(10).normal(size=(b, hq, d)), jnp.float32)
  table = jnp.asarray([[3, 1, 7], [2, 2, 5], [11, 4, 9]], jnp.int32)
  lengths = jnp.asarray([1, 6, 12], jnp.int32)
  got = paged_decode_attention(q, k_pool, v_pool, layer, table, lengths, window,
                               use_kernel=False)
  k, v = gather_pages(k_pool, layer, table), gather_pages(v_pool, layer, table)
  pos = jnp.arange(k.shape[1])[None, :]
  mask = (pos < lengths[:, None])
  if window is not None:
    mask &= (lengths - 1)[:, None] - pos < window
  want = L.attention(q[:, None], k, v, mask[:, None, :])[:, 0]
  np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("budget_rows", [1, 2, 3])
def test_cpu_path_in_row_chunks_equals_all_rows_at_once(monkeypatch, budget_rows):
  """The CPU path splits the rows into chunks whose gathered keys and values fit
  CPU_GATHER_BYTES (7 rows in chunks of 1, 2 or 3: the last chunk padded); decode and
  cascade attention give what the rows give at once, and padding never shows."""
  from jaxrl_post.rollout import attention as A
  hkv, n_layers, n_pages, ps, d, hq, layer = 2, 3, 24, 4, 8, 6, 2
  k_pool, v_pool = _stacked_pool(np.random.default_rng(11), hkv, n_layers, n_pages, ps, d)
  q = jnp.asarray(np.random.default_rng(12).normal(size=(7, hq, d)), jnp.float32)
  table = jnp.asarray(np.random.default_rng(13).permutation(n_pages)[:21].reshape(7, 3),
                      jnp.int32)
  lengths = jnp.asarray([1, 12, 5, 9, 0, 3, 11], jnp.int32)  # Row 4 has nothing yet.
  shared = SharedPrefix(jnp.asarray([[3, 7], [0, 0], [5, 0], [0, 0], [1, 2], [6, 0],
                                     [0, 0]], jnp.int32),
                        jnp.asarray([2 * ps, 0, ps, 0, 2 * ps, ps, 0], jnp.int32))

  def both():
    decode = jax.jit(lambda: paged_decode_attention(q, k_pool, v_pool, layer, table,
                                                    jnp.maximum(lengths, 1),
                                                    use_kernel=False))()
    cascade = jax.jit(lambda: cascade_decode_attention(q, k_pool, v_pool, layer, shared,
                                                       table, lengths, use_kernel=False))()
    return decode, cascade

  whole = both()
  row_bytes = 2 * hkv * table.shape[1] * ps * d * 4  # The cascade's prefix is narrower.
  monkeypatch.setattr(A, "CPU_GATHER_BYTES", budget_rows * row_bytes)
  chunked = both()
  for got, want in zip(chunked, whole):
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=1e-6)

"""The decode step's attention: the Pallas kernel over the stacked pool equals plain jnp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rollout.attention import paged_decode_attention


@pytest.mark.parametrize("layer", [0, 2])
def test_kernel_on_the_stacked_pool_equals_the_jnp_path(layer):
  hkv, n_layers, n_pages, ps, d, b, hq = 2, 3, 12, 8, 16, 4, 4
  rng = np.random.default_rng(layer)
  k_pool = jnp.asarray(rng.normal(size=(hkv, n_layers, n_pages, ps, d)), jnp.float32)
  v_pool = jnp.asarray(rng.normal(size=(hkv, n_layers, n_pages, ps, d)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
  table = jnp.asarray(rng.integers(1, n_pages, (b, 4)), jnp.int32)  # shared pages too
  lengths = jnp.asarray([1, 8, 17, 32], jnp.int32)  # 1, one page, ragged, full
  run = lambda use_kernel: paged_decode_attention(q, k_pool, v_pool, jnp.int32(layer), table,
                                                  lengths, use_kernel=use_kernel)
  np.testing.assert_allclose(run(True), run(False), atol=2e-5)  # f32 kernel tolerance


def test_kernel_refuses_a_sliding_window():
  pool = jnp.zeros((1, 1, 2, 8, 16))
  with pytest.raises(ValueError, match="sliding window"):
    paged_decode_attention(jnp.zeros((1, 1, 16)), pool, pool, 0, jnp.zeros((1, 1), jnp.int32),
                           jnp.ones((1,), jnp.int32), sliding_window=4, use_kernel=True)

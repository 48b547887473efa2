"""Shared builders for the kernel tests: tiny paged pools and tolerance checks."""

import jax.numpy as jnp
import numpy as np

# Fixed tolerances: float32 kernels differ from the float32 reference only by summation
# order; bfloat16 inputs add the rounding of probabilities and outputs (2^-8 relative).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def assert_close(actual, expected, dtype):
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             atol=tol, rtol=tol)


def random_pool(rng, hkv, num_pages, page_size, d, dtype):
  """K and V pools [Hkv, num_pages, page_size, D] of unit normals."""
  shape = (hkv, num_pages, page_size, d)
  return (jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(rng.normal(size=shape), dtype))


def page_tables(rng, lengths, max_pages, page_size, num_pages, shared=()):
  """[B, max_pages] int32 tables of distinct pages; `shared` lists (seq_a, seq_b, n) to
  make seq_b reuse seq_a's first n pages. Unused slots hold out-of-range junk (-1 and
  num_pages), which the kernels must never let affect the result."""
  b = len(lengths)
  perm = rng.permutation(num_pages)
  table = perm[:b * max_pages].reshape(b, max_pages).copy()
  for a, c, n in shared:
    table[c, :n] = table[a, :n]
  for i, length in enumerate(lengths):
    used = -(-length // page_size)
    table[i, used:] = np.where(np.arange(max_pages - used) % 2, -1, num_pages)
  return jnp.asarray(table, jnp.int32)

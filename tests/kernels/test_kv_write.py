"""The paged K/V write kernel == its scatter reference (Pallas interpreter on CPU), and it
compiles for TPU in place (no copy of the pool)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_post.kernels.kv_write import write_pages, write_pages_reference
from tests.tpu import tpu_mesh

HKV, P, PS, D = 2, 12, 8, 128


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_matches_the_scatter_with_runs_of_one_page_and_a_repeated_sink(dtype):
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.normal(size=(HKV, P, PS, D)), dtype)
  # A prefill chunk over pages 3-4 (runs of one page), decode tokens on 7 and 9, and
  # padding tokens sent to the sink page 0 between them (its contents are never read).
  pages = np.array([3, 3, 3, 4, 0, 7, 0, 9, 4], np.int32)
  slots = np.array([5, 6, 7, 0, 0, 2, 0, 7, 1], np.int32)
  new = jnp.asarray(rng.normal(size=(len(pages), HKV, D)), jnp.float32)
  want = write_pages_reference(pool, pages, slots, new)
  got = write_pages(jnp.array(pool), pages, slots, new, interpret=True)
  real = pages != 0
  np.testing.assert_array_equal(np.asarray(got)[:, 1:], np.asarray(want)[:, 1:])
  # Every written row holds its token, untouched rows their old values.
  np.testing.assert_array_equal(np.asarray(got)[:, pages[real], slots[real]],
                                np.asarray(new.astype(dtype)).transpose(1, 0, 2)[:, real])


def _compiled_pool_copies(fn):
  mesh = tpu_mesh("v5e:2x2", data=1)  # one chip: a Mosaic call on more needs shard_map
  on_tpu = NamedSharding(mesh, PartitionSpec())
  pool = jax.ShapeDtypeStruct((8, 32 * 64, 16, 128), jnp.bfloat16, sharding=on_tpu)
  idx = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=on_tpu)
  new = jax.ShapeDtypeStruct((16, 8, 128), jnp.bfloat16, sharding=on_tpu)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    text = jax.jit(fn, donate_argnums=0).lower(pool, idx, idx, new).compile().as_text()
  return [line for line in text.splitlines()
          if " copy(" in line and "bf16[8,2048,16,128]" in line.split("=")[1][:40]]


def test_on_tpu_the_kernel_writes_in_place_where_the_scatter_copies_the_pool():
  write = lambda pool, p, s, new: write_pages(pool, p, s, new)
  assert _compiled_pool_copies(write) == []

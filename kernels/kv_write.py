"""Writing new tokens' keys or values into a paged pool, in place, one page per token.

XLA's scatter does this on GPU and CPU. On TPU it does not do it in place: the TPU
compiler lays a scattered pool out with its KV heads beside the head dim (each token's
[Hkv, D] row one tile), while the paged attention kernel reads [page, D] tiles of one head,
so every layer of every decode step copied the whole pool twice between the two layouts
(XLA:TPU, Llama-3.1-8B on v5p: 69 GB per step against an 18 GB floor). This kernel keeps
the pool in the attention kernel's layout: grid step n reads token n's page (all its KV
heads), replaces the token's row and writes the page back, through Pallas' pipeline with
the pool aliased from input to output.

Consecutive tokens of one page (a prompt chunk) share the page's buffer: the pipeline
neither refetches the input nor writes the output back while a block index repeats, so a
step only copies the page in when the previous token wrote another page. A page met again
later must not be one an earlier step wrote (its write-back may still be in flight):
decode writes one page per sequence, prefill a chunk's pages in order, and only the sink
page that absorbs padding tokens repeats, whose contents are never read.

kernel -> pallas_call wrapper -> jitted API -> float32-exact jnp reference at the bottom.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_post.kernels.platform import kernel_platform


def _write_kernel(page_ref, slot_ref, new_ref, pool_in, pool_out):
  """Grid step n: pool_out (token n's page [Hkv, ps, D]) gets row slot[n] = new [Hkv, D]."""
  n = pl.program_id(0)
  revisit = (n > 0) & (page_ref[jnp.maximum(n - 1, 0)] == page_ref[n])

  @pl.when(jnp.logical_not(revisit))
  def _load():
    pool_out[...] = pool_in[...]

  rows = jax.lax.broadcasted_iota(jnp.int32, pool_out.shape, 1)
  pool_out[...] = jnp.where(rows == slot_ref[n], new_ref[...], pool_out[...])


def _write_call(pool, pages, slots, new, interpret):
  """pool [Hkv, P, ps, D]; pages, slots [N] int32; new [N, Hkv, D] -> the updated pool."""
  hkv, _, ps, d = pool.shape
  page_block = pl.BlockSpec((hkv, None, ps, d), lambda n, page, slot: (0, page[n], 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(new.shape[0],),
      in_specs=[pl.BlockSpec((None, hkv, 1, d), lambda n, page, slot: (n, 0, 0, 0)),
                page_block],
      out_specs=page_block)
  tokens = new.shape[0]
  return pl.pallas_call(
      _write_kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
      input_output_aliases={3: 0},  # operands: pages, slots, new, pool
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                    bytes_accessed=2 * tokens * hkv * ps * d * pool.itemsize),
      interpret=interpret, name="kv_page_write",
  )(pages, slots, new[:, :, None, :].astype(pool.dtype), pool)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=0)
def write_pages(pool, pages, slots, new, *, interpret=None):
  """pool with token n's K (or V) for every head at (pages[n], slots[n]).

  Args:
    pool: [Hkv, P, ps, D] one layer's (or the stacked layers', flattened) K or V pages.
    pages: [N] int32 page ids in the pool.
    slots: [N] int32 row of the page, in [0, ps).
    new: [N, Hkv, D] the tokens' keys or values.
    interpret: run the Pallas interpreter; None means "off only on a TPU".

  Returns:
    The pool, updated in place (donated).
  """
  if interpret is None:
    interpret = kernel_platform() != "tpu"
  return _write_call(pool, pages.astype(jnp.int32), slots.astype(jnp.int32), new, interpret)


def write_pages_reference(pool, pages, slots, new):
  """The same update as a scatter: what CPU and GPU programs run."""
  return pool.at[:, pages, slots].set(new.transpose(1, 0, 2).astype(pool.dtype))

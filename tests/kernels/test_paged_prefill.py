"""Paged prefill attention == its dense float32 reference (Pallas interpreter on CPU), on
rows laid out by the engine's own packer: chunks continuing after cached pages, a chunk
running on into the next row, padding, and sliding windows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import kernels
from jaxrl_post.kernels.paged_prefill import needed_pages
from jaxrl_post.rollout.prefill_pack import Chunk, pack
from tests.kernels.helpers import assert_close, random_pool

D, HKV = 16, 2
reference = jax.jit(kernels.paged_prefill_attention_reference, static_argnames=("window",))


def packed_rows(rng, page_size, num_pages, starts_and_lengths, width):
  """PackedRows for chunks (start, tokens) of distinct prompts on one shard, each prompt
  holding distinct pages of the pool."""
  perm = iter(rng.permutation(np.arange(1, num_pages)))
  chunks = []
  for start, n in starts_and_lengths:
    pages = [int(next(perm)) for _ in range(-(-(start + n) // page_size))]
    chunks.append(Chunk(0, rng.integers(0, 100, n).astype(np.int32), start, pages))
  rows, _ = pack(chunks, shards=1, width=width, page_size=page_size)
  return rows


def run_case(backend, dtype, page_size, group, window=None, seed=0, **config):
  rng = np.random.default_rng(seed)
  num_pages = 48
  # A fresh prompt, one continuing after 21 cached tokens (a prefix-cache hit), one
  # continuing after 3 whole pages, and one long enough to run on into the next row.
  rows = packed_rows(rng, page_size, num_pages, [(0, 5), (21, 9), (3 * page_size, 4),
                                                 (0, 27)], width=24)
  k_pages, v_pages = random_pool(rng, HKV, num_pages, page_size, D, dtype)
  r, t = rows.tokens.shape
  q = jnp.asarray(rng.normal(size=(r, t, HKV * group, D)), dtype)
  args = (q, k_pages, v_pages, rows.key_pages, rows.key_segments, rows.key_starts,
          rows.positions, rows.segments)
  cfg = kernels.PagedAttentionConfig(backend=backend, **config)
  out = kernels.paged_prefill_attention(*args, config=cfg, window=window)
  ref = reference(*args, window=window)
  assert out.dtype == dtype and out.shape == q.shape
  assert_close(out, ref, dtype)
  padding = rows.segments < 0
  assert padding.any() and not np.asarray(out, np.float32)[padding].any()
  return out


F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [("triton", F32, 8, 1, None), ("triton", BF16, 16, 2, 11), ("triton", F32, 16, 4, 11),
         ("mosaic", F32, 8, 2, None), ("mosaic", BF16, 16, 1, None), ("mosaic", F32, 8, 4, 11)]


@pytest.mark.parametrize("backend,dtype,page_size,group,window", CASES,
                         ids=[f"{b}-{jnp.dtype(d).name}-ps{p}-g{g}-w{w}"
                              for b, d, p, g, w in CASES])
def test_matches_reference(backend, dtype, page_size, group, window):
  run_case(backend, dtype, page_size, group, window, block_kv=2 * page_size)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["jnp", "kernel"])
def test_the_engines_prefill_attention_equals_the_reference(use_kernel):
  """rollout.attention's prefill on layer 1 of a stacked pool, by either path (the kernel
  on the flattened pool with the layer's page offset), equals the reference."""
  from jaxrl_post.rollout.attention import paged_prefill_attention
  rng = np.random.default_rng(3)
  page_size, num_pages = 8, 48
  rows = packed_rows(rng, page_size, num_pages, [(0, 5), (21, 9), (0, 27)], width=16)
  k_pages, v_pages = random_pool(rng, HKV, num_pages, page_size, D, jnp.float32)
  stack = lambda pool: jnp.stack([jnp.zeros_like(pool), pool], axis=1)  # [Hkv, 2, P, ps, D]
  q = jnp.asarray(rng.normal(size=(*rows.tokens.shape, 4, D)), jnp.float32)
  for window in (None, 11):
    want = reference(q, k_pages, v_pages, rows.key_pages, rows.key_segments, rows.key_starts,
                     rows.positions, rows.segments, window=window)
    got = paged_prefill_attention(q, stack(k_pages), stack(v_pages), jnp.int32(1),
                                  rows.key_pages, rows.key_segments, rows.key_starts,
                                  rows.positions, rows.segments, sliding_window=window,
                                  use_kernel=use_kernel)
    valid = rows.segments >= 0
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5)


def test_a_window_reads_only_the_pages_it_spans():
  """A 40-token chunk continuing after 160 cached tokens, pages of 8, window 16: its
  40 queries (positions 160-199) see keys from position 145 on, 7 pages of the 25 listed;
  without the window all 25."""
  rng = np.random.default_rng(0)
  rows = packed_rows(rng, 8, 64, [(160, 40)], width=40)
  args = (rows.key_pages, rows.key_segments, rows.key_starts, rows.positions, rows.segments)
  assert int(needed_pages(*map(jnp.asarray, args), 8, None)[3][0]) == 25
  pages, _, starts, count = needed_pages(*map(jnp.asarray, args), 8, 16)
  assert int(count[0]) == 7 and np.asarray(starts)[0, :7].tolist() == list(range(144, 200, 8))


def test_refuses_mismatched_operands():
  pool = jnp.zeros((HKV, 4, 8, D))
  table = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="positions"):
    kernels.paged_prefill_attention(jnp.zeros((1, 8, 4, D)), pool, pool, table, table, table,
                                    jnp.zeros((1, 7), jnp.int32), jnp.zeros((1, 8), jnp.int32))

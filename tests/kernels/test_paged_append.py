"""Decode attention with the K/V append == the write then paged attention's float32
reference (Triton kernel, Pallas interpreter on CPU): outputs, log-sum-exps, and every page
of the pool after the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.kernels.paged_append import (paged_attention_append,
                                             paged_attention_append_reference)
from jaxrl_post.kernels.paged_attention import PagedAttentionConfig
from jaxrl_post.kernels.qk_prep import PrepOperands, QKPrep, prepare_pair
from tests.kernels.helpers import assert_close, page_tables, random_pool

D = 16
MAX_PAGES = 4
reference = jax.jit(paged_attention_append_reference, static_argnames=("window", "prep"))


def prep_case(rng, b, norm: str):
  """A QKPrep and its operands: RoPE tables at random positions, and for "norm" (w) or
  "norm1" (1 + w) random norm weights."""
  positions = rng.integers(0, 4096, size=(b, 1))
  angles = positions * 10000.0 ** (-np.arange(D // 2) / (D // 2))
  ops = PrepOperands(jnp.asarray(np.cos(angles), jnp.float32),
                     jnp.asarray(np.sin(angles), jnp.float32))
  if norm == "rope":
    return QKPrep(), ops
  weight = lambda: jnp.asarray(rng.uniform(0.5, 1.5, size=D), jnp.bfloat16)
  prep = QKPrep(norm_eps=1e-6, norm_plus_one=norm == "norm1")
  return prep, ops._replace(q_scale=weight(), k_scale=weight())


def run_case(hq, hkv, page_size, dtype, lengths, seed=0, window=None, sink_rows=(),
             prep=None, **config):
  rng = np.random.default_rng(seed)
  b = len(lengths)
  num_pages = b * MAX_PAGES + 2
  k_pages, v_pages = random_pool(rng, hkv, num_pages, page_size, D, dtype)
  table = page_tables(rng, lengths, MAX_PAGES, page_size, num_pages - 1)
  table = jnp.where(table >= 0, table + 1, table)  # Page 0 is the sink, as in the engine.
  lengths = np.asarray(lengths, np.int32)
  write_page = np.take_along_axis(np.asarray(table), (lengths[:, None] - 1) // page_size,
                                  axis=1)[:, 0]
  write_page[list(sink_rows)] = 0  # Rows whose output nobody wants write to a sink page.
  args = (jnp.asarray(rng.normal(size=(b, hq + 2 * hkv, D)), dtype),)
  tail = (table, jnp.asarray(lengths), jnp.asarray(write_page, jnp.int32),
          jnp.asarray((lengths - 1) % page_size, jnp.int32))
  prep, ops = (None, None) if prep is None else prep_case(rng, b, prep)
  want = reference(*args, k_pages, v_pages, *tail, window=window, prep=prep, prep_ops=ops)
  cfg = PagedAttentionConfig(backend="triton", **config)
  out, lse, k_got, v_got = paged_attention_append(*args, k_pages, v_pages, *tail, config=cfg,
                                                  window=window, prep=prep, prep_ops=ops)
  live = np.asarray([i not in sink_rows for i in range(b)])
  assert out.dtype == dtype and out.shape == (b, hq, D)
  assert_close(np.asarray(out)[live], np.asarray(want[0])[live], dtype)
  assert_close(np.asarray(lse)[live], np.asarray(want[1])[live], jnp.float32)
  pages = [p for p in range(num_pages) if p != 0 or not sink_rows]  # the sink: any row's
  if prep is None:
    np.testing.assert_array_equal(np.asarray(k_got)[:, pages], np.asarray(want[2])[:, pages])
  else:  # The new keys normed and rotated in float32 in both, summed in other orders.
    assert_close(np.asarray(k_got)[:, pages], np.asarray(want[2])[:, pages], dtype)
  np.testing.assert_array_equal(np.asarray(v_got)[:, pages], np.asarray(want[3])[:, pages])


F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("dtype,page_size,group,splits", [
    (F32, 8, 1, 1), (BF16, 16, 2, 2), (BF16, 8, 4, 1), (F32, 16, 4, 2)])
def test_matches_the_write_then_attention(dtype, page_size, group, splits):
  full = MAX_PAGES * page_size
  # The first token (nothing in the pool), a full table, the first slot of a new page,
  # the last slot of a page, and mid-page.
  lengths = [1, full, page_size + 1, 2 * page_size, 3 * page_size - 3]
  run_case(2 * group, 2, page_size, dtype, lengths, block_kv=2 * page_size,
           num_splits=splits)


@pytest.mark.parametrize("dtype,prep,splits", [(F32, "rope", 1), (BF16, "rope", 2),
                                               (F32, "norm", 2), (BF16, "norm1", 1)])
def test_queries_and_the_new_key_normed_and_rotated_in_the_kernel(dtype, prep, splits):
  """qkv as the projection leaves it: the kernel applies Qwen3's q/k norm (with "norm",
  or in Gemma's 1 + w form) and RoPE to the queries and the new key as it reads them,
  and writes the rotated key."""
  page_size = 8
  lengths = [1, MAX_PAGES * page_size, page_size + 1, 2 * page_size, 3 * page_size - 3]
  run_case(4, 2, page_size, dtype, lengths, prep=prep, block_kv=2 * page_size,
           num_splits=splits)


def test_sliding_window_and_sink_rows():
  """A window of 11 over pages of 8 (the new key always inside it), three splits, and two
  rows writing to the shared sink page whose outputs are ignored."""
  run_case(4, 2, 8, F32, [29, 17, 5, 32, 9], window=11, block_kv=16, num_splits=3,
           sink_rows=(1, 4))


@pytest.mark.parametrize("dtype,prefix_splits,suffix_splits,prep", [
    (F32, 2, 1, None), (BF16, 2, 2, None), (F32, 1, 2, None), (F32, 2, 1, "norm"),
    (BF16, 1, 2, "rope")])
def test_a_prior_prefix_is_folded_in_as_cascade_merges_it(dtype, prefix_splits,
                                                          suffix_splits, prep):
  """Cascade decode: two blocks of three rows (not a power of two: padded in the prefix
  kernel), each block sharing prompt pages (the second none at all: its rows attend only
  to their own), the prefix kernel's splits handed over unmerged. The answer is the
  prefix's and the suffix's attention merged. With `prep` both kernels norm and rotate
  the queries they read (and the suffix kernel the new key)."""
  from jaxrl_post.kernels.paged_attention import (merge_attention_parts,
                                                  paged_attention_block_parts,
                                                  paged_attention_with_lse_reference)
  rng = np.random.default_rng(4)
  hq, hkv, ps, rows, blocks = 4, 2, 8, 3, 2
  b = rows * blocks
  num_pages = 2 * b * MAX_PAGES + 2
  k_pages, v_pages = random_pool(rng, hkv, num_pages, ps, D, dtype)
  pages = rng.permutation(np.arange(1, num_pages))  # 0 is the sink
  prefix_lengths = jnp.asarray([3 * ps, 0], jnp.int32)
  prefix_table = jnp.asarray(pages[:2 * MAX_PAGES].reshape(blocks, MAX_PAGES), jnp.int32)
  suffix = [1, ps + 2, 2 * ps, 5, ps, 3 * ps - 1]
  table = jnp.asarray(pages[2 * MAX_PAGES:2 * MAX_PAGES + b * MAX_PAGES].reshape(
      b, MAX_PAGES), jnp.int32)
  lengths = np.asarray(suffix, np.int32)
  write_page = np.take_along_axis(np.asarray(table), (lengths[:, None] - 1) // ps, 1)[:, 0]
  qkv = jnp.asarray(rng.normal(size=(b, hq + 2 * hkv, D)), dtype)
  tail = (table, jnp.asarray(lengths), jnp.asarray(write_page, jnp.int32),
          jnp.asarray((lengths - 1) % ps, jnp.int32))

  prep, ops = (None, None) if prep is None else prep_case(rng, b, prep)
  suf_out, suf_lse, k_want, v_want = reference(qkv, k_pages, v_pages, *tail, prep=prep,
                                               prep_ops=ops)
  queries = qkv[:, :hq]
  if prep is not None:
    queries = prepare_pair(queries, qkv[:, hq:hq + hkv], prep, ops)[0].astype(dtype)
  pre_out, pre_lse = paged_attention_with_lse_reference(
      queries.astype(jnp.float32), k_pages, v_pages,
      jnp.repeat(prefix_table, rows, axis=0), jnp.repeat(prefix_lengths, rows))
  want_out, want_lse = merge_attention_parts(jnp.stack([pre_out, suf_out]),
                                             jnp.stack([pre_lse, suf_lse]))

  cfg = PagedAttentionConfig(backend="triton", block_kv=ps, num_splits=prefix_splits)
  prior = paged_attention_block_parts(qkv, k_pages, v_pages, prefix_table, prefix_lengths,
                                      cfg, prep, ops)
  assert prior[0].shape == (prefix_splits, b, hkv, hq // hkv, D)
  cfg = PagedAttentionConfig(backend="triton", block_kv=ps, num_splits=suffix_splits)
  out, lse, k_got, v_got = paged_attention_append(qkv, k_pages, v_pages, *tail, config=cfg,
                                                  prior=prior, prep=prep, prep_ops=ops)
  assert out.dtype == dtype
  assert_close(out, want_out, dtype)
  assert_close(lse, want_lse, jnp.float32)
  if prep is None:
    np.testing.assert_array_equal(np.asarray(k_got), np.asarray(k_want))
  else:
    assert_close(np.asarray(k_got), np.asarray(k_want), dtype)
  np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_want))

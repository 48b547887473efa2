"""Paged decode attention == its dense float32 reference (Pallas interpreter on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import kernels
from jaxrl_post.kernels.paged_attention import BACKENDS, masked_decode_attention_reference
from tests.kernels.helpers import assert_close, page_tables, random_pool

D = 16
MAX_PAGES = 4
reference = jax.jit(kernels.paged_attention_with_lse_reference, static_argnames=("window",))


def run_case(backend, hq, hkv, page_size, dtype, lengths, shared=(), seed=0, window=None,
             **config):
  rng = np.random.default_rng(seed)
  num_pages = len(lengths) * MAX_PAGES + 2
  k_pages, v_pages = random_pool(rng, hkv, num_pages, page_size, D, dtype)
  table = page_tables(rng, lengths, MAX_PAGES, page_size, num_pages, shared)
  q = jnp.asarray(rng.normal(size=(len(lengths), hq, D)), dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  cfg = kernels.PagedAttentionConfig(backend=backend, **config)
  out, lse = kernels.paged_attention_with_lse(q, k_pages, v_pages, table, lengths, config=cfg,
                                              window=window)
  ref_out, ref_lse = reference(q, k_pages, v_pages, table, lengths, window=window)
  assert out.dtype == dtype and out.shape == q.shape
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, jnp.float32)  # lse is accumulated in f32 from the same inputs
  return out


F32, BF16 = jnp.float32, jnp.bfloat16
# Every pair of (backend, dtype, page size, GQA group) values occurs at least once: the
# all-pairs cover of the full 24-case product at a third of the interpreter's compile time.
SWEEP = [("triton", F32, 8, 1), ("triton", BF16, 16, 2), ("triton", BF16, 8, 4),
         ("triton", F32, 16, 4), ("mosaic", BF16, 16, 1), ("mosaic", F32, 8, 2),
         ("mosaic", F32, 16, 4), ("mosaic", BF16, 8, 4)]


@pytest.mark.parametrize("backend,dtype,page_size,group", SWEEP,
                         ids=[f"{b}-{jnp.dtype(d).name}-ps{p}-g{g}" for b, d, p, g in SWEEP])
def test_matches_reference(backend, dtype, page_size, group):
  full = MAX_PAGES * page_size
  # Ragged: a single token, a full table, a page boundary, one past it, and mid-page;
  # sequence 4 shares sequence 1's first three pages (a shared prompt).
  lengths = [1, full, page_size, page_size + 1, 3 * page_size - 3]
  run_case(backend, 2 * group, 2, page_size, dtype, lengths, shared=[(1, 4, 3)],
           block_kv=2 * page_size, num_splits=2)


@pytest.mark.parametrize("pages_per_block", [1, 2, 8])
def test_the_tpu_kernels_read_each_page_of_a_row_once(pages_per_block):
  """What the Mosaic kernels' page inputs fetch over a row's page blocks (Pallas copies an
  input in only when its index changes from the step before): every page the row reached,
  none past its last, and no page twice unless the row is shorter than one block."""
  from jaxrl_post.kernels.paged_attention import held_slot

  blocks = 5
  for last in range(blocks * pages_per_block):
    fetched = []
    for j in range(pages_per_block):
      held = [int(held_slot(i, j, pages_per_block, last)) for i in range(blocks)]
      fetched += [s for n, s in enumerate(held) if n == 0 or s != held[n - 1]]
    assert max(fetched) <= last and set(range(last + 1)) <= set(fetched), (last, fetched)
    assert len(fetched) == max(last + 1, pages_per_block), (last, fetched)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_masks_keys_behind_it(backend):
  """Gemma 3's sliding layers: a window of 11 over pages of 8, the query late in a page,
  early in one, and shorter than the window; blocks of two pages, two context splits."""
  out = run_case(backend, 4, 2, 8, jnp.float32, [29, 17, 5, 32], window=11, block_kv=16,
                 num_splits=2)
  full = run_case(backend, 4, 2, 8, jnp.float32, [29, 17, 5, 32], block_kv=16, num_splits=2)
  assert np.allclose(out[2], full[2]) and not np.allclose(out[0], full[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_kv,num_splits", [(8, 1), (8, 4), (32, None)])
def test_block_and_split_choices_agree(backend, block_kv, num_splits):
  lengths = [5, 32, 17]
  run_case(backend, 4, 2, 8, jnp.float32, lengths, block_kv=block_kv, num_splits=num_splits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_gives_zero_and_minus_inf(backend):
  out = run_case(backend, 2, 1, 8, jnp.float32, [0, 9], num_splits=2, block_kv=8)
  assert np.all(np.asarray(out[0]) == 0)


def test_multi_query_all_heads_share_one_kv_head():
  run_case("triton", 8, 1, 8, jnp.float32, [3, 30])


def test_default_config_runs_on_this_backend():
  lengths = [7, 32]
  rng = np.random.default_rng(1)
  k_pages, v_pages = random_pool(rng, 1, 10, 8, D, jnp.float32)
  table = page_tables(rng, lengths, MAX_PAGES, 8, 10)
  q = jnp.asarray(rng.normal(size=(2, 2, D)), jnp.float32)
  lengths = jnp.asarray(lengths, jnp.int32)
  out = kernels.paged_attention(q, k_pages, v_pages, table, lengths)
  assert_close(out, reference(q, k_pages, v_pages, table, lengths)[0], jnp.float32)


def test_merge_of_split_key_sets_is_exact():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(2, 4, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 12, 2, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 12, 2, D)), jnp.float32)
  first = jnp.arange(12)[None] < 5
  parts = [masked_decode_attention_reference(q, k, v, jnp.broadcast_to(m, (2, 12)))
           for m in (first, ~first, jnp.zeros_like(first))]  # the last part is empty
  out, lse = kernels.merge_attention_parts(jnp.stack([p[0] for p in parts]),
                                      jnp.stack([p[1] for p in parts]))
  ref_out, ref_lse = masked_decode_attention_reference(q, k, v, jnp.ones((2, 12), bool))
  assert_close(out, ref_out, jnp.float32)
  assert_close(lse, ref_lse, jnp.float32)


def test_triton_rejects_non_power_of_two_head_dim():
  q = jnp.zeros((1, 2, 24), jnp.float32)
  pages = jnp.zeros((1, 4, 8, 24), jnp.float32)
  cfg = kernels.PagedAttentionConfig(backend="triton")
  with pytest.raises(ValueError, match="power-of-two head_dim"):
    kernels.paged_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                            jnp.ones((1,), jnp.int32), config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_kernel_matches_reference(dtype):
  assert jax.default_backend() == "gpu"
  lengths = [1, 64, 16, 17, 45, 33, 2, 64]
  run_case(None, 8, 2, 16, dtype, lengths, shared=[(1, 4, 3)], block_kv=16)
  run_case(None, 8, 2, 16, dtype, lengths, shared=[(1, 4, 3)])

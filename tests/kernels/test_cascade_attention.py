"""Cascade (shared-prefix) attention == paged attention and the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import kernels
from jaxrl_post.kernels.paged_attention import BACKENDS
from tests.kernels.helpers import assert_close, random_pool

D = 16
PAGE = 8
reference = jax.jit(kernels.cascade_attention_with_lse_reference)


def build(rng, groups, samples, hq, hkv, prefix_lens, suffix_lens, dtype,
          max_prefix_pages=3, max_suffix_pages=2):
  """Disjoint prefix pages per group and suffix pages per sample, from one pool."""
  b = groups * samples
  num_pages = groups * max_prefix_pages + b * max_suffix_pages + 1
  k_pages, v_pages = random_pool(rng, hkv, num_pages, PAGE, D, dtype)
  perm = rng.permutation(num_pages)
  n_pre = groups * max_prefix_pages
  prefix = perm[:n_pre].reshape(groups, max_prefix_pages)
  suffix = perm[n_pre:n_pre + b * max_suffix_pages].reshape(b, max_suffix_pages)
  q = jnp.asarray(rng.normal(size=(b, hq, D)), dtype)
  return dict(q=q, k_pages=k_pages, v_pages=v_pages,
              prefix_page_table=jnp.asarray(prefix, jnp.int32),
              prefix_lengths=jnp.asarray(prefix_lens, jnp.int32),
              suffix_page_table=jnp.asarray(suffix, jnp.int32),
              suffix_lengths=jnp.asarray(suffix_lens, jnp.int32))


def per_sequence_table(case, samples):
  """The equivalent plain paged input: whole prefix pages, then the sample's suffix pages."""
  prefix = np.asarray(case["prefix_page_table"])
  suffix = np.asarray(case["suffix_page_table"])
  pre_lens = np.asarray(case["prefix_lengths"])
  assert np.all(pre_lens % PAGE == 0), "only whole prefix pages are contiguous"
  width = prefix.shape[1] + suffix.shape[1]
  rows = []
  for b in range(suffix.shape[0]):
    n = pre_lens[b // samples] // PAGE
    row = np.concatenate([prefix[b // samples, :n], suffix[b]])
    rows.append(np.pad(row, (0, width - row.size)))
  lengths = np.repeat(pre_lens, samples) + np.asarray(case["suffix_lengths"])
  return jnp.asarray(np.stack(rows), jnp.int32), jnp.asarray(lengths, jnp.int32)


def config(backend):
  paged = kernels.PagedAttentionConfig(backend=backend, block_kv=8, num_splits=2)
  return kernels.CascadeAttentionConfig(prefix=paged, suffix=paged)


F32, BF16 = jnp.float32, jnp.bfloat16
# All pairs of (backend, dtype, GQA group) values.
SWEEP = [("triton", F32, 1), ("triton", BF16, 2), ("triton", F32, 4),
         ("mosaic", BF16, 1), ("mosaic", F32, 2), ("mosaic", BF16, 4)]


@pytest.mark.parametrize("backend,dtype,group", SWEEP,
                         ids=[f"{b}-{jnp.dtype(d).name}-g{g}" for b, d, g in SWEEP])
def test_equals_paged_attention_on_whole_prefix_pages(backend, dtype, group):
  rng = np.random.default_rng(group)
  # Two prompts of 3 and 1 whole pages; three samples each with ragged suffixes (1 = the
  # first decoded token, 16 = a full suffix table).
  case = build(rng, 2, 3, 2 * group, 2, [3 * PAGE, PAGE], [1, 16, 9, 2, 8, 13], dtype)
  cfg = config(backend)
  out, lse = kernels.cascade_attention_with_lse(**case, config=cfg)
  table, lengths = per_sequence_table(case, 3)
  ref_out, ref_lse = kernels.paged_attention_with_lse(case["q"], case["k_pages"], case["v_pages"],
                                                 table, lengths, config=cfg.prefix)
  assert out.dtype == dtype
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, jnp.float32)
  assert_close(out, reference(**case)[0], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_and_empty_prefix_match_reference(backend):
  rng = np.random.default_rng(7)
  # Prompts of 13 tokens (partial last shared page), 0 tokens (no shared prefix) and a
  # full 24; two samples each.
  case = build(rng, 3, 2, 4, 2, [13, 0, 3 * PAGE], [1, 11, 5, 16, 2, 1], jnp.float32)
  out, lse = kernels.cascade_attention_with_lse(**case, config=config(backend))
  ref_out, ref_lse = reference(**case)
  assert_close(out, ref_out, jnp.float32)
  assert_close(lse, ref_lse, jnp.float32)


def test_partial_prefix_ignores_slots_past_the_prompt():
  """Garbage written after the prompt in its last shared page must not change the output."""
  rng = np.random.default_rng(3)
  case = build(rng, 1, 2, 2, 1, [13], [4, 6], jnp.float32)
  out = kernels.cascade_attention(**case, config=config("triton"))
  last = int(case["prefix_page_table"][0, 1])
  for name in ("k_pages", "v_pages"):
    case[name] = case[name].at[:, last, 13 % PAGE:].set(1e3)
  assert_close(kernels.cascade_attention(**case, config=config("triton")), out, jnp.float32)


def test_single_sample_groups_reduce_to_paged():
  rng = np.random.default_rng(4)
  case = build(rng, 3, 1, 4, 2, [PAGE, 2 * PAGE, 0], [3, 1, 12], jnp.float32)
  table, lengths = per_sequence_table(case, 1)
  out = kernels.cascade_attention(**case, config=config("triton"))
  ref = jax.jit(kernels.paged_attention_reference)(case["q"], case["k_pages"], case["v_pages"],
                                             table, lengths)
  assert_close(out, ref, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_kernel_matches_reference(dtype):
  assert jax.default_backend() == "gpu"
  rng = np.random.default_rng(5)
  case = build(rng, 2, 4, 8, 2, [3 * PAGE, 13], [1, 16, 9, 2, 8, 13, 5, 7], dtype)
  assert_close(kernels.cascade_attention(**case), reference(**case)[0], dtype)

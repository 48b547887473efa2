"""Cascade (shared-prefix) decode attention for groups of samples of one prompt.

GRPO-style rollouts decode K samples per prompt. Their keys are the prompt's (identical for
all K, stored once in shared pages) followed by each sample's own tokens. Plain paged
attention would read the shared prompt pages K times per step; here the K samples' queries
are stacked into one ``[K * Hq/Hkv, D]`` query block per KV head, so the prefix K/V is read
once per group, then each sample attends to its own suffix pages, and the two partial
attentions merge exactly by log-sum-exp (softmax over a union of disjoint key sets).
Stacking the queries also turns the prefix part from a matrix-vector into a real
matrix-matrix product (K x more rows per key tile), which is what tensor cores/MXUs want.

Both parts run the paged kernels of :mod:`paged_attention` (Triton on GPU, Mosaic on TPU,
interpreter on CPU); cascade adds only the query regrouping and the merge.

Layout: ``B = G * K`` and the samples of group g are rows ``g*K .. g*K + K - 1`` of q.

Partial prefix pages: ``prefix_lengths`` need not be a multiple of the page size. The prefix
part masks keys at or after ``prefix_lengths[g]``, so slots beyond the prompt in the last
shared page are never read as keys, and the suffix starts on its own page. This equals
:func:`paged_attention` on the per-sequence table "prefix pages, then suffix pages" exactly
when the prefix is a whole number of pages (otherwise the tokens are not contiguous in
that table). An engine that wants that equivalence copies the prompt's partial last page
into each sample's first suffix page and passes only the whole shared pages as the prefix;
an engine that does not copy passes the true prompt length. Both are supported and tested.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Submodule path: the package re-exports `paged_attention` the function under the module's name.
from jaxrl_post.kernels.paged_attention import (
    PagedAttentionConfig,
    gather_pages,
    masked_decode_attention_reference,
    merge_attention_parts,
    paged_attention_parts,
)


@dataclasses.dataclass(frozen=True)
class CascadeAttentionConfig:
  """Tunables per part: the prefix call has G sequences and K x more query rows per head.

  Attributes:
    prefix: kernel config of the shared-prefix part.
    suffix: kernel config of the per-sample suffix part.
  """
  prefix: PagedAttentionConfig = PagedAttentionConfig()
  suffix: PagedAttentionConfig = PagedAttentionConfig()


def group_queries(q, num_groups, hkv):  # [G*K, Hq, D] -> [G, Hkv * K * Hq/Hkv, D]
  """Stack a group's K samples per KV head so the kernel treats them as one head group."""
  b, hq, d = q.shape
  k = b // num_groups
  qg = jnp.swapaxes(q.reshape(num_groups, k, hkv, hq // hkv, d), 1, 2)  # [G, Hkv, K, G', D]
  return qg.reshape(num_groups, hkv * k * (hq // hkv), d)


def ungroup_queries(x, num_groups, hkv, hq):  # [G, Hkv*K*G', ...] -> [G*K, Hq, ...]
  """Inverse of group_queries for outputs (with trailing D) and lse (without)."""
  tail = x.shape[2:]
  k = x.shape[1] // hq
  x = jnp.swapaxes(x.reshape(num_groups, hkv, k, hq // hkv, *tail), 1, 2)
  return x.reshape(num_groups * k, hq, *tail)


def _check(q, prefix_page_table, prefix_lengths, suffix_page_table, suffix_lengths):
  b = q.shape[0]
  g = prefix_page_table.shape[0]
  if b % g:
    raise ValueError(f"batch {b} is not a multiple of the number of groups {g}")
  if prefix_lengths.shape != (g,) or suffix_page_table.shape[0] != b:
    raise ValueError("prefix tables are per group [G, ...], suffix tables per sequence [B, ...]")
  if suffix_lengths.shape != (b,):
    raise ValueError(f"suffix_lengths {suffix_lengths.shape} != ({b},)")


def cascade_attention_parts(q, k_pages, v_pages, prefix_page_table, prefix_lengths,
                            suffix_page_table, suffix_lengths, config):
  """Un-jitted core: ([B, Hq, D] f32 output, [B, Hq] f32 log-sum-exp)."""
  _check(q, prefix_page_table, prefix_lengths, suffix_page_table, suffix_lengths)
  hq = q.shape[1]
  num_groups, hkv = prefix_page_table.shape[0], k_pages.shape[0]
  qg = group_queries(q, num_groups, hkv)
  pre_out, pre_lse = paged_attention_parts(
      qg, k_pages, v_pages, prefix_page_table, prefix_lengths, config.prefix)
  pre_out = ungroup_queries(pre_out, num_groups, hkv, hq)  # [B, Hq, D]
  pre_lse = ungroup_queries(pre_lse, num_groups, hkv, hq)  # [B, Hq]
  suf_out, suf_lse = paged_attention_parts(
      q, k_pages, v_pages, suffix_page_table, suffix_lengths, config.suffix)
  return merge_attention_parts(jnp.stack([pre_out, suf_out]),
                                     jnp.stack([pre_lse, suf_lse]))


@functools.partial(jax.jit, static_argnames=("config",))
def cascade_attention_with_lse(q, k_pages, v_pages, prefix_page_table, prefix_lengths,
                               suffix_page_table, suffix_lengths, *,
                               config=CascadeAttentionConfig()):
  """Shared-prefix decode attention and its log-sum-exp.

  Args:
    q: [B, Hq, D] one query per sequence, B = G * K, group g's samples contiguous.
    k_pages: [Hkv, num_pages, page_size, D] key pool shared by both parts.
    v_pages: [Hkv, num_pages, page_size, D] value pool.
    prefix_page_table: [G, max_prefix_pages] int32 pages of each group's shared prompt.
    prefix_lengths: [G] int32 shared prompt tokens (any value, see the module docstring).
    suffix_page_table: [B, max_suffix_pages] int32 pages private to each sample.
    suffix_lengths: [B] int32 private tokens per sample.
    config: static tunables per part.

  Returns:
    ([B, Hq, D] in q's dtype, [B, Hq] float32 log-sum-exp over prefix and suffix keys).
  """
  out, lse = cascade_attention_parts(q, k_pages, v_pages, prefix_page_table,
                                     prefix_lengths, suffix_page_table, suffix_lengths,
                                     config)
  return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("config",))
def cascade_attention(q, k_pages, v_pages, prefix_page_table, prefix_lengths,
                      suffix_page_table, suffix_lengths, *, config=CascadeAttentionConfig()):
  """Shared-prefix decode attention, [B, Hq, D] in q's dtype; see cascade_attention_with_lse."""
  out, _ = cascade_attention_parts(q, k_pages, v_pages, prefix_page_table, prefix_lengths,
                                   suffix_page_table, suffix_lengths, config)
  return out.astype(q.dtype)


# ----------------------------------------------------------------------------- reference


def cascade_attention_with_lse_reference(q, k_pages, v_pages, prefix_page_table,
                                         prefix_lengths, suffix_page_table, suffix_lengths):
  """float32 reference: each sequence's dense keys = its group's prefix ++ its suffix."""
  b = q.shape[0]
  k_samples = b // prefix_page_table.shape[0]
  prefix_rows = jnp.repeat(prefix_page_table, k_samples, axis=0)  # [B, Mp]
  prefix_lens = jnp.repeat(prefix_lengths, k_samples)  # [B]
  k = jnp.concatenate([gather_pages(k_pages, prefix_rows),
                       gather_pages(k_pages, suffix_page_table)], axis=1)
  v = jnp.concatenate([gather_pages(v_pages, prefix_rows),
                       gather_pages(v_pages, suffix_page_table)], axis=1)
  s_pre = prefix_rows.shape[1] * k_pages.shape[2]
  s_suf = suffix_page_table.shape[1] * k_pages.shape[2]
  valid = jnp.concatenate([jnp.arange(s_pre)[None] < prefix_lens[:, None],
                           jnp.arange(s_suf)[None] < suffix_lengths[:, None]], axis=1)
  return masked_decode_attention_reference(q, k, v, valid)


def cascade_attention_reference(q, k_pages, v_pages, prefix_page_table, prefix_lengths,
                                suffix_page_table, suffix_lengths):
  """float32 [B, Hq, D] reference output of cascade_attention."""
  return cascade_attention_with_lse_reference(q, k_pages, v_pages, prefix_page_table,
                                              prefix_lengths, suffix_page_table,
                                              suffix_lengths)[0]

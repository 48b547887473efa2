"""Pallas kernels for rollout decode and training, each beside its float32 jnp reference.

A leaf package: it imports only jax. Each kernel picks its lowering per call -- Triton on
GPU, Mosaic (or JAX's splash attention) on TPU, the Pallas interpreter on CPU -- and keeps
its tunables in a frozen config dataclass passed as a static argument.

* paged_attention: decode attention against a paged KV pool (GQA, ragged lengths); on a
  GPU also cascade's block prefix (paged_attention_block_parts).
* paged_append: the GPU's decode attention that also writes the new token's K/V (and
  folds in a block prefix's parts).
* qk_prep: the q/k norm and RoPE the GPU's decode kernels apply to the rows they read.
* paged_prefill: packed prompt chunks against their own pages (the engine's prefill).
* cascade_attention: shared-prompt decode for groups of samples, merged by log-sum-exp.
* packed_attention: causal attention over packed segments, with gradients (and RoPE
  applied inside the GPU kernels).
* chunked_logprob: token log-probabilities and entropies without [T, V] logits.

The package names bind the functions, which shadow their modules' names; import module
internals by full path, e.g. ``from jaxrl_post.kernels.paged_attention import BACKENDS``.
"""

from jaxrl_post.kernels.cascade_attention import (
    CascadeAttentionConfig,
    cascade_attention,
    cascade_attention_reference,
    cascade_attention_with_lse,
    cascade_attention_with_lse_reference,
)
from jaxrl_post.kernels.chunked_logprob import (
    ChunkedLogprobConfig,
    chunked_logprob,
    chunked_logprob_reference,
)
from jaxrl_post.kernels.packed_attention import (
    RESIDUAL_NAMES as PACKED_ATTENTION_RESIDUALS,
    PackedAttentionConfig,
    packed_attention,
    packed_attention_reference,
    rotate_half,
    rotates_in_kernel,
)
from jaxrl_post.kernels.paged_attention import (
    PagedAttentionConfig,
    gather_pages,
    merge_attention_parts,
    paged_attention,
    paged_attention_reference,
    paged_attention_with_lse,
    paged_attention_with_lse_reference,
)
from jaxrl_post.kernels.paged_prefill import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

__all__ = [
    "PACKED_ATTENTION_RESIDUALS",
    "CascadeAttentionConfig",
    "ChunkedLogprobConfig",
    "PackedAttentionConfig",
    "PagedAttentionConfig",
    "cascade_attention",
    "cascade_attention_reference",
    "cascade_attention_with_lse",
    "cascade_attention_with_lse_reference",
    "chunked_logprob",
    "chunked_logprob_reference",
    "gather_pages",
    "merge_attention_parts",
    "packed_attention",
    "packed_attention_reference",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_with_lse",
    "paged_attention_with_lse_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "rotate_half",
    "rotates_in_kernel",
]

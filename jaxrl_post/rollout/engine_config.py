"""The rollout engine's shapes and budgets (EngineConfig): slots, decode steps, prefill
chunks and rows, the page pool, cascade blocks, decode widths, the prefix cache."""

from __future__ import annotations

import dataclasses

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import FLOAT_DTYPES
from jaxrl_post.rollout.pages import PoolConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Shapes and budgets of the rollout engine (a change recompiles).

  Attributes:
    num_slots: sequences decoded together (the decode batch). None sizes it from the work:
      `sized_for(sequences)` gives one slot per sequence (the training loop: prompts per
      step x group size; `generate` and the generate CLI: requests x n, as many as the
      pool holds); an Engine built with None takes as many sequences of its max_seq_len
      as its pool holds (at least 8, at most MAX_SLOTS).
    decode_steps: decode steps per device call; the host sees tokens once per call.
    prefill_chunk: most prompt tokens of one prompt written per prefill call.
    prefill_rows: most prompts prefilled together in one call, per data shard; their
      chunks are laid end to end in rows of that shard (rollout.prefill_pack), so a call
      computes about as many positions as it has prompt tokens.
    max_seq_len: longest prompt + completion; None means the model's context.
    max_stop_ids: most stop ids per request.
    kv_dtype: the pool's dtype; None means the model's compute dtype.
    min_table_pages: narrowest page table a device call sees. Tables are cut to a power of
      two of pages >= this (and <= max_seq_len / page_size), so attention gathers at most
      twice the pages in use while only a few table shapes are ever compiled.
    pool: how many KV pages to allocate.
    group_slots: 0 for independent slots; K > 0 groups the slots into blocks of K
      contiguous slots that each decode samples of one prompt, with cascade attention
      reading the prompt's shared pages once per block (see the module docstring).
      num_slots must be a multiple. Pick the usual samples per prompt: a prompt with
      fewer samples leaves the rest of its block idle until the block empties.
    decode_buckets: a decode call runs only the live slots of each data shard, padded to
      the narrowest of this many evenly spaced widths (see rollout.compact): slots that
      finished or wait to be refilled cost nothing. 1 runs every slot in every call; each
      width is its own decode program, compiled when a call first needs it (widths never
      exceed the slots per data shard). Cascade decode (group_slots) always runs every
      slot.
    prefix_cache: keep prefilled prompts' whole pages, so later prompts that start with
      the same tokens (a chat template, a system prompt, a few-shot preamble) reuse their
      K/V instead of prefilling it, to the token (a page that matches in part is copied;
      see rollout.prefix_cache). The cache holds its pages
      until the pool runs short, the weights change, or `drop_prefix_cache`.
    split_layers: hold the weights one buffer per layer and unroll the layers in the
      engine's programs (rollout.weights); None decides by platform (GPU: yes; TPU: for MoE).
  """

  num_slots: int | None = None
  decode_steps: int = 16
  prefill_chunk: int = 256
  prefill_rows: int = 8
  max_seq_len: int | None = None
  max_stop_ids: int = 8
  kv_dtype: str | None = None
  min_table_pages: int = 16
  pool: PoolConfig = PoolConfig()
  group_slots: int = 0
  # Each width a job reaches is one more decode program to compile (see rollout.compact).
  decode_buckets: int = 4
  prefix_cache: bool = False
  # None: on a GPU mesh (and a TPU one for MoE), see rollout.weights. A run's weight sync
  # writes the split form itself, so the weights are held once either way.
  split_layers: bool | None = None

  def __post_init__(self):
    for name in ("num_slots", "decode_steps", "prefill_chunk", "prefill_rows",
                 "max_stop_ids", "min_table_pages", "decode_buckets"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise UserError(f"engine config: {name} must be >= 1, got {value}")
    if self.group_slots < 0:
      raise UserError(f"engine config: group_slots must be >= 0 (0 = off), "
                      f"got {self.group_slots}")
    if self.group_slots and self.num_slots is not None and self.num_slots % self.group_slots:
      raise UserError(f"engine config: num_slots ({self.num_slots}) must be a multiple of "
                      f"group_slots ({self.group_slots})")
    if self.kv_dtype is not None and self.kv_dtype not in FLOAT_DTYPES:
      raise UserError(f"engine config: kv_dtype={self.kv_dtype!r} is not one of "
                      f"{FLOAT_DTYPES} (None: the model's compute dtype)")

  def pool_dtype(self, model_config):
    """The KV pool's dtype for model_config: kv_dtype, else the model's compute dtype (the
    engine allocates this; plan sizes and prices the pool with it)."""
    import jax.numpy as jnp

    return jnp.dtype(self.kv_dtype or model_config.compute_dtype)

  def sized_for(self, num_sequences: int, capacity: int | None = None) -> "EngineConfig":
    """This config with slots for decoding num_sequences at once.

    An explicit num_slots wins unchanged. None becomes num_sequences, at most `capacity`
    (the sequences the KV pool holds; None: no cap), rounded up to whole group_slots
    blocks: slots are fixed when the Engine is built, so callers that know the work size
    it here first.
    """
    if num_sequences < 1:
      raise UserError(f"engine config: sized_for needs >= 1 sequence, got {num_sequences}")
    if self.num_slots is not None:
      return self
    slots = num_sequences if capacity is None else max(1, min(num_sequences, capacity))
    block = self.group_slots or 1
    return dataclasses.replace(self, num_slots=-(-slots // block) * block)

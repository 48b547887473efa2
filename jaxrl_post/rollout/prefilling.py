"""The engine's prefill: pages promised to a prompt and its samples, the prompt's K/V
written a chunk per call (packed rows, rollout.prefill_pack), cached prompt pages reused,
and every sample's first token drawn once its prompt is done.

`Engine` (rollout.engine) combines it with the slot bookkeeping (rollout.slots) and the
decode calls.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxrl_post.models.moe import NO_EXPERT
from jaxrl_post.rollout import prefill_pack, programs
from jaxrl_post.rollout.pages import PagedSequence, cdiv, pow2_at_least
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.rollout.sequences import Prefix, record_prompt_experts

_MIN_CHUNK = 8  # Prefill chunk shapes: see _chunk_width.
# Tokens per packed prefill row (see Prefilling._packed_width): a row's queries attend over
# the pages of every chunk in it, so narrow rows read fewer keys; the matmuls see all rows
# at once either way. In bench_generate's calls of 16 short uneven chunks, rows of 24 read
# 6% fewer keys x positions than rows of 32.
_PACKED_ROW = 24


def _chunk_width(tokens: int) -> int:
  """Prefill chunk shape for `tokens` tokens: short prompts (the common case in RL, and
  the suffixes left after a prefix-cache hit) pad to a multiple of 8 up to 32 tokens and
  of 16 up to 64, longer chunks to a power of two, so only a few shapes compile."""
  for step, limit in ((_MIN_CHUNK, 4 * _MIN_CHUNK), (2 * _MIN_CHUNK, 8 * _MIN_CHUNK)):
    if tokens <= limit:
      return cdiv(max(tokens, 1), step) * step
  return pow2_at_least(tokens)


class Prefilling:
  """The Engine's prefill (see the module docstring)."""

  def new_prefix(self, prompt: Sequence[int], sampling: SamplingParams, seed: int,
                 sample_ids: Sequence[int], shard: int = 0) -> Prefix | None:
    """Reserves every page the prompt and its samples may need on data shard `shard`;
    None if that shard's pool is short.

    The caller validates the request first (`validate`).
    """
    alloc = self.allocs[shard]
    prompt = np.asarray(prompt, np.int32)
    private = self.private_pages(len(prompt), sampling.max_tokens)
    prompt_pages = cdiv(len(prompt), self.page_size)
    # The last sample inherits the partial prompt page instead of copying it.
    last = private - (1 if len(prompt) % self.page_size else 0)
    need = prompt_pages + (len(sample_ids) - 1) * private + last
    seq = PagedSequence(alloc, self.page_size, span=self.window_span)
    wneed = prompt_pages + (len(sample_ids) - 1) * seq.window_share(private)
    wneed += seq.window_share(last)
    if not self._reserve(seq, need, wneed):
      return None
    seq.grow(len(prompt))
    return Prefix(prompt, sampling, int(seed), tuple(int(i) for i in sample_ids), seq, private,
                  shard=shard)

  def _reserve(self, seq: PagedSequence, need: int, wneed: int) -> bool:
    """Promises `seq` need pages and wneed window pages, evicting cached prompts when the
    pool is short; False (nothing promised) when even that leaves it short."""
    alloc = seq.alloc
    wneed = 0 if alloc.window is None else wneed
    short = lambda: max(need - alloc.available,
                        0 if alloc.window is None else wneed - alloc.window.alloc.available)
    if short() > 0 and self.prefix_caches:
      self.prefix_caches[self.allocs.index(alloc)].evict(short())
    if short() > 0:
      return False
    alloc.reserve(need)
    if alloc.window is not None:
      alloc.window.alloc.reserve(wneed)
    seq.reserved += need
    seq.wreserved += wneed
    return True

  def prefill(self, prefix: Prefix) -> bool:
    """Writes the next chunk of the prompt; True once the prompt is done and first tokens drawn."""
    return self.prefill_batch([prefix])[0]

  @property
  def prefill_rows(self) -> int:
    """Most prompts one prefill call takes per data shard."""
    return self.config.prefill_rows

  def prefill_batch(self, prefixes: Sequence[Prefix]) -> list[bool]:
    """The next chunk of each prefix in one device call: at most `prefill_rows` prefixes
    per data shard, packed into rows of that shard (rollout.prefill_pack). The samples of
    every prefix that completes draw their first tokens together, in one more call,
    fetched once. Returns, per prefix, whether it is done."""
    if self.prefix_caches:
      copies = [[] for _ in range(self.shards)]
      for prefix in prefixes:
        if prefix.prefilled == 0:
          copies[prefix.shard] += self._reuse_cached_pages(prefix)
      if any(copies):
        self._copy(copies)
    counts = [min(self.config.prefill_chunk, len(p.prompt) - p.prefilled) for p in prefixes]
    chunks = [prefill_pack.Chunk(p.shard, p.prompt[p.prefilled:p.prefilled + n], p.prefilled,
                                 p.seq.pages) for p, n in zip(prefixes, counts)]
    width = self._packed_width(prefixes, counts)
    # Shapes this engine's prefill already compiled for this row width and chunk count.
    compiled = self._prefill_shapes.setdefault((width, cdiv(len(chunks), 8)), set())
    rows, last = prefill_pack.pack(chunks, shards=self.shards, page_size=self.page_size,
                                   width=width, reuse=compiled)
    compiled.add((rows.tokens.shape[0] // self.shards, rows.key_pages.shape[1]))
    adapters = None
    if programs.several_adapters(self.model_config):  # Chunk order, padded like `last`.
      adapters = np.zeros(last.shape, np.int32)
      adapters[:len(prefixes)] = [p.sampling.adapter for p in prefixes]
      adapters = self.layout.put_replicated(adapters)
    self.pool, logits, experts = programs.prefill_program(self.layout)(
        self.params, self.pool, self.layout.put_rows(rows), self.layout.put_replicated(last),
        self._window_operand(), adapters, cfg=self.model_config, layout=self.layout)
    if experts is not None:
      for prefix in prefixes:
        self._prompt_experts(prefix)
      record_prompt_experts(prefixes, rows.segments, np.asarray(jax.device_get(experts)))
    finished = []
    for prefix, n in zip(prefixes, counts):
      prefix.prefilled += n
      if prefix.prefilled == len(prefix.prompt):
        finished.append(prefix)
        if self.prefix_caches and not prefix.continued:  # A history is no shared prompt.
          self.prefix_caches[prefix.shard].add(prefix.prompt, prefix.seq.pages,
                                               prefix.experts)
    if finished:
      order = {id(p): i for i, p in enumerate(prefixes)}
      self._draw_first_tokens(finished, [order[id(p)] for p in finished], logits)
    return [p.done for p in prefixes]

  def _packed_width(self, prefixes: Sequence[Prefix], counts: list[int]) -> int:
    """Prefill row width: _PACKED_ROW, or the longest chunk's own width when that wastes
    fewer positions (prompts of one length fill their rows exactly)."""
    most = max(sum(n for p, n in zip(prefixes, counts) if p.shard == s)
               for s in range(self.shards))
    options = {min(_chunk_width(most), w) for w in (_PACKED_ROW, _chunk_width(max(counts)))}
    return min(options, key=lambda w: (prefill_pack.row_count(most, w) * w, w))

  def _reuse_cached_pages(self, prefix: Prefix) -> list[tuple[int, int]]:
    """A prompt about to be prefilled takes the cached pages of its leading tokens in
    place of its own (freed), and starts its prefill after them. Returns the page copy
    that brings a partly matching cached page into its own next page, if any."""
    found = self.prefix_caches[prefix.shard].match(prefix.prompt)
    prefix.seq.share_leading(found.pages)
    prefix.prefilled = found.tokens(self.page_size)
    if found.record is not None:  # The cached tokens' experts (MoE models).
      self._prompt_experts(prefix)[:prefix.prefilled] = found.record
    if found.partial is None:
      return []
    return [(found.partial, prefix.seq.pages[len(found.pages)])]

  def _prompt_experts(self, prefix: Prefix) -> np.ndarray:
    """The prefix's [P, L, k] expert record, created (all NO_EXPERT) on first use."""
    if prefix.experts is None:
      cfg = self.model_config
      shape = (len(prefix.prompt), cfg.num_layers, cfg.moe.experts_per_token)
      prefix.experts = np.full(shape, NO_EXPERT, np.int16)
    return prefix.experts

  @property
  def cached_prompt_tokens(self) -> int:
    """Prompt tokens served from the prefix cache instead of prefilled, so far."""
    return sum(c.hit_tokens for c in self.prefix_caches)

  def drop_prefix_cache(self) -> None:
    """Releases every cached page (pages in use by sequences stay theirs)."""
    for cache in self.prefix_caches:
      cache.clear()

  def _draw_first_tokens(self, prefixes: list[Prefix], rows: list[int], logits) -> None:
    """Every sample's first token for these prefixes (rows `rows` of the prefill's `logits`)."""
    sizes = [len(p.sample_ids) for p in prefixes]
    n = cdiv(sum(sizes), 8) * 8  # Padded to a multiple of 8: few compiled shapes.
    operands = [np.zeros((n,), dt) for dt in programs.FIRST_TOKEN_OPERANDS]
    at = 0
    for prefix, row, k in zip(prefixes, rows, sizes):
      sp = prefix.sampling
      for a, value in zip(operands, (row, prefix.seed, prefix.sample_ids, sp.temperature,
                                     sp.top_k, sp.top_p)):
        a[at:at + k] = value
      at += k
    truncation = any(p.sampling.truncates for p in prefixes)
    draws = any(p.sampling.draws for p in prefixes)
    operands = self.layout.put_replicated(operands)
    if self._ahead is not None:  # Never the same program compiled twice at once.
      self._ahead.wait(("first", logits.shape[0], n, truncation, draws))
    tok, lp, floor = jax.device_get(programs.sample_first(
        logits, *operands, layout=self.layout, truncation=truncation, draws=draws))
    at = 0
    for prefix, k in zip(prefixes, sizes):
      prefix.first_tokens, prefix.first_logprobs = tok[at:at + k], lp[at:at + k]
      prefix.first_floors = floor[at:at + k]
      prefix.first_version = self.version
      at += k

"""The rollout engine: paged KV decode with prefix sharing, shaped like JetStream's Engine.

`Engine` is the low-level interface a scheduler drives:

* `new_prefix` / `prefill`: reserve pages for a prompt and its samples, then write the
  prompt's K/V into pages one chunk per call (so prefill interleaves with decoding); the
  last chunk also draws every sample's first token.
* `insert` / `bulk_insert`: hand samples of a prefilled prompt to decode slots. They share
  the prompt's full pages; the partial last page is copied per sample (copy on write).
* `generate`: `decode_steps` decode steps for every slot in one jitted device loop.
* `free_resource`: return a finished slot's pages.

With `EngineConfig.group_slots = K` the slots form blocks of K contiguous slots, each block
decoding samples of one prompt, and decode attention is cascade attention: the block's
shared whole prompt pages are read once per block per step instead of once per sample
(the partial last prompt page is each sample's own copy, so it counts as the sample's).
Callers then insert a prompt's samples only into blocks that are free or already hold that
prompt; the Scheduler does so. Models with sliding-window layers (Mistral, Gemma 3) keep
the block placement but decode with plain paged attention, which is the only one with a
window (forward.cascade_refusal says why for a given model). When every layer has a
window (Mistral; not Gemma 3, whose global layers read every token) a decoding sequence
gives back the pages behind it.

Weights come from outside (`set_weights(params, version)`), so a trainer can swap them
between calls; every token is stamped with the version that produced it. `generate` at the
bottom of this module is the high-level call: requests in, per-sample completions out.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.moe import NO_EXPERT
from jaxrl_post.models.transformer import (Transformer, abstract_model, logical_axes,
                                           params_of)
from jaxrl_post.rollout import compact, forward, prefill_pack, weights
from jaxrl_post.rollout.attention import SharedPrefix
from jaxrl_post.rollout.layout import RolloutLayout, shard_count
from jaxrl_post.rollout.pages import (TRASH_PAGE, KVPool, PageAllocator, PagedSequence,
                                      PoolConfig, cdiv, copy_pool_pages, pow2_at_least,
                                      resolve_num_pages)
from jaxrl_post.rollout.prefix_cache import PrefixCache
from jaxrl_post.rollout.sampling import SamplingParams, sample_with_floors, token_keys
from jaxrl_post.rollout.scheduler import Completion, Request, Scheduler, SchedulerConfig
from jaxrl_post.sharding import ROLLOUT_RULES, activation_rules, tree_shardings

_MIN_CHUNK = 8  # Prefill chunk shapes: see _chunk_width.
# Tokens per packed prefill row (see Engine._packed_width): a row's queries attend over
# the pages of every chunk in it, so narrow rows read fewer keys; the matmuls see all rows
# at once either way. In bench_generate's calls of 16 short uneven chunks, rows of 24 read
# 6% fewer keys x positions than rows of 32.
_PACKED_ROW = 24
# Most slots an engine sizes itself (num_slots None, see Engine): a slot is a few small
# rows of host and device state, and slots beyond the live sequences cost nothing in a
# compacted decode step, but each one still widens every cascade step and page table.
MAX_SLOTS = 512
# Fewest slots such an engine gets: a pool too small for that many sequences of its
# max_seq_len still holds that many shorter ones, which is the usual case.
_MIN_SLOTS = 8


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
      engine's programs (rollout.weights); None decides by the mesh's platform (GPU: yes).
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
  # None: on a GPU mesh only (see rollout.weights; costs one more copy of the weights).
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


class SlotState(NamedTuple):
  """Per-slot decode state, the carry of the device loop (B = num_slots).

  It lives on the devices between decode calls; the host keeps a mirror, and sends only
  the rows it changed (an insert, a freed slot, pages grown) before the next call.
  """

  tokens: jax.Array  # [B] int32 next token to feed
  lengths: jax.Array  # [B] int32 tokens in the slot's pages (position of `tokens`)
  num_generated: jax.Array  # [B] int32 completion tokens so far (the fed one included)
  max_tokens: jax.Array  # [B] int32
  active: jax.Array  # [B] bool
  page_table: jax.Array  # [B, M] int32 every page of the slot (M = max_seq_len / page)
  seeds: jax.Array  # [B] uint32
  sample_ids: jax.Array  # [B] int32
  temperature: jax.Array  # [B] float32
  top_k: jax.Array  # [B] int32
  top_p: jax.Array  # [B] float32
  stop_ids: jax.Array  # [B, S] int32, -1 padded


def _host_slots(num_slots: int, max_pages: int, max_stop_ids: int) -> SlotState:
  b = num_slots
  return SlotState(
      tokens=np.zeros((b,), np.int32), lengths=np.zeros((b,), np.int32),
      num_generated=np.zeros((b,), np.int32), max_tokens=np.zeros((b,), np.int32),
      active=np.zeros((b,), bool), page_table=np.full((b, max_pages), TRASH_PAGE, np.int32),
      seeds=np.zeros((b,), np.uint32), sample_ids=np.zeros((b,), np.int32),
      temperature=np.zeros((b,), np.float32), top_k=np.zeros((b,), np.int32),
      top_p=np.ones((b,), np.float32), stop_ids=np.full((b, max_stop_ids), -1, np.int32))


@functools.lru_cache(maxsize=None)
def _release_window(cfg: ModelConfig) -> int | None:
  """The window behind which no layer reads a page (None: some layer reads them all).

  Only models whose every layer has a window (Mistral) can give pages back while a
  sequence decodes; a global layer (Gemma 3 has one per six) reads the whole sequence.
  """
  windows = cfg.layer_windows
  return None if None in windows else max(windows)


def _template(cfg: ModelConfig) -> Transformer:
  return abstract_model(cfg)


def _bind(cfg: ModelConfig, params):
  """(the model bound to `params`, its per-layer weights or None): see rollout.weights."""
  return weights.bind(cfg, params)


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "layout", "width", "rows",
                                            "truncation", "draws"),
                   donate_argnames=("pool", "state"))
def _decode_loop(params, pool: KVPool, state: SlotState, shared: SharedPrefix | None, *,
                 cfg: ModelConfig, steps: int, layout: RolloutLayout, width: int | None = None,
                 rows: int | None = None, truncation: bool = True, draws: bool = True):
  """Up to `steps` decode steps for all slots; stops early once every slot is done.

  `shared` (None: plain paged attention) is each block's shared prompt pages; it is fixed
  for the call, so it stays out of the loop carry. The loop sees `width` columns (None:
  all) of each slot's page table, from its first page (plain) or from the first page after
  its block's shared prefix (cascade). With `rows` (plain attention only) the call decodes
  only the first `rows` live slots of each data shard (rollout.compact; the host picks a
  width that holds them all), the other slots left as they are.
  Without `truncation` (no slot samples with top-k or top-p) the program holds no
  vocabulary sort at all, and without `draws` (every slot greedy) no random draw (see
  sampling.sample).

  Returns:
    (pool, final state (sharded like `state`, which stays on the devices), tokens [B, steps]
    (-1 where a slot produced none), logprobs, active [B], the experts of each step's fed
    token [B, steps, L, k] int16 (MoE models; None otherwise), each token's kept-set floor
    [B, steps] (with `truncation`; None otherwise)); all but the first two replicated, so
    every process reads them whole.
  """
  full = state.page_table
  state = state._replace(page_table=_loop_table(full, shared, width, pool.k.shape[3]))
  with activation_rules(ROLLOUT_RULES, layout.mesh):
    if rows is None:
      pool, state, *outputs = _decode_steps(params, pool, state, shared, cfg, steps, layout,
                                            truncation, draws)
    else:
      order = compact.live_first(state.active, layout.data_shards)
      pool, live, *outputs = _decode_steps(params, pool, compact.take(state, order, rows),
                                           shared, cfg, steps, layout, truncation, draws)
      state = compact.put(state, live, order)
      outputs = compact.put(_empty_outputs(cfg, state.tokens.shape[0], steps, truncation),
                            tuple(outputs), order)
  state = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, layout.rows(x.ndim)),
                       state._replace(page_table=full))
  whole = lambda tree: jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x, layout.replicated), tree)
  out_tokens, out_logprobs, out_experts, out_floors = outputs
  return (pool, state, whole(out_tokens), whole(out_logprobs), whole(state.active),
          whole(out_experts), whole(out_floors))


def _empty_outputs(cfg: ModelConfig, b: int, steps: int, truncation: bool):
  """A decode call's outputs for b slots before any step: (tokens -1, logprobs 0, experts
  NO_EXPERT (MoE models; int16, routing replay's record kept small), floors -inf (calls
  that may truncate)); a slot keeps these at every step it produces nothing."""
  experts = floors = None
  if cfg.moe is not None:
    shape = (b, steps, cfg.num_layers, cfg.moe.experts_per_token)
    experts = jnp.full(shape, NO_EXPERT, jnp.int16)
  if truncation:
    floors = jnp.full((b, steps), -jnp.inf, jnp.float32)
  return (jnp.full((b, steps), -1, jnp.int32), jnp.zeros((b, steps), jnp.float32), experts,
          floors)


def _loop_table(full, shared: SharedPrefix | None, width: int | None, page_size: int):
  """[B, M] page tables -> the [B, width] ones the decode step reads (see _decode_loop)."""
  width = width or full.shape[1]
  if shared is None:
    return full[:, :width]
  rows_per_block = full.shape[0] // shared.lengths.shape[0]
  start = jnp.repeat(shared.lengths // page_size, rows_per_block)  # [B] shared pages
  cols = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width]
  own = jnp.take_along_axis(full, jnp.minimum(cols, full.shape[1] - 1), axis=1)
  return jnp.where(cols < full.shape[1], own, TRASH_PAGE)


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(state: SlotState, index, rows: SlotState) -> SlotState:
  """state with rows `index` replaced ([N] slot ids; ids >= B are padding, dropped)."""
  return jax.tree.map(lambda a, r: a.at[index].set(r, mode="drop"), state, rows)


@functools.partial(jax.jit, donate_argnums=0)
def _set_table_rows(state: SlotState, index, table) -> SlotState:
  """state with the page-table rows `index` replaced; every other field as it is."""
  return state._replace(page_table=state.page_table.at[index].set(table, mode="drop"))


class _Launched(NamedTuple):
  """A decode call in flight: its outputs (device arrays) and what the host knew then."""

  tokens: jax.Array
  logprobs: jax.Array
  active: jax.Array
  experts: jax.Array | None  # [B, steps, L, k] (MoE models)
  floors: jax.Array | None  # [B, steps] (calls that may truncate)
  occupant: np.ndarray  # [B] each slot's occupant number at launch
  version: int


def _decode_steps(params, pool, state, shared, cfg, steps, layout, truncation, draws):
  model, layers = _bind(cfg, params)
  out_tokens, out_logprobs, out_experts, out_floors = _empty_outputs(
      cfg, state.tokens.shape[0], steps, truncation)

  def cond(carry):
    i, _, st = carry[:3]
    return (i < steps) & jnp.any(st.active)

  def body(carry):
    i, pool, st, out_tokens, out_logprobs, out_experts, out_floors = carry
    logits, pool, experts = forward.decode_step(model, pool, st.tokens, st.lengths,
                                                st.page_table, st.active, shared, layout,
                                                layers=layers)
    keys = token_keys(st.seeds, st.sample_ids, st.num_generated)
    tok, lp, floor = sample_with_floors(logits, keys, st.temperature, st.top_k, st.top_p,
                                        truncation, draws)
    on = st.active
    out_tokens = out_tokens.at[:, i].set(jnp.where(on, tok, -1))
    out_logprobs = out_logprobs.at[:, i].set(jnp.where(on, lp, 0.0))
    if out_experts is not None:  # The fed token's experts (it is the previous output).
      fed = jnp.where(on[:, None, None], experts, NO_EXPERT).astype(jnp.int16)
      out_experts = out_experts.at[:, i].set(fed)
    if out_floors is not None:
      out_floors = out_floors.at[:, i].set(jnp.where(on, floor, -jnp.inf))
    n = st.num_generated + on
    stop = jnp.any(tok[:, None] == st.stop_ids, axis=1)
    st = st._replace(tokens=jnp.where(on, tok, st.tokens), lengths=st.lengths + on,
                     num_generated=n, active=on & ~stop & (n < st.max_tokens))
    return i + 1, pool, st, out_tokens, out_logprobs, out_experts, out_floors

  carry = (jnp.int32(0), pool, state, out_tokens, out_logprobs, out_experts, out_floors)
  _, pool, state, *outputs = jax.lax.while_loop(cond, body, carry)
  return (pool, state, *outputs)


@functools.partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("pool",))
def _prefill(params, pool: KVPool, rows: prefill_pack.PackedRows, last, *, cfg: ModelConfig,
             layout: RolloutLayout):
  """Packed prompt chunks into the pool; (pool, logits [C, V] after each chunk's last token,
  each row token's experts [R, T, L, k] int16 replicated, or None for a dense model)."""
  with activation_rules(ROLLOUT_RULES, layout.mesh):
    model, layers = _bind(cfg, params)
    logits, pool, experts = forward.prefill_packed(model, pool, rows, last, layout,
                                                   layers=layers)
  if experts is not None:
    experts = jax.lax.with_sharding_constraint(experts.astype(jnp.int16), layout.replicated)
  return pool, logits, experts


# _sample_first's operands after the logits: the rows, seeds, sample ids, temperatures,
# top-k and top-p of the samples.
_FIRST_TOKEN_OPERANDS = (np.int32, np.uint32, np.int32, np.float32, np.int32, np.float32)


@functools.partial(jax.jit, static_argnames=("layout", "truncation", "draws"))
def _sample_first(logits, rows, seeds, sample_ids, temperature, top_k, top_p, *,
                  layout: RolloutLayout, truncation: bool = True,
                  draws: bool = True):  # [R, V], [S] x6
  """Each sample's first token (token index 0) from the last logits of its prefill row;
  without `truncation` (no sample uses top-k or top-p) or `draws` (every sample greedy)
  the program leaves out the vocabulary sort or the random draw, which on a CPU take
  most of its compile time."""
  keys = token_keys(seeds, sample_ids, jnp.zeros_like(sample_ids))
  out = sample_with_floors(jnp.take(logits, rows, axis=0), keys, temperature, top_k, top_p,
                           truncation, draws)
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, layout.replicated), out)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=0)
def _copy_pages(pool: KVPool, src, dst, *, layout: RolloutLayout) -> KVPool:
  """Per data shard, copies its pages src[s, i] -> dst[s, i] (shard-local ids)."""
  specs = KVPool(layout.pool_spec, layout.pool_spec)
  local = layout.per_device(lambda p, a, b: copy_pool_pages(p, a[0], b[0]),
                            in_specs=(specs, layout.rows_spec(2), layout.rows_spec(2)),
                            out_specs=specs)
  return local(pool, src, dst)


def _zeros_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                layout: RolloutLayout) -> KVPool:
  """The pool created in place on its devices (no host or single-device staging copy).

  Its sharding is spelled as the programs that return the pool spell it (a constraint, not
  out_shardings: XLA drops size-1 axes and trailing Nones). A differently spelled but
  equivalent sharding would make the next call's jit compile the same shapes again.
  """
  sharding = layout.sharding(layout.pool_spec)
  place = lambda x: jax.lax.with_sharding_constraint(x, sharding)
  make = jax.jit(lambda: jax.tree.map(place, KVPool.zeros(cfg, num_pages, page_size, dtype)))
  return make()


def _placed(x, sharding):
  """x in `sharding`: as is when already there, else copied onto the mesh."""
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.jit(lambda a: a, out_shardings=sharding)(x)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                      dtype=host.dtype)


def _chunk_width(tokens: int) -> int:
  """Prefill chunk shape for `tokens` tokens: short prompts (the common case in RL, and
  the suffixes left after a prefix-cache hit) pad to a multiple of 8 up to 32 tokens and
  of 16 up to 64, longer chunks to a power of two, so only a few shapes compile."""
  for step, limit in ((_MIN_CHUNK, 4 * _MIN_CHUNK), (2 * _MIN_CHUNK, 8 * _MIN_CHUNK)):
    if tokens <= limit:
      return cdiv(max(tokens, 1), step) * step
  return pow2_at_least(tokens)


def _record_prompt_experts(prefixes, segments, experts) -> None:
  """Stores each prefix's chunk of a prefill call's experts ([R, T, L, k], host) in its
  `experts` record; chunk c is the tokens whose segment is c, in row order."""
  flat_segments = np.asarray(segments).reshape(-1)
  flat = experts.reshape(-1, *experts.shape[2:])
  for c, prefix in enumerate(prefixes):
    chunk = flat[flat_segments == c]
    prefix.experts[prefix.prefilled:prefix.prefilled + len(chunk)] = chunk


@dataclasses.dataclass
class Prefix:
  """A prompt being prefilled, or prefilled and handing its samples to slots.

  Attributes:
    prompt: [P] int32 prompt ids.
    sampling: how its samples are drawn.
    seed: the request's seed.
    sample_ids: indices (within the request) of the samples this prefix serves.
    seq: the prompt's pages, plus the reservation for every sample not yet inserted.
    private_pages: pages one sample may need beyond the shared full prompt pages.
    shard: the data shard whose pages hold the prompt; its samples decode in its slots.
    prefilled: prompt tokens written so far.
    first_tokens / first_logprobs / first_version / first_floors: each sample's first
      token, once prefilled (floors: its kept set under top-k / top-p, see sampling).
    next_sample: samples handed out so far (inserted or finished at their first token).
    experts: MoE models: [P, L, k] int16 each prompt token's experts, filled as the prompt
      is prefilled (tokens served from the prefix cache take the cache's record).
  """

  prompt: np.ndarray
  sampling: SamplingParams
  seed: int
  sample_ids: tuple[int, ...]
  seq: PagedSequence
  private_pages: int
  shard: int = 0
  prefilled: int = 0
  first_tokens: np.ndarray | None = None
  first_logprobs: np.ndarray | None = None
  first_version: int | None = None
  first_floors: np.ndarray | None = None
  next_sample: int = 0
  experts: np.ndarray | None = None
  continued: bool = False  # A later turn of a held sequence (see Engine.continue_held).

  @property
  def done(self) -> bool:
    return self.first_tokens is not None

  @property
  def remaining(self) -> int:
    return len(self.sample_ids) - self.next_sample

  def finishes_at_first(self, i: int) -> bool:
    """Whether sample i ends with its first token (a stop id, or max_tokens == 1)."""
    return (self.sampling.max_tokens == 1 or
            int(self.first_tokens[i]) in self.sampling.stop_ids)


@dataclasses.dataclass
class Held:
  """A sequence whose turn ended but whose K/V stays in the pool for its next turn.

  Attributes:
    seq: its pages (no reservation left).
    length: tokens whose K/V the pages hold: every token of the history but the turn's
      last one, which was sampled and never fed.
    shard: the data shard whose pool holds the pages.
  """

  seq: PagedSequence
  length: int
  shard: int


@dataclasses.dataclass(frozen=True)
class ResultTokens:
  """What one `generate` call produced, per slot.

  Attributes:
    tokens: [B, N] int32, -1 where the slot produced no token at that step.
    logprobs: [B, N] float32 behaviour log-probabilities.
    finished: [B] bool, the slot's sequence ended during this call.
    version: the weight version that produced these tokens.
    experts: MoE models: [B, N, L, k] int16, at step n the experts of the token fed then
      (the slot's previous token); None for a dense model.
    floors: [B, N] float32 each token's kept-set floor (sampling.truncate), when the call
      could truncate; else None.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  finished: np.ndarray
  version: int
  experts: np.ndarray | None = None
  floors: np.ndarray | None = None


class _CompileAhead:
  """Programs compiled in order on one thread, each under a key that names its shape."""

  def __init__(self, jobs: dict[Hashable, Callable[[], Any]]):
    self._done = threading.Condition()
    self._pending = list(jobs)
    # Not a daemon: the interpreter's exit waits for it, as a compile cut off in XLA's
    # code at exit aborts the process.
    threading.Thread(target=self._run, args=(jobs,), name="compile-ahead").start()

  def _run(self, jobs: dict[Hashable, Callable[[], Any]]) -> None:
    for key, build in jobs.items():
      try:
        build()
      except Exception:  # pylint: disable=broad-except
        pass  # The call compiles its own program, and raises there if it must.
      with self._done:
        self._pending.remove(key)
        self._done.notify_all()

  def wait(self, key: Hashable) -> None:
    """Returns once the program under `key` is not being compiled here (or never was)."""
    with self._done:
      self._done.wait_for(lambda: key not in self._pending)

  def join(self) -> None:
    """Returns once every program is compiled (or failed to)."""
    with self._done:
      self._done.wait_for(lambda: not self._pending)


class Engine:
  """Paged-KV decode engine over decode slots and a KV page pool, on one device or a mesh.

  On a rollout mesh (`mesh=`), slots and pages are split over its "data" axis and KV heads
  over "tensor" (see rollout.layout): one jitted program drives every device, and each data
  shard has its own page allocator, so a prompt's pages and its samples' slots stay on one
  shard. num_slots is rounded up to whole blocks on every data shard; PoolConfig sizes the
  pages of one data shard (each of its devices holds them, for its KV heads).
  """

  def __init__(self, model_config: ModelConfig, params, config: EngineConfig = EngineConfig(),
               *, version: int = 0, mesh: Mesh | None = None):
    self.model_config, self.config = model_config, config
    self.layout = RolloutLayout.build(model_config, mesh, config.split_layers)
    self.shards = self.layout.data_shards
    self.prefix_caches: list[PrefixCache] = []
    self.set_weights(params, version)
    self.kv_dtype = jnp.dtype(config.kv_dtype or model_config.compute_dtype)
    self.page_size = config.pool.page_size
    kv_shards = self.layout.mesh.shape["tensor"] if self.layout.kv_axis else 1
    num_pages = resolve_num_pages(config.pool, model_config, self.kv_dtype,
                                  self.layout.local_device, kv_shards=kv_shards,
                                  data_shards=self.shards)
    self.pool = _zeros_pool(model_config, self.shards * num_pages, self.page_size,
                            self.kv_dtype, self.layout)
    self.allocs = [PageAllocator(num_pages) for _ in range(self.shards)]
    if config.prefix_cache:
      self.prefix_caches = [PrefixCache(a, self.page_size) for a in self.allocs]
    context = model_config.max_position_embeddings
    self.max_seq_len = min(config.max_seq_len or context, context)
    self.max_pages = cdiv(self.max_seq_len, self.page_size)
    if config.num_slots is None:  # No work in sight: as many as the pool holds.
      held = self.shards * sequences_held(num_pages, self.max_pages)
      config = config.sized_for(MAX_SLOTS, capacity=min(MAX_SLOTS, max(_MIN_SLOTS, held)))
      self.config = config
    self.num_slots = shard_count(config.num_slots, self.shards, config.group_slots)
    self.slots_per_shard = self.num_slots // self.shards
    self._slots = _host_slots(self.num_slots, self.max_pages, config.max_stop_ids)
    self._device_slots = self.layout.put_rows(self._slots)  # Stays on the devices.
    self._dirty: set[int] = set()  # Slots whose host rows the devices have not seen yet.
    self._grown: set[int] = set()  # Running slots whose page-table rows grew since.
    # Bumped when a slot is filled or emptied: a collected call's rows count only for
    # slots that still hold what it decoded.
    self._occupant = np.zeros((self.num_slots,), np.int64)
    self._pending: collections.deque[_Launched] = collections.deque()  # Calls in flight.
    self._ahead: _CompileAhead | None = None  # See compile_ahead.
    # (row width, chunks / 8) -> the (rows, key pages) per shard prefill calls have run.
    self._prefill_shapes: dict[tuple[int, int], set[tuple[int, int]]] = {}
    self._seqs: list[PagedSequence | None] = [None] * self.num_slots
    self._final_len = np.zeros((self.num_slots,), np.int64)  # Most tokens a slot writes.
    # Per block of group_slots slots: the shared whole prompt pages and their token count.
    blocks = self.num_slots // config.group_slots if config.group_slots else 0
    self._block_table = np.full((blocks, self.max_pages), TRASH_PAGE, np.int32)
    self._block_len = np.zeros((blocks,), np.int32)
    # Windowed models keep the blocks but decode with plain paged attention.
    self.cascade = bool(config.group_slots) and forward.cascade_refusal(model_config) is None
    self.release_window = _release_window(model_config)

  @classmethod
  def from_model(cls, model: Transformer, config: EngineConfig = EngineConfig(), *,
                 version: int = 0, mesh: Mesh | None = None) -> "Engine":
    return cls(model.config, params_of(model), config, version=version, mesh=mesh)

  # ------------------------------------------------------------------ weights

  def set_weights(self, params, version: int) -> None:
    """Uses `params` (a `params_of(model)` dict) from the next device call launched on;
    calls already launched (see `launch`) decode with the weights they were launched with.

    Weights not already in the rollout sharding of this engine's mesh are moved there.
    """
    template = _template(self.model_config)
    want = jax.tree.structure(params_of(template))
    if jax.tree.structure(params) != want:
      raise UserError("set_weights: the parameter tree does not match the model config")
    shardings = tree_shardings(logical_axes(template), params_of(template), ROLLOUT_RULES,
                               self.layout.mesh)
    self.params = jax.tree.map(_placed, params, shardings)
    if self.layout.split_layers:
      self.params = weights.split_layers(self.params, self.model_config.num_layers)
    self.version = int(version)
    for cache in self.prefix_caches:  # Cached K/V came from the old weights.
      cache.clear()

  # ------------------------------------------------------------------ queries

  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_slots

  @property
  def alloc(self) -> PageAllocator:
    """The page allocator of a one-shard engine (see `allocs` on a data-parallel mesh)."""
    if self.shards != 1:
      raise AttributeError("this engine has one allocator per data shard: use allocs")
    return self.allocs[0]

  def shard_of(self, slot: int) -> int:
    """The data shard that decodes `slot` (its pages live there)."""
    return slot // self.slots_per_shard

  @property
  def group_slots(self) -> int:
    """Slots per block (0: slots are independent); a block decodes samples of one prompt."""
    return self.config.group_slots

  @property
  def pages_in_use(self) -> int:
    return sum(a.in_use for a in self.allocs)

  def private_pages(self, prompt_len: int, max_tokens: int) -> int:
    """Pages one sample may need beyond the shared full prompt pages.

    The last completion token's K/V is never written, so a sample writes at most
    prompt_len + max_tokens - 1 tokens; the partial prompt page is its own copy.
    """
    ps = self.page_size
    return cdiv(prompt_len + max_tokens - 1, ps) - prompt_len // ps

  def max_group_size(self, prompt_len: int, max_tokens: int) -> int:
    """Most samples of one prompt that fit in the pool together (0: not even one)."""
    room = self.allocs[0].usable - cdiv(prompt_len, self.page_size)
    room += 1 if prompt_len % self.page_size else 0  # See new_prefix.
    private = self.private_pages(prompt_len, max_tokens)
    if room < private or room < 0:
      return 0
    return room // private if private else 1 << 30

  def validate(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
    """Raises UserError for a request this engine can never serve."""
    context = self.model_config.max_position_embeddings
    if len(prompt) == 0:
      raise UserError("the prompt is empty after tokenization")
    if len(prompt) + sampling.max_tokens > context:
      raise UserError(f"the prompt has {len(prompt)} tokens; with max_new_tokens="
                      f"{sampling.max_tokens} it exceeds the model's context of {context} tokens")
    if len(prompt) + sampling.max_tokens > self.max_seq_len:
      raise UserError(f"the prompt has {len(prompt)} tokens; with max_new_tokens="
                      f"{sampling.max_tokens} it exceeds the engine's max_seq_len of "
                      f"{self.max_seq_len} tokens")
    if min(prompt) < 0 or max(prompt) >= self.model_config.vocab_size:
      raise UserError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
    if len(sampling.stop_ids) > self.config.max_stop_ids:
      raise UserError(f"{len(sampling.stop_ids)} stop ids; the engine takes at most "
                      f"{self.config.max_stop_ids} (EngineConfig.max_stop_ids)")
    if self.max_group_size(len(prompt), sampling.max_tokens) == 0:
      raise UserError(f"a prompt of {len(prompt)} tokens with max_new_tokens="
                      f"{sampling.max_tokens} needs more KV pages than the pool's "
                      f"{self.allocs[0].usable} (per data shard)")

  # ------------------------------------------------------------------ prefill

  def new_prefix(self, prompt: Sequence[int], sampling: SamplingParams, seed: int,
                 sample_ids: Sequence[int], shard: int = 0) -> Prefix | None:
    """Reserves every page the prompt and its samples may need on data shard `shard`;
    None if that shard's pool is short.

    The caller validates the request first (`validate`).
    """
    alloc = self.allocs[shard]
    prompt = np.asarray(prompt, np.int32)
    private = self.private_pages(len(prompt), sampling.max_tokens)
    need = cdiv(len(prompt), self.page_size) + len(sample_ids) * private
    if len(prompt) % self.page_size:
      need -= 1  # The last sample inherits the partial prompt page instead of copying it.
    if not alloc.reserve(need):
      if not self.prefix_caches or not self.prefix_caches[shard].evict(need - alloc.available):
        return None
      if not alloc.reserve(need):
        return None
    seq = PagedSequence(alloc, self.page_size, reserved=need)
    seq.grow(len(prompt))
    return Prefix(prompt, sampling, int(seed), tuple(int(i) for i in sample_ids), seq, private,
                  shard=shard)

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
    self.pool, logits, experts = _prefill(self.params, self.pool, self.layout.put_rows(rows),
                                          self.layout.put_replicated(last),
                                          cfg=self.model_config, layout=self.layout)
    if experts is not None:
      for prefix in prefixes:
        self._prompt_experts(prefix)
      _record_prompt_experts(prefixes, rows.segments, np.asarray(jax.device_get(experts)))
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

  # ------------------------------------------------------------------ multi-turn

  def continue_held(self, held: Held, history: Sequence[int], sampling: SamplingParams,
                    seed: int, sample_id: int) -> Prefix | None:
    """The next turn of a held sequence, as a one-sample prefix whose prefill writes only
    the tokens after `held.length` (the last turn's final token, then the observation) into
    the sequence's own pages: the history before them is never prefilled again. None (and
    `held` unchanged) while the shard's pool cannot promise the turn's pages.

    `history`: every token so far, the observation last; the caller validates it first.
    """
    alloc, ps = self.allocs[held.shard], self.page_size
    seq = held.seq
    # A held partial last page is the sequence's own (see hold_skipped); should one still
    # be shared, it is copied before anything is written. A decoded turn's pages may run
    # past its length (grown ahead for calls it did not need).
    shared_tail = (held.length % ps != 0 and len(seq.pages) == cdiv(held.length, ps) and
                   alloc.refcount[seq.pages[-1]] > 1)
    need = max(0, cdiv(len(history) + sampling.max_tokens - 1, ps) - len(seq.pages))
    need += int(shared_tail)
    if not alloc.reserve(need):
      return None
    seq.reserved += need
    pair = seq.make_tail_writable(held.length)
    if pair is not None:
      self._copy([[pair] if s == held.shard else [] for s in range(self.shards)])
    seq.grow(len(history))
    return Prefix(np.asarray(history, np.int32), sampling, int(seed), (int(sample_id),), seq,
                  private_pages=seq.reserved, shard=held.shard, prefilled=held.length,
                  continued=True)

  def detach(self, slot: int) -> Held:
    """Empties a finished slot like `free_resource`, but its sequence keeps its pages."""
    seq = self._seqs[slot]
    seq.drop_reservation(seq.reserved)
    held = Held(seq, int(self._slots.lengths[slot]), self.shard_of(slot))
    self._seqs[slot] = None
    self.free_resource(slot)
    return held

  def hold_skipped(self, prefix: Prefix) -> Held:
    """`skip` for a sample kept for another turn: it holds the prompt's pages, the partial
    last one copied (paid from the sample's reservation, as an insert would) while other
    samples still share it, whose budget counts on one of them inheriting it."""
    assert prefix.done and prefix.remaining > 0 and prefix.finishes_at_first(prefix.next_sample)
    seq = prefix.seq.fork(self._sample_reservation(prefix))
    self._consume(prefix)
    pair = seq.make_tail_writable(len(prefix.prompt))
    if pair is not None:
      self._copy([[pair] if s == prefix.shard else [] for s in range(self.shards)])
    seq.drop_reservation(seq.reserved)
    return Held(seq, len(prefix.prompt), prefix.shard)

  def release(self, held: Held) -> None:
    """Returns a held sequence's pages to the pool (its trajectory ended)."""
    held.seq.free()

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
    operands = [np.zeros((n,), dt) for dt in _FIRST_TOKEN_OPERANDS]
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
    tok, lp, floor = jax.device_get(_sample_first(logits, *operands, layout=self.layout,
                                                  truncation=truncation, draws=draws))
    at = 0
    for prefix, k in zip(prefixes, sizes):
      prefix.first_tokens, prefix.first_logprobs = tok[at:at + k], lp[at:at + k]
      prefix.first_floors = floor[at:at + k]
      prefix.first_version = self.version
      at += k

  # ------------------------------------------------------------------ insert

  def insert(self, prefix: Prefix, slot: int) -> None:
    self.bulk_insert(prefix, [slot])

  def bulk_insert(self, prefix: Prefix, slots: Sequence[int]) -> None:
    """Hands the prefix's next len(slots) samples to these free slots, in order.

    With group_slots, every slot's block must be empty or already hold samples with this
    prompt's whole pages (ValueError otherwise): cascade attention reads one shared
    prefix per block. A prefix with a single sample shares nothing, so it shares no
    pages with its block, and blocks of such samples take any other (greedy evaluation
    fills every slot).
    """
    assert prefix.done and len(slots) <= prefix.remaining, (prefix.done, len(slots))
    assert all(self.shard_of(s) == prefix.shard for s in slots), (prefix.shard, slots)
    self._check_blocks(prefix, slots)
    copies = []
    for slot in slots:
      assert self._seqs[slot] is None, f"slot {slot} is busy"
      i = prefix.next_sample
      assert not prefix.finishes_at_first(i), "a finished sample needs no slot: use skip"
      seq = prefix.seq.fork(self._sample_reservation(prefix))
      self._consume(prefix)
      pair = seq.make_tail_writable(len(prefix.prompt))
      if pair is not None:
        copies.append(pair)
      self._seqs[slot] = seq
      self._fill_slot(slot, prefix, i, seq)
      self._join_block(slot, self._shared_pages(prefix), seq)
    if copies:
      self._copy([copies if s == prefix.shard else [] for s in range(self.shards)])

  def _copy(self, copies: list[list[tuple[int, int]]]) -> None:
    """Copy-on-write page copies: copies[s] the (src, dst) pairs of data shard s (its
    padding copies the sink to itself)."""
    width = pow2_at_least(max(len(pairs) for pairs in copies))
    src, dst = (np.zeros((self.shards, width), np.int32) for _ in range(2))  # 0 -> 0 pads.
    for shard, pairs in enumerate(copies):
      if pairs:
        src[shard, :len(pairs)], dst[shard, :len(pairs)] = zip(*pairs)
    self.pool = _copy_pages(self.pool, *self.layout.put_rows((src, dst)), layout=self.layout)

  def skip(self, prefix: Prefix) -> None:
    """Consumes the prefix's next sample, which finished at its first token."""
    assert prefix.done and prefix.remaining > 0 and prefix.finishes_at_first(prefix.next_sample)
    prefix.seq.drop_reservation(self._sample_reservation(prefix))
    self._consume(prefix)

  @staticmethod
  def _sample_reservation(prefix: Prefix) -> int:
    """Pages promised to the next sample: the last one gets what is left (one page less
    when it inherits the partial prompt page)."""
    return prefix.private_pages if prefix.remaining > 1 else prefix.seq.reserved

  def _block_slots(self, block: int) -> range:
    k = self.config.group_slots
    return range(block * k, (block + 1) * k)

  def _block_live(self, block: int) -> bool:
    return any(self._seqs[i] is not None for i in self._block_slots(block))

  def _shared_pages(self, prefix: Prefix) -> int:
    """Whole prompt pages the prefix's samples share with their block (0 for one sample)."""
    return len(prefix.prompt) // self.page_size if len(prefix.sample_ids) > 1 else 0

  def _check_blocks(self, prefix: Prefix, slots: Sequence[int]) -> None:
    """Raises ValueError if a slot's block decodes samples with other shared pages."""
    if not self.config.group_slots:
      return
    n = self._shared_pages(prefix)
    for block in sorted({slot // self.config.group_slots for slot in slots}):
      same = (self._block_len[block] == n * self.page_size and
              self._block_table[block, :n].tolist() == prefix.seq.pages[:n])
      if self._block_live(block) and not same:
        raise ValueError(f"bulk_insert: slots {list(self._block_slots(block))} decode another "
                         f"prompt; a block of group_slots slots holds one prompt's samples")

  def _join_block(self, slot: int, shared_pages: int, seq: PagedSequence) -> None:
    """Records the prompt's whole pages as the shared prefix of the slot's block."""
    if not self.config.group_slots:
      return
    block = slot // self.config.group_slots
    self._block_table[block] = TRASH_PAGE
    self._block_table[block, :shared_pages] = seq.pages[:shared_pages]
    self._block_len[block] = shared_pages * self.page_size

  def _consume(self, prefix: Prefix) -> None:
    prefix.next_sample += 1
    if prefix.remaining == 0:  # The prompt's own references go; the samples keep theirs.
      prefix.seq.free()

  def _fill_slot(self, slot: int, prefix: Prefix, i: int, seq: PagedSequence) -> None:
    s, sp, p = self._slots, prefix.sampling, len(prefix.prompt)
    s.tokens[slot], s.lengths[slot], s.num_generated[slot] = prefix.first_tokens[i], p, 1
    s.max_tokens[slot], s.active[slot] = sp.max_tokens, True
    s.page_table[slot] = seq.table_row(self.max_pages)
    s.seeds[slot], s.sample_ids[slot] = prefix.seed, prefix.sample_ids[i]
    s.temperature[slot], s.top_k[slot], s.top_p[slot] = sp.temperature, sp.top_k, sp.top_p
    s.stop_ids[slot] = -1
    s.stop_ids[slot, :len(sp.stop_ids)] = sp.stop_ids
    self._final_len[slot] = p + sp.max_tokens - 1
    self._occupant[slot] += 1
    self._dirty.add(slot)

  # ------------------------------------------------------------------ decode

  def generate(self) -> ResultTokens:
    """Runs `decode_steps` decode steps for every active slot in one device call and waits
    for its tokens (`launch` + `collect`).

    The slot state stays on the devices: the host sends the rows it changed since the last
    call and reads back only the new tokens, their logprobs and which slots are active.
    """
    self.launch()
    return self.collect()

  @property
  def in_flight(self) -> int:
    """Decode calls launched and not collected yet."""
    return len(self._pending)

  def launch(self) -> None:
    """Queues one decode call of `decode_steps` steps for every active slot, without
    waiting for it or for the calls before it (their outputs are its inputs on the
    devices). Between `launch` and the `collect` of a call the host may insert into and
    free slots it knows are done; the host's view of running slots (lengths, activity)
    lags by the calls in flight, so pages are grown for all of them."""
    steps = self.config.decode_steps
    needed = self._grow_pages(steps * (1 + len(self._pending)))
    self._push_dirty_rows()
    if self.cascade:
      shared, start = self._shared_operands()
      width = self._table_width(max(int((needed - start).max()), 1))
    else:
      shared, width = None, self._table_width(max(int(needed.max()), 1))
    # Cascade blocks keep their slots: a block shares its prompt's pages.
    rows = None if self.cascade else compact.call_width(self._slots.active, self.shards,
                                                        self.config.decode_buckets)
    if self._ahead is not None:  # Never the same program compiled twice at once.
      self._ahead.wait(("decode", rows))
    self.pool, self._device_slots, tokens, logprobs, active, experts, floors = _decode_loop(
        self.params, self.pool, self._device_slots, shared, cfg=self.model_config,
        steps=steps, layout=self.layout, width=width, rows=rows, truncation=self._truncating(),
        draws=bool(np.any(self._slots.temperature > 0.0)))
    for x in jax.tree.leaves((tokens, logprobs, active, experts, floors)):
      x.copy_to_host_async()  # Fetched while later calls run.
    self._pending.append(_Launched(tokens, logprobs, active, experts, floors,
                                   self._occupant.copy(), self.version))

  def compile_ahead(self, sampling: SamplingParams, prompt_len: int, prompts: int,
                    n: int = 1) -> None:
    """Starts compiling, on a thread, the programs this engine's first calls run for a job
    of `prompts` prompts of up to `prompt_len` tokens, `n` samples each, all sampled with
    `sampling`: the first prefill call's first-token program, the first decode call's, and
    (for a job of more than one decode call) the next narrower width's, which the second
    runs once a quarter of the sequences have ended. A call that needs one of them waits
    for it. For a caller with the whole job in hand, which prefills it first (the generate
    CLI): XLA compiles on one core, so the programs build beside the first prefill compile
    and the prefill instead of on the calls' path. A guess that misses costs the job
    nothing but a core for a while."""
    if self.cascade or self._ahead is not None:
      return
    self._ahead = _CompileAhead({**self._first_token_ahead(sampling, prompts, n),
                                 **self._decode_ahead(sampling, prompt_len, prompts * n)})

  def _first_token_ahead(self, sampling: SamplingParams, prompts: int, n: int) -> dict:
    """The first prefill call's first-token program, for prompts it prefills whole."""
    chunks = min(prompts, self.config.prefill_rows * self.shards)
    rows, samples = cdiv(chunks, 8) * 8, cdiv(chunks * n, 8) * 8
    shape = lambda size, dtype: jax.ShapeDtypeStruct(size, dtype, sharding=self.layout.replicated)
    operands = [shape((rows, self.model_config.vocab_size), jnp.float32)] + [
        shape((samples,), dt) for dt in _FIRST_TOKEN_OPERANDS]
    static = dict(layout=self.layout, truncation=sampling.truncates, draws=sampling.draws)
    key = ("first", rows, samples, sampling.truncates, sampling.draws)
    return {key: lambda: _sample_first.lower(*operands, **static).compile()}

  def _decode_ahead(self, sampling: SamplingParams, prompt_len: int, sequences: int) -> dict:
    """The first decode call's program and, for more than one call, the next narrower."""
    steps, ps = self.config.decode_steps, self.page_size
    written = min(prompt_len + steps, prompt_len + sampling.max_tokens - 1)
    active = np.zeros((self.shards, self.slots_per_shard), bool)
    active[:, :cdiv(min(sequences, self.num_slots), self.shards)] = True
    first = compact.call_width(active.reshape(-1), self.shards, self.config.decode_buckets)
    options = compact.widths(self.slots_per_shard, self.config.decode_buckets)
    at = options.index(first or self.slots_per_shard)
    guesses = [first] + ([options[at - 1]] if at and sampling.max_tokens > steps else [])
    static = dict(cfg=self.model_config, steps=steps, layout=self.layout,
                  width=self._table_width(max(cdiv(written, ps), 1)),
                  truncation=sampling.truncates, draws=sampling.draws)
    # The weights as they are (arrays a prefill never donates: an uncommitted one must stay
    # so, or the program differs); the pool and slots as shapes, since prefill calls on
    # the caller's thread donate them meanwhile.
    operands = (self.params, *jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        (self.pool, self._device_slots)), None)
    build = lambda rows: lambda: _decode_loop.lower(*operands, rows=rows, **static).compile()
    return {("decode", rows): build(rows) for rows in guesses}

  def _truncating(self) -> bool:
    """Whether any slot samples with top-k or top-p (an emptied slot keeps its last
    settings, which can only keep the truncation pass in, never leave it out wrongly; the
    same holds for the draw, which `launch` leaves out when no slot has a temperature)."""
    s = self._slots
    return bool(np.any((s.top_k > 0) | (s.top_p < 1.0)))

  def collect(self) -> ResultTokens:
    """Waits for the oldest launched call; its tokens, and the host's view brought up to
    date. Rows of slots emptied or refilled since that launch come back as producing
    nothing (the call did not decode their current occupant)."""
    call = self._pending.popleft()
    tokens, logprobs, active, experts, floors = jax.device_get(
        (call.tokens, call.logprobs, call.active, call.experts, call.floors))
    same = call.occupant == self._occupant  # [B] the slot holds what the call decoded
    tokens = np.where(same[:, None], tokens, -1)
    logprobs = np.where(same[:, None], logprobs, 0.0).astype(np.float32)
    s = self._slots
    produced = (tokens >= 0).sum(axis=1).astype(np.int32)  # A slot's tokens come first.
    last = np.take_along_axis(tokens, np.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    s.tokens[:] = np.where(produced > 0, last, s.tokens)
    s.lengths[:] += produced
    s.num_generated[:] += produced
    was_active = s.active & same
    s.active[:] = np.where(same, active, s.active)
    return ResultTokens(tokens, logprobs, was_active & ~s.active, call.version, experts,
                        floors)

  def _grow_pages(self, steps: int) -> np.ndarray:
    """Pages for each active slot's next `steps` tokens (taken from its reservation), and a
    few more: growing ahead changes a slot's table row, which the devices then need, once
    per several pages instead of once per call. Returns the pages needed now, per slot."""
    s, ps = self._slots, self.page_size
    needed = np.zeros((self.num_slots,), np.int64)
    for slot in np.flatnonzero(s.active):
      seq = self._seqs[slot]
      final = int(self._final_len[slot])
      needed[slot] = cdiv(int(min(s.lengths[slot] + steps, final)), ps)
      released = self._release_behind_window(seq, int(s.lengths[slot]))
      grows = needed[slot] > len(seq.pages)
      if grows:
        seq.grow(int(min(s.lengths[slot] + steps + 3 * ps, final)))
      if grows or released:
        s.page_table[slot, :len(seq.pages)] = seq.pages
        self._grown.add(int(slot))
    return needed

  def _release_behind_window(self, seq: PagedSequence, length: int) -> int:
    """Gives back the pages of a running sequence that every layer's window has left.

    The next query sits at position `length` (the host's view, which lags the devices', so
    the devices' windows are past these pages too) and sees keys after length - window.
    Calls in flight may still gather a page given back here, and a later call may give it
    to another sequence: their reads of it are masked by the window, so its contents do
    not matter; writes only land at a sequence's newest positions."""
    if self.release_window is None:
      return 0
    return seq.release_before(length - self.release_window + 1)

  def _push_dirty_rows(self) -> None:
    """Sends the host's changed slot rows to the device state (small scatters): whole rows
    of slots filled or emptied, whose device rows are idle; only the page table of running
    slots that grew, whose lengths and tokens the devices know better than the host while
    calls are in flight."""
    grown = self._grown - self._dirty
    if self._dirty:
      index, rows = self._rows_of(self._dirty, self._slots)
      self._device_slots = _set_rows(self._device_slots, index, rows)
    if grown:
      index, table = self._rows_of(grown, self._slots.page_table)
      self._device_slots = _set_table_rows(self._device_slots, index, table)
    self._dirty.clear()
    self._grown.clear()

  def _rows_of(self, slots: set[int], tree):
    """(index, rows of `tree`) on the devices for a scatter; padded to a power of two of
    rows with out-of-range indices, which the scatter drops."""
    slots = np.asarray(sorted(slots), np.int32)
    index = np.full((pow2_at_least(len(slots)),), self.num_slots, np.int32)
    index[:len(slots)] = slots
    rows = jax.tree.map(lambda a: a[np.minimum(index, self.num_slots - 1)], tree)
    return self.layout.put_replicated((index, rows))

  def _shared_operands(self) -> tuple[SharedPrefix, np.ndarray]:
    """The blocks' shared prompt pages (table narrowed like the slots' ones) and, per slot,
    how many of its pages they are."""
    ps = self.page_size
    widest_shared = max(int(self._block_len.max()) // ps, 1)
    shared = SharedPrefix(self._block_table[:, :self._table_width(widest_shared)],
                          self._block_len.copy())
    start = np.repeat(self._block_len // ps, self.config.group_slots)  # [B]
    return self.layout.put_rows(shared), start

  def attention_reads(self) -> tuple[int, int]:
    """KV pages (per layer, K or V, per KV head) the next decode step attends over.

    Returns (cascade, paged): cascade reads each live block's shared prompt pages once and
    every active slot's own pages; paged attention reads all pages of every active slot.
    Counted from the host tables and lengths, so the figure is exact and deterministic.
    Without group_slots both are the paged count.
    """
    s, ps = self._slots, self.page_size
    cascade = paged = 0
    live_blocks = set()
    for slot in np.flatnonzero(s.active):
      tokens = int(s.lengths[slot]) + 1  # The fed token's own K/V included.
      paged += cdiv(tokens, ps)
      shared = 0
      if self.config.group_slots:
        block = slot // self.config.group_slots
        shared = int(self._block_len[block])
        live_blocks.add(block)
      cascade += cdiv(tokens - shared, ps)
    cascade += sum(int(self._block_len[b]) // ps for b in live_blocks)
    return cascade, paged

  def _table_width(self, pages: int) -> int:
    width = max(pow2_at_least(pages), self.config.min_table_pages)
    return min(width, self.max_pages)

  def free_resource(self, slot: int) -> None:
    """Returns the slot's pages to the pool and marks the slot free."""
    seq = self._seqs[slot]
    if seq is not None:
      seq.free()
    self._seqs[slot] = None
    self._slots.active[slot] = False
    self._slots.page_table[slot] = TRASH_PAGE
    self._occupant[slot] += 1
    self._dirty.add(slot)
    if self.config.group_slots:
      block = slot // self.config.group_slots
      if not self._block_live(block):  # Its prompt pages may now be freed and reused.
        self._block_table[block] = TRASH_PAGE
        self._block_len[block] = 0

  def slot_pages(self, slot: int) -> list[int]:
    seq = self._seqs[slot]
    return [] if seq is None else list(seq.pages)


# ---------------------------------------------------------------------- high-level API


def sequences_held(num_pages: int, seq_pages: int) -> int:
  """Sequences of seq_pages pages each that a pool of num_pages holds at once (page 0 is
  the write sink, never handed out)."""
  return (num_pages - 1) // seq_pages


def request_seed(base_seed: int, index: int) -> int:
  """The seed of the index-th request of a call whose requests carry none."""
  return int(np.random.SeedSequence([base_seed, index]).generate_state(1)[0])


def generate(engine: Engine, requests: Sequence[Request | Sequence[int]], *, n: int = 1,
             sampling: SamplingParams = SamplingParams(),
             scheduler: SchedulerConfig = SchedulerConfig()) -> list[list[Completion]]:
  """Draws n completions per request with continuous batching.

  Args:
    engine: the engine (its weights and version are used as they are).
    requests: Request objects, or bare prompt id lists.
    n: samples per request; the prompt is prefilled once and its pages shared.
    sampling: settings for requests that carry none; also the base seed for requests
      without a seed (request i gets request_seed(sampling.seed, i)).
    scheduler: prefill/decode interleaving.

  Returns:
    For each request, its n Completions (tokens, behaviour logprobs, finish reason,
    weight versions).
  """
  if n < 1:
    raise UserError(f"n must be >= 1, got {n}")
  sched = Scheduler(engine, scheduler)
  ids = []
  for i, req in enumerate(requests):
    if not isinstance(req, Request):
      req = Request(tuple(req))
    seed = req.seed if req.seed is not None else request_seed(sampling.seed, i)
    ids.append(sched.submit(req.prompt, req.sampling or sampling, n=n, seed=seed))
  results = sched.run()
  return [results[i] for i in ids]

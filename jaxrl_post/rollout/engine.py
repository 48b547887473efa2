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
window (`cascade_refused` holds forward.cascade_refusal's reason, and a run prints it).
When every layer has a window (Mistral) a decoding sequence gives back the pages behind
it. A model with both sliding and global layers (Gemma 3) keeps its sliding layers' K/V in
a window pool of their own (rollout.pages.WindowPages): there a decoding sequence gives
back the window pages behind its window, and its global layers keep every page.

Weights come from outside (`set_weights(params, version)`), so a trainer can swap them
between calls; every token is stamped with the version that produced it. The high-level
call is rollout.scheduler.generate: requests in, per-sample completions out.

The engine's rooms: its shapes (rollout.engine_config), its device programs
(rollout.programs), its slot and page bookkeeping (rollout.slots), its prefill
(rollout.prefilling), the programs it compiles ahead (rollout.compile_ahead) and the
records it hands out (rollout.sequences); this module decides what runs when.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.transformer import Transformer, logical_axes, params_of
from jaxrl_post.rollout import compact, forward, programs, weights
from jaxrl_post.rollout.compile_ahead import CompileAhead, CompileAheadMixin
from jaxrl_post.rollout.engine_config import EngineConfig
from jaxrl_post.rollout.layout import RolloutLayout, shard_count
from jaxrl_post.rollout.pages import (TRASH_PAGE, PageAllocator, PagedSequence, cdiv,
                                      resolve_num_pages, sequences_held, window_pool_pages,
                                      window_share, window_span)
from jaxrl_post.rollout.prefilling import Prefilling
from jaxrl_post.rollout.prefix_cache import PrefixCache
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.rollout.sequences import ResultTokens
from jaxrl_post.rollout.slots import SlotBook
from jaxrl_post.sharding import ROLLOUT_RULES, tree_shardings

# Most slots an engine sizes itself (num_slots None, see Engine): a slot is a few small
# rows of host and device state, and slots beyond the live sequences cost nothing in a
# compacted decode step, but each one still widens every cascade step and page table.
MAX_SLOTS = 512
# Fewest slots such an engine gets: a pool too small for that many sequences of its
# max_seq_len still holds that many shorter ones, which is the usual case.
_MIN_SLOTS = 8


@functools.lru_cache(maxsize=None)
def _release_window(cfg: ModelConfig) -> int | None:
  """The window behind which no layer reads a page (None: some layer reads them all).

  Only models whose every layer has a window (Mistral) can give pages back while a
  sequence decodes; a global layer (Gemma 3 has one per six) reads the whole sequence.
  """
  windows = cfg.layer_windows
  return None if None in windows else max(windows)


class _Launched(NamedTuple):
  """A decode call in flight: its outputs (device arrays) and what the host knew then."""

  tokens: jax.Array
  logprobs: jax.Array
  active: jax.Array
  experts: jax.Array | None  # [B, steps, L, k] (MoE models)
  floors: jax.Array | None  # [B, steps] (calls that may truncate)
  occupant: np.ndarray  # [B] each slot's occupant number at launch
  version: int


class Engine(SlotBook, Prefilling, CompileAheadMixin):
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
    self.kv_dtype = config.pool_dtype(model_config)
    self.page_size = config.pool.page_size
    kv_shards = self.layout.mesh.shape["tensor"] if self.layout.kv_axis else 1
    context = model_config.max_position_embeddings
    self.max_seq_len = min(config.max_seq_len or context, context)
    self.max_pages = cdiv(self.max_seq_len, self.page_size)
    # Window pool (split_kv models): what one decoding sequence holds in it at most.
    self.window_span = window_span(model_config, self.page_size, config.decode_steps)
    share = window_share(model_config, self.page_size, self.max_pages, config.decode_steps)
    num_pages = resolve_num_pages(config.pool, model_config, self.kv_dtype,
                                  self.layout.local_device, kv_shards=kv_shards,
                                  data_shards=self.shards, window=share)
    wpages = 0
    if self.window_span:
      wpages = window_pool_pages(num_pages, share, self.max_pages, self.window_span)
    self.pool = programs.zeros_pool(model_config, self.shards * num_pages, self.page_size,
                                    self.kv_dtype, self.layout, self.shards * wpages)
    self.allocs = [PageAllocator(num_pages, wpages) for _ in range(self.shards)]
    self._window_map = None  # The window pages' map on the devices (see _window_operand).
    if config.prefix_cache:
      if programs.several_adapters(model_config):  # Its K/V depend on the adapter too.
        raise UserError("EngineConfig.prefix_cache: the cache keys prompts by their tokens, "
                        "and a model holding several adapters writes different K/V for "
                        "each; turn it off")
      self.prefix_caches = [PrefixCache(a, self.page_size) for a in self.allocs]
    if config.num_slots is None:  # No work in sight: as many as the pool holds.
      held = self.shards * sequences_held(num_pages, self.max_pages)
      if wpages:
        held = min(held, self.shards * sequences_held(
            wpages, min(self.max_pages, self.window_span)))
      config = config.sized_for(MAX_SLOTS, capacity=min(MAX_SLOTS, max(_MIN_SLOTS, held)))
      self.config = config
    self.num_slots = shard_count(config.num_slots, self.shards, config.group_slots)
    self.slots_per_shard = self.num_slots // self.shards
    self._slots = programs.host_slots(self.num_slots, self.max_pages, config.max_stop_ids)
    self._device_slots = self.layout.put_rows(self._slots)  # Stays on the devices.
    self._dirty: set[int] = set()  # Slots whose host rows the devices have not seen yet.
    self._grown: set[int] = set()  # Running slots whose page-table rows grew since.
    # Bumped when a slot is filled or emptied: a collected call's rows count only for
    # slots that still hold what it decoded.
    self._occupant = np.zeros((self.num_slots,), np.int64)
    self._pending: collections.deque[_Launched] = collections.deque()  # Calls in flight.
    self._ahead: CompileAhead | None = None  # See compile_ahead.
    # (row width, chunks / 8) -> the (rows, key pages) per shard prefill calls have run.
    self._prefill_shapes: dict[tuple[int, int], set[tuple[int, int]]] = {}
    self._seqs: list[PagedSequence | None] = [None] * self.num_slots
    self._final_len = np.zeros((self.num_slots,), np.int64)  # Most tokens a slot writes.
    # Per block of group_slots slots: the shared whole prompt pages and their token count.
    blocks = self.num_slots // config.group_slots if config.group_slots else 0
    self._block_table = np.full((blocks, self.max_pages), TRASH_PAGE, np.int32)
    self._block_len = np.zeros((blocks,), np.int32)
    # Windowed models keep the blocks but decode with plain paged attention; the run says why.
    refusal = forward.cascade_refusal(model_config) if config.group_slots else None
    self.cascade = bool(config.group_slots) and refusal is None
    self.cascade_refused: str | None = refusal  # Asked for by group_slots, and why not.
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
    An engine that splits its layers takes them split (a run's weight sync makes that
    form: rollout.weights.SplitLayers) or stacked, which it splits into a copy.
    """
    tree, shardings, form = self._weight_placement
    if form is not None and weights.is_split(params):
      tree, shardings = form.abstract(tree), form.shardings(shardings)
    if jax.tree.structure(params) != jax.tree.structure(tree):
      raise UserError("set_weights: the parameter tree does not match the model config")
    self.params = jax.tree.map(programs.placed, params, shardings)
    if form is not None:
      self.params = weights.split_layers(self.params, self.model_config.num_layers)
    self.version = int(version)
    for cache in self.prefix_caches:  # Cached K/V came from the old weights.
      cache.clear()

  @functools.cached_property
  def _weight_placement(self) -> tuple:
    """(the abstract params, their rollout shardings, the engine's split form or None):
    what set_weights places each sync's weights by. Made once: building the model's
    abstract template took 6-7 ms of host time at every step's sync."""
    template = weights.template(self.model_config)
    tree = params_of(template)
    shardings = tree_shardings(logical_axes(template), tree, ROLLOUT_RULES, self.layout.mesh)
    form = weights.engine_form(self.model_config, self.layout.mesh, self.layout.split_layers)
    return tree, shardings, form

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

  @property
  def window_pages_in_use(self) -> int:
    """Window-pool pages held (0 without a window pool)."""
    return sum(a.window.alloc.in_use for a in self.allocs if a.window is not None)

  def _window_operand(self):
    """The window pages' map ([shards * pages] shard-local ids, on the devices) for a
    device call, sent again only when the host changed it; None without a window pool."""
    if self.window_span is None:
      return None
    if self._window_map is None or any(a.window.dirty for a in self.allocs):
      self._window_map = self.layout.put_rows(np.concatenate([a.window.map for a in self.allocs]))
      for a in self.allocs:
        a.window.dirty = False
    return self._window_map

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
    most = room // private if private else 1 << 30
    window = self.allocs[0].window
    if window is not None:  # Each sample holds at most its span of window pages.
      room = window.alloc.usable - cdiv(prompt_len, self.page_size)
      most = min(most, max(room, 0) // max(min(private, self.window_span), 1))
    return most

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
    held = self.model_config.lora.adapters if programs.several_adapters(self.model_config) else 1
    if not 0 <= sampling.adapter < held:
      raise UserError(f"sampling: adapter {sampling.adapter} is not one of this engine's "
                      f"{held} (LoraConfig.adapters)")
    if self.max_group_size(len(prompt), sampling.max_tokens) == 0:
      raise UserError(f"a prompt of {len(prompt)} tokens with max_new_tokens="
                      f"{sampling.max_tokens} needs more KV pages than the pool's "
                      f"{self.allocs[0].usable} (per data shard)")

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
    out = programs.decode_program(self.layout)(
        self.params, self.pool, self._device_slots, shared, self._window_operand(),
        cfg=self.model_config,
        steps=steps, layout=self.layout, width=width, rows=rows, truncation=self._truncating(),
        draws=bool(np.any(self._slots.temperature > 0.0)))
    self.pool, self._device_slots, tokens, logprobs, active, experts, floors = out
    for x in jax.tree.leaves((tokens, logprobs, active, experts, floors)):
      x.copy_to_host_async()  # Fetched while later calls run.
    self._pending.append(_Launched(tokens, logprobs, active, experts, floors,
                                   self._occupant.copy(), self.version))

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

"""The rollout engine's device programs: the decode loop, packed prefill, first tokens.

Each is one jitted program over the rollout mesh (rollout.layout), taking the weights in
the engine's form (rollout.weights), the KV pool (donated: written in place) and the slot
state the devices keep between calls (SlotState). `rollout.engine.Engine` decides what to
run and when; the planner (jaxrl_post.plan) lowers these same programs on abstract
arguments to read their memory and cost, so what it predicts is what a run compiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.moe import NO_EXPERT
from jaxrl_post.models.transformer import group_lora
from jaxrl_post.rollout import compact, forward, prefill_pack, weights
from jaxrl_post.rollout.attention import SharedPrefix
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.rollout.pages import TRASH_PAGE, KVPool, copy_pool_pages
from jaxrl_post.rollout.sampling import sample_with_floors, token_keys
from jaxrl_post.sharding import ROLLOUT_RULES, activation_rules, mesh_platform


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
  adapter: jax.Array  # [B] int32 the adapter it decodes with (LoraConfig.adapters > 1)


def host_slots(num_slots: int, max_pages: int, max_stop_ids: int) -> SlotState:
  b = num_slots
  return SlotState(
      tokens=np.zeros((b,), np.int32), lengths=np.zeros((b,), np.int32),
      num_generated=np.zeros((b,), np.int32), max_tokens=np.zeros((b,), np.int32),
      active=np.zeros((b,), bool), page_table=np.full((b, max_pages), TRASH_PAGE, np.int32),
      seeds=np.zeros((b,), np.uint32), sample_ids=np.zeros((b,), np.int32),
      temperature=np.zeros((b,), np.float32), top_k=np.zeros((b,), np.int32),
      top_p=np.ones((b,), np.float32), stop_ids=np.full((b, max_stop_ids), -1, np.int32),
      adapter=np.zeros((b,), np.int32))


def decode_loop(params, pool: KVPool, state: SlotState, shared: SharedPrefix | None,
                window_map=None, *, cfg: ModelConfig, steps: int, layout: RolloutLayout,
                width: int | None = None, rows: int | None = None, truncation: bool = True,
                draws: bool = True):
  """Up to `steps` decode steps for all slots; stops early once every slot is done (not
  on a GPU, whose loop runs all `steps` so the host never waits on a flag: _decode_steps).

  `window_map` ([pages] int32, split_kv models only) maps each page id to the window page
  that holds its sliding layers' K/V (rollout.pages.WindowPages).

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
      pool, state, *outputs = _decode_steps(params, pool, state, shared, window_map, cfg,
                                            steps, layout, truncation, draws)
    else:
      order = compact.live_first(state.active, layout.data_shards)
      pool, live, *outputs = _decode_steps(params, pool, compact.take(state, order, rows),
                                           shared, window_map, cfg, steps, layout,
                                           truncation, draws)
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


def _on_gpu(layout: RolloutLayout) -> bool:
  """Whether the programs are for GPUs, which compile with options of their own and run
  no data-dependent branch: XLA:GPU decides each (a loop's exit test, a lax.cond) on the
  host, copying a flag back and draining the device before it launches further."""
  return mesh_platform(layout.mesh) == "gpu"


def _shortcuts(layout: RolloutLayout) -> bool:
  """Whether sampling skips, with lax.cond, the passes over [B, V] the rows turn out not to
  need: on a CPU only, where those passes are most of a decode step. Not on a GPU (see
  _on_gpu), nor on a TPU: there the logits cross into the cond in a layout of their own,
  a relayout of the whole f32 row every step (without the cond, the LM head and its
  logits' passes went from 1,182 to 919 MB a step of a 1B decode loop on one v5e chip at
  256 rows, and from 429 to 331 MB on each chip of an 8B one at tensor 4). The engine
  already leaves the sort and the draw out of its programs when no request asks for
  them."""
  return mesh_platform(layout.mesh) == "cpu"


_DECODE_JIT = dict(static_argnames=("cfg", "steps", "layout", "width", "rows", "truncation",
                                   "draws"), donate_argnames=("pool", "state"))
# XLA:GPU rematerialises fusions of a program whose live memory it counts above a share
# of the device's (xla_gpu_memory_limit_slop_factor percent of what the arguments leave).
# It counts the KV pool, which the rollout's programs update in place, as if it were
# held twice, so a pool of a third of the GPU made XLA recompute fusions of every layer,
# K/V writes included, at every step (Qwen3-0.6B on one H100: 255 rematerialised names
# in the decode loop, 600 in prefill); the pool is sized to fit already (rollout.pages).
GPU_POOL_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 10_000}
# XLA:GPU splits the contraction of a decode matmul (a few rows of activations against a
# whole weight) into float32 partial sums, and each fusion that consumes the product (the
# K and V page writes, the query's RoPE) re-reads all of them: at Llama-3.1-8B on 8 x H100
# (tensor 2) that made the loop read 1.239x its floor of weights + KV; with one split it
# reads 1.067x and launches 486 kernels per step instead of 550 (docs/BENCHMARKS.md).
GPU_DECODE_OPTIONS = {"xla_gpu_experimental_force_split_k": 1, **GPU_POOL_OPTIONS}
_decode_jit = jax.jit(decode_loop, **_DECODE_JIT)
_decode_gpu = jax.jit(decode_loop, compiler_options=GPU_DECODE_OPTIONS, **_DECODE_JIT)


def decode_program(layout: RolloutLayout):
  """decode_loop jitted for `layout`'s platform (call it, or `.lower` it, with
  decode_loop's arguments): on a GPU with GPU_DECODE_OPTIONS."""
  return _decode_gpu if _on_gpu(layout) else _decode_jit


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
  """[B, M] page tables -> the [B, width] ones the decode step reads (see decode_loop)."""
  width = width or full.shape[1]
  if shared is None:
    return full[:, :width]
  rows_per_block = full.shape[0] // shared.lengths.shape[0]
  start = jnp.repeat(shared.lengths // page_size, rows_per_block)  # [B] shared pages
  cols = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width]
  own = jnp.take_along_axis(full, jnp.minimum(cols, full.shape[1] - 1), axis=1)
  return jnp.where(cols < full.shape[1], own, TRASH_PAGE)


@functools.partial(jax.jit, donate_argnums=0)
def set_rows(state: SlotState, index, rows: SlotState) -> SlotState:
  """state with rows `index` replaced ([N] slot ids; ids >= B are padding, dropped)."""
  return jax.tree.map(lambda a, r: a.at[index].set(r, mode="drop"), state, rows)


@functools.partial(jax.jit, donate_argnums=0)
def set_table_rows(state: SlotState, index, table) -> SlotState:
  """state with the page-table rows `index` replaced; every other field as it is."""
  return state._replace(page_table=state.page_table.at[index].set(table, mode="drop"))


def several_adapters(cfg: ModelConfig) -> bool:
  return cfg.lora is not None and cfg.lora.adapters > 1


def _decode_steps(params, pool, state, shared, window_map, cfg, steps, layout, truncation,
                  draws):
  model, layers = weights.bind(cfg, params)
  if layers is not None and cfg.lora is not None:  # Laid out once, outside the loop.
    layers = tuple(group_lora(cfg, p) for p in layers)
  adapters = state.adapter if several_adapters(cfg) else None
  out_tokens, out_logprobs, out_experts, out_floors = _empty_outputs(
      cfg, state.tokens.shape[0], steps, truncation)

  # On a GPU the loop runs its `steps` (a count XLA knows: no read-back, see _on_gpu) and
  # sampling takes no runtime shortcut; slots that finish mid-call decode nothing.
  on_device = not _on_gpu(layout)

  def cond(carry):
    i, _, st = carry[:3]
    return (i < steps) & jnp.any(st.active) if on_device else i < steps

  def body(carry):
    i, pool, st, out_tokens, out_logprobs, out_experts, out_floors = carry
    logits, pool, experts = forward.decode_step(model, pool, st.tokens, st.lengths,
                                                st.page_table, st.active, shared, layout,
                                                layers=layers, window_map=window_map,
                                                adapters=adapters)
    keys = token_keys(st.seeds, st.sample_ids, st.num_generated)
    tok, lp, floor = sample_with_floors(logits, keys, st.temperature, st.top_k, st.top_p,
                                        truncation, draws, shortcuts=_shortcuts(layout))
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


def prefill(params, pool: KVPool, rows: prefill_pack.PackedRows, last, window_map=None,
            adapters=None, *, cfg: ModelConfig, layout: RolloutLayout):
  """Packed prompt chunks into the pool; (pool, logits [C, V] after each chunk's last token,
  each row token's experts [R, T, L, k] int16 replicated, or None for a dense model).
  window_map as in decode_loop; adapters [C] int32 each chunk's adapter (a model holding
  several; None otherwise)."""
  with activation_rules(ROLLOUT_RULES, layout.mesh):
    model, layers = weights.bind(cfg, params)
    logits, pool, experts = forward.prefill_packed(model, pool, rows, last, layout,
                                                   layers=layers, window_map=window_map,
                                                   adapters=adapters)
  if experts is not None:
    experts = jax.lax.with_sharding_constraint(experts.astype(jnp.int16), layout.replicated)
  return pool, logits, experts


_PREFILL_JIT = dict(static_argnames=("cfg", "layout"), donate_argnames=("pool",))
_prefill_jit = jax.jit(prefill, **_PREFILL_JIT)
_prefill_gpu = jax.jit(prefill, compiler_options=GPU_POOL_OPTIONS, **_PREFILL_JIT)


def prefill_program(layout: RolloutLayout):
  """prefill jitted for `layout`'s platform (call it, or `.lower` it, with prefill's
  arguments): on a GPU with GPU_POOL_OPTIONS."""
  return _prefill_gpu if _on_gpu(layout) else _prefill_jit


# sample_first's operands after the logits: the rows, seeds, sample ids, temperatures,
# top-k and top-p of the samples.
FIRST_TOKEN_OPERANDS = (np.int32, np.uint32, np.int32, np.float32, np.int32, np.float32)


@functools.partial(jax.jit, static_argnames=("layout", "truncation", "draws"))
def sample_first(logits, rows, seeds, sample_ids, temperature, top_k, top_p, *,
                  layout: RolloutLayout, truncation: bool = True,
                  draws: bool = True):  # [R, V], [S] x6
  """Each sample's first token (token index 0) from the last logits of its prefill row;
  without `truncation` (no sample uses top-k or top-p) or `draws` (every sample greedy)
  the program leaves out the vocabulary sort or the random draw, which on a CPU take
  most of its compile time."""
  keys = token_keys(seeds, sample_ids, jnp.zeros_like(sample_ids))
  out = sample_with_floors(jnp.take(logits, rows, axis=0), keys, temperature, top_k, top_p,
                           truncation, draws, shortcuts=_shortcuts(layout))
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, layout.replicated), out)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=0)
def copy_pages(pool: KVPool, src, dst, *window, layout: RolloutLayout) -> KVPool:
  """Per data shard, copies its pages src[s, i] -> dst[s, i] (shard-local ids), and with a
  window pool its window pages window[0][s, i] -> window[1][s, i]."""
  specs = forward.pool_specs(layout, pool.wk is not None)
  ids = (layout.rows_spec(2),) * (2 + len(window))
  local = layout.per_device(lambda p, *a: copy_pool_pages(p, *(x[0] for x in a)),
                            in_specs=(specs, *ids), out_specs=specs)
  return local(pool, src, dst, *window)



def zeros_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
               layout: RolloutLayout, window_pages: int = 0) -> KVPool:
  """The pool created in place on its devices (no host or single-device staging copy).

  Its sharding is spelled as the programs that return the pool spell it (a constraint, not
  out_shardings: XLA drops size-1 axes and trailing Nones). A differently spelled but
  equivalent sharding would make the next call's jit compile the same shapes again.
  """
  sharding = layout.sharding(layout.pool_spec)
  place = lambda x: jax.lax.with_sharding_constraint(x, sharding)
  make = jax.jit(lambda: jax.tree.map(
      place, KVPool.zeros(cfg, num_pages, page_size, dtype, window_pages)))
  return make()


def placed(x, sharding):
  """x in `sharding`: as is when already there, else copied onto the mesh."""
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
    return x
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.jit(lambda a: a, out_shardings=sharding)(x)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                      dtype=host.dtype)

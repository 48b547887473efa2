"""Continuous batching over an engine's decode slots, with chunked prefill.

Each `step` does, in order:

1. admit: waiting requests become prefixes (their pages reserved) while there are more
   free slots than samples already on their way to one;
2. prefill: prompt chunks of several prompts per device call (the engine's prefill_rows
   per data shard), at most `prefill_tokens_per_step` tokens while any slot is decoding
   (so a long prompt never stalls decoding for more than that), unbounded while nothing
   decodes;
3. insert: prefilled samples enter free slots (samples done at their first token skip);
4. decode: one engine call of `decode_steps` steps over all slots; finished slots are freed
   at once, so the next step refills them.

Overlap (SchedulerConfig.overlap, on by default on accelerators): step 4 launches the
next decode call before it waits for the previous one, so the devices always have a call
queued while the host reads tokens, frees, admits, prefills and inserts. The cost is that a
slot finishing in one call idles through the next (already launched) before it is refilled.
Samples are the same either way: a token's random draw depends on its request, sample and
position, never on its slot or call.

Multi-turn: a request submitted with `keep=True` keeps each sample's pages when it finishes
(`held[(request id, sample)]`, an engine `Held`), and `resume` queues that sample's next
turn: a one-sample request whose prefill writes only the tokens after the held ones (the
last turn's final token and the observation), on the data shard that holds them. The
caller gives the pages back with `release` once the trajectory ends.

A request whose pages the pool cannot promise yet waits at the head of the queue (first come,
first served); it never fails for want of memory and never takes a live sequence's pages.
Groups of samples larger than the pool can ever hold are split into groups that fit (each
prefills the prompt once).

Blocks: an engine with group_slots = K > 0 decodes each block of K contiguous slots as one
prompt's samples (cascade attention reads the prompt once per block). Admission and
insertion then count whole free blocks instead of free slots: a prefix takes a free block
and fills it with its samples; a prefix with more than K samples spreads over several whole
blocks, still prefilled once and sharing its prompt pages across them; a prefix with fewer
leaves the rest of its block idle until every sample in it finishes, when the block is free
again (continuous batching at block granularity). A request of one sample shares nothing,
so its sample takes any free slot of a block that holds only such samples ("solo" blocks,
opened from wholly free ones): greedy evaluation fills every slot. Without blocks every
slot is a block of one, which is plain continuous batching.

Data shards: on a rollout mesh the engine's slots and pages are split over D data shards
(slots [s * B/D, (s + 1) * B/D) decode with shard s's pages). A prompt is admitted to one
shard, the one with the most free blocks not yet promised (or the one its caller names:
the multi-turn driver balances held pages itself), and its samples enter only that
shard's blocks; one prefill call writes a chunk of the oldest prefilling prompts of every
shard. With one shard this is exactly the single-device behaviour.

The scheduler knows the engine only through its methods (new_prefix, prefill_batch,
bulk_insert, skip, generate, launch, collect, in_flight, free_resource, validate,
max_group_size, max_concurrent_decodes, group_slots, prefill_rows, shards; for kept
requests also continue_held, detach, hold_skipped, release).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.sharding import mesh_platform, on_accelerator

if TYPE_CHECKING:  # The engine imports this module's records.
  from jaxrl_post.rollout.engine import Engine


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Attributes:
    prefill_tokens_per_step: prompt tokens prefilled between two decode calls while some
      slot is decoding (at least one chunk is always done).
    overlap: keep a decode call queued on the devices while the host works (see above).
      None (the default) turns it on for accelerators and off on a CPU backend, whose
      devices are the host's own cores: there a queued call hides no host work, and a
      slot finishing in one call would still idle through the next.
  """

  prefill_tokens_per_step: int = 512
  overlap: bool | None = None

  def overlaps(self, mesh) -> bool:
    """`overlap`, with None resolved for the platform of the engine's `mesh` (not the
    host's backend: see sharding.platform)."""
    return on_accelerator(mesh_platform(mesh)) if self.overlap is None else self.overlap

  def __post_init__(self):
    if self.prefill_tokens_per_step < 1:
      raise UserError(f"scheduler config: prefill_tokens_per_step must be >= 1, "
                      f"got {self.prefill_tokens_per_step}")


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt, with optional per-request sampling settings and seed (taken mod 2**32)."""

  prompt: tuple[int, ...]
  sampling: SamplingParams | None = None
  seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sample.

  Attributes:
    tokens: completion ids (a stop token, if one ended it, is the last).
    logprobs: behaviour log-probability of each token.
    finish_reason: "stop" or "length".
    versions: the weight version that produced each token.
    experts: MoE models: [P + N - 1, L, k] int16, the experts each layer chose for every
      token the model was fed -- the P prompt tokens, then every completion token but the
      last -- which routing replay hands to the trainer; None for a dense model.
    floors: with top-k or top-p, each token's kept set as a floor on logits / temperature
      (sampling.truncate), so the trainer takes its logprob over the same set; else None.
  """

  tokens: tuple[int, ...]
  logprobs: tuple[float, ...]
  finish_reason: str
  versions: tuple[int, ...]
  experts: Optional[np.ndarray] = dataclasses.field(default=None, compare=False)
  floors: Optional[tuple[float, ...]] = None

  @property
  def weight_version(self) -> int:
    """The oldest weights any token came from (the staleness that matters)."""
    return min(self.versions)


@dataclasses.dataclass
class _Group:
  rid: int
  prompt: np.ndarray
  sampling: SamplingParams
  seed: int
  sample_ids: tuple[int, ...]
  held: Any = None  # A later turn: the engine's Held sequence it continues.
  shard: Optional[int] = None  # A data shard the caller chose (None: the one with most room).


@dataclasses.dataclass
class _Running:
  rid: int
  sample: int
  stop_ids: frozenset
  tokens: list
  logprobs: list
  versions: list
  experts: Optional[list] = None  # [n, L, k] arrays: the prompt's, then each call's
  floors: Optional[list] = None  # per token, when the request truncates

  def completion(self) -> Completion:
    reason = "stop" if self.tokens[-1] in self.stop_ids else "length"
    experts = None if self.experts is None else np.concatenate(self.experts)
    floors = None if self.floors is None else tuple(self.floors)
    return Completion(tuple(self.tokens), tuple(self.logprobs), reason, tuple(self.versions),
                      experts, floors)


class Scheduler:
  """Drives an engine: a FIFO of requests, chunked prefill, continuous batching."""

  def __init__(self, engine: Any, config: SchedulerConfig = SchedulerConfig()):
    self.engine, self.config = engine, config
    self.waiting: collections.deque[_Group] = collections.deque()
    self.prefilling: collections.deque = collections.deque()  # (group, prefix)
    self.ready: collections.deque = collections.deque()  # (group, prefix), prefilled
    self.slots: list[_Running | None] = [None] * engine.max_concurrent_decodes
    self.block_size = engine.group_slots or 1  # Slots a prompt's samples enter together.
    self.solo_blocks: set[int] = set()  # Live blocks of one-sample prompts (see above).
    self.shards = engine.shards  # Data shards: a prompt's pages and slots share one.
    self.results: dict[int, list[Completion | None]] = {}
    self.stats = collections.Counter()
    self.held: dict[tuple[int, int], Any] = {}  # (request, sample) -> Held, see above
    self._keep: set[int] = set()  # Requests whose samples keep their pages.
    self._next_id = 0

  def submit(self, prompt: Sequence[int], sampling: SamplingParams, *, n: int = 1,
             seed: int = 0, keep: bool = False, shard: Optional[int] = None) -> int:
    """Queues n samples of a prompt; returns the request id. Raises UserError if the
    engine can never serve it. keep: each sample's pages outlive it (see above). shard:
    the data shard all its samples take (a caller that balances held pages itself)."""
    prompt = np.asarray(list(prompt), np.int32)
    self.engine.validate(prompt, sampling)
    if shard is not None and not 0 <= shard < self.shards:
      raise ValueError(f"scheduler: shard {shard} is not one of the {self.shards} data shards")
    rid = self._new_request(n, keep)
    size = min(n, self.engine.max_group_size(len(prompt), sampling.max_tokens))
    for first in range(0, n, size):
      ids = tuple(range(first, min(first + size, n)))
      self.waiting.append(_Group(rid, prompt, sampling, int(seed) % (1 << 32), ids,
                                 shard=shard))
    return rid

  def resume(self, held: Any, history: Sequence[int], sampling: SamplingParams, *,
             seed: int, sample_id: int = 0, keep: bool = True) -> int:
    """Queues the next turn of a held sample: `history` is every token so far, the new
    observation last. Returns the new request id (one sample, id `sample_id`)."""
    history = np.asarray(list(history), np.int32)
    self.engine.validate(history, sampling)
    rid = self._new_request(1, keep)
    self.waiting.append(_Group(rid, history, sampling, int(seed) % (1 << 32), (sample_id,),
                               held=held))
    return rid

  def release(self, held: Any) -> None:
    """Gives a held sample's pages back (its trajectory is over)."""
    self.engine.release(held)

  def _new_request(self, n: int, keep: bool) -> int:
    rid, self._next_id = self._next_id, self._next_id + 1
    self.results[rid] = [None] * n
    if keep:
      self._keep.add(rid)
    return rid

  @property
  def idle(self) -> bool:
    return not (self.waiting or self.prefilling or self.ready or self._busy() or
                self.engine.in_flight)

  def _busy(self) -> bool:
    return any(r is not None for r in self.slots)

  def step(self) -> list[tuple[int, int, Completion]]:
    """One round of admit, prefill, insert, decode; returns (request id, sample, completion)
    for every sample that finished."""
    self._admit()
    if self.waiting and not (self.prefilling or self.ready or self._busy() or
                             self.engine.in_flight):
      raise UserError(f"the KV pool cannot take the next request while {len(self.held)} "
                      "finished samples hold their pages and nothing else runs: release "
                      "held samples (or run fewer trajectories at once, or enlarge the pool)")
    self._prefill()
    finished = self._insert()
    if self._busy() or self.engine.in_flight:
      finished += self._decode()
    for rid, i, completion in finished:
      self.results[rid][i] = completion
    return finished

  def completed(self, finished: list[tuple[int, int, Completion]]) -> list[int]:
    """The requests a step's `finished` samples completed (all n done), each once, in the
    order their last samples finished."""
    last = {rid: i for i, (rid, _, _) in enumerate(finished)}
    return [rid for i, (rid, _, _) in enumerate(finished)
            if last[rid] == i and all(c is not None for c in self.results[rid])]

  def run(self) -> dict[int, list[Completion]]:
    """Steps until every submitted request is done; returns all results by request id."""
    while not self.idle:
      self.step()
    return self.results

  def _free_blocks(self) -> list[collections.deque]:
    """Per data shard, each wholly free block as a deque of its slot indices, lowest first."""
    k, per_shard = self.block_size, len(self.slots) // self.shards
    out = [collections.deque() for _ in range(self.shards)]
    for first in range(0, len(self.slots), k):
      block = range(first, first + k)
      if all(self.slots[i] is None for i in block):
        out[first // per_shard].append(collections.deque(block))
    return out

  def _leave_block(self, slot: int) -> None:
    """An emptied solo block may hold any prompt again."""
    block = slot // self.block_size
    k = self.block_size
    if all(self.slots[i] is None for i in range(block * k, (block + 1) * k)):
      self.solo_blocks.discard(block)

  def _solo_slots(self) -> list[collections.deque]:
    """Per data shard, the free slots of live solo blocks, lowest first."""
    k, per_shard = self.block_size, len(self.slots) // self.shards
    out = [collections.deque() for _ in range(self.shards)]
    for block in sorted(self.solo_blocks):
      for i in range(block * k, (block + 1) * k):
        if self.slots[i] is None:
          out[i // per_shard].append(i)
    return out

  def _slots_needed(self, samples: int) -> int:
    """Free slots a prefix of this many samples takes: whole blocks, or one if solo."""
    if samples == 1 or self.block_size == 1:
      return samples
    return -(-samples // self.block_size) * self.block_size

  def _pending(self) -> list[int]:
    """Per data shard, slots that prefixes on their way to a slot will take."""
    pending = [0] * self.shards
    for _, p in (*self.prefilling, *self.ready):
      pending[p.shard] += self._slots_needed(p.remaining)
    return pending

  def _admit(self) -> None:
    """Waiting groups become prefixes (first come, first served) on the data shard with
    the most free slots not yet promised; a group whose pages no shard can promise waits."""
    free = [len(f) * self.block_size + len(o)
            for f, o in zip(self._free_blocks(), self._solo_slots())]
    room = [f - p for f, p in zip(free, self._pending())]
    while self.waiting:
      g = self.waiting[0]
      need = min(self._slots_needed(len(g.sample_ids)), self.block_size)
      order = sorted((s for s in range(self.shards) if room[s] >= need), key=lambda s: -room[s])
      if g.shard is not None:  # Chosen by the caller: that shard or wait.
        order = [g.shard] if g.shard in order else []
      prefix = None
      if g.held is not None:  # A later turn: only the shard that holds its pages.
        if g.held.shard in order:
          prefix = self.engine.continue_held(g.held, g.prompt, g.sampling, g.seed,
                                             g.sample_ids[0])
      for shard in order if g.held is None else ():
        prefix = self.engine.new_prefix(g.prompt, g.sampling, g.seed, g.sample_ids,
                                        shard=shard)
        if prefix is not None:
          break
      if prefix is None:
        if order:
          self.stats["admission_waits"] += 1
        return
      self.waiting.popleft()
      self.prefilling.append((g, prefix))
      room[prefix.shard] -= self._slots_needed(len(g.sample_ids))

  def _prefill(self) -> None:
    """Prompt chunks: one device call for the oldest prefilling prompts of each data shard
    (at most the engine's prefill_rows per shard)."""
    budget = self.config.prefill_tokens_per_step if self._busy() else float("inf")
    while self.prefilling and budget > 0:
      batch, taken = [], collections.Counter()
      for item in self.prefilling:
        if taken[item[1].shard] < self.engine.prefill_rows:
          taken[item[1].shard] += 1
          batch.append(item)
      before = sum(p.prefilled for _, p in batch)
      self.engine.prefill_batch([p for _, p in batch])
      budget -= sum(p.prefilled for _, p in batch) - before
      self.stats["prefill_chunks"] += len(batch)
      self.stats["prefill_calls"] += 1
      for item in batch:
        if item[1].done:
          self.prefilling.remove(item)
          self.ready.append(item)

  def _insert(self) -> list[tuple[int, int, Completion]]:
    """Prefilled samples into free blocks of their data shard, in order; a block never
    mixes two prompts, except solo blocks, which mix one-sample prompts."""
    finished = []
    blocks, solo = self._free_blocks(), self._solo_slots()
    for item in list(self.ready):
      g, prefix = item
      if len(g.sample_ids) == 1 and self.block_size > 1:
        finished += self._insert_solo(g, prefix, blocks[prefix.shard], solo[prefix.shard])
      else:
        finished += self._insert_group(g, prefix, blocks[prefix.shard])
      if prefix.remaining == 0:
        self.ready.remove(item)
    return finished

  def _insert_group(self, g: _Group, prefix, free: collections.deque) -> list:
    finished, batch = [], []
    while prefix.remaining > len(batch) and free:
      j = prefix.next_sample + len(batch)
      if not prefix.finishes_at_first(j):
        batch.append(free[0].popleft())
        if not free[0]:
          free.popleft()
        continue
      self._bulk_insert(g, prefix, batch)
      batch = []
      finished.append((g.rid, g.sample_ids[j], self._first_only(g, prefix, j).completion()))
      self._skip(g, prefix, g.sample_ids[j])
    self._bulk_insert(g, prefix, batch)
    if free and len(free[0]) < self.block_size:
      free.popleft()  # This prompt's block: its free slots idle until it empties.
    return finished

  def _insert_solo(self, g: _Group, prefix, free: collections.deque,
                   solo: collections.deque) -> list:
    """A one-sample prompt into a free slot of a solo block, opening one if none is left."""
    if prefix.finishes_at_first(0):
      done = self._first_only(g, prefix, 0).completion()
      self._skip(g, prefix, g.sample_ids[0])
      return [(g.rid, g.sample_ids[0], done)]
    if not solo and free:
      block = free.popleft()
      self.solo_blocks.add(block[0] // self.block_size)
      solo.extend(block)
    if solo:
      self._bulk_insert(g, prefix, [solo.popleft()])
    return []

  def _skip(self, g: _Group, prefix, sample: int) -> None:
    """A sample done at its first token needs no slot; a kept one holds its pages."""
    if g.rid in self._keep:
      self.held[(g.rid, sample)] = self.engine.hold_skipped(prefix)
    else:
      self.engine.skip(prefix)

  def _first_only(self, g: _Group, prefix, j: int) -> _Running:
    sp = g.sampling
    truncates = sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0)
    return _Running(g.rid, g.sample_ids[j], frozenset(sp.stop_ids),
                    [int(prefix.first_tokens[j])], [float(prefix.first_logprobs[j])],
                    [prefix.first_version],
                    None if prefix.experts is None else [prefix.experts],
                    [float(prefix.first_floors[j])] if truncates else None)

  def _bulk_insert(self, g: _Group, prefix, slots: list[int]) -> None:
    if not slots:
      return
    first = prefix.next_sample
    self.engine.bulk_insert(prefix, slots)
    for k, slot in enumerate(slots):
      self.slots[slot] = self._first_only(g, prefix, first + k)

  def _decode(self) -> list[tuple[int, int, Completion]]:
    if not self.config.overlaps(self.engine.layout.mesh):
      out = self.engine.generate()
    else:  # Queue the next call (two at the start) before waiting for the oldest.
      for _ in range((2 - self.engine.in_flight) if self._busy() else 0):
        self.engine.launch()
      out = self.engine.collect()
    self.stats["decode_calls"] += 1
    finished = []
    for slot, run in enumerate(self.slots):
      if run is None:
        continue
      produced = out.tokens[slot] >= 0
      run.tokens.extend(out.tokens[slot][produced].tolist())
      run.logprobs.extend(out.logprobs[slot][produced].tolist())
      run.versions.extend([out.version] * int(produced.sum()))
      if run.experts is not None:  # Step n's record is the token fed then: the one before.
        run.experts.append(out.experts[slot][produced])
      if run.floors is not None:
        run.floors.extend(out.floors[slot][produced].tolist())
      if out.finished[slot]:
        finished.append((run.rid, run.sample, run.completion()))
        if run.rid in self._keep:
          self.held[(run.rid, run.sample)] = self.engine.detach(slot)
        else:
          self.engine.free_resource(slot)
        self.slots[slot] = None
        self._leave_block(slot)
    return finished


# ---------------------------------------------------------------------- high-level API


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

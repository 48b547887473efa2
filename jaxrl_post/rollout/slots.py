"""The engine's host-side bookkeeping of slots and pages.

Which slot holds which sample and which pages, what the devices have not seen yet, the
blocks of cascade attention, the pages a decode call will write, windows' released pages,
and sequences held between turns. Nothing here launches a device program but the page
copies of an insert; `Engine` (rollout.engine) combines it with the device programs.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxrl_post.rollout import programs
from jaxrl_post.rollout.attention import SharedPrefix
from jaxrl_post.rollout.pages import TRASH_PAGE, PagedSequence, cdiv, pow2_at_least
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.rollout.sequences import Held, Prefix


class SlotBook:
  """The Engine's slot and page bookkeeping (see the module docstring)."""

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
    # The turn's prefill takes its pages before the window passes any: promised whole.
    if not self._reserve(seq, need, need):
      return None
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
    padding copies the sink to itself); a window pool copies the window pages they map to."""
    width = pow2_at_least(max(len(pairs) for pairs in copies))
    src, dst = (np.zeros((self.shards, width), np.int32) for _ in range(2))  # 0 -> 0 pads.
    for shard, pairs in enumerate(copies):
      if pairs:
        src[shard, :len(pairs)], dst[shard, :len(pairs)] = zip(*pairs)
    operands = [src, dst]
    if self.window_span is not None:
      maps = np.stack([a.window.map for a in self.allocs])  # [shards, pages]
      operands += [np.take_along_axis(maps, src, 1), np.take_along_axis(maps, dst, 1)]
    self.pool = programs.copy_pages(self.pool, *self.layout.put_rows(tuple(operands)),
                                    layout=self.layout)

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
    s.adapter[slot] = sp.adapter
    s.stop_ids[slot] = -1
    s.stop_ids[slot, :len(sp.stop_ids)] = sp.stop_ids
    self._final_len[slot] = p + sp.max_tokens - 1
    self._occupant[slot] += 1
    self._dirty.add(slot)

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
    """Gives back the pages of a running sequence that every layer's window has left, or
    with a window pool the window pages its sliding layers' window has left (the table
    row is unchanged then, so this returns 0).

    The next query sits at position `length` (the host's view, which lags the devices', so
    the devices' windows are past these pages too) and sees keys after length - window.
    Calls in flight may still gather a page given back here, and a later call may give it
    to another sequence: their reads of it are masked by the window, so its contents do
    not matter; writes only land at a sequence's newest positions."""
    if self.window_span is not None:
      seq.pass_window(length - self.model_config.sliding_window + 1)
      return 0
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
      self._device_slots = programs.set_rows(self._device_slots, index, rows)
    if grown:
      index, table = self._rows_of(grown, self._slots.page_table)
      self._device_slots = programs.set_table_rows(self._device_slots, index, table)
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

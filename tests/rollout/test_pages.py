"""Page pool sizing, reference counting, copy on write and the engine's page accounting."""

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rollout import PageAllocator, PagedSequence, PoolConfig, SamplingParams
from jaxrl_post.rollout.pages import TRASH_PAGE, page_bytes, resolve_num_pages
from tests.rollout import helpers as H

PS = H.PAGE_SIZE


class _FakeDevice:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_pool_size_from_pages_bytes_or_device_memory():
  per_page = page_bytes(H.CFG, 16, "bfloat16")
  assert per_page == 2 * 2 * 2 * 8 * 2 * 16  # K+V, layers, KV heads, head_dim, bytes, tokens
  assert resolve_num_pages(PoolConfig(num_pages=10), H.CFG, "bfloat16") == 10
  assert resolve_num_pages(PoolConfig(memory_bytes=per_page * 37 + 5), H.CFG, "bfloat16") == 37
  gpu = _FakeDevice({"bytes_limit": per_page * 1000, "bytes_in_use": per_page * 200})
  cfg = PoolConfig(memory_fraction=0.5)
  assert resolve_num_pages(cfg, H.CFG, "bfloat16", device=gpu) == 400
  cpu = _FakeDevice(None)
  assert resolve_num_pages(PoolConfig(fallback_bytes=per_page * 3), H.CFG, "bfloat16",
                           device=cpu) == 3
  # The CPU's devices share one memory: the fallback is the whole pool's, over every shard.
  assert resolve_num_pages(PoolConfig(fallback_bytes=per_page * 24), H.CFG, "bfloat16",
                           device=cpu, kv_shards=2, data_shards=4) == 6
  with pytest.raises(UserError, match="at least 2"):
    resolve_num_pages(PoolConfig(memory_bytes=per_page), H.CFG, "bfloat16")


def test_reservations_refcounts_and_copy_on_write():
  alloc = PageAllocator(num_pages=10)
  assert alloc.usable == 9 and alloc.available == 9
  assert not alloc.reserve(10)
  assert alloc.reserve(6)
  parent = PagedSequence(alloc, PS, reserved=6)
  parent.grow(10)  # 3 pages, the last one half full.
  assert alloc.in_use == 3 and alloc.available == 3 and TRASH_PAGE not in parent.pages
  child = parent.fork(reserved=2)
  assert child.pages == parent.pages and alloc.refcount[parent.pages].tolist() == [2, 2, 2]
  src, dst = child.make_tail_writable(10)  # Shared partial page: copy.
  assert src == parent.pages[-1] and dst not in parent.pages and child.pages[-1] == dst
  assert alloc.refcount[src] == 1 and child.reserved == 1
  assert child.make_tail_writable(10) is None  # Private now.
  assert child.make_tail_writable(12) is None  # A full page is never written again.
  parent.free()
  assert alloc.in_use == 3  # The child still holds two shared pages and its own copy.
  child.grow(13)
  assert alloc.in_use == 4 and child.reserved == 0
  child.free()
  assert alloc.in_use == 0 and alloc.reserved == 0 and alloc.available == 9
  assert alloc.refcount.tolist() == [1] + [0] * 9


def test_pages_behind_a_window_are_given_back_once():
  alloc = PageAllocator(num_pages=10)
  assert alloc.reserve(5)
  parent = PagedSequence(alloc, PS, reserved=5)
  parent.grow(4 * PS)
  child = parent.fork(reserved=1)
  first = list(parent.pages)
  assert child.release_before(2 * PS + 1) == 2  # Pages 0 and 1 lie wholly before it.
  assert child.pages == [TRASH_PAGE, TRASH_PAGE, *first[2:]] and alloc.in_use == 4
  assert child.release_before(2 * PS + 3) == 0  # Nothing twice; page 2 is still read.
  parent.free()
  assert alloc.in_use == 2  # The child's pages 2 and 3.
  grandchild = child.fork(reserved=0)
  assert alloc.refcount[first[2:]].tolist() == [2, 2] and alloc.refcount[TRASH_PAGE] == 1
  child.free(), grandchild.free()
  assert alloc.in_use == 0 and alloc.refcount.tolist() == [1] + [0] * 9


def test_a_group_shares_its_prompt_pages_and_copies_the_partial_one():
  eng = H.engine()
  rng = np.random.default_rng(0)
  prompt = H.prompts(rng, [10])[0]  # 2 full pages + 1 partial (page size 4).
  k, max_tokens = 3, 12
  prefix = eng.new_prefix(prompt, SamplingParams(temperature=1.0, max_tokens=max_tokens),
                          seed=0, sample_ids=range(k))
  # Promised up front: 3 prompt pages + 4 per sample (positions < 10 + 12 - 1 span pages
  # 0..5), less the partial page the last sample inherits.
  assert eng.alloc.reserved + eng.pages_in_use == 3 + 3 * 4 - 1
  while not eng.prefill(prefix):
    pass
  shared, partial = prefix.seq.pages[:2], prefix.seq.pages[2]
  partial_kv = np.asarray(eng.pool.k[:, :, partial, :2])  # The prompt's tokens 8 and 9.
  eng.bulk_insert(prefix, [0, 1, 2])
  pages = [eng.slot_pages(s) for s in range(k)]
  assert all(p[:2] == shared for p in pages)
  tails = [p[2] for p in pages]
  assert len(set(tails)) == k and partial in tails  # Two copies; the last sample keeps it.
  assert eng.alloc.refcount[shared].tolist() == [k, k]
  assert eng.pages_in_use == 2 + k  # shared prompt pages + one private page per sample
  for t in tails:  # The copies carry the prompt's K/V.
    np.testing.assert_array_equal(np.asarray(eng.pool.k[:, :, t, :2]), partial_kv)
  out = eng.generate()  # 8 steps: each sample writes positions 10..17 (pages 2..4),
  # and its pages grow ahead to what it may ever write (positions < 21: pages 2..5).
  assert out.tokens.shape == (4, 8) and np.all(out.tokens[:k] >= 0) and np.all(out.tokens[k] < 0)
  private = [len(eng.slot_pages(s)) - 2 for s in range(k)]
  assert private == [4] * k and eng.pages_in_use == 2 + sum(private)
  out = eng.generate()  # Steps 9..11 reach max_tokens = 12.
  assert out.finished[:k].all()
  assert eng.pages_in_use == 3 + 3 * 4 - 1 and eng.alloc.reserved == 0  # The promise was tight.
  for s in range(k):
    eng.free_resource(s)
  assert eng.pages_in_use == 0 and eng.alloc.reserved == 0


def test_sharing_ratio_from_the_engine():
  """K samples of one prompt keep the prompt once; separate requests keep it K times."""
  rng = np.random.default_rng(1)
  prompt = H.prompts(rng, [32])[0]  # 8 full pages.
  k, max_tokens = 4, 9  # Writes positions < 40: 2 private pages each.

  def peak(n, copies):
    eng = H.engine()
    prefixes = [eng.new_prefix(prompt, SamplingParams(max_tokens=max_tokens), seed=i,
                               sample_ids=range(n)) for i in range(copies)]
    for p in prefixes:
      while not eng.prefill(p):
        pass
    slot = 0
    for p in prefixes:
      eng.bulk_insert(p, list(range(slot, slot + n)))
      slot += n
    eng.generate()
    return eng.alloc.peak_in_use

  assert peak(k, 1) == 8 + k * 2
  assert peak(1, k) == k * (8 + 2)

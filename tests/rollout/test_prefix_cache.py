"""The prefix cache: prompts that share leading whole pages reuse their K/V, and the
result is what prefilling every prompt whole gives."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_post.models.decode import generate_dense
from jaxrl_post.rollout import Engine, SamplingParams, generate
from jaxrl_post.rollout.pages import PageAllocator
from jaxrl_post.rollout.prefix_cache import PrefixCache
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rollout import helpers as H

PS = H.PAGE_SIZE


def _shared_prompts(rng, n, shared_tokens):
  """n prompts that share exactly their first shared_tokens tokens (then a distinct one)."""
  head = rng.integers(0, H.CFG.vocab_size, size=shared_tokens).tolist()
  return [head + [i] + t for i, t in enumerate(H.prompts(rng, rng.integers(0, 8, size=n)))]


def test_match_takes_whole_leading_pages_and_leaves_the_last_token():
  alloc = PageAllocator(16)
  cache = PrefixCache(alloc, PS)
  prompt = np.arange(3 * PS, dtype=np.int32)  # Exactly three pages.
  alloc.reserve(3)
  pages = [alloc.take_reserved() for _ in range(3)]
  cache.add(prompt, pages)
  assert len(cache) == 3 and all(alloc.refcount[p] == 2 for p in pages)
  # The same prompt: its last page holds its last token, which must be prefilled, and
  # the page before it matches up to that token.
  assert cache.match(prompt)[:3] == (pages[:2], pages[2], PS - 1)
  longer = np.concatenate([prompt, [7]]).astype(np.int32)
  assert cache.match(longer)[:3] == (pages, None, 0)
  other = prompt.copy()
  other[PS + 1] += 1  # Differs in the second page: the first matches whole, one more token.
  assert cache.match(other)[:3] == (pages[:1], pages[1], 1)
  first_differs = prompt.copy()
  first_differs[0] += 1
  assert cache.match(first_differs)[:3] == ([], None, 0)
  assert cache.hit_tokens == (3 * PS - 1) + 3 * PS + (PS + 1)


def test_match_inside_a_page_takes_the_longest_matching_cached_page():
  alloc = PageAllocator(16)
  cache = PrefixCache(alloc, PS)
  head = np.arange(100, 100 + PS, dtype=np.int32)
  alloc.reserve(6)
  taken = []
  for tail in ([1, 2, 9, 9], [1, 2, 3, 9], [1, 2, 3, 4, 9]):  # PS == 4
    prompt = np.concatenate([head, tail]).astype(np.int32)
    taken.append([alloc.take_reserved() for _ in range(len(prompt) // PS)])
    cache.add(prompt, taken[-1])
  assert len(cache) == 4  # One head page, three second pages.
  prompt = np.concatenate([head, [1, 2, 3, 5, 6]]).astype(np.int32)
  # [1, 2, 3, 9] and [1, 2, 3, 4] both match 3 tokens: the first cached is taken.
  assert cache.match(prompt)[:3] == ([taken[0][0]], taken[1][1], 3)
  # A shorter prompt stops one token before its end, inside the page.
  found = cache.match(np.concatenate([head, [1, 2, 3]]).astype(np.int32))
  assert found.partial_tokens == 2 and found.tokens(PS) == PS + 2
  # Evicted pages are forgotten as partial matches too.
  for page in sum(taken, []):
    alloc.release(page)
  assert cache.evict(16) == 4 and len(cache) == 0
  assert cache.match(prompt)[:3] == ([], None, 0)


def test_evict_frees_only_pages_nobody_else_holds_oldest_first():
  alloc = PageAllocator(16)
  cache = PrefixCache(alloc, PS)
  alloc.reserve(4)
  a = [alloc.take_reserved() for _ in range(2)]
  b = [alloc.take_reserved() for _ in range(2)]
  cache.add(np.zeros(2 * PS, np.int32), a)
  cache.add(np.ones(2 * PS, np.int32), b)
  for p in b:
    alloc.release(p)  # Only the cache holds b; a's sequence still holds a.
  assert cache.evict(5) == 2 and len(cache) == 2
  assert all(alloc.refcount[p] == 0 for p in b) and all(alloc.refcount[p] == 2 for p in a)
  cache.clear()
  assert all(alloc.refcount[p] == 1 for p in a) and len(cache) == 0


def test_cached_prompts_decode_as_prefilling_them_whole():
  rng = np.random.default_rng(0)
  prompts = _shared_prompts(rng, 12, 3 * PS + 2)
  greedy = SamplingParams(temperature=0.0, max_tokens=6)
  eng = H.engine(prefix_cache=True, num_slots=4, prefill_rows=2)
  out = generate(eng, prompts, sampling=greedy)
  ref = generate_dense(H.model(), prompts, max_new_tokens=6)
  assert [list(o[0].tokens) for o in out] == ref.tokens
  # Prefill calls after the first reuse the shared three pages and two tokens of every
  # later prompt (copying the page that holds the two).
  assert eng.cached_prompt_tokens == (len(prompts) - 2) * (3 * PS + 2)
  plain = generate(H.engine(num_slots=4, prefill_rows=2), prompts, sampling=greedy)
  for a, b in zip(out, plain):
    np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=H.LOGPROB_TOL)
  # Only the cache holds pages now: its entries, until dropped.
  assert eng.pages_in_use == len(eng.prefix_caches[0]) > 0 and eng.alloc.reserved == 0
  eng.drop_prefix_cache()
  assert eng.pages_in_use == 0


def test_new_weights_clear_the_cache_and_a_short_pool_evicts_it():
  rng = np.random.default_rng(1)
  greedy = SamplingParams(temperature=0.0, max_tokens=4)
  eng = H.engine(prefix_cache=True, num_slots=4, prefill_rows=2)
  generate(eng, _shared_prompts(rng, 4, 2 * PS), sampling=greedy)
  assert len(eng.prefix_caches[0]) > 0
  eng.set_weights(eng.params, version=1)
  assert len(eng.prefix_caches[0]) == 0 and eng.pages_in_use == 0
  # Many distinct long prompts: the cache fills the pool and gives pages back on demand.
  prompts = H.prompts(rng, [6 * PS + 1] * 40)
  out = generate(eng, prompts, sampling=greedy)
  ref = generate_dense(H.model(), prompts, max_new_tokens=4)
  assert [list(o[0].tokens) for o in out] == ref.tokens
  assert eng.pages_in_use == len(eng.prefix_caches[0]) <= eng.alloc.usable


@pytest.mark.parametrize("group_slots", [0, 2])
def test_matches_inside_a_page_on_every_data_shard(group_slots):
  """Two data shards, each with its own cache: a page copy lands on the shard whose prompt
  needs it, cascade blocks share the copied page, and greedy tokens are the dense ones."""
  rng = np.random.default_rng(2)
  prompts = _shared_prompts(rng, 10, 2 * PS + 3)
  greedy = SamplingParams(temperature=0.0, max_tokens=5)
  mesh = make_mesh(MeshConfig(data=2, fsdp=1), jax.devices()[:2])
  cfg = dataclasses.replace(H.ENGINE, prefix_cache=True, num_slots=4, prefill_rows=1,
                            group_slots=group_slots)
  eng = Engine.from_model(H.model(), cfg, mesh=mesh)
  out = generate(eng, prompts, n=2, sampling=greedy)
  ref = generate_dense(H.model(), prompts, max_new_tokens=5)
  assert [[list(s.tokens) for s in o] for o in out] == [[t, t] for t in ref.tokens]
  # Every prompt after the first on each shard reuses the head, 3 tokens inside a page.
  assert eng.cached_prompt_tokens == (len(prompts) - 2) * (2 * PS + 3)
  eng.drop_prefix_cache()
  assert eng.pages_in_use == 0


def test_match_returns_the_records_of_the_tokens_it_supplies():
  alloc = PageAllocator(16)
  cache = PrefixCache(alloc, PS)
  prompt = np.arange(3 * PS, dtype=np.int32)
  record = np.arange(3 * PS * 2).reshape(3 * PS, 2)  # Two values per token.
  alloc.reserve(3)
  cache.add(prompt, [alloc.take_reserved() for _ in range(3)], record)
  other = prompt.copy()
  other[PS + 2] += 1  # One whole page, then two tokens of the second.
  found = cache.match(other)
  assert found.tokens(PS) == PS + 2
  np.testing.assert_array_equal(found.record, record[:PS + 2])
  plain = PrefixCache(alloc, PS)  # Pages added without records: none comes back.
  alloc.reserve(1)
  plain.add(prompt[:PS], [alloc.take_reserved()])
  assert plain.match(prompt).record is None

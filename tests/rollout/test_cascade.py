"""Cascade decode: blocks of slots read their prompt's shared pages once; nothing else changes.

Engines with group_slots must give what the plain engine gives (greedy tokens, behaviour
logprobs), for prompts that do and do not fill their last page, groups smaller and larger
than a block, and more groups than blocks.
"""

import dataclasses
import functools

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rollout import Engine, EngineConfig, SamplingParams, Scheduler, generate
from tests.rollout import helpers as H

STOPS = (5, 11)
MAX_NEW = 24
# Below, at and across page boundaries (page size 4): 4, 8 and 16 share whole pages only,
# 1 and 3 share none.
PROMPT_LENGTHS = (1, 3, 4, 8, 9, 16, 17, 38)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_ids=STOPS)


@functools.lru_cache(maxsize=None)
def _prompts():
  return tuple(tuple(p) for p in H.prompts(np.random.default_rng(0), PROMPT_LENGTHS))


@functools.lru_cache(maxsize=None)
def _plain_and_dense():
  """Greedy completions from the engine without blocks, and from the dense decoder."""
  prompts = [list(p) for p in _prompts()]
  plain = generate(H.engine(), prompts, n=1, sampling=GREEDY)
  dense = generate_dense(H.model(), prompts, max_new_tokens=MAX_NEW, stop_ids=STOPS)
  return [s[0] for s in plain], dense


# 4 slots: blocks of 2 (2 blocks) or 4 (1 block). n=1 and n=2 < 4 leave block slots idle;
# n=3 > 2 spreads a prompt over two blocks, one of them half used. 8 groups queue for the
# blocks either way.
@pytest.mark.parametrize("group_slots,n", [(2, 3), (2, 1), (4, 2)])
def test_greedy_equals_plain_decode_and_dense_reference(group_slots, n):
  eng = H.engine(group_slots=group_slots)
  assert eng.cascade
  out = generate(eng, [list(p) for p in _prompts()], n=n, sampling=GREEDY)
  plain, dense = _plain_and_dense()
  reasons = set()
  for i, samples in enumerate(out):
    assert len(samples) == n
    for c in samples:
      assert c.tokens == plain[i].tokens and list(c.tokens) == dense.tokens[i], i
      assert c.finish_reason == plain[i].finish_reason == dense.finish_reasons[i]
      np.testing.assert_allclose(c.logprobs, plain[i].logprobs, atol=H.LOGPROB_TOL)
      np.testing.assert_allclose(c.logprobs, dense.logprobs[i], atol=H.LOGPROB_TOL)
      reasons.add(c.finish_reason)
  assert reasons == {"stop", "length"}
  assert eng.pages_in_use == 0 and eng.alloc.reserved == 0


def test_sampled_tokens_and_behaviour_logprobs_equal_plain_decode():
  prompts = H.prompts(np.random.default_rng(1), [2, 8, 19])
  sampling = SamplingParams(temperature=0.9, top_k=30, max_tokens=20, seed=3)
  on = generate(H.engine(group_slots=2), prompts, n=3, sampling=sampling)
  off = generate(H.engine(), prompts, n=3, sampling=sampling)
  assert [[c.tokens for c in s] for s in on] == [[c.tokens for c in s] for s in off]
  assert H.check_behaviour_logprobs(prompts, on, 0.9, top_k=30) == 3 * 3 * 20


def _record_inserts(eng) -> list:
  placed = []  # (prompt length, slots) of every bulk_insert, in order.
  insert = eng.bulk_insert
  eng.bulk_insert = lambda prefix, slots: (placed.append((len(prefix.prompt), list(slots))),
                                           insert(prefix, slots))[1]
  return placed


def test_a_group_waits_for_a_whole_free_block():
  """A free slot in a busy block is never given to another prompt."""
  rng = np.random.default_rng(2)
  long, pair = H.prompts(rng, [6, 10])
  eng = H.engine(group_slots=2)
  placed = _record_inserts(eng)
  sched = Scheduler(eng)
  sched.submit(long, SamplingParams(temperature=0.0, max_tokens=20), n=3, seed=0)
  sched.submit(pair, SamplingParams(temperature=0.0, max_tokens=8), n=2, seed=2)
  sched.step()  # long -> block 0 and slot 2 of block 1; slot 3 idles with it.
  assert len(sched.waiting) == 1  # pair found no whole free block: slot 3 is not one.
  idle = []
  while not sched.idle:
    sched.step()
    idle.append(sched.slots[3] is None)
  assert placed == [(6, [0, 1, 2]), (10, [0, 1])] and all(idle)
  assert eng.pages_in_use == 0 and eng.alloc.refcount[1:].max() == 0


def test_one_sample_prompts_fill_every_slot_of_a_block():
  """Greedy evaluation (n=1) shares no prompt pages, so its prompts share blocks: all four
  slots decode at once, and the tokens are the plain engine's."""
  rng = np.random.default_rng(5)
  prompts = H.prompts(rng, [3, 9, 5, 12, 7])
  sampling = SamplingParams(temperature=0.0, max_tokens=12)
  eng = H.engine(group_slots=2)
  placed = _record_inserts(eng)
  sched = Scheduler(eng)
  for i, p in enumerate(prompts):
    sched.submit(p, sampling, n=1, seed=i)
  sched.step()
  assert [slots for _, slots in placed] == [[0], [1], [2], [3]]
  results = sched.run()
  plain = generate(H.engine(), prompts, n=1, sampling=sampling)
  assert [results[i][0].tokens for i in range(5)] == [out[0].tokens for out in plain]
  assert eng.pages_in_use == 0 and not sched.solo_blocks


def test_a_block_holds_one_prompt():
  rng = np.random.default_rng(3)
  eng = H.engine(group_slots=2)
  sampling = SamplingParams(max_tokens=4)
  a, b = (eng.new_prefix(p, sampling, seed=0, sample_ids=[0, 1])
          for p in H.prompts(rng, [9, 9]))
  for p in (a, b):
    while not eng.prefill(p):
      pass
  eng.insert(a, 0)
  with pytest.raises(ValueError, match="another prompt"):
    eng.insert(b, 1)
  eng.bulk_insert(b, [2, 3])
  eng.insert(a, 1)  # The same prompt may join its block.
  for slot in range(4):
    eng.free_resource(slot)
  assert eng.pages_in_use == 0 and eng.alloc.reserved == 0


def test_attention_reads_count_the_shared_pages_once():
  prompt = H.prompts(np.random.default_rng(4), [10])[0]  # 2 whole pages + 2 tokens.
  eng = H.engine(group_slots=2)
  prefix = eng.new_prefix(prompt, SamplingParams(max_tokens=4), seed=0, sample_ids=[0, 1])
  while not eng.prefill(prefix):
    pass
  eng.bulk_insert(prefix, [0, 1])
  # The next step feeds position 10: 11 tokens = 3 pages per slot without cascade; with it,
  # 2 shared pages once plus 1 own page (tokens 8..10) per slot.
  assert eng.attention_reads() == (2 + 2 * 1, 2 * 3)
  assert H.engine().attention_reads() == (0, 0)


def test_sliding_window_models_keep_blocks_but_decode_plainly():
  cfg = dataclasses.replace(H.CFG, sliding_window=6)
  config = dataclasses.replace(H.ENGINE, group_slots=2)
  eng = Engine(cfg, params_of(H.model()), config)
  assert not eng.cascade and eng.group_slots == 2
  prompts = H.prompts(np.random.default_rng(5), [3, 9])
  greedy = SamplingParams(temperature=0.0, max_tokens=16)
  plain = generate(Engine(cfg, params_of(H.model()), H.ENGINE), prompts, n=2, sampling=greedy)
  blocked = generate(eng, prompts, n=2, sampling=greedy)
  assert [[c.tokens for c in s] for s in blocked] == [[c.tokens for c in s] for s in plain]


def test_group_slots_must_divide_num_slots():
  with pytest.raises(UserError, match=r"num_slots \(6\) must be a multiple of group_slots"):
    EngineConfig(num_slots=6, group_slots=4)
  with pytest.raises(UserError, match="group_slots must be >= 0"):
    EngineConfig(group_slots=-1)
  assert EngineConfig(num_slots=8, group_slots=8).group_slots == 8

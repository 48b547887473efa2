"""Hundreds of random requests through a pool too small for them all at once."""

import dataclasses

import numpy as np
import pytest

from jaxrl_post.models.decode import generate_dense
from jaxrl_post.rollout import SamplingParams, Scheduler, SchedulerConfig
from tests.rollout import helpers as H

STOPS = (3, 17)


# 0: independent slots. 2: blocks of 2 slots decoded with cascade attention, so groups of
# 1..3 samples leave block slots idle or spread over two blocks; fewer sequences then run
# at once, so a smaller pool keeps requests waiting for pages.
# Without group slots: the overlap test below covers it (group_slots 0 and 2).
@pytest.mark.parametrize("group_slots,num_pages", [
    pytest.param(0, H.NUM_PAGES, marks=pytest.mark.sweep), (2, H.NUM_PAGES // 2)])
def test_random_requests_all_finish_exactly_and_leak_no_pages(group_slots, num_pages):
  rng = np.random.default_rng(7)
  eng = H.engine(group_slots=group_slots,
                 pool=dataclasses.replace(H.ENGINE.pool, num_pages=num_pages))
  sched = Scheduler(eng)
  n_requests, max_new = 240, 40
  lengths = rng.integers(1, 41, size=n_requests)
  prompts = H.prompts(rng, lengths)
  max_tokens = rng.integers(1, max_new + 1, size=n_requests)
  samples = rng.integers(1, 4, size=n_requests)
  greedy = rng.random(n_requests) < 0.7  # The rest sample, sharing slots and pages with them.
  ids = []
  for i in range(n_requests):
    sp = SamplingParams(temperature=0.0 if greedy[i] else 1.0, top_p=0.9,
                        max_tokens=int(max_tokens[i]), stop_ids=STOPS)
    ids.append(sched.submit(prompts[i], sp, n=int(samples[i]), seed=i))
  most_committed = 0  # Pages in use or promised.
  while not sched.idle:
    sched.step()
    most_committed = max(most_committed, eng.alloc.usable - eng.alloc.available)
    assert eng.pages_in_use + eng.alloc.available + eng.alloc.reserved == eng.alloc.usable
  results = sched.run()

  # The pool ran out (requests waited for pages) and nothing leaked.
  assert sched.stats["admission_waits"] > 0 and most_committed > 0.8 * eng.alloc.usable
  assert eng.pages_in_use == 0 and eng.alloc.reserved == 0
  assert eng.alloc.refcount[1:].max() == 0
  # Every sample finished; greedy ones equal the dense reference, so no sequence's K/V was
  # ever overwritten by another's.
  ref = generate_dense(H.model(), prompts, max_new_tokens=max_new, stop_ids=STOPS)
  for i, rid in enumerate(ids):
    out = results[rid]
    assert len(out) == samples[i] and all(c is not None for c in out)
    for c in out:
      assert 1 <= len(c.tokens) <= max_tokens[i] and len(c.logprobs) == len(c.tokens)
      stopped = c.tokens[-1] in STOPS
      assert c.finish_reason == ("stop" if stopped else "length")
      assert stopped or len(c.tokens) == max_tokens[i]
      assert not any(t in STOPS for t in c.tokens[:-1])
      if greedy[i]:
        assert list(c.tokens) == ref.tokens[i][:max_tokens[i]], i


@pytest.mark.parametrize("group_slots", [0, 2])
def test_overlapped_decode_draws_the_same_samples_as_waiting_for_each_call(group_slots):
  """With overlap the next decode call is queued before the host reads the last one, and
  slots are refilled a call later; every sample, logprob and finish reason is the same."""
  rng = np.random.default_rng(11)
  n_requests = 40
  prompts = H.prompts(rng, rng.integers(1, 30, size=n_requests))
  max_tokens = rng.integers(1, 30, size=n_requests)
  results = {}
  for overlap in (False, True):
    eng = H.engine(group_slots=group_slots)
    sched = Scheduler(eng, SchedulerConfig(overlap=overlap))
    ids = [sched.submit(p, SamplingParams(temperature=1.0, max_tokens=int(m), stop_ids=STOPS),
                        n=2, seed=i) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    out = sched.run()
    assert eng.in_flight == 0 and eng.pages_in_use == 0 and eng.alloc.reserved == 0
    results[overlap] = [out[rid] for rid in ids]
  for want, got in zip(results[False], results[True]):
    for a, b in zip(want, got):
      assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
      np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=0, atol=H.LOGPROB_TOL)

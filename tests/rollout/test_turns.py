"""Multi-turn decoding: a trajectory's K/V stays in the pool between its turns."""

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rollout import SamplingParams, Scheduler, prefill_pack  # noqa: F401
from tests.rollout import helpers as H

STOPS = (5, 11)


def _turn(sched, submit):
  rid = submit()
  sched.run()
  return rid, sched.results[rid]


def _prefilled_tokens(monkeypatch):
  """Counts the prompt tokens every prefill call writes."""
  written = []
  pack = prefill_pack.pack

  def counting(chunks, **kw):
    written.append(sum(len(c.tokens) for c in chunks))
    return pack(chunks, **kw)

  monkeypatch.setattr(prefill_pack, "pack", counting)
  return written


@pytest.mark.parametrize("first_turn_tokens", [1, 6], ids=["ends_at_first_token", "decoded"])
def test_a_held_trajectory_continues_from_its_pages_and_equals_a_reprefilled_history(
    monkeypatch, first_turn_tokens):
  """Turn 1 draws 3 samples of a prompt and keeps their pages; each sample's turn 2 prefills
  only its last token and an observation after them. Its tokens and logprobs equal a fresh
  engine's on the whole history as one prompt, and the full forward's."""
  prompt = H.prompts(np.random.default_rng(7), [10])[0]
  eng, written = H.engine(), _prefilled_tokens(monkeypatch)
  sched = Scheduler(eng)
  first = SamplingParams(temperature=1.0, max_tokens=first_turn_tokens, seed=1)
  rid, turn1 = _turn(sched, lambda: sched.submit(prompt, first, n=3, seed=9, keep=True))
  held = [sched.held.pop((rid, j)) for j in range(3)]
  assert [h.length for h in held] == [len(prompt) + len(c.tokens) - 1 for c in turn1]
  pages_after_turn1 = [list(h.seq.pages) for h in held]
  assert all(eng.allocs[0].refcount[p] > 0 for pages in pages_after_turn1 for p in pages)

  second = SamplingParams(temperature=0.9, max_tokens=7, stop_ids=STOPS)
  observation = [3, 14, 15, 92]
  histories, continued = [], []
  for j, (c, h) in enumerate(zip(turn1, held)):
    history = prompt + list(c.tokens) + observation
    written.clear()
    rid2, (out,) = _turn(sched, lambda: sched.resume(h, history, second, seed=40 + j))
    assert written == [len(history) - h.length]  # The held history is not prefilled again.
    now = sched.held.pop((rid2, 0))
    kept = h.length // H.PAGE_SIZE  # Its whole pages are the same pages.
    assert now.seq.pages[:kept] == pages_after_turn1[j][:kept]
    assert now.length == len(history) + len(out.tokens) - 1
    histories.append(history)
    continued.append(out)
    sched.release(now)

  fresh = Scheduler(H.engine())
  for j, (history, out) in enumerate(zip(histories, continued)):
    _, (want,) = _turn(fresh, lambda: fresh.submit(history, second, seed=40 + j))
    assert out.tokens == want.tokens and out.finish_reason == want.finish_reason
    np.testing.assert_allclose(out.logprobs, want.logprobs, atol=H.LOGPROB_TOL)
  assert H.check_behaviour_logprobs(histories, [[c] for c in continued], 0.9) > 0
  assert eng.pages_in_use == 0  # Released trajectories leave nothing behind.


def test_turns_of_many_trajectories_interleave_on_the_slots():
  """More trajectories than slots, each continued twice, over one scheduler: every last
  turn's logprobs are the full forward's over its history, and no page leaks."""
  rng = np.random.default_rng(3)
  prompts = H.prompts(rng, [5, 9, 3, 7])  # 8 trajectories of <= 7 pages: they fit
  eng = H.engine()
  sched = Scheduler(eng)
  sampling = SamplingParams(temperature=1.0, max_tokens=5, stop_ids=STOPS)
  rids = {sched.submit(p, sampling, n=2, seed=i, keep=True): p for i, p in enumerate(prompts)}
  histories = {}
  for _ in range(2):  # Two more turns, queued as earlier turns finish.
    sched.run()
    nxt = {}
    for (rid, j), h in list(sched.held.items()):
      del sched.held[(rid, j)]
      c = sched.results[rid][j]
      history = histories.get((rid, j), rids.get(rid)) + list(c.tokens) + [7, 8]
      new = sched.resume(h, history, sampling, seed=100 + rid * 2 + j)
      nxt[new] = history
      histories[(new, 0)] = history
    rids = nxt
  sched.run()
  for rid in rids:
    sched.release(sched.held.pop((rid, 0)))
  assert H.check_behaviour_logprobs(list(rids.values()),
                                    [[sched.results[r][0]] for r in rids], 1.0) > 0
  assert eng.pages_in_use == 0


def test_a_pool_full_of_held_samples_is_a_user_error_not_a_hang():
  sched = Scheduler(H.engine())
  sampling = SamplingParams(temperature=1.0, max_tokens=40, seed=2)
  prompt = H.prompts(np.random.default_rng(5), [60])[0]
  sched.submit(prompt, sampling, n=1, keep=True)  # 25 of the pool's 63 pages, held
  sched.submit(prompt, sampling, n=1, keep=True)
  sched.run()
  sched.submit(prompt, sampling, n=1)
  with pytest.raises(UserError, match="hold their pages"):
    sched.run()


def test_samples_that_end_at_their_first_token_keep_pages_of_their_own():
  """Some samples of a group end at their first token (a stop id) and are held; the
  prompt's partial page is copied for them, so the pool's promise to the others holds."""
  prompt = H.prompts(np.random.default_rng(11), [6])[0]  # A partial second page.
  eng = H.engine()
  sched = Scheduler(eng)
  # At this temperature these 8 first tokens (the likeliest) have 41% of the mass.
  first = H.completion_logits(prompt, [0])[0]
  stops = tuple(int(t) for t in np.argsort(-first)[:8])
  sampling = SamplingParams(temperature=0.1, max_tokens=5, stop_ids=stops)
  rid = sched.submit(prompt, sampling, n=8, seed=3, keep=True)
  sched.run()
  lengths = [len(c.tokens) for c in sched.results[rid]]
  assert 1 in lengths and max(lengths) > 1, lengths
  tails = [sched.held[(rid, j)].seq.pages[1] for j in range(8)]
  assert len(set(tails)) == 8  # Every held partial page is a sample's own.
  for j in range(8):
    sched.release(sched.held.pop((rid, j)))
  assert eng.pages_in_use == 0

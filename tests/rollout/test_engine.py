"""The engine against the dense-cache reference decoder and a full forward."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.transformer import init_model, params_of
from jaxrl_post.rollout import (Engine, EngineConfig, PoolConfig, Request, SamplingParams,
                                Scheduler, SchedulerConfig, generate)
from jaxrl_post.rollout.engine import MAX_SLOTS
from jaxrl_post.rollout.pages import sequences_held
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.rollout.pages import resolve_num_pages
from tests.rollout import helpers as H
from tests.tpu import tpu_mesh

LOGPROB_TOL = H.LOGPROB_TOL
STOPS = (5, 11)


def test_greedy_matches_dense_reference_token_for_token():
  rng = np.random.default_rng(0)
  # Lengths below, at and across page and chunk boundaries (page 4, chunk 16).
  prompts = H.prompts(rng, [1, 3, 4, 9, 16, 17, 38])
  sampling = SamplingParams(temperature=0.0, max_tokens=24, stop_ids=STOPS)
  out = generate(H.engine(), prompts, n=3, sampling=sampling)
  ref = generate_dense(H.model(), prompts, max_new_tokens=24, stop_ids=STOPS)
  reasons = set()
  for i, samples in enumerate(out):
    assert len(samples) == 3
    for c in samples:
      assert list(c.tokens) == ref.tokens[i], i
      assert c.finish_reason == ref.finish_reasons[i]
      np.testing.assert_allclose(c.logprobs, ref.logprobs[i], atol=LOGPROB_TOL)
      reasons.add(c.finish_reason)
  assert reasons == {"stop", "length"}  # Both ways of finishing were exercised.


def test_temperature_logprobs_equal_full_forward():
  prompts = H.prompts(np.random.default_rng(1), [2, 7, 19])
  sampling = SamplingParams(temperature=0.7, max_tokens=20, seed=3)
  out = generate(H.engine(), prompts, n=2, sampling=sampling)
  assert H.check_behaviour_logprobs(prompts, out, 0.7) == 3 * 2 * 20
  assert len({c.tokens for s in out for c in s}) == 6  # Samples differ from each other.


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (12, 0.6)])
def test_truncated_logprobs_equal_the_renormalised_distribution(top_k, top_p):
  prompts = H.prompts(np.random.default_rng(2), [5, 13])
  sampling = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, max_tokens=16, seed=4)
  out = generate(H.engine(), prompts, n=2, sampling=sampling)
  H.check_behaviour_logprobs(prompts, out, 1.3, top_k, top_p)


def test_a_requests_tokens_do_not_depend_on_the_batch():
  rng = np.random.default_rng(3)
  target, others = H.prompts(rng, [9]), H.prompts(rng, [3, 14, 6, 21, 8])
  sampling = SamplingParams(temperature=1.0, top_k=20, max_tokens=20)
  request = Request(tuple(target[0]), seed=1234)
  alone = generate(H.engine(), [request], n=2, sampling=sampling)[0]
  # Last, so it lands in other slots, next to sequences of every length.
  crowd = generate(H.engine(), [*others, request], n=2, sampling=sampling)[-1]
  assert [c.tokens for c in alone] == [c.tokens for c in crowd]
  np.testing.assert_allclose([c.logprobs for c in alone], [c.logprobs for c in crowd],
                             atol=LOGPROB_TOL)
  other_seed = generate(H.engine(), [Request(tuple(target[0]), seed=99)], n=2,
                        sampling=sampling)[0]
  assert [c.tokens for c in other_seed] != [c.tokens for c in alone]


def test_long_prompt_is_prefilled_in_chunks_between_decode_calls():
  rng = np.random.default_rng(4)
  short, long = H.prompts(rng, [3, 60])  # 60 tokens = 4 chunks of 16.
  eng = H.engine()
  sched = Scheduler(eng, SchedulerConfig(prefill_tokens_per_step=16))
  greedy = SamplingParams(temperature=0.0, max_tokens=60)
  sched.submit(short, greedy, seed=0)
  sched.step()  # Nothing decodes yet: prefill the short prompt, insert it, decode.
  sched.submit(long, greedy, seed=0)
  progress = []
  while not sched.ready and not any(r is not None and r.rid == 1 for r in sched.slots):
    sched.step()
    running = next(r for r in sched.slots if r is not None and r.rid == 0)
    progress.append(len(running.tokens))
  # One chunk per step while the short request decodes, its tokens growing every step.
  assert len(progress) == 4 and all(a < b for a, b in zip(progress, progress[1:]))
  results = sched.run()
  ref = generate_dense(H.model(), [short, long], max_new_tokens=60)
  assert [list(r[0].tokens) for r in (results[0], results[1])] == ref.tokens


def test_prompts_prefill_together_and_the_device_keeps_the_slot_state(monkeypatch):
  """Eight prompts prefill in two calls of four rows (prefill_rows = 4), their samples'
  first tokens come back in one fetch per call, and decoding reads back only new tokens:
  no other device-to-host read anywhere (transfer guard), and the tokens are the dense
  reference's."""
  rng = np.random.default_rng(8)
  prompts = H.prompts(rng, [3, 9, 5, 12, 7, 4, 16, 2])
  greedy = SamplingParams(temperature=0.0, max_tokens=10)
  generate(H.engine(prefill_rows=4, num_slots=8), prompts[:1], sampling=greedy)  # Compiles.
  eng = H.engine(prefill_rows=4, num_slots=8)
  fetches = []
  get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: (fetches.append(1), get(x))[1])
  sched = Scheduler(eng)
  for i, p in enumerate(prompts):
    sched.submit(p, greedy, n=1, seed=i)
  with jax.transfer_guard_device_to_host("disallow"):
    sched.step()
    assert sched.stats["prefill_calls"] == 2 and sched.stats["prefill_chunks"] == 8
    assert len(fetches) == 3  # First tokens of each prefill call, then one decode call.
    results = sched.run()
  assert len(fetches) == 3 + sched.stats["decode_calls"] - 1
  ref = generate_dense(H.model(), prompts, max_new_tokens=10)
  assert [list(results[i][0].tokens) for i in range(8)] == ref.tokens
  assert eng.pages_in_use == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_weight_swap_between_calls_stamps_versions(overlap):
  prompt = H.prompts(np.random.default_rng(5), [6])[0]
  greedy = SamplingParams(temperature=0.0, max_tokens=30)
  new = params_of(init_model(H.CFG, seed=2))

  def run(swap):
    eng = H.engine(version=7)
    sched = Scheduler(eng, SchedulerConfig(overlap=overlap))
    sched.submit(prompt, greedy, seed=0)
    sched.step()
    if swap:
      eng.set_weights(new, version=8)
    return sched.run()[0][0]

  kept, swapped = run(False), run(True)
  # The first token comes from prefill, then one call; with overlap a second call was
  # already launched, and it keeps the weights it was launched with.
  first = 1 + (2 if overlap else 1) * H.ENGINE.decode_steps
  assert swapped.versions == (7,) * first + (8,) * (30 - first)
  assert swapped.weight_version == 7 and set(kept.versions) == {7}
  # The swapped-in weights are the ones decoding from the next call on.
  assert swapped.tokens[:first] == kept.tokens[:first]
  assert swapped.tokens[first:] != kept.tokens[first:]
  with pytest.raises(UserError, match="parameter tree"):
    H.engine().set_weights({"embed": new["embed"]}, version=9)


def test_requests_the_engine_cannot_serve_are_user_errors():
  eng = H.engine()
  with pytest.raises(UserError, match="exceeds the model's context of 128 tokens"):
    generate(eng, [[1] * 100], sampling=SamplingParams(max_tokens=40))
  with pytest.raises(UserError, match="empty"):
    generate(eng, [[]])
  with pytest.raises(UserError, match="token ids"):
    generate(eng, [[H.CFG.vocab_size]])
  with pytest.raises(UserError, match="top_p"):
    SamplingParams(top_p=0.0)


def test_overlap_is_on_for_accelerators_and_off_on_a_cpu_by_default():
  cpu = RolloutLayout.build(H.CFG).mesh
  tpu = tpu_mesh("v5e:2x2")
  assert SchedulerConfig().overlaps(cpu) is False  # The mesh's devices decide, not the host.
  assert SchedulerConfig().overlaps(tpu) is True
  assert SchedulerConfig(overlap=True).overlaps(cpu) is True
  assert SchedulerConfig(overlap=False).overlaps(tpu) is False


def _peak_live(eng, prompts, n, sampling):
  """Most sequences decoding at once while generating n samples of each prompt."""
  sched, peak = Scheduler(eng), 0
  for i, p in enumerate(prompts):
    sched.submit(p, sampling, n=n, seed=i)
  while not sched.idle:
    sched.step()
    peak = max(peak, sum(s is not None for s in sched.slots))
  return peak


def test_a_default_config_sized_for_the_work_decodes_it_all_at_once():
  """EngineConfig() sized for 40 prompts x 2 samples: all 80 decode together in the
  default CPU pool; an explicit num_slots is kept as given."""
  prompts = H.prompts(np.random.default_rng(3), [5 + i % 11 for i in range(40)])
  sampling = SamplingParams(temperature=1.0, max_tokens=100)
  default = EngineConfig(max_seq_len=128)
  budget = resolve_num_pages(default.pool, H.CFG, H.CFG.compute_dtype)
  assert sequences_held(budget, 128 // default.pool.page_size) >= 80  # Nothing caps it.
  eng = Engine.from_model(H.model(), default.sized_for(40 * 2, capacity=MAX_SLOTS))
  assert eng.num_slots == 80
  assert _peak_live(eng, prompts, 2, sampling) == 80
  explicit = dataclasses.replace(default, num_slots=8)
  assert explicit.sized_for(80) is explicit
  assert _peak_live(Engine.from_model(H.model(), explicit), prompts[:8], 2, sampling) == 8


def test_unsized_slots_follow_the_pool_and_bad_values_are_user_errors():
  # 8 pages of 4 tokens per sequence of 32: a pool of 8 * 20 + 1 pages holds 20 of them.
  pool = PoolConfig(page_size=4, num_pages=8 * 20 + 1)
  assert H.engine(num_slots=None, max_seq_len=32, pool=pool).num_slots == 20
  small = PoolConfig(page_size=4, num_pages=17)  # Two sequences: the floor of 8 slots.
  assert H.engine(num_slots=None, max_seq_len=32, pool=small).num_slots == 8
  assert EngineConfig(group_slots=4).sized_for(10).num_slots == 12  # Whole blocks.
  assert EngineConfig().sized_for(1000, capacity=300).num_slots == 300
  with pytest.raises(UserError, match="num_slots must be >= 1, got 0"):
    EngineConfig(num_slots=0)
  with pytest.raises(UserError, match="needs >= 1 sequence"):
    EngineConfig().sized_for(0)

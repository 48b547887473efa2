"""Decode steps over the live slots only (rollout.compact) and the engine with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rollout import SamplingParams, generate
from jaxrl_post.rollout import compact
from jaxrl_post.rollout import programs
from jaxrl_post.rollout.compact import widths
from tests.rollout import helpers as H


def test_widths_are_evenly_spaced_up_to_every_row():
  assert widths(96, 4) == (24, 48, 72, 96)
  assert widths(6, 4) == (2, 3, 5, 6)
  assert widths(2, 4) == (1, 2)
  assert widths(5, 1) == (5,)


@pytest.mark.parametrize("live", [[0, 3, 6, 7], [1], [0, 1, 2, 3, 4, 5, 6, 7], []])
def test_a_call_sees_each_shards_live_rows_and_results_return_to_their_slots(live):
  shards = 2  # 8 slots: 4 per shard, widths 1..4.
  active = np.isin(np.arange(8), live)
  per_shard = [active[:4].sum(), active[4:].sum()]
  width = compact.call_width(active, shards, 4)
  if max(per_shard) == 4:
    assert width is None  # Every row: the call gathers nothing.
    return
  assert width == max(1, max(per_shard))  # The narrowest width that holds them.

  @jax.jit
  def call(rows, active):
    order = compact.live_first(active, shards)
    part = compact.take(rows, order, width)
    return part, compact.put(rows, {"slot": part["slot"] * 10 + 1}, order)

  slots = jnp.arange(8)
  part, out = call({"slot": slots}, jnp.asarray(active))
  got = np.asarray(part["slot"])
  assert len(got) == 2 * width
  for s in range(2):  # Each shard's live rows first, in slot order, from its own slots.
    mine = got[s * width:(s + 1) * width]
    assert np.all((mine >= 4 * s) & (mine < 4 * s + 4))
    np.testing.assert_array_equal(mine[:per_shard[s]], np.flatnonzero(active[4 * s:4 * s + 4])
                                  + 4 * s)
  # Rows the call took come back changed, in their own slots; the others as they were.
  want = np.where(np.isin(np.arange(8), got), np.arange(8) * 10 + 1, np.arange(8))
  np.testing.assert_array_equal(np.asarray(out["slot"]), want)


def test_a_call_runs_at_the_width_of_its_live_slots_one_program_per_width(monkeypatch):
  seen = []
  real = compact.call_width
  monkeypatch.setattr(compact, "call_width", lambda *a: seen.append(real(*a)) or seen[-1])
  engine = H.engine(num_slots=8, decode_buckets=4)  # Widths 2, 4, 6, 8.
  sampling = SamplingParams(temperature=0.0, max_tokens=9)
  prompts = H.prompts(np.random.default_rng(1), [3, 4, 5, 6, 7, 8, 9, 10])
  before = programs.decode_program(engine.layout)._cache_size()
  generate(engine, prompts[:1], sampling=sampling)
  assert seen and set(seen) == {2}  # One live slot: the narrowest width, every call.
  assert programs.decode_program(engine.layout)._cache_size() <= before + 1
  seen.clear()
  generate(engine, prompts, sampling=sampling)
  assert None in seen  # Every slot live at some call: all rows, no gather.


def test_sampled_tokens_and_logprobs_do_not_depend_on_the_widths():
  rng = np.random.default_rng(5)
  # Lengths and stop ids that finish rows at different steps of a call.
  prompts = H.prompts(rng, [2, 5, 9, 14, 3, 20])
  sampling = SamplingParams(temperature=1.0, max_tokens=13, stop_ids=(5, 11), seed=2)
  runs = [generate(H.engine(num_slots=6, decode_buckets=b), prompts, n=2, sampling=sampling)
          for b in (1, 3)]
  lengths = {len(c.tokens) for s in runs[0] for c in s}
  assert len(lengths) > 2  # Rows did finish at different steps.
  for a, b in zip(*runs):
    for ca, cb in zip(a, b):
      assert ca.tokens == cb.tokens
      np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=H.LOGPROB_TOL)

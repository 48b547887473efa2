"""Decode steps over the live slots only (rollout.compact) and the engine with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rollout import SamplingParams, generate
from jaxrl_post.rollout.compact import live_rows_step, widths
from tests.rollout import helpers as H


def test_widths_are_evenly_spaced_up_to_every_row():
  assert widths(96, 4) == (24, 48, 72, 96)
  assert widths(6, 4) == (2, 3, 5, 6)
  assert widths(2, 4) == (1, 2)
  assert widths(5, 1) == (5,)


@pytest.mark.parametrize("live", [[0, 3, 6, 7], [1], [0, 1, 2, 3, 4, 5, 6, 7], []])
def test_the_step_sees_each_shards_live_rows_and_results_return_to_their_slots(live):
  shards, sizes = 2, widths(4, 4)  # 8 slots: 4 per shard, widths 1..4.
  active = np.isin(np.arange(8), live)
  seen = []

  def step(pool, rows):
    jax.debug.callback(lambda r: seen.append(np.asarray(r)), rows["slot"])
    return pool + 1, {"out": rows["slot"] * 10 + rows["active"]}

  rows = {"slot": jnp.arange(8), "active": jnp.asarray(active)}
  pool, out = jax.jit(lambda p, r, a: live_rows_step(step, p, r, a, shards, sizes))(
      jnp.int32(0), rows, jnp.asarray(active))
  assert int(pool) == 1
  per_shard = [active[:4].sum(), active[4:].sum()]
  width = min(w for w in sizes if w >= max(per_shard))
  (got,) = seen
  assert len(got) == 2 * width  # The narrowest width that holds every shard's live rows.
  for s in range(2):  # Each shard's live rows first, in slot order, from its own slots.
    mine = got[s * width:(s + 1) * width]
    assert np.all((mine >= 4 * s) & (mine < 4 * s + 4))
    np.testing.assert_array_equal(mine[:per_shard[s]], np.flatnonzero(active[4 * s:4 * s + 4])
                                  + 4 * s)
  want = np.where(np.isin(np.arange(8), got), np.arange(8) * 10 + active, 0)
  np.testing.assert_array_equal(np.asarray(out["out"]), want)


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

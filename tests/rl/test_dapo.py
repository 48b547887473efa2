"""DAPO dynamic sampling (keep mask, host-side refilling) and the overlong penalty."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rl import (DynamicSamplingConfig, GroupRefill, OverlongConfig, group_keep_mask,
                           overlong_penalty)


def test_keep_mask():
  rewards = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5000001]], np.float32)
  want = [False, True, False, True]
  np.testing.assert_array_equal(group_keep_mask(rewards), want)
  np.testing.assert_array_equal(group_keep_mask(jnp.asarray(rewards)), want)


def rollout(first_id, rewards, t=5):
  """A fake rollout batch: per-sample ids and token arrays for G groups of K samples."""
  g, k = rewards.shape
  ids = np.arange(first_id, first_id + g * k)
  return {"id": ids, "tokens": np.repeat(ids[:, None], t, axis=1)}, rewards


def test_refill_accumulates_kept_groups_in_order():
  refill = GroupRefill(DynamicSamplingConfig(target_groups=3, group_size=2))
  assert refill.add(*rollout(0, np.array([[1, 1], [0, 1]]))) == 1  # keeps ids 2, 3
  assert not refill.full
  assert refill.add(*rollout(4, np.array([[0, 0], [1, 0]]))) == 1  # keeps 6, 7
  assert refill.add(*rollout(8, np.array([[0, 1], [1, 0]]))) == 2  # keeps 8..11; one surplus
  assert refill.full
  out = refill.take()
  np.testing.assert_array_equal(out["id"], [2, 3, 6, 7, 8, 9])
  np.testing.assert_array_equal(out["tokens"][:, 0], out["id"])
  assert refill.stats() == {"batches": 0.0, "kept_frac": 0.0}  # reset for the next step
  with pytest.raises(ValueError):
    refill.take()


def test_refill_gives_up_after_max_batches():
  refill = GroupRefill(DynamicSamplingConfig(target_groups=2, group_size=2, max_batches=2))
  refill.add(*rollout(0, np.array([[1, 1], [0, 1]])))
  with pytest.raises(UserError, match="max_batches=2"):
    refill.add(*rollout(4, np.array([[1, 1], [0, 0]])))


def test_refill_rejects_mismatched_shapes():
  refill = GroupRefill(DynamicSamplingConfig(target_groups=2, group_size=2))
  batch, _ = rollout(0, np.zeros((2, 2)))
  with pytest.raises(ValueError):
    refill.add(batch, np.zeros((1, 4)))


def test_overlong_penalty_matches_definition():
  cfg = OverlongConfig(max_length=20, buffer=8, factor=0.5)
  lengths = np.arange(0, 25)
  want = []
  for n in lengths:  # DAPO eq. 13, written out
    if n <= 12:
      want.append(0.0)
    elif n <= 20:
      want.append(0.5 * (12 - n) / 8)
    else:
      want.append(-0.5)
  np.testing.assert_allclose(overlong_penalty(jnp.asarray(lengths), cfg), want, rtol=1e-6,
                             atol=1e-7)
  assert float(overlong_penalty(jnp.asarray([20]), cfg)[0]) == -0.5  # truncated: full penalty

"""DAPO's keep mask and overlong penalty (the refilling: tests/pipeline/test_algorithms.py)."""

import jax.numpy as jnp
import numpy as np

from jaxrl_post.rl import OverlongConfig, group_keep_mask, overlong_penalty


def test_keep_mask():
  rewards = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5000001]], np.float32)
  want = [False, True, False, True]
  np.testing.assert_array_equal(group_keep_mask(rewards), want)
  np.testing.assert_array_equal(group_keep_mask(jnp.asarray(rewards)), want)


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

"""Shared test batches: ragged masks with prefix, gap and empty rows, garbage at padding."""

import numpy as np

# Fixed float32 tolerances against float64 loop references: float32 rounding of the inputs'
# arithmetic only. Never loosened to make a test pass.
RTOL, ATOL = 1e-5, 1e-6

B, T, K = 8, 12, 4


def response_mask():
  """[B, T] masks covering the layouts the trainer sees."""
  mask = np.zeros((B, T), np.float32)
  spans = [(0, 12), (2, 9), (0, 1), (4, 12), (1, 6), (0, 7), (3, 11), (0, 0)]
  for b, (start, stop) in enumerate(spans):
    mask[b, start:stop] = 1.0
  mask[0, 5:7] = 0.0  # a masked span inside a row (multi-turn tool output)
  return mask  # row 7 is empty: all padding


def with_garbage(x, mask, value):
  """Padding holds junk the code must never read: inf/NaN/huge, never silently zero."""
  return np.where(mask > 0, x, value).astype(np.float32)


def batch(seed=0, spread=0.35, seq_advantages=False):
  """Policy-loss inputs; ratios exp(lp - old) straddle typical clip bounds."""
  rng = np.random.default_rng(seed)
  mask = response_mask()
  lp = rng.uniform(-4.0, -0.05, (B, T))
  old = lp + rng.normal(0.0, spread, (B, T))
  ref = lp + rng.normal(0.0, 0.3, (B, T))
  behaviour = old + rng.normal(0.0, 0.15, (B, T))
  adv = rng.normal(0.0, 1.0, (B, T))
  if seq_advantages:
    adv = np.repeat(rng.normal(0.0, 1.0, (B, 1)), T, axis=1)
  return {
      "mask": mask,
      "logprobs": with_garbage(lp, mask, 1e4),
      "old_logprobs": with_garbage(old, mask, -np.inf),
      "ref_logprobs": with_garbage(ref, mask, np.nan),
      "behaviour_logprobs": with_garbage(behaviour, mask, -1e4),
      "advantages": with_garbage(adv, mask, np.nan),
      "entropy": with_garbage(rng.uniform(0.0, 3.0, (B, T)), mask, np.inf),
      "is_weights": with_garbage(rng.uniform(0.5, 1.5, (B, T)), mask, np.nan),
  }


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=rtol, atol=atol)

"""Truncated importance sampling and sequence masking against NumPy loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rl import OffPolicyConfig, off_policy_correction
from tests.rl import reference as ref
from tests.rl.helpers import assert_close, batch


def reference(old, behaviour, mask, cfg):
  """(weights, mask, truncated fraction, dropped fraction) by loops."""
  b_count = mask.shape[0]
  keep = np.ones(b_count, bool)
  for b in range(b_count):
    pos = ref.valid_positions(mask, b)
    ratios = [math.exp(float(old[b, t]) - float(behaviour[b, t])) for t in pos]
    if not pos or cfg.seq_mask == "none":
      continue
    if cfg.seq_mask == "geometric":
      centre = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
      keep[b] = cfg.seq_low <= centre <= cfg.seq_high
    else:
      keep[b] = all(cfg.seq_low <= r <= cfg.seq_high for r in ratios)
  weights, new_mask = np.zeros(mask.shape), np.zeros(mask.shape)
  truncated, tokens = 0, 0
  for b in range(b_count):
    for t in ref.valid_positions(mask, b):
      r = math.exp(float(old[b, t]) - float(behaviour[b, t]))
      truncated, tokens = truncated + (r > cfg.tis_cap), tokens + 1
      if keep[b]:
        weights[b, t], new_mask[b, t] = min(r, cfg.tis_cap), 1.0
  nonempty = [b for b in range(b_count) if ref.valid_positions(mask, b)]
  dropped = sum(1 for b in nonempty if not keep[b]) / len(nonempty)
  return weights, new_mask, truncated / tokens, dropped


@pytest.mark.parametrize("seq_mask", ["none", "geometric", "max"])
def test_matches_reference(seq_mask):
  data = batch(seed=21, spread=0.3)
  # A behaviour policy far from the trainer's in some rows, so masks and caps engage.
  old = data["old_logprobs"]
  behaviour = data["behaviour_logprobs"] + np.float32(0.5) * (np.arange(8)[:, None] % 3 == 0)
  cfg = OffPolicyConfig(tis_cap=1.1, seq_mask=seq_mask, seq_low=0.8, seq_high=1.25)
  weights, mask, metrics = off_policy_correction(jnp.asarray(old), jnp.asarray(behaviour),
                                                 data["mask"], cfg)
  want_w, want_mask, truncated, dropped = reference(old, behaviour, data["mask"], cfg)
  assert 0 < truncated < 1
  assert (dropped > 0) == (seq_mask != "none")
  assert_close(weights, want_w)
  np.testing.assert_array_equal(mask, want_mask)
  assert_close(metrics["tis_truncated_frac"], truncated)
  assert_close(metrics["seq_dropped_frac"], dropped)
  assert_close(metrics["is_weight_mean"], want_w[want_mask > 0].mean())


def test_modes_differ():
  """One token far off in an otherwise matching row: "max" drops it, "geometric" keeps it
  (its geometric mean e^0.25 = 1.28 is in bounds, the arithmetic mean 1.80 would not be)."""
  mask = np.ones((1, 8), np.float32)
  old = np.full((1, 8), -1.0, np.float32)
  behaviour = old.copy()
  behaviour[0, 3] = -3.0  # ratio e^2 at one token
  kept = {}
  for mode in ("geometric", "max"):
    _, new_mask, _ = off_policy_correction(old, behaviour, mask, OffPolicyConfig(
        seq_mask=mode, seq_low=0.5, seq_high=1.5))
    kept[mode] = float(np.asarray(new_mask).sum())
  assert kept == {"geometric": 8.0, "max": 0.0}


def test_weights_are_constants():
  data = batch(seed=22)
  grad = jax.grad(lambda old: jnp.sum(off_policy_correction(
      old, data["behaviour_logprobs"], data["mask"], OffPolicyConfig())[0]))(
          jnp.asarray(data["old_logprobs"]))
  assert float(jnp.abs(grad).max()) == 0.0

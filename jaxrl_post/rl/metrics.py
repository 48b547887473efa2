"""Canary metrics of an RL step, as pure functions over padded arrays.

These are the numbers that tell a healthy run from a broken one before the reward curve
does: importance ratios drifting from 1, clip fractions creeping up, the rollout engine's
logprobs disagreeing with the trainer's, advantage collapse, length blow-ups. All reduce
over valid tokens only; padding never reaches a statistic. Each returns float32 scalars
(or a small fixed-size array), cheap enough to compute every step inside the jitted step.
Statistics of an empty selection are NaN (quantiles, min/max, correlation) or 0 (means).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxrl_post.rl.kl import kl_estimate
from jaxrl_post.rl.masked import F32, masked_count, masked_mean, masked_var, sequence_lengths

DEFAULT_QUANTILES = (0.01, 0.5, 0.99)


def masked_quantiles(x: jax.Array, mask: jax.Array,
                     qs: Sequence[float] = DEFAULT_QUANTILES) -> jax.Array:  # -> [len(qs)]
  """Quantiles of the valid entries, with NumPy's default linear interpolation.

  Padding is pushed to the end of one sort (as +inf) and the interpolation only indexes the
  first n = count(valid) sorted entries.
  """
  m = mask.astype(bool).reshape(-1)
  ordered = jnp.sort(jnp.where(m, x.astype(F32).reshape(-1), jnp.inf))
  n = jnp.sum(m.astype(jnp.int32))
  pos = jnp.asarray(qs, F32) * (jnp.maximum(n, 1) - 1).astype(F32)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  a, b = ordered[lo], ordered[hi]
  value = a + (b - a) * (pos - lo.astype(F32))
  return jnp.where(n > 0, value, jnp.nan)


def masked_histogram(x: jax.Array, mask: jax.Array, lo: float, hi: float,
                     bins: int) -> jax.Array:  # -> [bins] float32 counts
  """Counts of valid entries in `bins` equal bins over [lo, hi).

  Entries below lo count in the first bin and entries at or above hi in the last, so the
  counts always sum to the number of valid entries and outliers stay visible.
  """
  m = mask.astype(bool).reshape(-1)
  scaled = (x.astype(F32).reshape(-1) - lo) * (bins / (hi - lo))
  index = jnp.clip(jnp.floor(jnp.nan_to_num(scaled)), 0, bins - 1).astype(jnp.int32)
  return jnp.zeros((bins,), F32).at[index].add(m.astype(F32))


def ratio_canaries(ratio: jax.Array, mask: jax.Array,
                   qs: Sequence[float] = DEFAULT_QUANTILES) -> dict:
  """{"ratio/pXX": quantile} of the importance ratio over valid tokens."""
  values = masked_quantiles(ratio, mask, qs)
  return {f"ratio/p{100 * q:g}": values[i] for i, q in enumerate(qs)}


def clip_fractions(clip_low: jax.Array, clip_high: jax.Array, mask: jax.Array) -> dict:
  """Fractions of valid tokens where each clip bound was active (indicators from a loss)."""
  return {"clip_frac_low": masked_mean(clip_low.astype(F32), mask),
          "clip_frac_high": masked_mean(clip_high.astype(F32), mask)}


def behaviour_kl(logprobs: jax.Array, behaviour_logprobs: jax.Array,
                 mask: jax.Array) -> jax.Array:
  """k3 estimate of KL(behaviour || current) from the rollout's own samples."""
  return masked_mean(kl_estimate(behaviour_logprobs, logprobs, mask, "k3"), mask)


def reference_kl(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array,
                 estimator: str = "k3") -> jax.Array:
  """Token-mean estimate of KL(policy || reference)."""
  return masked_mean(kl_estimate(logprobs, ref_logprobs, mask, estimator), mask)


def mean_entropy(entropy: jax.Array, mask: jax.Array) -> jax.Array:
  return masked_mean(entropy.astype(F32), mask)


def logprob_mismatch(logprobs: jax.Array, behaviour_logprobs: jax.Array,
                     mask: jax.Array) -> dict:
  """How far the rollout engine's logprobs are from the trainer's on the same tokens.

  "mismatch/abs_mean" and "mismatch/abs_max" of |lp - behaviour lp|, and "mismatch/prob_corr",
  the Pearson correlation of the two probabilities: a kernel or precision bug shows as a
  correlation visibly below 1 long before the loss diverges.
  """
  m = mask.astype(bool)
  lp = jnp.where(m, logprobs.astype(F32), 0.0)
  beh = jnp.where(m, behaviour_logprobs.astype(F32), 0.0)
  diff = jnp.abs(lp - beh)
  n = masked_count(m)
  p, q = jnp.exp(lp), jnp.exp(beh)
  dp, dq = p - masked_mean(p, m), q - masked_mean(q, m)
  cov = masked_mean(dp * dq, m)
  scale = jnp.sqrt(masked_mean(dp * dp, m) * masked_mean(dq * dq, m))
  return {"mismatch/abs_mean": masked_mean(diff, m),
          "mismatch/abs_max": jnp.where(n > 0, jnp.max(jnp.where(m, diff, 0.0)), jnp.nan),
          "mismatch/prob_corr": jnp.where(scale > 0, cov / jnp.where(scale > 0, scale, 1.0),
                                          jnp.nan)}


def effective_sample_size(weights: jax.Array, mask: jax.Array) -> jax.Array:
  """Normalised ESS (sum w)^2 / (n sum w^2) in (0, 1] over valid tokens; 1 = uniform weights.

  A falling ESS means a few tokens carry the importance-weighted gradient.
  """
  m = mask.astype(bool)
  w = jnp.where(m, weights.astype(F32), 0.0)
  total, squares = jnp.sum(w), jnp.sum(w * w)
  return jnp.where(squares > 0, total * total / (masked_count(m) * jnp.maximum(squares, 1e-30)),
                   jnp.nan)


def _min_max(x, mask, prefix):
  m = mask.astype(bool)
  any_valid = jnp.any(m)
  low = jnp.min(jnp.where(m, x, jnp.inf))
  high = jnp.max(jnp.where(m, x, -jnp.inf))
  return {f"{prefix}/min": jnp.where(any_valid, low, jnp.nan),
          f"{prefix}/max": jnp.where(any_valid, high, jnp.nan)}


def advantage_stats(advantages: jax.Array, mask: jax.Array) -> dict:
  """Mean, population std, min and max of the advantages over valid tokens."""
  adv = jnp.where(mask.astype(bool), advantages.astype(F32), 0.0)
  return {"advantage/mean": masked_mean(adv, mask),
          "advantage/std": jnp.sqrt(masked_var(adv, mask)),
          **_min_max(adv, mask, "advantage")}


def zero_variance_fraction(rewards: jax.Array) -> jax.Array:  # [G, K] -> scalar
  """Fraction of groups whose K rewards are all equal (no signal for group estimators).

  Written with array methods, so host rewards (numpy) stay on the host: the loop reports
  it every step without a device program.
  """
  constant = rewards.max(axis=-1) == rewards.min(axis=-1)
  return constant.astype(F32).mean()


def length_stats(mask: jax.Array) -> dict:
  """Mean, min and max response length (valid tokens per sequence) over the batch rows."""
  lengths = sequence_lengths(mask)
  return {"length/mean": jnp.mean(lengths), "length/min": jnp.min(lengths),
          "length/max": jnp.max(lengths)}

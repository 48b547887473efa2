"""Canary metrics against NumPy loops over the valid tokens."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rl import LossConfig, global_normaliser, policy_loss
from jaxrl_post.rl import metrics as M
from tests.rl import reference as ref
from tests.rl.helpers import B, assert_close, batch, response_mask


def valid_values(x, mask):
  return [float(x[b, t]) for b in range(mask.shape[0]) for t in ref.valid_positions(mask, b)]


def loop_quantile(values, q):
  """Linear interpolation between order statistics (NumPy's default method)."""
  s = sorted(values)
  pos = q * (len(s) - 1)
  lo = int(math.floor(pos))
  hi = min(lo + 1, len(s) - 1)
  return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@pytest.mark.parametrize("qs", [(0.01, 0.5, 0.99), (0.0, 0.25, 1.0)])
def test_masked_quantiles_ignore_padding(qs):
  data = batch(seed=41)
  mask = data["mask"]
  x = data["logprobs"]  # padding holds 1e4: it would dominate the top quantiles
  values = valid_values(x, mask)
  got = M.masked_quantiles(jnp.asarray(x), mask, qs)
  assert_close(got, [loop_quantile(values, q) for q in qs])
  assert_close(got, np.quantile(values, qs))


def test_quantiles_of_tiny_and_empty_selections():
  x = jnp.arange(6.0).reshape(2, 3)
  one = np.zeros((2, 3), np.float32)
  one[1, 2] = 1
  np.testing.assert_array_equal(M.masked_quantiles(x, one, (0.01, 0.99)), [5.0, 5.0])
  assert np.isnan(np.asarray(M.masked_quantiles(x, np.zeros((2, 3)), (0.5,)))).all()


def test_histogram():
  rng = np.random.default_rng(42)
  mask = response_mask()
  x = np.where(mask > 0, rng.uniform(-0.5, 3.5, mask.shape), np.nan).astype(np.float32)
  got = M.masked_histogram(jnp.asarray(x), mask, 0.0, 3.0, 6)
  want = [0] * 6
  for v in valid_values(x, mask):
    edges = [0.0 + 0.5 * i for i in range(7)]
    index = next((i for i in range(6) if edges[i] <= v < edges[i + 1]), 0 if v < 0 else 5)
    want[index] += 1
  np.testing.assert_array_equal(got, want)
  assert float(got.sum()) == mask.sum()


def test_ratio_canaries_and_clip_fractions_from_a_loss():
  data = batch(seed=43)
  mask = data["mask"]
  cfg = LossConfig("ppo", clip_low=0.2, clip_high=0.28)
  _, metrics = policy_loss(data["logprobs"], data["old_logprobs"], None, data["advantages"],
                           mask, None, cfg, global_normaliser(mask, cfg))
  ratios = [math.exp(float(data["logprobs"][b, t]) - float(data["old_logprobs"][b, t]))
            for b in range(B) for t in ref.valid_positions(mask, b)]
  canaries = M.ratio_canaries(metrics["ratio"], mask)
  assert sorted(canaries) == ["ratio/p1", "ratio/p50", "ratio/p99"]
  assert_close([canaries[k] for k in ("ratio/p1", "ratio/p50", "ratio/p99")],
               [loop_quantile(ratios, q) for q in (0.01, 0.5, 0.99)])
  low = high = 0
  for b in range(B):
    for t in ref.valid_positions(mask, b):
      r, a = math.exp(float(data["logprobs"][b, t]) - float(data["old_logprobs"][b, t])), float(
          data["advantages"][b, t])
      low, high = low + (a < 0 and r < 0.8), high + (a > 0 and r > 1.28)
  fractions = M.clip_fractions(metrics["clip_low"], metrics["clip_high"], mask)
  assert low > 0 and high > 0
  assert_close(fractions["clip_frac_low"], low / len(ratios))
  assert_close(fractions["clip_frac_high"], high / len(ratios))


def test_kl_entropy_and_mismatch():
  data = batch(seed=44)
  mask = data["mask"]
  lp, beh, refp = data["logprobs"], data["behaviour_logprobs"], data["ref_logprobs"]
  pairs = [(float(lp[b, t]), float(beh[b, t]), float(refp[b, t]), float(data["entropy"][b, t]))
           for b in range(B) for t in ref.valid_positions(mask, b)]
  n = len(pairs)
  k3_beh = sum(math.exp(p - q) - (p - q) - 1 for p, q, _, _ in pairs) / n  # samples from q
  k3_ref = sum(math.exp(r - p) - (r - p) - 1 for p, _, r, _ in pairs) / n
  assert_close(M.behaviour_kl(lp, beh, mask), k3_beh)
  assert_close(M.reference_kl(lp, refp, mask), k3_ref)
  assert_close(M.reference_kl(lp, refp, mask, "k1"), sum(p - r for p, _, r, _ in pairs) / n)
  assert_close(M.mean_entropy(data["entropy"], mask), sum(e for *_, e in pairs) / n)

  got = M.logprob_mismatch(lp, beh, mask)
  diffs = [abs(p - q) for p, q, _, _ in pairs]
  assert_close(got["mismatch/abs_mean"], sum(diffs) / n)
  assert_close(got["mismatch/abs_max"], max(diffs))
  x = [math.exp(p) for p, *_ in pairs]
  y = [math.exp(q) for _, q, *_ in pairs]
  mx, my = sum(x) / n, sum(y) / n
  cov = sum((a - mx) * (c - my) for a, c in zip(x, y))
  corr = cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((c - my) ** 2 for c in y))
  assert 0.5 < corr < 0.9999
  assert_close(got["mismatch/prob_corr"], corr)


def test_effective_sample_size():
  data = batch(seed=45)
  mask = data["mask"]
  w = valid_values(data["is_weights"], mask)  # padding holds NaN
  want = sum(w) ** 2 / (len(w) * sum(v * v for v in w))
  assert 0 < want < 1
  assert_close(M.effective_sample_size(data["is_weights"], mask), want)
  ones = np.where(mask > 0, 1.0, np.nan)
  assert_close(M.effective_sample_size(ones, mask), 1.0)


def test_advantage_length_and_group_stats():
  data = batch(seed=46)
  mask = data["mask"]
  a = valid_values(data["advantages"], mask)
  mean = sum(a) / len(a)
  got = M.advantage_stats(data["advantages"], mask)
  assert_close(got["advantage/mean"], mean)
  assert_close(got["advantage/std"], math.sqrt(sum((v - mean) ** 2 for v in a) / len(a)))
  assert_close(got["advantage/min"], min(a))
  assert_close(got["advantage/max"], max(a))

  lengths = [len(ref.valid_positions(mask, b)) for b in range(B)]
  got = M.length_stats(mask)
  assert_close([got["length/mean"], got["length/min"], got["length/max"]],
               [sum(lengths) / B, min(lengths), max(lengths)])

  rewards = np.array([[1, 1, 1], [0, 1, 1], [0, 0, 0], [2, 2, 3]], np.float32)
  assert_close(M.zero_variance_fraction(jnp.asarray(rewards)), 0.5)

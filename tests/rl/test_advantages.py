"""Advantage estimators against NumPy loops; GAE against a reverse loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rl import AdvantageConfig, compute_advantages
from jaxrl_post.rl.advantages import sequence_advantages
from tests.rl import reference as ref
from tests.rl.helpers import B, K, T, assert_close, response_mask, with_garbage


def rewards(seed=0):
  """[B] rewards, K per group: a continuous group and a constant group (0.1, not exact in
  binary, so a naive mean leaves rounding noise that eps would blow up)."""
  rng = np.random.default_rng(seed)
  r = rng.normal(0.0, 1.0, B).astype(np.float32)
  r[K:2 * K] = 0.1
  return r


@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo(ddof):
  r, mask = rewards(), response_mask()
  adv, returns = compute_advantages(jnp.asarray(r), mask, AdvantageConfig(
      "grpo", group_size=K, eps=1e-6, std_ddof=ddof))
  want = ref.grpo(r, K, 1e-6, ddof)
  assert_close(adv, ref.to_tokens(want, mask))
  assert_close(returns, ref.to_tokens(r, mask))
  np.testing.assert_array_equal(np.asarray(adv)[K:2 * K], 0.0)  # constant group: exactly 0


def test_dr_grpo_and_rloo():
  r, mask = rewards(1), response_mask()
  for name, want in (("dr_grpo", ref.dr_grpo(r, K)), ("rloo", ref.rloo(r, K))):
    adv, _ = compute_advantages(jnp.asarray(r), mask, AdvantageConfig(name, group_size=K))
    assert_close(adv, ref.to_tokens(want, mask))
    np.testing.assert_array_equal(np.asarray(adv)[K:2 * K], 0.0)


def test_rloo_is_scaled_dr_grpo():
  """r_i - mean(others) = K / (K - 1) * (r_i - mean): both references must agree too."""
  r = rewards(2)
  assert_close(ref.rloo(r, K), ref.dr_grpo(r, K) * K / (K - 1))


def test_reinforce_pp():
  r, mask = rewards(3), response_mask()
  adv, _ = compute_advantages(jnp.asarray(r), mask, AdvantageConfig(
      "reinforce_pp", group_size=K, eps=1e-6))
  assert_close(adv, ref.reinforce_pp(r, mask, K, 1e-6))
  m = mask > 0  # whitened over valid tokens: zero mean, unit std
  assert abs(float(np.asarray(adv)[m].mean())) < 1e-6
  assert_close(np.asarray(adv)[m].std(), 1.0, rtol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reverse_loop(gamma, lam):
  rng = np.random.default_rng(4)
  mask = response_mask()
  token_rewards = with_garbage(rng.normal(0, 1, (B, T)), mask, np.nan)
  values = with_garbage(rng.normal(0, 1, (B, T)), mask, np.inf)
  adv, returns = compute_advantages(jnp.asarray(token_rewards), mask,
                                    AdvantageConfig("gae", gamma=gamma, lam=lam),
                                    values=jnp.asarray(values))
  want_adv, want_ret = ref.gae(token_rewards, values, mask, gamma, lam)
  assert_close(adv, want_adv)
  assert_close(returns, want_ret)


def test_gae_lambda_one_returns_are_rewards_to_go():
  """gamma = lam = 1: returns = the sum of the row's remaining valid rewards, whatever V."""
  rng = np.random.default_rng(5)
  mask = response_mask()
  token_rewards = rng.normal(0, 1, (B, T)).astype(np.float32)
  _, returns = compute_advantages(jnp.asarray(token_rewards), mask, AdvantageConfig("gae"),
                                  values=jnp.asarray(rng.normal(0, 1, (B, T)), jnp.float32))
  to_go = np.zeros((B, T))
  for b in range(B):
    for t in ref.valid_positions(mask, b):
      to_go[b, t] = sum(token_rewards[b, u] for u in ref.valid_positions(mask, b) if u >= t)
  assert_close(returns, to_go)


def test_gae_whiten():
  rng = np.random.default_rng(6)
  mask = response_mask()
  token_rewards, values = (rng.normal(0, 1, (B, T)).astype(np.float32) for _ in range(2))
  cfg = AdvantageConfig("gae", gamma=0.99, lam=0.95, whiten=True, eps=1e-8)
  adv, _ = compute_advantages(jnp.asarray(token_rewards), mask, cfg, values=jnp.asarray(values))
  raw, _ = ref.gae(token_rewards, values, mask, 0.99, 0.95)
  flat = raw[mask > 0]
  want = np.where(mask > 0, (raw - flat.mean()) / (flat.std() + 1e-8), 0.0)
  assert_close(adv, want)


def test_values_required_exactly_for_gae():
  mask = response_mask()
  with pytest.raises(ValueError, match="needs values"):
    compute_advantages(jnp.zeros((B, T)), mask, AdvantageConfig("gae"))
  with pytest.raises(ValueError, match="takes no values"):
    compute_advantages(jnp.zeros(B), mask, AdvantageConfig("grpo", group_size=K),
                       values=jnp.zeros((B, T)))


def test_group_size_must_divide_batch():
  with pytest.raises(UserError, match="group_size=3"):
    compute_advantages(jnp.zeros(B), response_mask(), AdvantageConfig("grpo", group_size=3))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_constant_groups_are_exactly_zero(name):
  """With K = 3, the float32 mean of three 0.1s is off by an ulp; the z-score of that noise
  over eps would be ~0.007, not 0."""
  r = np.array([0.1] * 3 + [0.2] * 3 + [0.4, -1.0, 2.0], np.float32)
  mask = np.ones((9, 4), np.float32)
  adv, _ = compute_advantages(jnp.asarray(r), mask, AdvantageConfig(name, group_size=3))
  np.testing.assert_array_equal(np.asarray(adv)[:6], 0.0)
  assert np.all(np.asarray(adv)[6:] != 0.0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_sequence_advantages_are_the_estimators_per_sequence(name):
  """The loop's one jitted program gives what compute_advantages gives per sequence."""
  rewards = np.random.default_rng(0).integers(0, 3, 16).astype(np.float32)
  cfg = AdvantageConfig(name, group_size=4)
  want, _ = compute_advantages(rewards, np.ones((16, 1), np.float32), cfg)
  assert_close(sequence_advantages(rewards, cfg), np.asarray(want)[:, 0])

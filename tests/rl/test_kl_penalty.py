"""KL to the reference as a reward penalty, per token and per sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rl import KLPenaltyConfig, apply_kl_penalty
from tests.rl import reference as ref
from tests.rl.helpers import B, T, assert_close, batch


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_token_and_sequence_penalties(estimator):
  data = batch(seed=31)
  mask = data["mask"]
  kl, _ = ref.kl(data["logprobs"], data["ref_logprobs"], mask, estimator)
  rng = np.random.default_rng(31)
  token_rewards = rng.normal(0, 1, (B, T)).astype(np.float32)
  rewards = rng.normal(0, 1, B).astype(np.float32)
  args = (data["logprobs"], data["ref_logprobs"], mask)

  got = apply_kl_penalty(token_rewards, *args, KLPenaltyConfig(0.05, estimator, "token"))
  want = token_rewards.astype(np.float64).copy()
  for b in range(B):
    for t in ref.valid_positions(mask, b):
      want[b, t] -= 0.05 * kl[b, t]
  assert_close(got, want)

  got = apply_kl_penalty(rewards, *args, KLPenaltyConfig(0.05, estimator, "sequence"))
  want = [rewards[b] - 0.05 * sum(kl[b, t] for t in ref.valid_positions(mask, b))
          for b in range(B)]
  assert_close(got, want)


def test_penalty_is_not_differentiated():
  data = batch(seed=32)
  cfg = KLPenaltyConfig(0.1, "k3", "sequence")
  grad = jax.grad(lambda lp: jnp.sum(apply_kl_penalty(
      jnp.zeros(B), lp, data["ref_logprobs"], data["mask"], cfg)))(jnp.asarray(data["logprobs"]))
  assert float(jnp.abs(grad).max()) == 0.0


def test_level_checks_reward_rank():
  data = batch()
  with pytest.raises(ValueError, match="sequence"):
    apply_kl_penalty(jnp.zeros((B, T)), data["logprobs"], data["ref_logprobs"], data["mask"],
                     KLPenaltyConfig(0.1, level="sequence"))

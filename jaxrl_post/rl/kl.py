"""KL divergence estimators from sampled tokens, as a loss term or a reward penalty.

With tokens sampled from p and d = log q - log p at each token (q the other policy, e.g.
the frozen reference), the estimators of KL(p || q) are (Schulman, "Approximating KL
divergence"):

  k1 = -d                   unbiased, high variance, can be negative per token
  k2 = d^2 / 2              biased, low variance, gradient = the log-ratio
  k3 = exp(d) - d - 1       unbiased, low variance, never negative (GRPO's choice)

k3 is evaluated as expm1(d) - d, which keeps its precision when d is tiny (near on-policy).
The functions take (logprobs of the sampling policy, logprobs of the other), so the same
code measures KL(policy || reference) in the loss and KL(behaviour || trainer) in metrics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.rl.masked import masked_sum, valid
from jaxrl_post.rl.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(logprobs, other_logprobs):  # [B, T] x 2 -> [B, T]
  return logprobs - other_logprobs


@KL_ESTIMATORS.register("k2")
def k2(logprobs, other_logprobs):  # [B, T] x 2 -> [B, T]
  d = logprobs - other_logprobs
  return 0.5 * d * d


@KL_ESTIMATORS.register("k3")
def k3(logprobs, other_logprobs):  # [B, T] x 2 -> [B, T]
  d = other_logprobs - logprobs
  return jnp.expm1(d) - d


def kl_estimate(logprobs: jax.Array, other_logprobs: jax.Array, mask: jax.Array,
                estimator: str) -> jax.Array:  # [B, T] x 3 -> [B, T]
  """Per-token KL estimate, 0 at padding; gradients flow into both inputs."""
  lp, other = valid(mask, logprobs, other_logprobs)
  return jnp.where(mask.astype(bool), KL_ESTIMATORS.get(estimator)(lp, other), 0.0)


PENALTY_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class KLPenaltyConfig:
  """KL to the reference as a reward penalty (PPO-RLHF style) instead of a loss term.

  Attributes:
    beta: penalty coefficient (>= 0).
    estimator: "k1", "k2" or "k3".
    level: "token": per-token rewards [B, T] lose beta * KL_t at each valid token (for GAE
      or REINFORCE++ returns); "sequence": rewards [B] lose beta * sum_t KL_t (for the
      sequence estimators).
  """
  beta: float
  estimator: str = "k1"
  level: str = "token"

  def __post_init__(self):
    KL_ESTIMATORS.check("kl penalty config", "estimator", self.estimator)
    if self.level not in PENALTY_LEVELS:
      raise UserError(f"kl penalty config: level={self.level!r} is not one of {PENALTY_LEVELS}")
    if not self.beta >= 0:
      raise UserError(f"kl penalty config: beta must be >= 0, got {self.beta!r}")


def apply_kl_penalty(rewards: jax.Array, logprobs: jax.Array, ref_logprobs: jax.Array,
                     mask: jax.Array, cfg: KLPenaltyConfig) -> jax.Array:
  """rewards - beta * KL: [B, T] -> [B, T] at level "token", [B] -> [B] at "sequence".

  The penalty is part of the reward, so no gradient flows through it.
  """
  kl = jax.lax.stop_gradient(kl_estimate(logprobs, ref_logprobs, mask, cfg.estimator))
  expected = 2 if cfg.level == "token" else 1
  if rewards.ndim != expected:
    raise ValueError(f"kl penalty level {cfg.level!r} expects rewards with {expected} "
                     f"dimension(s), got shape {tuple(rewards.shape)}")
  if cfg.level == "token":
    return rewards - cfg.beta * kl  # kl is 0 at padding
  return rewards - cfg.beta * masked_sum(kl, mask, axis=-1)

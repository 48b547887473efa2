"""Advantage estimators, registered by name.

Two kinds share one registry:

* sequence estimators (GRPO family) score whole completions. They take one reward per
  sequence, rewards [B] with B = G * K: G prompts, K samples each, each prompt's samples
  contiguous (rows g*K .. g*K+K-1). Their statistics are taken over the group, so they must
  run on the whole rollout batch, before it is split into minibatches. The advantage of a
  sequence is broadcast to its valid tokens.
* token estimators (GAE for PPO) take per-token rewards and values [B, T].

`compute_advantages` is the one entry point; it returns (advantages, returns), both [B, T]
and 0 at padding. For sequence estimators the return of every valid token is the
sequence's reward (undiscounted, terminal reward), which is what a critic would regress on.

A group whose K rewards are all equal carries no learning signal. The group estimators
return exactly 0 for it, rather than rounding noise divided by `eps` (the mean of K equal
floats is not always bit-equal to them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.rl.masked import F32, masked_whiten, to_tokens, valid
from jaxrl_post.rl.registry import Registry


@dataclasses.dataclass(frozen=True)
class Estimator:
  """A registered estimator.

  Attributes:
    fn: sequence kind: (rewards [B], mask [B, T], cfg) -> advantages [B, T];
      token kind: (rewards [B, T], values [B, T], mask [B, T], cfg) -> (advantages, returns).
    per_token: True for the token kind (needs values).
    grouped: True when the statistics are over groups of `group_size` samples.
  """
  fn: Callable
  per_token: bool
  grouped: bool


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def register_advantage(name: str, *, per_token: bool = False, grouped: bool = True):
  """Decorator registering an estimator function under `name`."""

  def add(fn):
    ADVANTAGE_ESTIMATORS.register(name)(Estimator(fn, per_token, grouped))
    return fn

  return add


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Which estimator and its constants.

  Attributes:
    name: a registered estimator: "grpo", "dr_grpo", "rloo", "reinforce_pp", "gae".
    group_size: K, samples per prompt (group estimators need K >= 2).
    eps: added to standard deviations before dividing (keeps zero-variance groups finite).
    std_ddof: 1 for the unbiased group std (as the GRPO reference implementations), or 0.
    gamma: GAE discount.
    lam: GAE lambda.
    whiten: GAE only: normalise advantages to zero mean, unit std over the batch's tokens.
  """
  name: str
  group_size: int = 1
  eps: float = 1e-6
  std_ddof: int = 1
  gamma: float = 1.0
  lam: float = 1.0
  whiten: bool = False

  def __post_init__(self):
    where = "advantage config"
    ADVANTAGE_ESTIMATORS.check(where, "name", self.name)
    if not isinstance(self.group_size, int) or self.group_size < 1:
      raise UserError(f"{where}: group_size must be a positive integer, got {self.group_size!r}")
    if ADVANTAGE_ESTIMATORS.get(self.name).grouped and self.group_size < 2:
      raise UserError(f"{where}: name={self.name!r} needs group_size >= 2, got {self.group_size}")
    if self.std_ddof not in (0, 1):
      raise UserError(f"{where}: std_ddof must be 0 or 1, got {self.std_ddof!r}")
    if not self.eps > 0:
      raise UserError(f"{where}: eps must be > 0, got {self.eps!r}")
    for field in ("gamma", "lam"):
      if not 0.0 <= getattr(self, field) <= 1.0:
        raise UserError(f"{where}: {field} must be in [0, 1], got {getattr(self, field)!r}")


def compute_advantages(rewards: jax.Array, mask: jax.Array, cfg: AdvantageConfig,
                       values: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """(advantages [B, T], returns [B, T]) with the estimator named by `cfg`.

  Args:
    rewards: [B] for sequence estimators, [B, T] for token estimators.
    mask: [B, T] response mask.
    cfg: the validated config.
    values: [B, T] critic values, required by token estimators and refused by the others,
      so that a pipeline wired for the wrong estimator fails loudly.
  """
  est = ADVANTAGE_ESTIMATORS.get(cfg.name)
  if est.per_token != (values is not None):
    raise ValueError(f"advantage estimator {cfg.name!r} "
                     f"{'needs' if est.per_token else 'takes no'} values")
  if est.per_token:
    return est.fn(rewards, values, mask, cfg)
  return est.fn(rewards, mask, cfg), to_tokens(rewards, mask)


@functools.partial(jax.jit, static_argnames="cfg")
def sequence_advantages(rewards: jax.Array, cfg: AdvantageConfig) -> jax.Array:  # [B] -> [B]
  """One advantage per sequence from a sequence estimator, for a whole rollout batch.

  One compiled program whose result stays on the device for the trainer's programs: the
  loop calls it every step, where running the estimator's few ops one by one would cost
  a dispatch each and fetching the result a host round trip.
  """
  est = ADVANTAGE_ESTIMATORS.get(cfg.name)
  if est.per_token:
    raise ValueError(f"advantage estimator {cfg.name!r} is per token (needs values)")
  return est.fn(rewards, jnp.ones((rewards.shape[0], 1), F32), cfg)[:, 0]


def _groups(rewards: jax.Array, group_size: int) -> jax.Array:  # [B] -> [G, K] f32
  b = rewards.shape[0]
  if rewards.ndim != 1 or b % group_size:
    raise UserError(f"advantage config: group_size={group_size} does not divide the rewards "
                    f"of shape {tuple(rewards.shape)} into groups")
  return rewards.astype(F32).reshape(b // group_size, group_size)


def _centred(groups: jax.Array) -> jax.Array:  # [G, K] -> [G, K]
  """r - group mean, exactly 0 in groups whose rewards are all equal."""
  constant = groups.max(axis=-1, keepdims=True) == groups.min(axis=-1, keepdims=True)
  return jnp.where(constant, 0.0, groups - groups.mean(axis=-1, keepdims=True))


BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # a = (r - baseline) / scale per group


def group_baseline(rewards: jax.Array, cfg: AdvantageConfig):  # [B] -> [G, K] x 3, [G, 1]
  """(rewards, baseline, scale, constant) of the baseline estimators, grouped: advantage
  (r - baseline) / scale, 0 in a group whose rewards are all equal (`constant`). GRPO: the
  group mean and std + eps; Dr. GRPO: the mean and 1; RLOO: the mean of the other K - 1
  and 1. Multi-turn reward-to-go credit puts a turn's return in place of r (turn_credit)."""
  if cfg.name not in BASELINE_ESTIMATORS:
    raise ValueError(f"advantage estimator {cfg.name!r} has no group baseline")
  groups = _groups(rewards, cfg.group_size)
  k = groups.shape[-1]
  constant = groups.max(axis=-1, keepdims=True) == groups.min(axis=-1, keepdims=True)
  mean = groups.mean(axis=-1, keepdims=True)
  baseline = jnp.broadcast_to(mean, groups.shape)
  if cfg.name == "rloo":
    baseline = (groups.sum(axis=-1, keepdims=True) - groups) / (k - 1)
  scale = jnp.ones_like(groups)
  if cfg.name == "grpo":
    centred = jnp.where(constant, 0.0, groups - mean)
    std = jnp.sqrt(jnp.sum(centred * centred, axis=-1, keepdims=True) / (k - cfg.std_ddof))
    scale = jnp.broadcast_to(std + cfg.eps, groups.shape)
  return groups, baseline, scale, constant


def _baseline_advantages(rewards, mask, cfg):  # [B], [B, T] -> [B, T]
  groups, baseline, scale, constant = group_baseline(rewards, cfg)
  return to_tokens(jnp.where(constant, 0.0, (groups - baseline) / scale).reshape(-1), mask)


@register_advantage("grpo")
def grpo(rewards, mask, cfg):  # [B], [B, T] -> [B, T]
  """GRPO: z-score within each group, (r - mean_g) / (std_g + eps)."""
  return _baseline_advantages(rewards, mask, cfg)


@register_advantage("dr_grpo")
def dr_grpo(rewards, mask, cfg):  # [B], [B, T] -> [B, T]
  """Dr. GRPO: r - mean_g. Dividing by the group std up-weights near-unanimous groups."""
  return _baseline_advantages(rewards, mask, cfg)


@register_advantage("rloo")
def rloo(rewards, mask, cfg):  # [B], [B, T] -> [B, T]
  """RLOO: r_i minus the mean of the other K - 1 rewards (an unbiased baseline)."""
  return _baseline_advantages(rewards, mask, cfg)


@register_advantage("reinforce_pp")
def reinforce_pp(rewards, mask, cfg):  # [B], [B, T] -> [B, T]
  """REINFORCE++ with the group-mean baseline (the "REINFORCE++-baseline" variant).

  a_i = r_i - mean_g(r) is broadcast to the tokens of sequence i; then the whole batch is
  whitened over its valid tokens: A = (a - mu) / (sigma + eps), where mu and sigma are the
  token-weighted mean and population std of a over every valid token of the batch. mu is
  not 0 in general (long completions weigh more), so it is subtracted again. Normalising by
  the batch rather than the group std avoids GRPO's up-weighting of near-unanimous groups.
  """
  centred = _centred(_groups(rewards, cfg.group_size)).reshape(-1)
  return masked_whiten(to_tokens(centred, mask), mask, cfg.eps)


@register_advantage("gae", per_token=True, grouped=False)
def gae(rewards, values, mask, cfg):  # [B, T] x 3 -> ([B, T], [B, T])
  """Generalised advantage estimation over the valid tokens of each row.

  delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where
  "next" is the next *valid* token of the row (V_next = 0 and A_next = 0 after the last
  one): padding and masked spans inside a row (tool outputs in multi-turn) are skipped, not
  treated as time steps, and their rewards are ignored. Returns = A + V before whitening.
  """
  m = mask.astype(bool)
  r, v = valid(m, rewards, values)

  def step(carry, x):  # carry: next valid (value, advantage) per row, [B] each
    next_v, next_a = carry
    r_t, v_t, m_t = x
    a_t = r_t + cfg.gamma * next_v - v_t + cfg.gamma * cfg.lam * next_a
    carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
    return carry, a_t

  zeros = jnp.zeros(r.shape[:1], F32)
  _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
  adv = jnp.where(m, adv.T, 0.0)
  returns = jnp.where(m, adv + v, 0.0)
  return (masked_whiten(adv, m, cfg.eps) if cfg.whiten else adv), returns

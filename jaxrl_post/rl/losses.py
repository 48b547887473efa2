"""Policy losses, loss aggregation and the composed policy loss.

Each registered policy loss is a pure function

  (logprobs [B, T], old_logprobs [B, T], advantages [B, T], mask [B, T], cfg)
      -> (per-token loss [B, T], per-token metrics {name: [B, T]})

that is 0 at padding. Metrics always include "ratio" (the importance ratio the loss used),
"clip_low" and "clip_high" (1.0 where that clip bound is active, else 0.0), so canaries
read the same keys whatever the loss. Clipping is written as a selection, not as
min/max of the two surrogates: `jnp.maximum` splits the gradient in half at ties, which
would halve the step exactly on-policy when a bound is 1 (clip_low = 0).

Aggregation turns per-token losses into a scalar with an explicit global normaliser (the
count of valid tokens, or of non-empty sequences, in the WHOLE batch: see
`global_normaliser`). Every mode is a sum over sequences of a per-sequence term divided by
that constant, so the losses of micro-batches split along B sum to the full-batch loss,
and so do their gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.rl.kl import KL_ESTIMATORS, kl_estimate
from jaxrl_post.rl.masked import F32, masked_count, masked_sum, sequence_lengths, valid
from jaxrl_post.rl.registry import Registry

POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("loss aggregation")
DEFAULT_AGGREGATION = {"gspo": "seq-mean-token-mean"}  # Loss name -> its paper's aggregation.


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Policy loss, aggregation and auxiliary terms.

  Attributes:
    name: "ppo", "dual_clip", "gspo" or "cispo".
    clip_low: ratio lower bound is 1 - clip_low, in [0, 1] (1 disables it).
    clip_high: ratio upper bound is 1 + clip_high (DAPO's clip-higher sets it above
      clip_low, e.g. 0.28 vs 0.2). GSPO uses far smaller bounds, e.g. 3e-4 / 4e-4.
    clip_c: dual-clip bound on the loss of negative-advantage tokens, > 1.
    aggregation: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or
      "seq-mean-token-sum-norm"; None (the default) means the loss's own paper's:
      "seq-mean-token-mean" for GSPO (a mean of per-sequence objectives), "token-mean"
      for the others.
    norm_length: the fixed length that "seq-mean-token-sum-norm" divides by (usually the
      maximum response length); required by that mode only.
    kl_coef: weight of KL(policy || reference) in the loss (0: no term).
    kl_estimator: "k1", "k2" or "k3".
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    max_log_ratio: |log ratio| is clamped here before exp, so a stray token cannot make
      the loss or its gradient infinite.
  """
  name: str = "ppo"
  clip_low: float = 0.2
  clip_high: float = 0.2
  clip_c: float = 3.0
  aggregation: Optional[str] = None
  norm_length: Optional[int] = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  max_log_ratio: float = 20.0

  def __post_init__(self):
    where = "loss config"
    POLICY_LOSSES.check(where, "name", self.name)
    if self.aggregation is None:
      object.__setattr__(self, "aggregation", DEFAULT_AGGREGATION.get(self.name, "token-mean"))
    AGGREGATIONS.check(where, "aggregation", self.aggregation)
    KL_ESTIMATORS.check(where, "kl_estimator", self.kl_estimator)
    if not 0.0 <= self.clip_low <= 1.0:
      raise UserError(f"{where}: clip_low must be in [0, 1], got {self.clip_low!r}")
    for field in ("clip_high", "kl_coef", "entropy_coef"):
      if not getattr(self, field) >= 0.0:
        raise UserError(f"{where}: {field} must be >= 0, got {getattr(self, field)!r}")
    if not self.clip_c > 1.0:
      raise UserError(f"{where}: clip_c must be > 1, got {self.clip_c!r}")
    if not self.max_log_ratio > 0.0:
      raise UserError(f"{where}: max_log_ratio must be > 0, got {self.max_log_ratio!r}")
    if self.aggregation == "seq-mean-token-sum-norm" and not (
        isinstance(self.norm_length, int) and self.norm_length > 0):
      raise UserError(f"{where}: aggregation='seq-mean-token-sum-norm' needs a positive "
                      f"integer norm_length, got {self.norm_length!r}")


# ----------------------------------------------------------------------------- policy losses


def _log_ratio(logprobs, old_logprobs, mask, cfg):  # -> lp, log ratio [B, T] f32
  lp, old = valid(mask, logprobs, jax.lax.stop_gradient(old_logprobs))
  return lp, jnp.clip(lp - old, -cfg.max_log_ratio, cfg.max_log_ratio)


def _clipped_surrogate(ratio, adv, mask, cfg):  # [B, T] x 3 -> loss, clip_low, clip_high
  """-min(r A, clip(r) A) written as a selection between the two surrogates.

  The clipped branch is taken exactly where it is the smaller objective: A > 0 with
  r > 1 + clip_high, or A < 0 with r < 1 - clip_low. There its value is constant in the
  policy, so those tokens get no gradient; the indicators are where that happens.
  """
  m = mask.astype(bool)
  high = m & (adv > 0) & (ratio > 1.0 + cfg.clip_high)
  low = m & (adv < 0) & (ratio < 1.0 - cfg.clip_low)
  bound = jnp.where(adv > 0, 1.0 + cfg.clip_high, 1.0 - cfg.clip_low)
  loss = jnp.where(high | low, -adv * bound, -adv * ratio)
  return jnp.where(m, loss, 0.0), low.astype(F32), high.astype(F32)


def _metrics(ratio, mask, clip_low, clip_high, **extra):
  return {"ratio": jnp.where(mask.astype(bool), ratio, 0.0), "clip_low": clip_low,
          "clip_high": clip_high, **extra}


@POLICY_LOSSES.register("ppo")
def ppo_loss(logprobs, old_logprobs, advantages, mask, cfg):  # [B, T] x 4 -> [B, T], dict
  """PPO-clip with separate bounds [1 - clip_low, 1 + clip_high] (DAPO clip-higher)."""
  _, log_ratio = _log_ratio(logprobs, old_logprobs, mask, cfg)
  (adv,) = valid(mask, advantages)
  ratio = jnp.exp(log_ratio)
  loss, low, high = _clipped_surrogate(ratio, adv, mask, cfg)
  return loss, _metrics(ratio, mask, low, high)


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(logprobs, old_logprobs, advantages, mask, cfg):
  """PPO-clip plus dual clip: for A < 0 the loss is capped at -clip_c * A.

  Plain PPO leaves negative-advantage tokens unclipped above 1 + clip_high, so one token
  whose probability rose a lot under a stale sample can dominate the batch. Where A < 0 and
  r > clip_c the loss is the constant -clip_c * A ("clip_dual" = 1), with no gradient.
  """
  _, log_ratio = _log_ratio(logprobs, old_logprobs, mask, cfg)
  (adv,) = valid(mask, advantages)
  ratio = jnp.exp(log_ratio)
  loss, low, high = _clipped_surrogate(ratio, adv, mask, cfg)
  dual = mask.astype(bool) & (adv < 0) & (ratio > cfg.clip_c)
  loss = jnp.where(dual, -adv * cfg.clip_c, loss)
  return loss, _metrics(ratio, mask, low, high, clip_dual=dual.astype(F32))


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, mask, cfg):
  """GSPO: one importance ratio per sequence, s_i = exp(mean_t log(p_t / old_t)).

  Written in the paper's GSPO-token form: every token uses the ratio
  sg(s_i) * exp(lp_t - sg(lp_t)), whose value is s_i, and clipping is decided on s_i (with
  the sign of the token's advantage), so a sequence is clipped as a whole. Its gradient with
  respect to lp_t is s_i; for sequence-level advantages and the aggregations here (weights
  constant within a sequence) this equals the gradient of the plain sequence objective,
  where s_i's gradient is spread as s_i / L_i over the L_i tokens, and it stays correct for
  token-level advantages.
  """
  m = mask.astype(bool)
  lp, log_ratio = _log_ratio(logprobs, old_logprobs, mask, cfg)
  (adv,) = valid(mask, advantages)
  seq_log_ratio = masked_sum(log_ratio, m, axis=-1) / jnp.maximum(sequence_lengths(m), 1.0)
  seq_ratio = jax.lax.stop_gradient(jnp.exp(seq_log_ratio))[:, None]  # [B, 1]
  ratio = seq_ratio * jnp.exp(lp - jax.lax.stop_gradient(lp))  # value == s_i exactly
  loss, low, high = _clipped_surrogate(ratio, adv, mask, cfg)
  return loss, _metrics(ratio, mask, low, high)


@POLICY_LOSSES.register("cispo")
def cispo_loss(logprobs, old_logprobs, advantages, mask, cfg):
  """CISPO (MiniMax-M1): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log p.

  Unlike PPO, clipping bounds the importance weight but never drops a token's gradient
  (dlogp = -w A everywhere), so rare high-ratio tokens (often the reflective "forks") keep
  contributing. The paper clips only above: set clip_low = 1. "clip_low"/"clip_high" mark
  tokens whose weight was truncated, whatever the sign of A.
  """
  m = mask.astype(bool)
  lp, log_ratio = _log_ratio(logprobs, old_logprobs, mask, cfg)
  (adv,) = valid(mask, advantages)
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
  loss = jnp.where(m, -weight * adv * lp, 0.0)
  low = (m & (ratio < 1.0 - cfg.clip_low)).astype(F32)
  high = (m & (ratio > 1.0 + cfg.clip_high)).astype(F32)
  return loss, _metrics(ratio, mask, low, high)


# ------------------------------------------------------------------------------ aggregation


@dataclasses.dataclass(frozen=True)
class Aggregation:
  """fn(loss [B, T], mask [B, T], normaliser, norm_length) -> scalar; `per_token` says
  whether the normaliser counts valid tokens (True) or non-empty sequences (False)."""
  fn: Callable
  per_token: bool


def _register_aggregation(name: str, per_token: bool):
  def add(fn):
    AGGREGATIONS.register(name)(Aggregation(fn, per_token))
    return fn

  return add


@_register_aggregation("token-mean", per_token=True)
def token_mean(loss, mask, normaliser, norm_length):
  """Sum over all valid tokens / total valid tokens: every token weighs the same."""
  del norm_length
  return masked_sum(loss, mask) / normaliser


@_register_aggregation("seq-mean-token-mean", per_token=False)
def seq_mean_token_mean(loss, mask, normaliser, norm_length):
  """Mean over each sequence's tokens, then over sequences: every sequence weighs the same
  (GRPO's original form; biases towards short correct and long wrong answers)."""
  del norm_length
  per_seq = masked_sum(loss, mask, axis=-1) / jnp.maximum(sequence_lengths(mask), 1.0)
  return jnp.sum(per_seq) / normaliser


@_register_aggregation("seq-mean-token-sum", per_token=False)
def seq_mean_token_sum(loss, mask, normaliser, norm_length):
  """Sum over each sequence's tokens, mean over sequences."""
  del norm_length
  return masked_sum(loss, mask) / normaliser


@_register_aggregation("seq-mean-token-sum-norm", per_token=False)
def seq_mean_token_sum_norm(loss, mask, normaliser, norm_length):
  """Dr. GRPO: sum over each sequence's tokens / norm_length, mean over sequences.

  Dividing by a constant instead of each sequence's length removes the length bias of
  seq-mean-token-mean while keeping the loss scale independent of the batch's lengths.
  """
  return masked_sum(loss, mask) / (normaliser * norm_length)


def global_normaliser(mask: jax.Array, cfg: LossConfig) -> jax.Array:  # [B, T] -> scalar
  """The normaliser of `cfg.aggregation` computed from the WHOLE batch's mask.

  Compute it once per optimiser step, before splitting into micro-batches, and pass the
  same value to every micro-batch: that is what makes the micro-batch losses add up to
  the full-batch loss. At least 1, so an all-padding batch gives loss 0, not NaN.
  """
  if AGGREGATIONS.get(cfg.aggregation).per_token:
    count = masked_count(mask)
  else:
    count = jnp.sum((sequence_lengths(mask) > 0).astype(F32))
  return jnp.maximum(count, 1.0)


def aggregate(loss: jax.Array, mask: jax.Array, normaliser, cfg: LossConfig) -> jax.Array:
  """Scalar loss from per-token losses [B, T] with the mode named by `cfg.aggregation`."""
  agg = AGGREGATIONS.get(cfg.aggregation)
  return agg.fn(loss, mask, jnp.asarray(normaliser, F32), cfg.norm_length)


# ------------------------------------------------------------------------ the policy loss


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array,
                ref_logprobs: Optional[jax.Array], advantages: jax.Array, mask: jax.Array,
                entropy: Optional[jax.Array], cfg: LossConfig, normaliser: jax.Array | float,
                is_weights: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
  """loss = pg + kl_coef * kl - entropy_coef * entropy, each aggregated the same way.

  Args:
    logprobs: [B, T] current policy log-probabilities of the sampled tokens (differentiated).
    old_logprobs: [B, T] log-probabilities of the policy that the ratio is taken against.
    ref_logprobs: [B, T] reference log-probabilities, or None when kl_coef == 0.
    advantages: [B, T] (sequence advantages already broadcast to tokens).
    mask: [B, T] response mask.
    entropy: [B, T] per-token entropies, or None when entropy_coef == 0.
    cfg: validated LossConfig.
    normaliser: `global_normaliser` of the whole batch (the same for every micro-batch).
    is_weights: optional [B, T] off-policy weights (see off_policy.py), multiplying the
      policy-gradient term only; treated as constants.

  Returns:
    (scalar loss, metrics): "pg_loss", and "kl_loss" / "entropy" when those inputs are
    given, are scalars aggregated like the loss (so they too sum over micro-batches); the
    loss's per-token metrics ("ratio", "clip_low", "clip_high", ...) and "kl" are [B, T].
  """
  pg_tok, metrics = POLICY_LOSSES.get(cfg.name)(logprobs, old_logprobs, advantages, mask, cfg)
  if is_weights is not None:
    pg_tok = pg_tok * jax.lax.stop_gradient(valid(mask, is_weights)[0])
  agg = functools.partial(aggregate, mask=mask, normaliser=normaliser, cfg=cfg)
  metrics["pg_loss"] = loss = agg(pg_tok)
  loss = loss + _kl_term(logprobs, ref_logprobs, mask, cfg, agg, metrics)
  loss = loss - _entropy_term(entropy, mask, cfg, agg, metrics)
  return loss, metrics


def _kl_term(logprobs, ref_logprobs, mask, cfg, agg, metrics):
  """kl_coef * aggregated KL(policy || reference); records "kl" and "kl_loss"."""
  if ref_logprobs is None:
    if cfg.kl_coef > 0:
      raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    return 0.0
  metrics["kl"] = kl_estimate(logprobs, jax.lax.stop_gradient(ref_logprobs), mask,
                              cfg.kl_estimator)
  metrics["kl_loss"] = agg(metrics["kl"])
  return cfg.kl_coef * metrics["kl_loss"]


def _entropy_term(entropy, mask, cfg, agg, metrics):
  """entropy_coef * aggregated entropy; records "entropy"."""
  if entropy is None:
    if cfg.entropy_coef > 0:
      raise ValueError(f"entropy_coef={cfg.entropy_coef} needs entropy")
    return 0.0
  metrics["entropy"] = agg(valid(mask, entropy)[0])
  return cfg.entropy_coef * metrics["entropy"]

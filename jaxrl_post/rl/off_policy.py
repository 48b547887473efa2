"""Correction for the gap between the rollout engine's policy and the trainer's.

The rollout engine samples with behaviour logprobs mu (bf16 weights, a different kernel,
possibly an older weight version under async training); the trainer's "old" logprobs pi_old
are recomputed with its own forward at the start of the step. The PPO ratio is taken
against pi_old, so the samples additionally need the weight pi_old / mu. Per token it is
truncated (TIS): w = min(exp(old - behaviour), tis_cap), a constant for the gradient.
Sequences whose ratio is far from 1 are better dropped than reweighted: the mismatch is
then a bug or extreme staleness, not noise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.rl.masked import F32, masked_count, masked_mean, masked_sum, sequence_lengths

SEQUENCE_MASK_MODES = ("none", "geometric", "max")


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
  """Thresholds of the correction.

  Attributes:
    tis_cap: upper truncation of the per-token weight (> 0; inf for untruncated IS).
    seq_mask: "none"; "geometric": drop a sequence when the geometric mean of its token
      ratios, exp(mean_t (old - behaviour)), leaves [seq_low, seq_high]; "max": drop it when
      any token's ratio leaves [seq_low, seq_high] (its largest ratio exceeds seq_high or
      its smallest falls below seq_low).
    seq_low: lower bound, in [0, 1].
    seq_high: upper bound, >= 1.
  """
  tis_cap: float = 2.0
  seq_mask: str = "none"
  seq_low: float = 0.5
  seq_high: float = 2.0

  def __post_init__(self):
    where = "off-policy config"
    if not self.tis_cap > 0:
      raise UserError(f"{where}: tis_cap must be > 0, got {self.tis_cap!r}")
    if self.seq_mask not in SEQUENCE_MASK_MODES:
      raise UserError(f"{where}: seq_mask={self.seq_mask!r} is not one of {SEQUENCE_MASK_MODES}")
    if not 0.0 <= self.seq_low <= 1.0:
      raise UserError(f"{where}: seq_low must be in [0, 1], got {self.seq_low!r}")
    if not self.seq_high >= 1.0:
      raise UserError(f"{where}: seq_high must be >= 1, got {self.seq_high!r}")


def _keep_sequences(log_ratio, mask, cfg):  # [B, T] x 2 -> [B] bool
  """Which sequences pass the sequence-level test (rows without valid tokens pass)."""
  if cfg.seq_mask == "none":
    return jnp.ones(log_ratio.shape[:1], bool)
  if cfg.seq_mask == "geometric":
    centre = jnp.exp(masked_mean(log_ratio, mask, axis=-1))
    return (centre >= cfg.seq_low) & (centre <= cfg.seq_high)
  m = mask.astype(bool)
  ratio = jnp.exp(log_ratio)
  top = jnp.max(jnp.where(m, ratio, 1.0), axis=-1)
  bottom = jnp.min(jnp.where(m, ratio, 1.0), axis=-1)
  return (top <= cfg.seq_high) & (bottom >= cfg.seq_low)


def off_policy_correction(old_logprobs: jax.Array, behaviour_logprobs: jax.Array,
                          mask: jax.Array, cfg: OffPolicyConfig
                          ) -> tuple[jax.Array, jax.Array, dict]:
  """(weights [B, T], mask [B, T], metrics) for pi_old / mu.

  The weights (0 at padding and in dropped sequences) go to `policy_loss(is_weights=...)`;
  the returned mask replaces the response mask for the loss. Metrics are scalars:
  "tis_truncated_frac" (valid tokens whose ratio exceeded tis_cap), "seq_dropped_frac"
  (non-empty sequences dropped), "is_weight_mean" (over the tokens kept).
  """
  m = mask.astype(bool)
  old, beh = (jax.lax.stop_gradient(jnp.where(m, x.astype(F32), 0.0))
              for x in (old_logprobs, behaviour_logprobs))
  ratio = jnp.exp(old - beh)  # 1 at padding
  keep = _keep_sequences(old - beh, m, cfg)
  new_mask = m & keep[:, None]
  weights = jnp.where(new_mask, jnp.minimum(ratio, cfg.tis_cap), 0.0)
  nonempty = sequence_lengths(m) > 0
  metrics = {
      "tis_truncated_frac": masked_mean((ratio > cfg.tis_cap).astype(F32), m),
      "seq_dropped_frac": (jnp.sum(nonempty & ~keep) / jnp.maximum(jnp.sum(nonempty), 1)
                           ).astype(F32),
      "is_weight_mean": masked_sum(weights, new_mask) / jnp.maximum(masked_count(new_mask), 1.0),
  }
  return weights, new_mask.astype(mask.dtype), metrics

"""RL algorithm maths: advantages, policy losses, KL, off-policy correction, DAPO, canaries.

Everything here is a pure function of padded arrays (per-sequence [B], per-token [B, T] with
a response mask [B, T]) plus a frozen, validated config, so it jits, shards and
micro-batches without special cases. Algorithms are chosen by registered name.
"""

from jaxrl_post.rl.advantages import (ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages,
                                      register_advantage)
from jaxrl_post.rl.dapo import OverlongConfig, group_keep_mask, overlong_penalty
from jaxrl_post.rl.kl import KL_ESTIMATORS, KLPenaltyConfig, apply_kl_penalty, kl_estimate
from jaxrl_post.rl.losses import (AGGREGATIONS, POLICY_LOSSES, LossConfig, aggregate,
                                  global_normaliser, policy_loss)
from jaxrl_post.rl.off_policy import OffPolicyConfig, off_policy_correction

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "AdvantageConfig", "KLPenaltyConfig", "KL_ESTIMATORS", "LossConfig", "OffPolicyConfig",
    "OverlongConfig", "POLICY_LOSSES", "aggregate", "apply_kl_penalty", "compute_advantages",
    "global_normaliser", "group_keep_mask", "kl_estimate", "off_policy_correction",
    "overlong_penalty", "policy_loss", "register_advantage",
]

"""Per-turn credit for multi-turn episodes: each turn's tokens are credited with the reward
from that turn on (its return-to-go), not with rewards the episode earned before it.

An episode's reward is the sum of its turns' rewards (AgentSpec.reward = "sum"). Episode
credit gives every token the group advantage of that sum. Reward-to-go credit gives turn
j's tokens (R_j - b) / s, R_j = the rewards of turns j, j+1, ..., with the baseline b and
scale s of the configured group estimator over the episodes' sums: GRPO's group mean and
std (+ eps), Dr. GRPO's mean and 1, RLOO's mean of the other K - 1 and 1. The first turn's
R is the whole sum, so its tokens get exactly the episode advantage; a group whose sums are
all equal gets 0, as those estimators give it. The result is per token ([N, T], the
trainer's completion layout), which the policy losses take as they take broadcast
sequence advantages.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.rl.advantages import BASELINE_ESTIMATORS, AdvantageConfig, group_baseline


def check_estimator(cfg: AdvantageConfig) -> None:
  if cfg.name not in BASELINE_ESTIMATORS:
    raise UserError(f"agent: credit='reward_to_go' needs a group estimator with a baseline "
                    f"({', '.join(BASELINE_ESTIMATORS)}), not advantage {cfg.name!r}")


def reward_to_go_advantages(returns: np.ndarray, earned_before: Sequence[np.ndarray],
                            cfg: AdvantageConfig, width: int) -> np.ndarray:
  """[N, width] float32 per-token advantages.

  Args:
    returns: [N] episode rewards (the sums), groups of cfg.group_size contiguous.
    earned_before: per episode, per token after the prompt, the rewards of the turns
      before the token's turn (0 in the first turn).
    cfg: the run's advantage config (one of BASELINE_ESTIMATORS).
    width: the completion layout's width (at least the longest episode).
  """
  check_estimator(cfg)
  k = cfg.group_size
  groups, baseline, scale, constant = map(np.asarray, group_baseline(
      np.asarray(returns, np.float32), cfg))
  out = np.zeros((len(returns), width), np.float32)
  for i, before in enumerate(earned_before):
    g, j = divmod(i, k)
    if not constant[g, 0]:
      to_go = groups[g, j] - np.asarray(before, np.float32)
      out[i, :len(before)] = (to_go - baseline[g, j]) / scale[g, j]
  return out

"""Reward-to-go credit for multi-turn episodes: per-token advantages, and the trainer
taking them as it takes per-sequence ones."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models import init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.advantages import AdvantageConfig, sequence_advantages
from jaxrl_post.rl.packing import completion_bucket
from jaxrl_post.rl.trainer import Trainer, train_on_rollouts
from jaxrl_post.rl.turn_credit import reward_to_go_advantages

# Two groups of K = 2. Episode 0: turn rewards 0.5 then 1.0 (3 + 2 tokens); episode 1: one
# turn, reward 0 (3 tokens); episodes 2 and 3 both earn 1.0 (a group with no signal).
RETURNS = np.array([1.5, 0.0, 1.0, 1.0], np.float32)
EARNED = [np.array([0, 0, 0, 0.5, 0.5]), np.zeros(3), np.array([0, 0, 1.0]), np.zeros(2)]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_each_turn_is_credited_with_the_rewards_from_it_on(name):
  cfg = AdvantageConfig(name, group_size=2)
  got = reward_to_go_advantages(RETURNS, EARNED, cfg, width=8)
  episode = np.asarray(sequence_advantages(RETURNS, cfg))
  scale = {"grpo": np.sqrt(2 * 0.75 ** 2) + cfg.eps, "dr_grpo": 1.0, "rloo": 1.0}[name]
  baseline = {"grpo": 0.75, "dr_grpo": 0.75, "rloo": 0.0}[name]
  np.testing.assert_allclose(got[0, :3], episode[0], rtol=1e-6)  # first turn: the episode's
  np.testing.assert_allclose(got[0, 3:5], (1.0 - baseline) / scale, rtol=1e-6)
  np.testing.assert_allclose(got[1, :3], episode[1], rtol=1e-6)
  assert not got[0, 5:].any() and not got[1, 3:].any()  # padding
  assert not got[2:].any()  # equal sums: no signal, whatever the turns earned


def test_other_estimators_and_episode_rewards_are_refused():
  with pytest.raises(UserError, match="reinforce_pp"):
    reward_to_go_advantages(RETURNS, EARNED, AdvantageConfig("reinforce_pp", group_size=2), 8)
  from jaxrl_post.pipeline.config import AgentSpec
  with pytest.raises(UserError, match="needs reward='sum'"):
    AgentSpec(credit="reward_to_go", reward="last")
  with pytest.raises(UserError, match="credit must be"):
    AgentSpec(credit="turn")


def test_per_token_advantages_train_as_the_same_sequence_advantages():
  """[N, T] advantages equal along each row give the update [N] ones give."""
  from tests.rl.test_fused_step import CFG, TRAINER, rollout

  params = params_of(init_model(CFG, 0))
  trajs, behaviour, adv = rollout()
  trainer = Trainer(CFG, dataclasses.replace(
      TRAINER, loss=dataclasses.replace(TRAINER.loss, kl_coef=0.0)))
  width = completion_bucket(max(len(t.completion) for t in trajs))
  runs = []
  for a in (np.asarray(adv, np.float32), np.repeat(np.asarray(adv, np.float32)[:, None],
                                                    width, 1)):
    state, history = train_on_rollouts(trainer, trainer.init_state(params), trajs, behaviour,
                                       a)
    runs.append((jax.device_get(state.params), history))
  (p1, h1), (p2, h2) = runs
  for a, b in zip(h1, h2):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p1, p2)

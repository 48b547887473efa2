"""A toy verifiable task for the GRPO loop: copy the prompt's token.

Prompts are [1, x] for x in 2..9; the reward is the fraction of the completion's tokens
equal to x. A random tiny policy scores about 1/16.
"""

import numpy as np

from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.transformer import params_of, with_params
from jaxrl_post.rl.advantages import AdvantageConfig, compute_advantages
from jaxrl_post.rl.packing import Trajectory
from jaxrl_post.rl.trainer import Trainer, train_on_rollouts

CFG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                  max_position_embeddings=32, tie_word_embeddings=True)
PROMPTS = [[1, x] for x in range(2, 10)]
COMPLETION = 2


def random_rollout(n, seed=0):
  """n random trajectories over the toy vocabulary, their behaviour logprobs and one
  advantage each (for trainer equivalence tests, where the values need not make sense)."""
  rng = np.random.default_rng(seed)
  trajs = [Trajectory([1] + rng.integers(2, 16, rng.integers(1, 8)).tolist(),
                      rng.integers(2, 16, rng.integers(1, 12)).tolist()) for _ in range(n)]
  behaviour = [rng.normal(-2.0, 0.1, len(t.completion)).tolist() for t in trajs]
  return trajs, behaviour, rng.normal(size=n).astype(np.float32)


def reward(prompt, completion):
  return float(np.mean([t == prompt[1] for t in completion]))


def rollout(trainer, state, k, seed):
  model = with_params(trainer.model, trainer.full_params(state))
  prompts = [p for p in PROMPTS for _ in range(k)]  # Groups of K contiguous.
  out = generate_dense(model, prompts, max_new_tokens=COMPLETION, temperature=1.0, seed=seed)
  trajs = [Trajectory(p, c) for p, c in zip(prompts, out.tokens)]
  rewards = np.array([reward(p, c) for p, c in zip(prompts, out.tokens)], np.float32)
  return trajs, out.logprobs, rewards


def run_grpo(trainer_cfg, steps, k=8, seed=0):
  """Returns the mean reward per step."""
  trainer = Trainer(CFG, trainer_cfg)
  state = trainer.init_state(params_of(init_model(CFG, seed)))
  ref = params_of(init_model(CFG, seed))
  adv_cfg = AdvantageConfig("grpo", group_size=k)
  curve = []
  for step in range(steps):
    trajs, behaviour, rewards = rollout(trainer, state, k, seed=step)
    mask = np.ones((len(trajs), 1), np.float32)
    adv, _ = compute_advantages(rewards, mask, adv_cfg)
    state, _ = train_on_rollouts(trainer, state, trajs, behaviour, np.asarray(adv)[:, 0],
                                  rewards, ref_params=ref, group_size=k)
    curve.append(float(rewards.mean()))
  return curve

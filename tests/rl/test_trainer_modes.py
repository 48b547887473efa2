"""The trainer in its other modes: LoRA adapters, a PPO value head, a sharded mesh."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_post.models import LoraConfig, init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.losses import LossConfig
from jaxrl_post.rl.optim import OptimizerConfig
from jaxrl_post.rl.trainer import Trainer, TrainerConfig, train_on_rollouts
from tests.rl.toy_task import CFG, rollout


def test_lora_trains_only_the_adapters_and_its_reference_is_the_base():
  cfg = dataclasses.replace(CFG, lora=LoraConfig(rank=2, targets=("wq", "w_up")))
  trainer = Trainer(cfg, TrainerConfig(row_tokens=32, optimizer=OptimizerConfig(1e-2),
                                       loss=LossConfig(kl_coef=0.1)))
  state = trainer.init_state(params_of(init_model(cfg, 0)))
  frozen = jax.device_get(state.frozen)
  assert set(state.params["layers"]) == {"wq_lora_a", "wq_lora_b", "w_up_lora_a", "w_up_lora_b"}
  trajs, behaviour, rewards = rollout(trainer, state, k=4, seed=0)
  adv = np.linspace(-1, 1, len(trajs), dtype=np.float32)
  state, history = train_on_rollouts(trainer, state, trajs, behaviour, adv)
  assert history[0]["kl/reference"] == pytest.approx(0, abs=1e-6)  # B starts at zero.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.frozen), frozen)
  assert np.abs(np.asarray(state.params["layers"]["wq_lora_b"])).max() > 0



def test_ppo_with_a_value_head_fits_its_critic():
  cfg = dataclasses.replace(CFG, value_head=True)
  trainer = Trainer(cfg, TrainerConfig(row_tokens=32, optimizer=OptimizerConfig(1e-2)))
  params = params_of(init_model(cfg, 0))
  state = trainer.init_state(params)
  trajs, behaviour, rewards = rollout(trainer, state, k=4, seed=0)
  rewards = rewards + np.linspace(0, 1, len(rewards), dtype=np.float32)
  value_losses = []
  for i in range(8):
    state, history = train_on_rollouts(trainer, state, trajs, behaviour, rewards=rewards,
                                       ref_params=params)
    value_losses.append(history[0]["value_loss"])
  assert value_losses[0] > 0 and value_losses[-1] < 0.5 * value_losses[0], value_losses



def test_sharded_trainer_matches_the_single_device_one():
  from jaxrl_post.sharding import MeshConfig, make_mesh
  from jax.sharding import NamedSharding
  cfg = TrainerConfig(row_tokens=32, optimizer=OptimizerConfig(1e-2), micro_batches=2)
  params = params_of(init_model(CFG, 0))
  results = []
  for mesh in (None, make_mesh(MeshConfig(fsdp=4, tensor=2))):
    trainer = Trainer(CFG, cfg, mesh=mesh)
    state = trainer.init_state(params)
    trajs, behaviour, rewards = rollout(trainer, state, k=4, seed=0)
    # Advantages with a nonzero mean: symmetric ones make the first on-policy loss zero up
    # to rounding, which no relative tolerance can compare.
    adv = np.linspace(-1, 2, len(trajs), dtype=np.float32)
    state, history = train_on_rollouts(trainer, state, trajs, behaviour, adv, ref_params=params)
    if mesh is not None:
      shardings = [x.sharding for x in jax.tree.leaves(state)]
      assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings)
      wq = state.params["layers"]["wq"]
      assert wq.sharding.shard_shape(wq.shape)[2] == CFG.num_heads // 2  # heads over tensor
    results.append((jax.device_get(state.params), history[0]["loss"]))
  assert abs(results[0][1]) > 0.1
  assert results[0][1] == pytest.approx(results[1][1], rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), results[0][0],
               results[1][0])

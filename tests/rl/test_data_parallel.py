"""Data parallelism is a sharding: the packed batch is split over (data, fsdp), each device
does its share of the step's work, and the numbers are those of one device."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxrl_post.models import init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.optim import OptimizerConfig
from jaxrl_post.rl.trainer import (OldPolicy, SequenceScores, Trainer, TrainerConfig,
                                   pack_rollouts)
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rl.helpers import ATOL, RTOL
from tests.rl.toy_task import CFG, random_rollout

N = 64  # trajectories per step: 2 micro-batches of 32, packed into 16 rows each
# Adam's first update is lr * g / (|g| + eps). With the default eps = 1e-8 it is a sign
# function, and gradient entries that cancel to ~1e-8 turn summation-order rounding
# (~1e-11, f32) into 1e-6 parameter differences. eps = 1e-3 keeps the update Lipschitz in
# g (slope lr / eps), so equal parameters below do mean equal gradients.
TRAINER = TrainerConfig(row_tokens=32, micro_batches=2,
                        optimizer=OptimizerConfig(1e-2, eps=1e-3))


def rollout(n=N, seed=0):
  return random_rollout(n, seed)


def one_device() -> Trainer:
  return Trainer(CFG, TRAINER, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))


def sharded_batch(trainer, state, params, trajs=None):
  """One step's inputs on `trainer`'s mesh: (minibatch, scores, reference, old policy).

  The old policy is moved off the current one, as after a minibatch update: ratios then
  spread over the histogram's bins instead of sitting at 1 +- an ulp, on a bin edge.
  """
  trajs, behaviour, adv = rollout() if trajs is None else trajs
  batch, = pack_rollouts(trainer, trajs, behaviour)
  ref = trainer.place(params)
  old = jax.device_get(trainer.old_policy(trainer.full_params(state), batch.inputs))
  m, b, t = old.logprobs.shape  # the same shift for a trajectory however many pad the batch
  shift = np.random.default_rng(1).normal(0.0, 0.1, (m, N, t)).astype(np.float32)[:, :b]
  mask = np.asarray(batch.inputs.completion_mask) > 0
  old = OldPolicy(np.where(mask, old.logprobs + shift, 0.0), old.values)
  scores = SequenceScores.of(len(trajs), adv)
  return batch, scores, ref, trainer.place_batch(old)


def close(actual, expected, what=""):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=RTOL, atol=ATOL, err_msg=what)


def same_results(a, b):
  """(state, metrics) results: every metric and every updated parameter."""
  (state_a, metrics_a), (state_b, metrics_b) = jax.device_get((a, b))
  assert set(metrics_a) == set(metrics_b)
  for key in metrics_a:
    close(metrics_a[key], metrics_b[key], key)
  jax.tree.map(close, state_a.params, state_b.params)


def flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_batch_rows_and_trajectories_are_split_over_data_and_fsdp():
  trainer = Trainer(CFG, TRAINER, make_mesh(MeshConfig(data=2, fsdp=4)))
  params = params_of(init_model(CFG, 0))
  batch, _, _, old = sharded_batch(trainer, trainer.init_state(params), params)
  rows, trajectories = batch.inputs.tokens.shape[1], batch.sequence.shape[1]
  assert rows % 8 == 0 and trajectories % 8 == 0
  for x in jax.tree.leaves((batch, old)):
    assert x.sharding.spec == PartitionSpec(None, ("data", "fsdp")), x.sharding
    assert x.sharding.shard_shape(x.shape)[1] == x.shape[1] // 8


def test_step_flops_per_device_fall_with_eight_devices():
  params = params_of(init_model(CFG, 0))
  sharded = Trainer(CFG, TRAINER, make_mesh(MeshConfig(fsdp=8)))
  state8 = sharded.init_state(params)
  inputs8 = sharded_batch(sharded, state8, params)
  single = one_device()
  state1 = single.init_state(params)
  batch1, scores, _, old1 = jax.device_get(inputs8)
  inputs1 = (single.place_batch(batch1), scores, single.place(params), single.place_batch(old1))
  per_device = flops(sharded._update.lower(state8, inputs8[2], inputs8[0], inputs8[1],
                                           inputs8[3]).compile())
  whole = flops(single._update.lower(state1, inputs1[2], inputs1[0], inputs1[1],
                                     inputs1[3]).compile())
  print(f"step flops per device: 8 devices {per_device:.4g}, 1 device {whole:.4g}, "
        f"ratio {per_device / whole:.3f}")
  assert per_device <= whole / 6


# fsdp8 is the sweep's: data2-fsdp4 shards the parameters over FSDP and splits the rows
# over data too, and tests/rl/test_fused_step.py runs the fused update on fsdp8.
@pytest.mark.parametrize("mesh_cfg", [pytest.param(MeshConfig(fsdp=8), marks=pytest.mark.sweep),
                                      MeshConfig(data=2, fsdp=4)], ids=["fsdp8", "data2-fsdp4"])
def test_sharded_step_equals_the_one_device_step(mesh_cfg):
  params = params_of(init_model(CFG, 0))
  sharded = Trainer(CFG, TRAINER, make_mesh(mesh_cfg))
  state8 = sharded.init_state(params)
  batch8, scores, ref8, old8 = sharded_batch(sharded, state8, params)
  single = one_device()
  one = single.step(single.init_state(params), jax.device_get(batch8), scores, params,
                    jax.device_get(old8))
  assert bool(one[1]["update_finite"]) and float(one[1]["grad_norm"]) > 0
  same_results(sharded.step(state8, batch8, scores, ref8, old8), one)


def test_padding_rows_and_trajectories_change_nothing():
  """Packed for 8 shards (rows a multiple of 8, 2 empty trajectories per micro-batch whose
  per-token inputs are NaN) or for 1: the same loss, metrics and update on one device."""
  params = params_of(init_model(CFG, 0))
  trajs = rollout(n=44)  # 22 per micro-batch: padded to 24 trajectories for 8 shards
  results = []
  for shards in (1, 8):
    trainer = one_device()
    trainer.batch_shards = shards  # pack as an 8-shard trainer would, run on one device
    state = trainer.init_state(params)
    batch, scores, ref, old = jax.device_get(sharded_batch(trainer, state, params, trajs))
    if shards == 8:
      assert batch.inputs.completion_mask.shape[1] == 24
      assert not batch.inputs.completion_mask[:, 22:].any()
      batch = dataclasses.replace(batch, behaviour_logprobs=_junk_after(
          batch.behaviour_logprobs, 22))
      old = jax.tree.map(lambda x: _junk_after(x, 22), old)
    results.append(trainer.step(state, batch, scores, ref, old))
  same_results(*results)



def _junk_after(x, real):  # [M, B, T]: NaN in the padding trajectories
  x = np.array(x, np.float32)
  x[:, real:] = np.nan
  return x

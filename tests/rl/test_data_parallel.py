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
from jaxrl_post.rl.packing import Trajectory
from jaxrl_post.rl.trainer import Trainer, TrainerConfig, prepare_step_batches
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rl.helpers import ATOL, RTOL
from tests.rl.toy_task import CFG

N = 64  # trajectories per step: 2 micro-batches of 32, packed into 16 rows each
# Adam's first update is lr * g / (|g| + eps). With the default eps = 1e-8 it is a sign
# function, and gradient entries that cancel to ~1e-8 turn summation-order rounding
# (~1e-11, f32) into 1e-6 parameter differences. eps = 1e-3 keeps the update Lipschitz in
# g (slope lr / eps), so equal parameters below do mean equal gradients.
TRAINER = TrainerConfig(row_tokens=32, micro_batches=2,
                        optimizer=OptimizerConfig(1e-2, eps=1e-3))


def rollout(n=N, seed=0):
  rng = np.random.default_rng(seed)
  trajs = [Trajectory([1] + rng.integers(2, 16, rng.integers(1, 8)).tolist(),
                      rng.integers(2, 16, rng.integers(1, 12)).tolist()) for _ in range(n)]
  behaviour = [rng.normal(-2.0, 0.1, len(t.completion)).tolist() for t in trajs]
  return trajs, behaviour, rng.normal(size=n).astype(np.float32)


def one_device() -> Trainer:
  return Trainer(CFG, TRAINER, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))


def sharded_batch(trainer, state, params, trajs=None):
  """One step's batch, prepared (packed, old and reference logprobs) on `trainer`'s mesh.

  The old policy is moved off the current one, as after a minibatch update: ratios then
  spread over the histogram's bins instead of sitting at 1 +- an ulp, on a bin edge.
  """
  trajs, behaviour, adv = rollout() if trajs is None else trajs
  batch, = prepare_step_batches(trainer, state, trajs, behaviour, adv, ref_params=params,
                                on_policy=False)
  old = np.asarray(batch.old_logprobs)
  m, b, t = old.shape  # the same shift for a trajectory however many pad the batch
  shift = np.random.default_rng(1).normal(0.0, 0.1, (m, N, t)).astype(np.float32)[:, :b]
  old = np.where(np.asarray(batch.inputs.completion_mask) > 0, old + shift, 0.0)
  return trainer.place_batch(dataclasses.replace(batch, old_logprobs=old))


def close(actual, expected, what=""):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=RTOL, atol=ATOL, err_msg=what)


def same_results(a, b):
  """(state, metrics) pairs: every metric and every updated parameter."""
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
  batch = sharded_batch(trainer, trainer.init_state(params), params)
  rows, trajectories = batch.inputs.tokens.shape[1], batch.advantages.shape[1]
  assert rows % 8 == 0 and trajectories % 8 == 0
  for x in jax.tree.leaves(batch):
    assert x.sharding.spec == PartitionSpec(None, ("data", "fsdp")), x.sharding
    assert x.sharding.shard_shape(x.shape)[1] == x.shape[1] // 8


def test_step_flops_per_device_fall_with_eight_devices():
  params = params_of(init_model(CFG, 0))
  sharded = Trainer(CFG, TRAINER, make_mesh(MeshConfig(fsdp=8)))
  state8 = sharded.init_state(params)
  batch8 = sharded_batch(sharded, state8, params)
  single = one_device()
  state1 = single.init_state(params)
  batch1 = single.place_batch(jax.device_get(batch8))
  per_device = flops(sharded._step.lower(state8, batch8, False).compile())
  whole = flops(single._step.lower(state1, batch1, False).compile())
  print(f"step flops per device: 8 devices {per_device:.4g}, 1 device {whole:.4g}, "
        f"ratio {per_device / whole:.3f}")
  assert per_device <= whole / 6


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=8), MeshConfig(data=2, fsdp=4)],
                         ids=["fsdp8", "data2-fsdp4"])
def test_sharded_step_equals_the_one_device_step(mesh_cfg):
  params = params_of(init_model(CFG, 0))
  sharded = Trainer(CFG, TRAINER, make_mesh(mesh_cfg))
  state8 = sharded.init_state(params)
  batch8 = sharded_batch(sharded, state8, params)
  single = one_device()
  one = single.step(single.init_state(params), jax.device_get(batch8))
  assert bool(one[1]["update_finite"]) and float(one[1]["grad_norm"]) > 0
  same_results(sharded.step(state8, batch8), one)


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
    batch = jax.device_get(sharded_batch(trainer, state, params, trajs))
    if shards == 8:
      assert batch.inputs.completion_mask.shape[1] == 24
      assert not batch.inputs.completion_mask[:, 22:].any()
      batch = dataclasses.replace(batch, **{name: _junk_after(getattr(batch, name), 22)
                                            for name in PER_TOKEN})
    results.append(trainer.step(state, batch))
  same_results(*results)


PER_TOKEN = ("old_logprobs", "behaviour_logprobs", "ref_logprobs", "advantages", "old_values",
             "returns")


def _junk_after(x, real):  # [M, B, T]: NaN in the padding trajectories
  x = np.array(x, np.float32)
  x[:, real:] = np.nan
  return x

"""The fused minibatch update: equal to the unfused reference on 1 and 8 devices, the LM
head at completion positions equal to the head over every position, one program per
minibatch and one metrics fetch per rollout batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.models import init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.forward import PackedInputs, completion_logprobs
from jaxrl_post.rl.losses import LossConfig
from jaxrl_post.rl.optim import OptimizerConfig
from jaxrl_post.rl.packing import (pack, pad_rows, pad_trajectories,
                                   with_head_layout)
from jaxrl_post.rl.trainer import (SequenceScores, Trainer, TrainerConfig, fetch_metrics,
                                   pack_rollouts, train_on_rollouts)
from jaxrl_post.sharding import MeshConfig, activation_rules, make_mesh, TRAINING_RULES
from jaxrl_post.telemetry.dispatch import DispatchCensus
from tests.rl.helpers import ATOL, RTOL
from tests.rl.toy_task import CFG, random_rollout
from tests.rl.unfused import full_position_logprobs, host_arrays, unfused_update

N = 32  # trajectories: 2 minibatches x 2 micro-batches of 8
# Adam's eps at 1e-3 keeps the first update Lipschitz in the gradient (see
# test_data_parallel): equal parameters then mean equal gradients.
TRAINER = TrainerConfig(row_tokens=32, minibatches=2, micro_batches=2,
                        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01),
                        optimizer=OptimizerConfig(1e-2, eps=1e-3))
MESHES = {"1dev": None, "fsdp8": MeshConfig(fsdp=8), "data2-fsdp4": MeshConfig(data=2, fsdp=4)}


def rollout(n=N, seed=0):
  return random_rollout(n, seed)


def close(actual, expected, what=""):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=RTOL, atol=ATOL, err_msg=what)


@pytest.mark.parametrize("mesh_cfg", [
    pytest.param(cfg, marks=pytest.mark.sweep) if name != "fsdp8" else cfg
    for name, cfg in MESHES.items()], ids=MESHES.keys())
def test_fused_update_equals_the_unfused_reference(mesh_cfg):
  """Reference and old-policy logprobs from separate full-position programs, the loss and
  update after: the same metrics of both minibatches and the same parameters."""
  params = params_of(init_model(CFG, 0))
  ref = params_of(init_model(CFG, 1))  # a reference apart from the policy: KL is not 0
  trajs, behaviour, adv = rollout()
  mesh = None if mesh_cfg is None else make_mesh(mesh_cfg)
  trainer = Trainer(CFG, TRAINER, mesh=mesh)
  state = trainer.init_state(params)
  want_params, _, want = unfused_update(trainer, params, {},
                                        jax.device_get(state.opt_state), 0, trajs, behaviour,
                                        adv, ref)
  state, got = train_on_rollouts(trainer, state, trajs, behaviour, adv,
                                 ref_params=trainer.place(ref))
  assert len(got) == len(want) == 2 and int(state.step) == 2
  for n, (g, w) in enumerate(zip(got, want)):
    assert set(w) <= set(g)
    for key in w:
      close(g[key], w[key], f"minibatch {n}: {key}")
  assert got[0]["ratio/p1"] == got[0]["ratio/p99"] == 1.0  # its own forward is the old one
  assert got[1]["ratio/p50"] != 1.0 and got[1]["kl/reference"] > 0
  jax.tree.map(close, jax.device_get(state.params), jax.device_get(want_params))


def packed_batch(shards, rows=None):
  trajs, _, _ = rollout(n=12, seed=3)
  packed = pack(trajs, row_tokens=32)
  packed = pad_rows(packed, rows or len(packed.tokens))
  return packed, with_head_layout(packed, shards)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_head_positions_equal_the_full_position_head(shards):
  """logprob, entropy and their gradients through the head at completion positions only
  (any row-shard layout) equal those of the head over all R * S positions."""
  params = params_of(init_model(CFG, 0))
  packed, laid_out = packed_batch(shards, rows=8)
  head = laid_out.head_index.shape[0]
  assert head < laid_out.tokens.size if shards == 1 else head <= laid_out.tokens.size
  model = init_model(CFG, 0)
  inputs = PackedInputs.from_packed(laid_out)
  arrays = jax.tree.map(jnp.asarray, host_arrays(packed))
  weights = jnp.asarray(np.random.default_rng(0).normal(size=packed.completion_mask.shape),
                        jnp.float32)

  def scalar(fn):
    return lambda p: sum(jnp.sum(w * x) for w, x in zip((weights, 1 - weights), fn(p)))

  ours = lambda p: completion_logprobs(model, p, inputs)
  full = lambda p: full_position_logprobs(model, p, arrays, 1.0)
  jax.tree.map(close, jax.jit(ours)(params), jax.jit(full)(params))
  jax.tree.map(close, jax.jit(jax.grad(scalar(ours)))(params),
               jax.jit(jax.grad(scalar(full)))(params))


def test_head_positions_on_a_mesh_stay_on_each_shard():
  """On 8 devices each shard's head positions lie in its own rows: the same values as on
  one device."""
  mesh = make_mesh(MeshConfig(fsdp=8))
  params = params_of(init_model(CFG, 0))
  packed, laid_out = packed_batch(8, rows=8)
  model = init_model(CFG, 0)
  trainer = Trainer(CFG, TRAINER, mesh=mesh)
  inputs = trainer.place_inputs(PackedInputs.on_host(pad_trajectories(laid_out, 16)))

  def sharded(p, x):
    with activation_rules(TRAINING_RULES, mesh):
      return completion_logprobs(model, p, x)

  got = tuple(x[:12] for x in jax.jit(sharded)(trainer.place(params), inputs))  # the real 12
  want = jax.jit(full_position_logprobs, static_argnums=(0, 3))(
      model, params, jax.tree.map(jnp.asarray, host_arrays(packed)), 1.0)
  jax.tree.map(close, jax.device_get(got), jax.device_get(want))


def test_a_rollout_batch_runs_one_program_per_minibatch_and_fetches_once():
  """After packing and placing, the update runs the old policy of the second minibatch
  (a forward program), then one train program for both minibatches, and nothing else;
  the host waits for the devices once, for all the metrics."""
  trainer = Trainer(CFG, TRAINER)
  params = params_of(init_model(CFG, 0))
  state = trainer.init_state(params)
  trajs, behaviour, adv = rollout()
  ref = jax.device_put(params)
  for step in range(2):  # the first compiles; the second is counted
    scores = SequenceScores.of(N, jnp.asarray(adv), np.ones(N, np.float32))
    batches = pack_rollouts(trainer, trajs, behaviour)
    with DispatchCensus() as census:
      with census.section("train"):
        state, history = trainer.update(state, batches, scores, ref)
        metrics = fetch_metrics(history)
  assert census.executions() == 3 and census.distinct() == 2, census.programs
  assert census.round_trips() == 1
  assert len(metrics) == 2 and isinstance(metrics[0]["loss"], float)

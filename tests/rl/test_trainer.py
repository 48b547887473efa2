"""The jitted trainer step: on-policy canaries, packing and micro-batch equivalence,
non-finite skipping, and a toy task that GRPO must solve (other modes: test_trainer_modes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.models import init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.forward import PackedInputs
from jaxrl_post.rl.losses import LossConfig, global_normaliser
from jaxrl_post.rl.optim import OptimizerConfig
from jaxrl_post.rl.packing import PackedBatch, Trajectory, pack, with_head_layout
from jaxrl_post.rl.trainer import (OldPolicy, Trainer, TrainerConfig, _Micro,
                                   to_completion_layout, train_on_rollouts)
from tests.rl.toy_task import CFG, rollout, run_grpo

GRAD_TOL = 1e-6  # f32: the same sums in another order.


def trajectories(seed=0, n=8):
  rng = np.random.default_rng(seed)
  return [Trajectory([1] + rng.integers(2, 16, rng.integers(1, 5)).tolist(),
                     rng.integers(2, 16, rng.integers(1, 7)).tolist()) for _ in range(n)]


def unpacked(trajs, t):
  """One trajectory per row: the layout packing must be equivalent to."""
  rows = [pack([x], row_tokens=16, max_completion=t) for x in trajs]
  cat = lambda name: np.concatenate([getattr(r, name) for r in rows])
  index = np.concatenate([r.completion_index + i * 16 for i, r in enumerate(rows)])
  mask = cat("completion_mask")
  packed = PackedBatch(cat("tokens"), cat("positions"), cat("segment_ids"), cat("targets"),
                       index * mask.astype(np.int32), mask, head_index=None, head_slot=None)
  return PackedInputs.from_packed(with_head_layout(packed))


def grads_of(trainer, state, inputs_list, groups, adv, behaviour, t, normaliser):
  """Summed gradients of the micro-batch losses (what the scan accumulates)."""
  total = jax.tree.map(jnp.zeros_like, state.params)
  full = trainer.full_params(state)
  for inputs, g in zip(inputs_list, groups):
    old = trainer.logprobs(full, inputs)[0]
    zeros = jnp.zeros_like(old)
    mb = _Micro(inputs, jnp.asarray(to_completion_layout([behaviour[i] for i in g], t)),
                jnp.asarray(adv[g]), jnp.zeros(len(g)), OldPolicy(old, zeros))
    g_ = _micro_grad(trainer, state.params, state.frozen, mb, old, normaliser)
    total = jax.tree.map(jnp.add, total, g_)
  return total


@functools.partial(jax.jit, static_argnums=0)
def _micro_grad(trainer, params, frozen, mb, old, normaliser):
  """One micro-batch's gradient, compiled (op by op it took most of a minute)."""
  return jax.grad(lambda p: trainer._micro_loss(p, frozen, mb, old, normaliser)[0])(params)


# CI runs the default aggregation; the other two share every packing path (-m sweep).
@pytest.mark.slow(reason="a gradient program for each of four packings of the batch")
@pytest.mark.parametrize("aggregation", [
    "token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.sweep),
    pytest.param("seq-mean-token-sum", marks=pytest.mark.sweep)])
def test_packed_and_micro_batched_gradients_equal_the_unpacked_full_batch(aggregation):
  cfg = TrainerConfig(loss=LossConfig(aggregation=aggregation, kl_coef=0.1,
                                      entropy_coef=0.01), row_tokens=16)
  trainer = Trainer(CFG, cfg)
  state = trainer.init_state(params_of(init_model(CFG, 0)))
  trajs = trajectories()
  t = 8
  adv = np.random.default_rng(1).normal(size=len(trajs)).astype(np.float32)
  behaviour = [np.random.default_rng(i).normal(-2, 0.1, len(x.completion)).tolist()
               for i, x in enumerate(trajs)]
  reference = unpacked(trajs, t)
  normaliser = global_normaliser(reference.completion_mask, cfg.loss)
  want = grads_of(trainer, state, [reference], [list(range(8))], adv, behaviour, t, normaliser)
  for groups in ([list(range(8))], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5],
                                                                   [6, 7]]):
    packed = [PackedInputs.from_packed(pack([trajs[i] for i in g], 16, max_completion=t))
              for g in groups]
    got = grads_of(trainer, state, packed, groups, adv, behaviour, t, normaliser)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=GRAD_TOL), got, want)


def test_first_on_policy_step_has_ratio_one_and_no_clipping():
  trainer = Trainer(CFG, TrainerConfig(row_tokens=32, minibatches=2, micro_batches=2,
                                       loss=LossConfig(kl_coef=0.1)))
  state = trainer.init_state(params_of(init_model(CFG, 0)))
  trajs, behaviour, rewards = rollout(trainer, state, k=4, seed=0)
  adv = rewards - rewards.mean() + np.linspace(-1, 1, len(rewards), dtype=np.float32)
  ref = params_of(init_model(CFG, 0))
  state, history = train_on_rollouts(trainer, state, trajs, behaviour, adv, rewards,
                                     ref_params=ref, group_size=4)
  first = history[0]
  for key, value in first.items():
    if key.startswith("ratio/p"):
      assert value == 1.0, key
  assert sum(k.startswith("ratio/p") for k in first) == 3
  assert first["clip_frac_low"] == 0.0 and first["clip_frac_high"] == 0.0
  # The rollout sampled from these very weights: behaviour == trainer logprobs.
  assert first["mismatch/abs_max"] < 1e-4 and first["kl/reference"] == pytest.approx(0, abs=1e-6)
  assert len(history) == 2 and int(state.step) == 2


def test_non_finite_update_is_skipped_and_counted():
  trainer = Trainer(CFG, TrainerConfig(row_tokens=32))
  params = params_of(init_model(CFG, 0))
  state = trainer.init_state(params)
  trajs, behaviour, _ = rollout(trainer, state, k=2, seed=0)
  before = jax.device_get(state.params)
  adv = np.full(len(trajs), np.nan, np.float32)
  state, history = train_on_rollouts(trainer, state, trajs, behaviour, adv, ref_params=params)
  assert history[0]["update_finite"] is False and int(state.skipped) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(state.opt_state)))


def test_no_kl_term_runs_no_reference_forward():
  """At kl_coef 0 the loss needs no reference: the program computes none (no weights are
  needed for it, no kl/reference metric) and the update is the same as with one."""
  params = params_of(init_model(CFG, 0))
  trainer = Trainer(CFG, TrainerConfig(row_tokens=32))
  state = trainer.init_state(params)
  trajs, behaviour, rewards = rollout(trainer, state, k=4, seed=0)
  adv = np.linspace(-1, 1, len(trajs), dtype=np.float32)
  without, history = train_on_rollouts(trainer, state, trajs, behaviour, adv)
  assert "kl/reference" not in history[0] and "kl/behaviour" in history[0]
  ref = params_of(init_model(CFG, 1))
  kl = Trainer(CFG, TrainerConfig(row_tokens=32, loss=LossConfig(kl_coef=1e-30)))
  with_ref, history = train_on_rollouts(kl, kl.init_state(params), trajs, behaviour, adv,
                                        ref_params=kl.place(ref))
  assert history[0]["kl/reference"] > 0
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(without.params),
               jax.device_get(with_ref.params))


@pytest.mark.slow(reason="GRPO trains until the toy task is solved")
def test_grpo_solves_the_toy_task():
  cfg = TrainerConfig(optimizer=OptimizerConfig(learning_rate=3e-3, total_steps=1000),
                      row_tokens=32)
  curve = run_grpo(cfg, steps=200)
  print("toy task reward: start", np.mean(curve[:10]), "end", np.mean(curve[-10:]))
  assert np.mean(curve[:10]) < 0.3
  assert np.mean(curve[-10:]) > 0.95

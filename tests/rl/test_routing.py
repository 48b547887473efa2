"""Routing replay for a MoE policy, from the engine's record to the trainer's metrics.

Whatever makes the rollout's routers pick other experts than the trainer's (bfloat16
decode against a float32 trainer, other kernels, weights a sync behind), replay must make
the trainer take the rollout's experts: its logprobs then come closer to the behaviour
logprobs than with its own routing, and on-policy ratios stay 1 against its own old
policy. A router perturbed on the rollout side makes the disagreement large enough to
measure on a tiny model; a bfloat16 rollout shows the real, rarer one.
"""

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig, MoeConfig, init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.losses import LossConfig
from jaxrl_post.rl.packing import pack
from jaxrl_post.rl.routing import RoutingReplay
from jaxrl_post.rl.trainer import Trainer, TrainerConfig, train_on_rollouts
from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig, SamplingParams, generate
from jaxrl_post.pipeline.rollouts import Group, flatten

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                  max_position_embeddings=64,
                  moe=MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=16))
ENGINE = EngineConfig(num_slots=8, decode_steps=8, prefill_chunk=16, min_table_pages=8,
                      pool=PoolConfig(page_size=4, num_pages=96))


def _params(seed=0):
  params = params_of(init_model(CFG, seed))
  rng = np.random.default_rng(seed)  # A router with some near-ties and some clear picks.
  params["layers"]["router"] = rng.normal(0, 0.3, params["layers"]["router"].shape).astype(
      np.float32)
  return params


def _rollout(params, dtype="bfloat16", router_noise=0.0):
  if router_noise:
    noise = np.random.default_rng(7).normal(0, router_noise, params["layers"]["router"].shape)
    params = {**params, "layers": {**params["layers"],
                                   "router": params["layers"]["router"] + noise}}
  eng = Engine(CFG.replace(compute_dtype=dtype), params, ENGINE)
  prompts = [list(np.random.default_rng(i).integers(2, 64, 6 + i)) for i in range(4)]
  out = generate(eng, prompts, n=4, sampling=SamplingParams(temperature=1.0, max_tokens=10,
                                                            seed=1))
  groups = [Group(None, p, cs) for p, cs in zip(prompts, out)]
  trajs, behaviour = flatten(groups)
  return trajs, behaviour


def _first_step(mode, trajs, behaviour, params):
  trainer = Trainer(CFG, TrainerConfig(row_tokens=64, routing=RoutingReplay(mode, measure=True),
                                       balance_coef=0.01, loss=LossConfig()))
  state = trainer.init_state(params)
  adv = np.linspace(-1, 1, len(trajs), dtype=np.float32)
  _, history = train_on_rollouts(trainer, state, trajs, behaviour, adv)
  return history[0]


def test_trajectories_carry_the_experts_into_the_packed_rows():
  trajs, _ = _rollout(_params())
  assert all(t.experts.shape == (len(t.prompt) + len(t.completion) - 1, 2, 2) for t in trajs)
  packed = pack(trajs[:3], row_tokens=64)
  assert packed.experts.shape == (1, 64, 2, 2)
  n = len(trajs[0].prompt) + len(trajs[0].completion)
  np.testing.assert_array_equal(packed.experts[0, :n - 1], trajs[0].experts)
  assert np.all(packed.experts[0, n - 1] == -1)  # The last token was never fed.


def test_replay_brings_the_trainer_to_the_rollouts_logprobs():
  params = _params()
  trajs, behaviour = _rollout(params, "float32", router_noise=0.05)
  replay = _first_step("replay", trajs, behaviour, params)
  free = _first_step("off", trajs, behaviour, params)
  agreement = replay["routing/expert_agreement"]
  assert 0.5 < agreement < 0.99 and agreement == pytest.approx(free["routing/expert_agreement"])
  # The rest of the gap is the gates: the perturbed router weighs the same experts a bit
  # differently.
  assert replay["routing/mismatch_replay"] < 0.8 * replay["routing/mismatch_free"]
  # Each mode measures the other with the same numbers.
  for key in ("routing/mismatch_replay", "routing/mismatch_free"):
    assert replay[key] == pytest.approx(free[key], rel=1e-5)
  assert replay["mismatch/abs_mean"] == pytest.approx(replay["routing/mismatch_replay"])
  assert free["mismatch/abs_mean"] == pytest.approx(free["routing/mismatch_free"])
  for m in (replay, free):  # On-policy against the trainer's own old logprobs.
    assert all(v == 1.0 for k, v in m.items() if k.startswith("ratio/p"))
    assert m["moe/balance_loss"] >= 1.0


def test_bfloat16_rollout_disagrees_on_a_few_choices():
  params = _params()
  trajs, behaviour = _rollout(params, "bfloat16")
  m = _first_step("replay", trajs, behaviour, params)
  assert 0.9 < m["routing/expert_agreement"] < 1.0
  assert 0 < m["routing/mismatch_replay"] < 1e-2 and 0 < m["routing/mismatch_free"] < 1e-2


def test_float32_rollout_agrees_exactly_and_replay_changes_nothing():
  params = _params(1)
  trajs, behaviour = _rollout(params, dtype="float32")
  m = _first_step("replay", trajs, behaviour, params)
  assert m["routing/expert_agreement"] == 1.0
  assert m["routing/mismatch_replay"] == pytest.approx(m["routing/mismatch_free"], abs=1e-6)
  assert m["routing/mismatch_replay"] < 1e-4


def test_bad_mode_is_a_one_line_error():
  with pytest.raises(UserError, match="mode='sometimes'"):
    RoutingReplay("sometimes")
  with pytest.raises(UserError, match="balance_coef"):
    TrainerConfig(balance_coef=-1.0)

"""Exact off-policy maths under top-k / top-p: the trainer takes each sampled token's
logprob over the same truncated, renormalised distribution the sampler drew it from.

On-policy (the rollout's weights are the trainer's, float32 both), every token's
importance ratio trainer / behaviour must be 1 within float32 rounding with top_p 0.9 and
top_k 20 -- and would not be over the whole vocabulary, which is the bias this removes.
"""

import dataclasses

import numpy as np
import pytest

from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.pipeline.rollouts import Group, flatten
from jaxrl_post.rl.packing import pack
from jaxrl_post.rl.trainer import Trainer, TrainerConfig, pack_micro_batches
from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig, SamplingParams, generate

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                  max_position_embeddings=64)
ENGINE = EngineConfig(num_slots=8, decode_steps=8, prefill_chunk=16, min_table_pages=8,
                      pool=PoolConfig(page_size=4, num_pages=96))
RATIO_TOL = 1e-4  # float32: the same logits in another summation order.
TEMPERATURE = 0.9


def _rollout(sampling):
  params = params_of(init_model(CFG, 3))
  # Logits large enough that top-p 0.9 cuts well inside the vocabulary.
  params["lm_head"] = params["lm_head"] * 40
  prompts = [list(np.random.default_rng(i).integers(2, 97, 5 + 3 * i)) for i in range(4)]
  out = generate(Engine(CFG, params, ENGINE), prompts, n=4, sampling=sampling)
  trajs, behaviour = flatten([Group(None, p, cs) for p, cs in zip(prompts, out)])
  return params, trajs, behaviour


def _ratios(params, trajs, behaviour):
  trainer = Trainer(CFG, TrainerConfig(row_tokens=64, temperature=TEMPERATURE))
  inputs = pack_micro_batches(trajs, [list(range(len(trajs)))], 64,
                              max(len(t.completion) for t in trajs))[0]
  logp, _ = trainer.logprobs(params, inputs)
  mask = np.asarray(inputs.completion_mask) > 0
  beh = np.zeros(mask.shape, np.float32)
  for i, b in enumerate(behaviour):
    beh[i, :len(b)] = b
  return np.exp(np.asarray(logp) - beh)[mask]


@pytest.mark.parametrize("top_k,top_p", [(20, 0.9), (0, 0.9), (20, 1.0)])
def test_on_policy_ratio_is_one_for_every_token_under_truncation(top_k, top_p):
  sampling = SamplingParams(temperature=TEMPERATURE, top_k=top_k, top_p=top_p,
                            max_tokens=12, seed=5)
  params, trajs, behaviour = _rollout(sampling)
  assert all(t.floors is not None and len(t.floors) == len(t.completion) for t in trajs)
  ratios = _ratios(params, trajs, behaviour)
  np.testing.assert_allclose(ratios, 1.0, atol=RATIO_TOL, rtol=0)
  # Over the whole vocabulary the same tokens' ratios are biased below 1.
  plain = [dataclasses.replace(t, floors=None) for t in trajs]
  biased = _ratios(params, plain, behaviour)
  assert np.max(np.abs(biased - 1.0)) > 100 * RATIO_TOL and np.all(biased <= 1.0 + RATIO_TOL)


def test_untruncated_sampling_carries_no_floors():
  _, trajs, _ = _rollout(SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=2))
  assert all(t.floors is None for t in trajs)
  assert pack(trajs, 64).floors is None

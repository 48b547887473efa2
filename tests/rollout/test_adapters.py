"""One engine, several LoRA adapters: sequences of different adapters decode in the same
batch (LoraConfig.adapters; each token keeps its own adapter's rank components), and each
gets the tokens and logprobs of its adapter alone."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import LoraConfig
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.transformer import (init_model, params_of, split_adapters,
                                           stack_adapters, with_params)
from jaxrl_post.rollout import Engine, Request, SamplingParams, generate
from tests.rollout import helpers as H

LORA = LoraConfig(rank=2, alpha=4.0, targets=("wq", "wv", "w_up", "w_down"))


def _adapter(seed, model_cfg=H.CFG, lora=LORA):  # B non-zero: it changes the tokens.
  adapter = split_adapters(params_of(init_model(model_cfg.replace(lora=lora), seed=seed)))[0]
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  return jax.tree.map(lambda x: 0.5 * jax.random.normal(next(keys), x.shape), adapter)


def _with(base, adapter):
  return {**base, "layers": {**base["layers"], **adapter["layers"]}}


def _decode_each_as_alone(model_cfg, lora, engine_cfg):
  """Three adapters' requests decoded in one batch give each adapter's own greedy tokens
  and logprobs. Returns (the engine, the prompts, the outputs)."""
  base = params_of(init_model(model_cfg, seed=0))
  adapters = [_adapter(s, model_cfg, lora) for s in (1, 2, 3)]
  cfg = model_cfg.replace(lora=dataclasses.replace(lora, rank=3 * lora.rank, adapters=3))
  engine = Engine(cfg, _with(base, stack_adapters(adapters)), engine_cfg)
  prompts = H.prompts(np.random.default_rng(0), [3, 9, 5, 12])
  which = [0, 1, 2, 1]
  requests = [Request(tuple(p), SamplingParams(temperature=0.0, max_tokens=10, adapter=k))
              for p, k in zip(prompts, which)]
  out = generate(engine, requests, n=2)
  for i, (prompt, k) in enumerate(zip(prompts, which)):
    alone = with_params(init_model(model_cfg.replace(lora=lora)), _with(base, adapters[k]))
    ref = generate_dense(alone, [prompt], max_new_tokens=10)
    for sample in out[i]:
      assert list(sample.tokens) == ref.tokens[0], (i, k)
      np.testing.assert_allclose(sample.logprobs, ref.logprobs[0], atol=H.LOGPROB_TOL)
  return engine, prompts, out


def test_three_adapters_in_one_batch_decode_as_each_alone():
  engine, prompts, out = _decode_each_as_alone(H.CFG, LORA, H.ENGINE)
  # The adapters matter: the same prompt under adapter 0 and 2 decodes differently.
  assert out[0][0].tokens != generate(engine, [Request(tuple(prompts[0]), SamplingParams(
      temperature=0.0, max_tokens=10, adapter=2))])[0][0].tokens
  with pytest.raises(UserError, match="adapter 3 is not one of this engine's 3"):
    generate(engine, [Request(tuple(prompts[0]), SamplingParams(max_tokens=4, adapter=3))])
  with pytest.raises(UserError, match="prefix_cache"):
    Engine(engine.model_config, engine.params, dataclasses.replace(H.ENGINE, prefix_cache=True))


def test_three_adapters_decode_as_each_alone_where_the_kernels_norm_and_rotate_q_and_k(
    monkeypatch):
  """The GPU's form (layers split, the K/V write in the attention kernel, through the
  Pallas interpreter): with LoRA on wq, wk and wv, each layer's q, k and v leave one
  product with the adapters' deltas from one A and one B product (models.transformer.
  qkv_side_by_side), and the kernels norm (Qwen3's q/k norms) and rotate them."""
  from jaxrl_post.rollout import forward

  monkeypatch.setattr(forward, "appends_in_kernel", lambda *args: True)
  prepared = []
  monkeypatch.setattr(forward, "prepares_in_kernel",
                      lambda *a, was=forward.prepares_in_kernel: prepared.append(was(*a))
                      or prepared[-1])
  lora = dataclasses.replace(LORA, targets=("wq", "wk", "wv", "w_up"))
  jax.clear_caches()  # Traced anew: a CPU's trace of the same shapes writes with a scatter.
  try:
    _decode_each_as_alone(H.CFG.replace(head_dim=16, qk_norm=True), lora,
                          dataclasses.replace(H.ENGINE, split_layers=True))
  finally:
    jax.clear_caches()
  assert prepared and all(prepared), prepared

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


def _adapter(seed):  # B non-zero: an adapter that changes the tokens.
  adapter = split_adapters(params_of(init_model(H.CFG.replace(lora=LORA), seed=seed)))[0]
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  return jax.tree.map(lambda x: 0.5 * jax.random.normal(next(keys), x.shape), adapter)


def _with(base, adapter):
  return {**base, "layers": {**base["layers"], **adapter["layers"]}}


def test_three_adapters_in_one_batch_decode_as_each_alone():
  base = params_of(H.model())
  adapters = [_adapter(s) for s in (1, 2, 3)]
  cfg = H.CFG.replace(lora=dataclasses.replace(LORA, rank=3 * LORA.rank, adapters=3))
  engine = Engine(cfg, _with(base, stack_adapters(adapters)), H.ENGINE)
  prompts = H.prompts(np.random.default_rng(0), [3, 9, 5, 12])
  which = [0, 1, 2, 1]
  requests = [Request(tuple(p), SamplingParams(temperature=0.0, max_tokens=10, adapter=k))
              for p, k in zip(prompts, which)]
  out = generate(engine, requests, n=2)
  for i, (prompt, k) in enumerate(zip(prompts, which)):
    alone = with_params(init_model(H.CFG.replace(lora=LORA)), _with(base, adapters[k]))
    ref = generate_dense(alone, [prompt], max_new_tokens=10)
    for sample in out[i]:
      assert list(sample.tokens) == ref.tokens[0], (i, k)
      np.testing.assert_allclose(sample.logprobs, ref.logprobs[0], atol=H.LOGPROB_TOL)
  # The adapters matter: the same prompt under adapter 0 and 2 decodes differently.
  assert out[0][0].tokens != generate(engine, [Request(tuple(prompts[0]), SamplingParams(
      temperature=0.0, max_tokens=10, adapter=2))])[0][0].tokens
  with pytest.raises(UserError, match="adapter 3 is not one of this engine's 3"):
    generate(engine, [Request(tuple(prompts[0]), SamplingParams(max_tokens=4, adapter=3))])
  with pytest.raises(UserError, match="prefix_cache"):
    Engine(cfg, engine.params, dataclasses.replace(H.ENGINE, prefix_cache=True))

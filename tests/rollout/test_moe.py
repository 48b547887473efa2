"""The engine on the tiny Qwen3-MoE fixture: paged decode equals the dense decoder and
transformers, and the experts it records are the ones the model chooses.

Routing replay needs, for every token the engine fed -- the prompt's tokens (prefilled
once per group, shared by its samples) and every completion token but the last -- the
top-k experts of every MoE layer. A full forward over prompt + completion must choose
exactly those experts, whether the engine ran on one device or with slots over "data"
and experts over "expert".
"""

import dataclasses
import functools
import json
import os

import jax
import numpy as np

from jaxrl_post import models
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.rollout import Engine, SamplingParams, generate
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rollout import helpers as H

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
NAME = "tiny_qwen3_moe"


@functools.lru_cache(maxsize=None)
def qwen3_moe():
  model, _ = models.load(os.path.join(FIXTURES, NAME), compute_dtype="float32")
  return model


def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  expected = np.load(os.path.join(FIXTURES, NAME, "expected.npz"))
  hf_prompts = json.loads(str(expected["greedy_prompts"]))
  return hf_prompts + [rng.integers(0, 320, size=n).tolist() for n in lengths], \
      expected["greedy"].tolist()


def _own_experts(model, prompt, completion):  # -> [P + N - 1, L, k] sorted over k
  seq = list(prompt) + list(completion)[:-1]
  routing = H.full_forward(model, seq)[1]
  return np.sort(np.moveaxis(np.asarray(routing.experts)[:, 0, :len(seq)], 0, 1), axis=-1)


def _check_recorded(model, prompts, out):
  for prompt, samples in zip(prompts, out):
    for c in samples:
      assert c.experts.dtype == np.int16
      assert c.experts.shape == (len(prompt) + len(c.tokens) - 1, 2, 2)
      np.testing.assert_array_equal(np.sort(c.experts, axis=-1),
                                    _own_experts(model, prompt, c.tokens))


def test_paged_greedy_equals_dense_and_transformers_and_records_the_experts():
  model = qwen3_moe()
  prompts, hf_greedy = _prompts((1, 4, 17, 38), 0)  # Page 4, chunk 16.
  sampling = SamplingParams(temperature=0.0, max_tokens=16)
  out = generate(Engine.from_model(model, H.ENGINE), prompts, n=2, sampling=sampling)
  ref = generate_dense(model, prompts, max_new_tokens=16)
  for i, samples in enumerate(out):
    for c in samples:
      assert list(c.tokens) == ref.tokens[i], i
      np.testing.assert_allclose(c.logprobs, ref.logprobs[i], atol=H.LOGPROB_TOL)
  for i, want in enumerate(hf_greedy):
    assert list(out[i][0].tokens) == want, i
  _check_recorded(model, prompts, out)


def test_sampled_rollout_on_a_mesh_with_experts_split_records_the_experts():
  model = qwen3_moe()
  prompts, _ = _prompts((5, 23), 1)
  cfg = dataclasses.replace(H.ENGINE, num_slots=8, group_slots=2)
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=2, tensor=2), jax.devices())
  eng = Engine.from_model(model, cfg, mesh=mesh)
  assert eng.params["layers"]["we_gate"].sharding.spec[1] == "expert"
  # Slots and KV pages split over data x expert (4 shards), not replicated over "expert":
  # each device holds its shard's pages, of the KV heads its tensor shard owns.
  assert eng.shards == 4
  pages = eng.pool.k.shape[2]
  assert {s.data.shape[2] for s in eng.pool.k.addressable_shards} == {pages // 4}
  assert len({s.index for s in eng.pool.k.addressable_shards}) == 8
  out = generate(eng, prompts, n=2, sampling=SamplingParams(temperature=1.0, max_tokens=12,
                                                            seed=3))
  _check_recorded(model, prompts, out)


def test_prompts_served_from_the_prefix_cache_keep_their_experts():
  model = qwen3_moe()
  template = list(range(2, 25))  # 23 shared tokens: 5 whole pages and 3 of the next.
  prompts = [template + [40, 41], template + [50, 51, 52, 53, 54, 55]]
  eng = Engine.from_model(model, dataclasses.replace(H.ENGINE, prefix_cache=True))
  sampling = SamplingParams(temperature=0.0, max_tokens=6)
  out = [generate(eng, [p], sampling=sampling)[0] for p in prompts]
  assert eng.cached_prompt_tokens == 23  # The second prompt prefilled only its own tail.
  _check_recorded(model, prompts, out)

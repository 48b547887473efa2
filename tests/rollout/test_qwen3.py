"""The engine on the tiny Qwen3 fixtures: the q/k norms reach the paged forward.

The paged prefill and decode share `qkv_projection` with the dense forward, so the keys
written to the pool are normed and rotated as the dense cache's are. Greedy tokens must
equal the dense-cache reference decoder (and transformers' own greedy continuations stored
in the fixture), with logprobs within float32 rounding.
"""

import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest

from jaxrl_post import models
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.rollout import Engine, SamplingParams, generate
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rollout import helpers as H

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
STOPS = (5, 11)


@functools.lru_cache(maxsize=None)
def qwen3(name):
  model, _ = models.load(os.path.join(FIXTURES, name), compute_dtype="float32")
  return model


def _compare(out, ref):
  for i, samples in enumerate(out):
    for c in samples:
      assert list(c.tokens) == ref.tokens[i], i
      assert c.finish_reason == ref.finish_reasons[i]
      np.testing.assert_allclose(c.logprobs, ref.logprobs[i], atol=H.LOGPROB_TOL)


def _prompts(name, lengths, seed):
  """transformers' greedy prompts from the fixture, then random ones of these lengths."""
  rng = np.random.default_rng(seed)
  expected = np.load(os.path.join(FIXTURES, name, "expected.npz"))
  hf_prompts = json.loads(str(expected["greedy_prompts"]))
  return hf_prompts + [rng.integers(0, 320, size=n).tolist() for n in lengths], \
      expected["greedy"].tolist()


def test_paged_greedy_equals_the_dense_decoder_and_transformers():
  model = qwen3("tiny_qwen3")
  prompts, hf_greedy = _prompts("tiny_qwen3", (1, 4, 17, 38), 0)  # Page 4, chunk 16.
  sampling = SamplingParams(temperature=0.0, max_tokens=16)
  out = generate(Engine.from_model(model, H.ENGINE), prompts, n=2, sampling=sampling)
  _compare(out, generate_dense(model, prompts, max_new_tokens=16))
  for i, want in enumerate(hf_greedy):
    assert list(out[i][0].tokens) == want, i


@pytest.mark.sweep  # The engine's tensor split of heads is covered by tests/rollout/test_mesh.py.
def test_tied_model_with_heads_split_over_tensor_equals_dense_and_transformers():
  model = qwen3("tiny_qwen3_tied")
  prompts, hf_greedy = _prompts("tiny_qwen3_tied", (3, 9, 21), 1)
  sampling = SamplingParams(temperature=0.0, max_tokens=16, stop_ids=STOPS)
  cfg = dataclasses.replace(H.ENGINE, num_slots=8, group_slots=2)
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
  eng = Engine.from_model(model, cfg, mesh=mesh)
  assert eng.layout.kv_axis == "tensor"  # Each device holds one KV head's pages.
  out = generate(eng, prompts, n=2, sampling=sampling)
  _compare(out, generate_dense(model, prompts, max_new_tokens=16, stop_ids=STOPS))
  for i, want in enumerate(hf_greedy):  # A stop id may end ours first.
    assert list(out[i][0].tokens) == want[:len(out[i][0].tokens)], i

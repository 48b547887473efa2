"""The engine with per-layer weight buffers (rollout.weights; a GPU's default) computes
what the stacked engine does: greedy tokens identical, logprobs within float32 rounding,
on one device and on a mesh, for a dense and an MoE model, through a weight update."""

import dataclasses

import jax
import numpy as np

from jaxrl_post.models.transformer import init_model, params_of
from jaxrl_post.rollout import Engine, SamplingParams, generate
from jaxrl_post.rollout import weights
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.rollout.weights import is_split
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rollout import helpers as H
from tests.rollout.test_moe import _check_recorded, _prompts, qwen3_moe

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _run(engine, prompts, sampling=GREEDY):
  return generate(engine, prompts, n=2, sampling=sampling)


def _assert_same(got, want):
  for g_req, w_req in zip(got, want):
    for g, w in zip(g_req, w_req):
      assert g.tokens == w.tokens
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=H.LOGPROB_TOL)


def test_the_split_follows_the_platform_and_the_config():
  assert not RolloutLayout.build(H.CFG).split_layers  # a CPU mesh
  assert RolloutLayout.build(H.CFG, split_layers=True).split_layers
  eng = H.engine(split_layers=True)
  assert is_split(eng.params) and len(eng.params["layers"]) == H.CFG.num_layers
  assert not is_split(H.engine().params)


def test_split_layers_equal_stacked_on_one_device_and_after_new_weights():
  prompts = H.prompts(np.random.default_rng(3), [1, 4, 9, 17, 30])
  sampled = SamplingParams(temperature=0.8, max_tokens=12)
  want = [_run(H.engine(), prompts, s) for s in (GREEDY, sampled)]
  eng = H.engine(split_layers=True)
  _assert_same(_run(eng, prompts), want[0])
  _assert_same(_run(eng, prompts, sampled), want[1])
  other = params_of(init_model(H.CFG, seed=5))
  stacked = H.engine()
  stacked.set_weights(other, 1)
  eng.set_weights(other, 1)
  assert is_split(eng.params)
  _assert_same(_run(eng, prompts), _run(stacked, prompts))


def test_new_weights_are_placed_without_building_the_model_again(monkeypatch):
  """A run's sync hands the engine new weights every step; building the model's abstract
  template to place them took 6-7 ms of host time each time. The engine keeps it."""
  eng = H.engine(split_layers=True)
  other = params_of(init_model(H.CFG, seed=5))
  eng.set_weights(other, 1)
  built, real = [], weights.template
  monkeypatch.setattr(weights, "template", lambda cfg: built.append(cfg) or real(cfg))
  eng.set_weights(other, 2)  # stacked, split into a copy
  eng.set_weights(eng.params, 3)  # split already, as a run's sync writes them
  assert built == [] and is_split(eng.params) and eng.version == 3


def test_split_layers_on_a_mesh_equal_one_device():
  mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2), jax.devices()[:8])
  prompts = H.prompts(np.random.default_rng(4), [2, 5, 8, 13, 21, 33])
  cfg = dataclasses.replace(H.ENGINE, num_slots=8, split_layers=True)
  got = _run(Engine.from_model(H.model(), cfg, mesh=mesh), prompts)
  _assert_same(got, _run(H.engine(), prompts))


def test_split_layers_record_the_experts_of_an_moe_model():
  model = qwen3_moe()
  prompts, _ = _prompts((3, 17), 1)
  cfg = dataclasses.replace(H.ENGINE, split_layers=True)
  out = _run(Engine.from_model(model, cfg), prompts)
  _assert_same(out, _run(Engine.from_model(model, H.ENGINE), prompts))
  _check_recorded(model, prompts, out)

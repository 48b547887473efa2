"""The multi-turn driver: episodes on the engine, each turn continuing its held pages."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.envs import EpisodeLimits, EpisodeRunner, GuessingGame, TurnFormat
from jaxrl_post.envs.driver import scripted_episode
from jaxrl_post.models import ModelConfig
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import init_model, params_of, with_params
from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig, SamplingParams
from jaxrl_post.sharding import MeshConfig, make_mesh

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                  max_position_embeddings=64)
ENGINE = EngineConfig(num_slots=8, decode_steps=4, prefill_chunk=16, min_table_pages=4,
                      max_seq_len=40, pool=PoolConfig(page_size=4, num_pages=160))
LIMITS = EpisodeLimits(max_turns=4, max_tokens=24)
TOL = 1e-4  # float32, as the engine's own tests


@functools.lru_cache(maxsize=None)
def _model():
  return init_model(CFG, seed=3)


@jax.jit
def _logits(params, tokens):  # [T] -> [T, V]
  m = with_params(_model(), params)
  return m.logits(m(tokens[None], jnp.arange(tokens.shape[0])[None]))[0]


def _episodes(mesh=None, k=4, engine=ENGINE, game=GuessingGame(max_turns=4), limits=LIMITS):
  tok = char_tokenizer()
  problems = [game.split("train")[i] for i in range(5)]
  prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
  engine = Engine.from_model(_model(), engine, mesh=mesh)
  runner = EpisodeRunner(engine, game, TurnFormat(tok, False), limits)
  sampling = SamplingParams(temperature=1.0, max_tokens=3, stop_ids=tok.stop_ids)
  try:
    out = runner.run(problems, prompts, k, sampling, seed=0, step=1)
  finally:
    runner.close()
  assert engine.pages_in_use == 0  # Every episode gave its pages back.
  _episodes.errors, _episodes.failures = runner.env_errors, dict(runner.env_failures)
  return problems, prompts, out


def test_episodes_are_the_policys_own_tokens_with_observations_masked():
  problems, prompts, groups = _episodes()
  turns = 0
  for prompt, group in zip(prompts, groups):
    assert len(group) == 4
    for e in group:
      assert 1 <= len(e.turns) <= 4 and len(e.tokens) <= LIMITS.max_tokens
      mask, logprobs = np.array(e.loss_mask), np.array(e.logprobs)
      assert len(mask) == len(e.tokens) == len(logprobs) == len(e.versions)
      assert np.all(logprobs[mask == 0] == 0.0)
      seq = np.asarray(prompt + list(e.tokens), np.int32)
      # Padded to one length, so one program serves every episode (causal: the padding
      # after the episode changes none of its positions).
      padded = np.zeros(ENGINE.max_seq_len, np.int32)
      padded[:len(seq)] = seq
      full = np.asarray(_logits(params_of(_model()), jnp.asarray(padded)), np.float64)
      full = full[:len(seq)]
      want = jax.nn.log_softmax(full, axis=-1)[len(prompt) - 1:-1]
      picked = np.asarray(want)[np.arange(len(e.tokens)), list(e.tokens)]
      # Every model token's behaviour logprob is the full forward's over the whole
      # history: the held pages and the appended observations are exactly that history.
      np.testing.assert_allclose(logprobs[mask == 1], picked[mask == 1], atol=TOL)
      ids = [t for turn in e.turns for t in turn.observation_ids]
      assert [t for t, m in zip(e.tokens, mask) if m == 0] == ids
      assert e.reward == float(e.solved)
      turns += len(e.turns)
  assert turns > 2 * 20  # Most episodes took several turns.


@pytest.mark.parametrize("pages", [pytest.param(160, marks=pytest.mark.sweep), 60],
                         ids=["roomy", "one_prompt_per_shard"])
def test_episodes_on_a_rollout_mesh_equal_one_device(pages):
  """On 4 data shards; with 60 pages a shard holds one prompt's 4 episodes at their
  longest, so the driver must place each prompt on a shard with no live episodes (held
  pages take no slot: balancing by free slots could pile two prompts on one shard)."""
  engine = dataclasses.replace(ENGINE, pool=PoolConfig(page_size=4, num_pages=pages))
  _, _, one = _episodes(engine=engine)
  mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2), jax.devices()[:8])
  _, _, many = _episodes(mesh, engine=engine)
  for a, b in zip(one, many):
    for x, y in zip(a, b):
      assert x.tokens == y.tokens and x.reward == y.reward
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOL)


def test_episodes_in_cascade_blocks_equal_independent_slots():
  """A prompt's first turns decode in its block (cascade attention over the shared
  prompt); later turns are one-sample requests in solo blocks."""
  _, _, plain = _episodes()
  _, _, blocks = _episodes(engine=dataclasses.replace(ENGINE, group_slots=4))
  for a, b in zip(plain, blocks):
    for x, y in zip(a, b):
      assert x.tokens == y.tokens
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOL)


def _divide_by_zero(reply):
  return 1 / 0


def _sleep_past_the_deadline(reply):
  time.sleep(3.0)


class _Broken(GuessingGame):
  """Problem 0's episodes raise at their first step, problem 1's hang past the timeout
  (module-level functions: the episode is pickled to the worker that steps it)."""

  def reset(self, problem):
    episode = super().reset(problem)
    if problem.id.endswith("-0"):
      episode.step = _divide_by_zero
    elif problem.id.endswith("-1"):
      episode.step = _sleep_past_the_deadline
    return episode


def test_a_raising_or_hung_environment_ends_its_episodes_and_nothing_else():
  limits = dataclasses.replace(LIMITS, step_timeout_s=0.5)
  _, _, groups = _episodes(game=_Broken(max_turns=4), limits=limits)
  assert _episodes.errors == 8  # 2 problems x 4 episodes, each at its first turn
  assert _episodes.failures == {"error": 4, "timeout": 4, "crash": 0}  # Raised; killed.
  for group in groups[:2]:
    assert all(len(e.turns) == 1 and e.reward == 0.0 for e in group)
  assert sum(len(e.turns) for g in groups[2:] for e in g) > 12  # The others played on.


def test_scripted_episodes_mask_the_observations():
  tok = char_tokenizer()
  game = GuessingGame()
  problem = game.split("train")[2]
  ids, mask = scripted_episode(game, problem, TurnFormat(tok, False), LIMITS,
                               np.random.default_rng(0))
  text = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
  assert text.isdigit() and len(text) == len(set(text))
  assert all(tok.decode([t]) in "+-" for t, m in zip(ids, mask) if not m)

"""The engine on the tiny Gemma 3 fixtures: sliding-window and full layers.

Each scanned layer picks its window (and RoPE base) by its index, in the paged prefill and
decode as in the dense forward. The sliding layers keep their K/V in a window pool of
their own and give its pages back as their window passes them. With a window of 6 and pages of 4, prompts and
continuations run well past the window, so the sliding layers skip whole pages the full
layer still reads. Greedy tokens must equal the dense-cache decoder and transformers; the
behaviour logprobs must equal a full (non-cached) forward over prompt + completion.
Cascade decode has no window: engines asked for blocks keep them and decode plainly.
An all-sliding model (Mistral) is tests/rollout/test_window_release.py's.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import models
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.transformer import init_model, params_of, with_params
from jaxrl_post.rollout import Engine, SamplingParams, generate
from jaxrl_post.rollout.forward import cascade_refusal
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rollout import helpers as H

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


@functools.lru_cache(maxsize=None)
def gemma3(name):
  model, _ = models.load(os.path.join(FIXTURES, name), compute_dtype="float32")
  return model


def _prompts(name, lengths, seed):
  """transformers' greedy prompts from the fixture, then random ones of these lengths."""
  rng = np.random.default_rng(seed)
  expected = np.load(os.path.join(FIXTURES, name, "expected.npz"))
  hf_prompts = json.loads(str(expected["greedy_prompts"]))
  vocab = gemma3(name).config.vocab_size
  return hf_prompts + [rng.integers(0, vocab, size=n).tolist() for n in lengths], \
      expected["greedy"].tolist()


def _full_forward_logprobs(model, prompt, tokens):  # -> [len(tokens)] float64
  logprobs = H.log_softmax(H.completion_logits(prompt, tokens, model))
  return logprobs[np.arange(len(tokens)), list(tokens)]


def _check(model, prompts, out, ref):
  for i, samples in enumerate(out):
    want = _full_forward_logprobs(model, prompts[i], samples[0].tokens)
    for c in samples:
      assert list(c.tokens) == ref.tokens[i], i
      np.testing.assert_allclose(c.logprobs, ref.logprobs[i], atol=H.LOGPROB_TOL)
      np.testing.assert_allclose(c.logprobs, want, atol=H.LOGPROB_TOL)


@pytest.mark.slow(reason="the paged engine against the dense decoder and transformers' "
                        "tokens on both fixtures, 16 tokens from six prompts each")
@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_gemma3_softcap"])
def test_paged_greedy_equals_dense_forward_and_transformers(name):
  model = gemma3(name)
  prompts, hf_greedy = _prompts(name, (1, 5, 17, 38), 0)  # Page 4, chunk 16, window 6.
  sampling = SamplingParams(temperature=0.0, max_tokens=16)
  out = generate(Engine.from_model(model, H.ENGINE), prompts, n=2, sampling=sampling)
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=16))
  for i, want in enumerate(hf_greedy):
    assert list(out[i][0].tokens) == want, i


def test_engines_asked_for_cascade_keep_blocks_and_decode_plainly():
  model = gemma3("tiny_gemma3")
  assert cascade_refusal(model.config).startswith("the model has sliding-window layers, ")
  assert cascade_refusal(H.CFG) is None
  cfg = dataclasses.replace(H.ENGINE, group_slots=2, prefix_cache=True)
  eng = Engine.from_model(model, cfg)
  assert not eng.cascade and eng.group_slots == 2
  assert eng.cascade_refused == cascade_refusal(model.config)  # What the run prints.
  assert Engine.from_model(model, H.ENGINE).cascade_refused is None  # Not asked for.
  rng = np.random.default_rng(3)
  head = rng.integers(0, 320, size=9).tolist()  # Shared by every prompt: a cache hit.
  prompts = [head + rng.integers(0, 320, size=n).tolist() for n in (2, 7, 12)]
  sampling = SamplingParams(temperature=0.0, max_tokens=16)
  out = generate(eng, prompts, n=3, sampling=sampling)
  assert eng.cached_prompt_tokens > 0
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=16))


@pytest.mark.sweep  # The engine's mesh split is covered by tests/rollout/test_mesh.py.
def test_heads_and_rows_split_over_a_mesh_equal_the_dense_decoder():
  model = gemma3("tiny_gemma3")
  prompts, hf_greedy = _prompts("tiny_gemma3", (3, 21), 1)
  cfg = dataclasses.replace(H.ENGINE, num_slots=8)
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
  out = generate(Engine.from_model(model, cfg, mesh=mesh), prompts, n=2,
                 sampling=SamplingParams(temperature=0.0, max_tokens=16))
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=16))
  for i, want in enumerate(hf_greedy):
    assert list(out[i][0].tokens) == want, i


def test_soft_capped_attention_scores_in_the_paged_forward():
  """attn_logit_softcapping (no Gemma 3 checkpoint sets it; transformers' Gemma 3 ignores
  it) reaches every attention path of ours: paged == dense == full forward, and the cap
  changes the tokens' logprobs."""
  base = gemma3("tiny_gemma3")
  model = with_params(init_model(base.config.replace(attn_logit_softcapping=0.5)),
                      params_of(base))
  prompts, _ = _prompts("tiny_gemma3", (9,), 2)
  sampling = SamplingParams(temperature=0.0, max_tokens=12)
  out = generate(Engine.from_model(model, H.ENGINE), prompts, n=1, sampling=sampling)
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=12))
  uncapped = _full_forward_logprobs(base, prompts[0], out[0][0].tokens)
  assert np.abs(uncapped - np.asarray(out[0][0].logprobs)).max() > 1e-3


def test_sliding_layers_hold_only_their_windows_pages():
  """Gemma 3's sliding layers (3 of the fixture's 4) store K/V in the window pool, and a
  decoding sequence gives back the window pages its window (6 tokens) has passed: they
  hold a few pages per sequence while the global layer holds every page, and the tokens
  and logprobs stay the dense decoder's."""
  model = gemma3("tiny_gemma3")
  engine = Engine.from_model(model, H.ENGINE)
  assert (engine.pool.k.shape[1], engine.pool.wk.shape[1]) == (1, 3)  # [Hkv, L, pages, ...]
  prompts, _ = _prompts("tiny_gemma3", (5, 17, 38), 3)
  sampling = SamplingParams(temperature=0.0, max_tokens=80)  # Up to 30 pages of 4.
  out = generate(engine, prompts, n=2, sampling=sampling)
  main, window = engine.alloc, engine.alloc.window.alloc
  # Measured: 51 global-layer pages at the peak against 16 window pages (a window of 6
  # spans 2-3 pages; the rest are pages grown ahead for the decode calls in flight and
  # prompt pages still shared by a group's other sample).
  assert window.peak_in_use * 3 <= main.peak_in_use, (window.peak_in_use, main.peak_in_use)
  assert engine.window_pages_in_use == engine.pages_in_use == 0  # All given back once.
  assert window.reserved == main.reserved == 0
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=80))


def test_cached_prompts_share_their_window_pages_and_decode_as_prefilled_whole():
  """Prompts with a 22-token common prefix (past the window of 6): later prompts take the
  cached pages, the sliding layers' window pages with them, and decode as the dense
  decoder does; once the cache is dropped every window page is back."""
  model = gemma3("tiny_gemma3")
  rng = np.random.default_rng(5)
  common = rng.integers(0, model.config.vocab_size, 22).tolist()
  prompts = [common + rng.integers(0, model.config.vocab_size, n).tolist() for n in (3, 9, 5)]
  engine = Engine.from_model(model, dataclasses.replace(H.ENGINE, prefix_cache=True,
                                                        prefill_rows=1))
  sampling = SamplingParams(temperature=0.0, max_tokens=24)
  out = generate(engine, prompts, n=1, sampling=sampling)
  assert engine.cached_prompt_tokens >= 2 * 20  # Five whole pages of 4 for each later prompt.
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=24))
  assert engine.window_pages_in_use > 0  # The cache keeps its pages' window parts.
  engine.drop_prefix_cache()
  assert engine.window_pages_in_use == engine.pages_in_use == 0


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_mixed_window_decode_lowers_with_the_kernel_on_both_kinds_of_layer(platform):
  """For a GPU or TPU both branches of the layer scan's lax.cond are the paged kernel: the
  full layers' over every page, the sliding layers' over its window's pages only."""
  from jaxrl_post.models import layers as L
  from jaxrl_post.rollout.attention import paged_decode_attention
  from tests.kernels.test_lowering import export, kernel_calls, paged_args
  cfg = gemma3("tiny_gemma3").config
  attend = L.per_layer(cfg, lambda window: functools.partial(paged_decode_attention,
                                                             sliding_window=window))

  def decode_attention(q, k_pool, v_pool, table, lengths):  # every layer's output
    k_pool, v_pool = (jnp.broadcast_to(p[:, None], (p.shape[0], cfg.num_layers, *p.shape[1:]))
                      for p in (k_pool, v_pool))
    body = lambda c, layer: (c, attend(layer, q, k_pool, v_pool, layer, table, lengths))
    return jax.lax.scan(body, 0, jnp.arange(cfg.num_layers))[1]

  text = export(platform, decode_attention, *paged_args(jnp.bfloat16))
  assert kernel_calls(platform, text) == 2 and "stablehlo.case" in text


def test_the_engine_with_the_kernels_decodes_as_the_dense_decoder(monkeypatch):
  """The engine as it runs on a GPU (the Triton kernels, interpreted here): prefill through
  kernels.paged_prefill on both branches of the layer cond (a sliding layer reads its
  window pool's pages, only those its window spans), prompts continuing after cached
  pages past the window, decode through the paged kernel: the dense decoder's tokens and
  logprobs."""
  from jaxrl_post.rollout import attention
  monkeypatch.setattr(attention, "on_accelerator", lambda: True)
  model = gemma3("tiny_gemma3")
  rng = np.random.default_rng(7)
  common = rng.integers(0, model.config.vocab_size, 13).tolist()
  prompts = [common + rng.integers(0, model.config.vocab_size, n).tolist() for n in (2, 11)]
  prompts.append(rng.integers(0, model.config.vocab_size, 30).tolist())
  engine = Engine.from_model(model, dataclasses.replace(H.ENGINE, prefix_cache=True,
                                                        prefill_rows=1))
  out = generate(engine, prompts, n=1, sampling=SamplingParams(temperature=0.0, max_tokens=10))
  assert engine.cached_prompt_tokens > 0
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=10))

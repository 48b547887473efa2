"""An all-sliding model (Mistral) gives back every page its window has passed.

Every layer of the tiny test model gets a window of 6 (pages of 4), so a sequence decoding
80 tokens holds its window's few pages instead of all of them; the tokens and logprobs stay
the dense decoder's. Gemma 3's mixed layers are tests/rollout/test_gemma3.py's.
"""

import dataclasses

import numpy as np

from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.transformer import init_model, params_of, with_params
from jaxrl_post.rollout import Engine, SamplingParams, generate
from tests.rollout import helpers as H
from tests.rollout.test_gemma3 import _check, gemma3


def test_pages_behind_every_layers_window_are_given_back_while_decoding():
  """An all-sliding model (Mistral) gives back pages no layer reads again, so it holds a
  few pages per sequence instead of all of them; Gemma 3's global layer keeps every page."""
  assert Engine.from_model(gemma3("tiny_gemma3"), H.ENGINE).release_window is None
  cfg = dataclasses.replace(H.CFG, sliding_window=6)
  params = params_of(H.model())
  prompts = H.prompts(np.random.default_rng(7), [3, 21])
  sampling = SamplingParams(temperature=0.0, max_tokens=80)  # 21 pages of 4 at most.
  windowed = Engine(cfg, params, H.ENGINE)
  assert windowed.release_window == 6
  out = generate(windowed, prompts, n=1, sampling=sampling)
  full = Engine(H.CFG, params, H.ENGINE)
  generate(full, prompts, n=1, sampling=sampling)
  # Measured: 14 pages against 46 (the window's 2-3 pages per sequence, plus those grown
  # ahead for the decode calls in flight).
  assert windowed.alloc.peak_in_use <= full.alloc.peak_in_use // 3
  assert windowed.pages_in_use == 0 and windowed.alloc.reserved == 0  # All given back once.
  model = with_params(init_model(cfg), params)
  _check(model, prompts, out, generate_dense(model, prompts, max_new_tokens=80))

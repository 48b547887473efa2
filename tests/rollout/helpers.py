"""Shared builders for the rollout tests: one tiny float32 model and one engine shape.

Every test engine has the same shapes (slots, decode steps, page size, pool size, table
width), so the jitted prefill/decode functions compile once per test process.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models import ModelConfig
from jaxrl_post.models.transformer import init_model
from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                  max_position_embeddings=128)
PAGE_SIZE = 4
LOGPROB_TOL = 1e-4  # float32: the same maths as the full forward, summed in another order.
NUM_PAGES = 64
ENGINE = EngineConfig(num_slots=4, decode_steps=8, prefill_chunk=16, min_table_pages=32,
                      pool=PoolConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES))


@functools.lru_cache(maxsize=None)
def model(seed: int = 1):
  return init_model(CFG, seed=seed)


def engine(version: int = 0, **changes) -> Engine:
  return Engine.from_model(model(), dataclasses.replace(ENGINE, **changes), version=version)


def prompts(rng, lengths):
  return [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]


@nnx.jit
def _routed_logits(model, tokens):  # [1, T] -> (logits [1, T, V], routing or None)
  hidden, routing = model.forward_routed(tokens, jnp.arange(tokens.shape[1])[None])
  return model.logits(hidden), routing


def full_forward(model, ids, bucket: int = 32):
  """Any model's full (non-cached) forward over ids: logits [len(ids), V] as float64 and
  its MoE routing (moe.Routing, or None), compiled once per model and bucket of lengths
  (eagerly, each op and the layer scan compiled per length). Padding on the right changes
  no earlier position: attention is causal and no expert drops a token for capacity."""
  n = len(ids)
  padded = np.zeros((1, -(-n // bucket) * bucket), np.int32)
  padded[0, :n] = ids
  logits, routing = _routed_logits(model, jnp.asarray(padded))
  return np.asarray(logits, np.float64)[0, :n], routing


def completion_logits(prompt, tokens, m=None):  # -> [len(tokens), V]: each token's logits
  """Logits of a full (non-cached) forward of m (the tiny model by default) over prompt +
  completion, at the positions that predicted the completion's tokens."""
  logits = full_forward(m if m is not None else model(), list(prompt) + list(tokens))[0]
  return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def log_softmax(x):  # [..., V] float64
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def truncated_logprobs(logits, temperature, top_k=0, top_p=1.0):  # [N, V] -> [N, V], -inf cut
  """The renormalised distribution after temperature, top-k, then top-p (float64)."""
  scaled = logits / temperature
  out = np.full_like(scaled, -np.inf)
  for i, row in enumerate(scaled):
    order = np.argsort(-row, kind="stable")
    k = top_k if top_k > 0 else row.size
    kept = order[:k]
    p = np.exp(log_softmax(row[kept]))
    mass_before = np.cumsum(p) - p
    kept = kept[mass_before < top_p]
    out[i, kept] = log_softmax(row[kept])
  return out


def check_behaviour_logprobs(prompts, out, temperature, top_k=0, top_p=1.0):
  """Asserts every sampled token's logprob is the full forward's truncated one; returns
  how many tokens were checked."""
  checked = 0
  for prompt, samples in zip(prompts, out):
    for c in samples:
      logits = completion_logits(prompt, c.tokens)
      want = truncated_logprobs(logits, temperature, top_k, top_p)
      picked = want[np.arange(len(c.tokens)), list(c.tokens)]
      assert np.all(np.isfinite(picked)), "a token outside the kept set was sampled"
      np.testing.assert_allclose(c.logprobs, picked, atol=LOGPROB_TOL)
      checked += len(c.tokens)
  return checked

"""A simple dense-KV-cache decoder: the reference the paged rollout engine is tested against.

Prompts are right-padded into one batch and prefilled at once; then a jitted
lax.while_loop decodes on the device until every row has stopped, so the host is touched
once per call, not once per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.errors import UserError
from jaxrl_post.models.transformer import KVCache, Transformer

# Prompt and cache lengths are rounded up so nearby prompt sizes share one compile.
_PROMPT_BUCKET = 16
_CACHE_BUCKET = 64


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class DecodeResult:
  tokens: list[list[int]]  # Generated ids per prompt, including the stop token if one ended it.
  logprobs: list[list[float]]  # Log-probability of each under the distribution sampled from.
  finish_reasons: list[str]  # "stop" or "length".


def sample(logits, key, temperature: float):  # [B, V] f32 -> tokens [B], logprobs [B]
  """Greedy when temperature == 0, else sampling from softmax(logits / temperature)."""
  if temperature == 0.0:
    logp = jax.nn.log_softmax(logits, axis=-1)
    tokens = jnp.argmax(logits, axis=-1)
  else:
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    tokens = jax.random.categorical(key, logp, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "temperature", "cache_len"))
def _generate(model: Transformer, tokens, lengths, stop_ids, key, *, max_new_tokens: int,
              temperature: float, cache_len: int):
  """tokens [B, P] right-padded, lengths [B] -> (out [B, N], logprobs [B, N], n [B], stopped [B])."""
  b, p = tokens.shape
  cache = KVCache.zeros(model.config, b, cache_len)
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  hidden, cache = model.forward_cached(tokens, positions, cache, jnp.zeros((b,), jnp.int32))
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  first, first_lp = sample(model.logits(last), jax.random.fold_in(key, 0), temperature)

  out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
  lps = jnp.zeros((b, max_new_tokens), jnp.float32).at[:, 0].set(first_lp)
  done = jnp.isin(first, stop_ids)
  n = jnp.ones((b,), jnp.int32)

  def cond(state):
    step, _, _, _, done, _ = state
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(state):
    step, cache, out, lps, done, n = state
    pos = lengths + step - 1  # Position of the token fed in this step.
    tok = out[:, step - 1]
    h, cache = model.forward_cached(tok[:, None], pos[:, None], cache, pos)
    nxt, lp = sample(model.logits(h[:, 0]), jax.random.fold_in(key, step), temperature)
    out = out.at[:, step].set(jnp.where(done, 0, nxt))
    lps = lps.at[:, step].set(jnp.where(done, 0.0, lp))
    n = n + (~done).astype(jnp.int32)
    done = done | jnp.isin(nxt, stop_ids)
    return step + 1, cache, out, lps, done, n

  state = (jnp.int32(1), cache, out, lps, done, n)
  _, _, out, lps, done, n = jax.lax.while_loop(cond, body, state)
  return out, lps, n, done


def generate_dense(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   temperature: float = 0.0, seed: int = 0,
                   stop_ids: Sequence[int] = ()) -> DecodeResult:
  """Decodes a batch of prompts with a dense KV cache.

  Raises:
    UserError: an empty prompt, or prompt + max_new_tokens beyond the model's context.
  """
  if max_new_tokens < 1:
    raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise UserError(f"temperature must be >= 0, got {temperature}")
  context = model.config.max_position_embeddings
  for ids in prompts:
    if not ids:
      raise UserError("the prompt is empty after tokenization")
    if len(ids) + max_new_tokens > context:
      raise UserError(f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                      f"it exceeds the model's context of {context} tokens")
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded = np.zeros((len(prompts), _round_up(int(lengths.max()), _PROMPT_BUCKET)), np.int32)
  for i, ids in enumerate(prompts):
    padded[i, :len(ids)] = ids
  # Slot == position: prefill fills slots [0, padded), decoding up to max length + N.
  need = max(padded.shape[1], int(lengths.max()) + max_new_tokens)
  cache_len = _round_up(need, _CACHE_BUCKET)
  stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
  out, lps, n, done = jax.device_get(_generate(
      model, jnp.asarray(padded), jnp.asarray(lengths), stops, jax.random.key(seed),
      max_new_tokens=max_new_tokens, temperature=float(temperature), cache_len=cache_len))
  return DecodeResult(tokens=[out[i, :n[i]].tolist() for i in range(len(prompts))],
                      logprobs=[lps[i, :n[i]].tolist() for i in range(len(prompts))],
                      finish_reasons=["stop" if d else "length" for d in done])

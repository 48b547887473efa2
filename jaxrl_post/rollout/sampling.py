"""Token sampling with behaviour log-probabilities, per-row settings and per-request keys.

RL needs the log-probability of each token under the distribution it was actually drawn
from (the behaviour policy), so that is what comes back: after temperature, top-k and top-p
truncation, renormalised. Greedy rows report the untempered model log-probability of the
argmax (there is no distribution to report; this matches the dense reference decoder).

Randomness is a function of the request only: the key of token t of sample i of a request
with seed s is fold_in(fold_in(key(s), i), t). A request's tokens therefore do not depend on
which slot it sits in or what else is in the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to draw a completion.

  Attributes:
    temperature: 0 means greedy.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of most likely tokens with mass >= top_p; 1 keeps all.
    max_tokens: completion length limit (finish reason "length").
    stop_ids: token ids that end a completion (finish reason "stop"); the stop token is
      returned as the completion's last token.
    seed: the seed of requests that do not carry their own.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_tokens: int = 16
  stop_ids: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise UserError(f"sampling: temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise UserError(f"sampling: top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise UserError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
    if self.max_tokens < 1:
      raise UserError(f"sampling: max_tokens must be >= 1, got {self.max_tokens}")
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))


def token_keys(seeds, sample_ids, token_index):  # [B] x3 int -> [B] keys
  """Per-row keys: fold_in(fold_in(key(seed), sample), token index)."""
  def one(seed, sample, t):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample), t)
  return jax.vmap(one)(seeds, sample_ids, token_index)


def truncate(scaled, top_k, top_p):  # [B, V] f32, [B] int32, [B] f32 -> [B, V]
  """Top-k then top-p: logits outside the kept set become -inf.

  Top-p applies to the top-k distribution (renormalised). Ties at a cut-off are all kept.
  """
  v = scaled.shape[-1]
  desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
  ranks = jnp.arange(v)[None, :]
  desc = jnp.where(ranks < k[:, None], desc, -jnp.inf)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.sum((mass_before < top_p[:, None]) & (ranks < k[:, None]), axis=-1)  # [B] >= 1
  cutoff = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
  return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def sample(logits, keys, temperature, top_k, top_p):
  """Draws one token per row.

  Args:
    logits: [B, V] float32.
    keys: [B] typed PRNG keys.
    temperature: [B] float32, 0 for greedy.
    top_k: [B] int32, 0 for off.
    top_p: [B] float32, 1 for off.

  Returns:
    (tokens [B] int32, logprobs [B] float32 under the distribution sampled from).
  """
  greedy = temperature <= 0.0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  # The sort behind truncation costs more than the rest: skip it when no row asks for it.
  needs_cut = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
  cut = jax.lax.cond(needs_cut, truncate, lambda s, k, p: s, scaled, top_k, top_p)
  scaled = jnp.where(greedy[:, None], logits, cut)
  best = jnp.argmax(logits, axis=-1)
  # A draw makes [B, V] random bits, a large part of a greedy decode step on a CPU: skip
  # it when every row is greedy (evaluation, greedy generation).
  drawn = jax.lax.cond(jnp.all(greedy), lambda k, s: best,
                       lambda k, s: jax.vmap(jax.random.categorical)(k, s), keys, scaled)
  tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

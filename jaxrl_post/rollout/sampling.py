"""Token sampling with behaviour log-probabilities, per-row settings and per-request keys.

RL needs the log-probability of each token under the distribution it was actually drawn
from (the behaviour policy), so that is what comes back: after temperature, top-k and top-p
truncation, renormalised. Greedy rows report the untempered model log-probability of the
argmax (there is no distribution to report; this matches the dense reference decoder).

Randomness is a function of the request only: the key of token t of sample i of a request
with seed s is fold_in(fold_in(key(s), i), t). A request's tokens therefore do not depend on
which slot it sits in or what else is in the batch.

Each truncated draw also reports its kept set as a floor on the scaled logits (halfway
between the smallest kept one and the largest dropped one), so the trainer can take the
token's logprob over the same renormalised set (kernels.chunked_logprob's `floor`) and
the on-policy importance ratio is exactly 1 under top-k and top-p too.
"""

from __future__ import annotations

import functools

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.sharding import constrain, on_accelerator


def check_sampling(temperature, top_k, top_p, max_tokens,
                   name: Callable[[str], str] = lambda field: f"sampling: {field}") -> None:
  """Sampling settings' mistakes as one UserError line. `name` spells a field as the
  caller's user knows it (SamplingParams' field, or a command's flag)."""
  if not temperature >= 0:  # NaN too.
    raise UserError(f"{name('temperature')} must be >= 0, got {temperature}")
  if top_k < 0:
    raise UserError(f"{name('top_k')} must be >= 0 (0 keeps every token), got {top_k}")
  if not 0.0 < top_p <= 1.0:
    raise UserError(f"{name('top_p')} must be in (0, 1] (1 keeps every token), got {top_p}")
  if max_tokens < 1:
    raise UserError(f"{name('max_tokens')} must be >= 1, got {max_tokens}")


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
    adapter: which of an engine's adapters the completion is drawn with (a model whose
      LoraConfig holds several; 0 otherwise).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_tokens: int = 16
  stop_ids: tuple[int, ...] = ()
  seed: int = 0
  adapter: int = 0

  def __post_init__(self):
    check_sampling(self.temperature, self.top_k, self.top_p, self.max_tokens)
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))

  @property
  def truncates(self) -> bool:
    """Whether top-k or top-p is on (the programs' static `truncation`)."""
    return self.top_k > 0 or self.top_p < 1.0

  @property
  def draws(self) -> bool:
    """Whether tokens are drawn at random (not greedy; the programs' static `draws`)."""
    return self.temperature > 0.0


def token_keys(seeds, sample_ids, token_index):  # [B] x3 int -> [B] keys
  """Per-row keys: fold_in(fold_in(key(seed), sample), token index)."""
  def one(seed, sample, t):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample), t)
  return jax.vmap(one)(seeds, sample_ids, token_index)


def truncate(scaled, top_k, top_p):  # [B, V] f32, [B] int32, [B] f32 -> [B, V], [B]
  """Top-k then top-p: logits outside the kept set become -inf.

  Top-p applies to the top-k distribution (renormalised). Ties at a cut-off are all kept.
  Also returns each row's floor: a threshold between the kept logits and the dropped ones
  (-inf when nothing is dropped), away from both, so a recomputation of the logits that
  differs in the last bits still selects the same set.
  """
  v = scaled.shape[-1]
  # Whole rows on each row's devices: the sort gathers them anyway, and the cumulative
  # sum below over a vocabulary split between GPUs runs as a loop of one step per token.
  scaled = constrain(scaled, ("batch", None))
  desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
  ranks = jnp.arange(v)[None, :]
  desc = jnp.where(ranks < k[:, None], desc, -jnp.inf)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.sum((mass_before < top_p[:, None]) & (ranks < k[:, None]), axis=-1)  # [B] >= 1
  cutoff = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
  dropped = jnp.max(jnp.where(scaled < cutoff, scaled, -jnp.inf), axis=-1)  # [B]
  floor = jnp.where(jnp.isfinite(dropped), 0.5 * (cutoff[:, 0] + dropped), -jnp.inf)
  return jnp.where(scaled >= cutoff, scaled, -jnp.inf), floor


def first_argmax(x, best=None):  # [B, V](, [B, 1] its max) -> [B] int32
  """The first index of each row's maximum, as jnp.argmax, in two vectorised reductions
  (a max, then a min over matching indices): XLA's CPU argmax is several times slower."""
  best = jnp.max(x, axis=-1, keepdims=True) if best is None else best
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x == best, index, x.shape[-1] - 1), axis=-1)


_BLOCK = 128  # Largest vocabulary block of the two-level inverse CDF.
_MAX_VOCAB_SHARDS = 8


def _block_size(v: int) -> int:
  """The inverse CDF's vocabulary block: the largest power of two up to _BLOCK whose
  blocks split evenly over up to 8 vocabulary shards, so that the blocks of a tensor-
  parallel LM head's logits stay on their devices (128-token blocks of Llama 3's 128256
  tokens over 4 shards straddled them, and XLA gathered the f32 logits every step). A
  vocabulary that is not a multiple of 8 is padded to 128-token blocks. The block depends
  on the vocabulary only: the same request draws the same tokens on any mesh."""
  if v % _MAX_VOCAB_SHARDS:
    return _BLOCK
  per_shard = v // _MAX_VOCAB_SHARDS
  return min(_BLOCK, per_shard & -per_shard)  # the largest power of two dividing it


def _last_positive(x):  # [..., N] >= 0 -> [...] index of the last entry > 0 (0 if none)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(x > 0, index, 0), axis=-1)


def inverse_cdf_draw(keys, scaled):  # [B] keys, [B, V] float32 (-inf: excluded) -> [B]
  """One categorical draw per row from softmax(scaled) with a single uniform per row."""
  return _draw(keys, scaled)[0]


def _block_stats(scaled, blk):
  """(each row's max [B, 1], its blocks' masses exp(scaled - max) summed [B, nb], the first
  index of its max [B]) in separate passes over the row: the max, then the masses and the
  argmax after it."""
  b, v = scaled.shape
  peak = jnp.max(scaled, axis=-1, keepdims=True)
  p = jnp.exp(scaled - peak)  # Only reduced here: no [B, V] array is written.
  mass = jnp.pad(p, ((0, 0), (0, -v % blk))).reshape(b, -1, blk).sum(-1)
  return peak, mass, first_argmax(scaled, peak)


def _online(a, b):  # Two (max, sum of exp(x - max), first index of max) -> their union's.
  (m1, s1, i1), (m2, s2, i2) = a, b
  m = jnp.maximum(m1, m2)
  shift = jnp.where(m == -jnp.inf, 0.0, m)  # Both empty: no -inf - -inf.
  total = s1 * jnp.exp(m1 - shift) + s2 * jnp.exp(m2 - shift)
  first = jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))
  return m, total, first


def _block_stats_one_pass(scaled, blk):
  """_block_stats reading the row once: each block's max, its mass over that max and its
  argmax in one variadic reduction (the online softmax's), then the [B, nb] blocks brought
  to the row's max. On a GPU or TPU each pass over the f32 logits is a sixth of a 1B
  layer's weights at a few hundred rows (131 MB at 256 rows of Llama 3's vocabulary), and
  XLA:TPU writes exp(x - max) out before summing it; on a CPU the reduction runs element
  by element, two to three times slower than the separate passes."""
  b, v = scaled.shape
  x = jnp.pad(scaled, ((0, 0), (0, -v % blk)), constant_values=-jnp.inf).reshape(b, -1, blk)
  # Indices within the block: a block index times blk here is a launch of its own a step.
  within = jax.lax.broadcasted_iota(jnp.int32, x.shape, 2)
  init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(blk))
  top, mass, first = jax.lax.reduce((x, (x > -jnp.inf).astype(jnp.float32), within), init,
                                    _online, (2,))
  top, mass, first = (constrain(a, ("batch", None)) for a in (top, mass, first))
  peak = jnp.max(top, axis=-1, keepdims=True)
  mass = jnp.where(top > -jnp.inf, mass * jnp.exp(top - peak), 0.0)
  block = first_argmax(top, peak)
  best = block * blk + jnp.take_along_axis(first, block[:, None], axis=-1)[:, 0]
  return peak, mass, best


def _draw(keys, scaled, one_pass: bool | None = None):
  """(tokens [B], their scaled logits [B], each row's max [B], log of its mass over that
  max [B], the first index of its max [B]) of inverse_cdf_draw: max + log mass is the
  row's log-sum-exp and the token's logit is in its block, so the draw's logprob needs no
  pass of its own over the row. `one_pass` (static; default: on a GPU or TPU, the platform
  the program is traced for) reads the row once (_block_stats_one_pass).

  The Gumbel-max draw needs V random numbers per row, most of a sampled decode step on a
  CPU. Here the uniform's share of the row's mass is located first among blocks of
  tokens (cumulative block masses; see _block_size), then inside the chosen block. Tokens
  of zero probability are never chosen: counting "cumulative <= target" steps over them,
  and the indices are clipped to the last block / token with mass.
  """
  v = scaled.shape[1]
  blk = _block_size(v)
  one_pass = on_accelerator() if one_pass is None else one_pass
  stats = _block_stats_one_pass if one_pass else _block_stats
  peak, block_mass, best = stats(scaled, blk)
  # Every block's mass on each row's devices before the cumulative sum: over blocks split
  # between tensor shards, XLA:GPU runs it as a sequential loop of nb steps (2,004 for
  # Llama 3 at tensor 2: 14,000 launches per decode step).
  block_mass = constrain(block_mass, ("batch", None))
  block_cum = jnp.cumsum(block_mass, axis=-1)
  target = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys) * block_cum[:, -1]  # [B]
  block = jnp.sum(block_cum <= target[:, None], axis=-1, dtype=jnp.int32)
  block = jnp.minimum(block, _last_positive(block_mass))
  take = lambda a: jnp.take_along_axis(a, block[:, None], axis=1)[:, 0]
  # The chosen block's probabilities, recomputed from its blk logits rather than sliced
  # from a [B, nb, blk] copy of p (a relayout of the whole row on a TPU).
  index = block[:, None] * blk + jnp.arange(blk, dtype=jnp.int32)  # [B, blk]
  logits = jnp.take_along_axis(scaled, jnp.minimum(index, v - 1), axis=-1)
  inner = jnp.where(index < v, jnp.exp(logits - peak), 0.0)  # [B, blk]
  within = jnp.maximum(target - (take(block_cum) - take(block_mass)), 0.0)
  i = jnp.sum(jnp.cumsum(inner, axis=-1) <= within[:, None], axis=-1, dtype=jnp.int32)
  i = jnp.minimum(i, _last_positive(inner))
  return (block * blk + i, jnp.take_along_axis(logits, i[:, None], axis=-1)[:, 0],
          peak[:, 0], jnp.log(block_cum[:, -1]), best)


def sample(logits, keys, temperature, top_k, top_p, truncation: bool = True,
           draws: bool = True):
  """Draws one token per row.

  Args:
    logits: [B, V] float32.
    keys: [B] typed PRNG keys.
    temperature: [B] float32, 0 for greedy.
    top_k: [B] int32, 0 for off.
    top_p: [B] float32, 1 for off.
    truncation: static; False promises no row uses top-k or top-p, and the program then
      holds no truncation pass (a sort over the vocabulary) at all.
    draws: static; False promises every row is greedy (temperature 0), and the program
      then holds no random draw (nor the key derivation before it) at all.

  Returns:
    (tokens [B] int32, logprobs [B] float32 under the distribution sampled from).
  """
  return sample_with_floors(logits, keys, temperature, top_k, top_p, truncation, draws)[:2]


def sample_with_floors(logits, keys, temperature, top_k, top_p, truncation: bool = True,
                       draws: bool = True, shortcuts: bool = True):
  """`sample`, and each row's kept-set floor [B] float32 on logits / temperature
  (-inf where the row kept the whole vocabulary: no truncation, or greedy).

  `shortcuts` (static): skip, with lax.cond, the passes the rows turn out not to need.
  Without (a GPU's or TPU's programs: rollout.programs._shortcuts) every pass that
  `truncation` and `draws` keep runs: the same tokens.
  """
  if not draws:  # Greedy generation and evaluation: a smaller program, quicker to compile.
    return _greedy(logits, keys, temperature, top_k, top_p)
  mixed = functools.partial(_mixed, truncation=truncation, shortcuts=shortcuts)
  if not shortcuts:
    return mixed(logits, keys, temperature, top_k, top_p)
  # A batch of greedy rows only (evaluation, greedy generation) skips the scaling,
  # truncation and draw passes over [B, V], a large part of a decode step on a CPU.
  return jax.lax.cond(jnp.all(temperature <= 0.0), _greedy, mixed, logits, keys,
                      temperature, top_k, top_p)


def _greedy(logits, keys, temperature, top_k, top_p):
  del keys, temperature, top_k, top_p
  # The argmax's logit is the row's max: log softmax there is -log sum exp(logits - max),
  # with no gather of the chosen logits (on a TPU, a relayout of the whole row).
  if on_accelerator():  # One pass over the row (_block_stats_one_pass).
    _, mass, token = _block_stats_one_pass(logits, _block_size(logits.shape[-1]))
    total = jnp.sum(mass, axis=-1)
  else:
    best = jnp.max(logits, axis=-1, keepdims=True)
    total = jnp.sum(jnp.exp(logits - best), axis=-1)
    token = first_argmax(logits, best)
  return token, -jnp.log(total), jnp.full(total.shape, -jnp.inf)


def _mixed(logits, keys, temperature, top_k, top_p, truncation=True, shortcuts=True):
  greedy = temperature <= 0.0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  cut, floor = scaled, jnp.full(greedy.shape, -jnp.inf)
  if truncation and not shortcuts:
    cut, floor = truncate(scaled, top_k, top_p)
  elif truncation:  # The sort behind it costs more than the rest: skip it when no row asks.
    needs_cut = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
    cut, floor = jax.lax.cond(needs_cut, truncate, lambda s, k, p: (s, floor), scaled,
                              top_k, top_p)
  scaled = jnp.where(greedy[:, None], logits, cut)
  drawn, drawn_logit, peak, log_mass, best = _draw(keys, scaled)
  # A greedy row's scaled logits are its logits: the draw's max and argmax are its own.
  tokens = jnp.where(greedy, best, drawn)
  picked = jnp.where(greedy, peak, drawn_logit)
  return tokens, picked - peak - log_mass, jnp.where(greedy, -jnp.inf, floor)

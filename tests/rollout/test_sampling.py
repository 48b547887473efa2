"""sample(): per-row settings, truncation, behaviour logprobs and per-request keys."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_post.rollout import sampling
from jaxrl_post.rollout.sampling import first_argmax, inverse_cdf_draw, sample, token_keys
from tests.rollout import helpers as H

V = 50
# Rows: greedy, plain temperature, top-k, top-p, both, greedy with (ignored) truncation.
TEMPERATURE = np.array([0.0, 0.8, 1.0, 1.5, 0.6, 0.0], np.float32)
TOP_K = np.array([0, 0, 7, 0, 10, 3], np.int32)
TOP_P = np.array([1.0, 1.0, 1.0, 0.7, 0.9, 0.5], np.float32)


def _draw(logits, seeds, token_index, reps=1):
  """Draws for every row, `reps` times with token indices token_index, token_index + 1..."""
  b = logits.shape[0]
  t = np.repeat(token_index + np.arange(reps), b)
  keys = token_keys(jnp.asarray(np.tile(seeds, reps), jnp.uint32),
                    jnp.zeros((b * reps,), jnp.int32), jnp.asarray(t, jnp.int32))
  tile = lambda x: np.tile(x, (reps,) + (1,) * (x.ndim - 1))
  tok, lp = jax.jit(sample)(jnp.asarray(tile(logits)), keys, tile(TEMPERATURE), tile(TOP_K),
                            tile(TOP_P))
  return np.asarray(tok).reshape(reps, b), np.asarray(lp).reshape(reps, b)  # [reps, B] x2


def _want_logprobs(logits):  # [B, V] -> [B, V], -inf outside each row's kept set
  rows = []
  for i, row in enumerate(logits.astype(np.float64)):
    if TEMPERATURE[i] == 0:
      rows.append(H.log_softmax(row))
    else:
      rows.append(H.truncated_logprobs(row[None], TEMPERATURE[i], TOP_K[i], TOP_P[i])[0])
  return np.stack(rows)


def test_tokens_and_logprobs_follow_each_rows_settings():
  rng = np.random.default_rng(0)
  logits = (2.0 * rng.normal(size=(len(TEMPERATURE), V))).astype(np.float32)
  want = _want_logprobs(logits)
  kept = np.isfinite(want).sum(axis=1)
  assert kept[2] == 7 and kept[4] <= 10 and 1 < kept[3] < V  # Truncation did cut.
  for t in range(20):
    (tok,), (lp,) = _draw(logits, np.arange(len(TEMPERATURE)), t)
    assert tok[0] == np.argmax(logits[0]) and tok[5] == np.argmax(logits[5])
    picked = want[np.arange(len(tok)), tok]
    assert np.all(np.isfinite(picked))
    np.testing.assert_allclose(lp, picked, atol=1e-5)


def test_draws_follow_the_truncated_distribution():
  rng = np.random.default_rng(1)
  row = (1.5 * rng.normal(size=(V,))).astype(np.float32)
  logits = np.tile(row, (len(TEMPERATURE), 1))
  drawn = TEMPERATURE > 0  # Greedy rows report model logprobs but always take the argmax.
  want = np.exp(_want_logprobs(logits))[drawn]
  n = 3000
  counts = np.zeros_like(want)
  tok, _ = _draw(logits, [7] * len(TEMPERATURE), 0, reps=n)  # [n, B]
  for i, row in enumerate(np.flatnonzero(drawn)):
    counts[i] = np.bincount(tok[:, row], minlength=V)
  freq = counts / n
  # 5 standard errors of a binomial frequency: fails for a wrong distribution, not by chance.
  bound = 5 * np.sqrt(want * (1 - want) / n) + 1e-9
  assert np.all(np.abs(freq - want) <= bound)
  assert np.all(counts[want == 0] == 0)


def test_keys_depend_on_seed_sample_and_token_index_only():
  def data(seeds, samples, t):
    return np.asarray(jax.random.key_data(token_keys(
        jnp.asarray(seeds, jnp.uint32), jnp.asarray(samples, jnp.int32),
        jnp.asarray(t, jnp.int32))))
  a = data([5, 5, 5, 6], [0, 1, 0, 0], [3, 3, 4, 3])
  b = data([6, 5], [0, 0], [3, 3])  # Same (seed, sample, t) in other rows.
  np.testing.assert_array_equal(a[3], b[0])
  np.testing.assert_array_equal(a[0], b[1])
  assert len({tuple(r) for r in a}) == 4
  want = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 1), 3)
  np.testing.assert_array_equal(a[1], np.asarray(jax.random.key_data(want)))


def test_an_all_greedy_batch_gives_the_argmax_and_its_model_logprob():
  # Every row greedy: the draw (and its random bits) is skipped; the result is the same.
  rng = np.random.default_rng(1)
  logits = (2.0 * rng.normal(size=(4, V))).astype(np.float32)
  keys = token_keys(jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32),
                    jnp.zeros(4, jnp.int32))
  args = (jnp.asarray(logits), keys, np.zeros(4, np.float32), np.zeros(4, np.int32),
          np.ones(4, np.float32))
  tok, lp = jax.jit(sample)(*args)
  np.testing.assert_array_equal(np.asarray(tok), np.argmax(logits, axis=1))
  want = np.stack([H.log_softmax(r.astype(np.float64)) for r in logits])
  np.testing.assert_allclose(np.asarray(lp), want[np.arange(4), np.argmax(logits, axis=1)],
                             atol=1e-5)
  # draws=False: a program with no draw at all, for callers that know every row is greedy.
  greedy = jax.jit(functools.partial(sample, truncation=False, draws=False))
  assert "threefry" not in greedy.lower(*args).as_text()
  for got, ref in zip(greedy(*args), (tok, lp)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def _assert_draws_follow(v, kept, probs, seed, n=4000):
  """n inverse-CDF draws from a vocabulary of v where only `kept` tokens have mass
  (`probs`): no excluded token is drawn, and each kept one within 5 standard errors."""
  logits = np.full((v,), -np.inf, np.float32)
  logits[kept] = np.log(np.array(probs, np.float32))
  keys = token_keys(jnp.full((n,), seed, jnp.uint32), jnp.zeros((n,), jnp.int32),
                    jnp.arange(n, dtype=jnp.int32))
  tok = np.asarray(jax.jit(inverse_cdf_draw)(keys, jnp.asarray(np.tile(logits, (n, 1)))))
  counts = np.bincount(tok, minlength=v)
  assert counts.sum() == counts[kept].sum()
  want = np.exp(logits[kept])
  bound = 5 * np.sqrt(want * (1 - want) / n)
  assert np.all(np.abs(counts[kept] / n - want) <= bound)


def test_inverse_cdf_draw_crosses_blocks_and_never_takes_excluded_tokens():
  # 300 tokens: two whole 128-token blocks and a partial one; the kept tokens sit at both
  # ends of the vocabulary and across the first block boundary, with whole blocks of
  # excluded (-inf) tokens between them.
  _assert_draws_follow(300, np.array([0, 5, 127, 128, 290, 299]),
                       [0.05, 0.25, 0.1, 0.2, 0.3, 0.1], seed=11)


def test_first_argmax_takes_the_first_of_tied_maxima():
  x = jnp.asarray([[1.0, 3.0, 3.0, 2.0], [-jnp.inf, -1.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
  np.testing.assert_array_equal(np.asarray(first_argmax(x)), [1, 1, 0])


def test_inverse_cdf_draw_with_small_blocks_matches_the_distribution():
  # 192 tokens (a multiple of 8): blocks of 8, so that 8 vocabulary shards split them.
  assert sampling._block_size(192) == 8
  _assert_draws_follow(192, np.array([0, 7, 8, 100, 191]), [0.1, 0.3, 0.2, 0.25, 0.15],
                       seed=5)


def test_one_pass_row_statistics_equal_the_separate_passes(monkeypatch):
  """The accelerators' one-pass reduction (max, block masses and argmax together) against the
  separate passes: 4,096 tokens in 32 blocks of 128, rows with excluded (-inf) tokens and
  whole excluded blocks, a max tied within and across blocks (the first one wins), and the
  draws."""
  rng = np.random.default_rng(3)
  x = (rng.normal(size=(6, 4096)) * 4).astype(np.float32)
  x[1, rng.random(4096) < 0.9] = -np.inf  # most tokens excluded (a top-k row)
  x[2, 128:3000] = -np.inf  # whole blocks excluded
  x[3, [9, 5, 700, 4000]] = 50.0  # the max twice in a block and in two more: 5 first
  x[4, [900, 131, 130]] = 50.0  # ... and in a later block before an earlier one: 130
  x[5, :] = -np.inf
  x[5, 4095] = 1.0  # one token left, in the last block
  blk = sampling._block_size(4096)
  assert blk == 128
  rows = jnp.asarray(x)
  want = jax.jit(sampling._block_stats, static_argnums=1)(rows, blk)
  got = jax.jit(sampling._block_stats_one_pass, static_argnums=1)(rows, blk)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # the max: exact
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=0)
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
  np.testing.assert_array_equal(np.asarray(got[2])[3:], [5, 130, 4095])
  keys = token_keys(jnp.arange(6, dtype=jnp.uint32), jnp.zeros(6, jnp.int32),
                    jnp.zeros(6, jnp.int32))
  draws = [jax.jit(functools.partial(sampling._draw, one_pass=one))(keys, rows)
           for one in (False, True)]
  np.testing.assert_array_equal(np.asarray(draws[1][0]), np.asarray(draws[0][0]))
  np.testing.assert_allclose(np.asarray(draws[1][2]), np.asarray(draws[0][2]), atol=1e-6)
  # A greedy batch on an accelerator: the argmax and its logprob from the one pass.
  greedy = rows[jnp.asarray([0, 3, 4])]
  want = jax.jit(sampling._greedy)(greedy, None, None, None, None)
  monkeypatch.setattr(sampling, "on_accelerator", lambda: True)
  got = jax.jit(sampling._greedy)(greedy, None, None, None, None)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[0]), [np.argmax(x[0]), 5, 130])
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6)


def test_sampling_keeps_tensor_sharded_logits_on_their_tpu_chips():
  # 4 vocabulary shards of 96 tokens: 128-token blocks would straddle them and XLA would
  # gather every row's f32 logits onto each chip (Llama 3's 128256 tokens over 4 chips).
  from tests.tpu import tpu_mesh
  mesh = tpu_mesh("v5e:2x2", tensor=4)
  b, v = 16, 384
  logits = jax.ShapeDtypeStruct((b, v), jnp.float32,
                                sharding=NamedSharding(mesh, PartitionSpec(None, "tensor")))
  row = lambda dtype: jax.ShapeDtypeStruct((b,), dtype,
                                           sharding=NamedSharding(mesh, PartitionSpec()))
  keys = row(jax.random.key(0).dtype)
  draw = functools.partial(sample, truncation=False)
  hlo = jax.jit(draw).lower(logits, keys, row(jnp.float32), row(jnp.int32),
                            row(jnp.float32)).compile().as_text()
  gathered = [math.prod(int(d) for d in re.search(r"\[([\d,]+)\]", line).group(1).split(","))
              for line in hlo.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
  # Only the [B, blocks] block masses travel (the cumulative sum runs over all blocks).
  assert max(gathered, default=0) <= b * v // 16, gathered

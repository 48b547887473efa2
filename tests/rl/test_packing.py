"""Packing: layout, budget errors, and packed == unpacked per-token logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rl.packing import Trajectory, head_tokens, pack, pad_rows, with_head_layout

CFG = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                  max_position_embeddings=64)


def trajectories(seed=0, n=5):
  rng = np.random.default_rng(seed)
  return [Trajectory(rng.integers(1, 50, rng.integers(1, 6)).tolist(),
                     rng.integers(1, 50, rng.integers(1, 8)).tolist()) for _ in range(n)]


def test_layout_segments_positions_and_targets():
  trajs = [Trajectory([1, 2], [3, 4, 5]), Trajectory([6], [7])]
  b = pack(trajs, row_tokens=8)
  assert b.tokens.shape == (1, 8)
  np.testing.assert_array_equal(b.tokens[0], [1, 2, 3, 4, 5, 6, 7, 0])
  np.testing.assert_array_equal(b.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 0])
  np.testing.assert_array_equal(b.positions[0], [0, 1, 2, 3, 4, 0, 1, 0])
  np.testing.assert_array_equal(b.targets[0], [2, 3, 4, 5, 0, 7, 0, 0])
  np.testing.assert_array_equal(b.completion_mask, [[1, 1, 1], [1, 0, 0]])
  # Completion tokens 3, 4, 5 are predicted at positions 1, 2, 3; token 7 at position 5.
  np.testing.assert_array_equal(b.completion_index, [[1, 2, 3], [5, 0, 0]])
  np.testing.assert_array_equal(b.gather(b.targets), [[3, 4, 5], [7, 0, 0]])


def test_budget_errors_name_the_trajectory():
  with pytest.raises(UserError, match="trajectory 1 has 9 tokens"):
    pack([Trajectory([1], [2]), Trajectory([1] * 4, [2] * 5)], row_tokens=8)
  with pytest.raises(UserError, match="need 3 rows"):
    pack([Trajectory([1] * 4, [2] * 3)] * 3, row_tokens=8, num_rows=2)


def test_packed_logprobs_equal_unpacked():
  model = init_model(CFG, seed=0)
  trajs = trajectories()
  b = pack(trajs, row_tokens=16, num_rows=3)
  logp = jax.nn.log_softmax(model.logits(model(jnp.asarray(b.tokens), jnp.asarray(b.positions),
                                               jnp.asarray(b.segment_ids))))
  token_logp = jnp.take_along_axis(logp, jnp.asarray(b.targets)[..., None], -1)[..., 0]
  packed = np.asarray(b.gather(token_logp))
  for i, t in enumerate(trajs):
    seq = jnp.asarray(t.prompt + t.completion)[None]
    alone = jax.nn.log_softmax(model.logits(model(seq, jnp.arange(seq.shape[1])[None])))[0]
    p = len(t.prompt)
    want = [alone[p - 1 + k, c] for k, c in enumerate(t.completion)]
    np.testing.assert_allclose(packed[i, :len(t.completion)], want, atol=1e-5)
    assert np.all(packed[i, len(t.completion):] == 0)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_head_layout_lists_each_completion_position_once_inside_its_row_shard(shards):
  trajs = trajectories(seed=1, n=9)
  packed = with_head_layout(pad_rows(pack(trajs, row_tokens=16), 8), shards)
  n, per_shard = len(packed.head_index), len(packed.head_index) // shards
  valid = packed.completion_mask > 0
  # Every completion token's slot holds the position that predicts it, and no two share.
  np.testing.assert_array_equal(packed.head_index[packed.head_slot[valid]],
                                packed.completion_index[valid])
  assert len(set(packed.head_slot[valid].tolist())) == valid.sum()
  shard_positions = 8 // shards * 16
  for g in range(shards):  # a shard's entries (padding too) lie in its own rows
    entries = packed.head_index[g * per_shard:(g + 1) * per_shard]
    assert np.all(entries // shard_positions == g)
  assert n % shards == 0 and per_shard >= head_tokens(packed, shards)
  np.testing.assert_array_equal(packed.gather(packed.targets),
                                np.where(valid, packed.targets.reshape(-1)[
                                    packed.head_index][packed.head_slot], 0))


def test_a_multi_turn_loss_mask_leaves_the_observations_out_of_the_head_and_the_loss():
  """Episode = two model turns around an observation: the observation's tokens are inputs
  (the second turn is conditioned on them) but no loss position and no head position."""
  turn1, obs, turn2 = [5, 6, 2], [9, 9], [7, 2]
  traj = Trajectory([1, 3, 4], turn1 + obs + turn2, loss_mask=[1, 1, 1, 0, 0, 1, 1])
  packed = pack([traj, Trajectory([8], [4, 2])], row_tokens=16)
  np.testing.assert_array_equal(packed.completion_mask[0], [1, 1, 1, 0, 0, 1, 1])
  assert list(packed.tokens[0, :10]) == [1, 3, 4] + turn1 + obs + turn2
  heads = set(packed.head_index.tolist())
  masked = packed.completion_index[0][packed.completion_mask[0] == 0]
  assert not heads & set(masked.tolist())
  assert head_tokens(packed, 1) == 5 + 2  # The model's tokens of both trajectories.

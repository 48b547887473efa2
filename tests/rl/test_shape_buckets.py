"""Bounded compiled shapes: rows and completion widths come from fixed buckets, so a run
whose completion lengths vary step to step compiles a few step programs, not one per step."""


import numpy as np
import pytest

from jaxrl_post.models import init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.packing import Trajectory, bucket, completion_bucket
from jaxrl_post.rl.trainer import (SequenceScores, Trainer, TrainerConfig, pack_micro_batches,
                                   pack_rollouts)
from tests.rl.toy_task import CFG

MAX_LEN = 32  # completion lengths 1..32 over the run


@pytest.mark.parametrize("n,multiple,want", [(1, 1, 1), (3, 1, 4), (4, 1, 4), (5, 8, 8),
                                             (9, 8, 16), (17, 6, 24), (1, 8, 8)])
def test_buckets_are_multiples_times_powers_of_two(n, multiple, want):
  assert bucket(n, multiple) == want


def test_completion_widths_are_powers_of_two_from_eight():
  assert [completion_bucket(n) for n in (1, 8, 9, 16, 17, 33, 64)] == [8, 8, 16, 16, 32, 64, 64]


def test_rows_fit_the_batch_shards_and_padding_trajectories_are_empty():
  trajs = [Trajectory([1, 2, 3], [4] * n) for n in range(1, 11)]
  inputs, = pack_micro_batches(trajs, [list(range(10))], row_tokens=16, max_completion=16,
                               shards=8)
  used = (inputs.segment_ids != 0).any(axis=1)
  assert inputs.tokens.shape == (8, 16) and used.sum() == 6  # bucket: a multiple of 8
  assert not inputs.segment_ids[~used].any() and not inputs.targets[~used].any()
  assert inputs.completion_mask.shape == (16, 16)  # 10 trajectories padded to 16
  assert not inputs.completion_mask[10:].any() and not inputs.head_slot[10:].any()


def run_lengths(longest: int) -> list[Trajectory]:
  """16 trajectories whose completions spread over 1..longest tokens."""
  rng = np.random.default_rng(longest)
  return [Trajectory([1] * (1 + j % 4), rng.integers(2, 16, 1 + j * (longest - 1) // 15).tolist())
          for j in range(16)]


def test_varying_completion_lengths_compile_a_bounded_set_of_steps():
  trainer = Trainer(CFG, TrainerConfig(row_tokens=128))
  params = params_of(init_model(CFG, 0))
  state = trainer.init_state(params)
  rng = np.random.default_rng(0)
  shapes = []
  for i in range(20):
    trajs = run_lengths(1 + i * (MAX_LEN - 1) // 19)  # the longest grows 1 -> 32 tokens
    behaviour = [rng.normal(-2.0, 0.1, len(t.completion)).tolist() for t in trajs]
    adv = rng.normal(size=len(trajs)).astype(np.float32)
    batches = pack_rollouts(trainer, trajs, behaviour)
    inputs = batches[0].inputs
    shapes.append((inputs.tokens.shape[1], inputs.completion_mask.shape[2],
                   inputs.head_index.shape[1]))
    state, _ = trainer.update(state, batches, SequenceScores.of(len(trajs), adv), params)
  compiled = trainer._update._cache_size()
  print(f"(rows, width, head positions) per step {shapes}; step compilations {compiled} over "
        "20 steps")
  rows, widths, heads = ({shape[i] for shape in shapes} for i in range(3))
  assert widths <= {8, 16, 32, 64} and rows <= {1, 2, 4, 8}
  assert heads <= {64 * 2 ** k for k in range(5)}
  assert all(a <= b for earlier, later in zip(shapes, shapes[1:])
             for a, b in zip(earlier, later))  # all three rise
  # Rising together through a few widths, row counts and head sizes (each a power of two):
  # at most one shape per change of one of them, each compiled once (no recompilation of a
  # shape already seen).
  assert compiled == len(set(shapes)) <= len(rows) + len(widths) + len(heads) - 2
  assert trainer._logprobs._cache_size() == 0  # no separate reference or old-policy pass

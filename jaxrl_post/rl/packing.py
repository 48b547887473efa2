"""Packing trajectories (prompt + completion) into rows of a fixed token budget.

The trainer's forward runs on packed rows [R, S] (segment ids keep sequences apart,
positions restart per sequence), so no FLOPs go to padding. Losses are defined per
sequence, on a padded [B, T] completion layout; `PackedBatch.gather` maps per-token values
from the packed rows to that layout with one gather, so gradients flow back through it.

Shapes: R rows of S tokens; B trajectories; T the longest completion.

Jitted steps compile once per shape, so the trainer rounds R and T up to fixed buckets
(`bucket`, `completion_bucket`): a run whose completion lengths vary compiles a few shapes,
not one per step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxrl_post.errors import UserError


@dataclasses.dataclass(frozen=True)
class Trajectory:
  prompt: Sequence[int]
  completion: Sequence[int]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """Host arrays for one packed batch.

  Attributes:
    tokens: [R, S] input ids (0 in padding).
    positions: [R, S] position within each sequence.
    segment_ids: [R, S] 1.. per sequence in a row, 0 for padding.
    targets: [R, S] the next token (what position t predicts).
    completion_index: [B, T] flat index into R * S of the position that predicts
      completion token t of trajectory b (0 where masked).
    completion_mask: [B, T] 1 where trajectory b has a completion token t.
  """

  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  targets: np.ndarray
  completion_index: np.ndarray
  completion_mask: np.ndarray

  def gather(self, per_token):  # [R, S] (or [R * S]) -> [B, T]
    """Per-token values of the packed rows in the padded completion layout."""
    return gather_completions(per_token, self.completion_index, self.completion_mask)


def gather_completions(per_token, completion_index, completion_mask):
  """[R, S] (or [R * S]) per-token values -> [B, T] completion layout, 0 where masked.

  Works on numpy and jax arrays alike; under jax the gradient flows back to the rows.
  """
  return per_token.reshape(-1)[completion_index] * completion_mask


MIN_COMPLETION_BUCKET = 8


def bucket(n: int, multiple: int = 1) -> int:
  """The smallest `multiple` x 2^k >= n: few distinct sizes, each a multiple of `multiple`."""
  size = multiple
  while size < n:
    size *= 2
  return size


def completion_bucket(longest: int) -> int:
  """Completion width T for a batch whose longest completion has `longest` tokens."""
  return bucket(longest, MIN_COMPLETION_BUCKET)


def pad_trajectories(packed: PackedBatch, n: int) -> PackedBatch:
  """The completion layout padded to n trajectories with empty ones (mask 0, index 0).

  A padding trajectory has no completion token, so every masked reduction, the token and
  sequence normalisers and the gather (index 0 times mask 0) ignore it.
  """
  extra = n - len(packed.completion_mask)
  if extra < 0:
    raise ValueError(f"cannot pad {len(packed.completion_mask)} trajectories to {n}")
  pad = lambda x: np.pad(x, ((0, extra), (0, 0)))
  return dataclasses.replace(packed, completion_index=pad(packed.completion_index),
                             completion_mask=pad(packed.completion_mask))


def _first_fit(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
  """Trajectory indices per row, first-fit decreasing (few rows, little padding)."""
  rows: list[list[int]] = []
  space: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    for r, free in enumerate(space):
      if lengths[i] <= free:
        rows[r].append(i)
        space[r] -= lengths[i]
        break
    else:
      rows.append([i])
      space.append(row_tokens - lengths[i])
  return rows


def pack(trajectories: Sequence[Trajectory], row_tokens: int, num_rows: int | None = None,
         max_completion: int | None = None) -> PackedBatch:
  """Packs trajectories into `num_rows` rows (default: as few as fit) of `row_tokens`.

  Raises:
    UserError: a trajectory longer than a row, or more rows needed than `num_rows`.
  """
  lengths = [len(t.prompt) + len(t.completion) for t in trajectories]
  for i, n in enumerate(lengths):
    if n > row_tokens or not trajectories[i].completion or not trajectories[i].prompt:
      raise UserError(f"packing: trajectory {i} has {n} tokens (prompt "
                      f"{len(trajectories[i].prompt)}, completion "
                      f"{len(trajectories[i].completion)}); rows hold {row_tokens} and both "
                      "parts must be non-empty")
  rows = _first_fit(lengths, row_tokens)
  n_rows = num_rows or len(rows)
  if len(rows) > n_rows:
    raise UserError(f"packing: {len(trajectories)} trajectories need {len(rows)} rows of "
                    f"{row_tokens} tokens; only {n_rows} configured")
  shape = (n_rows, row_tokens)
  tokens, positions, segments, targets = (np.zeros(shape, np.int32) for _ in range(4))
  longest = max(len(t.completion) for t in trajectories)
  t_max = max_completion or longest
  if t_max < longest:
    raise UserError(f"packing: max_completion={max_completion} is shorter than the longest "
                    f"completion ({longest} tokens)")
  index = np.zeros((len(trajectories), t_max), np.int32)
  mask = np.zeros((len(trajectories), t_max), np.float32)
  for r, members in enumerate(rows):
    start = 0
    for seg, i in enumerate(members, start=1):
      seq = list(trajectories[i].prompt) + list(trajectories[i].completion)
      n, p = len(seq), len(trajectories[i].prompt)
      tokens[r, start:start + n] = seq
      positions[r, start:start + n] = np.arange(n)
      segments[r, start:start + n] = seg
      targets[r, start:start + n - 1] = seq[1:]
      c = n - p  # Completion token t is predicted at position p - 1 + t.
      index[i, :c] = r * row_tokens + start + p - 1 + np.arange(c)
      mask[i, :c] = 1.0
      start += n
  return PackedBatch(tokens, positions, segments, targets, index, mask)

"""Packing trajectories (prompt + completion) into rows of a fixed token budget.

The trainer's forward runs on packed rows [R, S] (segment ids keep sequences apart,
positions restart per sequence), so no FLOPs go to padding. Losses are defined per
sequence, on a padded [B, T] completion layout; `PackedBatch.gather` maps per-token values
from the packed rows to that layout with one gather, so gradients flow back through it.

The LM head (a [D, V] matmul and a softmax per token, the largest cost of a small model's
forward) is needed only where a completion token is predicted: the head layout
(`head_index`, `head_slot`) lists those N positions, so the trainer gathers N hidden
states instead of running the head over all R * S positions (prompts and padding too).
The positions are grouped by row shard: on a mesh each device's rows are a contiguous
block of rows, and its share of the head positions must come from those rows only, so no
device reads another's hidden states.

Shapes: R rows of S tokens; B trajectories; T the longest completion; N head positions.

Jitted steps compile once per shape, so the trainer rounds R, T and N up to fixed buckets
(`bucket`, `completion_bucket`, `head_bucket`): a run whose completion lengths vary
compiles a few shapes, not one per step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from jaxrl_post.errors import UserError


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """A prompt and its completion; for a MoE policy also the experts the rollout chose for
  each token it fed ([P + N - 1, L, k], see rollout.scheduler.Completion), for replay;
  under top-k / top-p each completion token's kept-set floor ([N], sampling.truncate);
  for a multi-turn episode the loss mask of its completion ([N])."""

  prompt: Sequence[int]
  completion: Sequence[int]
  experts: Optional[np.ndarray] = dataclasses.field(default=None, compare=False)
  floors: Optional[Sequence[float]] = None
  # Multi-turn episodes: 1 on the completion's model tokens, 0 on the observations between
  # its turns, which the policy is conditioned on but never trained to produce.
  loss_mask: Optional[Sequence[int]] = None


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
    head_index: [N] flat index into R * S of each position the LM head runs at: shard g
      of `shards` owns entries [g * N / shards, (g + 1) * N / shards), all within its
      rows; unused entries hold the shard's first position (their results are never read).
    head_slot: [B, T] the entry of head_index that predicts completion token t of
      trajectory b (0 where masked).
    experts: [R, S, L, k] int16 the rollout's experts for each position's token
      (NO_EXPERT where none: padding, a completion's last token), when the trajectories
      carry them; else None.
    floors: [B, T] float32 each completion token's kept-set floor (-inf: the whole
      vocabulary), when any trajectory carries floors; else None. head_floor is the same
      per head_index entry.
  """

  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  targets: np.ndarray
  completion_index: np.ndarray
  completion_mask: np.ndarray
  head_index: np.ndarray
  head_slot: np.ndarray
  experts: Optional[np.ndarray] = None
  floors: Optional[np.ndarray] = None
  head_floor: Optional[np.ndarray] = None

  def gather(self, per_token):  # [R, S] (or [R * S]) -> [B, T]
    """Per-token values of the packed rows in the padded completion layout."""
    return gather_completions(per_token, self.completion_index, self.completion_mask)


def gather_completions(per_token, completion_index, completion_mask):
  """[R, S] (or [R * S]) per-token values -> [B, T] completion layout, 0 where masked.

  Works on numpy and jax arrays alike; under jax the gradient flows back to the rows.
  """
  return per_token.reshape(-1)[completion_index] * completion_mask


MIN_COMPLETION_BUCKET = 8
MIN_HEAD_BUCKET = 64  # Head positions per row shard at least (fewer sizes to compile).


def bucket(n: int, multiple: int = 1) -> int:
  """The smallest `multiple` x 2^k >= n: few distinct sizes, each a multiple of `multiple`."""
  size = multiple
  while size < n:
    size *= 2
  return size


def completion_bucket(longest: int) -> int:
  """Completion width T for a batch whose longest completion has `longest` tokens."""
  return bucket(longest, MIN_COMPLETION_BUCKET)


def head_bucket(tokens: int, positions: int) -> int:
  """Head positions per row shard for a shard of `positions` positions holding at most
  `tokens` completion tokens: a bucket, but never more than the shard's positions."""
  return min(bucket(tokens, MIN_HEAD_BUCKET), positions)


def shard_of_positions(flat_index: np.ndarray, rows: int, row_tokens: int,
                       shards: int) -> np.ndarray:
  """The row shard (of `shards` contiguous blocks of rows) each flat position lies in."""
  if rows % shards:
    raise ValueError(f"packing: {rows} rows do not split into {shards} row shards")
  return flat_index // (rows // shards * row_tokens)


def head_tokens(packed: PackedBatch, shards: int) -> int:
  """Completion tokens of the busiest row shard: what the head layout must hold per shard."""
  rows, row_tokens = packed.tokens.shape
  flat = packed.completion_index[packed.completion_mask > 0]
  shard = shard_of_positions(flat, rows, row_tokens, shards)
  return int(np.bincount(shard, minlength=shards).max())


def with_head_layout(packed: PackedBatch, shards: int = 1,
                     per_shard: int | None = None) -> PackedBatch:
  """`packed` with its head layout rebuilt for `shards` row shards of `per_shard`
  positions each (default: the head bucket of the busiest shard).

  Each shard's completion positions keep the order of (trajectory, token); the gather
  back to [B, T] is then one index per token.
  """
  rows, row_tokens = packed.tokens.shape
  per_shard = per_shard or head_bucket(head_tokens(packed, shards), rows // shards * row_tokens)
  valid = packed.completion_mask > 0
  flat = packed.completion_index[valid]  # [C] in (b, t) order
  shard = shard_of_positions(flat, rows, row_tokens, shards)
  order = np.argsort(shard, kind="stable")
  counts = np.bincount(shard, minlength=shards)
  if counts.max(initial=0) > per_shard:
    raise ValueError(f"packing: a row shard has {counts.max()} completion tokens, more than "
                     f"the {per_shard} head positions per shard")
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank = np.empty(len(flat), np.int64)
  rank[order] = np.arange(len(flat)) - starts[shard[order]]
  slot = (shard * per_shard + rank).astype(np.int32)  # [C]
  first = np.arange(shards) * (rows // shards * row_tokens)
  head_index = np.repeat(first, per_shard).astype(np.int32)  # [N]
  head_index[slot] = flat
  head_slot = np.zeros(packed.completion_mask.shape, np.int32)
  head_slot[valid] = slot
  head_floor = None
  if packed.floors is not None:
    head_floor = np.full(head_index.shape, -np.inf, np.float32)
    head_floor[slot] = packed.floors[valid]
  return dataclasses.replace(packed, head_index=head_index, head_slot=head_slot,
                             head_floor=head_floor)


def pad_rows(packed: PackedBatch, n: int) -> PackedBatch:
  """`packed` with padding rows appended up to n rows (segment id 0, no targets).

  Flat indices count row by row, so the completion index stays valid; the head layout is
  rebuilt by the caller once the final rows and shards are known.
  """
  extra = n - len(packed.tokens)
  if extra < 0:
    raise ValueError(f"cannot pad {len(packed.tokens)} rows to {n}")
  pad = lambda x: np.pad(x, ((0, extra), (0, 0)))
  experts = packed.experts
  if experts is not None:
    experts = np.pad(experts, ((0, extra),) + ((0, 0),) * 3, constant_values=NO_EXPERT)
  return dataclasses.replace(packed, tokens=pad(packed.tokens),
                             positions=pad(packed.positions),
                             segment_ids=pad(packed.segment_ids), targets=pad(packed.targets),
                             experts=experts)


def pad_trajectories(packed: PackedBatch, n: int) -> PackedBatch:
  """The completion layout padded to n trajectories with empty ones (mask 0, index 0).

  A padding trajectory has no completion token, so every masked reduction, the token and
  sequence normalisers and the gather (index 0 times mask 0) ignore it.
  """
  extra = n - len(packed.completion_mask)
  if extra < 0:
    raise ValueError(f"cannot pad {len(packed.completion_mask)} trajectories to {n}")
  pad = lambda x: np.pad(x, ((0, extra), (0, 0)))
  floors = None if packed.floors is None else np.pad(
      packed.floors, ((0, extra), (0, 0)), constant_values=-np.inf)
  return dataclasses.replace(packed, completion_index=pad(packed.completion_index),
                             completion_mask=pad(packed.completion_mask),
                             head_slot=pad(packed.head_slot), floors=floors)


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
  """Packs trajectories into `num_rows` rows (default: as few as fit) of `row_tokens`,
  with a one-shard head layout (see `with_head_layout` for more shards).

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
  experts = _experts_rows(trajectories, shape)
  floors = None
  if any(t.floors is not None for t in trajectories):
    floors = np.full((len(trajectories), t_max), -np.inf, np.float32)
  for r, members in enumerate(rows):
    start = 0
    for seg, i in enumerate(members, start=1):
      seq = list(trajectories[i].prompt) + list(trajectories[i].completion)
      n, p = len(seq), len(trajectories[i].prompt)
      tokens[r, start:start + n] = seq
      if experts is not None:
        e = trajectories[i].experts[:n]
        experts[r, start:start + len(e)] = e
      positions[r, start:start + n] = np.arange(n)
      segments[r, start:start + n] = seg
      targets[r, start:start + n - 1] = seq[1:]
      c = n - p  # Completion token t is predicted at position p - 1 + t.
      index[i, :c] = r * row_tokens + start + p - 1 + np.arange(c)
      mask[i, :c] = 1.0 if trajectories[i].loss_mask is None else trajectories[i].loss_mask
      if floors is not None and trajectories[i].floors is not None:
        floors[i, :c] = trajectories[i].floors
      start += n
  packed = PackedBatch(tokens, positions, segments, targets, index, mask,
                       head_index=np.zeros((0,), np.int32), head_slot=np.zeros_like(index),
                       experts=experts, floors=floors)
  return with_head_layout(packed)


NO_EXPERT = -1  # models.moe.NO_EXPERT: a position with no recorded experts routes itself.


def _experts_rows(trajectories: Sequence[Trajectory], shape) -> Optional[np.ndarray]:
  """[R, S, L, k] int16 all NO_EXPERT when the trajectories carry experts, else None."""
  with_experts = [t.experts for t in trajectories if t.experts is not None]
  if not with_experts:
    return None
  if len(with_experts) != len(trajectories):
    raise ValueError("packing: some trajectories carry rollout experts and some do not")
  return np.full(shape + with_experts[0].shape[1:], NO_EXPERT, np.int16)

"""DAPO's sampling-side extras: dynamic sampling and the soft overlong penalty.

Dynamic sampling: a group whose K samples all get the same reward has zero advantage under
every group estimator, so it only dilutes the batch. DAPO drops such groups and keeps
drawing rollout batches until the training batch is full again. The keep mask is a pure
array function; the refilling is host-side bookkeeping (`GroupRefill`) between rollout
calls, because how many batches it takes is data-dependent.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.errors import UserError


def group_keep_mask(rewards):  # [G, K] -> [G] bool
  """True for groups whose rewards are not all equal (non-zero variance).

  Compares max and min exactly rather than a computed std against a tolerance. Works on
  NumPy arrays (host side) and jax arrays alike.
  """
  return rewards.max(axis=-1) != rewards.min(axis=-1)


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
  """Attributes:
    target_groups: groups (prompts) per training batch.
    group_size: K, samples per prompt.
    max_batches: rollout batches allowed per training batch before giving up (0: no limit).
  """
  target_groups: int
  group_size: int
  max_batches: int = 0

  def __post_init__(self):
    for field in ("target_groups", "group_size"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise UserError(f"dynamic sampling config: {field} must be a positive integer, "
                        f"got {value!r}")
    if not isinstance(self.max_batches, int) or self.max_batches < 0:
      raise UserError(f"dynamic sampling config: max_batches must be an integer >= 0, "
                      f"got {self.max_batches!r}")


class GroupRefill:
  """Host-side accumulator of the groups kept by dynamic sampling.

  Feed each rollout batch to `add` until `full`, then `take` exactly `target_groups` groups.
  Surplus groups of the last batch are discarded, not carried to the next step: they would
  be one policy version stale. Every array of a batch has a leading axis B = G * K with each
  group's samples contiguous, and the same trailing shape in every batch (pad to the fixed
  maximum length).
  """

  def __init__(self, cfg: DynamicSamplingConfig):
    self.cfg = cfg
    self._reset()

  def _reset(self):
    self._parts: list[dict[str, np.ndarray]] = []
    self.kept = 0
    self.batches = 0
    self.groups_seen = 0

  @property
  def full(self) -> bool:
    return self.kept >= self.cfg.target_groups

  def add(self, batch: Mapping[str, np.ndarray], rewards: np.ndarray) -> int:
    """Keeps the non-zero-variance groups of one rollout batch; returns how many.

    Raises UserError when max_batches batches have been drawn and the batch is still not
    full (e.g. a task the policy always or never solves).

    Args:
      batch: arrays with leading axis B = G * K.
      rewards: [G, K] rewards of the same batch.
    """
    rewards = np.asarray(rewards)
    g, k = rewards.shape
    if k != self.cfg.group_size or any(len(v) != g * k for v in batch.values()):
      raise ValueError(f"rewards {rewards.shape} and batch leading axes "
                       f"{ {n: len(v) for n, v in batch.items()} } disagree with "
                       f"group_size={self.cfg.group_size}")
    keep = np.asarray(group_keep_mask(rewards))
    rows = np.repeat(keep, k)
    self._parts.append({n: np.asarray(v)[rows] for n, v in batch.items()})
    self.batches += 1
    self.groups_seen += g
    self.kept += int(keep.sum())
    if self.cfg.max_batches and self.batches >= self.cfg.max_batches and not self.full:
      raise UserError(f"dynamic sampling: max_batches={self.cfg.max_batches} rollout batches "
                      f"kept only {self.kept} of {self.cfg.target_groups} groups with "
                      f"non-constant rewards")
    return int(keep.sum())

  def take(self) -> dict[str, np.ndarray]:
    """Exactly target_groups * K rows of every array; resets the accumulator."""
    if not self.full:
      raise ValueError(f"GroupRefill.take: {self.kept} of {self.cfg.target_groups} groups")
    rows = self.cfg.target_groups * self.cfg.group_size
    out = {n: np.concatenate([p[n] for p in self._parts])[:rows] for n in self._parts[0]}
    self._reset()
    return out

  def stats(self) -> dict[str, float]:
    """Batches drawn and the fraction of groups kept so far (for telemetry)."""
    return {"batches": float(self.batches),
            "kept_frac": self.kept / max(self.groups_seen, 1)}


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
  """DAPO's soft overlong punishment.

  Attributes:
    max_length: maximum response length L_max (tokens).
    buffer: L_cache, the span before L_max over which the penalty ramps from 0 to -factor.
    factor: penalty at (and beyond) L_max.
  """
  max_length: int
  buffer: int
  factor: float = 1.0

  def __post_init__(self):
    if not isinstance(self.max_length, int) or self.max_length < 1:
      raise UserError(f"overlong config: max_length must be a positive integer, "
                      f"got {self.max_length!r}")
    if not isinstance(self.buffer, int) or not 0 < self.buffer <= self.max_length:
      raise UserError(f"overlong config: buffer must be an integer in [1, max_length="
                      f"{self.max_length}], got {self.buffer!r}")
    if not self.factor >= 0:
      raise UserError(f"overlong config: factor must be >= 0, got {self.factor!r}")


def overlong_penalty(lengths: jax.Array, cfg: OverlongConfig) -> jax.Array:  # [B] -> [B]
  """Reward to add for response lengths (DAPO eq. 13), scaled by `factor`:

    0                                  if L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
    -1                                 if L > L_max

  A truncated response (L = L_max) thus gets -factor, and the penalty is continuous.
  """
  lengths = jnp.asarray(lengths, jnp.float32)
  start = cfg.max_length - cfg.buffer
  ramp = (start - lengths) / cfg.buffer
  penalty = jnp.where(lengths <= start, 0.0, jnp.where(lengths <= cfg.max_length, ramp, -1.0))
  return cfg.factor * penalty

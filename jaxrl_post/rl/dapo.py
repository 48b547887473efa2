"""DAPO's sampling-side extras: dynamic sampling and the soft overlong penalty.

Dynamic sampling: a group whose K samples all get the same reward has zero advantage under
every group estimator, so it only dilutes the batch. DAPO drops such groups and keeps
drawing rollout batches until the training batch is full again. The keep mask is a pure
array function; the refilling is the loop's (`pipeline/dynamic.py`), between rollout
calls, because how many batches it takes is data-dependent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError


def group_keep_mask(rewards):  # [G, K] -> [G] bool
  """True for groups whose rewards are not all equal (non-zero variance).

  Compares max and min exactly rather than a computed std against a tolerance. Works on
  NumPy arrays (host side) and jax arrays alike.
  """
  return rewards.max(axis=-1) != rewards.min(axis=-1)


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

"""Rewards scored once per sample across processes, and the same on every process.

In a multi-process run every process holds the same rollouts (the engine's outputs are
replicated to the hosts), and everything the hosts derive from rewards -- advantages, DAPO
refill rounds, dropped groups -- must be the same on all of them, or their SPMD programs
get different inputs. Scoring every sample on every process does not guarantee that: a
verifier that times out on one host (a loaded code sandbox) and not on another gives
different rewards. So the samples of group (prompt) i are scored by process i % processes
alone, and the outcomes are gathered: a timeout is then one value that every process
reads. Whole groups, so a problem's samples meet one host's verifier, as they would on a
single host.

One process: the samples are all its own and nothing is gathered.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jaxrl_post.rewards import VerifierStats
from jaxrl_post.sharding.hosts import allgather_objects


def owner(group: int) -> int:
  """The process that scores the samples of the batch's group `group`."""
  return group % jax.process_count()


def owns(group: int) -> bool:
  return owner(group) == jax.process_index()


def gather(n: int, mine: Sequence[int], rewards: np.ndarray,
           stats: VerifierStats) -> tuple[np.ndarray, VerifierStats]:
  """Every process's scores of its samples -> rewards [n] and stats of all n samples.

  mine: this process's flat sample indices (in the order of `rewards` and `stats.parts`).
  Collective: every process calls it, for the same batch, in the same order.
  """
  if jax.process_count() == 1:
    return rewards, stats
  everyone = allgather_objects((list(mine), np.asarray(rewards, np.float32), stats))
  out = np.zeros(n, np.float32)
  parts: list = [None] * n
  for indices, values, theirs in everyone:
    out[indices] = values
    for i, p in zip(indices, theirs.parts or [None] * len(indices)):
      parts[i] = p
  merged = _merge([s for _, _, s in everyone], stats.wait_s)
  return out, dataclasses.replace(merged, parts=tuple(parts) if any(
      p is not None for p in parts) else ())


def _merge(stats: Sequence[VerifierStats], wait_s: float) -> VerifierStats:
  types: dict[str, int] = {}
  for s in stats:
    for name, count in s.error_types.items():
      types[name] = types.get(name, 0) + count
  return VerifierStats(samples=sum(s.samples for s in stats),
                       errors=sum(s.errors for s in stats),
                       timeouts=sum(s.timeouts for s in stats),
                       crashes=sum(s.crashes for s in stats), error_types=types,
                       busy_s=sum(s.busy_s for s in stats), wait_s=wait_s)

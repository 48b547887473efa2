"""DAPO's dynamic sampling in the loop: refill the groups whose rewards do not vary.

A group whose K samples all get the same verifier reward has zero advantage under every
group estimator: it only dilutes the batch. With dynamic sampling a step draws further
rollout rounds of `prompts_per_step` prompts until it holds `prompts_per_step` groups with
non-zero reward variance, or until `max_extra_rounds` extra rounds are spent; a batch still
short then is completed with zero-variance groups (they train on nothing but keep the
batch's shapes, so no new program is compiled), and the shortfall is counted.

Exact resume: round r of step s samples with `round_seed(seed, r)` in place of the run
seed, so every request's seed is a function of (seed, s, r, prompt index); the extra
prompts come from the run's prompt stream, whose position the checkpoint saves after the
step, however many rounds it drew. The choice of groups is a pure function of the
rewards (`pick_groups`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import VerifierStats
from jaxrl_post.rl.dapo import group_keep_mask


@dataclasses.dataclass(frozen=True)
class DynamicSamplingSpec:
  """Attributes:
    max_extra_rounds: rollout rounds a step may draw beyond its first to replace groups
      whose rewards are all equal (0: drop nothing, only count them).
  """

  max_extra_rounds: int = 4

  def __post_init__(self):
    value = self.max_extra_rounds
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise UserError(f"dynamic sampling spec: max_extra_rounds must be an integer >= 0, "
                      f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class Drawn:
  """Groups of one or more rollout rounds, in order.

  Attributes:
    groups: rollouts.Group per prompt (K completions each).
    rewards: [len(groups) * K] float32 verifier rewards, each group's samples contiguous.
    stats: how the verifier pool scored them.
    seconds: decode wall time (for the rollout's tokens per second).
  """

  groups: list
  rewards: np.ndarray
  stats: VerifierStats
  seconds: float


def round_seed(seed: int, round_: int) -> int:
  """The seed that stands in for the run seed in rollout round `round_` of a step (the
  first round keeps the run seed, so a run without refills samples as before)."""
  if round_ == 0:
    return seed
  return int(np.random.SeedSequence([seed, round_]).generate_state(1)[0])


def pick_groups(rewards: Sequence[np.ndarray], k: int, target: int
                ) -> tuple[list[tuple[int, int]], int]:
  """Which (round, group) pairs make the training batch, and how many are short.

  The first `target` groups with non-constant rewards, in draw order; when fewer exist,
  the first zero-variance groups complete the batch (the shortfall is returned).

  Args:
    rewards: per round, [G_r * K] rewards.
    k: samples per group.
    target: groups in the training batch.
  """
  kept, constant = [], []
  for r, x in enumerate(rewards):
    keep = np.asarray(group_keep_mask(np.asarray(x).reshape(-1, k)))
    kept += [(r, int(g)) for g in np.flatnonzero(keep)]
    constant += [(r, int(g)) for g in np.flatnonzero(~keep)]
  short = max(0, target - len(kept))
  return sorted(kept[:target] + constant[:short]), short


def refill(draw: Callable[[int], Drawn], target: int, k: int, spec: DynamicSamplingSpec
           ) -> tuple[Drawn, Drawn, dict[str, int]]:
  """(training batch, everything drawn, counts) with dynamic sampling.

  Args:
    draw: samples and scores round r's `target` prompts.
    target: prompts per step (groups in the training batch).
    k: samples per prompt.
    spec: the cap on extra rounds.
  """
  rounds = [draw(0)]
  while _varied(rounds, k) < target and len(rounds) <= spec.max_extra_rounds:
    rounds.append(draw(len(rounds)))
  picks, short = pick_groups([d.rewards for d in rounds], k, target)
  drawn = Drawn([g for d in rounds for g in d.groups],
                np.concatenate([d.rewards for d in rounds]),
                merge_stats([d.stats for d in rounds]), sum(d.seconds for d in rounds))
  batch = Drawn([rounds[r].groups[g] for r, g in picks],
                np.concatenate([rounds[r].rewards[g * k:(g + 1) * k] for r, g in picks]),
                drawn.stats, drawn.seconds)
  varied = _varied(rounds, k)
  counts = {"dapo/rounds": len(rounds), "dapo/groups_drawn": len(drawn.groups),
            "dapo/groups_zero_variance": len(drawn.groups) - varied,
            "dapo/groups_dropped": len(drawn.groups) - target,
            "dapo/groups_refilled": min(varied, target) - _varied(rounds[:1], k),
            "dapo/groups_short": short}
  return batch, drawn, counts


def _varied(rounds: Sequence[Drawn], k: int) -> int:
  """Groups with non-constant rewards among the rounds."""
  return sum(int(np.sum(group_keep_mask(d.rewards.reshape(-1, k)))) for d in rounds)


def merge_stats(stats: Sequence[VerifierStats]) -> VerifierStats:
  """One VerifierStats for several `results` calls, field by field: counts and seconds
  add up, per-type counts merge, per-sample tuples concatenate in call order."""
  def merged(name: str):
    values = [getattr(s, name) for s in stats]
    if isinstance(values[0], tuple):
      return tuple(x for v in values for x in v)
    if isinstance(values[0], Mapping):
      out: dict = {}
      for v in values:
        for key, n in v.items():
          out[key] = out.get(key, 0) + n
      return out
    return sum(values)

  return VerifierStats(**{f.name: merged(f.name) for f in dataclasses.fields(VerifierStats)})

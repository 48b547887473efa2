"""The environment interface: problems whose answers take several model turns.

An Environment is also a Task (rewards/base.py): its splits give the problems (a problem's
prompt is the first observation), and `score` reads a one-turn reply, so the warm-up, the
verifier pool and the evaluate CLI take it as they take any task. `reset(problem)` starts
an Episode; each `step(reply)` answers one model turn with the next observation, a reward
and whether the episode is over. Episodes hold plain Python state and are stepped on the
host, off the devices' path (the driver runs them in worker threads; tools that run code
start sandboxed processes of their own).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional, Protocol, Sequence

import numpy as np

from jaxrl_post.rewards.base import Problem


@dataclasses.dataclass(frozen=True)
class Step:
  """What the environment answers to one model turn.

  Attributes:
    observation: the text shown to the model before its next turn ("" when done).
    reward: this turn's reward (the trajectory's is their sum, or the last: AgentSpec).
    done: the episode is over: solved, failed for good, or out of turns.
    solved: the episode reached its goal (evaluation counts these).
  """

  observation: str
  reward: float
  done: bool
  solved: bool = False


class Episode(Protocol):
  """One run of an environment on one problem."""

  def step(self, reply: str) -> Step:
    """The environment's answer to the model's reply (its decoded turn)."""
    ...


class Environment(abc.ABC):
  """Problems in splits plus the episodes they start.

  Attributes:
    name: shown in logs and metrics.
    max_turns: the most model turns of an episode; the driver ends it after that many.
  """

  name: str = "environment"
  max_turns: int = 4

  @abc.abstractmethod
  def split(self, name: str) -> Sequence[Problem]:
    """Problems of split "train" or "eval"; the two never share a problem."""

  @abc.abstractmethod
  def reset(self, problem: Problem) -> Episode:
    """A fresh episode; its first observation is `problem.prompt`."""

  def score(self, problem: Problem, completion: str) -> float:
    """The reward of an episode that ends after this one reply (the one-turn view)."""
    return float(self.reset(problem).step(completion).reward)

  def final_answer(self, reply: str) -> Optional[str]:
    """The answer a reply commits to, for majority voting over episodes (None: no vote)."""
    return None

  def demonstration(self, problem: Problem, rng: np.random.Generator
                    ) -> Optional[list[str]]:
    """Replies of a scripted episode for the supervised warm-up (None: the problem's
    reference answer as one turn). The environment answers them as it would the model."""
    return None

  @property
  def skipped(self) -> dict[str, int]:
    return {}


def play(env: Environment, problem: Problem, replies: Sequence[str]
         ) -> list[tuple[str, Step]]:
  """Plays scripted replies until the episode ends: [(reply, step)], for demonstrations
  and tests."""
  episode, out = env.reset(problem), []
  for reply in replies[:env.max_turns]:
    step = episode.step(reply)
    out.append((reply, step))
    if step.done:
      break
  return out

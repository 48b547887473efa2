"""A number-guessing game: the smallest multi-turn task, with no tools.

The secret is an integer in [low, high]. Each turn the model replies with a guess and the
game answers `higher`, `lower` or, for a reply that is not a number in range, `invalid`;
the right guess ends the episode with reward 1. A policy that ignores the feedback finds
the secret in max_turns of (high - low + 1) cases at best; one that bisects finds every
secret of a range of up to 2**max_turns - 1 numbers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar, Optional, Sequence

import numpy as np

from jaxrl_post.envs.base import Environment, Step
from jaxrl_post.errors import UserError
from jaxrl_post.rewards.base import Problem, check_split
from jaxrl_post.rewards.seeded import LazySplit, Stream

_NUMBER = re.compile(r"-?\d+")


@dataclasses.dataclass
class _Game:
  secret: int
  game: "GuessingGame"
  turns: int = 0

  def step(self, reply: str) -> Step:
    self.turns += 1
    g = self.game
    guess = g.parse(reply)
    out_of_turns = self.turns >= g.max_turns
    if guess == self.secret:
      return Step("", 1.0, True, solved=True)
    if guess is None:
      feedback = g.invalid
    else:
      feedback = g.higher if guess < self.secret else g.lower
    return Step("" if out_of_turns else feedback, 0.0, out_of_turns)


@dataclasses.dataclass(frozen=True)
class GuessingGame(Environment):
  """Attributes:
    low, high: the secret's range, both included.
    max_turns: guesses per episode.
    prompt: the first observation ({low}, {high} filled in).
    higher, lower, invalid: the feedback texts.
    num_train, num_eval: problems per split (a problem is a secret; eval draws its own).
    seed: the draws of both splits.
  """

  name: ClassVar[str] = "guess"

  low: int = 0
  high: int = 9
  max_turns: int = 4
  prompt: str = "guess {low}-{high}:"
  higher: str = "+"
  lower: str = "-"
  invalid: str = "?"
  num_train: int = 100_000
  num_eval: int = 100
  seed: int = 0

  def __post_init__(self):
    owner = type(self).__name__
    if not (isinstance(self.low, int) and isinstance(self.high, int) and self.low < self.high):
      raise UserError(f"{owner}: low={self.low!r} must be an integer below high={self.high!r}")
    for name in ("max_turns", "num_train", "num_eval"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise UserError(f"{owner}: {name} must be a positive integer, got {value!r}")

  def split(self, name: str) -> Sequence[Problem]:
    check_split(type(self).__name__, name)
    n = self.num_train if name == "train" else self.num_eval
    return LazySplit(n, lambda i: self._problem(name, i))

  def _problem(self, split: str, index: int) -> Problem:
    secret = Stream(self.seed, self.name, split, index).integer(self.low, self.high)
    return Problem(id=f"guess-{split}-{index}",
                   prompt=self.prompt.format(low=self.low, high=self.high),
                   answer=str(secret), meta={"secret": secret})

  def reset(self, problem: Problem) -> _Game:
    return _Game(int(problem.meta["secret"]), self)

  def parse(self, reply: str) -> Optional[int]:
    """The guess in a reply: its first integer, if in range."""
    found = _NUMBER.search(reply)
    if found is None:
      return None
    value = int(found.group())
    return value if self.low <= value <= self.high else None

  def final_answer(self, reply: str) -> Optional[str]:
    guess = self.parse(reply)
    return None if guess is None else str(guess)

  def demonstration(self, problem: Problem, rng: np.random.Generator) -> list[str]:
    """Distinct uniform guesses that ignore the feedback: the warm-up teaches the format
    of an episode (a number per turn, whatever came before), not how to play it."""
    numbers = np.arange(self.low, self.high + 1)
    return [str(int(n)) for n in rng.permutation(numbers)[:self.max_turns]]

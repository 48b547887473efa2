"""A task of your own: reverse a short string of letters, with partial credit.

    python -m jaxrl_post.train --gin_import=examples.my_task \
        --gin_file=examples/my_task/config.gin --workdir=runs/my_task

`@jaxrl_post.register` makes the class a gin configurable under its own name, so the gin
file says `Experiment.task = @ReverseTask()` and binds its fields (`ReverseTask.max_length
= 4`) like a built-in task's. A task is a frozen dataclass with a `name`, `split(name)`
(the problems of "train" or "eval", which share none), `score(problem, completion)` (the
reward) and `skipped` (see jaxrl_post.rewards.Task). It must pickle and import without
side effects: verifier worker processes import this module to unpickle the task.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import jaxrl_post
from jaxrl_post.errors import UserError
from jaxrl_post.rewards import Problem
from jaxrl_post.rewards.base import check_int, check_template
from jaxrl_post.rewards.seeded import GeneratedSplits, Stream


@jaxrl_post.register
@dataclasses.dataclass(frozen=True)
class ReverseTask:
  """Write a string of letters backwards: "reverse abc:" -> "cba".

  Attributes:
    alphabet: the letters strings are drawn from.
    min_length, max_length: the strings' lengths, both included.
    template: the prompt, with the field {text}.
    num_train, num_eval: problems per split; eval strings never appear in train.
    seed: the draws of both splits.
  """

  name: ClassVar[str] = "reverse"

  alphabet: str = "abcde"
  min_length: int = 2
  max_length: int = 4
  template: str = "reverse {text}:"
  num_train: int = 100_000
  num_eval: int = 100
  seed: int = 0

  def __post_init__(self):
    owner = type(self).__name__
    if not isinstance(self.alphabet, str) or len(set(self.alphabet)) < 2:
      raise UserError(f"{owner}: alphabet={self.alphabet!r} needs two letters or more")
    check_int(owner, "min_length", self.min_length, 1)
    check_int(owner, "max_length", self.max_length, self.min_length)
    check_int(owner, "num_train", self.num_train, 1)
    check_int(owner, "num_eval", self.num_eval, 1)
    check_int(owner, "seed", self.seed, 0)
    check_template(owner, self.template, ("text",))
    # GeneratedSplits draws the eval strings once (distinct) and keeps train off them; it is
    # made here, not in split(), so every caller sees the same eval set.
    object.__setattr__(self, "_splits", GeneratedSplits(
        owner, self.name, self.seed, self._draw, str, self.num_train, self.num_eval))

  def _draw(self, stream: Stream) -> str:
    length = stream.integer(self.min_length, self.max_length)
    return "".join(stream.choice(self.alphabet) for _ in range(length))

  def _problem(self, split: str, index: int, text: str) -> Problem:
    return Problem(id=f"reverse-{split}-{index}", prompt=self.template.format(text=text),
                   answer=text[::-1])

  def split(self, name: str) -> Sequence[Problem]:
    return self._splits.split(name, self._problem)

  def score(self, problem: Problem, completion: str) -> float:
    """The share of letters in place, over the longer of the reply and the answer: 1.0
    only for the exact reversal, and extra letters cost as much as missing ones. The
    reply is the completion's last word, so "Answer: cba" counts as "cba"."""
    words = completion.split()
    reply = words[-1] if words else ""
    right = sum(a == b for a, b in zip(reply, problem.answer))
    return right / max(len(reply), len(problem.answer))

  def final_answer(self, completion: str) -> str | None:
    """What a completion answers, for majority votes (maj@k): its last word."""
    words = completion.split()
    return words[-1] if words else None

  @property
  def skipped(self) -> dict[str, int]:
    return {}  # Generated problems: no input rows to skip.

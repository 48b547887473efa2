"""Code with execution feedback: a HumanEval function written over several attempts.

Each turn's reply is run against the problem's tests in the code sandbox (through
rewards.humaneval, the single-turn task's own scorer). Passing ends the episode with
reward 1; otherwise the next observation says how the run failed, and the model tries
again until max_turns.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from jaxrl_post.envs.base import Environment, Step
from jaxrl_post.rewards.base import Problem, check_int
from jaxrl_post.rewards.humaneval import HumanEvalSource, HumanEvalTask

DEFAULT_FEEDBACK = ("The tests failed ({status}: {reason}). Reply with the whole corrected "
                    "function in a ```python block.")


@dataclasses.dataclass
class _Attempts:
  env: "HumanEvalFeedback"
  problem: Problem
  turns: int = 0

  def step(self, reply: str) -> Step:
    self.turns += 1
    last = self.turns >= self.env.max_turns
    result = self.env.task.run(self.problem, reply)
    if result is not None and result.status == "ok":
      return Step("", 1.0, True, solved=True)
    if result is None:
      status, reason = "syntax", "the reply holds no function that parses as Python"
    else:
      status, reason = result.status, result.reason
    feedback = self.env.feedback.format(status=status, reason=reason[:300])
    return Step("" if last else feedback, 0.0, last)


@dataclasses.dataclass(frozen=True)
class HumanEvalFeedback(HumanEvalSource, Environment):
  """Attributes: those of rewards.HumanEvalSource (the problems, prompt and sandbox
  limits, as for the single-turn task), plus
    max_turns: attempts per episode.
    feedback: the observation after a failed attempt ({status}, {reason}).
  """

  name: ClassVar[str] = "humaneval_feedback"

  max_turns: int = 3
  feedback: str = DEFAULT_FEEDBACK

  def __post_init__(self):
    check_int(type(self).__name__, "max_turns", self.max_turns, 1)
    object.__setattr__(self, "task", HumanEvalTask(**self.source()))

  def split(self, name: str) -> Sequence[Problem]:
    return self.task.split(name)

  def reset(self, problem: Problem) -> _Attempts:
    return _Attempts(self, problem)

  @property
  def skipped(self) -> dict[str, int]:
    return self.task.skipped

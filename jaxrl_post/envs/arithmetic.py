"""Multi-step arithmetic where the model may call a calculator before it answers.

A problem is an expression of `terms` numbers joined by + - *. Each turn the model either
calls a tool (the calculator; see envs/tools.py for the call formats), whose result is the
next observation, or answers with "Answer: N" (or \\boxed{N}), which ends the episode:
reward 1 for the right value. A turn that does neither gets a reminder.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import ClassVar, Optional, Sequence

import numpy as np

from jaxrl_post.envs.base import Environment, Step
from jaxrl_post.envs.tools import ToolRegistry, calculator
from jaxrl_post.errors import UserError
from jaxrl_post.rewards.base import Problem, check_int, check_split
from jaxrl_post.rewards.seeded import GeneratedSplits, Stream

_ANSWER = re.compile(r"(?:Answer:\s*|\\boxed\{\s*)(-?\d+)")

DEFAULT_PROMPT = ("Compute {expression}. You can use a calculator: reply "
                  '<tool_call>{{"name": "calculator", "arguments": {{"expression": "..."}}}}'
                  "</tool_call> and its result comes back. Finish with 'Answer: <number>'.")


@dataclasses.dataclass
class _Episode:
  env: "ToolArithmetic"
  value: int
  turns: int = 0
  called: bool = False  # A calculator call has run (and earned call_reward).

  def step(self, reply: str) -> Step:
    self.turns += 1
    last = self.turns >= self.env.max_turns
    answer = self.env.final_answer(reply)
    if answer is not None:
      right = int(answer) == self.value
      return Step("", float(right), True, solved=right)
    result = self.env.tools.call(reply)
    text = self.env.reminder if result is None else self.env.tool_response.format(result=result)
    ran = result is not None and not result.startswith("error")
    reward = self.env.call_reward if ran and not self.called else 0.0
    self.called = self.called or ran
    return Step("" if last else text, reward, last)


@dataclasses.dataclass(frozen=True)
class ToolArithmetic(Environment):
  """Attributes:
    terms: numbers per expression.
    min_operand, max_operand: their range.
    operators: those used between them.
    max_turns: model turns (tool calls plus the answer).
    prompt: the first observation, with {expression}.
    tool_response: wraps a tool's result ({result}) as the next observation.
    reminder: the observation after a turn with neither a call nor an answer.
    call_reward: the reward of the turn whose calculator call first runs (once per episode):
      a per-turn reward that shapes toward tool use; the answer's turn earns 1 when right.
      With AgentSpec.credit = "reward_to_go" the answer's tokens are not credited with it.
    num_train, num_eval, seed: the splits (eval never shares an expression with train).
  """

  name: ClassVar[str] = "tool_arithmetic"

  terms: int = 3
  min_operand: int = 2
  max_operand: int = 99
  operators: tuple[str, ...] = ("+", "-", "*")
  max_turns: int = 4
  prompt: str = DEFAULT_PROMPT
  tool_response: str = "<tool_response>{result}</tool_response>"
  reminder: str = "Call the calculator or finish with 'Answer: <number>'."
  call_reward: float = 0.0
  num_train: int = 100_000
  num_eval: int = 100
  seed: int = 0

  def __post_init__(self):
    owner = type(self).__name__
    check_int(owner, "terms", self.terms, 2)
    check_int(owner, "max_turns", self.max_turns, 1)
    check_int(owner, "num_eval", self.num_eval, 1)
    if not isinstance(self.call_reward, (int, float)) or not 0.0 <= self.call_reward < 1.0:
      raise UserError(f"{owner}: call_reward must be in [0, 1) (below a right answer's 1), "
                      f"got {self.call_reward!r}")
    if self.min_operand > self.max_operand or not set(self.operators) <= {"+", "-", "*"}:
      raise UserError(f"{owner}: operands [{self.min_operand}, {self.max_operand}] and "
                      f"operators {self.operators!r} (of + - *) do not make expressions")
    object.__setattr__(self, "_splits", GeneratedSplits(
        owner, self.name, self.seed, self._draw, str, self.num_train, self.num_eval))
    object.__setattr__(self, "tools", ToolRegistry([calculator()]))

  def _draw(self, stream: Stream) -> str:
    parts = [str(stream.integer(self.min_operand, self.max_operand))]
    for _ in range(self.terms - 1):
      parts += [stream.choice(self.operators),
                str(stream.integer(self.min_operand, self.max_operand))]
    return " ".join(parts)

  def split(self, name: str) -> Sequence[Problem]:
    check_split(type(self).__name__, name)
    return self._splits.split(name, self._problem)

  def _problem(self, split: str, index: int, expression: str) -> Problem:
    value = eval(expression, {"__builtins__": {}})  # Digits and + - * only (_draw).
    return Problem(id=f"{self.name}-{split}-{index}",
                   prompt=self.prompt.format(expression=expression), answer=f"Answer: {value}",
                   meta={"expression": expression, "value": value})

  def reset(self, problem: Problem) -> _Episode:
    return _Episode(self, int(problem.meta["value"]))

  def final_answer(self, reply: str) -> Optional[str]:
    found = _ANSWER.search(reply)
    return None if found is None else found.group(1)

  def demonstration(self, problem: Problem, rng: np.random.Generator) -> list[str]:
    """One calculator call on the whole expression, then the answer it gave."""
    call = {"name": "calculator", "arguments": {"expression": problem.meta["expression"]}}
    return [f"<tool_call>{json.dumps(call)}</tool_call>", problem.answer]

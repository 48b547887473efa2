"""Integer arithmetic "a op b" with an exact-match reward: the smallest RL sanity task.

Small models learn it in a few hundred steps, which makes it the first thing to run when a
change to the trainer might have broken learning. Problems are generated on access from
(seed, split, index); eval is drawn first as distinct (a, op, b) triples and train redraws
any hit on them, so an eval score is never a memorised train item.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from fractions import Fraction
from typing import ClassVar, Sequence

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import seeded
from jaxrl_post.rewards.base import Problem, check_int, check_template

_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# A number token. A "-" counts as a sign only when it does not follow a digit, letter or
# ")", so in "20-19" the last number is 19 rather than -19. Thousands separators ("1,234")
# and decimals are one token, so "19.5" is read as 19.5 (wrong), never as a trailing 5.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")
_MAX_TOKEN = 40  # Longer digit runs cannot be an answer here and would be slow to convert.

Triple = tuple[int, str, int]


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """`a op b` over integer operands, scored by the last number in the completion.

  Attributes:
    seed: Selects the problems; equal seeds give equal splits in any process.
    min_operand: Smallest operand (may be negative; negative b is shown in parentheses).
    max_operand: Largest operand.
    operators: A non-empty subset of "+", "-", "*".
    num_train: Length of the train split (items may repeat: the split is a sample).
    num_eval: Length of the eval split; its (a, op, b) triples are pairwise distinct.
    template: Prompt format string with the fields {a}, {op} and {b}; e.g. "What is {a}
      {op} {b}? Answer with just the number." for chat models.
  """

  name: ClassVar[str] = "arithmetic"

  seed: int = 0
  min_operand: int = 0
  max_operand: int = 99
  operators: Sequence[str] = ("+", "-", "*")
  num_train: int = 100_000
  num_eval: int = 200
  template: str = "{a}{op}{b}="
  _splits: seeded.GeneratedSplits = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    owner = type(self).__name__
    check_int(owner, "seed", self.seed, 0)
    check_int(owner, "min_operand", self.min_operand, -10**9, 10**9)
    check_int(owner, "max_operand", self.max_operand, self.min_operand, 10**9)
    self._check_operators(owner)
    check_int(owner, "num_train", self.num_train, 1)
    check_int(owner, "num_eval", self.num_eval, 0)
    check_template(owner, self.template, ("a", "op", "b"))
    width = self.max_operand - self.min_operand + 1
    space = width * width * len(self.operators)
    # Eval takes at most half the triples: train keeps a real space of its own, and both the
    # distinct eval draws and the train redraws succeed with probability >= 1/2 each.
    if self.num_eval > space // 2:
      raise UserError(
          f"{owner}: num_eval={self.num_eval} needs at least {2 * self.num_eval} distinct "
          f"problems, but operands {self.min_operand}..{self.max_operand} with "
          f"{len(self.operators)} operator(s) give {space}")
    object.__setattr__(self, "_splits", seeded.GeneratedSplits(
        owner, "arithmetic", self.seed, self._draw, _key, self.num_train, self.num_eval))

  def _check_operators(self, owner: str) -> None:
    ops = self.operators
    if isinstance(ops, str) or not all(isinstance(op, str) for op in ops):
      raise UserError(f"{owner}: operators={ops!r} must be a list of '+', '-', '*'")
    ops = tuple(ops)  # Lists (from gin) become tuples, so the config stays hashable.
    if not ops or not set(ops) <= set(_APPLY) or len(set(ops)) != len(ops):
      raise UserError(f"{owner}: operators={ops!r} must be a non-empty subset of "
                      "'+', '-', '*' without repeats")
    object.__setattr__(self, "operators", ops)

  def _draw(self, stream: seeded.Stream) -> Triple:
    a = stream.integer(self.min_operand, self.max_operand)
    op = stream.choice(self.operators)
    return a, op, stream.integer(self.min_operand, self.max_operand)

  def _problem(self, split: str, index: int, triple: Triple) -> Problem:
    a, op, b = triple
    shown_b = f"({b})" if b < 0 else str(b)  # "5-(-3)", not "5--3".
    return Problem(id=f"arith-{split}-{index}",
                   prompt=self.template.format(a=a, op=op, b=shown_b),
                   answer=str(_APPLY[op](a, b)))

  def split(self, name: str) -> Sequence[Problem]:
    return self._splits.split(name, self._problem)

  def score(self, problem: Problem, completion: str) -> float:
    """1.0 iff the last number in `completion` equals the answer."""
    value = last_number(completion)
    return 1.0 if value is not None and value == int(problem.answer) else 0.0

  def final_answer(self, completion: str) -> str | None:
    """The completion's answer for majority votes (maj@k): its last number."""
    value = last_number(completion)
    return None if value is None else str(value)

  @property
  def skipped(self) -> dict[str, int]:
    return {}


def _key(triple: Triple) -> Triple:
  return triple


def last_number(text: str) -> Fraction | None:
  """The last number written in `text` ("1,234" and "-7" included), or None.

  Models end answers in many ways: "19", " 19</s>", "The answer is 19.", "12 + 7 = 19";
  the final number is the answer in all of them.
  """
  tokens = _NUMBER.findall(text.replace("\u2212", "-"))  # Unicode minus sign.
  if not tokens or len(tokens[-1]) > _MAX_TOKEN:
    return None
  return Fraction(tokens[-1].replace(",", ""))

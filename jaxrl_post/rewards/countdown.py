"""Countdown: reach a target from a few numbers with + - * / and parentheses.

Every target is built from a random expression over the drawn numbers, so each problem has
a solution (kept in `Problem.meta["solution"]`). A completion's expression is parsed with
`ast` against a whitelist and evaluated with exact fractions; it is never `eval`-ed, since
completions are untrusted model output.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import operator
import re
from fractions import Fraction
from typing import ClassVar, Sequence

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import seeded
from jaxrl_post.rewards.base import Problem, check_int, check_template

DEFAULT_TEMPLATE = (
    "Using the numbers {numbers}, write an expression that equals {target}. Use each "
    "number at most once and only + - * / and parentheses. Answer with just the expression.")

# Exact by construction in `_combine`: it only divides when the remainder is zero.
_INTEGER_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul,
                "/": operator.floordiv}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}
# Longer answers are not a use of at most six small numbers; the cap also bounds the
# recursion of the evaluator and the cost of parsing.
_MAX_EXPRESSION = 200
_SPECIAL_TOKENS = re.compile(r"</s>|<\|[^|<>]*\|>|<eos>|<end_of_turn>")
_FENCE = re.compile(r"```\w*")  # A markdown code fence line around the answer.
_TRAILING_RESULT = re.compile(r"=\s*-?\d+(?:\.\d+)?\s*\.?\s*$")
_SYMBOLS = str.maketrans({"\u00d7": "*", "\u00f7": "/", "\u2212": "-"})

# (numbers in prompt order, target, solution expression)
Puzzle = tuple[tuple[int, ...], int, str]


@dataclasses.dataclass(frozen=True)
class CountdownTask:
  """Countdown puzzles; the answer is the target, the numbers live in `Problem.meta`.

  Attributes:
    seed: Selects the puzzles; equal seeds give equal splits in any process.
    num_numbers: How many numbers a puzzle offers (2..6).
    min_number: Smallest number offered.
    max_number: Largest number offered.
    num_train: Length of the train split (a sample: puzzles may repeat).
    num_eval: Length of the eval split; no two share (numbers, target).
    template: Prompt format string with the fields {numbers} (shown as "[3, 7, 25]") and
      {target}.
  """

  name: ClassVar[str] = "countdown"

  seed: int = 0
  num_numbers: int = 3
  min_number: int = 1
  max_number: int = 25
  num_train: int = 100_000
  num_eval: int = 200
  template: str = DEFAULT_TEMPLATE
  _splits: seeded.GeneratedSplits = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    owner = type(self).__name__
    check_int(owner, "seed", self.seed, 0)
    check_int(owner, "num_numbers", self.num_numbers, 2, 6)
    check_int(owner, "min_number", self.min_number, 0, 10**6)
    check_int(owner, "max_number", self.max_number, self.min_number, 10**6)
    check_int(owner, "num_train", self.num_train, 1)
    check_int(owner, "num_eval", self.num_eval, 0)
    check_template(owner, self.template, ("numbers", "target"))
    # Distinct eval keys need distinct number multisets or targets; half of the multisets
    # is a conservative bound that also leaves train a space of its own.
    multisets = _multisets(self.max_number - self.min_number + 1, self.num_numbers)
    if self.num_eval > multisets // 2:
      raise UserError(
          f"{owner}: num_eval={self.num_eval} needs at least {2 * self.num_eval} number "
          f"sets, but {self.num_numbers} numbers in {self.min_number}..{self.max_number} "
          f"give {multisets}")
    object.__setattr__(self, "_splits", seeded.GeneratedSplits(
        owner, "countdown", self.seed, self._draw, _key, self.num_train, self.num_eval))

  def _draw(self, stream: seeded.Stream) -> Puzzle:
    numbers = tuple(stream.integer(self.min_number, self.max_number)
                    for _ in range(self.num_numbers))
    target, solution = _random_expression(numbers, stream)
    return numbers, target, solution

  def _problem(self, split: str, index: int, puzzle: Puzzle) -> Problem:
    numbers, target, solution = puzzle
    prompt = self.template.format(numbers=f"[{', '.join(map(str, numbers))}]", target=target)
    return Problem(id=f"countdown-{split}-{index}", prompt=prompt, answer=str(target),
                   meta={"numbers": numbers, "solution": solution})

  def split(self, name: str) -> Sequence[Problem]:
    return self._splits.split(name, self._problem)

  def score(self, problem: Problem, completion: str) -> float:
    """1.0 iff the final expression uses only offered numbers and equals the target."""
    value = evaluate(extract_expression(completion), problem.meta["numbers"])
    return 1.0 if value is not None and value == int(problem.answer) else 0.0

  @property
  def skipped(self) -> dict[str, int]:
    return {}


def _key(puzzle: Puzzle) -> tuple[tuple[int, ...], int]:
  """Puzzles are the same problem when they offer the same numbers for the same target."""
  numbers, target, _ = puzzle
  return tuple(sorted(numbers)), target


def _multisets(values: int, size: int) -> int:
  """How many multisets of `size` numbers can be drawn from `values` distinct values."""
  count = 1
  for i in range(size):  # C(values + size - 1, size), exactly.
    count = count * (values + i) // (i + 1)
  return count


def _random_expression(numbers: Sequence[int], stream: seeded.Stream) -> tuple[int, str]:
  """A random expression over all `numbers`: (its value, its text).

  Random pairs from a pool are combined until one value is left, which gives random tree
  shapes. Every intermediate value stays a non-negative integer (subtraction is ordered,
  division only when exact), as in the game, so the target is always reachable by hand.
  """
  pool = [(n, str(n)) for n in numbers]
  while len(pool) > 1:
    left = pool.pop(stream.below(len(pool)))
    right = pool.pop(stream.below(len(pool)))
    pool.append(_combine(left, right, stream))
  value, text = pool[0]
  return value, text[1:-1]  # The outermost combination needs no parentheses.


def _combine(left: tuple[int, str], right: tuple[int, str],
             stream: seeded.Stream) -> tuple[int, str]:
  (a, a_text), (b, b_text) = left, right
  op = stream.choice("+-*/")
  if op == "/" and not (b and a % b == 0):
    if a and b % a == 0:
      (a, a_text), (b, b_text) = (b, b_text), (a, a_text)
    else:
      op = stream.choice("+-*")
  if op == "-" and a < b:
    (a, a_text), (b, b_text) = (b, b_text), (a, a_text)
  return _INTEGER_OPS[op](a, b), f"({a_text} {op} {b_text})"


def extract_expression(completion: str) -> str:
  """The expression a completion answers with: its last line, unwrapped.

  Strips an "<answer>...</answer>" wrapper (also when the stop sequence cut the closing
  tag), end-of-turn tokens, code fences, a leading "Answer:" label, markdown/LaTeX
  delimiters and a trailing "= N", which models often add and is not part of the expression.
  """
  text = completion
  start = text.rfind("<answer>")
  if start >= 0:
    text = text[start + len("<answer>"):].split("</answer>", 1)[0]
  lines = [line.strip() for line in _SPECIAL_TOKENS.sub("", text).splitlines()]
  lines = [line for line in lines if line and not _FENCE.fullmatch(line)]
  if not lines:
    return ""
  line = lines[-1].rsplit(":", 1)[-1].strip().strip("`$").strip()
  line = _TRAILING_RESULT.sub("", line).strip().rstrip(".").strip()
  for latex, symbol in (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/")):
    line = line.replace(latex, symbol)
  return line.translate(_SYMBOLS)


def evaluate(expression: str, numbers: Sequence[int]) -> Fraction | None:
  """The exact value of `expression`, or None if it is not a valid answer for `numbers`.

  Valid means: only integer literals, + - * /, unary minus and parentheses; each literal
  one of `numbers`, used no more often than offered; and no division by zero.
  """
  if not expression or len(expression) > _MAX_EXPRESSION:
    return None
  try:
    tree = ast.parse(expression, mode="eval")
  except (SyntaxError, ValueError):
    return None
  used: list[int] = []
  if not _allowed(tree.body, used):
    return None
  if collections.Counter(used) - collections.Counter(numbers):
    return None  # A number not offered, or one offered once and used twice.
  try:
    return _value(tree.body)
  except ZeroDivisionError:
    return None


def _allowed(node: ast.AST, used: list[int]) -> bool:
  """Whitelist check: names, calls, attributes, floats, powers etc. all fail here."""
  if isinstance(node, ast.Constant):
    if type(node.value) is int:  # Not bool, float or str.
      used.append(node.value)
      return True
    return False
  if isinstance(node, ast.UnaryOp):
    return isinstance(node.op, ast.USub) and _allowed(node.operand, used)
  if isinstance(node, ast.BinOp):
    return (type(node.op) in _BINARY and _allowed(node.left, used)
            and _allowed(node.right, used))
  return False


def _value(node: ast.AST) -> Fraction:
  """Evaluates a tree that passed `_allowed`."""
  if isinstance(node, ast.Constant):
    return Fraction(node.value)
  if isinstance(node, ast.UnaryOp):
    return -_value(node.operand)
  return _BINARY[type(node.op)](_value(node.left), _value(node.right))

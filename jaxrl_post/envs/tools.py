"""Tool calls: parsing them out of a model turn, and the tools a registry runs.

Two call formats are read:

* Qwen-style: `<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>`;
* fenced code: a block fenced with a tool's name (```calculator ... ```, ```python ... ```),
  whose body is the tool's one argument.

Whatever goes wrong -- a call that is not JSON, an unknown tool, a bad argument, an error or
a timeout inside the tool -- comes back as the text of the next observation, so the model
sees it and the episode goes on; nothing a model writes raises out of a registry.

A registry bound to a verifier pool (`ToolRegistry.bind`, as the agent run does) runs each
tool in the pool's worker processes: a tool that hangs is killed at the pool's deadline
and one that crashes takes down only its worker, never the trainer.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import json
import math
import operator
import re
from typing import Any, Callable, Mapping, Optional, Sequence

from jaxrl_post.rewards.sandbox import Limits, SandboxError, run_program

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```([A-Za-z_][\w-]*)[ \t]*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: Mapping[str, Any]


class MalformedCall(ValueError):
  """A turn tried to call a tool and the call cannot be read (the message says why)."""


def parse_tool_call(text: str, fenced: Sequence[str] = ()) -> Optional[ToolCall]:
  """The first tool call in a model turn, or None when it makes none.

  fenced: tool names whose fenced blocks count as calls (their body becomes the tool's
  single argument, see `Tool.argument`).

  Raises:
    MalformedCall: a <tool_call> block that is not a JSON object with a string "name" and
      an object "arguments".
  """
  tagged = _TAGGED.search(text)
  if tagged is not None:
    try:
      call = json.loads(tagged.group(1))
    except json.JSONDecodeError as e:
      raise MalformedCall(f"the tool call is not valid JSON ({e.msg})") from None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments", {}), dict)):
      raise MalformedCall('a tool call is {"name": <string>, "arguments": <object>}')
    return ToolCall(call["name"], dict(call.get("arguments", {})))
  for found in _FENCED.finditer(text):
    if found.group(1) in fenced:
      return ToolCall(found.group(1), {"": found.group(2)})
  return None


class ToolError(Exception):
  """A tool could not do what was asked; the message goes back to the model."""


# ---------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 60  # Bounds every intermediate value, so no expression runs for long.


def calculate(expression: str) -> str:
  """Evaluates +, -, *, /, //, %, ** on numbers; an exact integer when the value is one."""
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError:
    raise ToolError(f"cannot parse {expression.strip()[:80]!r}") from None
  value = _evaluate(tree.body)
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ToolError("the result is not a finite number")
    if value.is_integer():
      value = int(value)
  return str(value) if isinstance(value, int) else f"{value:.10g}"


def _evaluate(node: ast.AST):
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > _MAX_DIGITS:
      raise ToolError("the power is too large")
    try:
      value = _BINARY[type(node.op)](left, right)
    except ZeroDivisionError:
      raise ToolError("division by zero") from None
    if isinstance(value, complex) or abs(value) >= 10 ** _MAX_DIGITS:
      raise ToolError("the value is out of range")
    return value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  raise ToolError(f"only numbers and + - * / // % ** are allowed, not "
                  f"{type(node).__name__}")


# ---------------------------------------------------------------------- tools


@dataclasses.dataclass(frozen=True)
class Tool:
  """A named function of a model's call.

  Attributes:
    name: what calls name it.
    argument: its one argument's name (a fenced call's body fills it).
    run: argument value -> the observation text; raises ToolError for the model to see.
  """

  name: str
  argument: str
  run: Callable[[str], str]


def calculator() -> Tool:
  return Tool("calculator", "expression", calculate)


def _run_python(code: str, limits: Limits) -> str:
  try:
    result = run_program(code, limits=limits)
  except SandboxError as e:
    raise ToolError(f"the sandbox failed: {e}") from None
  if result.status == "ok":
    return result.stdout.strip() or "(no output)"
  return f"{result.status}: {result.reason}"[:400]


def python_sandbox(limits: Limits = Limits(timeout_s=5.0)) -> Tool:
  """Runs a program in the code sandbox (rewards/sandbox.py, its own process and limits);
  the observation is what it printed, or how it failed."""
  return Tool("python", "code", functools.partial(_run_python, limits=limits))


def _observation(run: Callable[[str], str], value: str) -> str:
  """A tool's result, or its ToolError, as observation text (in a pool worker too)."""
  try:
    return run(value)
  except ToolError as e:
    return f"error: {e}"


class ToolRegistry:
  """The tools an environment offers, by name."""

  def __init__(self, tools: Sequence[Tool]):
    self.tools = {t.name: t for t in tools}
    self._pool, self._keys = None, itertools.count()

  def bind(self, pool) -> None:
    """Runs every tool in `pool`'s workers (a rewards.VerifierPool); None: in the caller."""
    self._pool = pool

  def __getstate__(self):  # Sent to pool workers with its environment: without the pool.
    return {"tools": self.tools}

  def __setstate__(self, state):
    self.__init__(list(state["tools"].values()))

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.tools)

  def call(self, text: str) -> Optional[str]:
    """Runs the tool call in a model turn: its result or error as observation text; None
    when the turn calls no tool."""
    try:
      call = parse_tool_call(text, fenced=self.names)
    except MalformedCall as e:
      return f"error: {e}"
    if call is None:
      return None
    tool = self.tools.get(call.name)
    if tool is None:
      return f"error: no tool named {call.name!r} (tools: {', '.join(self.names)})"
    value = call.arguments.get(tool.argument, call.arguments.get(""))
    if not isinstance(value, str):
      return f"error: {call.name} takes one string argument {tool.argument!r}"
    if self._pool is None:
      return _observation(tool.run, value)
    done = self._pool.call(("tool", id(self), next(self._keys)), _observation, tool.run, value)
    if done.kind == "ok":
      return done.value
    if done.kind == "timeout":
      return f"error: {call.name} was stopped after {self._pool.timeout_s:g} s"
    return f"error: {call.name} failed ({done.reason})"

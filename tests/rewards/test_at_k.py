"""pass@k (the unbiased estimator) and maj@k (rewards/at_k.py)."""

import itertools

import pytest

from jaxrl_post.rewards import ArithmeticTask, ComposedTask, FormatReward, at_k


@pytest.mark.parametrize("n", [1, 4, 7])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_solution(n):
  for c in range(n + 1):
    solved = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(solved, k))
      want = sum(any(s) for s in subsets) / len(subsets)
      assert at_k.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_k_above_n():
  with pytest.raises(ValueError, match="k <= n"):
    at_k.pass_at_k(4, 1, 5)


def test_majority_takes_the_most_common_answer_and_the_first_on_a_tie():
  assert at_k.majority_solves(["7", "8", "7", None], [True, False, True, False])
  assert not at_k.majority_solves(["8", "7", "8"], [False, True, False])
  assert at_k.majority_solves(["7", "8"], [True, False])  # Tie: the first seen wins.
  assert not at_k.majority_solves(["8", "7"], [False, True])
  assert not at_k.majority_solves([None, None], [False, False])  # No answer: unsolved.


def test_final_answers_of_tasks_and_of_the_task_a_composed_one_shapes():
  task = ArithmeticTask()
  assert at_k.final_answer(task, "12 + 7 = 19.") == "19"
  assert at_k.final_answer(task, "no idea") is None
  composed = ComposedTask(task=task, components=(FormatReward(pattern="="),), weights=(0.1,))
  assert at_k.final_answer(composed, "so 19") == "19"
  assert at_k.ks_for(1) == [1] and at_k.ks_for(6) == [1, 2, 4, 6]

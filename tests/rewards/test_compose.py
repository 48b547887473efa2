"""ComposedTask: the weighted total, its named parts and their metrics, config checks, gin,
and scoring in verifier worker processes."""

import math
import os
import pickle

import pytest

from jaxrl_post import train
from jaxrl_post.errors import UserError
from jaxrl_post.rewards import (ArithmeticTask, ComponentScorer, ComposedTask, FormatReward,
                                HumanEvalTask, LengthPenalty, Problem, Task, VerifierPool,
                                reward_metrics, score_with_parts)
from tests.rewards.sandboxed import SANDBOXED

pytestmark = SANDBOXED  # One worker: see tests/rewards/sandboxed.py.

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                      "smollm2_humaneval_grpo.gin")
PROBLEM = Problem("p", "2+3=", "5")


def composed(**kwargs):
  return ComposedTask(**{"task": ArithmeticTask(num_train=10, num_eval=5),
                         "components": [FormatReward(r"^\d+$", name="bare"),
                                        LengthPenalty(target_chars=4, span_chars=8)],
                         "weights": [0.5, 2.0], **kwargs})


def test_score_is_the_weighted_sum_of_the_named_parts():
  task = composed(correctness_weight=3.0)
  assert isinstance(task, Task) and isinstance(task, ComponentScorer)
  assert task.component_names() == ("correctness", "bare", "length")
  cases = {"5": (1.0, 1.0, 0.0), "The answer is 5": (1.0, 0.0, -11 / 8),
           "4": (0.0, 1.0, 0.0), "so 5 it is, 5.": (1.0, 0.0, -1.0)}
  for completion, (right, bare, length) in cases.items():
    parts = task.score_components(PROBLEM, completion)
    want = {"correctness": right, "bare": bare, "length": max(length, -1.0)}
    assert parts == pytest.approx(want), completion
    total = 3.0 * right + 0.5 * bare + 2.0 * max(length, -1.0)
    assert task.score(PROBLEM, completion) == pytest.approx(total) == task.total(parts)


def test_no_components_is_the_task_itself():
  inner = ArithmeticTask(num_train=10, num_eval=5)
  task = ComposedTask(inner)
  assert list(task.split("eval")) == list(inner.split("eval"))
  assert task.skipped == inner.skipped == {}
  p = inner.split("eval")[0]
  assert task.score(p, p.answer) == inner.score(p, p.answer) == 1.0
  assert task.score_components(p, "nothing") == {"correctness": 0.0}


def test_length_penalty_is_zero_to_the_target_then_linear_to_minus_one():
  pen = LengthPenalty(target_chars=10, span_chars=20)
  assert [pen(PROBLEM, "x" * n) for n in (0, 10, 11, 20, 30, 31, 500)] == \
      [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]


def test_format_reward_default_wants_a_fenced_python_block():
  fmt = FormatReward()
  assert fmt.name == "format"
  for text in ("```python\ndef f(): pass\n```", "Sure:\n```py\nx = 1\n```\nDone.",
               "```\nx = 1\n```"):
    assert fmt(PROBLEM, text) == 1.0, text
  for text in ("def f(): pass", "```python\ndef f(): pass", "```python x = 1```", ""):
    assert fmt(PROBLEM, text) == 0.0, text


@pytest.mark.parametrize("kwargs, message", [
    ({"weights": [1.0]}, "weights has 1 entries for 2 components (bare, length)"),
    ({"weights": [1.0, float("nan")]}, "weights holds nan"),
    ({"weights": [1.0, True]}, "weights holds True"),
    ({"weights": "1 2"}, "weights='1 2' must be a list"),
    ({"correctness_weight": float("inf")}, "correctness_weight holds inf"),
    ({"components": [LengthPenalty(), LengthPenalty(target_chars=3)], "weights": [1, 1]},
     "share the name(s) length"),
    ({"components": ["format"], "weights": [1]}, "components holds 'format'"),
    ({"components": FormatReward(), "weights": [1]}, "components=FormatReward"),
    ({"task": "humaneval"}, "task='humaneval' must be a task"),
])
def test_composed_task_mistakes_are_one_line_errors_naming_the_field(kwargs, message):
  with pytest.raises(UserError) as e:
    composed(**kwargs)
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_nested_composition_is_refused():
  with pytest.raises(UserError, match="not itself a ComposedTask"):
    ComposedTask(composed())


@pytest.mark.parametrize("make, message", [
    (lambda: FormatReward("(unclosed"), "pattern='(unclosed' is not a valid regex"),
    (lambda: FormatReward(""), "pattern='' must be a non-empty string"),
    (lambda: FormatReward(name="Format"), "name='Format' must be lower_snake_case"),
    (lambda: FormatReward(name="correctness"), "name='correctness'"),
    (lambda: LengthPenalty(name="mean"), "name='mean'"),
    (lambda: LengthPenalty(target_chars=-1), "target_chars=-1"),
    (lambda: LengthPenalty(span_chars=0), "span_chars=0"),
])
def test_component_mistakes_are_one_line_errors_naming_the_field(make, message):
  with pytest.raises(UserError) as e:
    make()
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_reward_metrics_average_each_part_and_count_failures_as_zero():
  task = composed()
  parts = [task.score_components(PROBLEM, text) for text in ("5", "The answer is 5")]
  metrics = reward_metrics(task.component_names(), parts + [None])
  assert metrics == pytest.approx({"reward/correctness": 2 / 3, "reward/bare": 1 / 3,
                                   "reward/length": -1 / 3})
  assert reward_metrics(task.component_names(), []) == {}


def test_score_with_parts_is_one_scoring_for_any_task():
  task = composed()
  total, parts = score_with_parts(task, PROBLEM, "The answer is 5")
  assert parts == task.score_components(PROBLEM, "The answer is 5")
  assert total == task.score(PROBLEM, "The answer is 5") == pytest.approx(1.0 - 2.0)
  assert score_with_parts(task.task, PROBLEM, "5") == (1.0, None)


def test_pickles_with_its_parts():
  task = composed()
  copy = pickle.loads(pickle.dumps(task))
  assert copy == task and hash(copy) == hash(task)
  assert copy.score_components(PROBLEM, "5") == task.score_components(PROBLEM, "5")


def test_gin_builds_the_shipped_humaneval_config(tmp_path):
  exp, _ = train.prepare([f"--gin_file={CONFIG}", f"--workdir={tmp_path}",
                          "--gin_param=ComposedTask.components = "
                          "[@FormatReward(), @LengthPenalty()]",
                          "--gin_param=ComposedTask.weights = [0.2, 0.5]",
                          "--gin_param=LengthPenalty.target_chars = 600"])
  task = exp.task
  assert isinstance(task, ComposedTask) and isinstance(task.task, HumanEvalTask)
  assert task.component_names() == ("correctness", "format", "length")
  assert task.weights == (0.2, 0.5) and task.components[1].target_chars == 600
  assert len(task.split("eval")) == 40 and exp.rollout.max_new_tokens == 384
  text = (tmp_path / "config.json").read_text()
  assert '"__class__": "ComposedTask"' in text and "def has_close_elements" not in text


def test_gin_mistake_in_a_component_is_one_line(capsys, tmp_path):
  rc = train.main([f"--gin_file={CONFIG}", f"--workdir={tmp_path / 'run'}",
                   "--gin_param=ComposedTask.weights = [0.2, 0.1]"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and "weights has 2 entries" in err, err


def test_scores_in_worker_processes():
  """The pool pickles the task into its workers; a HumanEval answer runs in the sandbox."""
  task = ComposedTask(HumanEvalTask(num_eval=2),
                      components=[FormatReward(), LengthPenalty(target_chars=100)],
                      weights=[0.2, 1.0])
  p = task.split("eval")[0]
  with VerifierPool(task, workers=1, timeout_s=30.0) as pool:
    pool.submit("right", p, p.answer)
    pool.submit("prose", p, "No idea.")
    rewards, stats = pool.results(["right", "prose"])
  length = -min(1.0, (len(p.answer) - 100) / 1000)
  assert rewards.tolist() == pytest.approx([1.0 + 0.2 + length, 0.0])
  assert stats.counts() == {"errors": 0, "timeouts": 0, "crashes": 0}
  assert math.isclose(task.score(p, p.answer), rewards[0], rel_tol=1e-6)
  # Each sample's parts come back with its reward; the step logs their means.
  metrics = stats.as_metrics()
  assert stats.parts[1] == {"correctness": 0.0, "format": 0.0, "length": 0.0}
  assert metrics["reward/correctness"] == 0.5 and metrics["reward/format"] == 0.5
  assert metrics["reward/length"] == pytest.approx(length / 2)


def test_thread_workers_report_the_parts_too():
  """Evaluation reads correctness from the parts: pass@1, not the shaped total."""
  task = ComposedTask(ArithmeticTask(num_train=10, num_eval=4),
                      components=[FormatReward(r"\d")], weights=[0.5])
  p = task.split("eval")[0]
  with VerifierPool(task, workers=1, timeout_s=30.0, processes=False) as pool:
    pool.submit(0, p, p.answer)
    pool.submit(1, p, "7" if p.answer != "7" else "8")
    _, stats = pool.results([0, 1])
  assert [q["correctness"] for q in stats.parts] == [1.0, 0.0]
  assert stats.as_metrics()["reward/format"] == 1.0

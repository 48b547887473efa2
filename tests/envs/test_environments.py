"""The built-in environments, played with scripted replies."""

import pickle

import numpy as np
import pytest

from jaxrl_post.envs import GuessingGame, HumanEvalFeedback, ToolArithmetic, play
from jaxrl_post.errors import UserError
from jaxrl_post.rewards import HumanEvalTask
from tests.rewards.sandboxed import SANDBOXED

pytestmark = SANDBOXED  # One worker: see tests/rewards/sandboxed.py.


def test_the_guessing_game_answers_higher_lower_and_ends_on_the_secret():
  game = GuessingGame(low=0, high=9, max_turns=4)
  problem = game.split("train")[0]
  secret = problem.meta["secret"]
  low = str(secret - 1) if secret > 0 else "x"
  steps = play(game, problem, [low, "99", str(secret), "0"])
  assert [s.observation for _, s in steps] == ["+" if secret > 0 else "?", "?", ""]
  assert [s.reward for _, s in steps] == [0.0, 0.0, 1.0]
  assert steps[-1][1].done and steps[-1][1].solved
  wrong = str((secret + 1) % 10)
  out = play(game, problem, [wrong] * 4)
  assert len(out) == 4 and out[-1][1].done and not out[-1][1].solved
  assert out[0][1].observation == ("-" if int(wrong) > secret else "+")
  assert game.score(problem, str(secret)) == 1.0 and game.final_answer("I say 7") == "7"


def test_the_guessing_game_splits_and_demonstrations():
  game = GuessingGame(num_eval=50)
  secrets = [p.meta["secret"] for p in game.split("eval")]
  assert set(secrets) == set(range(10)) and len(secrets) == 50
  demo = game.demonstration(game.split("train")[0], np.random.default_rng(0))
  assert len(demo) == 4 and len(set(demo)) == 4
  with pytest.raises(UserError, match="low=5 must be an integer below high=5"):
    GuessingGame(low=5, high=5)


def test_tool_arithmetic_runs_the_calculator_and_scores_the_answer():
  env = ToolArithmetic(terms=3, max_turns=3)
  problem = env.split("eval")[0]
  value = problem.meta["value"]
  call = ('<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
          % problem.meta["expression"])
  steps = play(env, problem, [call, f"Answer: {value}"])
  assert steps[0][1].observation == f"<tool_response>{value}</tool_response>"
  assert steps[1][1].solved and steps[1][1].reward == 1.0
  steps = play(env, problem, ["hmm", "<tool_call>bad</tool_call>", f"Answer: {value + 1}"])
  assert steps[0][1].observation == env.reminder
  assert "not valid JSON" in steps[1][1].observation
  assert steps[2][1].done and steps[2][1].reward == 0.0
  assert env.demonstration(problem, None)[1] == f"Answer: {value}"
  assert play(env, problem, env.demonstration(problem, None))[-1][1].solved
  assert [s.reward for _, s in play(env, problem, [call, call, f"Answer: {value}"])] == [
      0.0, 0.0, 1.0]  # No call reward unless asked for.


def test_tool_arithmetic_rewards_the_first_call_that_runs_once():
  env = ToolArithmetic(terms=3, max_turns=4, call_reward=0.1)
  problem = env.split("eval")[0]
  value = problem.meta["value"]
  call = '```calculator\n%s\n```'
  steps = play(env, problem, [call % "1 / 0", call % problem.meta["expression"],
                              call % "2 + 2", f"Answer: {value}"])
  assert [s.reward for _, s in steps] == [0.0, 0.1, 0.0, 1.0]  # An error earns nothing.
  with pytest.raises(UserError, match="call_reward"):
    ToolArithmetic(call_reward=1.0)


def test_humaneval_feedback_shows_the_failure_and_takes_a_second_attempt():
  env = HumanEvalFeedback(num_eval=2, num_train=2, max_turns=2, timeout_s=10.0)
  problem = env.split("eval")[0]
  wrong = f"```python\n{problem.meta['code']}    return None\n```"
  steps = play(env, problem, [wrong, problem.answer])
  assert not steps[0][1].done and "The tests failed (failed" in steps[0][1].observation
  assert steps[1][1].solved and steps[1][1].reward == 1.0
  last = play(env, problem, ["def (", "still (not code"])
  assert "syntax" in last[0][1].observation and last[1][1].done and not last[1][1].solved


def test_humaneval_feedback_builds_its_task_from_every_shared_field():
  """The problems, prompt and sandbox limits are declared once (rewards.HumanEvalSource):
  the environment's task gets each of them, the problems the single-turn task draws."""
  fields = dict(seed=3, num_eval=2, num_train=3, template="Fix:\n{code}", timeout_s=7.0,
                memory_mb=256)
  env = HumanEvalFeedback(**fields, max_turns=2)
  assert env.task.source() == env.source() == {"path": None, **fields}
  alone = HumanEvalTask(**fields)
  assert [p.prompt for p in env.split("train")] == [p.prompt for p in alone.split("train")]
  assert env.task._limits.timeout_s == 7.0 and env.task._limits.memory_mb == 256


@pytest.mark.parametrize("make", [GuessingGame, ToolArithmetic, lambda: HumanEvalFeedback(
    num_eval=2, num_train=2)], ids=["guess", "tool_arithmetic", "humaneval_feedback"])
def test_environments_pickle_for_worker_processes(make):
  env = make()
  again = pickle.loads(pickle.dumps(env))
  assert again.split("eval")[0] == env.split("eval")[0]

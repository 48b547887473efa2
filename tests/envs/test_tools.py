"""Tool calls: both formats parsed, every failure an observation, never an exception."""

import pytest

from jaxrl_post.envs import (MalformedCall, ToolCall, ToolRegistry, calculator,
                             parse_tool_call, python_sandbox)
from jaxrl_post.envs.tools import ToolError, calculate


def test_qwen_style_and_fenced_calls_are_parsed():
  text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "37 * 12"}}</tool_call>')
  assert parse_tool_call(text) == ToolCall("calculator", {"expression": "37 * 12"})
  fenced = "Run this:\n```python\nprint(2 + 2)\n```\nthen see."
  assert parse_tool_call(fenced, fenced=("python",)) == ToolCall("python",
                                                                 {"": "print(2 + 2)\n"})
  assert parse_tool_call(fenced) is None  # A fence counts only for a registered tool.
  assert parse_tool_call("Answer: 4") is None


@pytest.mark.parametrize("text,why", [
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', '"name"'),
    ('<tool_call>{"name": "calculator", "arguments": "3*4"}</tool_call>', '"arguments"'),
])
def test_a_malformed_call_says_what_is_wrong(text, why):
  with pytest.raises(MalformedCall, match=why):
    parse_tool_call(text)


def test_the_calculator_is_exact_and_refuses_what_is_not_arithmetic():
  assert calculate("37 * 12 + 58 - 19") == "483"
  assert calculate("7 / 2") == "3.5" and calculate("8 / 2") == "4"
  assert calculate("-(3 ** 4) % 5") == "4"
  for bad, why in (("1 / 0", "division by zero"), ("9 ** 9 ** 9", "too large"),
                   ("__import__('os')", "only numbers"), ("2 +", "cannot parse")):
    with pytest.raises(ToolError, match=why):
      calculate(bad)


def test_the_registry_turns_every_failure_into_an_observation():
  tools = ToolRegistry([calculator()])
  call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
  assert tools.call(call % "6 * 7") == "42"
  assert tools.call(call % "1 / 0") == "error: division by zero"
  assert tools.call('<tool_call>{"name": "search", "arguments": {}}</tool_call>').startswith(
      "error: no tool named 'search'")
  assert tools.call("<tool_call>oops</tool_call>").startswith("error: the tool call is not")
  assert tools.call('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'
                    ) == "error: calculator takes one string argument 'expression'"
  assert tools.call("```calculator\n2 ** 10\n```") == "1024"
  assert tools.call("no call here") is None


def test_python_runs_in_the_sandbox_with_its_time_limit():
  from jaxrl_post.rewards.sandbox import Limits
  tools = ToolRegistry([python_sandbox(Limits(timeout_s=2.0))])
  assert tools.call("```python\nprint(sum(range(10)))\n```") == "45"
  assert tools.call("```python\nwhile True: pass\n```").startswith("timeout")
  assert "ValueError: no" in tools.call("```python\nraise ValueError('no')\n```")


def test_a_registry_bound_to_a_verifier_pool_runs_its_tools_there():
  """The agent run binds the environment's tools to its verifier pool: calls run in the
  pool's worker processes, a hang is killed at the pool's deadline and comes back as an
  observation, and the registry still pickles (it travels to workers with its env)."""
  import os
  import pickle

  from jaxrl_post.envs import ToolArithmetic
  from jaxrl_post.envs.tools import Tool
  from jaxrl_post.rewards import VerifierPool
  from tests.rewards.test_pool import act

  env = ToolArithmetic()
  tools = ToolRegistry([calculator(), python_sandbox(),
                        Tool("pid", "what", act), Tool("hang", "what", act)])
  # The env as the task, as the agent run has it: workers import envs before the clock runs.
  with VerifierPool(env, workers=2, timeout_s=2.0) as pool:
    assert pool.wait_ready()
    tools.bind(pool)
    assert pickle.loads(pickle.dumps(tools)).call("```calculator\n6 * 7\n```") == "42"
    assert tools.call("```calculator\n6 * 7\n```") == "42"
    assert tools.call("```calculator\n1 / 0\n```") == "error: division by zero"
    assert tools.call("```python\nprint(3 + 4)\n```") == "7"
    pid = int(tools.call("```pid\npid\n```"))
    assert pid in pool.pids and pid != os.getpid()
    assert tools.call("```hang\nhang\n```") == "error: hang was stopped after 2 s"
    assert tools.call('```pid\ncrash\n```').startswith("error: pid failed (worker exited")
    env.tools.bind(pool)
    assert pickle.loads(pickle.dumps(env)).tools.call("```calculator\n2 ** 5\n```") == "32"

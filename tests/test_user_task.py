"""A task of one's own, the documented way: a class registered with jaxrl_post.register in a
module outside the package (examples/my_task), imported by the commands' --gin_import."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

import jaxrl_post
from jaxrl_post import train
from jaxrl_post.envs import Environment, Step
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline import config, trained
from jaxrl_post.rewards import Problem
from jaxrl_post.telemetry import read_metrics
from tests.xla import host_flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLE = ["--gin_import=examples.my_task", "--gin_file=examples/my_task/config.gin"]
# The example at its smallest: two RL steps of 4 prompts x 4 samples, a short warm-up.
SMALL = ["Experiment.steps = 2", "SftConfig.steps = 4", "EvalSpec.num_problems = 8",
         "EvalSpec.every_n_steps = 0", "RolloutSpec.prompts_per_step = 4",
         "RolloutSpec.group_size = 4", "EngineConfig.num_slots = 16",
         "EngineConfig.group_slots = 4", "OptimizerConfig.total_steps = 10",
         "PlacementConfig.num_devices = 1", "LogSpec.progress = False"]


def _train(*flags) -> subprocess.CompletedProcess:
  """The training command as the README gives it: from the repository root, which `python
  -m` puts on sys.path, so `examples` imports without PYTHONPATH, in the verifier worker
  processes too (they unpickle the task by its module)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(1))
  return subprocess.run([sys.executable, "-m", "jaxrl_post.train", *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_the_example_task_trains_through_gin_import(tmp_path):
  workdir = tmp_path / "run"
  done = _train(*EXAMPLE, f"--workdir={workdir}", *(f"--gin_param={p}" for p in SMALL))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "held-out accuracy:" in done.stdout
  task = json.loads((workdir / "config.json").read_text())["task"]
  assert task["__class__"] == "ReverseTask" and task["max_length"] == 4
  records = read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2]
  for r in records[1:]:  # Every sample scored by ReverseTask.score in a worker process.
    assert (r["verifier/samples"], r["verifier/errors"], r["verifier/crashes"]) == (16, 0, 0)
    assert 0.0 <= r["reward/mean"] <= 1.0
  assert records[0]["eval/problems"] == 8 and records[0]["eval/errors"] == 0
  # The run's config.gin imports the module itself, so it parses again without the flag
  # (evaluate --checkpoint and export read the model from it).
  assert "import examples.my_task" in (workdir / "config.gin").read_text()
  assert trained.read_model_spec(str(workdir)).source == "tiny"


def test_a_module_that_does_not_import_is_one_error_line(tmp_path):
  done = _train("--gin_import=examples.no_such_task", *EXAMPLE[1:],
                f"--workdir={tmp_path / 'run'}")
  assert done.returncode == 2
  assert done.stderr.startswith("error: --gin_import=examples.no_such_task: no module named "
                                "'examples.no_such_task'") and done.stderr.count("\n") == 1
  assert not (tmp_path / "run").exists()  # Nothing was written: no work started.


def test_plan_reads_the_same_config_with_the_same_flag():
  """plan parses the config's bindings of the user's classes too; without the module it
  says which flag is missing."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(1))
  plan = lambda *flags: subprocess.run([sys.executable, "-m", "jaxrl_post.plan", *flags,
                                        "--json"], cwd=ROOT, env=env, capture_output=True,
                                       text=True, timeout=600)
  done = plan(*EXAMPLE)
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads(done.stdout.strip().splitlines()[-1])["fits"] is True
  done = plan(*EXAMPLE[1:])
  assert done.returncode == 2 and "'@ReverseTask()'" in done.stderr
  assert "--gin_import=MODULE" in done.stderr


@pytest.mark.parametrize("module,expected", [
    ("examples/my_task.py", "not a module name; give one as Python imports it, e.g. "
                            "'examples.my_task', not a path"),
    ("broken_tasks", "broken_tasks.py:2: invalid syntax"),
    ("needs_missing", "cannot import it: No module named 'no_such_dependency'"),
])
def test_each_import_mistake_names_the_module(capsys, tmp_path, monkeypatch, module, expected):
  (tmp_path / "broken_tasks.py").write_text("import dataclasses\nclass (:\n")
  (tmp_path / "needs_missing.py").write_text("import no_such_dependency\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  rc = train.main([f"--gin_import={module}", *EXAMPLE[1:], f"--workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert rc == 2 and err.startswith(f"error: --gin_import={module}: ") and err.count("\n") == 1
  assert expected in err


def test_a_registered_environment_is_configured_as_a_built_in_one():
  """An Environment subclass registers the same way; gin binds its fields and builds it
  as Experiment.task, with the agent spec that runs its episodes."""

  @jaxrl_post.register
  @dataclasses.dataclass(frozen=True)
  class EchoGame(Environment):
    word: str = "hi"
    max_turns: int = 2

    def split(self, name):
      return [Problem(f"echo-{name}", f"say {self.word}", self.word)]

    def reset(self, problem):
      return types.SimpleNamespace(step=lambda reply: Step("", float(reply == self.word), True))

  config.parse([], ["Experiment.task = @EchoGame()", "EchoGame.word = 'yo'",
                    "Experiment.agent = @AgentSpec()", "AgentSpec.max_turns = 2"])
  exp = config.build_experiment()
  assert exp.task == EchoGame(word="yo") and exp.agent.max_turns == 2
  assert jaxrl_post.register(EchoGame) is EchoGame  # Again: the same class, no mistake.


def test_registering_a_taken_name_or_a_plain_class_is_one_error_line():
  @dataclasses.dataclass(frozen=True)
  class ArithmeticTask:
    seed: int = 0

  with pytest.raises(UserError, match=r"^register: .*ArithmeticTask: the name "
                                      r"'ArithmeticTask' is taken by "
                                      r"jaxrl_post\.rewards\.arithmetic\.ArithmeticTask"):
    jaxrl_post.register(ArithmeticTask)
  with pytest.raises(UserError, match="is not a dataclass; put @jaxrl_post.register above"):
    jaxrl_post.register(type("Plain", (), {}))

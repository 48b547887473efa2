"""gin configuration of a run: every mistake is one error line before any work starts."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_post import train
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline import config

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.gin")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def _run_main(capsys, tmp_path, *params, gin_file=QUICKSTART):
  argv = [f"--gin_file={gin_file}", f"--workdir={tmp_path / 'run'}"]
  argv += [f"--gin_param={p}" for p in params]
  rc = train.main(argv)
  return rc, capsys.readouterr().err


@pytest.mark.parametrize("binding,expected", [
    ("RolloutSpec.group_sise = 4", "group_sise"),
    ("NoSuchThing.x = 1", "NoSuchThing"),
    ("RolloutSpec.group_size = 0", "group_size must be a positive integer"),
    ("LossConfig.name = 'ppp'", "ppp"),
    ("OptimizerConfig.learning_rate = -1.0", "learning_rate must be > 0"),
    ("PromptConfig.overlong = 'drop'", "overlong='drop'"),
    ("ArithmeticTask.operators = ('+', '^')", "^"),
    ("TrainerConfig.minibatches = 3", "do not split"),
    ("EngineConfig.kv_dtype = 'float8'", "kv_dtype='float8' is not one of"),
    ("SyncConfig.rollout_dtype = 'int8'", "rollout_dtype='int8' is not a float dtype"),
    ("EngineConfig.num_slots = 'many'", "EngineConfig.num_slots = 'many' is not an integer "
                                        "or None"),
    ("OptimizerConfig.learning_rate = 'fast'", "learning_rate = 'fast' is not a number"),
    ("Experiment.steps = True", "Experiment.steps = True is not an integer"),
    ("RolloutSpec.group_size = ", "gin"),
    ("RolloutSpec.group_size = (", "--gin_param='RolloutSpec.group_size = (': unexpected EOF"),
])
def test_bad_binding_is_one_line_error_before_any_work(capsys, tmp_path, binding, expected):
  rc, err = _run_main(capsys, tmp_path, binding)
  assert rc == 2
  assert err.startswith("error: ") and err.count("\n") == 1, err
  assert expected in err
  assert not (tmp_path / "run").exists()  # Nothing was written: no work started.


def test_missing_gin_file_and_missing_dataset(capsys, tmp_path):
  rc, err = _run_main(capsys, tmp_path, gin_file=str(tmp_path / "nope.gin"))
  assert rc == 2 and "nope.gin: no such gin file" in err
  rc, err = _run_main(capsys, tmp_path, "Experiment.task = @JsonlTask()",
                      f"JsonlTask.path = '{tmp_path}/missing.jsonl'")
  assert rc == 2 and "missing.jsonl" in err and err.count("\n") == 1


def test_an_unclosed_bracket_or_string_in_a_gin_file_names_the_file_and_line(capsys, tmp_path):
  for text, message in (("SftConfig.steps = 0\nRolloutSpec.group_size = (\n", "unexpected EOF"),
                        ("SftConfig.steps = 0\nLossConfig.name = 'grpo\n", "unterminated string")):
    (tmp_path / "bad.gin").write_text(text)
    rc, err = _run_main(capsys, tmp_path, gin_file=str(tmp_path / "bad.gin"))
    assert rc == 2 and err.count("\n") == 1, err
    assert f"error: gin: {tmp_path / 'bad.gin'}, line 2: {message}" in err, err


def test_missing_model_is_one_line_error(capsys, tmp_path):
  rc, err = _run_main(capsys, tmp_path, "ModelSpec.source = '/no/such/model.gguf'",
                      "ModelSpec.tokenizer = ''")
  assert rc == 2 and "/no/such/model.gguf" in err and err.count("\n") == 1


def test_a_workdir_that_is_a_file_is_one_line_error(capsys, tmp_path):
  (tmp_path / "taken").write_text("")
  for workdir in ("taken", "taken/run"):
    rc = train.main([f"--gin_file={QUICKSTART}", f"--workdir={tmp_path / workdir}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--workdir={tmp_path / workdir}: cannot be used as a directory" in err


def test_bindings_reach_nested_configs_and_scopes(tmp_path):
  exp, workdir = train.prepare([
      f"--gin_file={QUICKSTART}", f"--workdir={tmp_path}",
      "--gin_param=LossConfig.kl_coef = 0.25",
      "--gin_param=trainer_mesh/MeshConfig.fsdp = 1",
      "--gin_param=PlacementConfig.num_devices = 1",
      "--gin_param=RolloutSpec.group_size = 4"])
  assert exp.trainer.loss.kl_coef == 0.25
  assert exp.placement.trainer_mesh.fsdp == 1
  assert exp.placement.rollout_mesh.data == -1  # The scoped binding did not leak.
  assert exp.advantage.group_size == 4 and exp.advantage.name == "grpo"
  assert exp.rollout.engine.pool.page_size == 8  # PoolConfig binding, two levels down.
  resolved = json.loads((tmp_path / "config.json").read_text())
  assert resolved["trainer"]["loss"]["kl_coef"] == 0.25
  assert resolved["task"]["__class__"] == "ArithmeticTask"
  assert "LossConfig.kl_coef = 0.25" in (tmp_path / "config.gin").read_text()


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".gin")))
def test_every_shipped_config_parses_and_documents_its_command(name):
  path = os.path.join(CONFIGS, name)
  first = open(path).readline()
  assert first.startswith("# python -m jaxrl_post.train --gin_file=configs/" + name), first
  config.parse([path], [])
  try:
    config.build_experiment()
  except UserError as e:  # Only a missing local model/dataset file may stop it here.
    assert "no such file" in str(e), str(e)


def test_an_unscoped_binding_of_a_class_built_twice_is_an_error_naming_both(capsys, tmp_path):
  rc, err = _run_main(capsys, tmp_path, "AdvantageConfig.name = 'rloo'")
  assert rc == 2 and err.count("\n") == 1, err
  assert "Experiment.advantage and Experiment.trainer.gae" in err
  assert "advantage/AdvantageConfig.name or gae/AdvantageConfig.name" in err
  rc, err = _run_main(capsys, tmp_path, "MeshConfig.fsdp = 2")
  assert rc == 2 and "trainer_mesh/MeshConfig.fsdp or rollout_mesh/MeshConfig.fsdp" in err


def test_a_scoped_binding_reaches_only_its_place(tmp_path):
  exp, _ = train.prepare([f"--gin_file={QUICKSTART}", f"--workdir={tmp_path}",
                          "--gin_param=advantage/AdvantageConfig.name = 'rloo'",
                          "--gin_param=gae/AdvantageConfig.gamma = 0.9"])
  assert exp.advantage.name == "rloo" and exp.trainer.gae.name == "gae"
  assert exp.trainer.gae.gamma == 0.9 and exp.advantage.gamma != 0.9


def test_a_scoped_binding_that_reaches_nothing_is_an_error_naming_the_places(capsys,
                                                                           tmp_path):
  """gin ignores a binding in a scope nothing is built in (a typo in the scope): the run
  would go on without it. A scope a reference opens (`@bar/ArithmeticTask()`) counts."""
  rc, err = _run_main(capsys, tmp_path, "trainer_mseh/MeshConfig.fsdp = 4")
  assert rc == 2 and err.count("\n") == 1, err
  assert err == ("error: gin: trainer_mseh/MeshConfig.fsdp reaches nothing: no MeshConfig is "
                 "built in scope 'trainer_mseh'; MeshConfig is built at "
                 "Experiment.placement.trainer_mesh and Experiment.placement.rollout_mesh\n")
  rc, err = _run_main(capsys, tmp_path, "bar/ArithmeticTask.num_eval = 4")
  assert rc == 2 and "no ArithmeticTask is built in scope 'bar'" in err
  assert not (tmp_path / "run").exists()
  exp, _ = train.prepare([f"--gin_file={QUICKSTART}", f"--workdir={tmp_path}",
                          "--gin_param=Experiment.task = @bar/ArithmeticTask()",
                          "--gin_param=bar/ArithmeticTask.num_eval = 4"])
  assert exp.task.num_eval == 4


def test_every_place_of_a_class_has_its_own_scope():
  for name, where in config.places().items():
    scopes = [w.rsplit(".", 1)[-1] for w in where]
    assert len(set(scopes)) == len(scopes), (name, where)


def test_a_task_left_at_its_default_is_built(tmp_path):
  """Experiment.task defaults to an ArithmeticTask, whose init=False fields (its splits)
  the builder must leave to the class."""
  gin_file = tmp_path / "minimal.gin"
  gin_file.write_text("Experiment.steps = 1\nModelSpec.source = 'tiny'\n"
                      "ModelSpec.tokenizer = 'chars'\n")
  exp, _ = train.prepare([f"--gin_file={gin_file}", f"--workdir={tmp_path / 'run'}"])
  assert type(exp.task).__name__ == "ArithmeticTask" and len(exp.task.split("eval")) > 0


_SLICES = sorted(os.path.join(d, f) for d in ("gpu", "tpu")
                 for f in os.listdir(os.path.join(CONFIGS, d)) if f.endswith(".gin"))


@pytest.mark.parametrize("name", _SLICES)
def test_every_accelerator_config_parses_and_documents_how_to_plan_and_launch(name):
  path = os.path.join(CONFIGS, name)
  head = open(path).read().splitlines()[:2]
  assert head[0].startswith(f"# Plan:   python -m jaxrl_post.plan --gin_file=configs/{name}")
  assert head[1].startswith(f"# Launch: python -m jaxrl_post.train --gin_file=configs/{name}")
  cwd = os.getcwd()
  os.chdir(os.path.join(CONFIGS, ".."))  # Their includes and MODEL_DIRs are repo-relative.
  try:
    config.parse([path], [])
    config.build_experiment()
  except UserError as e:  # The GSM8K files live on the machine that trains.
    assert "/data/gsm8k/train.jsonl: no such file" in str(e), str(e)
  finally:
    os.chdir(cwd)


@pytest.mark.sweep  # A full plan per config: minutes each, for a release check.
@pytest.mark.parametrize("name", _SLICES)
def test_every_accelerator_config_fits_the_target_its_plan_line_names(name):
  """The command on each config's first line, as a user pastes it, says "fits" (exit 0)."""
  line = open(os.path.join(CONFIGS, name)).readline()
  args = line.split("python -m jaxrl_post.plan", 1)[1].split()
  out = subprocess.run([sys.executable, "-m", "jaxrl_post.plan", *args, "--json"],
                       cwd=os.path.join(CONFIGS, ".."), capture_output=True, text=True,
                       timeout=1800)
  assert out.returncode == 0 and json.loads(out.stdout)["fits"], out.stdout[-2000:]

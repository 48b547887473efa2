"""The multi-turn run end to end: train, store the episodes, resume, evaluate, read them."""

import json
import os
import types

import numpy as np
import pytest

from jaxrl_post import evaluate, train, trajectories
from jaxrl_post.envs import GuessingGame, store
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline.agent import AgentRLRun
from jaxrl_post.pipeline.config import AsyncSpec
from jaxrl_post.pipeline.pipelined import run_class
from jaxrl_post.telemetry import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
AGENT = os.path.join(ROOT, "configs", "quickstart_agent.gin")
# The agent quickstart shrunk to seconds, on one device (episodes on a rollout mesh equal one
# device's: tests/envs/test_driver.py).
FAST = ["Experiment.steps = 3", "SftConfig.steps = 4", "EvalSpec.every_n_steps = 2",
        "EvalSpec.num_problems = 8", "EvalSpec.samples = 4", "RolloutSpec.prompts_per_step = 4",
        "RolloutSpec.group_size = 4", "EngineConfig.num_slots = 16",
        "CheckpointConfig.every_n_steps = 1", "OptimizerConfig.total_steps = 10",
        "AgentSpec.env_workers = 2",  # A guess is a comparison: 2 workers keep up.
        "PlacementConfig.num_devices = 1"]


def _argv(workdir, extra=()):
  return ([f"--gin_file={AGENT}", f"--workdir={workdir}"] +
          [f"--gin_param={p}" for p in FAST + list(extra)])


def _stored(workdir):
  with open(os.path.join(workdir, store.FILE)) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow(reason="one agent run checked through training, storage, resume and evaluation")
def test_agent_run_trains_on_episodes_stores_them_and_resumes(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  assert train.main(_argv(workdir)) == 0
  metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  assert [m["step"] for m in metrics] == [0, 1, 2, 3]
  for m in metrics[1:]:
    assert m["agent/turns_mean"] > 1.0 and 0.0 <= m["agent/solved"] <= 1.0
    assert m["train/tokens"] > 0 and m["reward/mean"] == m["agent/solved"]
  assert {"eval/pass@4", "eval/maj@4", "eval/turns_mean"} <= set(metrics[-1])

  rows = _stored(workdir)
  train_rows = [r for r in rows if r["split"] == "train"]
  assert sorted({r["step"] for r in train_rows}) == [1, 2, 3] and len(train_rows) == 3 * 16
  assert sorted({r["step"] for r in rows if r["split"] == "eval"}) == [0, 2, 3]
  for r in train_rows:  # The stored ids are the episode: model turns, then observations.
    assert r["turns"] and all(t["ids"] for t in r["turns"])
    assert r["reward"] == float(r["solved"])
    assert all(t["observation"] == "" for t in r["turns"][-1:])

  # Resumes after step 3; step 4 credits each turn with the rewards from it on (per-token
  # advantages through the trainer; the game rewards only its last turn, so they equal the
  # episode's here).
  assert train.main(_argv(workdir, ["Experiment.steps = 4",
                                    "AgentSpec.credit = 'reward_to_go'"])) == 0
  last = read_metrics(os.path.join(workdir, "metrics.jsonl"))[-1]
  assert last["step"] == 4 and np.isfinite(last["train/loss"]) and "train/advantage/std" in last
  rows = _stored(workdir)
  assert sorted({r["step"] for r in rows if r["split"] == "train"}) == [1, 2, 3, 4]
  assert len([r for r in rows if r["split"] == "train"]) == 4 * 16  # None written twice.

  capsys.readouterr()
  assert trajectories.main([workdir, "--split", "train", "--step", "4", "--limit", "2"]) == 0
  out = capsys.readouterr().out
  assert out.count("[prompt] guess 0-9:") == 2 and "[model 1]" in out
  assert out.strip().splitlines()[-1].startswith("2 episodes, mean reward ")
  assert trajectories.main([workdir, "--solved", "--json"]) == 0
  assert all(json.loads(line)["solved"] for line in capsys.readouterr().out.splitlines())
  assert trajectories.main([str(tmp_path / "none")]) == 2

  args = [f"--gin_file={AGENT}", f"--checkpoint={workdir}", "--json"]
  args += [f"--gin_param={p}" for p in FAST]
  assert evaluate.main(args) == 0
  result = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert result["eval/problems"] == 8 and "eval/pass@4" in result and "eval/maj@4" in result


MOE = ["ModelSpec.moe = @MoeConfig()", "MoeConfig.num_experts = 4",
       "MoeConfig.intermediate_size = 96", "TrainerConfig.routing = @RoutingReplay()",
       "RoutingReplay.mode = 'replay'",
       "Experiment.steps = 1", "EvalSpec.every_n_steps = 0", "CheckpointConfig.every_n_steps = 5",
       "TrainerConfig.minibatches = 1"]


def test_a_moe_policy_plays_episodes_with_every_fed_token_replayed(tmp_path):
  """Each turn records the experts of the tokens it fed (the observation's included: a
  later turn prefills them); the episode's record stitches them, so replay routes every
  fed token as the rollout did. With one update per step the trainer routes with the
  rollout's own float32 weights, so its router agrees with every record; records one
  position off agreed on 0.77 of the choices, and none reached the trainer before (0.0)."""
  workdir = str(tmp_path / "moe")
  assert train.main(_argv(workdir, MOE)) == 0
  last = read_metrics(os.path.join(workdir, "metrics.jsonl"))[-1]
  assert last["step"] == 1 and last["agent/turns_mean"] > 1.0
  assert last["train/routing/expert_agreement"] == 1.0 and np.isfinite(last["train/loss"])


def test_an_episodes_experts_are_its_turns_records_stitched():
  from jaxrl_post.envs.driver import EpisodeRecord, Turn
  from jaxrl_post.rollout.scheduler import Completion

  def turn(tokens, record, observation):  # record: [history + N - 1, L=1, k=1]
    c = Completion(tokens, (0.0,) * len(tokens), "stop", (0,) * len(tokens),
                   np.asarray(record, np.int16).reshape(-1, 1, 1))
    return Turn(c, "", "", observation, 0.0)

  # Prompt of 2, turn 1 of 2 tokens, observation of 2, turn 2 of 1 token: 7 tokens, 6 fed.
  # Turn 2 fed turn 1's last token, the observation and nothing more (its one token ended).
  first = turn((5, 6), [1, 2, 3], (7, 8))
  second = turn((9,), [-1, -1, -1, 4, 5, 6], ())
  record = EpisodeRecord((first, second), 1.0, True, "done")
  assert record.tokens == (5, 6, 7, 8, 9)
  np.testing.assert_array_equal(record.experts[:, 0, 0], [1, 2, 3, 4, 5, 6])


def test_an_environment_task_runs_synchronously_and_refuses_the_asynchronous_modes():
  exp = types.SimpleNamespace(task=GuessingGame(), asynchronous=AsyncSpec(mode="bounded"))
  with pytest.raises(UserError, match="multi-turn episodes run synchronously"):
    run_class(exp)
  assert run_class(types.SimpleNamespace(task=GuessingGame(), asynchronous=AsyncSpec())
                   ) is AgentRLRun


def test_the_agent_run_sends_its_environments_tool_calls_to_its_verifier_pool(tmp_path):
  """ToolArithmetic's calculator runs in the run's verifier pool workers; an environment
  without tools (the guessing game) starts no pool."""
  from jaxrl_post.envs import ToolArithmetic

  overrides = ['ModelSpec.overrides = {"vocab_size": 128, "hidden_size": 32, '
               '"intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, '
               '"head_dim": 16, "max_position_embeddings": 512}',
               "Experiment.task = @ToolArithmetic()", "PromptConfig.max_prompt_tokens = 400",
               "TrainerConfig.row_tokens = 512", "AgentSpec.max_tokens = 64",
               "RewardSpec.timeout_s = 5.0"]
  exp, workdir = train.prepare(_argv(str(tmp_path / "tools"), overrides))
  assert isinstance(exp.task, ToolArithmetic)
  run = AgentRLRun(exp, workdir)
  try:
    assert run.pool is not None and run.pool.wait_ready()
    assert exp.task.tools._pool is run.pool
    calls, real = [], run.pool.call
    run.pool.call = lambda key, fn, *args: calls.append(args) or real(key, fn, *args)
    assert exp.task.tools.call("```calculator\n12 * 12\n```") == "144"
    assert [a[1] for a in calls] == ["12 * 12\n"]  # Through the pool's workers.
  finally:
    run.close()
  assert exp.task.tools._pool is None
  exp, workdir = train.prepare(_argv(str(tmp_path / "game")))
  run = AgentRLRun(exp, workdir)
  try:
    assert run.pool is None
  finally:
    run.close()

"""A training step overlaps its rewards with its decode.

Kept free of jax at import: verifier worker processes import this module to unpickle its task.
"""

import dataclasses
import time

import pytest

from jaxrl_post.rewards import ArithmeticTask, VerifierPool

# One worker runs this file: its module fixture (a run or a pool) is built once, not
# once per worker (scripts/test.sh distributes by --dist loadgroup).
pytestmark = pytest.mark.xdist_group("overlap")

WORKERS = 4
PROMPTS, K, NEW_TOKENS = 16, 4, 48
# Small enough that the train step is short beside a decode of one token per device call.
MODEL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
         "num_heads": 2, "num_kv_heads": 1, "head_dim": 32, "max_position_embeddings": 64,
         "compute_dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class SlowArithmetic(ArithmeticTask):
  """Arithmetic whose verifier takes `delay` seconds per call (sleeping: it needs no CPU,
  so the measurement holds on a busy host)."""

  delay: float = 0.0

  def score(self, problem, completion):
    time.sleep(self.delay)
    return super().score(problem, completion)


def _experiment():
  from jaxrl_post.checkpoint import CheckpointConfig
  from jaxrl_post.data.prompts import PromptConfig
  from jaxrl_post.pipeline.config import (EvalSpec, Experiment, LogSpec, ModelSpec, RewardSpec,
                                          RolloutSpec, validate)
  from jaxrl_post.rl.sft import SftConfig
  from jaxrl_post.rl.trainer import TrainerConfig
  from jaxrl_post.rollout import EngineConfig, PoolConfig
  from jaxrl_post.sharding import PlacementConfig, SyncConfig

  # One prompt's K samples decode at a time, so the groups finish one after another over
  # the whole decode, as they do when a step has more prompts than the engine has slots.
  engine = EngineConfig(num_slots=K, group_slots=K, decode_steps=1, min_table_pages=2,
                        pool=PoolConfig(page_size=8, num_pages=64))
  return validate(Experiment(
      steps=100, model=ModelSpec(source="tiny", tokenizer="chars", overrides=MODEL),
      task=SlowArithmetic(max_operand=49, operators=("+",), num_eval=8),
      prompts=PromptConfig(max_prompt_tokens=16),
      rollout=RolloutSpec(prompts_per_step=PROMPTS, group_size=K, max_new_tokens=NEW_TOKENS,
                          engine=engine),
      reward=RewardSpec(workers=WORKERS, timeout_s=30.0),
      trainer=TrainerConfig(row_tokens=64), sft=SftConfig(steps=0),
      eval=EvalSpec(every_n_steps=0, num_problems=1),
      placement=PlacementConfig(num_devices=1), sync=SyncConfig(rollout_dtype="float32"),
      logging=LogSpec(tensorboard=False, progress=False),
      checkpoint=CheckpointConfig(every_n_steps=1000)))


def _timed_step(run, step):
  from jaxrl_post.telemetry import StepTimer

  timer = StepTimer()
  timer.start()
  metrics = run.step(step, timer)
  return metrics | timer.stop()


def _serial_rewards(pool, task, n):
  """Seconds to score n samples submitted together: the reward role without overlap."""
  problem = task.split("train")[0]
  start = time.perf_counter()
  for i in range(n):
    pool.submit(("serial", i), problem, problem.answer)
  pool.results([("serial", i) for i in range(n)])
  return time.perf_counter() - start


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  from jaxrl_post.pipeline.loop import RLRun

  run = RLRun(_experiment(), str(tmp_path_factory.mktemp("run")), log=lambda message: None)
  try:
    run.start()
    run.sampling = dataclasses.replace(run.sampling, stop_ids=())  # Exactly NEW_TOKENS each.
    yield run
  finally:
    run.close()


def test_groups_are_reported_as_they_finish_and_match_generate(run, monkeypatch):
  from jaxrl_post.pipeline import rollouts
  from jaxrl_post.rollout import Request, generate

  decodes = []  # One entry per decode call of the engine that decoded something.
  collect = run.engine.collect  # The scheduler launches calls and collects them later.

  def counted():
    out = collect()
    if (out.tokens >= 0).any():
      decodes.append(1)
    return out

  monkeypatch.setattr(run.engine, "collect", counted)
  problems, prompts = run.prompts.next_batch(4)
  seen = []
  groups = rollouts.sample_groups(
      run.engine, problems, prompts, K, run.sampling, run.exp.rollout.scheduler, seed=3,
      step=5, on_group=lambda i, g: seen.append((i, g, len(decodes))))
  total = len(decodes)
  requests = [Request(tuple(ids), seed=rollouts.request_seed(3, 5, i))
              for i, ids in enumerate(prompts)]
  want = generate(run.engine, requests, n=K, sampling=run.sampling,
                  scheduler=run.exp.rollout.scheduler)
  assert [g.completions for g in groups] == want
  assert [g.problem for g in groups] == problems and [g.prompt for g in groups] == prompts
  assert sorted(i for i, _, _ in seen) == list(range(4))
  assert all(g == groups[i] for i, g, _ in seen)
  # Handed over as they finish: the first long before the decode ends, none after it.
  assert seen[0][2] < total / 2 and seen[-1][2] == total


def test_rewards_as_long_as_decode_overlap_it(run):
  """In a training step whose rewards take as long as its decode, the step takes well
  under decode + rewards."""
  _timed_step(run, 1)  # Compiles.
  decode_s = _timed_step(run, 2)["time/rollout"]
  # Verifiers that need as long as the decode: N calls on WORKERS workers.
  delay = decode_s * WORKERS / (PROMPTS * K)
  run.pool.close()
  run.pool = VerifierPool(dataclasses.replace(run.task, delay=delay), workers=WORKERS,
                          timeout_s=30.0)
  assert run.pool.wait_ready()
  ratios = []
  for step in (3, 4):  # The better of two: one step can meet a burst of load.
    m = _timed_step(run, step)
    serial_s = _serial_rewards(run.pool, run.task, PROMPTS * K)
    ratios.append(m["time/step"] / (m["time/rollout"] + serial_s))
    print(f"\nstep {step}: {m['time/step']:.2f} s (rollout {m['time/rollout']:.2f} s, reward "
          f"wait {m['reward/wait_s']:.2f} s, train {m['time/train']:.2f} s); decode + serial "
          f"rewards {m['time/rollout']:.2f} + {serial_s:.2f} s; ratio {ratios[-1]:.2f}")
    if ratios[-1] < 0.8:
      break
  assert min(ratios) < 0.8, ratios


def test_reward_spec_binds_through_gin_and_rejects_bad_values():
  from jaxrl_post.errors import UserError
  from jaxrl_post.pipeline import config

  try:
    task = "Experiment.task = @ArithmeticTask()"
    config.parse([], [task, "RewardSpec.workers = 2", "RewardSpec.timeout_s = 3.5",
                      "RewardSpec.processes = False"])
    exp = config.build_experiment()
    assert exp.reward == config.RewardSpec(workers=2, timeout_s=3.5, processes=False)
    assert config.places()["RewardSpec"] == ["Experiment.reward"]
    config.parse([], [task, "RewardSpec.timeout_s = 0"])
    with pytest.raises(UserError, match="reward spec: timeout_s must be a finite number > 0, got 0"):
      config.build_experiment()
  finally:
    config.parse([], [])

"""The multi-turn RL run: the synchronous loop with episodes in place of completions.

Only the rollout side changes. A step draws K episodes per prompt with the multi-turn
driver (envs.driver: each trajectory's K/V stays in the pool between its turns), takes
each episode's reward from its environment (it scored every turn as it answered it; the
verifier pool's workers run the environment's tool calls; its steps run in the driver's
own killable workers, with AgentSpec.step_timeout_s as their deadline), and hands the trainer
every token after the prompt with a loss mask over the model's own: observations
condition the policy but are never trained on.
Advantages are GRPO's over the K episodes of a problem, per episode or, with
AgentSpec.credit = "reward_to_go", per turn (rl.turn_credit). Evaluation is the greedy success
rate of episodes, and pass@k / maj@k over sampled ones.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.data.prompts import PromptConfig
from jaxrl_post.envs import Environment, EpisodeRecord, EpisodeRunner, TurnFormat
from jaxrl_post.envs.driver import scripted_episode
from jaxrl_post.envs.store import TrajectoryStore
from jaxrl_post.envs.tools import ToolRegistry
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline import dynamic, rollouts
from jaxrl_post.pipeline.loop import Progress, RLRun
from jaxrl_post.rewards import Problem, VerifierPool, VerifierStats, at_k
from jaxrl_post.rl import turn_credit
from jaxrl_post.rl.packing import Trajectory, completion_bucket
from jaxrl_post.rl.trainer import SequenceScores
from jaxrl_post.rollout import SamplingParams


class AgentRLRun(RLRun):
  """RLRun over an environment task (Experiment.task is an envs.Environment)."""

  def __init__(self, exp, workdir: str, log=print):
    super().__init__(exp, workdir, log)
    if not isinstance(exp.task, Environment):
      raise UserError(f"agent: the task {type(exp.task).__name__} is not an environment")
    if self.trainer.value_head:
      raise UserError("agent: multi-turn episodes train with group advantages (GRPO "
                      "family); a value-head model's GAE is not supported for them yet")
    self.env, self.spec = exp.task, exp.agent
    if self.spec.credit == "reward_to_go":
      turn_credit.check_estimator(exp.advantage)
    self._earned: list[np.ndarray] = []  # Per trajectory: rewards before each token's turn.
    self.turns = TurnFormat(self.tokenizer, exp.prompts.chat_template)
    self.store: Optional[TrajectoryStore] = None
    self._agent_metrics: dict[str, float] = {}

  def _verifier_pool(self) -> Optional[VerifierPool]:
    """Workers for the environment's tool calls (killable, off the trainer's process); None
    for an environment without tools. Rewards come from the environment, turn by turn."""
    tools = getattr(self.exp.task, "tools", None)
    if not isinstance(tools, ToolRegistry):
      return None
    pool = super()._verifier_pool()
    tools.bind(pool)
    return pool

  def start(self) -> Progress:
    progress = super().start()
    self.runner = EpisodeRunner(self.engine, self.env, self.turns, self.spec.limits(),
                                self.exp.rollout.scheduler, workers=self.spec.env_workers,
                                dead_letter=self.dead_letter)
    if self.spec.store and jax.process_index() == 0:
      self.store = TrajectoryStore(self.workdir,
                                   progress.step if progress.eval_history else -1)
    return progress

  def _completion_budget(self) -> int:
    return self.exp.agent.max_tokens

  def _warm_up_script(self):
    limits = self.spec.limits()
    return lambda problem, rng: scripted_episode(self.env, problem, self.turns, limits, rng)

  # ------------------------------------------------------------------ one step

  def step(self, step: int, timer) -> dict[str, Any]:
    metrics = super().step(step, timer)
    return metrics | self._agent_metrics

  def _draw(self, step: int, round_: int, timer) -> dynamic.Drawn:
    exp = self.exp
    problems, prompt_ids = self.prompts.next_batch(exp.rollout.prompts_per_step)
    before = dict(self.runner.env_failures)
    with timer.role("rollout"):  # Environment steps included: they run between turns.
      t0 = time.perf_counter()
      episodes = self.runner.run(problems, prompt_ids, exp.rollout.group_size, self.sampling,
                                 dynamic.round_seed(exp.seed, round_), step,
                                 between_calls=self._between_decode_calls)
      seconds = time.perf_counter() - t0
    if self.store is not None:
      self.store.write(step, "train", problems, prompt_ids, episodes)
    rewards = np.array([e.reward for g in episodes for e in g], np.float32)
    failed = {k: n - before[k] for k, n in self.runner.env_failures.items()}
    self._agent_metrics = episode_metrics("agent", episodes) | {
        f"env/{kind}s": float(n) for kind, n in failed.items()}  # env/timeouts, ...
    stats = VerifierStats(samples=len(rewards), errors=failed["error"],
                          timeouts=failed["timeout"], crashes=failed["crash"])
    groups = [rollouts.Group(p, list(ids), g) for p, ids, g in zip(problems, prompt_ids,
                                                                   episodes)]
    return dynamic.Drawn(groups, rewards, stats, seconds)

  def _trajectories(self, groups) -> tuple[list, list]:
    trajs, behaviour = [], []
    for g in groups:
      for e in g.completions:
        trajs.append(Trajectory(g.prompt, e.tokens, e.experts, e.floors, e.loss_mask))
        behaviour.append(e.logprobs)
    self._earned = [_earned_before(e) for g in groups for e in g.completions]
    return trajs, behaviour

  def _scores(self, rewards: np.ndarray) -> SequenceScores:
    """Episode credit: the loop's group advantages. Reward-to-go credit: per token, each
    turn's tokens credited with the rewards from that turn on (rl.turn_credit)."""
    if self.spec.credit == "episode":
      return super()._scores(rewards)
    width = completion_bucket(max(len(e) for e in self._earned))  # pack_rollouts' width
    advantages = turn_credit.reward_to_go_advantages(rewards, self._earned, self.exp.advantage,
                                                     width)
    return SequenceScores(jnp.asarray(advantages), jnp.asarray(rewards, jnp.float32))

  def evaluate(self) -> dict[str, float]:
    spec = self.exp.eval
    out, kept, prompts, greedy = evaluate_episodes(
        self.runner, self.tokenizer, self.env, self.eval_problems, self.exp.prompts,
        self.exp.rollout.max_new_tokens, spec.samples, spec.temperature)
    if self.store is not None:
      self.store.write(self._step, "eval", kept, prompts, greedy)
    return out

  def close(self) -> None:
    try:
      if getattr(self, "runner", None) is not None:
        self.runner.close()
      tools = getattr(self.exp.task, "tools", None)
      if isinstance(tools, ToolRegistry):
        tools.bind(None)  # The pool closes below; the environment may be used again.
    finally:
      super().close()


def _earned_before(e: EpisodeRecord) -> np.ndarray:
  """Per token after the prompt, the sum of the rewards of the turns before its turn."""
  out, earned = [], 0.0
  for turn in e.turns:
    out += [earned] * (len(turn.completion.tokens) + len(turn.observation_ids))
    earned += turn.reward
  return np.asarray(out, np.float32)


def episode_metrics(prefix: str, groups: Sequence[Sequence[EpisodeRecord]]) -> dict[str, float]:
  episodes = [e for g in groups for e in g]
  out = {f"{prefix}/solved": float(np.mean([e.solved for e in episodes])),
         f"{prefix}/turns_mean": float(np.mean([len(e.turns) for e in episodes])),
         f"{prefix}/observation_tokens_mean": float(np.mean(
             [sum(len(t.observation_ids) for t in e.turns) for e in episodes]))}
  for ended in ("done", "max_turns", "max_tokens", "failed"):
    out[f"{prefix}/ended_{ended}"] = float(np.mean([e.ended == ended for e in episodes]))
  return out


def evaluate_episodes(runner: EpisodeRunner, tokenizer, env: Environment,
                      problems: Sequence[Problem], prompt_cfg: PromptConfig,
                      max_new_tokens: int, samples: int = 0, temperature: float = 1.0):
  """Greedy episodes on held-out problems (success rate as eval/accuracy), and with
  `samples` n > 0 pass@k and maj@k of n sampled episodes per problem (maj@k votes on each
  episode's last reply, as the environment reads its answer). The seeds are the same at
  every evaluation. Returns (metrics, problems kept, their prompts, greedy episodes)."""
  kept, prompts = rollouts.held_out_prompts(tokenizer, problems, prompt_cfg)
  out: dict[str, float] = {"eval/problems": len(kept), "eval/skipped": len(problems) - len(kept)}
  if not kept:
    return out | {"eval/accuracy": 0.0}, kept, prompts, []
  greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                          stop_ids=tokenizer.stop_ids)
  episodes = runner.run(kept, prompts, 1, greedy, seed=0, step=0)
  out["eval/accuracy"] = float(np.mean([g[0].solved for g in episodes]))
  out.update(episode_metrics("eval", episodes))
  if samples:
    sampled = SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                             stop_ids=tokenizer.stop_ids)
    groups = runner.run(kept, prompts, samples, sampled, seed=1, step=0)
    out.update(_at_k(env, groups))
  return out, kept, prompts, episodes


def _at_k(env: Environment, groups: Sequence[Sequence[EpisodeRecord]]) -> dict[str, float]:
  solved = np.array([[e.solved for e in g] for g in groups])
  answers = [[env.final_answer(e.turns[-1].reply) for e in g] for g in groups]
  return at_k.metrics(solved, answers)

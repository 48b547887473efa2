"""Rollout-side helpers of the loop: grouped completions, scoring as groups finish, evaluation.

Every request's seed is a function of (run seed, RL step, prompt index) only, so a resumed
run samples exactly what the uninterrupted run sampled.

Rewards overlap decoding: the scheduler is stepped here, and each prompt's K samples go to
the verifier pool the moment the last of them finishes, while the engine keeps decoding the
other prompts. What is left for the reward role once decoding ends is the last groups' calls.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Optional, Sequence

import numpy as np

from jaxrl_post.data.prompts import PromptConfig, encode_prompt
from jaxrl_post.models import Tokenizer
from jaxrl_post.pipeline import agreement
from jaxrl_post.rewards import Problem, Task, VerifierPool, VerifierStats, at_k
from jaxrl_post.rl.packing import Trajectory
from jaxrl_post.rollout import Engine, SamplingParams
from jaxrl_post.rollout.scheduler import Completion, Scheduler, SchedulerConfig
from jaxrl_post.sharding import hosts


def request_seed(seed: int, step: int, index: int) -> int:
  return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Group:
  """The K samples of one prompt."""

  problem: Problem
  prompt: list[int]
  completions: list[Completion]


def sample_groups(engine: Engine, problems: Sequence[Problem], prompts: Sequence[list[int]],
                  k: int, sampling: SamplingParams, scheduler: SchedulerConfig, seed: int,
                  step: int,
                  on_group: Optional[Callable[[int, Group], None]] = None,
                  between_calls: Optional[Callable[[], None]] = None) -> list[Group]:
  """K samples of each prompt, in prompt order.

  The scheduler is driven as `rollout.generate` drives it (same requests, seeds and steps),
  so the samples are the same; stepping it here lets `on_group(i, group)` run as soon as
  prompt i's samples are all done, while the others still decode. `between_calls()` runs
  before each scheduler step: where new weights may enter the engine mid-batch.

  A process that holds none of the engine's devices (split placement across processes)
  receives the groups from the rollout's processes once they are done, then calls
  `on_group` for each. Collective in that case.
  """
  mesh = engine.layout.mesh
  if not hosts.holds(mesh):
    groups = hosts.share(None, mesh)
    for i, group in enumerate(groups):
      if on_group is not None:
        on_group(i, group)
    return groups
  sched = Scheduler(engine, scheduler)
  rids = [sched.submit(tuple(ids), sampling, n=k, seed=request_seed(seed, step, i))
          for i, ids in enumerate(prompts)]
  index = {rid: i for i, rid in enumerate(rids)}
  while not sched.idle:
    if between_calls is not None:
      between_calls()
    finished = sched.step()
    for rid in sched.completed(finished) if on_group is not None else []:
      i = index[rid]
      on_group(i, Group(problems[i], list(prompts[i]), sched.results[rid]))
  return hosts.share([Group(p, list(ids), sched.results[rid])
                      for p, ids, rid in zip(problems, prompts, rids)], mesh)


@dataclasses.dataclass(frozen=True)
class Scoring:
  """One batch's scoring on the verifier pool: `submit` is `sample_groups`' on_group.

  Attributes:
    pool: The run's verifier pool.
    tokenizer: Decodes completions to the text verifiers read.
    tag: Names the batch in the pool's keys ("train", "eval"), so two never collide.
    step: The RL step, in the keys and in dead-letter lines.
  """

  pool: VerifierPool
  tokenizer: Tokenizer
  tag: str
  step: int

  def key(self, index: int, sample: int) -> Hashable:
    return (self.tag, self.step, index, sample)

  def submit(self, index: int, group: Group) -> None:
    """Queues the group's samples if this process scores it (pipeline/agreement.py)."""
    if not agreement.owns(index):
      return
    for j, c in enumerate(group.completions):
      text = self.tokenizer.decode(c.tokens, skip_special_tokens=True)
      self.pool.submit(self.key(index, j), group.problem, text, step=self.step)

  def results(self, groups: Sequence[Group]) -> tuple[np.ndarray, VerifierStats]:
    """float32 rewards [samples] in `flatten`'s order, the same on every process; blocks
    for the calls still running (and, across processes, for the other processes')."""
    start = time.perf_counter()
    samples = [(i, j) for i, g in enumerate(groups) for j in range(len(g.completions))]
    mine = [(f, self.key(i, j)) for f, (i, j) in enumerate(samples) if agreement.owns(i)]
    rewards, stats = self.pool.results([key for _, key in mine])
    stats = dataclasses.replace(stats, wait_s=time.perf_counter() - start)
    return agreement.gather(len(samples), [f for f, _ in mine], rewards, stats)


def flatten(groups: Sequence[Group]) -> tuple[list[Trajectory], list[tuple[float, ...]]]:
  """Trajectories (groups of K contiguous) and their behaviour logprobs."""
  trajs, behaviour = [], []
  for g in groups:
    for c in g.completions:
      trajs.append(Trajectory(g.prompt, c.tokens, c.experts, c.floors))
      behaviour.append(c.logprobs)
  return trajs, behaviour


def rollout_metrics(groups: Sequence[Group], seconds: float) -> dict[str, float]:
  lengths = np.array([len(c.tokens) for g in groups for c in g.completions])
  stopped = np.mean([c.finish_reason == "stop" for g in groups for c in g.completions])
  return {"rollout/tokens": int(lengths.sum()),
          "rollout/tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
          "rollout/completion_len_mean": float(lengths.mean()),
          "rollout/completion_len_max": int(lengths.max()),
          "rollout/stop_frac": float(stopped),
          "rollout/weight_version_min": min(c.weight_version for g in groups
                                            for c in g.completions),
          "rollout/weight_version_max": max(max(c.versions)
                                            for g in groups for c in g.completions)}


def held_out_prompts(tokenizer: Tokenizer, problems: Sequence[Problem],
                     prompt_cfg: PromptConfig) -> tuple[list[Problem], list[list[int]]]:
  """The problems whose prompts fit the budget, and their ids (the rest are skipped)."""
  kept, prompts = [], []
  for p in problems:
    ids, _ = encode_prompt(tokenizer, p, prompt_cfg)
    if ids is not None:
      kept.append(p)
      prompts.append(ids)
  return kept, prompts


def evaluate(engine: Engine, tokenizer: Tokenizer, task: Task, problems: Sequence[Problem],
             prompt_cfg: PromptConfig, max_new_tokens: int, scheduler: SchedulerConfig, *,
             pool: Optional[VerifierPool] = None, step: int = 0, samples: int = 0,
             temperature: float = 1.0) -> dict[str, float]:
  """Greedy pass@1 on held-out problems (prompts over the budget are skipped, counted);
  with `samples` n > 0 also pass@k and maj@k of n samples per problem at `temperature`
  (eval/pass@k, eval/maj@k for k = 1, 2, 4, ... n; rewards/at_k.py).

  Scored as groups finish, on `pool` (a run's own), or on a default pool for this call.
  """
  if pool is None:
    with VerifierPool(task) as own:
      return evaluate(engine, tokenizer, task, problems, prompt_cfg, max_new_tokens,
                      scheduler, pool=own, step=step, samples=samples,
                      temperature=temperature)
  kept, prompts = held_out_prompts(tokenizer, problems, prompt_cfg)
  greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                          stop_ids=tokenizer.stop_ids)
  _, correct, stats = _score_held_out(engine, tokenizer, kept, prompts, 1, greedy, scheduler,
                                      pool, "eval", step)
  # Counts only: eval lines must be the same in a resumed run, and timings never are.
  out = {"eval/accuracy": float(np.mean(correct)) if len(kept) else 0.0,
         "eval/problems": len(kept), "eval/skipped": len(problems) - len(kept),
         **{f"eval/{name}": n for name, n in stats.counts().items()}}
  if samples and kept:
    sampled = SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                             stop_ids=tokenizer.stop_ids)
    out.update(_at_k(task, tokenizer, *_score_held_out(
        engine, tokenizer, kept, prompts, samples, sampled, scheduler, pool, "eval/k", step)))
  return out


def _score_held_out(engine, tokenizer, kept, prompts, n, sampling, scheduler, pool, tag,
                    step) -> tuple[list[Group], np.ndarray, VerifierStats]:
  """n samples per problem, scored: (groups, per-sample correctness, stats). A composed
  reward's correctness part, not the shaped total (a format bonus is no solution). The
  seeds are the same at every evaluation (and in the evaluate CLI): changes between two
  evaluations are the weights', not the draws'."""
  scoring = Scoring(pool, tokenizer, tag, step)
  groups = sample_groups(engine, kept, prompts, n, sampling, scheduler, seed=0, step=0,
                         on_group=scoring.submit)
  rewards, stats = scoring.results(groups)
  if stats.parts and any(p is not None and "correctness" in p for p in stats.parts):
    rewards = [p["correctness"] if p is not None else 0.0 for p in stats.parts]
  return groups, np.asarray(rewards, np.float64), stats


def _at_k(task: Task, tokenizer: Tokenizer, groups: Sequence[Group], correct: np.ndarray,
          stats: VerifierStats) -> dict[str, float]:
  n = len(groups[0].completions)
  solved = correct.reshape(len(groups), n) >= 1.0 - 1e-6  # A problem solved, not credit.
  answers = [[at_k.final_answer(task, tokenizer.decode(c.tokens, skip_special_tokens=True))
              for c in g.completions] for g in groups]
  return {**at_k.metrics(solved, answers), "eval/k_timeouts": stats.timeouts}

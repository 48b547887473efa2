"""Rollout-side helpers of the loop: requests, grouped completions, held-out evaluation.

Every request's seed is a function of (run seed, RL step, prompt index) only, so a resumed
run samples exactly what the uninterrupted run sampled.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxrl_post.data.prompts import PromptConfig, encode_prompt
from jaxrl_post.models import Tokenizer
from jaxrl_post.rewards import Problem, Task, score_batch
from jaxrl_post.rl.packing import Trajectory
from jaxrl_post.rollout import Engine, Request, SamplingParams, generate
from jaxrl_post.rollout.scheduler import Completion, SchedulerConfig


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
                  step: int) -> list[Group]:
  requests = [Request(tuple(ids), seed=request_seed(seed, step, i))
              for i, ids in enumerate(prompts)]
  out = generate(engine, requests, n=k, sampling=sampling, scheduler=scheduler)
  return [Group(p, list(ids), c) for p, ids, c in zip(problems, prompts, out)]


def flatten(groups: Sequence[Group]) -> tuple[list[Trajectory], list[tuple[float, ...]]]:
  """Trajectories (groups of K contiguous) and their behaviour logprobs."""
  trajs, behaviour = [], []
  for g in groups:
    for c in g.completions:
      trajs.append(Trajectory(g.prompt, c.tokens))
      behaviour.append(c.logprobs)
  return trajs, behaviour


def completion_texts(tokenizer: Tokenizer, groups: Sequence[Group]) -> list[str]:
  return [tokenizer.decode(c.tokens, skip_special_tokens=True)
          for g in groups for c in g.completions]


def rollout_metrics(groups: Sequence[Group], seconds: float) -> dict[str, float]:
  lengths = np.array([len(c.tokens) for g in groups for c in g.completions])
  stopped = np.mean([c.finish_reason == "stop" for g in groups for c in g.completions])
  return {"rollout/tokens": int(lengths.sum()),
          "rollout/tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
          "rollout/completion_len_mean": float(lengths.mean()),
          "rollout/completion_len_max": int(lengths.max()),
          "rollout/stop_frac": float(stopped),
          "rollout/weight_version_min": min(c.weight_version for g in groups
                                            for c in g.completions)}


def evaluate(engine: Engine, tokenizer: Tokenizer, task: Task, problems: Sequence[Problem],
             prompt_cfg: PromptConfig, max_new_tokens: int,
             scheduler: SchedulerConfig) -> dict[str, float]:
  """Greedy pass@1 on held-out problems (prompts over the budget are skipped, counted)."""
  kept, prompts = [], []
  for p in problems:
    ids, _ = encode_prompt(tokenizer, p, prompt_cfg)
    if ids is not None:
      kept.append(p)
      prompts.append(ids)
  sampling = SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                            stop_ids=tokenizer.stop_ids)
  groups = sample_groups(engine, kept, prompts, 1, sampling, scheduler, seed=0, step=0)
  rewards, stats = score_batch(task, kept, completion_texts(tokenizer, groups))
  return {"eval/accuracy": float(np.mean(rewards)) if len(kept) else 0.0,
          "eval/problems": len(kept), "eval/skipped": len(problems) - len(kept),
          **{f"eval/{k.split('/', 1)[1]}": v for k, v in stats.as_metrics().items()}}

"""The trajectory store: every episode of a run as one JSON line, for analysis and replay.

A line holds the step, the split ("train" or "eval"), the problem, the sample, the
episode's reward and how it ended, the prompt's ids, and per turn: the model's ids, their
behaviour logprobs and weight versions, the decoded reply, the observation's text and ids,
and the turn's reward. Prompt + every turn's ids + observation ids is exactly the token
sequence the trainer saw. Only process 0 writes; a resumed run first cuts the lines of
steps after its checkpoint, as metrics.jsonl is cut.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional, Sequence

from jaxrl_post.envs.driver import EpisodeRecord
from jaxrl_post.rewards.base import Problem
from jaxrl_post.telemetry import truncate_jsonl

FILE = "trajectories.jsonl"


def episode_line(step: int, split: str, problem: Problem, prompt: Sequence[int], sample: int,
                 episode: EpisodeRecord) -> dict:
  return {
      "step": step, "split": split, "problem": problem.id, "sample": sample,
      "reward": episode.reward, "solved": episode.solved, "ended": episode.ended,
      "prompt": problem.prompt, "prompt_ids": list(map(int, prompt)),
      "turns": [{"ids": list(t.completion.tokens), "logprobs": list(t.completion.logprobs),
                 "versions": list(t.completion.versions), "reply": t.reply,
                 "finish_reason": t.completion.finish_reason, "observation": t.observation,
                 "observation_ids": list(t.observation_ids), "reward": t.reward}
                for t in episode.turns]}


class TrajectoryStore:
  """Appends episodes to WORKDIR/trajectories.jsonl."""

  def __init__(self, workdir: str, resume_step: int):
    self.path = os.path.join(workdir, FILE)
    os.makedirs(workdir, exist_ok=True)
    truncate_jsonl(self.path, resume_step)

  def write(self, step: int, split: str, problems: Sequence[Problem],
            prompts: Sequence[Sequence[int]], groups: Sequence[Sequence[EpisodeRecord]]) -> None:
    with open(self.path, "a") as f:
      for problem, prompt, group in zip(problems, prompts, groups):
        for j, episode in enumerate(group):
          f.write(json.dumps(episode_line(step, split, problem, prompt, j, episode)) + "\n")


def read(path: str, step: Optional[int] = None, split: Optional[str] = None,
         solved: Optional[bool] = None, problem: Optional[str] = None) -> Iterator[dict]:
  """The stored episodes that match every filter given."""
  with open(path) as f:
    for n, line in enumerate(f, 1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue  # A line cut off by a killed run.
      if ((step is None or row["step"] == step) and (split is None or row["split"] == split)
          and (solved is None or row["solved"] == solved)
          and (problem is None or row["problem"] == problem)):
        yield row

"""Environments that hang, kill their interpreter or answer garbage cost their episodes and
nothing else: the driver's worker processes are killed and replaced, the threads stay bounded."""

import dataclasses
import json
import os
import threading
import time

import pytest

from jaxrl_post.envs import EpisodeLimits, EpisodeRunner, GuessingGame, TurnFormat
from jaxrl_post.envs.base import Step
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.rollout import Engine, SamplingParams
from tests.envs.test_driver import ENGINE, _model

WORKERS = 2
LIMITS = EpisodeLimits(max_turns=3, max_tokens=24, step_timeout_s=1.5)
PROBLEMS, K = 6, 2  # Problems 0 and 3 fault: every third problem's episodes.


@dataclasses.dataclass
class _FaultyEpisode:
  inner: object
  fault: str  # "" plays the game.

  def step(self, reply):
    if self.fault == "hang":
      while True:  # Forever: only killing the worker ends it.
        time.sleep(60)
    if self.fault == "crash":
      os._exit(7)
    if self.fault == "garbage":
      return Step(observation=["not", "text"], reward="high", done="yes")
    return self.inner.step(reply)


@dataclasses.dataclass(frozen=True)
class _Faulty(GuessingGame):
  fault: str = "hang"

  def reset(self, problem):
    index = int(problem.id.rsplit("-", 1)[1])
    return _FaultyEpisode(super().reset(problem), self.fault if index % 3 == 0 else "")


def _run(game, workdir):
  tok = char_tokenizer()
  problems = list(game.split("train")[:PROBLEMS])
  prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
  engine = Engine.from_model(_model(), ENGINE)
  threads = threading.active_count()
  dead_letter = os.path.join(workdir, "dead_letter.jsonl")
  runner = EpisodeRunner(engine, game, TurnFormat(tok, False), LIMITS, workers=WORKERS,
                         dead_letter=dead_letter)
  try:
    sampling = SamplingParams(temperature=1.0, max_tokens=3, stop_ids=tok.stop_ids)
    groups = runner.run(problems, prompts, K, sampling, seed=0, step=5)
    # Bounded: the pool's dispatcher and one waiting thread per worker, whatever hung.
    assert threading.active_count() <= threads + WORKERS + 1
    pids = runner.pool.pids
    assert len(pids) == WORKERS and all(_alive(p) for p in pids)
  finally:
    runner.close()
  assert runner.pool.pids == [] or not any(_alive(p) for p in pids)
  with open(dead_letter) as f:
    letters = [json.loads(line) for line in f]
  return problems, groups, dict(runner.env_failures), letters


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


@pytest.mark.parametrize("fault,kind", [("hang", "timeout"), ("crash", "crash"),
                                        ("garbage", "error")])
def test_a_faulty_step_costs_its_episode_and_nothing_else(tmp_path, fault, kind):
  problems, groups, failures, letters = _run(_Faulty(max_turns=3, fault=fault), tmp_path)
  bad = {0, 3}
  assert failures == {"error": 0, "timeout": 0, "crash": 0} | {kind: len(bad) * K}
  for i, group in enumerate(groups):
    for e in group:
      if i in bad:
        assert e.ended == "failed" and e.reward == 0.0 and len(e.turns) == 1
      else:
        assert e.ended != "failed"
  played = [e for i, g in enumerate(groups) if i not in bad for e in g]
  assert sum(len(e.turns) for e in played) > len(played)  # The others played on.
  # One dead letter per bad episode, naming it (problem id / sample) and the step.
  assert sorted(tuple(x["key"][1:3]) for x in letters) == sorted(
      (f"{problems[i].id}/{j}", 0) for i in bad for j in range(K))
  assert all(x["type"] == kind and x["step"] == 5 for x in letters)
  if kind == "crash":
    assert "code 7" in letters[0]["reason"]
  if kind == "error":
    assert "not str" in letters[0]["reason"]


def test_a_step_past_the_deadline_does_not_starve_later_runs(tmp_path):
  """Every hang reclaims its worker: a second run on the same runner plays as fully."""
  game = _Faulty(max_turns=3, fault="hang")
  tok = char_tokenizer()
  problems = list(game.split("train")[1:3])  # Neither faults.
  prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
  engine = Engine.from_model(_model(), ENGINE)
  runner = EpisodeRunner(engine, game, TurnFormat(tok, False), LIMITS, workers=WORKERS)
  sampling = SamplingParams(temperature=1.0, max_tokens=3, stop_ids=tok.stop_ids)
  try:
    first = runner.run(problems, prompts, K, sampling, seed=0, step=1)
    hangs = list(game.split("train")[0:1]) * 3  # Six hanging episodes on two workers.
    hang_prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in hangs]
    runner.run(hangs, hang_prompts, K, sampling, seed=0, step=2)
    assert runner.env_failures["timeout"] == 6
    again = runner.run(problems, prompts, K, sampling, seed=0, step=1)
  finally:
    runner.close()
  for a, b in zip(first, again):
    for x, y in zip(a, b):
      assert x.tokens == y.tokens and x.reward == y.reward

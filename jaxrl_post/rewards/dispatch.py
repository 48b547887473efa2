"""Scoring a batch of completions on worker threads, with errors and timeouts contained.

A verifier is arbitrary CPU code run on untrusted model output: sympy can take minutes on
a pathological expression, and a parser can raise on anything. The trainer must neither
crash nor wait forever because of one completion, so each call gets a deadline; a failed or
late call scores 0.0 and is counted in `ScoreStats`, which the trainer logs as metrics.

Threads cannot be killed, so a call past its deadline is abandoned: its worker keeps running
until the call returns (its result is then dropped) and a fresh worker takes its place, so
the rest of the batch still runs `workers` wide. Workers are daemon threads, which a stuck
verifier cannot use to block interpreter exit (ThreadPoolExecutor's threads would).

This is the simple in-process scorer for a finished batch. The trainer uses `pool.VerifierPool`
instead: worker processes that can be killed, fed group by group while decoding goes on.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Sequence

import numpy as np

from jaxrl_post.rewards.base import Problem, Task
from jaxrl_post.rewards.compose import score_with_parts

_MAX_ERROR_CHARS = 300


@dataclasses.dataclass(frozen=True)
class ScoreStats:
  """What went wrong while scoring one batch.

  Attributes:
    errors: Calls that raised (or returned a non-finite reward); each scored 0.0.
    timeouts: Calls still running after `timeout_s`; each scored 0.0.
    first_error: "<problem id>: <Type>: <message>" of the first error, one line, for logs.
  """

  errors: int = 0
  timeouts: int = 0
  first_error: str | None = None

  def as_metrics(self) -> dict[str, int]:
    return {"verifier/errors": self.errors, "verifier/timeouts": self.timeouts}


def score_batch(task: Task, problems: Sequence[Problem], completions: Sequence[str], *,
                workers: int = 4, timeout_s: float = 5.0) -> tuple[np.ndarray, ScoreStats]:
  """Scores `completions[i]` against `problems[i]` on `workers` threads.

  Args:
    task: Supplies `score(problem, completion) -> float`.
    problems: One problem per completion (repeat a problem for a group of samples).
    completions: Decoded completion texts.
    workers: Threads scoring concurrently.
    timeout_s: Longest a single call may run, measured from when it starts, so a long
      batch is not penalised for queueing.

  Returns:
    float32 rewards [len(completions)] in input order, and the batch's `ScoreStats`.
  """
  if len(problems) != len(completions):
    raise ValueError(f"score_batch got {len(problems)} problems for "
                     f"{len(completions)} completions")
  if workers < 1 or not timeout_s > 0:
    raise ValueError(f"score_batch needs workers >= 1 and timeout_s > 0, got "
                     f"workers={workers}, timeout_s={timeout_s}")
  batch = _Batch(task, problems, completions)
  if batch.remaining:
    for _ in range(min(workers, batch.remaining)):
      batch.start_worker()
    batch.wait(timeout_s)
  return batch.rewards, ScoreStats(batch.errors, batch.timeouts, batch.first_error)


class _Batch:
  """The shared state of one `score_batch` call; fields change only under `cond`."""

  def __init__(self, task: Task, problems: Sequence[Problem], completions: Sequence[str]):
    self.task, self.problems, self.completions = task, problems, completions
    self.rewards = np.zeros(len(completions), np.float32)
    self.jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(completions)):
      self.jobs.put(index)
    self.cond = threading.Condition()
    self.running: dict[int, float] = {}  # Index -> monotonic start time of its call.
    self.remaining = len(completions)  # Neither finished nor abandoned yet.
    self.errors = self.timeouts = 0
    self.first_error: str | None = None

  def start_worker(self) -> None:
    threading.Thread(target=self._work, name="verifier", daemon=True).start()

  def _work(self) -> None:
    while True:
      try:
        index = self.jobs.get_nowait()
      except queue.Empty:
        return
      with self.cond:
        self.running[index] = time.monotonic()
      reward, error = self._score(index)
      with self.cond:
        if self.running.pop(index, None) is None:
          return  # Abandoned after its deadline; a replacement worker took over.
        if error is None:
          self.rewards[index] = reward
        else:
          self.errors += 1
          self.first_error = self.first_error or error
        self.remaining -= 1
        self.cond.notify()

  def _score(self, index: int) -> tuple[float, str | None]:
    """(reward, None), or (0.0, a one-line description) when the verifier failed."""
    reward, _, _, error = verify(self.task, self.problems[index], self.completions[index])
    return reward, error

  def wait(self, timeout_s: float) -> None:
    """Returns once every call has finished or been abandoned at its deadline."""
    with self.cond:
      while self.remaining:
        now = time.monotonic()
        for index, start in list(self.running.items()):
          if now - start >= timeout_s:
            del self.running[index]
            self.timeouts += 1
            self.remaining -= 1
            if not self.jobs.empty():
              self.start_worker()  # Keeps the batch `workers` wide past a stuck call.
        if self.remaining:
          # Sleep to the earliest deadline. With nothing running, sleep timeout_s: any call
          # that starts meanwhile is due later than that, so no deadline is missed.
          deadline = min(self.running.values(), default=now) + timeout_s
          self.cond.wait(max(deadline - now, 1e-3))


def verify(task: Task, problem: Problem,
           completion: str) -> tuple[float, dict | None, str | None, str | None]:
  """One verifier call with its failure contained, as the thread and process pools make it.

  Returns:
    (reward, parts, None, None), parts being the reward's named components for a task that
    has them (`compose.ComponentScorer`) and None otherwise; or (0.0, None, the exception's
    type name, a one-line description) when the verifier raised or returned a non-finite
    reward.
  """
  try:
    reward, parts = score_with_parts(task, problem, completion)
    if not math.isfinite(reward):  # NaN would poison every advantage in its group.
      raise ValueError(f"non-finite reward {reward}")
    return reward, parts, None, None
  except Exception as e:  # Any verifier failure is a zero reward, never a crash.
    return 0.0, None, type(e).__name__, _describe(problem, e)


def _describe(problem: Problem, error: Exception) -> str:
  """The error as one loggable line: problem id, exception type and message."""
  try:
    message = str(error)
  except Exception:  # A broken __str__ must not escape the worker.
    message = "<unprintable>"
  text = f"{getattr(problem, 'id', '?')}: {type(error).__name__}: {message}"
  text = " ".join(text.split())
  return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS - 3] + "..."

"""score_batch: order, errors and timeouts contained, bounded wall time."""

import threading
import time

import numpy as np
import pytest

from jaxrl_post.rewards import ArithmeticTask, Problem, ScoreStats, score_batch


class Scripted:
  """Completion text decides the behaviour: a number, "boom", "nan" or "sleep <s>"."""

  name = "scripted"
  skipped: dict = {}

  def __init__(self):
    self.release = threading.Event()  # Lets the sleepers go at the end of a test.

  def split(self, name):
    return []

  def score(self, problem, completion):
    if completion == "boom":
      raise RuntimeError(f"verifier exploded\non {problem.id}")
    if completion == "nan":
      return float("nan")
    if completion.startswith("sleep"):
      self.release.wait(float(completion.split()[1]))
    return float(completion.split()[-1]) if completion[0].isdigit() else 0.5


def problems(n):
  return [Problem(f"p{i}", "", "") for i in range(n)]


def test_rewards_in_input_order():
  task = ArithmeticTask()
  batch = [task.split("eval")[i] for i in range(32)]
  completions = [p.answer if i % 3 else "wrong" for i, p in enumerate(batch)]
  rewards, stats = score_batch(task, batch, completions, workers=3)
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, [float(i % 3 != 0) for i in range(32)])
  assert stats == ScoreStats(0, 0, None)


def test_exceptions_score_zero_and_are_counted():
  completions = ["1", "boom", "0.25", "nan", "boom"]
  rewards, stats = score_batch(Scripted(), problems(5), completions, workers=2)
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 0.25, 0.0, 0.0])
  assert (stats.errors, stats.timeouts) == (3, 0)
  assert stats.first_error in ("p1: RuntimeError: verifier exploded on p1",
                               "p3: ValueError: non-finite reward nan")
  assert stats.as_metrics() == {"verifier/errors": 3, "verifier/timeouts": 0}


def test_timeouts_score_zero_and_do_not_block_the_batch():
  task = Scripted()
  # Two workers, three sleepers: each stuck call is replaced, so the fast ones still run.
  completions = ["sleep 30"] * 3 + ["1"] * 20 + ["boom"]
  start = time.monotonic()
  rewards, stats = score_batch(task, problems(24), completions, workers=2, timeout_s=0.2)
  elapsed = time.monotonic() - start
  assert elapsed < 2.0, elapsed  # About 0.4 s: two rounds of deadlines, never the 30 s.
  task.release.set()  # The abandoned calls now return 30.0; it must not land in rewards.
  time.sleep(0.05)
  np.testing.assert_array_equal(rewards, [0.0] * 3 + [1.0] * 20 + [0.0])
  assert (stats.errors, stats.timeouts) == (1, 3)
  assert stats.as_metrics() == {"verifier/errors": 1, "verifier/timeouts": 3}


def test_empty_batch_and_bad_arguments():
  rewards, stats = score_batch(Scripted(), [], [])
  assert rewards.shape == (0,) and stats == ScoreStats()
  with pytest.raises(ValueError):
    score_batch(Scripted(), problems(2), ["1"])
  with pytest.raises(ValueError):
    score_batch(Scripted(), problems(1), ["1"], workers=0)

"""VerifierPool: results by key, failures contained and dead-lettered, workers replaced, slow
calls that do not hold up fast ones, no orphan processes."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import ArithmeticTask, Problem, VerifierPool

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


class Scripted:
  """The completion text decides what the verifier does: "<reward>", "boom" (raises), "nan",
  "sleep <seconds> <reward>", "crash" (the worker process exits) or "hang".

  Defined here so worker processes can import it (as tests.rewards.test_pool).
  """

  name = "scripted"
  skipped: dict = {}

  def split(self, name):
    return []

  def score(self, problem, completion):
    words = completion.split()
    if words[0] == "boom":
      raise RuntimeError(f"verifier exploded\non {problem.id}")
    if words[0] == "nan":
      return float("nan")
    if words[0] == "crash":
      os._exit(3)
    if words[0] == "hang":
      time.sleep(3600)
    if words[0] == "sleep":
      time.sleep(float(words[1]))
    return float(words[-1])


def problem(i):
  return Problem(f"p{i}", "", "")


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


@pytest.fixture
def dead_letter(tmp_path):
  path = tmp_path / "dead_letter.jsonl"
  return path, lambda: [json.loads(line) for line in path.read_text().splitlines()]


def test_results_are_matched_to_samples_by_key():
  with VerifierPool(Scripted(), workers=3, timeout_s=5.0) as pool:
    # Sleeps that decrease with the index make the calls finish roughly in reverse.
    for i in range(12):
      pool.submit(("s", i), problem(i), f"sleep {0.01 * (12 - i)} {i}")
    order = [("s", i) for i in (5, 0, 11, 3, 1, 2, 4, 6, 7, 8, 9, 10)]
    rewards, stats = pool.results(order)
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, [k[1] for k in order])
  assert stats.counts() == {"errors": 0, "timeouts": 0, "crashes": 0}
  assert stats.samples == 12 and stats.busy_s > 0


def test_real_task_scores_and_keys_can_be_reused_after_collection():
  task = ArithmeticTask()
  batch = [task.split("eval")[i] for i in range(16)]
  with VerifierPool(task, workers=2) as pool:
    for i, p in enumerate(batch):
      pool.submit(i, p, p.answer if i % 3 else "wrong")
    rewards, _ = pool.results(list(range(16)))
    pool.submit(0, batch[0], batch[0].answer)  # Collected keys are free again.
    again, _ = pool.results([0])
  np.testing.assert_array_equal(rewards, [float(i % 3 != 0) for i in range(16)])
  assert again[0] == 1.0


def test_errors_score_zero_and_are_dead_lettered(dead_letter):
  path, lines = dead_letter
  with VerifierPool(Scripted(), workers=2, dead_letter=str(path)) as pool:
    for i, text in enumerate(["1", "boom", "0.25", "nan", "boom"]):
      pool.submit(("train", 7, i), problem(i), text, step=7)
    rewards, stats = pool.results([("train", 7, i) for i in range(5)])
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 0.25, 0.0, 0.0])
  assert stats.counts() == {"errors": 3, "timeouts": 0, "crashes": 0}
  assert stats.error_types == {"RuntimeError": 2, "ValueError": 1}
  metrics = stats.as_metrics()
  assert metrics["verifier/errors"] == 3 and metrics["verifier/errors/RuntimeError"] == 2
  assert {"reward/wait_s", "verifier/seconds_per_sample", "verifier/timeouts",
          "verifier/crashes"} <= set(metrics)
  records = sorted(lines(), key=lambda r: r["key"])
  assert [r["key"] for r in records] == [["train", 7, 1], ["train", 7, 3], ["train", 7, 4]]
  assert records[0] == {"step": 7, "problem_id": "p1", "key": ["train", 7, 1], "type": "error",
                        "reason": "p1: RuntimeError: verifier exploded on p1"}
  assert records[1]["reason"] == "p3: ValueError: non-finite reward nan"


def test_crashed_and_hung_workers_are_replaced_and_the_rest_still_score(dead_letter):
  path, lines = dead_letter
  texts = ["crash", "hang"] + [f"{i % 2}" for i in range(40)]
  with VerifierPool(Scripted(), workers=2, timeout_s=1.0, dead_letter=str(path)) as pool:
    assert pool.wait_ready()
    before = set(pool.pids)
    start = time.monotonic()
    for i, text in enumerate(texts):
      pool.submit(i, problem(i), text, step=3)
    rewards, stats = pool.results(list(range(len(texts))))
    elapsed = time.monotonic() - start
    after = set(pool.pids)
    assert pool.wait_ready()  # The replacements come up.
  np.testing.assert_array_equal(rewards, [0.0, 0.0] + [float(i % 2) for i in range(40)])
  assert stats.counts() == {"errors": 0, "timeouts": 1, "crashes": 1}
  assert elapsed < 10.0, elapsed  # One deadline (1 s) plus restarts, never the hang.
  assert len(after) == 2 and len(before - after) == 2  # Both workers were replaced...
  assert not any(alive(pid) for pid in before - after)  # ...and are gone.
  records = {r["type"]: r for r in lines()}
  assert records["crash"]["key"] == 0 and "exited with code 3" in records["crash"]["reason"]
  assert records["timeout"] == {"step": 3, "problem_id": "p1", "key": 1, "type": "timeout",
                                "reason": "no result after 1 s"}


def test_slow_calls_do_not_hold_up_fast_ones():
  """200 calls, 8 of them slow (1.5 s, within the 5 s deadline): every fast result is in
  long before the slow ones are, because a slow call occupies only its own worker."""
  slow = set(range(3, 200, 25))
  with VerifierPool(Scripted(), workers=10, timeout_s=5.0) as pool:
    assert pool.wait_ready()
    start = time.monotonic()
    for i in range(200):
      pool.submit(i, problem(i), f"sleep 1.5 {i}" if i in slow else str(i))
    fast_rewards, _ = pool.results([i for i in range(200) if i not in slow])
    fast_s = time.monotonic() - start
    slow_rewards, stats = pool.results(sorted(slow))
    slow_s = time.monotonic() - start
  print(f"\n200 calls: 192 fast ones done at {fast_s:.2f} s, 8 slow ones at {slow_s:.2f} s")
  np.testing.assert_array_equal(fast_rewards, [i for i in range(200) if i not in slow])
  np.testing.assert_array_equal(slow_rewards, sorted(slow))
  assert stats.counts() == {"errors": 0, "timeouts": 0, "crashes": 0}
  assert slow_s >= 1.5
  assert fast_s < 1.0 and fast_s < slow_s - 0.5, (fast_s, slow_s)


def test_close_leaves_no_processes_and_fails_what_is_pending():
  pool = VerifierPool(Scripted(), workers=3, timeout_s=60.0)
  assert pool.wait_ready()
  pids = pool.pids
  pool.submit("stuck", problem(0), "hang")
  pool.close()
  assert not any(alive(pid) for pid in pids)
  rewards, stats = pool.results(["stuck"])
  assert rewards[0] == 0.0 and stats.crashes == 1
  with pytest.raises(RuntimeError):
    pool.submit("late", problem(1), "1")
  pool.close()  # Idempotent.


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_workers_end_with_the_interpreter(how):
  """A pool never closed (interpreter exit), or a trainer killed outright mid-call: no
  worker outlives it."""
  code = ("import os, sys, time\n"
          "from jaxrl_post.rewards import Problem, VerifierPool\n"
          "from tests.rewards.test_pool import Scripted\n"
          "pool = VerifierPool(Scripted(), workers=2, timeout_s=60.0)\n"
          "assert pool.wait_ready()\n"
          "pool.submit(0, Problem('p', '', ''), 'hang')\n"
          "time.sleep(0.2)\n"
          "print(*pool.pids, flush=True)\n"
          f"if {how == 'sigkill'}: os.kill(os.getpid(), 9)\n")
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  pids = [int(p) for p in out.stdout.split()]
  assert len(pids) == 2, out.stderr
  deadline = time.monotonic() + 10.0
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not any(alive(p) for p in pids)


def test_threads_score_too_and_abandon_a_hung_call():
  with VerifierPool(Scripted(), workers=2, timeout_s=0.3, processes=False) as pool:
    for i, text in enumerate(["sleep 5 9", "1", "boom", "0.5"]):
      pool.submit(i, problem(i), text)
    rewards, stats = pool.results([0, 1, 2, 3])
    assert pool.pids == []
  np.testing.assert_array_equal(rewards, [0.0, 1.0, 0.0, 0.5])
  assert stats.counts() == {"errors": 1, "timeouts": 1, "crashes": 0}


def test_bad_arguments_are_one_line_errors():
  with pytest.raises(UserError, match="workers=0"):
    VerifierPool(Scripted(), workers=0)
  with pytest.raises(UserError, match="timeout_s=-1"):
    VerifierPool(Scripted(), timeout_s=-1)
  unpicklable = Scripted()
  unpicklable.hook = lambda: None
  with pytest.raises(UserError, match="processes=False"):
    VerifierPool(unpicklable)
  with VerifierPool(Scripted(), workers=1) as pool:
    pool.submit(0, problem(0), "1")
    with pytest.raises(ValueError, match="already submitted"):
      pool.submit(0, problem(0), "1")
    with pytest.raises(ValueError, match="unsubmitted"):
      pool.results([1])
    pool.results([0])


def act(what):
  """A plain call for `VerifierPool.call`: module-level, so workers can import it."""
  what = what.strip()  # A fenced tool call's body ends with its newline.
  if what == "pid":
    return os.getpid()
  if what == "boom":
    raise ValueError("tool exploded")
  if what == "crash":
    os._exit(4)
  time.sleep(3600)


def test_plain_calls_run_on_the_workers_with_the_same_failure_handling(dead_letter):
  """An agent's tool calls use the pool's workers: a result comes back; an exception, a
  crash and a hang each fail only that call (the hang is killed at the deadline)."""
  path, lines = dead_letter
  with VerifierPool(Scripted(), workers=2, timeout_s=1.0, dead_letter=str(path)) as pool:
    assert pool.wait_ready()
    done = pool.call("a", act, "pid")
    assert done.kind == "ok" and done.value in pool.pids and done.value != os.getpid()
    done = pool.call("b", act, "boom", step=2)
    assert done.value is None and done.kind == "error"
    assert done.reason == "ValueError: tool exploded"
    assert pool.call("c", act, "crash").kind == "crash"
    start = time.monotonic()
    hung = pool.call("d", act, "hang")
    assert hung.kind == "timeout" and time.monotonic() - start < 5.0
    pool.submit(0, problem(0), "1")  # Scoring goes on beside the calls.
    assert pool.results([0])[0].tolist() == [1.0]
    assert pool.call("a", act, "pid").kind == "ok"  # A collected key may be used again.
  records = {r["key"]: r for r in lines()}
  assert records["b"]["call"] == "act" and records["b"]["step"] == 2
  assert records["c"]["type"] == "crash" and records["d"]["type"] == "timeout"

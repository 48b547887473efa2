"""The asynchronous driver (pipeline/pipelined.py): batches drawn ahead with weights a fixed
number of steps old, staleness metrics, and exact resume after SIGKILL.

Which weights draw which batch depends on the step only, so an asynchronous run killed at
any point and restarted writes the metrics of the run that was never interrupted: the
batches drawn ahead are saved beside each checkpoint and trained on after the restart.
"""

import dataclasses
import os
import shutil
import signal
import subprocess

import pytest

from jaxrl_post import train
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline import pipelined
from jaxrl_post.pipeline.config import AsyncSpec
from jaxrl_post.telemetry import read_metrics
from tests.pipeline.test_train import (ROOT, _deterministic, _train_args, _train_cmd,
                                       _wait_for_step)

ONE_STEP_OFF = ["AsyncSpec.mode = 'one_step_off'", "CheckpointConfig.every_n_steps = 2"]
BOUNDED = ["AsyncSpec.mode = 'bounded'", "AsyncSpec.max_staleness = 4",
           "CheckpointConfig.every_n_steps = 2"]


def test_batches_come_from_weights_lag_steps_old_and_report_their_staleness(tmp_path):
  assert train.main(_train_args(tmp_path / "run", BOUNDED)) == 0  # quickstart: 2 minibatches
  records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  steps = [r for r in records if r["step"] > 0]
  assert [r["step"] for r in steps] == list(range(1, 7))
  for r in steps:  # Lag 2: step t's batch comes from version t - 3 (version 0 at first).
    version = max(r["step"] - 3, 0)
    assert r["rollout/weight_version_min"] == version and r["async/lag_steps"] == 2
    assert r["async/staleness"] == (r["step"] - 1 - version) * 2 <= 4
    assert sum(r["async/staleness_hist"]) == r["rollout/tokens"]
    assert r["async/dropped_groups"] == 0 and "time/wait_data" in r
  queues = sorted(f for f in os.listdir(tmp_path / "run" / "checkpoints") if f.startswith("queue"))
  assert "queue_6.pkl" in queues
  # The finished run extended by two steps: its last checkpoint queued no batch past step
  # 6, so steps 7 and 8 draw with the restored weights (version 6) instead of waiting for
  # versions this process never had.
  assert train.main(_train_args(tmp_path / "run", BOUNDED + ["Experiment.steps = 8"])) == 0
  more = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] > 6]
  assert [r["step"] for r in more] == [7, 8]
  assert [r["rollout/weight_version_min"] for r in more] == [6, 6]
  assert all(r["async/staleness"] <= 4 and r["async/dropped_groups"] == 0 for r in more)


# In the default run, tests/pipeline/test_devices.py kills a one-step-off run (two
# processes) after step 3 and checks that its resume recomputes step 3 bit for bit and
# writes the uninterrupted one-process run's metrics: the same driver, queue and restore.
@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("extra,kill_after", [
    (ONE_STEP_OFF, 3),
    pytest.param(BOUNDED, 2, marks=pytest.mark.sweep),
    pytest.param(ONE_STEP_OFF, 5, marks=pytest.mark.sweep)], ids=["one-step-off", "bounded",
                                                                  "late"])
def test_sigkill_and_restart_gives_the_uninterrupted_metrics(tmp_path, extra, kill_after):
  env = dict(os.environ, PYTHONPATH=ROOT)
  straight = tmp_path / "straight"
  assert train.main(_train_args(straight, extra)) == 0
  killed = tmp_path / "killed"
  proc = subprocess.Popen(_train_cmd(killed, extra), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
  try:
    _wait_for_step(str(killed / "metrics.jsonl"), kill_after, proc)
    proc.send_signal(signal.SIGKILL)  # Mid-rollout, mid-train or mid-sync: wherever it is.
  finally:
    proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert max(r["step"] for r in read_metrics(str(killed / "metrics.jsonl"))) < 6
  resumed = subprocess.run(_train_cmd(killed, extra), env=env, check=True,
                           capture_output=True, text=True, timeout=600)
  assert "resumed from" in resumed.stdout
  want = _deterministic(read_metrics(str(straight / "metrics.jsonl")))
  got = _deterministic(read_metrics(str(killed / "metrics.jsonl")))
  strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("async/rollout_",
                                                                        "async/queue"))}
                      for r in rs]  # Timing and how far the thread had got: not the data.
  assert [r["step"] for r in got] == list(range(7))
  assert strip(got) == strip(want)


def test_in_flight_updates_switch_weights_mid_batch_and_stamp_each_token(tmp_path,
                                                                         monkeypatch):
  """Rollout made slower than training: after the batch's first decode call the thread
  waits (in the hook where weights may enter) until the trainer publishes step t - 1, so
  every batch from step 3 on starts on version t - 2 and finishes on t - 1. (Step 2's
  batch may be drawn while step 0's evaluation waits for the engine: not held there.)"""
  original = pipelined.AsyncRLRun._between_decode_calls
  calls = {}

  def slow_rollout(run):
    step = run.ahead.next_step
    calls[step] = calls.get(step, 0) + 1
    if calls[step] == 2 and step >= 3:  # One call done on the old weights.
      with run.ahead.cond:
        assert run.ahead.cond.wait_for(lambda: max(run.ahead.weights) >= step - 1, 600)
    original(run)

  monkeypatch.setattr(pipelined.AsyncRLRun, "_between_decode_calls", slow_rollout)
  extra = ["AsyncSpec.mode = 'one_step_off'", "AsyncSpec.weight_updates = 'in_flight'",
           "CheckpointConfig.every_n_steps = 100",  # A save holds its step's weights back.
           "EngineConfig.decode_steps = 1",  # A decode call per token: calls to switch between.
           # No evaluation between the first and the last step: it would wait for the
           # engine, which the held-up thread keeps, before the trainer publishes.
           "EvalSpec.every_n_steps = 0"]
  assert train.main(_train_args(tmp_path / "run", extra)) == 0
  steps = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] > 0]
  assert [r["step"] for r in steps] == list(range(1, 7))
  assert steps[0]["async/weight_swaps"] == 0  # Version 0 is the newest there is.
  for r in steps[2:]:
    t = r["step"]
    assert r["async/weight_swaps"] == 1
    assert (r["rollout/weight_version_min"], r["rollout/weight_version_max"]) == (t - 2, t - 1)
    old, fresh = r["async/staleness_hist"][2], r["async/staleness_hist"][0]  # 2 minibatches
    assert old > 0 and fresh > 0 and old + fresh == r["rollout/tokens"]
    assert r["async/staleness"] == 2 and r["async/dropped_groups"] == 0


def _stamped_old(drawn):
  """`drawn` with every token stamped as version 0's."""
  groups = [dataclasses.replace(g, completions=[dataclasses.replace(c, versions=(0,) * len(
      c.versions)) for c in g.completions]) for g in drawn.groups]
  return dataclasses.replace(drawn, groups=groups)


def test_a_batch_over_the_bound_is_dropped_counted_and_drawn_again_with_fresh_weights(
    tmp_path, monkeypatch, capsys):
  """Step 4's batch reaches the trainer stamped with version 0: 6 optimizer steps stale
  against a bound of 2. It is dropped, its groups counted, and the trainer draws step 4
  again with the newest weights (version 3) on the same prompts. A resumed run keeps the
  count."""
  draw, redraw, redrawn = pipelined._Ahead._draw, pipelined.AsyncRLRun._redraw, []

  def stale_at_step_4(ahead, step, params):
    item = draw(ahead, step, params)
    if step != 4:
      return item
    return dataclasses.replace(item, batch=_stamped_old(item.batch),
                               drawn=_stamped_old(item.drawn))

  def recorded(run, step, dropped, timer):
    out = redraw(run, step, dropped, timer)
    redrawn.append((step, [g.prompt for g in dropped.batch.groups],
                    [g.prompt for g in out[0].groups]))
    return out

  monkeypatch.setattr(pipelined._Ahead, "_draw", stale_at_step_4)
  monkeypatch.setattr(pipelined.AsyncRLRun, "_redraw", recorded)
  assert train.main(_train_args(tmp_path / "run", ONE_STEP_OFF)) == 0  # Bound: 1 x 2.
  steps = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] > 0]
  assert [r["step"] for r in steps] == list(range(1, 7))
  assert [r["async/dropped_groups"] for r in steps] == [0, 0, 0, 4, 4, 4]  # 4 prompts a step
  assert len(redrawn) == 1 and redrawn[0][0] == 4 and redrawn[0][1] == redrawn[0][2]
  for r in steps:
    fresh = r["step"] - 1 if r["step"] == 4 else max(r["step"] - 2, 0)
    assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == fresh
    assert r["async/staleness"] == (r["step"] - 1 - fresh) * 2 <= 2
    assert len(r["async/staleness_hist"]) == 3
    assert sum(r["async/staleness_hist"]) == r["rollout/tokens"]
  # A queue cut short: one line naming it and what to move away.
  queue = tmp_path / "run" / "checkpoints" / "queue_6.pkl"
  os.truncate(queue, 20)
  capsys.readouterr()
  assert train.main(_train_args(tmp_path / "run", ONE_STEP_OFF)) == 2
  assert capsys.readouterr().err == (
      f"error: {queue}: the rollout queue of checkpoint 6 cannot be read (UnpicklingError: "
      "pickle data was truncated); move checkpoint 6 and this file away to resume from an "
      "earlier one\n")
  # Resumed from checkpoint 4 (after the drop), the run writes the same steps 5 and 6.
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  os.remove(tmp_path / "run" / "checkpoints" / "queue_6.pkl")
  assert train.main(_train_args(tmp_path / "run", ONE_STEP_OFF)) == 0
  resumed = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] > 0]
  strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("async/rollout_",
                                                                        "async/queue"))}
                      for r in _deterministic(rs)]
  assert strip(resumed) == strip(steps) and len(redrawn) == 1


def test_bad_async_settings_are_one_line_errors():
  with pytest.raises(UserError, match="mode='later'"):
    AsyncSpec(mode="later")
  with pytest.raises(UserError, match="weight_updates='sometimes'"):
    AsyncSpec(weight_updates="sometimes")
  with pytest.raises(UserError, match="less than one RL step"):
    AsyncSpec(mode="bounded", max_staleness=1).lag(minibatches=2)

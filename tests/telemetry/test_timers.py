"""StepTimer: role sums, the waiting remainder and misuse errors."""

import time

import pytest

from jaxrl_post.telemetry import StepTimer


class FakeClock:
  """A clock advanced by hand, so role arithmetic can be checked exactly."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def test_real_clock_sums_and_waiting():
  timer = StepTimer()
  timer.start()
  with timer.role("rollout"):
    time.sleep(0.01)
  time.sleep(0.005)  # Host time outside every role.
  with timer.role("train"):
    time.sleep(0.005)
  out = timer.stop()
  assert set(out) == {"time/rollout", "time/train", "time/waiting", "time/step"}
  assert all(v >= 0.0 for v in out.values())
  assert out["time/rollout"] >= 0.009  # sleep never returns early (beyond clock granularity)
  assert out["time/step"] >= out["time/rollout"] + out["time/train"]
  total = out["time/rollout"] + out["time/train"] + out["time/waiting"]
  assert total == pytest.approx(out["time/step"])


def test_exact_attribution_with_fake_clock():
  clock = FakeClock()
  timer = StepTimer(clock=clock)
  timer.start()
  with timer.role("rollout"):
    clock.now += 2.0
  clock.now += 0.5
  with timer.role("reward"):
    clock.now += 1.0
  clock.now += 0.25
  assert timer.stop() == {"time/rollout": 2.0, "time/reward": 1.0,
                          "time/waiting": 0.75, "time/step": 3.75}


def test_repeated_role_accumulates_and_unused_roles_are_absent():
  clock = FakeClock()
  timer = StepTimer(clock=clock)
  timer.start()
  for _ in range(3):
    with timer.role("train"):
      clock.now += 1.0
  assert timer.stop() == {"time/train": 3.0, "time/waiting": 0.0, "time/step": 3.0}
  timer.start()  # The next step starts from zero.
  clock.now += 1.0
  assert timer.stop() == {"time/waiting": 1.0, "time/step": 1.0}


def test_waiting_never_negative_with_nested_roles():
  clock = FakeClock()
  timer = StepTimer(clock=clock)
  timer.start()
  with timer.role("outer"):
    with timer.role("inner"):
      clock.now += 1.0
  out = timer.stop()
  assert out["time/waiting"] == 0.0
  assert out["time/step"] == 1.0


def test_role_time_recorded_when_block_raises():
  clock = FakeClock()
  timer = StepTimer(clock=clock)
  timer.start()
  with pytest.raises(KeyError):
    with timer.role("reward"):
      clock.now += 1.0
      raise KeyError("boom")
  assert timer.stop()["time/reward"] == 1.0


def test_nested_same_role_raises():
  timer = StepTimer()
  timer.start()
  with timer.role("rollout"):
    with pytest.raises(RuntimeError, match="already open"):
      with timer.role("rollout"):
        pass
  timer.stop()


@pytest.mark.parametrize("name", ["", "waiting", "step"])
def test_bad_role_names_raise(name):
  timer = StepTimer()
  timer.start()
  with pytest.raises(ValueError):
    with timer.role(name):
      pass


def test_misuse_outside_a_step_raises():
  timer = StepTimer()
  with pytest.raises(RuntimeError):
    timer.stop()
  with pytest.raises(RuntimeError):
    with timer.role("train"):
      pass
  timer.start()
  with pytest.raises(RuntimeError):
    timer.start()
  with timer.role("train"):
    with pytest.raises(RuntimeError, match="inside role"):
      timer.stop()

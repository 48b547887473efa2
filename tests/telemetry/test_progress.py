"""ProgressBar rendering, throttling on files and terminals, and the format helpers."""

import io

import pytest

from jaxrl_post.telemetry import ProgressBar
from jaxrl_post.telemetry.progress import format_duration, format_rate


class FakeClock:
  """A clock advanced by hand, so ETAs and throttling are deterministic."""

  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


class FakeTTY(io.StringIO):
  """A StringIO that claims to be a terminal, to exercise in-place redraws."""

  def isatty(self) -> bool:
    return True


@pytest.mark.parametrize("seconds,want", [
    (0, "0s"), (0.4, "0s"), (45, "45s"), (59.4, "59s"), (60, "1m00s"), (192, "3m12s"),
    (3599, "59m59s"), (3600, "1h00m"), (3720, "1h02m"), (-5, "0s"),
    (float("inf"), "?"), (float("nan"), "?")])
def test_format_duration(seconds, want):
  assert format_duration(seconds) == want


@pytest.mark.parametrize("rate,want", [
    (0, "0"), (950, "950"), (999.4, "999"), (999.7, "1.0k"), (1200, "1.2k"),
    (3.4e6, "3.4M"), (999_960, "1.0M"), (2.5e9, "2.5G"), (-1500, "-1.5k")])
def test_format_rate(rate, want):
  assert format_rate(rate) == want


def test_non_tty_line_contents_and_eta():
  out, clock = io.StringIO(), FakeClock()
  bar = ProgressBar(100, stream=out, clock=clock)
  clock.now += 12 * 2.0  # 12 steps at 2 s each: 88 left -> 176 s.
  bar.update(12, reward=0.4312, tokens_per_s=1234.0)
  bar.close()
  assert out.getvalue() == "step 12/100  reward 0.431  1.2k tok/s  ETA 2m56s\n"


def test_resumed_run_eta_counts_only_this_process():
  out, clock = io.StringIO(), FakeClock()
  bar = ProgressBar(100, start_step=90, stream=out, clock=clock)
  clock.now += 2 * 5.0  # 2 steps here at 5 s each: 8 left -> 40 s.
  bar.update(92)
  assert out.getvalue() == "step 92/100  ETA 40s\n"


def test_non_tty_throttles_but_keeps_first_and_last():
  out, clock = io.StringIO(), FakeClock()
  bar = ProgressBar(10, stream=out, min_interval_s=1.0, clock=clock)
  for step in range(1, 11):
    clock.now += 0.3
    bar.update(step, reward=1.0)
  bar.close()
  lines = out.getvalue().splitlines()
  steps = [int(line.split()[1].split("/")[0]) for line in lines]
  assert steps[0] == 1 and steps[-1] == 10
  assert len(steps) < 10
  assert "\r" not in out.getvalue()
  assert lines[-1].endswith("ETA 0s")


def test_close_shows_throttled_last_update():
  out, clock = io.StringIO(), FakeClock()
  bar = ProgressBar(100, stream=out, min_interval_s=10.0, clock=clock)
  bar.update(1)
  clock.now += 1.0
  bar.update(2)
  assert "step 2/100" not in out.getvalue()
  bar.close()
  bar.close()  # Idempotent.
  assert out.getvalue().splitlines()[-1].startswith("step 2/100")


def test_write_on_non_tty_is_a_plain_line_and_eta_unknown_before_a_step():
  out = io.StringIO()
  bar = ProgressBar(5, start_step=1, stream=out, clock=FakeClock())
  bar.update(1)
  bar.write("saved checkpoint")
  assert out.getvalue().splitlines() == ["step 1/5  ETA ?", "saved checkpoint"]


def test_tty_redraws_in_place_and_message_keeps_bar():
  out, clock = FakeTTY(), FakeClock()
  bar = ProgressBar(3, stream=out, min_interval_s=0.0, clock=clock)
  clock.now += 1.0
  bar.update(1, reward=0.5)
  bar.write("hello")
  clock.now += 1.0
  bar.update(2)
  clock.now += 1.0
  bar.update(3)
  bar.close()
  text = out.getvalue()
  assert text.count("\n") == 2  # The message line and the final newline from close().
  assert "\rhello\n" in text
  segments = text.rstrip("\n").split("\r")
  assert segments[-1] == "step 3/3  ETA 0s"
  # Step 2's line is shorter than step 1's, so it is padded to cover it.
  step2 = next(seg for seg in segments if seg.startswith("step 2/3"))
  assert step2.rstrip() == "step 2/3  ETA 1s"
  assert len(step2) == len("step 1/3  reward 0.500  ETA 2s")


def test_label_names_what_is_counted():
  out = io.StringIO()
  bar = ProgressBar(40, stream=out, clock=FakeClock(), label="completions")
  bar.update(3)
  assert out.getvalue().startswith("completions 3/40  ")

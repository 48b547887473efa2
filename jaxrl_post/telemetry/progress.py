"""A one-line training progress display: step, reward, throughput and ETA.

On a terminal the line is redrawn in place with a carriage return. When the stream is a file
or a pipe (cluster logs, `nohup`), carriage returns would pile up into one huge line, so
full lines are printed instead, throttled so that logs stay short and readable.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO


def format_duration(seconds: float) -> str:
  """Formats a duration compactly: "45s", "3m12s", "1h02m" ("?" if unknown).

  Hours drop the seconds because an ETA that far out is not that precise.
  """
  if not math.isfinite(seconds):
    return "?"
  total = max(0, round(seconds))
  hours, rest = divmod(total, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def format_rate(value: float) -> str:
  """Formats a rate with an SI suffix: "950", "1.2k", "3.4M"."""
  if not math.isfinite(value):
    return str(value)
  sign = "-" if value < 0 else ""
  value = abs(value)
  if value < 999.5:
    return f"{sign}{value:.0f}"
  for suffix in "kMGT":
    value /= 1000.0
    if value < 999.95 or suffix == "T":
      return f"{sign}{value:.1f}{suffix}"
  raise AssertionError("unreachable")


class ProgressBar:
  """Shows "step 12/100  reward 0.431  1.2k tok/s  ETA 3m12s" while training runs.

  The ETA is the mean time per step since this bar was created times the steps left. Only
  steps done in this process count, so a run resumed at `start_step` does not look
  impossibly fast (or slow) because of steps finished before the restart.
  """

  def __init__(self, total_steps: int, start_step: int = 0, stream: TextIO | None = None,
               min_interval_s: float = 0.5, *, clock: Callable[[], float] = time.monotonic,
               label: str = "step"):
    """Creates the bar; nothing is printed until the first `update`.

    Args:
      total_steps: Step number at which training ends.
      start_step: Steps already done when this process started (a resumed run).
      stream: Where to draw; `sys.stderr` (looked up at call time, so redirection by test
        runners or loggers is honoured) when None.
      min_interval_s: Minimum time between draws, so fast steps do not flood the output.
      clock: Monotonic clock in seconds; tests pass a fake one.
      label: What is counted, shown before the count ("completions 3/40").
    """
    if total_steps < 0 or start_step < 0:
      raise ValueError(f"invalid progress range: start_step={start_step}, "
                       f"total_steps={total_steps}")
    self.total_steps = total_steps
    self.start_step = start_step
    self.min_interval_s = min_interval_s
    self.label = label
    self._stream = sys.stderr if stream is None else stream
    self._tty = _isatty(self._stream)
    self._clock = clock
    self._start_time = clock()
    self._last_draw: float | None = None
    self._text = ""  # Latest rendered status.
    self._on_screen = ""  # What the terminal line currently shows (TTY only).
    self._pending = False  # The latest status has not been shown yet.
    self._closed = False

  def update(self, step: int, reward: float | None = None,
             tokens_per_s: float | None = None) -> None:
    """Records that `step` steps are done and redraws if due.

    Draws the first update and the final step (`step >= total_steps`) unconditionally,
    other updates at most once per `min_interval_s`.

    Args:
      step: Number of completed steps.
      reward: Mean reward of the step, or None to omit it.
      tokens_per_s: Generation throughput, or None to omit it.
    """
    now = self._clock()
    self._text = self._render(step, reward, tokens_per_s, now)
    due = (self._last_draw is None or step >= self.total_steps
           or now - self._last_draw >= self.min_interval_s)
    if due:
      self._show(now)
    else:
      self._pending = True

  def write(self, message: str) -> None:
    """Prints a message on its own line, keeping the bar intact below it on a terminal."""
    if self._tty and self._on_screen:
      blank = " " * len(self._on_screen)
      self._stream.write(f"\r{blank}\r{message}\n{self._on_screen}")
    else:
      self._stream.write(message + "\n")
    self._stream.flush()

  def close(self) -> None:
    """Shows the latest status if a throttled update was not drawn, then ends the line."""
    if self._closed:
      return
    self._closed = True
    if self._pending:
      self._show(self._clock())
    if self._tty and self._on_screen:
      self._stream.write("\n")
      self._stream.flush()
      self._on_screen = ""

  def __enter__(self) -> ProgressBar:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _render(self, step: int, reward: float | None, tokens_per_s: float | None,
              now: float) -> str:
    parts = [f"{self.label} {step}/{self.total_steps}"]
    if reward is not None:
      parts.append(f"reward {reward:.3f}")
    if tokens_per_s is not None:
      parts.append(f"{format_rate(tokens_per_s)} tok/s")
    parts.append(f"ETA {format_duration(self._eta(step, now))}")
    return "  ".join(parts)

  def _eta(self, step: int, now: float) -> float:
    """Seconds left at the mean pace of this process's steps (inf before the first one)."""
    done_here = step - self.start_step
    if done_here <= 0:
      return math.inf
    seconds_per_step = (now - self._start_time) / done_here
    return seconds_per_step * max(0, self.total_steps - step)

  def _show(self, now: float) -> None:
    if self._tty:
      # Pad with spaces so a shorter line fully covers the previous one.
      padding = " " * max(0, len(self._on_screen) - len(self._text))
      self._stream.write(f"\r{self._text}{padding}")
      self._on_screen = self._text
    else:
      self._stream.write(self._text + "\n")
    self._stream.flush()
    self._last_draw = now
    self._pending = False


def _isatty(stream: TextIO) -> bool:
  """Whether `stream` is an open terminal; objects without `isatty` count as files."""
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # ValueError: the stream is closed.
    return False

"""Per-step wall-clock attribution to named roles (rollout, reward, train, ...).

A training step interleaves host work, device work and waiting. Timing each role separately,
and reporting what is left over as `time/waiting`, shows where a step's wall time goes
without a profiler: a large `time/waiting` means the host spends time in code that no role
covers (data loading, logging, checkpoint I/O, an unblocked async dispatch finishing later).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# Keys that `stop()` always emits; a role with one of these names would be overwritten.
_RESERVED_ROLES = frozenset({"waiting", "step"})


class StepTimer:
  """Accumulates the wall time of named roles within one training step.

  Usage:

    timer.start()
    with timer.role("rollout"):
      ...
    with timer.role("train"):
      ...
    metrics.update(timer.stop())

  A role may be entered several times per step; its times add up. Entering a role that is
  already open is an error, because the inner time would be counted twice. Different roles
  may nest, but then both count the inner block and `time/waiting` can clamp at zero, so
  prefer disjoint roles.
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    """Creates an idle timer.

    Args:
      clock: Monotonic clock in seconds; `time.perf_counter` by default because it has the
        finest resolution. Tests pass a fake clock to make the arithmetic exact.
    """
    self._clock = clock
    self._step_start: float | None = None
    self._totals: dict[str, float] = {}
    self._open: set[str] = set()
    # (role, begin, end) on `clock`, in the order the blocks ended: the step's timeline.
    self.spans: list[tuple[str, float, float]] = []
    self.step_span: tuple[float, float] | None = None  # The last step's (begin, end).

  @property
  def running(self) -> bool:
    """Whether a step is in progress (between `start()` and `stop()`)."""
    return self._step_start is not None

  def start(self) -> None:
    """Begins a step, forgetting the role times of the previous one.

    Raises:
      RuntimeError: If a step is already in progress, since silently restarting it would
        drop the time measured so far.
    """
    if self.running:
      raise RuntimeError("StepTimer.start() called twice without stop()")
    self._totals = {}
    self._open = set()
    self.spans = []
    self._step_start = self._clock()

  @contextlib.contextmanager
  def role(self, name: str) -> Iterator[None]:
    """Adds the wall time of the enclosed block to role `name`.

    The time is recorded even if the block raises, so a failing step still reports where
    its time went.

    Args:
      name: Role name; reported as `time/<name>`.

    Raises:
      RuntimeError: If no step is in progress or the role is already open (nested use of the
        same role would double-count).
      ValueError: If `name` is empty or collides with a key `stop()` always emits.
    """
    self._check_role(name)
    self._open.add(name)
    begin = self._clock()
    try:
      yield
    finally:
      end = self._clock()
      self._totals[name] = self._totals.get(name, 0.0) + end - begin
      self.spans.append((name, begin, end))
      self._open.discard(name)

  def stop(self) -> dict[str, float]:
    """Ends the step and returns its timings in seconds.

    Returns:
      `{"time/<role>": ..., "time/waiting": ..., "time/step": ...}` with one entry per role
      used in this step. `time/waiting` is the step time not attributed to any role, clamped
      at zero (nested roles can make the roles' sum exceed the step time).

    Raises:
      RuntimeError: If no step is in progress or a role block is still open, because its
        time would be missing from the result.
    """
    if not self.running:
      raise RuntimeError("StepTimer.stop() called without start()")
    if self._open:
      raise RuntimeError(f"StepTimer.stop() called inside role(s) {sorted(self._open)}")
    end = self._clock()
    total = end - self._step_start
    self.step_span = (self._step_start, end)
    self._step_start = None
    result = {f"time/{name}": seconds for name, seconds in self._totals.items()}
    result["time/waiting"] = max(0.0, total - sum(self._totals.values()))
    result["time/step"] = total
    return result

  def _check_role(self, name: str) -> None:
    """Rejects role names and states that would produce wrong timings."""
    if not name:
      raise ValueError("StepTimer role name must be non-empty")
    if name in _RESERVED_ROLES:
      raise ValueError(f"StepTimer role name {name!r} is reserved")
    if not self.running:
      raise RuntimeError(f"StepTimer.role({name!r}) used outside start()/stop()")
    if name in self._open:
      raise RuntimeError(f"StepTimer.role({name!r}) entered while already open")
